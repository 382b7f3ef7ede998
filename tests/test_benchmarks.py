"""Smoke tests of the benchmark scripts (tiny sizes; no timing is checked).

The scripts under benchmarks/ are not a package; they are loaded from their
files. Speed figures come from running the scripts, never from these tests.
"""

import contextlib
import copy
import importlib.util
import io
import json
import math
import os
import pathlib
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
  assert "--quick" in jobs["bench_transformer"].args
  # A quick run's figures are not to be quoted: every script writes to the
  # scratch folder, none into benchmarks/results/.
  for name, job in jobs.items():
    if name == "plot_results":
      assert job.args[job.args.index("--results-dir") + 1] == str(tmp_path)
    elif name in ("bench_recipes", "bench_int_qat", "qat_digits"):
      assert job.args[job.args.index("--out") + 1].startswith(str(tmp_path)), name
    else:
      assert job.args[job.args.index("--out-dir") + 1] == str(tmp_path), name
    assert all(o.startswith(str(tmp_path)) for o in job.outputs), name
  full = {j.name: j for j in run_all.plan("cpu", "cpu", quick=False, quick_dir="")}
  assert full["bench_h100_compile"].outputs == (
      os.path.join(run_all.RESULTS_DIR, "h100-compile.json"),)


def test_timed_step_keeps_three_fp8_products_per_layer(require_target):
  # The step every timing benchmark runs must keep forward, dgrad and wgrad: a
  # step returning only the variables' gradients compiles to 1 product per layer.
  require_target("h100")
  import jax
  import jax.numpy as jnp
  import optax

  import fp8_linen as fl
  from fp8_linen.testing.compile import compile_for
  common = _load("common")
  model = fl.QDense(128, dtype=jnp.bfloat16)
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  with fl.target_backend("gpu"):
    state = jax.eval_shape(
        lambda: fl.TrainState.create(apply_fn=model.apply, tx=optax.sgd(1e-3), params=model.init(
            jax.random.key(0), jnp.zeros(x.shape, x.dtype))))
  report = compile_for("h100", common.make_train_step(model), state, x,
                       jax.ShapeDtypeStruct((64, 128), jnp.bfloat16))
  assert (report.fp8_gemms, report.gemms) == (3, 3), report.summary()


def test_bench_int_qat_tiny(tmp_path):
  # The integer arms keep int8 codes (STE) for the backward: half of bf16's
  # residual bytes; qwix and AQT run in the same process when installed.
  b = _load("bench_int_qat")
  out = tmp_path / "int.json"
  payload = b.main(["--sizes", "64", "--runs", "1", "--warmup", "1", "--out", str(out)])
  rows = payload["results"]["64"]
  assert rows["bf16_dense"]["ratio_vs_bf16"] == 1.0
  assert rows["int8_ste"]["residual_ratio_vs_bf16"] == pytest.approx(0.5, abs=0.02)
  assert rows["int8_ste_s8gemm"]["residual_ratio_vs_bf16"] == pytest.approx(0.5, abs=0.02)
  assert set(rows) >= {"qwix_int8", "aqt_int8", "int8_lsq", "int4_lsq_plus"}
  assert json.loads(out.read_text())["meta"]["device"]


def test_qlora_memory_tiny(tmp_path):
  q = _load("qlora_memory")
  out = tmp_path / "qlora.json"
  rows = q.main(["--d", "128", "--layers", "2", "--tokens", "8", "--rank", "2", "--no-h100",
                 "--out", str(out)])["results"]
  # The frozen int4 base: a quarter of bf16's bytes plus its scales; the backward keeps codes.
  assert rows["qlora_int4_channel"]["base_ratio_vs_bf16"] < 0.3
  assert rows["qlora_int4_channel"]["weight_residual_dtypes"] == ["i4"]
  assert rows["qlora_fp8_delayed"]["weight_residual_dtypes"] == ["f8_e4m3fn"]
  assert rows["bf16_lora"]["weight_residual_dtypes"] == ["bf16"]
  assert json.loads(out.read_text())["meta"]["device"]


def test_bench_passes_tiny(tmp_path, require_target):
  require_target("h100")
  bp = _load("bench_passes")
  out = tmp_path / "passes.json"
  rows = bp.main(["--m", "128", "--k", "64", "--n", "64", "--targets", "h100", "--out",
                  str(out)])["results"]["h100"]
  assert rows["bf16"]["vs_bf16"] == 1.0
  # An fp8 step writes fp8 codes in passes of its own; every kernel is listed with a purpose.
  assert any("cast to fp8" in k["purpose"] for k in rows["fp8_delayed"]["kernels"])
  assert rows["fp8_delayed"]["non_gemm_bytes"] > rows["bf16"]["non_gemm_bytes"]
  assert json.loads(out.read_text())["meta"]["device"] == "estimate (compile only)"


