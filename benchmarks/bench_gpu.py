"""Dense train step on a real GPU: measured ratios, fp8 GEMM counts and the estimate, side by side.

One short run for a lent GPU (an H200 or H100): for each shape ``(M, K, N)``
(x is ``(M, K)`` bf16, the kernel ``(K, N)`` float32) every arm's training
step (``common.make_train_step``: forward, dgrad, wgrad, SGD update and fp8
state merge; the step returns the loss and dL/dx, so all three products run)
is compiled once on the device and then

1. **timed**: all arms interleaved in this process, median / min / max of
   ``--reps`` runs after warm-up, as ratios to bf16 ``nn.Dense`` and to flax's
   ``Fp8DirectDotGeneralOp`` (``common.time_arms``);
2. **counted**: the fp8 GEMMs among all GEMMs of the optimized program the GPU
   ran (``common.gpu_products``: cuBLASLt fp8 custom calls, fp8 Triton and
   cuDNN GEMM fusions; 3 per layer per step expected for every fp8 arm), with
   every product's kind and operand class;
3. **estimated**: the project's roofline estimate
   (``fp8_linen.testing.estimate``, "estimate (compile only)") applied to the
   same compiled program with the device's published peaks, so the estimated
   ratio to bf16 stands next to the measured one on the same device.

Arms: ``bf16_dense`` (``nn.Dense``, bf16), ``flax_fp8_direct`` (``nn.Dense``
with flax's ``Fp8DirectDotGeneralOp``), ``qdense_delayed`` (``fl.QDense``, the
default recipe: delayed scaling), ``qdense_current`` (``fl.current_scaling()``),
``qdense_rowwise`` (``fl.rowwise_scaling()``) and ``qdense_delayed_split`` (delayed
scaling, its step wrapped in ``fl.split_first_step``: the warm-up fills the
histories, so the timed steps run its steady branch). No f32 arm: on a GPU the
floor is bf16.

Shapes: square 4096, 8192, 16384; TransformerEngine's JAX dense example layer
(x ``(16384, 8192)`` -> 32768 features); the LLM MLP projections M = 8192,
``(K, N)`` in ``{(4096, 14336), (14336, 4096)}``.

The whole run is sized for a few minutes of device time: compiles dominate
(about 30 steps, GEMM autotuning included), the timed rounds of even the
largest shape take seconds. If the run falls behind ``--budget-s`` the
remaining shapes get fewer reps. Only a shape that would not finish before
``--stop-after-s`` (judged by the slowest shape so far) is skipped, so that the
run still ends with its summary inside the caller's timeout; a SIGTERM (from
``timeout``) ends it the same way between two steps of Python. The JSON is
rewritten after every shape, so even a killed run keeps what it measured.

Writes ``<out-dir>/<device>-gpu.json`` (``<device>-gpu-smoke.json`` with
``--smoke``) and prints one line per arm and shape, then a summary table.

``--loss mse`` times the step with ``0.5 * sum((y - r)^2)`` instead of
``sum(y * r)``: with the linear loss nothing orders the forward before the
backward, and XLA may fuse a weight's amax (the forward's) into the SGD update
and then copy the weight (docs/accelerators.md).

Usage:
  python benchmarks/bench_gpu.py --out-dir /tmp/gpu          # on the GPU (~3-5 min)
  python benchmarks/bench_gpu.py --smoke --out-dir /tmp/gpu  # tiny shapes, any machine
  python benchmarks/bench_gpu.py --shapes te_dense_example --loss mse --out-dir /tmp/gpu
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen.testing import estimate, hlo, hlo_kernels, hlo_products  # noqa: E402
from fp8_linen.testing.train_step import LOSSES  # noqa: E402

BASELINE = "bf16_dense"
FLAX_FP8 = "flax_fp8_direct"
FP8_ARMS = ("flax_fp8_direct", "qdense_delayed", "qdense_current", "qdense_rowwise",
            "qdense_delayed_split")
# Arms whose step is wrapped in fl.split_first_step (timed after the warm-up filled the
# histories: its steady branch).
SPLIT_ARMS = ("qdense_delayed_split",)

# (label, (M, K, N)) in the order they run.
SHAPES = (
    ("square_4096", (4096, 4096, 4096)),
    ("square_8192", (8192, 8192, 8192)),
    ("square_16384", (16384, 16384, 16384)),
    # TransformerEngine's JAX dense example: x (16384, 8192) -> 32768 features.
    ("te_dense_example", (16384, 8192, 32768)),
    ("llm_up_8192x4096x14336", (8192, 4096, 14336)),
    ("llm_down_8192x14336x4096", (8192, 14336, 4096)),
)
SMOKE_SHAPES = (("smoke_256", (256, 256, 256)), ("smoke_rect", (256, 128, 512)))

# The speed-ups over bf16 BENCHMARKS.md asks of a real GPU (fwd + bwd), by shape label.
SPEEDUP_TARGETS = {"square_4096": 1.2, "square_8192": 1.45, "square_16384": 1.6}

# Which published peaks (fp8_linen.testing.estimate.PEAKS) a device kind's estimate uses.
# The H200 SXM's tensor peaks are the H100 SXM's (989 TFLOP/s dense bf16, 1979 fp8) and
# its HBM3e gives 4.8 TB/s (NVIDIA H200 datasheet); the "h200" entry records that.
_PEAKS_BY_KIND = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"))


def make_layer(arm: str, features: int) -> nn.Module:
  """The Linen layer of one arm: ``features`` outputs, no bias, bf16 compute."""
  bf16 = jnp.bfloat16
  if arm == "bf16_dense":
    return nn.Dense(features, use_bias=False, dtype=bf16)
  if arm == "flax_fp8_direct":
    return nn.Dense(features, use_bias=False, dtype=bf16,
                    dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
  if arm in ("qdense_delayed", "qdense_delayed_split"):  # delayed scaling (1024-long history)
    return fl.QDense(features, use_bias=False, dtype=bf16)
  if arm == "qdense_current":
    return fl.QDense(features, use_bias=False, dtype=bf16, recipe=fl.current_scaling())
  if arm == "qdense_rowwise":
    return fl.QDense(features, use_bias=False, dtype=bf16, recipe=fl.rowwise_scaling())
  raise ValueError(f"unknown arm {arm!r}")


ARMS = (BASELINE,) + FP8_ARMS


def peaks_for(kind: str, name: str | None) -> tuple[str, estimate.Peaks, str]:
  """``(peaks name, Peaks, note)`` for a device kind, or the ``--peaks`` override.

  On a device with no published peaks here (the CPU of a smoke run) the H200's
  are used so the estimate's code path runs; the note says the figures then
  describe no real device.
  """
  if name:
    return name, estimate.PEAKS[name], "chosen with --peaks"
  for key, peaks_name in _PEAKS_BY_KIND:
    if key in kind:
      return peaks_name, estimate.PEAKS[peaks_name], f"from the device kind {kind!r}"
  return "h200", estimate.PEAKS["h200"], (f"device kind {kind!r} has no peaks: the H200's "
                                          "are used, the estimate describes no real run")


def product_summary(text: str) -> dict:
  """Products of an optimized HLO module: the GPU counts and a ``kind/class`` histogram."""
  module = hlo.parse(text)
  prods = hlo_products.products(module)
  counts = common.gpu_products(text)
  counts["by_kind_and_class"] = dict(sorted(collections.Counter(
      f"{p.kind}{'(' + p.target + ')' if p.target else ''}/{p.operand_class}"
      for p in prods).items()))
  return counts


def estimate_row(text: str, peaks: estimate.Peaks) -> dict:
  """The estimate (compile only) of one compiled step with ``peaks``."""
  est = estimate.estimate(hlo_kernels.kernels(hlo.parse(text)), peaks)
  return {"ms": est.seconds * 1e3, "product_ms": est.product_seconds * 1e3,
          "low_precision_share": est.low_precision_share, "other_bytes": est.other_bytes,
          "flops_by_class": dict(est.flops), "kernels": len(est.kernels)}


def run_shape(label: str, shape: tuple[int, int, int], reps: int, warmup: int,
              peaks: estimate.Peaks, arms: tuple[str, ...] = ARMS,
              loss: str = "linear") -> dict:
  """Builds, counts, estimates and times every arm on one shape; returns its JSON row.

  An arm that fails to build or compile is recorded with its error and left
  out of the timing; the others still run.
  """
  m, k, n = shape
  t0 = time.perf_counter()
  # Every arm gets the same random x (bf16) and, through seed=0, the same cotangent.
  x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(jnp.bfloat16)
  built, rows = {}, {}
  for arm in arms:
    try:
      a = common.build_train_arm(make_layer(arm, n), x, seed=0, loss=loss,
                                 split=arm in SPLIT_ARMS)
      text = a.compiled.as_text()
      rows[arm] = {"compile_s": a.compile_seconds, "memory": a.memory,
                   "products": product_summary(text), "estimate": estimate_row(text, peaks)}
      built[arm] = a
    except Exception as e:  # pylint: disable=broad-except  # one arm must not end the run
      rows[arm] = {"error": f"{type(e).__name__}: {e}"[:2000]}
      print(f"{label} {arm}: FAILED to build: {rows[arm]['error'][:300]}", flush=True)
  compile_s = time.perf_counter() - t0
  times, timing_error = {}, None
  if BASELINE in built:
    try:
      times = common.time_arms(built, BASELINE, reps=reps, warmup=warmup)
    except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory: keep the rest
      timing_error = f"{type(e).__name__}: {e}"[:2000]
      print(f"{label}: timing FAILED: {timing_error[:300]}", flush=True)
  del built  # the arms' states and programs: free the device before the next shape
  flops = 3 * 2 * m * k * n  # forward, dgrad and wgrad products of the step
  # The estimate's ratios, for every arm that compiled (timed or not).
  base_est = rows.get(BASELINE, {}).get("estimate", {})
  flax_est = rows.get(FLAX_FP8, {}).get("estimate", {}).get("ms")
  for row in rows.values():
    est = row.get("estimate")
    if est is None:
      continue
    if base_est:
      est["ratio_vs_bf16"] = est["ms"] / base_est["ms"]
      est["other_bytes_vs_bf16"] = (est["other_bytes"] / base_est["other_bytes"]
                                    if base_est["other_bytes"] else None)
    if flax_est:
      est["ratio_vs_flax_fp8"] = est["ms"] / flax_est
  flax_ms = times.get(FLAX_FP8, {}).get("median_ms")
  for arm, t in times.items():
    row = rows[arm]
    row.update({key: t[key] for key in ("median_ms", "min_ms", "max_ms", "runs")})
    row["ratio_vs_bf16"] = t["ratio"]
    row["min_ratio_vs_bf16"] = t["min_ratio"]
    row["max_ratio_vs_bf16"] = t["max_ratio"]
    row["speedup_vs_bf16"] = 1.0 / t["ratio"]
    row["gemm_tflops"] = flops / (t["median_ms"] * 1e-3) / 1e12
    if flax_ms:
      row["ratio_vs_flax_fp8"] = t["median_ms"] / flax_ms
    # Measured time over the roofline: how far the device is from the peaks.
    row["estimate"]["measured_over_estimate"] = t["median_ms"] / row["estimate"]["ms"]
  for arm in arms:
    print(arm_line(label, arm, rows[arm]), flush=True)
  return {"label": label, "shape_MKN": list(shape), "reps": reps, "warmup": warmup, "loss": loss,
          **({"timing_error": timing_error} if timing_error else {}),
          "products_flops_per_step": flops, "compile_s": compile_s,
          "seconds": time.perf_counter() - t0, "arms": rows}


def arm_line(label: str, arm: str, row: dict) -> str:
  """One printed line: time, measured and estimated ratios, fp8 GEMMs / GEMMs."""
  if "error" in row:
    return f"{label:>26} {arm:16s} ERROR {row['error'][:120]}"
  if "median_ms" not in row:
    return f"{label:>26} {arm:16s} built, not timed (no baseline)"
  p, est = row["products"], row["estimate"]
  return (f"{label:>26} {arm:16s} {row['median_ms']:8.3f} ms [{row['min_ms']:.3f}, "
          f"{row['max_ms']:.3f}]  x{row['ratio_vs_bf16']:.3f} bf16 (est x"
          f"{est.get('ratio_vs_bf16', float('nan')):.3f})  x"
          f"{row.get('ratio_vs_flax_fp8', float('nan')):.3f} flax-fp8  "
          f"fp8 {p['fp8_products']}/{p['products']} products  "
          f"{row['gemm_tflops']:6.1f} TFLOP/s  compile {row['compile_s']:.1f}s")


def checks(results: list[dict]) -> list[dict]:
  """BENCHMARKS.md's real-GPU bars, per shape: 3 fp8 GEMMs per layer, speed-ups, vs flax."""
  out = []
  for res in results:
    arms = res["arms"]
    for arm in FP8_ARMS:
      row = arms.get(arm, {})
      if "products" in row:
        # A split step's program holds the step twice (a branch each).
        n = row["products"]["fp8_products"] // (2 if arm in SPLIT_ARMS else 1)
        out.append({"shape": res["label"], "arm": arm, "check": "3 fp8 products per step",
                    "value": n, "ok": n == 3})
      if arm.startswith("qdense") and "median_ms" in row:
        bar = SPEEDUP_TARGETS.get(res["label"])
        if bar:
          out.append({"shape": res["label"], "arm": arm, "check": f"speed-up over bf16 >= {bar}",
                      "value": row["speedup_vs_bf16"], "ok": row["speedup_vs_bf16"] >= bar})
        if "ratio_vs_flax_fp8" in row:
          out.append({"shape": res["label"], "arm": arm, "check": "not slower than flax's fp8 op",
                      "value": row["ratio_vs_flax_fp8"], "ok": row["ratio_vs_flax_fp8"] <= 1.0})
  return out


