"""Draws PNG plots from the benchmark JSON files in benchmarks/results/.

For a device prefix (``cpu``, or a GPU kind such as ``nvidia-h100-80gb-hbm3``)
it looks for these files and draws one PNG beside each that it finds; a file
that does not exist is skipped with a printed note:

  <device>-dense.json        -> <device>-dense.png (bench_dense.py)
  <device>-recipes.json      -> <device>-recipes.png (bench_recipes.py --out)
  <device>-transformer.json  -> <device>-transformer.png (bench_transformer.py)

The dense and recipe plots have two panels: the train-step time of each arm as
a ratio to the bf16 ``nn.Dense`` step per size (the error bar spans the
fastest and slowest run, each divided by the bf16 median), and the residual
bytes kept for the backward pass as a ratio to bf16. The transformer plot
shows the training-loss curves of the arms, their difference from bf16, and
the validation-loss curves.

Usage:
  python benchmarks/plot_results.py                 # this machine's device
  python benchmarks/plot_results.py --device cpu
  python benchmarks/plot_results.py --results-dir /tmp/quick --out-dir /tmp/quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
"""Where the benchmark scripts write their JSON files by default."""


# ---------------------------------------------------------------------------
# Turning each JSON schema into per-arm series.


def dense_series(payload: dict) -> dict:
  """Per-arm ratio series of a ``bench_dense.py`` payload.

  Args:
    payload: The JSON written by ``bench_dense.py``: ``results[i]["M=K=N"]``
      and ``results[i]["arms"][name]`` with ``median_ms``, ``min_ms``,
      ``max_ms``, ``ratio_vs_bf16_dense`` and
      ``residual_ratio_vs_bf16_dense``.

  Returns:
    ``{"sizes": [...], "arms": {name: {"ratio", "lo", "hi", "residual"}}}``
    where ``sizes`` are tick labels (``"512"``, ``"8192x4096x14336"``) and
    each value is a list aligned with ``sizes`` (NaN where an arm is
    missing at a size). ``lo``/``hi`` are the fastest/slowest run divided by
    the bf16 median.
  """
  rows = payload["results"]
  # A square size (512) or an "MxKxN" label for the LLM projection shapes.
  sizes = [str(r["M=K=N"]) for r in rows]
  names = []
  for r in rows:
    names += [n for n in r["arms"] if n not in names]
  arms = {n: {"ratio": [], "lo": [], "hi": [], "residual": []} for n in names}
  for r in rows:
    base = r["arms"].get("bf16_dense", {}).get("median_ms", float("nan"))
    for n in names:
      a = r["arms"].get(n)
      s = arms[n]
      if a is None:
        for k in s:
          s[k].append(float("nan"))
        continue
      s["ratio"].append(a["ratio_vs_bf16_dense"])
      s["lo"].append(a.get("min_ms", a["median_ms"]) / base)
      s["hi"].append(a.get("max_ms", a["median_ms"]) / base)
      s["residual"].append(a.get("residual_ratio_vs_bf16_dense", float("nan")))
  return {"sizes": sizes, "arms": arms}


def recipes_series(payload: dict) -> dict:
  """Per-arm ratio series of a ``bench_recipes.py --out`` payload.

  Args:
    payload: ``results[str(size)][arm]`` with ``ratio_vs_bf16``,
      ``min_ratio``, ``max_ratio`` and ``residual_ratio_vs_bf16``.

  Returns:
    The same structure as :func:`dense_series`.
  """
  sizes = sorted(payload["results"], key=int)
  names = []
  for s in sizes:
    names += [n for n in payload["results"][s] if n not in names]
  arms = {n: {"ratio": [], "lo": [], "hi": [], "residual": []} for n in names}
  for s in sizes:
    for n in names:
      a = payload["results"][s].get(n, {})
      arms[n]["ratio"].append(a.get("ratio_vs_bf16", float("nan")))
      arms[n]["lo"].append(a.get("min_ratio", float("nan")))
      arms[n]["hi"].append(a.get("max_ratio", float("nan")))
      arms[n]["residual"].append(a.get("residual_ratio_vs_bf16", float("nan")))
  return {"sizes": list(sizes), "arms": arms}


# ---------------------------------------------------------------------------
# Drawing.


def _subtitle(payload: dict) -> str:
  env = payload.get("env") or payload.get("meta") or {}
  kind = env.get("device_kind") or env.get("device") or "?"
  return f"device {kind}, jax {env.get('jax', '?')}, flax {env.get('flax', '?')}"


def plot_ratio_panels(series: dict, title: str, png_path: str,
                      size_label: str = "M = K = N (or M x K x N)") -> str:
  """Draws the two-panel ratio plot (step time, residual bytes) to a PNG.

  Args:
    series: Output of :func:`dense_series` or :func:`recipes_series`.
    title: Figure title.
    png_path: Where to write the PNG.
    size_label: Label of the size axis.

  Returns:
    ``png_path``.
  """
  sizes, arms = series["sizes"], series["arms"]
  x = np.arange(len(sizes))
  width = 0.8 / max(len(arms), 1)
  fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 4.8))
  for i, (name, s) in enumerate(arms.items()):
    pos = x - 0.4 + width * (i + 0.5)
    ratio, lo, hi = (np.asarray(s[k], dtype=float) for k in ("ratio", "lo", "hi"))
    err = np.vstack([np.clip(ratio - lo, 0, None), np.clip(hi - ratio, 0, None)])
    err = np.nan_to_num(err)
    ax_t.bar(pos, ratio, width, yerr=err, capsize=2, label=name)
    ax_r.bar(pos, np.asarray(s["residual"], dtype=float), width, label=name)
  for ax, ylabel in ((ax_t, "train-step time / bf16 median"),
                     (ax_r, "residual bytes / bf16")):
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, [str(s) for s in sizes])
    ax.set_xlabel(size_label)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
  ax_t.set_title("step time (bar: median, whiskers: min/max run)")
  ax_r.set_title("residuals kept for the backward pass")
  ax_r.legend(fontsize=8, loc="best")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path


def _moving_average(values, window: int):
  v = np.asarray(values, dtype=float)
  if window <= 1 or len(v) < window:
    return np.arange(len(v)), v
  kernel = np.ones(window) / window
  return np.arange(window - 1, len(v)), np.convolve(v, kernel, mode="valid")


def plot_transformer(payload: dict, png_path: str) -> str:
  """Draws the loss curves of a ``bench_transformer.py`` payload to a PNG.

  Three panels: the train loss of each arm, its difference from the baseline
  arm's (bf16), and the validation loss.

  Args:
    payload: The transformer JSON; reads ``parity.arms[name].train_loss``,
      ``parity.arms[name].val`` (``[[step, loss], ...]``) and, when present,
      ``timing.arms[name].ratio_vs_bf16`` for the legend.
    png_path: Where to write the PNG.

  Returns:
    ``png_path``.
  """
  parity = payload["parity"]
  timing = (payload.get("timing") or {}).get("arms", {})
  window = max(1, min(10, len(next(iter(parity["arms"].values()))["train_loss"]) // 10))
  base_name = parity.get("baseline", "bf16")
  base = parity["arms"].get(base_name)
  fig, (ax_t, ax_d, ax_v) = plt.subplots(1, 3, figsize=(17, 4.5))
  for name, arm in parity["arms"].items():
    label = name
    if name in timing:
      label += f" (step x{timing[name]['ratio_vs_bf16']:.2f} bf16)"
    steps, smooth = _moving_average(arm["train_loss"], window)
    line, = ax_t.plot(steps, smooth, label=label)
    ax_t.plot(arm["train_loss"], color=line.get_color(), alpha=0.2, lw=0.8)
    if base is not None:
      _, base_smooth = _moving_average(base["train_loss"], window)
      ax_d.plot(steps, smooth - base_smooth, color=line.get_color(), label=name)
    val = np.asarray(arm["val"], dtype=float).reshape(-1, 2)
    ax_v.plot(val[:, 0], val[:, 1], "o-", color=line.get_color(), label=name)
  ax_t.set_title(f"train loss (moving average of {window} steps; faint: per step)")
  ax_d.set_title(f"train loss minus {base_name} (same moving average)")
  ax_v.set_title("validation loss")
  for ax in (ax_t, ax_d, ax_v):
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  ax_d.set_ylabel("difference (nats / byte)")
  m = payload.get("model", {})
  fig.suptitle(f"byte-level LM: {m.get('num_layers', '?')} layers, d_model "
               f"{m.get('d_model', '?')}, seq {m.get('seq_len', '?')}, batch "
               f"{m.get('batch_size', '?')}, {m.get('param_count', 0) / 1e6:.1f}M params - "
               f"{_subtitle(payload)}", fontsize=10)
  fig.tight_layout()
  fig.savefig(png_path, dpi=110)
  plt.close(fig)
  return png_path


# ---------------------------------------------------------------------------
# Entry point.


def _plot_dense(payload, png):
  return plot_ratio_panels(dense_series(payload),
                           f"QDense train step vs bf16 nn.Dense - {_subtitle(payload)}", png)


def _plot_recipes(payload, png):
  return plot_ratio_panels(recipes_series(payload),
                           f"QDense recipes vs bf16 nn.Dense - {_subtitle(payload)}", png,
                           size_label="features (square layer)")


PLOTTERS = {"dense": _plot_dense, "recipes": _plot_recipes, "transformer": plot_transformer}
"""Benchmark name (the JSON file's suffix) -> ``(payload, png_path) -> png_path``."""


def default_device() -> str:
  """This machine's device prefix, as ``common.device_name()`` spells it."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import common  # pylint: disable=g-import-not-at-top
  return common.device_name()


def main(argv=None) -> list[str]:
  """Plots every known results file found for one device.

  Args:
    argv: Command-line arguments (``None``: ``sys.argv[1:]``).

  Returns:
    The paths of the PNG files written.
  """
  p = argparse.ArgumentParser(
      description="Draw PNG plots from benchmarks/results/<device>-<name>.json files.")
  p.add_argument("--device", default=None,
                 help="file-name prefix, e.g. 'cpu' (default: this machine's device)")
  p.add_argument("--results-dir", default=RESULTS_DIR,
                 help="folder holding the JSON files (default: benchmarks/results)")
  p.add_argument("--out-dir", default=None,
                 help="folder for the PNG files (default: the results folder)")
  p.add_argument("--only", nargs="+", choices=sorted(PLOTTERS), default=None,
                 help="plot only these benchmarks (default: all)")
  args = p.parse_args(argv)
  device = args.device or default_device()
  out_dir = args.out_dir or args.results_dir
  os.makedirs(out_dir, exist_ok=True)
  written = []
  for name in args.only or PLOTTERS:
    src = os.path.join(args.results_dir, f"{device}-{name}.json")
    if not os.path.exists(src):
      print(f"skip {name}: {src} does not exist")
      continue
    with open(src) as f:
      payload = json.load(f)
    png = PLOTTERS[name](payload, os.path.join(out_dir, f"{device}-{name}.png"))
    print("wrote", png)
    written.append(png)
  return written


if __name__ == "__main__":
  main()