def test_bench_accumulate_tiny(tmp_path, require_target):
  require_target("h100")
  ba = _load("bench_accumulate")
  out = tmp_path / "accumulate.json"
  payload = ba.main(["--d", "64", "--tokens", "32", "--micro", "2", "--targets", "h100",
                     "--out", str(out)])
  rows = payload["results"]["h100"]
  assert set(rows) == {f"{a}{h}" for a in ("bf16", "fp8_delayed", "fp8_current")
                       for h in ("", "_hoisted")}
  assert rows["bf16"]["vs_bf16"] == 1.0
  # Once per window moves fewer bytes than once per micro-batch.
  assert rows["fp8_delayed_hoisted"]["non_gemm_bytes"] < rows["fp8_delayed"]["non_gemm_bytes"]
  # Under optax.MultiSteps a cached call moves fewer bytes than a plain one, and multiplies
  # the same dtypes; the cache's own program multiplies nothing.
  steps = payload["multisteps"]["h100"]
  assert set(steps) == {"bf16", "fp8_delayed", "fp8_current"}
  for arms in steps.values():
    assert arms["cached"]["non_gemm_bytes"] < arms["plain"]["non_gemm_bytes"]
    assert arms["cached"]["products"] == arms["plain"]["products"]
    assert arms["prologue"]["products"] == [] and arms["cache_bytes"] > 0
  assert json.loads(out.read_text())["meta"]["device"] == "estimate (compile only)"


def test_bench_accumulate_measure_times_every_arm(tmp_path):
  ba = _load("bench_accumulate")
  out = tmp_path / "accumulate.json"
  rows = ba.main(["--measure", "--d", "32", "--tokens", "16", "--micro", "2", "--reps", "1",
                  "--out", str(out)])["results"]
  assert set(rows) == {f"{a}{h}" for a in ("bf16", "fp8_delayed", "fp8_current")
                       for h in ("", "_hoisted")}
  assert all(r["median_ms"] > 0 for r in rows.values()) and rows["bf16"]["vs_bf16"] == 1.0
  assert json.loads(out.read_text())["meta"]["device"] == "cpu"


def test_bench_grouped_gemm_tiny(tmp_path, require_target):
  require_target("h100")
  bg = _load("bench_grouped_gemm")
  out = tmp_path / "grouped.json"
  rows = bg.main(["--rows", "256", "--k", "128", "--n", "128", "--experts", "4", "--targets",
                  "h100", "--arms", "bf16", "fp8_xla", "fp8", "--out", str(out)])["results"]["h100"]
  # XLA multiplies every routed row by all 4 experts; the kernels by its own only.
  assert rows["fp8"]["gflops"] == pytest.approx(rows["fp8_xla"]["gflops"] / 4)
  assert {p["kind"] for p in rows["fp8"]["products"]} == {"pallas-grouped-gemm"}
  assert rows["fp8_xla"]["classes"] == {"fp8": 3}
  assert "| h100 | fp8 |" in bg.markdown(json.loads(out.read_text()))
  assert json.loads(out.read_text())["meta"]["device"] == "estimate (compile only)"


def test_bench_dense_tiny(tmp_path):
  bd = _load("bench_dense")
  payload = bd.main(["--sizes", "64", "--reps", "2", "--out-dir", str(tmp_path)])
  (row,) = payload["results"]
  arms = row["arms"]
  assert set(arms) >= {"bf16_dense", "f32_dense", "flax_fp8_direct", "qdense_delayed"}
  assert arms["bf16_dense"]["ratio_vs_bf16_dense"] == 1.0
  # QDense keeps only the fp8 copies of x and the kernel: half of bf16's residuals.
  assert arms["qdense_delayed"]["residual_ratio_vs_bf16_dense"] == pytest.approx(0.5, abs=0.02)
  assert arms["qdense_delayed"]["memory"]["temp_size_in_bytes"] > 0
  assert list(tmp_path.glob("*-dense.json"))


def test_bench_h100_compile_quick(tmp_path, require_target):
  require_target("h100")
  bh = _load("bench_h100_compile")
  payload = bh.main(["--quick", "--only", "mlp", "--out-dir", str(tmp_path)])
  saved = json.loads((tmp_path / "h100-compile.json").read_text())
  assert saved["device"] == "H100 (compile only)"
  layers = payload["sizes"]["layers"]
  arms = saved["results"]["mlp"]["arms"]
  assert arms["bf16_dense"]["fp8_products"] == 0
  assert arms["bf16_dense"]["products"] == 3 * layers
  for name in ("qdense_delayed", "qdense_current", "flax_fp8_direct"):
    assert arms[name]["fp8_products"] == arms[name]["products"] == 3 * layers, name
    assert arms[name]["as_expected"]
  for row in arms.values():
    assert row["temp_size_in_bytes"] > 0 and row["argument_size_in_bytes"] > 0


