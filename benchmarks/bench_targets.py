"""Estimated step time of a decoder block per recipe on every accelerator (estimate, compile only).

For a pre-LN decoder block (causal-free self-attention and a GELU MLP;
d_model 1024, 4096 and 8192; 8192 tokens = batch 4 x sequence 2048; heads of
128; MLP 4 x d_model; bf16 activations, float32 parameters) each recipe is
applied by ``fl.quantize_model(block, recipe, rules=fl.projection_rules())``
(the projections quantized, the attention math in bf16, as users train) and
its training step (``fp8_linen.testing.train_step``: loss, dL/dx and all
gradients) is compiled for every one-device target: H100, B200, TPU v5e, v6e
and TPU7x (``fp8_linen.testing.targets``; no GPU or TPU needed). Per arm:

* what the program multiplies (products by operand class);
* the **estimated step time (estimate, compile only)**: per top-level kernel,
  max(FLOPs / the target's published peak for its operand class, bytes / HBM
  bandwidth) plus a per-kernel floor (``fp8_linen.testing.estimate``; the
  peaks and their sources are written into the JSON), and its ratio to bf16;
* the low-precision GEMMs' share of that time;
* the bytes read and written by the kernels without products (amax, cast,
  transpose, element-wise) against bf16's: the overhead fused kernels remove;
* the temp memory XLA plans.

Each target's compiles run in a child process: libtpu 0.0.42 crashes (a stack
overflow in its convolution cost model) on some attention programs for TPU7x,
and a crash must cost one cell, not the run.

**On a machine where JAX has a GPU or TPU** the same steps are also timed
there (median of ``--reps``, arms interleaved, random inputs and cotangent)
and the measured time is printed beside the estimate for that device (when it
is one of the targets). Here (CPU only) the script says no device was found
and prints the estimates.

Writes ``benchmarks/results/estimate-targets.json`` (device "estimate
(compile only)"); a measured run also writes ``<device>-targets.json``.

``--loss mse`` compiles the step with ``0.5 * sum((y - r)^2)`` instead of
``sum(y * r)``, so that the forward is ordered before the backward as in a
real model (``fp8_linen.testing.train_step``). ``--optimizer sgd|adam`` has
the step update the parameters (variables and optimizer state donated)
instead of returning their gradients, as a training loop's step does: then
XLA fuses the cast of each bfloat16 weight gradient into the update.

Usage:
  python benchmarks/bench_targets.py                       # all widths, targets, arms (~40 min)
  python benchmarks/bench_targets.py --widths 1024 --targets h100 tpu-v6e
  python benchmarks/bench_targets.py --quick --out /tmp/t.json   # tiny block, smoke run
  python benchmarks/bench_targets.py --tables benchmarks/results/estimate-targets.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = "estimate (compile only)"
ARMS = ("bf16", "fp8_delayed", "fp8_current", "fp8_rowwise", "mx_block", "nvfp4", "int8_ste",
        "int8_lsq", "int8_grad8", "int8_grad8_sr")
# Arms compiled only when asked for (--arms): not cells of the README table.
# ``fp8_delayed_split``: fp8 delayed under ``fl.split_first_step``, compiled as the
# branch it runs once every history holds an observation (every step but the
# first); timed on a device through the wrapped step itself.
EXTRA_ARMS = ("fp8_delayed_split",)
WIDTHS = (1024, 4096, 8192)
TARGETS = ("h100", "b200", "tpu-v5e", "tpu-v6e", "tpu7x")
# device_kind of a real device -> the target whose peaks its estimate uses.
KINDS = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100": "h100", "NVIDIA H200": "h200",
         "NVIDIA B200": "b200",
         "TPU v5 lite": "tpu-v5e", "TPU v6 lite": "tpu-v6e", "TPU7x": "tpu7x"}


def recipe(arm: str):
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  return {"bf16": None, "fp8_delayed": fl.delayed_scaling(),
          "fp8_delayed_split": fl.delayed_scaling(), "fp8_current": fl.current_scaling(),
          "fp8_rowwise": fl.rowwise_scaling(), "mx_block": fl.mx_block_scaling(),
          "nvfp4": fl.nvfp4(),
          "int8_ste": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel")),
          "int8_lsq": fl.int8_lsq(),
          "int8_grad8": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"), grad_bits=8),
          "int8_grad8_sr": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"),
                                        grad_bits=8, grad_stochastic_rounding=True)}[arm]


def model(arm: str, d: int, heads: int):
  """The block for one arm: unmodified (bf16) or quantized by path rules."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing.cases import DecoderBlock  # pylint: disable=import-outside-toplevel
  block = DecoderBlock(num_heads=heads, qkv_features=d, mlp=4 * d, dtype=jnp.bfloat16)
  r = recipe(arm)
  return block if r is None else fl.quantize_model(block, r, rules=fl.projection_rules())


