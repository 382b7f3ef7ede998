"""Smoke tests of the benchmark scripts (tiny sizes; no timing is checked).

The scripts under benchmarks/ are not a package; they are loaded from their
files. Speed figures come from running the scripts, never from these tests.
"""

import importlib.util
import json
import math
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks")


def _load(name):
  if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)  # The scripts import `common` and each other.
  module_name = f"_benchmarks_{name}_under_test"
  if module_name in sys.modules:
    return sys.modules[module_name]
  spec = importlib.util.spec_from_file_location(module_name,
                                                os.path.join(BENCH_DIR, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module  # dataclasses look their module up here.
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def plot_results():
  return _load("plot_results")


def test_bench_transformer_quick(tmp_path):
  bt = _load("bench_transformer")
  arms = ["bf16", "fp8_current"]
  payload = bt.main(["--quick", "--arms", *arms, "--steps", "6", "--reps", "2",
                     "--warmup", "1", "--val-points", "1", "--out-dir", str(tmp_path)])
  json_files = list(tmp_path.glob("*-transformer.json"))
  assert len(json_files) == 1
  if payload["env"]["platform"] == "cpu":
    assert json_files[0].name == "cpu-transformer.json"
  saved = json.loads(json_files[0].read_text())
  assert set(saved["timing"]["arms"]) == set(arms)
  assert set(saved["parity"]["arms"]) == set(arms)
  for row in saved["timing"]["arms"].values():
    assert math.isfinite(row["ratio_vs_bf16"]) and row["ratio_vs_bf16"] > 0
    assert row["runs"] == 2
  assert saved["timing"]["arms"]["bf16"]["ratio_vs_bf16"] == 1.0
  cmp = saved["parity"]["vs_baseline"]["fp8_current"]
  for key in ("final_train_loss_ratio", "val_loss_ratio", "final_train_loss_diff",
              "val_loss_diff"):
    assert math.isfinite(cmp[key]), key
  for arm in saved["parity"]["arms"].values():
    assert len(arm["train_loss"]) == 6 and arm["finite"]
  assert json_files[0].with_suffix(".png").exists()


def _dense_row(size, arms):
  base = 10.0
  return {"M=K=N": size, "arms": {
      name: {"median_ms": base * r, "min_ms": base * r * 0.9, "max_ms": base * r * 1.2,
             "ratio_vs_bf16_dense": r, "residual_ratio_vs_bf16_dense": res}
      for name, (r, res) in arms.items()}}


def test_plot_results_dense(tmp_path, plot_results, capsys):
  arms = {"bf16_dense": (1.0, 1.0), "qdense_delayed": (1.1, 0.5), "flax_fp8_direct": (1.3, 0.75)}
  payload = {"env": {"device_kind": "cpu", "jax": "x", "flax": "y"},
             "results": [_dense_row(512, arms), _dense_row(1024, arms),
                         _dense_row("8192x4096x14336", arms)]}
  (tmp_path / "cpu-dense.json").write_text(json.dumps(payload))
  written = plot_results.main(["--device", "cpu", "--results-dir", str(tmp_path)])
  assert written == [str(tmp_path / "cpu-dense.png")]
  assert (tmp_path / "cpu-dense.png").stat().st_size > 0
  out = capsys.readouterr().out
  assert "skip recipes" in out and "skip transformer" in out

  series = plot_results.dense_series(payload)
  assert series["sizes"] == ["512", "1024", "8192x4096x14336"]
  assert series["arms"]["qdense_delayed"]["lo"] == pytest.approx([0.99] * 3)


def test_run_all_quick_keeps_results(tmp_path):
  run_all = _load("run_all")
  jobs = {j.name: j for j in run_all.plan("cpu", "cpu", quick=True, quick_dir=str(tmp_path))}
  assert tuple(jobs) == run_all.ORDER
  # Only the scripts that cannot redirect their output write into results/.
  assert {n for n, j in jobs.items() if j.fixed_outputs} == {"bench_dense", "bench_layers"}
  assert "--quick" in jobs["bench_transformer"].args

  # A quick run's file goes to the scratch folder; the measured one comes back.
  results = tmp_path / "results"
  scratch = tmp_path / "scratch"
  results.mkdir()
  scratch.mkdir()
  kept, fresh = results / "cpu-dense.json", results / "cpu-layers.json"
  kept.write_text("measured")
  saved = run_all._snapshot([str(kept), str(fresh)])
  kept.write_text("quick")
  fresh.write_text("quick")
  moved = run_all._divert(saved, str(scratch))
  assert kept.read_text() == "measured" and not fresh.exists()
  assert sorted(os.path.basename(m) for m in moved) == ["cpu-dense.json", "cpu-layers.json"]
  assert (scratch / "cpu-dense.json").read_text() == "quick"