def test_scripts_import_only_the_public_api():
  # Benchmarks measure what users get: fp8_linen's public names, the deviceless
  # compile, and the shared helpers in common.py (bench_transformer also runs
  # the main job's model, fp8_linen_job).
  import ast
  allowed_ours = {"fp8_linen", "fp8_linen.testing", *(f"fp8_linen.testing.{m}" for m in (
      "hlo", "hlo_products", "hlo_collectives", "hlo_kernels", "estimate", "targets",
      "train_step", "compile", "passes", "cases", "collectives")),
                  "fp8_linen_job", "common", "plot_results"}
  for path in sorted(pathlib.Path(BENCH_DIR).glob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module + ("." + a.name if node.module == "fp8_linen.testing" else "")
                 for a in node.names]
      else:
        continue
      for name in names:
        if name.split(".")[0] in ("fp8_linen", "fp8_linen_job", "common", "plot_results"):
          ok = name in allowed_ours or name.startswith("fp8_linen_job.")
          # The kernels' own benchmarks run them against their references (jnp, or XLA's
          # grouped GEMM and bf16 in the same kernels): both internal.
          ok = ok or (path.name in ("bench_kernels_gpu.py", "bench_grouped_gemm.py",
                                    "bench_grouped_gpu.py")
                      and name == "fp8_linen.core")
          assert ok, f"{path.name} imports {name}"
      # Only the scripts that measure the job's own models may import the job.
      if path.name not in ("bench_transformer.py", "bench_block_quality.py", "from_float.py",
                           "sensitivity_lm.py", "bench_moe_quality.py"):
        assert not any(n.startswith("fp8_linen_job") for n in names), path.name


def test_bench_collectives_quick(tmp_path, capsys):
  bc = _load("bench_collectives")
  out = tmp_path / "collectives.json"
  payload = bc.main(["--quick", "--markdown", "--out", str(out)])
  saved = json.loads(out.read_text())
  rows = saved["meshes"]["cpu"]["rows"]
  assert saved["meshes"]["cpu"]["device"] == "CPU (8 virtual devices)"
  assert {(r["depth"], r["arm"]) for r in rows} == {
      (d, a) for d in (2, 4) for a in ("bf16", "fp8_delayed", "fp8_current", "int8")}
  assert payload["goals_missed"] == [] and saved["goals_missed"] == []
  delayed = [r for r in rows if r["arm"] == "fp8_delayed"]
  assert all(1 <= r["state_all_reduces"] <= 2 for r in delayed)
  assert all(r["first_step_only"]["all-reduce"]["count"] > 0 for r in delayed)
  assert "| CPU (8 virtual devices) | 4 | int8 |" in capsys.readouterr().out


def test_bench_serving_quick(tmp_path):
  bs = _load("bench_serving")
  payload = bs.main(["--quick", "--reps", "2", "--warmup", "1", "--no-h100",
                     "--out-dir", str(tmp_path)])
  saved = json.loads((tmp_path / f"{payload['env']['platform']}-serving.json").read_text())
  assert saved["device"] == ("CPU" if payload["env"]["platform"] == "cpu" else saved["device"])
  rows = saved["results"]["batch_8"]
  assert set(rows) == {"f32", "bf16", "int8", "int8_s8gemm", "int4", "fp8"}
  assert all(r["median_ms"] > 0 for r in rows.values())
  assert rows["int8_s8gemm"]["cpu_dots"] == ["s8 x s8 -> s32"] * 2
  # The served weights are a quarter (int8, fp8) and an eighth (int4) of f32's, plus scales
  # (int4 LSQ+ also keeps an int32 column sum of its codes per output channel).
  for name, bound in (("int8", 0.3), ("fp8", 0.3), ("int4", 0.18)):
    assert rows[name]["weight_bytes"] < bound * rows["f32"]["weight_bytes"], name