def summary(results: list[dict]) -> str:
  """The compact table printed at the end."""
  lines = [f"{'shape':>26} {'arm':16s} {'ms':>9} {'meas/bf16':>9} {'est/bf16':>8} "
           f"{'meas/flax':>9} {'est/flax':>8} {'fp8/all':>7} {'TFLOP/s':>7}"]
  for res in results:
    for arm, row in res["arms"].items():
      if "median_ms" not in row:
        lines.append(f"{res['label']:>26} {arm:16s} {row.get('error', 'not timed')[:60]}")
        continue
      est, p = row["estimate"], row["products"]
      lines.append(f"{res['label']:>26} {arm:16s} {row['median_ms']:9.3f} "
                   f"{row['ratio_vs_bf16']:9.3f} {est.get('ratio_vs_bf16', float('nan')):8.3f} "
                   f"{row.get('ratio_vs_flax_fp8', float('nan')):9.3f} "
                   f"{est.get('ratio_vs_flax_fp8', float('nan')):8.3f} "
                   f"{p['fp8_products']:>3}/{p['products']:<3} {row['gemm_tflops']:7.1f}")
  return "\n".join(lines)


def device_info() -> dict:
  """What the device says of itself beyond ``common.environment()``."""
  d = jax.devices()[0]
  info = {}
  for attr in ("compute_capability", "core_count"):
    if hasattr(d, attr):
      info[attr] = str(getattr(d, attr))
  try:
    stats = d.memory_stats() or {}
    if "bytes_limit" in stats:
      info["memory_bytes_limit"] = int(stats["bytes_limit"])
  except Exception:  # pylint: disable=broad-except  # not every backend reports memory
    pass
  return info


