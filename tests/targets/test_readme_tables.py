"""The accelerator tables of the README and docs/accelerators.md are what the programs show.

The "what it multiplies" table is compared cell by cell with the compiled
programs (``cli.markdown_cell``: it also fails a cell whose case does not
hold on that target). The estimate tables are compared with
``benchmarks/results/estimate-targets.json``, the file the benchmark wrote.
"""

import json
import pathlib
import re
import sys

import pytest

from fp8_linen.testing import cases, cli, targets

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "accelerators.md"]
CASES = {c.name: c for c in cases.cases()}
BY_DESCRIPTION = {t.description: t.name for t in targets.TARGETS.values()}


def _table_after(text: str, marker: str) -> list[list[str]]:
  """The rows (cells stripped) of the first markdown table after ``marker``."""
  rest = text[text.index(marker):]
  lines = [l for l in rest.splitlines()[1:] if l.strip()]
  rows = []
  for line in lines:
    if not line.startswith("|"):
      if rows:
        break
      continue
    rows.append([c.strip() for c in line.strip().strip("|").split("|")])
  return rows


def _accelerator_cells():
  out = []
  for page in PAGES:
    rows = _table_after(page.read_text(), "<!-- accelerators table")
    header, body = rows[0], rows[2:]
    for row in body:
      case = re.match(r"`([^`]+)`", row[0]).group(1)
      for description, cell in zip(header[1:], row[1:]):
        out.append((page.name, case, BY_DESCRIPTION[description], cell))
  return out


CELLS = _accelerator_cells()


def test_tables_cover_every_one_device_target():
  assert {t for _, _, t, _ in CELLS} == set(targets.SINGLE_DEVICE)
  assert {c for p, c, _, _ in CELLS if p == "accelerators.md"} == set(CASES)


@pytest.mark.parametrize("page,case,target,cell", CELLS,
                         ids=[f"{p}-{c}-{t}" for p, c, t, _ in CELLS])
def test_cell_is_what_the_compiled_program_multiplies(require_target, page, case, target, cell):
  del page
  require_target(target)
  assert cell == cli.markdown_cell(CASES[case], target)


def test_estimate_tables_are_the_benchmark_output():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_targets  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/estimate-targets.json").read_text())
  want = bench_targets.tables(payload).split("\n\n")
  ratios = _table_after(ROOT.joinpath("README.md").read_text(), "<!-- estimate table")
  assert ratios == _rows(want[0])
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- estimate table") == _rows(want[0])
  assert _table_after(doc, "<!-- estimate detail") == _rows(want[1])
  assert _table_after(doc, "<!-- estimate floor") == _rows(want[2])
  assert payload["device"] == "estimate (compile only)"


def test_mse_loss_table_is_the_benchmark_output():
  """The linear -> mse table and the README's sentence are the two recorded runs' figures."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_targets  # pylint: disable=import-outside-toplevel
  lin = json.loads((ROOT / "benchmarks/results/estimate-targets.json").read_text())["results"]
  mse_payload = json.loads((ROOT / "benchmarks/results/estimate-targets-mse.json").read_text())
  assert mse_payload["model"]["loss"] == "0.5 * sum((y - r)^2)"
  mse = mse_payload["results"]
  widths = ("1024", "4096", "8192")
  cells = lambda res, t, a, key: " / ".join(f"{res[t][w][a][key]:.2f}" for w in widths)
  want = [["target", "recipe", "step vs bf16", "non-GEMM bytes vs bf16"], ["---"] * 4]
  for t in ("h100", "b200"):
    for a in ("fp8_delayed", "fp8_current"):
      want.append([bench_targets.NAMES[t], bench_targets.LABELS[a]] + [
          f"{cells(lin, t, a, key)} -> {cells(mse, t, a, key)}"
          for key in ("ratio_vs_bf16", "other_bytes_vs_bf16")])
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- estimate mse table") == want
  readme = ROOT.joinpath("README.md").read_text()
  assert f"H100 fp8 delayed {cells(mse, 'h100', 'fp8_delayed', 'ratio_vs_bf16')};" in readme
  # The same products with either loss: only the passes around them differ.
  for t in ("h100", "b200"):
    for w in widths:
      for a in ("bf16", "fp8_delayed", "fp8_current"):
        assert mse[t][w][a]["products"] == lin[t][w][a]["products"], (t, w, a)


def test_adam_step_table_is_the_benchmark_output():
  """The training step's table (mse loss, Adam's update) and the README's figures are the run's."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_targets  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/estimate-targets-adam.json").read_text())
  assert payload["model"]["optimizer"] == "adam"
  assert payload["model"]["loss"] == "0.5 * sum((y - r)^2)"
  res = payload["results"]
  cells = lambda t, a, key: " / ".join(f"{res[t][w][a][key]:.2f}" for w in ("1024", "4096", "8192"))
  arms = {"h100": ("fp8_delayed", "fp8_current", "fp8_rowwise"),
          "b200": ("fp8_delayed", "fp8_current", "fp8_rowwise", "mx_block", "nvfp4")}
  want = [["target", "recipe", "step vs bf16", "non-GEMM bytes vs bf16"], ["---"] * 4]
  for t, names in arms.items():
    for a in names:
      want.append([bench_targets.NAMES[t], bench_targets.LABELS[a],
                   cells(t, a, "ratio_vs_bf16"), cells(t, a, "other_bytes_vs_bf16")])
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- estimate adam table") == want
  readme = " ".join(ROOT.joinpath("README.md").read_text().split())
  for t, a, label in (("h100", "fp8_delayed", "H100 fp8 delayed"), ("b200", "mx_block", "B200 MXFP8"),
                      ("b200", "nvfp4", "NVFP4")):
    assert f"{label} {cells(t, a, 'ratio_vs_bf16')}" in readme, label