def test_bench_block_quality_quick(tmp_path):
  bq = _load("bench_block_quality")
  out = tmp_path / "cpu-block-quality.json"
  bq.main(["--quick", "--arms", "bf16", "nvfp4", "nvfp4_tail_mxfp8", "--seeds", "0",
           "--lengths", "1", "--eval-batches", "2", "--val-points", "1", "--tail-fraction",
           "0.3", "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["seeds"] == [0] and saved["lengths_steps"] == [10]
  rows = saved["summary"]["10_steps"]
  assert set(rows) == {"bf16", "nvfp4", "nvfp4_tail_mxfp8"}
  assert rows["nvfp4"]["target_excess"] == 0.015 and "meets_target" in rows["nvfp4"]
  assert len(rows["nvfp4"]["ratio_vs_bf16_per_seed"]) == 1
  assert len(saved["runs"]) == 3 and all(r["finite"] for r in saved["runs"])
  # The NVFP4 arm keeps the last block's MLP in bf16 by rule.
  nv = [r for r in saved["runs"] if r["arm"] == "nvfp4"][0]
  assert "block1/mlp" in nv["rules"] and "float4_e2m1fn" in nv["recipe"]
  # The tail arm ran its last 3 of 10 steps in MXFP8, and was evaluated both ways.
  tail = [r for r in saved["runs"] if r["arm"] == "nvfp4_tail_mxfp8"]
  assert all(r["tail"] == "mxfp8" and r["tail_from_step"] == 7 for r in tail)
  assert all(r["val_loss_own_recipe"] != r["val_loss"] for r in tail)
  assert "| nvfp4_tail_mxfp8 | 10 | 7 |" in bq.own_recipe_markdown(saved)
  # Partial runs merge into one table: a second file's seeds join the first's.
  other = dict(saved, runs=[dict(r, seed=r["seed"] + 10) for r in saved["runs"]])
  (tmp_path / "more.json").write_text(json.dumps(other))
  merged = bq.merge([str(out), str(tmp_path / "more.json")])
  assert merged["seeds"] == [0, 10]
  assert merged["summary"]["10_steps"]["nvfp4"]["seeds"] == [0, 10]
  assert len(merged["summary"]["10_steps"]["nvfp4"]["ratio_vs_bf16_per_seed"]) == 2
  table = bq.markdown(merged).splitlines()
  assert table[0].startswith("| arm | 10 steps: val loss (vs bf16) |")
  assert table[5].startswith("| nvfp4 | ") and table[5].endswith("[2] | within 1.5% |")


def test_bench_moe_quality_quick(tmp_path):
  bm = _load("bench_moe_quality")
  out, base = tmp_path / "moe.json", tmp_path / "bf16.json"
  bm.main(["--quick", "--seeds", "0", "--arms", "fp8", "int8", "--out", str(out)])
  runs = {r["arm"]: r for r in json.loads(out.read_text())["runs"]}
  assert set(runs) == {"fp8", "int8"} and all(r["finite"] for r in runs.values())
  # Per block: two expert grouped GEMMs and the two attention projections; the routers
  # and the head kept (the attention math is jax.nn.dot_product_attention's own).
  for arm in ("fp8", "int8"):
    assert runs[arm]["products"]["quantized"] == 8 and runs[arm]["products"]["excluded"] == 3
  # A later run of another arm merges into the same table.
  bm.main(["--quick", "--seeds", "0", "--arms", "bf16", "--out", str(base)])
  merged = bm.main(["--merge", str(out), str(base), "--out", str(tmp_path / "all.json")])
  assert set(merged["summary"]) == {"bf16", "fp8", "int8"}
  bf16 = merged["summary"]["bf16"]["val_loss"]
  assert all(merged["summary"][a]["val_loss"] != bf16 for a in ("fp8", "int8"))
  assert merged["summary"]["fp8"]["excess_vs_bf16"] is not None
  assert bm.markdown(merged).splitlines()[3].startswith("| `fp8` |")


def test_estimate_vs_published_quick(tmp_path, require_target):
  require_target("b200")
  ev = _load("estimate_vs_published")
  out = tmp_path / "evp.json"
  payload = ev.main(["--te-shape", "256", "256", "512", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert rows == json.loads(json.dumps(payload["rows"]))
  h200 = [r for r in rows if r["device"] == "H200"]
  assert {r["arm"] for r in h200} >= {"bf16", "flax fp8 op", "fp8 delayed"}
  for r in h200:
    # The roofline is a lower bound; calibration arms are fitted exactly; our own arms are
    # predicted out of sample by the per-class GEMM efficiency, within 10% here.
    assert r["roofline_ms"] < r["measured_ms"]
    if r["calibration"]:
      assert abs(r["predicted_ms"] - r["measured_ms"]) < 1e-6 * r["measured_ms"]
    else:
      assert abs(r["predicted_ms"] / r["measured_ms"] - 1) < 0.1, r
  te = {r["arm"]: r for r in rows if r["device"].startswith("GB200")}
  assert te["bf16"]["measured_ms"] == 18.06 and te["mxfp8"]["measured_ms"] == 11.26
  assert te["mxfp8"]["products"] == {"fp8": 3}  # cuDNN block-scaled dots of fp8 codes


def test_estimate_vs_published_takes_the_latest_run_of_a_shape(tmp_path):
  """A shape timed again in a later session replaces its earlier row (one row per arm)."""
  ev = _load("estimate_vs_published")

  def arm(ms, cls):
    return {"median_ms": ms, "estimate": {"ms": ms / 2, "product_ms": ms / 4,
                                          "flops_by_class": {cls: 1}}}

  def run(delayed_ms):
    return {"shape_MKN": [8, 8, 8], "arms": {
        "bf16_dense": arm(40.0, "bf16"), "flax_fp8_direct": arm(24.0, "fp8"),
        "qdense_delayed": arm(delayed_ms, "fp8")}}

  path = tmp_path / "h200.json"
  path.write_text(json.dumps({"results": [run(24.5), run(25.3)]}))
  rows, etas = ev.h200_rows(str(path))
  assert sorted(r["arm"] for r in rows) == ["bf16", "flax fp8 op", "fp8 delayed"]
  (delayed,) = [r for r in rows if r["arm"] == "fp8 delayed"]
  assert delayed["measured_ms"] == 25.3
  assert delayed["measured_ratio"] == pytest.approx(25.3 / 40.0)
  assert list(etas) == [(8, 8, 8)]


def test_bench_targets_quick(tmp_path, capsys, require_target):
  require_target("b200")
  bt = _load("bench_targets")
  out = tmp_path / "estimate-targets.json"
  payload = bt.main(["--quick", "--widths", "256", "--targets", "b200",
                     "--arms", "bf16", "nvfp4", "--loss", "mse", "--out", str(out)])
  saved = json.loads(out.read_text())
  assert saved["device"] == "estimate (compile only)" and saved["measured"] is None
  assert saved["complete"] and saved["model"]["loss"] == "0.5 * sum((y - r)^2)"
  rows = saved["results"]["b200"]["256"]
  assert set(rows) == {"bf16", "nvfp4"}
  assert rows["bf16"]["ratio_vs_bf16"] == 1.0 and rows["bf16"]["low_precision_products"] == 0
  # The block's projections: 4 GEMMs x 3 products each, block-scaled dots on B200 (the
  # README cells prove the fp8 block's cuBLASLt GEMMs: tests/targets/test_readme_tables.py).
  assert rows["nvfp4"]["by_kind"].get("cuDNN block-scaled", 0) >= 12
  for row in rows.values():
    assert row["estimate_ms"] > 0 and 0 <= row["low_precision_share"] <= 1
  assert "no GPU or TPU found" in capsys.readouterr().out
  table = bt.tables(payload).splitlines()
  assert table[0] == "| recipe | B200 |"
  assert any(l.startswith("| NVFP4 | ") for l in table)


def test_bench_gpu_smoke(tmp_path):
  # The script a lent GPU runs: here (CPU) it must run end to end with its tiny shapes.
  bg = _load("bench_gpu")
  payload = bg.main(["--smoke", "--loss", "mse", "--out-dir", str(tmp_path)])
  saved = json.loads((tmp_path / f"{bg.common.device_name()}-gpu-smoke.json").read_text())
  assert saved["complete"] and not saved["skipped"]
  assert saved["step"].startswith("jit(loss = 0.5 * sum((y - r)^2)")
  assert {r["loss"] for r in saved["results"]} == {"mse"}
  assert [r["label"] for r in saved["results"]] == [s for s, _ in bg.SMOKE_SHAPES]
  for res in saved["results"]:
    assert set(res["arms"]) == set(bg.ARMS)
    for arm, row in res["arms"].items():
      assert "error" not in row and row["runs"] == 2
      # fl.split_first_step's program holds the step twice, a branch each.
      assert row["products"]["products"] == (6 if arm in bg.SPLIT_ARMS else 3)
      assert math.isfinite(row["ratio_vs_bf16"])
      assert math.isfinite(row["estimate"]["ratio_vs_bf16"])
    assert res["arms"]["bf16_dense"]["ratio_vs_bf16"] == 1.0
  if payload["env"]["platform"] == "cpu":  # no peaks of its own: the H200's run the code path
    assert saved["estimate"]["peaks_name"] == "h200" and saved["checks"] == []


def test_bench_kernels_gpu_smoke(tmp_path):
  # The kernels' GPU check, here in Pallas' interpreter: every case runs and is bit-exact.
  bk = _load("bench_kernels_gpu")
  bk.main(["--smoke", "--out-dir", str(tmp_path)])
  saved = json.loads((tmp_path / f"{bk.common.device_name()}-kernels-gpu-smoke.json").read_text())
  assert len(saved["cases"]) == 6
  for case, row in saved["cases"].items():
    assert "error" not in row, (case, row)
    assert row["bit_exact"] and not any(row["differing_elements"]), case
  # The sweep's other tiles give the same bits, and the library's launch table is left as it was.
  launch = copy.deepcopy(bk.block_kernels._LAUNCH)  # pylint: disable=protected-access
  bk.main(["--smoke", "--sweep", "--out-dir", str(tmp_path)])
  assert bk.block_kernels._LAUNCH == launch  # pylint: disable=protected-access
  saved = json.loads((tmp_path / f"{bk.common.device_name()}-kernels-sweep-smoke.json").read_text())
  assert len(saved["cases"]) == 4  # the MX and weight-tile kernels
  for case, row in saved["cases"].items():
    (r,) = row["rows"]
    assert r["bit_exact"] and tuple(r["launch"]["tile"]) != launch[row["kernels"][0]]["tile"], case


def test_bench_grouped_gpu_smoke(tmp_path):
  # The grouped kernels' GPU run, here in Pallas' interpreter: the int8 step with and without
  # the kernels (and without their K-major copies) is the same bits, every kernel gives the
  # same output in both operand layouts, and the launch table is left as it was.
  bg = _load("bench_grouped_gpu")
  launch = copy.deepcopy(bg.grouped_kernels._LAUNCH)  # pylint: disable=protected-access
  policy = bg.grouped_kernels.contiguous_contraction
  bg.main(["--smoke", "--sections", "steps", "layouts", "--arms", "int8", "int8_xla",
           "int8_nmajor", "--layout-dtypes", "int8", "--out-dir", str(tmp_path)])
  assert bg.grouped_kernels._LAUNCH == launch  # pylint: disable=protected-access
  assert bg.grouped_kernels.contiguous_contraction is policy
  saved = json.loads((tmp_path / f"{bg.common.device_name()}-grouped-gpu-smoke.json").read_text())
  assert saved["complete"] and sum(saved["group_sizes"]) == saved["shape"]["rows"]
  arms = saved["steps"]["arms"]
  assert arms["int8"]["vs_int8_xla"]["bit_exact"] and arms["int8_nmajor"]["vs_int8"]["bit_exact"]
  assert arms["int8"]["products"]["by_kind_and_class"] != {}
  rows = saved["layouts"].values()
  assert not any("error" in r for r in rows)
  checked = [r for r in rows if any(k.startswith("max_rel_vs_") for k in r)]
  assert {r["form"] for r in checked} == {"fwd_kmajor", "wgrad_kmajor"}
  # Exact integer operands: the two layouts agree bit for bit.
  assert {r["dtype"] for r in rows} == {"int8"}
  for r in checked:
    assert [v for k, v in r.items() if k.startswith("max_rel_vs_")] == [0], r


def test_bench_targets_measure_only_times_on_this_machine(tmp_path):
  bt = _load("bench_targets")
  # One cheap arm: the compiles are the estimate's tests' business; this is the plumbing.
  payload = bt.main(["--measure-only", "--quick", "--widths", "64", "--arms", "bf16",
                     "--reps", "1", "--loss", "mse", "--optimizer", "adam",
                     "--out", str(tmp_path / "x.json")])
  (path,) = tmp_path.glob("*-targets-measured.json")
  saved = json.loads(path.read_text())
  assert saved["complete"] and payload["complete"] and saved["loss"] == "mse"
  assert saved["optimizer"] == "adam"  # each timed call updates the donated state
  rows = saved["widths"]["64"]
  assert set(rows) == {"bf16"}
  assert all(r["measured_ms"] > 0 for r in rows.values())


@pytest.mark.parametrize("optimizer", ["none", "sgd"])
def test_bench_targets_times_the_split_step(tmp_path, optimizer):
  """``fp8_delayed_split`` is timed through ``fl.split_first_step`` after one step has filled
  the histories (so the timed calls run its steady branch)."""
  bt = _load("bench_targets")
  bt.main(["--measure-only", "--quick", "--widths", "64", "--arms", "fp8_delayed_split",
           "--reps", "1", "--optimizer", optimizer, "--out", str(tmp_path / "x.json")])
  (path,) = tmp_path.glob("*-targets-measured.json")
  rows = json.loads(path.read_text())["widths"]["64"]
  assert set(rows) == {"bf16", "fp8_delayed_split"}
  assert all(r["measured_ms"] > 0 for r in rows.values())


def test_bench_targets_optimizer_step_keeps_the_products(require_target):
  """``--optimizer``: the step updates the parameters; it multiplies what the gradient step does."""
  require_target("h100")
  bt = _load("bench_targets")
  rows = {}
  for optimizer in ("none", "sgd"):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      bt.child("h100", 256, ["fp8_delayed"], True, "mse", optimizer)
    (rows[optimizer],) = [json.loads(l[4:]) for l in buf.getvalue().splitlines()
                          if l.startswith("ROW ")]
  assert rows["sgd"]["products"] == rows["none"]["products"] == {"bf16": 6, "fp8": 18}
  # The update reads the weights and writes them back: more bytes than returning gradients.
  assert rows["sgd"]["other_bytes"] != rows["none"]["other_bytes"]


def test_bench_gpu_peaks_follow_the_device_kind():
  bg = _load("bench_gpu")
  assert bg.peaks_for("NVIDIA H200", None)[0] == "h200"
  assert bg.peaks_for("NVIDIA H100 80GB HBM3", None)[0] == "h100"
  assert bg.peaks_for("cpu", "b200")[0] == "b200"
  assert bg.peaks_for("NVIDIA H200", None)[1].hbm == 4.8e12


# qwix 0.1.8 checks for flax's removed nnx.VariableState alias on every param it unboxes.
@pytest.mark.filterwarnings("ignore:'VariableState' was removed:DeprecationWarning")
def test_ptq_qwix_quick(tmp_path):
  # fl.ptq and qwix's PTQ from the same float params: the same formats give the same
  # bytes, int8 beats int4 in both, the same int4 grid gives the same logits, and each
  # w8a8 forward multiplies what it claims.
  pytest.importorskip("qwix")
  pq = _load("ptq_qwix")
  out = tmp_path / "cpu-ptq-qwix.json"
  payload = pq.main(["--quick", "--out", str(out)])
  saved = json.loads(out.read_text())
  if payload["env"]["platform"] == "cpu":
    assert saved["device"] == "CPU"
  assert saved["env"]["qwix"] and saved["env"]["jax"] and saved["env"]["flax"]
  arms = saved["arms"]
  assert set(arms) == {"float", *pq.QUICK_ARMS}
  for key in ("int8", "w8a8_static"):
    assert set(arms[key]) == {"fp8_linen", "qwix"}, key
  assert set(arms["int4"]) == {"fp8_linen", "qwix", pq.QWIX_OUR_GRID}
  assert set(arms["w8a8_dynamic"]) == {"qwix"}
  base = arms["float"]["float"]
  for key, rows in arms.items():
    for lib, r in rows.items():
      assert r["test_accuracy"] > 0.8, (key, lib)  # chance is 0.1
      assert r["timing"]["batch_397"]["runs"] == 1, (key, lib)
      assert math.isfinite(r["timing"]["batch_397"]["ratio_vs_float"]), (key, lib)
      assert len(r["cpu_dots"]) == 3, (key, lib)  # one product per Dense
      if key != "float":
        assert r["weight_bytes"] < 0.3 * base["weight_bytes"], (key, lib)
  for lib in ("fp8_linen", "qwix"):
    assert arms["int8"][lib]["logits_rel_err"] < 0.02, lib
    assert arms["int8"][lib]["logits_rel_err"] < arms["int4"][lib]["logits_rel_err"], lib
    assert arms["int4"][lib]["weight_bytes"] < arms["int8"][lib]["weight_bytes"], lib
    for key in ("int8", "int4"):  # weight-only: dequantized codes in a float dot
      assert set(arms[key][lib]["cpu_dots"]) == {"f32 x f32 -> f32"}, (key, lib)
  for key in ("int8", "int4"):  # the same codes, scales and biases: the same bytes
    assert arms[key]["fp8_linen"]["weight_bytes"] == arms[key]["qwix"]["weight_bytes"], key
  # qwix given fp8_linen's int4 grid (its range widened by 7.5/7) serves the same logits.
  ours, same_grid = arms["int4"]["fp8_linen"], arms["int4"][pq.QWIX_OUR_GRID]
  assert same_grid["logits_rel_err"] == pytest.approx(ours["logits_rel_err"], rel=1e-3)
  assert set(arms["w8a8_static"]["qwix"]["cpu_dots"]) == {"s8 x s8 -> s32"}
  assert set(arms["w8a8_dynamic"]["qwix"]["cpu_dots"]) == {"s8 x s8 -> s32"}
  assert set(arms["w8a8_static"]["fp8_linen"]["cpu_dots"]) <= {"s8 x s8 -> s32",
                                                                "bf16 x bf16 -> f32"}


def test_bench_wgrad_dtype_tiny(tmp_path, capsys):
  bw = _load("bench_wgrad_dtype")
  payload = bw.main(["--m", "64", "--k", "32", "--n", "64", "--reps", "2", "--out-dir",
                     str(tmp_path), "--optimizers", "none", "adam", "--loss", "mse"])
  arms = ("bf16", "fp8_bf16_wgrad", "fp8_f32_wgrad")
  assert set(payload["results"]) == {*arms, *(f"{a}+adam" for a in arms)}
  assert payload["results"]["bf16"]["vs_bf16"] == payload["results"]["bf16+adam"]["vs_bf16"] == 1.0
  assert payload["loss"] == "mse"
  # An optimizer arm trains: each call updates the donated weight, and the loss falls.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  w = jax.random.normal(jax.random.key(0), (32, 64), jnp.float32) * 0.1
  x = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
  r = jnp.zeros((64, 64), jnp.float32)
  run, _ = bw._step("fp8_f32_wgrad", "sgd", "mse", w, x, r)  # pylint: disable=protected-access
  losses = [float(run()[1]) for _ in range(3)]
  assert losses[2] < losses[1] < losses[0], losses
  # Off a GPU the hint does nothing, and the script says so rather than report a gain.
  assert "rhs_grad_dtype does nothing here" in capsys.readouterr().out
  assert list(tmp_path.glob("*-wgrad-dtype.json"))
  assert set(payload["compile_s"]) == set(payload["results"])  # every arm's first compile


def test_bench_compile_child_and_best_flags(tmp_path):
  """The child builds, traces and times the arms; ``best_flags`` keeps ``default``'s kernels."""
  bc = _load("bench_compile")
  assert bc.fold("fusion.12 (cublas-gemm.3)") == "fusion.# (cublas-gemm.#)"
  out = tmp_path / "child.json"
  bc.child("default", ["bf16_dense", "qdense_delayed"], bc.SHAPES["smoke"], reps=1, trace=True,
           out=str(out))
  row = json.loads(out.read_text())
  assert set(row["arms"]) == {"bf16_dense", "qdense_delayed"}
  for arm in row["arms"].values():
    assert arm["compile_s"] > 0 and arm["median_ms"] > 0
    names = [n for n, _, _ in arm["trace"]["by_name"]]
    assert names and not any(n.startswith("$") for n in names), names  # XLA's, not Python's
  assert row["arms"]["bf16_dense"]["ratio_vs_first"] == 1.0

  def run(flags, compile_s, ms, fp8_gemms=3):
    arms = {a: {"compile_s": compile_s if a != "bf16_dense" else 1.0, "median_ms": ms,
                "products": {"fp8_gemms": 0 if a == "bf16_dense" else fp8_gemms}}
            for a in bc.ARMS}
    return {"xla_flags": flags, "arms": arms}

  runs = {"default": run("", 100.0, 25.0), "autotune0": run("--a", 1.0, 250.0),
          "no_triton_gemm": run("--b", 20.0, 25.2)}
  assert bc.best_flags({"variants": runs}) == "--b"  # faster to compile, same kernels and speed
  runs["no_triton_gemm"] = run("--b", 20.0, 25.2, fp8_gemms=0)  # other kernels: not taken
  assert bc.best_flags({"variants": runs}) == ""


def test_bench_targets_names_why_a_child_crashed():
  """A compiler check that aborted the child is the reason given, not libtpu's hostname line,
  which every TPU compile here logs."""
  bt = _load("bench_targets")
  noise = ("E0000 common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname "
           "'WARNING: could not determine TPU worker hostnames'")
  check = "F1128 fusion_util.cc:3959] Check failed: chunk_counts[new_window_dim] == 1"
  assert bt._crash_reason("\n".join([noise, check, noise]), 134) == check
  assert bt._crash_reason("\n".join([noise, "RuntimeError: out of memory"]), 1) == (
      "RuntimeError: out of memory")
  assert bt._crash_reason(noise, 139) == "exit 139"


def test_bench_targets_floor_is_the_step_with_bf16s_non_gemm_time():
  """The headroom table's floor: the arm's GEMM time plus bf16's non-GEMM time, over bf16's step."""
  bt = _load("bench_targets")
  bf16 = {"estimate_ms": 10.0, "product_ms": 6.0, "ratio_vs_bf16": 1.0}
  # Quantized: GEMMs twice as fast, 1.5 ms more outside them than bf16 (5.5 vs 4.0).
  arm = {"estimate_ms": 8.5, "product_ms": 3.0, "ratio_vs_bf16": 0.85}
  assert bt.floor_ratio(bf16, arm) == pytest.approx(0.7)
  assert bt.floor_ratio(bf16, bf16) == pytest.approx(1.0)
  results = {"h100": {str(w): {"bf16": bf16, "fp8_delayed": arm} for w in (1024, 4096)}}
  rows = bt.floor_rows(results, [1024, 4096])
  assert rows[2] == "| H100 | fp8 delayed | 0.85 / 0.85 | 0.70 / 0.70 | 0.30 / 0.30 |"
  # A target whose cells are missing is left out, not printed with holes.
  assert len(rows) == 3