def _stop(signum, frame):  # pylint: disable=unused-argument
  raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> dict:
  """Runs the benchmark, writes the JSON and returns its payload."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out-dir", default=None,
                 help="folder for <device>-gpu.json (default: benchmarks/results)")
  p.add_argument("--reps", type=int, default=20, help="timed rounds per shape")
  p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
  p.add_argument("--shapes", nargs="+", choices=[s for s, _ in SHAPES],
                 help="run only these shapes (default: all)")
  p.add_argument("--arms", nargs="+", choices=ARMS,
                 help=f"run only these arms ({BASELINE} always runs; default: all)")
  p.add_argument("--budget-s", type=float, default=300.0,
                 help="past this many seconds the remaining shapes get --late-reps reps")
  p.add_argument("--late-reps", type=int, default=8)
  p.add_argument("--stop-after-s", type=float, default=380.0,
                 help="skip a shape that would end past this many seconds (keep it under "
                      "the caller's timeout)")
  p.add_argument("--peaks", choices=sorted(estimate.PEAKS),
                 help="published peaks for the estimate (default: from the device kind)")
  p.add_argument("--loss", choices=sorted(LOSSES), default="linear",
                 help="the step's loss: 'linear' (sum(y * r), the recorded runs) or 'mse' "
                      "(0.5 * sum((y - r)^2), whose cotangent depends on the forward as a "
                      "real loss's does)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, 2 reps, 1 warm-up: proves the script runs (any machine)")
  args = p.parse_args(argv)
  t_start = time.perf_counter()
  shapes = SMOKE_SHAPES if args.smoke else tuple(
      (s, shape) for s, shape in SHAPES if not args.shapes or s in args.shapes)
  reps, warmup = (2, 1) if args.smoke else (args.reps, args.warmup)
  arms = (BASELINE,) + tuple(a for a in ARMS if a != BASELINE and (not args.arms or a in args.arms))
  env = {**common.environment(), **device_info()}
  peaks_name, peaks, peaks_note = peaks_for(env["device_kind"], args.peaks)
  print(f"device {env['device_kind']} ({env['platform']}), jax {env['jax']}, jaxlib "
        f"{env['jaxlib']}, flax {env['flax']}; estimate with '{peaks_name}' peaks "
        f"({peaks_note})", flush=True)
  name = "gpu-smoke" if args.smoke else "gpu"
  payload = {
      "benchmark": "gpu_dense_train_step", "env": env, "complete": False,
      "step": ("jit(loss = sum(y * r)" if args.loss == "linear" else
               "jit(loss = 0.5 * sum((y - r)^2)") + " with random r; returns new state, loss "
              "and dL/dx: fwd + dgrad + wgrad + SGD update + fp8 state merge), donated state, "
              "arms interleaved",
      "dtypes": {"x": "bfloat16", "params": "float32", "compute": "bfloat16 (fp8 arms: "
                 "e4m3 forward operands, e5m2 output gradient)"},
      "arms": {a: make_layer(a, 1).__class__.__name__ + ("" if a == BASELINE else f" ({a})")
               for a in arms},
      "expected_fp8_products_per_step": 3,
      "estimate": {"label": "estimate (compile only)", "peaks_name": peaks_name,
                   "peaks_note": peaks_note, "flops": dict(peaks.flops), "hbm": peaks.hbm,
                   "kernel_floor_s": peaks.kernel_floor, "source": peaks.source,
                   "method": "per top-level kernel of the compiled step: max(FLOPs / peak of its "
                             "operand class, bytes / HBM bandwidth) + a per-kernel floor, summed "
                             "(fp8_linen.testing.estimate)"},
      "results": []}
  # `timeout` sends SIGTERM: turn it into an exception so the summary is still written.
  signal.signal(signal.SIGTERM, _stop)
  payload["skipped"] = []
  slowest = 0.0
  try:
    for label, shape in shapes:
      elapsed = time.perf_counter() - t_start
      if not args.smoke and elapsed + slowest > args.stop_after_s:
        print(f"{elapsed:.0f} s elapsed, the slowest shape took {slowest:.0f} s: {label} "
              f"skipped to end before {args.stop_after_s:.0f} s", flush=True)
        payload["skipped"].append(label)
        continue
      n = reps
      if not args.smoke and elapsed > args.budget_s and reps > args.late_reps:
        n = args.late_reps
        print(f"{elapsed:.0f} s elapsed (budget {args.budget_s:.0f} s): {label} gets {n} reps",
              flush=True)
      payload["results"].append(run_shape(label, shape, n, warmup, peaks, arms, args.loss))
      slowest = max(slowest, payload["results"][-1]["seconds"])
      payload["seconds"] = time.perf_counter() - t_start
      common.write_json(name, payload, args.out_dir)  # keep what is done so far
      print(f"-- {label} done at {payload['seconds']:.0f} s", flush=True)
  except KeyboardInterrupt:
    done = {r["label"] for r in payload["results"]}
    payload["skipped"] += [s for s, _ in shapes if s not in done and s not in payload["skipped"]]
    print(f"stopped at {time.perf_counter() - t_start:.0f} s; not run: {payload['skipped']}",
          flush=True)
  # The bars are about a GPU's fp8 GEMMs: on any other device (a smoke run on the CPU,
  # where every product is a bf16/f32 dot) they would only fail.
  on_gpu = env["platform"] == "gpu"
  payload["checks"] = checks(payload["results"]) if on_gpu else []
  payload["complete"] = not payload["skipped"]
  payload["seconds"] = time.perf_counter() - t_start
  path = common.write_json(name, payload, args.out_dir)
  print()
  print(summary(payload["results"]))
  failed = [c for c in payload["checks"] if not c["ok"]]
  if on_gpu:
    print(f"checks: {len(payload['checks']) - len(failed)}/{len(payload['checks'])} pass"
          + "".join(f"\n  FAIL {c['shape']} {c['arm']}: {c['check']} (got {c['value']:.3g})"
                    for c in failed))
  else:
    print(f"checks skipped: the device is {env['platform']!r}, not a GPU")
  print(f"wrote {path} in {payload['seconds']:.0f} s")
  return payload


if __name__ == "__main__":
  main()