def test_passes_by_loss_table_is_the_benchmark_output():
  """The dense layer's passes with each loss and optimizer: the docs table, read from the runs."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_passes  # pylint: disable=import-outside-toplevel
  runs, metas = {}, {}
  for column, name in bench_passes.LOSS_RUNS:
    payload = json.loads((ROOT / "benchmarks/results" / name).read_text())
    runs[column], metas[column] = payload["results"], payload["meta"]
  want = [[c.strip() for c in line.strip("|").split("|")]
          for line in bench_passes.loss_table(runs).splitlines()]
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- passes by loss table") == want
  # Each run is what its column says, on the same layer.
  assert [(m.get("loss", "linear"), m.get("optimizer", "none")) for m in metas.values()] == [
      ("linear", "none"), ("mse", "none"), ("mse", "adam")]
  assert len({json.dumps(m["shape"], sort_keys=True) for m in metas.values()}) == 1
  # The steady branch moves no more than the default step with any loss.
  for res in runs.values():
    for t in ("h100", "b200"):
      assert res[t]["fp8_delayed_split"]["vs_bf16"] <= res[t]["fp8_delayed"]["vs_bf16"]


def test_split_first_step_table_is_the_benchmark_output():
  """The decoder block under ``fl.split_first_step`` (its steady branch): docs table and README."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_targets  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/estimate-targets-split.json").read_text())
  res = payload["results"]
  cells = lambda t, a, key: " / ".join(f"{res[t][w][a][key]:.2f}" for w in ("1024", "4096", "8192"))
  want = [["target", "recipe", "step vs bf16", "non-GEMM bytes vs bf16"], ["---"] * 4]
  for t in ("h100", "b200"):
    for a in ("fp8_delayed", "fp8_delayed_split"):
      want.append([bench_targets.NAMES[t], bench_targets.LABELS[a],
                   cells(t, a, "ratio_vs_bf16"), cells(t, a, "other_bytes_vs_bf16")])
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- estimate split table") == want
  # The unsplit arm is the README table's cell, compiled again in the same run.
  main = json.loads((ROOT / "benchmarks/results/estimate-targets.json").read_text())["results"]
  for t in ("h100", "b200"):
    for w in ("1024", "4096", "8192"):
      assert res[t][w]["fp8_delayed"]["estimate_ms"] == pytest.approx(
          main[t][w]["fp8_delayed"]["estimate_ms"], rel=1e-6)
  # The split arm multiplies what the unsplit one does.
  assert all(res[t][w]["fp8_delayed_split"]["products"] == res[t][w]["fp8_delayed"]["products"]
             for t in ("h100", "b200") for w in ("1024", "4096", "8192"))
  readme = " ".join(ROOT.joinpath("README.md").read_text().split())
  assert f"B200 fp8 delayed {cells('b200', 'fp8_delayed_split', 'ratio_vs_bf16')}" in readme