def _shape(d: int, quick: bool) -> tuple[tuple[int, int, int], int]:
  return ((2, 64, d), max(d // 64, 1)) if quick else ((4, 2048, d), d // 128)


def row_of(report, est) -> dict:
  """One arm's JSON row from its compile report and estimate."""
  return {"estimate_ms": est.seconds * 1e3, "products": report.classes,
          "low_precision_products": report.low_precision,
          "all_products": len(report.product_list), "by_kind": report.by_kind,
          "low_precision_share": est.low_precision_share,
          "product_ms": est.product_seconds * 1e3, "other_bytes": est.other_bytes,
          "flops": est.flops, "kernels": len(est.kernels),
          "scalar_ops": sum(t.kernel.count for t in est.kernels if t.kernel.scalar),
          "temp_bytes": report.temp_bytes,
          "compile_s": report.compile_seconds}


def _optimizer(name: str):
  """The step's optimizer for ``compile_train_step``: ``None`` for ``'none'``."""
  return None if name == "none" else name


def child(target: str, d: int, arms: list[str], quick: bool, loss: str = "linear",
          optimizer: str = "none") -> None:
  """Compiles the arms for one target and width; one JSON line per arm on stdout."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing.compile import compile_train_step  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing import train_step  # pylint: disable=import-outside-toplevel
  shape, heads = _shape(d, quick)
  for arm in arms:
    steady = train_step.steady_branch() if arm.endswith("_split") else contextlib.nullcontext()
    with steady:
      r = compile_train_step(model(arm, d, heads), shape, jnp.bfloat16, target=target,
                             loss=loss, optimizer=_optimizer(optimizer))
    print("ROW " + json.dumps({"arm": arm, **row_of(r, r.estimate())}), flush=True)


def _run_child(target: str, d: int, arms: list[str], quick: bool, timeout: float,
               loss: str = "linear", optimizer: str = "none") -> dict:
  """``{arm: row}``; an arm whose compile crashed the process, or did not finish within
  ``timeout`` seconds, gets ``{"error": ...}``."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", target, str(d), *arms]
  cmd += (["--quick"] if quick else []) + ["--loss", loss, "--optimizer", optimizer]
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    rows = {}
    for line in stdout.splitlines():
      if line.startswith("ROW "):
        row = json.loads(line[4:])
        rows[row.pop("arm")] = row
    for arm in arms:
      rows.setdefault(arm, {"error": f"compile did not finish within {timeout:.0f} s"})
    return rows
  rows = {}
  for line in out.stdout.splitlines():
    if line.startswith("ROW "):
      row = json.loads(line[4:])
      rows[row.pop("arm")] = row
  missing = [a for a in arms if a not in rows]
  if missing and out.returncode != 0:
    if len(arms) > 1:  # find the arm that crashed; the others still get their row
      for arm in missing:
        rows.update(_run_child(target, d, [arm], quick, timeout, loss, optimizer))
    else:
      rows[arms[0]] = {"error": _crash_reason(out.stderr, out.returncode)}
  return rows


# libtpu logs this on every load here (no TPU worker hostnames); it is no reason for a crash.
_NOISE = "unexpected worker hostname"


def _crash_reason(stderr: str, returncode: int) -> str:
  """The line of a crashed child's stderr that says why: a compiler check, then an error."""
  lines = [l for l in stderr.splitlines() if _NOISE not in l]
  for marks in (("Check failed",), ("SIGSEGV", "Error")):
    found = [l for l in lines if any(m in l for m in marks)]
    if found:
      return found[-1][:300]
  return f"exit {returncode}"


def _ratios(rows: dict) -> None:
  base = rows.get("bf16", {})
  for row in rows.values():
    if "estimate_ms" in row and "estimate_ms" in base:
      row["ratio_vs_bf16"] = row["estimate_ms"] / base["estimate_ms"]
      row["other_bytes_vs_bf16"] = row["other_bytes"] / base["other_bytes"]


def probe_device(env) -> tuple[str, str]:
  """``(backend, device_kind)`` as a plain JAX process sees them (asked in a subprocess)."""
  code = "import jax; d = jax.devices()[0]; print(d.platform); print(d.device_kind)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False, env=env).stdout.strip().splitlines()
  return (out[-2], out[-1]) if len(out) >= 2 else ("cpu", "cpu")


def measure(widths, arms, reps: int, quick: bool, loss: str = "linear",
            optimizer: str = "none") -> dict:
  """Times each arm's step on the local GPU/TPU; estimates it with that device's peaks."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, HERE)
  import common  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing import estimate, hlo, hlo_kernels  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing.train_step import make_train_step, optimizer_of  # pylint: disable=import-outside-toplevel
  kind = jax.devices()[0].device_kind
  peaks = estimate.PEAKS.get(KINDS.get(kind, ""))
  result = {"device_kind": kind, "estimated_with": KINDS.get(kind), "widths": {}}
  for d in widths:
    shape, heads = _shape(d, quick)
    fns, rows = {}, {}
    for i, arm in enumerate(arms):
      m = model(arm, d, heads)
      x = jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
      t0 = time.perf_counter()
      # Jitted: an eager init of the wide blocks spends minutes dispatching op by op.
      v = jax.jit(m.init)(jax.random.key(0), x)
      r = jax.random.normal(jax.random.key(1), shape, jnp.float32)
      tx = optimizer_of(_optimizer(optimizer))
      step = make_train_step(m, loss=loss, optimizer=tx)
      if arm.endswith("_split"):
        # Its steady branch runs once every history holds an observation: one step first.
        if tx is None:
          v = fl.merge_owg(v, jax.jit(step)(v, x, r)[2])
        else:
          v = jax.jit(step)(v, tx.init(v["params"]), x, r)[2]
        step = fl.split_first_step(step)
      if tx is None:
        compiled = jax.jit(step).lower(v, x, r).compile()
        fns[arm] = (lambda s, v, x, r: lambda: s(v, x, r))(compiled, v, x, r)
      else:  # the update writes into the donated variables and optimizer state
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
            v, tx.init(v["params"]), x, r).compile()
        fns[arm] = _donating_run(compiled, v, tx.init(v["params"]), x, r)
      rows[arm] = {"compile_s": time.perf_counter() - t0}
      print(f"{kind} d={d} {arm:12s} initialized and compiled in {rows[arm]['compile_s']:.1f} s",
            flush=True)
      if peaks is not None:
        module = hlo.parse(compiled.as_text())
        est = estimate.estimate(hlo_kernels.kernels(module), peaks)
        rows[arm]["estimate_ms"] = est.seconds * 1e3
    times = common.time_interleaved(fns, reps=reps, warmup=3)
    for arm in arms:
      rows[arm].update(measured_ms=times[arm]["median_ms"], min_ms=times[arm]["min_ms"],
                       max_ms=times[arm]["max_ms"])
    result["widths"][str(d)] = rows
    for arm in arms:
      row = rows[arm]
      est = f"{row['estimate_ms']:.2f} ms" if "estimate_ms" in row else "no estimate"
      print(f"{kind} d={d} {arm:12s} measured {row['measured_ms']:.2f} ms "
            f"(x{row['measured_ms'] / rows[arms[0]]['measured_ms']:.2f})  estimated {est}",
            flush=True)
  return result


def _donating_run(compiled, variables, opt_state, x, r):
  """One training step per call, each on the state the previous one returned."""
  held = [variables, opt_state]

  def run():
    loss, dx, held[0], held[1] = compiled(held[0], held[1], x, r)
    return loss, dx, held[0]
  return run


def measure_only(args, arms) -> dict:
  """``--measure-only``: each width timed on the local device, the JSON rewritten after each."""
  sys.path.insert(0, HERE)
  import common  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  payload = {"device": None, "env": common.environment(), "arms": arms, "reps": args.reps,
             "widths": {}, "complete": False,
             "model": "pre-LN decoder block as in estimate-targets.json, 4 x 2048 tokens",
             "loss": args.loss, "optimizer": args.optimizer}
  out_dir = os.path.dirname(args.out)
  for d in args.widths:
    result = measure([d], arms, args.reps, args.quick, args.loss, args.optimizer)
    payload["device"] = result["device_kind"]
    payload["estimated_with"] = result["estimated_with"]
    payload["widths"].update(result["widths"])
    payload["seconds"] = time.perf_counter() - t0
    path = common.write_json("targets-measured", payload, out_dir=out_dir)
  payload["complete"] = True
  path = common.write_json("targets-measured", payload, out_dir=out_dir)
  print(f"wrote {path}")
  return payload


LABELS = {"fp8_delayed": "fp8 delayed", "fp8_delayed_split": "fp8 delayed, split first step", "fp8_current": "fp8 current", "fp8_rowwise": "fp8 row-wise",
          "mx_block": "MXFP8", "nvfp4": "NVFP4", "int8_ste": "int8 STE", "int8_lsq": "int8 LSQ",
          "int8_grad8": "int8 STE, grad_bits=8",
          "int8_grad8_sr": "int8 STE, grad_bits=8, stochastic rounding"}
NAMES = {"h100": "H100", "b200": "B200", "tpu-v5e": "TPU v5e", "tpu-v6e": "TPU v6e",
         "tpu7x": "TPU7x"}


def ratio_cell(rows: dict) -> str:
  """``'1.07 / 0.80 / 0.70'``: estimated ratio to bf16 per width (``-`` where it failed)."""
  return " / ".join(f"{r['ratio_vs_bf16']:.2f}" if "ratio_vs_bf16" in r else "-" for r in rows)


# The recipe each target's users train with, for the headroom table (``floor_rows``).
FLOOR_ARMS = (("h100", "fp8_delayed"), ("b200", "fp8_delayed"), ("b200", "mx_block"),
              ("b200", "nvfp4"), ("tpu-v5e", "int8_grad8"), ("tpu-v6e", "int8_grad8"),
              ("tpu7x", "fp8_delayed"))


def floor_ratio(bf16: dict, arm: dict) -> float:
  """The step vs bf16 if ``arm``'s non-GEMM kernels took exactly bf16's own non-GEMM time.

  Fusing the quantization passes can remove what the quantized step adds
  outside its GEMMs, not the work bf16's step already does there (attention's
  softmax, the norms, the residuals, the bias and weight-gradient passes), so
  this is about the best that fusion alone can give: ``(arm's GEMM time +
  bf16's non-GEMM time) / bf16's step``.
  """
  return (arm["product_ms"] + bf16["estimate_ms"] - bf16["product_ms"]) / bf16["estimate_ms"]


def floor_rows(results: dict, widths) -> list[str]:
  """The headroom table: each main recipe's step now, its floor and its GEMMs alone."""
  out = ["| target | recipe | step vs bf16 now | if its non-GEMM time were bf16's "
         "| its GEMMs alone vs bf16's step |", "| --- | --- | ---: | ---: | ---: |"]
  for t, arm in FLOOR_ARMS:
    rows = [results.get(t, {}).get(str(w), {}) for w in widths]
    if not all("estimate_ms" in r.get(a, {}) for r in rows for a in ("bf16", arm)):
      continue
    fmt = lambda f: " / ".join(f"{f(r['bf16'], r[arm]):.2f}" for r in rows)
    out.append(f"| {NAMES[t]} | {LABELS[arm]} | {fmt(lambda b, q: q['ratio_vs_bf16'])} | "
               f"{fmt(floor_ratio)} | {fmt(lambda b, q: q['product_ms'] / b['estimate_ms'])} |")
  return out


def tables(payload: dict) -> str:
  """The markdown tables the README and docs/accelerators.md quote, from the JSON."""
  results, out = payload["results"], []
  targets = [t for t in TARGETS if t in results]
  widths = sorted({int(w) for t in targets for w in results[t]})
  out.append("| recipe | " + " | ".join(NAMES[t] for t in targets) + " |")
  out.append("| --- |" + " ---: |" * len(targets))
  present = {a for t in targets for r in results[t].values() for a in r}
  for arm, label in LABELS.items():
    if arm in EXTRA_ARMS and arm not in present:
      continue
    cells = [ratio_cell([results[t].get(str(w), {}).get(arm, {}) for w in widths])
             for t in targets]
    out.append(f"| {label} | " + " | ".join(cells) + " |")
  out.append("")
  out.append("| target, d_model | bf16 ms | fp8 delayed ms | fp8: low-precision GEMMs' share "
             "| fp8: non-GEMM bytes vs bf16 | int8 STE ms |")
  out.append("| --- | ---: | ---: | ---: | ---: | ---: |")
  for t in targets:
    for w in widths:
      r = results[t].get(str(w), {})
      b, f, i = (r.get(a, {}) for a in ("bf16", "fp8_delayed", "int8_ste"))
      if "estimate_ms" not in b or "estimate_ms" not in f:
        continue
      int8 = f"{i['estimate_ms']:.2f}" if "estimate_ms" in i else "-"
      out.append(f"| {NAMES[t]}, {w} | {b['estimate_ms']:.2f} | {f['estimate_ms']:.2f} | "
                 f"{f['low_precision_share']:.0%} | {f['other_bytes_vs_bf16']:.2f}x | {int8} |")
  out.append("")
  out.extend(floor_rows(results, widths))
  return "\n".join(out)


def _payload(args, results, t0, measured, *, complete: bool) -> dict:
  """The JSON written for a run (``complete=False`` while targets remain)."""
  import common  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing import estimate  # pylint: disable=import-outside-toplevel
  return {
      "device": DEVICE, "env": common.environment(), "seconds": time.perf_counter() - t0,
      "model": {"what": "pre-LN decoder block (attention + GELU MLP), quantize_model with "
                        "projection_rules(); train step returns loss, dL/dx and " + (
                            "gradients" if args.optimizer == "none" else
                            f"the variables updated by {args.optimizer} (donated)"),
                "optimizer": args.optimizer,
                "loss": "sum(y * r)" if args.loss == "linear" else "0.5 * sum((y - r)^2)",
                "tokens": "2 x 64 (quick)" if args.quick else "4 x 2048",
                "heads": "d/64 (quick)" if args.quick else "d/128", "mlp": "4 d",
                "activations": "bfloat16", "params": "float32"},
      "method": "estimate (compile only): per top-level kernel max(FLOPs/peak for its operand "
                "class, bytes/HBM bandwidth) + a per-kernel floor (on a TPU, the scalar "
                "floor for a scalar-unit instruction), summed; collectives excluded",
      "peaks": {t: {"flops": dict(estimate.PEAKS[t].flops), "hbm": estimate.PEAKS[t].hbm,
                    "kernel_floor_s": estimate.PEAKS[t].kernel_floor,
                    "scalar_floor_s": estimate.PEAKS[t].scalar_floor,
                    "source": estimate.PEAKS[t].source} for t in args.targets},
      "results": results, "measured": measured, "complete": complete}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
  p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
  p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS + EXTRA_ARMS)
  p.add_argument("--reps", type=int, default=20, help="timed runs on a real device")
  p.add_argument("--quick", action="store_true", help="a tiny block (smoke run)")
  p.add_argument("--loss", choices=("linear", "mse"), default="linear",
                 help="the step's loss (fp8_linen.testing.train_step.LOSSES): 'linear' "
                      "(sum(y * r), the recorded runs) or 'mse', whose cotangent depends on "
                      "the forward as a real loss's does"),
  p.add_argument("--optimizer", choices=("none", "sgd", "adam"), default="none",
                 help="what follows the gradients in the step (fp8_linen.testing.train_step."
                      "OPTIMIZERS): 'none' (they are returned, the recorded runs) or the "
                      "optimizer whose update the step runs, as a training loop's does")
  p.add_argument("--out", default=os.path.join(HERE, "results", "estimate-targets.json"))
  p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
  p.add_argument("--child-timeout", type=float, default=1200,
                 help="seconds one target and width may compile before its cells are given up")
  p.add_argument("--measure-only", action="store_true",
                 help="only time the arms on this machine's GPU/TPU (no compile-only targets); "
                      "writes <device>-targets-measured.json after each width")
  p.add_argument("--tables", metavar="JSON",
                 help="print the markdown tables of a results file and exit")
  args = p.parse_args(argv)
  if args.tables:
    with open(args.tables) as f:
      print(tables(json.load(f)))
    return {}
  if args.child:
    child(args.child[0], int(args.child[1]), args.child[2:], args.quick, args.loss,
          args.optimizer)
    return {}
  arms = ["bf16"] + [a for a in args.arms if a != "bf16"]
  if args.measure_only:
    return measure_only(args, arms)
  # This process only compiles: keep JAX (and its GPU/TPU plugins) on the CPU. The device
  # probe and the measurement run in their own processes, with the user's environment.
  env = dict(os.environ)
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, HERE)
  import common  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  results = {}
  for target in args.targets:
    results[target] = {}
    for d in args.widths:
      rows = _run_child(target, d, arms, args.quick, args.child_timeout, args.loss,
                        args.optimizer)
      _ratios(rows)
      results[target][str(d)] = rows
      # What has compiled so far, so a long run that is stopped keeps its rows.
      common.write_json_to(args.out, _payload(args, results, t0, None, complete=False))
      for arm in arms:
        row = rows.get(arm, {"error": "not compiled"})
        if "error" in row:
          print(f"{target:8s} d={d:<5d} {arm:12s} FAILED: {row['error']}", flush=True)
          continue
        print(f"{target:8s} d={d:<5d} {arm:12s} estimate {row['estimate_ms']:9.2f} ms "
              f"x{row.get('ratio_vs_bf16', float('nan')):.2f} bf16; low-precision GEMMs "
              f"{row['low_precision_share']:.0%} of it; non-GEMM bytes "
              f"x{row.get('other_bytes_vs_bf16', float('nan')):.2f} bf16; products "
              f"{row['products']}", flush=True)
  backend, kind = probe_device(env)
  measured = None
  if backend in ("gpu", "tpu"):
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import bench_targets as b, json; "
            f"print('MEASURED ' + json.dumps(b.measure({args.widths!r}, {arms!r}, "
            f"{args.reps}, {args.quick}, {args.loss!r}, {args.optimizer!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, env=env)
    print(out.stdout, end="")
    lines = [l for l in out.stdout.splitlines() if l.startswith("MEASURED ")]
    measured = json.loads(lines[-1][9:]) if lines else {"error": out.stderr[-500:]}
  else:
    print(f"no GPU or TPU found (jax sees {kind!r}): estimates only, nothing timed")
  payload = _payload(args, results, t0, measured, complete=True)
  common.write_json_to(args.out, payload)
  if measured and "device_kind" in measured:
    common.write_json("targets", {"device": measured["device_kind"], **payload},
                      out_dir=os.path.dirname(args.out))
  print(f"wrote {args.out}")
  return payload


if __name__ == "__main__":
  main()
