"""The step-time estimate (compile only) next to measured figures: published ones and ours.

The estimate (``fp8_linen.testing.estimate``) is a roofline at published
peaks: a lower bound that ranks recipes. This script puts it beside every
measured step time we can reproduce the shape of, and fits the one thing the
roofline leaves out that dominates large dense steps, the GEMMs' efficiency
below peak:

* **ours**: ``benchmarks/results/nvidia-h200-gpu.json`` (``bench_gpu.py`` on one
  H200: the dense training step at M=K=N 4096 / 8192 / 16384, bf16 and the fp8
  recipes, measured and estimated from the very program that ran);
* **published**: TransformerEngine's JAX dense example layer, x (8 * 2048, 8192)
  bf16 -> 32768 features, forward + dgrad + wgrad, as quoted in issue 27: bf16
  18.06 ms, MXFP8 11.26 ms on GB200. We compile our bf16 and MXFP8 steps of that
  layer for B200 (compile only; GB200's peaks are ~10% above B200's).

The GEMM-efficiency model: per operand class, ``eta = estimated GEMM time /
(measured step - estimated non-GEMM time)`` of a calibration step of the same
device and shape (the fraction of peak its GEMMs reach): bf16 from the bf16
step, fp8 from flax's fp8 op (the fp8 step with the fewest passes around its
GEMMs; not one of ours, so our arms are predicted out of sample). Every other
arm is ``predicted = non-GEMM time + GEMM time / eta`` of its class. For the
TE layer only bf16 is measured on the same device: its fp8 GEMMs get bf16's
efficiency times the fp8/bf16 efficiency ratio measured on the H200 at the
closest size. The roofline stays beside it as the lower bound.

  python benchmarks/estimate_vs_published.py --out benchmarks/results/estimate-vs-published.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import flax.linen as nn
import jax.numpy as jnp

import fp8_linen as fl
from fp8_linen.testing import estimate, hlo, hlo_kernels, passes, targets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TE_DENSE = {"shape": (16384, 8192, 32768), "device": "GB200", "target": "b200",
            "measured_ms": {"bf16": 18.06, "mxfp8": 11.26},
            "source": "TransformerEngine JAX dense example, as quoted in issue 27"}
H200_ARMS = {"bf16_dense": "bf16", "flax_fp8_direct": "flax fp8 op",
             "qdense_delayed": "fp8 delayed", "qdense_current": "fp8 current",
             "qdense_rowwise": "fp8 row-wise"}


def efficiency(bf16_measured_ms: float, bf16_product_ms: float, bf16_ms: float) -> float:
  """The fraction of peak the bf16 step's GEMMs reach (its non-GEMM time as estimated)."""
  return bf16_product_ms / max(bf16_measured_ms - (bf16_ms - bf16_product_ms), 1e-9)


def predicted(est_ms: float, product_ms: float, eta: float) -> float:
  """The estimate with its GEMM time divided by ``eta``."""
  return est_ms - product_ms + product_ms / eta


CALIBRATION = {"bf16": "bf16_dense", "fp8": "flax_fp8_direct"}


def _class_of(est: dict) -> str:
  return "fp8" if "fp8" in est.get("flops_by_class", {}) else "bf16"


def h200_rows(path: str) -> tuple[list[dict], dict]:
  """Our H200 measurements and their estimates, with the efficiency model.

  Returns the rows and ``{(m, k, n): {class: eta}}``.
  """
  if not os.path.exists(path):
    return [], {}
  rows, etas = [], {}
  # A shape timed again in a later session replaces its earlier row: the rows are
  # compared within one run only, and the latest run is of the code as it is.
  latest = {tuple(s["shape_MKN"]): s for s in json.load(open(path))["results"]}
  for shape in latest.values():
    arms = shape["arms"]
    if any("median_ms" not in arms.get(a, {}) for a in CALIBRATION.values()):
      continue
    eta = {cls: efficiency(arms[a]["median_ms"], arms[a]["estimate"]["product_ms"],
                           arms[a]["estimate"]["ms"]) for cls, a in CALIBRATION.items()}
    etas[tuple(shape["shape_MKN"])] = eta
    base = arms["bf16_dense"]
    for arm, label in H200_ARMS.items():
      a = arms.get(arm, {})
      if "median_ms" not in a:
        continue
      est = a["estimate"]
      e = eta[_class_of(est)]
      rows.append({"device": "H200", "shape": shape["shape_MKN"], "arm": label,
                   "calibration": arm in CALIBRATION.values(),
                   "measured_ms": a["median_ms"], "roofline_ms": est["ms"],
                   "gemm_efficiency": e, "predicted_ms": predicted(est["ms"], est["product_ms"], e),
                   "measured_ratio": a["median_ms"] / base["median_ms"],
                   "roofline_ratio": est["ms"] / base["estimate"]["ms"]})
  for r in rows:
    r["predicted_ratio"] = r["predicted_ms"] / next(
        b["predicted_ms"] for b in rows if b["shape"] == r["shape"] and b["arm"] == "bf16")
  return rows, etas