def test_accumulate_table_is_the_benchmark_output():
  """Weights quantized once per accumulation window: the docs table and its figures."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_accumulate  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/estimate-accumulate.json").read_text())
  res = payload["results"]
  want = [[c.strip() for c in line.strip("|").split("|")]
          for line in bench_accumulate.markdown(res).splitlines()]
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- accumulate table") == want
  steps = payload["multisteps"]
  want = [[c.strip() for c in line.strip("|").split("|")] for line in
          bench_accumulate.multisteps_markdown(steps, payload["meta"]["shape"]["micro"])
          .splitlines()]
  assert _table_after(doc, "<!-- multisteps table") == want
  for target in ("h100", "b200"):
    for arm in ("fp8_delayed", "fp8_current"):
      cached, plain = steps[target][arm]["cached"], steps[target][arm]["plain"]
      assert cached["seconds_estimate"] < plain["seconds_estimate"]
      assert cached["products"] == plain["products"] and all("f8" in p for p in plain["products"])
  for t in ("h100", "b200"):
    for arm in ("fp8_delayed", "fp8_current"):
      # Once per window is faster and keeps every product in fp8.
      assert res[t][f"{arm}_hoisted"]["vs_bf16"] < res[t][arm]["vs_bf16"]
      assert res[t][f"{arm}_hoisted"]["products"] == res[t][arm]["products"]
      assert all("f8" in p for p in res[t][arm]["products"])
  v5e = res["tpu-v5e"]
  assert v5e["int8_grad8_hoisted"]["vs_bf16"] < v5e["int8_grad8"]["vs_bf16"]
  assert v5e["int8_grad8_hoisted"]["products"] == ["s8xs8"]
  prose = " ".join(doc.split())
  h = res["h100"]
  assert (f"fp8 delayed and current scaling estimate {h['fp8_delayed']['vs_bf16']:.2f} -> "
          f"{h['fp8_delayed_hoisted']['vs_bf16']:.2f}") in prose


def test_estimate_vs_measured_table_is_the_benchmark_output():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import estimate_vs_published as ev  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/estimate-vs-published.json").read_text())
  doc = ROOT.joinpath("docs/accelerators.md").read_text()
  assert _table_after(doc, "<!-- estimate vs measured") == _rows(ev.markdown(payload["rows"]))
  # The TE layer at its published shape, both arms compiled for B200.
  te = [r for r in payload["rows"] if r["device"].startswith("GB200")]
  assert [r["shape"] for r in te] == [[16384, 8192, 32768]] * 2


def test_moe_quality_table_is_the_benchmark_output():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_moe_quality as bm  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/cpu-moe-quality.json").read_text())
  doc = ROOT.joinpath("docs/transforms.md").read_text()
  assert _table_after(doc, "<!-- moe quality table") == _rows(bm.markdown(payload))
  assert payload["device"] == "cpu" and payload["steps"] == 1200
  assert all(payload["summary"][a]["seeds"] == 3 for a in bm.ARMS)
  assert all(r["products"]["quantized"] == 8 for r in payload["runs"] if r["arm"] != "bf16")


def _rows(table: str) -> list[list[str]]:
  return [[c.strip() for c in l.strip().strip("|").split("|")] for l in table.splitlines()]


def test_collectives_tables_are_the_benchmark_output():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_collectives  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/collectives.json").read_text())
  doc = ROOT.joinpath("docs/distributed.md").read_text()
  for axis_type in ("auto", "explicit"):
    got = _table_after(doc, f"<!-- collectives table ({axis_type} axes)")
    assert got == _rows(bench_collectives.markdown(payload, axis_type)), axis_type
  # The goals the issue set, as measured: state all-reduces and code gathers.
  rows = [(m, r) for m in payload["meshes"].values() for r in m["rows"]]
  assert all(r["state_all_reduces"] <= 2 for _, r in rows if r["arm"] == "fp8_delayed")
  assert all(r["weight_gathers_vs_f32_params"] <= 0.25 + 1e-9 for m, r in rows
             if r["arm"] != "bf16" and (r["axis_type"] == "explicit" or "TPU" not in m["device"]))


def test_quality_tables_are_the_benchmark_output():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_block_quality as bq  # pylint: disable=import-outside-toplevel
  payload = json.loads((ROOT / "benchmarks/results/cpu-block-quality.json").read_text())
  main = _rows(bq.markdown(payload))
  assert _table_after(ROOT.joinpath("README.md").read_text(), "<!-- quality table") == main
  doc = ROOT.joinpath("docs/recipes.md").read_text()
  assert _table_after(doc, "<!-- quality table") == main
  assert _table_after(doc, "<!-- quality ablations") == _rows(bq.markdown(payload, bq.ABLATIONS))
  assert _table_after(doc, "<!-- quality options") == _rows(bq.markdown(payload, bq.OPTIONS))
  assert _table_after(doc, "<!-- quality tail") == _rows(bq.own_recipe_markdown(payload))
  assert _table_after(doc, "<!-- quality int8") == _rows(
      bq.markdown(payload, ("bf16",) + bq.INT_ARMS))
  assert _table_after(doc, "<!-- quality fp8") == _rows(
      bq.markdown(payload, ("bf16", "fp8_delayed") + bq.FP8_ARMS))
  assert payload["device"] == "CPU"
  summary = payload["summary"]
  # Every main arm ran seeds 0-2 at 300 and 1200 steps; bf16 and the tuned NVFP4 at 3000.
  for length in ("300_steps", "1200_steps"):
    assert all({0, 1, 2} <= set(summary[length][a]["seeds"]) for a in bq.MAIN_ARMS), length
  assert all({0, 1, 2} <= set(summary["3000_steps"][a]["seeds"])
             for a in ("bf16", bq.TUNED_NVFP4))
  # The tuned NVFP4 arm's targets, as measured: +1.5% at 1200 steps, +1.0% at 3000.
  for length, bound in (("1200_steps", 0.015), ("3000_steps", 0.010)):
    assert summary[length][bq.TUNED_NVFP4]["ratio_vs_bf16_mean"] - 1 <= bound, length