def te_rows(shape=TE_DENSE["shape"], etas=None) -> list[dict]:
  """Our bf16 and MXFP8 steps of TE's dense-example layer, compiled for B200."""
  m, k, n = shape
  if not targets.availability(TE_DENSE["target"]):
    print("b200: cannot compile here", flush=True)
    return []
  models = {"bf16": nn.Dense(n, dtype=jnp.bfloat16),
            "mxfp8": fl.QDense(n, dtype=jnp.bfloat16, recipe=fl.mx_block_scaling())}
  est = {}
  for arm, model in models.items():
    t0 = time.perf_counter()
    report = passes.step_passes(model, (m, k), target=TE_DENSE["target"]).report
    e = estimate.estimate(hlo_kernels.kernels(hlo.parse(report.hlo)),
                          estimate.PEAKS[TE_DENSE["target"]])
    est[arm] = {"ms": e.seconds * 1e3, "product_ms": e.product_seconds * 1e3,
                "products": dict(report.classes)}
    print(f"b200 {arm}: roofline {est[arm]['ms']:.2f} ms ({time.perf_counter() - t0:.0f} s "
          "to compile)", flush=True)
  measured = TE_DENSE["measured_ms"]
  eta_bf16 = efficiency(measured["bf16"], est["bf16"]["product_ms"], est["bf16"]["ms"])
  # fp8 GEMMs: bf16's efficiency here times the fp8/bf16 ratio on the H200 at the closest size.
  ratio = 1.0
  if etas:
    closest = min(etas, key=lambda s: abs(s[0] * s[1] * s[2] - shape[0] * shape[1] * shape[2]))
    ratio = etas[closest]["fp8"] / etas[closest]["bf16"]
  eta = {"bf16": eta_bf16, "mxfp8": eta_bf16 * ratio}
  rows = []
  for arm, e in est.items():
    rows.append({"device": f"{TE_DENSE['device']} (B200 peaks)", "shape": list(shape),
                 "arm": arm, "measured_ms": measured[arm], "measured_by": TE_DENSE["source"],
                 "calibration": arm == "bf16", "roofline_ms": e["ms"], "gemm_efficiency": eta[arm],
                 "predicted_ms": predicted(e["ms"], e["product_ms"], eta[arm]),
                 "products": e["products"]})
  for r in rows:
    r["measured_ratio"] = r["measured_ms"] / measured["bf16"]
    r["roofline_ratio"] = r["roofline_ms"] / rows[0]["roofline_ms"]
    r["predicted_ratio"] = r["predicted_ms"] / rows[0]["predicted_ms"]
  return rows


def markdown(rows: list[dict]) -> str:
  out = ["| device | M, K, N | arm | measured ms (ratio) | roofline ms (ratio) | GEMM efficiency "
         "| predicted ms (ratio) |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
  for r in rows:
    arm = r["arm"] + (" (calibration)" if r.get("calibration") else "")
    out.append(f"| {r['device']} | {', '.join(map(str, r['shape']))} | {arm} | "
               f"{r['measured_ms']:.2f} ({r['measured_ratio']:.2f}) | "
               f"{r['roofline_ms']:.2f} ({r['roofline_ratio']:.2f}) | "
               f"{100 * r['gemm_efficiency']:.0f}% | "
               f"{r['predicted_ms']:.2f} ({r['predicted_ratio']:.2f}) |")
  return "\n".join(out)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--h200-json", default=os.path.join(RESULTS, "nvidia-h200-gpu.json"))
  p.add_argument("--te-shape", type=int, nargs=3, default=TE_DENSE["shape"],
                 help="M K N of the TE layer (smaller for a quick run)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  ours, etas = h200_rows(args.h200_json)
  rows = ours + te_rows(tuple(args.te_shape), etas)
  payload = {"device": "estimate (compile only) beside measurements", "rows": rows,
             "environment": common.environment()}
  return common.finish(payload, markdown(rows), args.out)


if __name__ == "__main__":
  main()
