"""Gradient accumulation: weights quantized once per window vs once per micro-batch (compile only).

A two-layer MLP (d -> 4d -> d, GELU, bfloat16 compute over float32
parameters) accumulates the gradients of ``--micro`` micro-batches of
``--tokens`` tokens in one ``lax.scan`` (``fl.accumulate_microbatches``): with
``hoist=False`` every micro-batch casts each weight again (its amax, its codes
in both layouts; bf16's f32 -> bf16 cast), with ``hoist=True`` that work runs
once before the loop. Each arm's program is compiled for the target (no GPU
or TPU needed) and read: the non-GEMM bytes of the whole window
(``fp8_linen.testing.passes``, a loop body counted once per micro-batch) and
the roofline step estimate (``fp8_linen.testing.estimate``). Figures read from
compiled programs: estimates, not measurements.

The byte counter charges a kernel that slices one micro-batch out of the
stacked batch with the whole stacked operand, so every arm's figure includes
the same overcount; compare arms, not absolute bytes.

The same MLP is also stepped under ``optax.MultiSteps`` (Adam, one call per
micro-batch): the plain train step against ``fl.quantize_once_per_window``'s,
whose later calls of a window read the work on the parameters from a cache
(the branch of its program such a call runs), and whose first call also runs
the program that builds the cache. A window is ``--micro`` calls.

  python benchmarks/bench_accumulate.py --out benchmarks/results/estimate-accumulate.json
  python benchmarks/bench_accumulate.py --d 256 --tokens 128 --targets h100   # quick

``--measure`` times the windows on this machine instead (each arm jitted, random
inputs, arms interleaved, median of ``--reps``; the device is named in the JSON):

  python benchmarks/bench_accumulate.py --measure --d 1024 --tokens 1024 \
      --out benchmarks/results/cpu-accumulate.json
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8_linen as fl
from fp8_linen.testing import compile as compile_lib
from fp8_linen.testing import estimate, passes, targets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEVICE = "estimate (compile only)"
TARGETS = ["h100", "b200", "tpu-v5e", "tpu7x"]


class Mlp(nn.Module):
  """d -> 4d -> d with a GELU between; ``make(features)`` builds each projection."""

  make: object
  d: int

  @nn.compact
  def __call__(self, x):
    return self.make(self.d)(jax.nn.gelu(self.make(4 * self.d)(x)))


def recipes(target: str) -> dict:
  """``{arm: recipe or None (bf16)}`` for ``target``."""
  if targets.get_target(target).platform == "gpu":
    return {"bf16": None, "fp8_delayed": fl.delayed_scaling(),
            "fp8_current": fl.current_scaling()}
  return {"bf16": None, "fp8_delayed": fl.delayed_scaling(),
          "int8_grad8": fl.IntRecipe(grad_bits=8)}


def mlp_and_loss(recipe, d: int):
  """``(model, loss)``: the MLP (bf16 over float32 parameters; ``recipe`` None: flax's
  ``nn.Dense``) and its mean squared error ``loss(variables, (x, y))``."""
  make = ((lambda n: nn.Dense(n, dtype=jnp.bfloat16)) if recipe is None else
          (lambda n: fl.QDense(n, dtype=jnp.bfloat16, recipe=recipe)))
  model = Mlp(make, d)

  def loss(v, batch):
    x, y = batch
    out = model.apply(v, x).astype(jnp.float32)
    return 0.5 * jnp.mean(jnp.sum((out - y.astype(jnp.float32)) ** 2, axis=-1))

  return model, loss


def window(recipe, d: int, tokens: int, micro: int, *, hoist: bool, concrete: bool = False):
  """``(fn, args)``: one accumulation window's gradients of the MLP (abstract arguments,
  or initialized variables and random micro-batches with ``concrete``)."""
  model, loss = mlp_and_loss(recipe, d)
  init = lambda: model.init(jax.random.key(0), jnp.ones((8, d), jnp.bfloat16))
  variables = init() if concrete else jax.eval_shape(init)
  xs = jax.ShapeDtypeStruct((micro, tokens, d), jnp.bfloat16)
  ys = jax.ShapeDtypeStruct((micro, tokens, d), jnp.bfloat16)

  grad_fn = jax.grad(loss)
  fn = lambda v, xs, ys: fl.accumulate_microbatches(grad_fn, v, (xs, ys), hoist=hoist)
  if concrete:
    kx, ky = jax.random.split(jax.random.key(1))
    xs = jax.random.normal(kx, xs.shape, xs.dtype)
    ys = jax.random.normal(ky, ys.shape, ys.dtype)
  return fn, (variables, xs, ys)


def multisteps(recipe, d: int, tokens: int, micro: int):
  """``(plain step, wrapped step, state, (x, y))``: one ``optax.MultiSteps`` call of the MLP
  (abstract state and micro-batch)."""
  model, loss = mlp_and_loss(recipe, d)
  tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=micro)
  state = jax.eval_shape(lambda: fl.TrainState.create(
      apply_fn=model.apply, tx=tx,
      params=model.init(jax.random.key(0), jnp.ones((8, d), jnp.bfloat16))))

  def step(state, x, y):
    return state.apply_gradients(grads=jax.grad(loss)(state.params, (x, y)))

  xy = (jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16))
  return step, fl.quantize_once_per_window(step, every_k=micro), state, xy


def multisteps_arms(target: str, recipe, d: int, tokens: int, micro: int) -> dict:
  """The plain call, a cached call and the cache's program, compiled for ``target`` and read."""
  step, wrapped, state, xy = multisteps(recipe, d, tokens, micro)
  t = targets.get_target(target)
  rest, extra = state.replace(params=None), (xy, {})
  with fl.target_backend(t.platform, block_scaled=t.block_scaled_gemms):
    cache = jax.eval_shape(wrapped.prologue, state.params, rest, extra)
  reports = {
      "plain": compile_lib.compile_for(target, step, state, *xy),
      "cached": compile_lib.compile_for(target, wrapped.steady, state.params, rest, cache,
                                        state.opt_state.gradient_step, extra),
      "prologue": compile_lib.compile_for(target, wrapped.prologue, state.params, rest, extra)}
  out = {}
  for arm, report in reports.items():
    est = estimate.estimate(report.kernel_list, estimate.PEAKS[target])
    out[arm] = {"non_gemm_bytes": float(sum(p.bytes for p in passes.passes(report)
                                            if p.every_step)),
                "seconds_estimate": est.seconds,
                "products": sorted({"x".join(p.operands) for p in report.product_list})}
  out["cache_bytes"] = float(sum(np.prod(a.shape) * np.dtype(a.dtype).itemsize
                                 for a in jax.tree.leaves(cache)))
  return out


def run(d: int, tokens: int, micro: int, target_names) -> dict:
  rows = {}
  for target in common.compilable(target_names):
    table = {}
    for name, recipe in recipes(target).items():
      for hoist in (False, True):
        fn, args = window(recipe, d, tokens, micro, hoist=hoist)
        report = compile_lib.compile_for(target, fn, *args)
        ps = passes.passes(report)
        est = estimate.estimate(report.kernel_list, estimate.PEAKS[target])
        table[f"{name}{'_hoisted' if hoist else ''}"] = {
            "non_gemm_bytes": float(sum(p.bytes for p in ps if p.every_step)),
            "window_seconds_estimate": est.seconds,
            "products": sorted({"x".join(p.operands) for p in report.product_list}),
            "temp_bytes": report.temp_bytes}
    base = table["bf16"]
    for row in table.values():
      row["vs_bf16"] = row["window_seconds_estimate"] / base["window_seconds_estimate"]
      row["bytes_vs_bf16"] = row["non_gemm_bytes"] / base["non_gemm_bytes"]
    rows[target] = table
  return rows


def measure(d: int, tokens: int, micro: int, reps: int) -> dict:
  """``{arm: timing}`` of each recipe's window on this machine, per micro-batch and once."""
  platform = jax.devices()[0].platform
  arms = {}
  for name, recipe in recipes("tpu-v5e" if platform == "tpu" else "h100").items():
    for hoist in (False, True):
      fn, args = window(recipe, d, tokens, micro, hoist=hoist, concrete=True)
      step = jax.jit(fn)
      arms[f"{name}{'_hoisted' if hoist else ''}"] = lambda step=step, args=args: step(*args)
  rows = common.time_interleaved(arms, reps=reps)
  for row in rows.values():
    row["vs_bf16"] = row["median_ms"] / rows["bf16"]["median_ms"]
  return rows


def markdown(rows: dict) -> str:
  """Per target and recipe: the window's estimate and non-GEMM bytes against bf16's
  per-micro-batch window, and the estimate once per window against bf16's once per window."""
  lines = ["| target | recipe | window vs bf16's: per micro-batch -> once per window | "
           "vs bf16's window, both once per window | "
           "non-GEMM bytes vs bf16's: per micro-batch -> once per window |",
           "| --- | --- | ---: | ---: | ---: |"]
  for target in sorted(rows, key=lambda t: TARGETS.index(t) if t in TARGETS else len(TARGETS)):
    table = rows[target]
    for name in [k for k in table if not k.endswith("_hoisted")]:
      a, b = table[name], table[f"{name}_hoisted"]
      both = b["window_seconds_estimate"] / table["bf16_hoisted"]["window_seconds_estimate"]
      lines.append(f"| {target} | {name} | {a['vs_bf16']:.2f} -> {b['vs_bf16']:.2f} | "
                   f"{both:.2f} | {a['bytes_vs_bf16']:.2f} -> {b['bytes_vs_bf16']:.2f} |")
  return "\n".join(lines)


def run_multisteps(d: int, tokens: int, micro: int, target_names) -> dict:
  """``{target: {recipe: arms}}`` of :func:`multisteps_arms`."""
  return {target: {name: multisteps_arms(target, recipe, d, tokens, micro)
                   for name, recipe in recipes(target).items()}
          for target in common.compilable(target_names)}


def multisteps_markdown(rows: dict, micro: int) -> str:
  """Per target and recipe under ``optax.MultiSteps``: a later call of the window and the whole
  window (the cache's program once, ``micro`` calls), plain -> cached, against bf16's plain."""
  lines = ["| target | recipe | a later call vs bf16's: plain -> cached | "
           f"window ({micro} calls) vs bf16's: plain -> cached | "
           "non-GEMM GiB of a later call: plain -> cached | cache (MiB) |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
  for target in sorted(rows, key=lambda t: TARGETS.index(t) if t in TARGETS else len(TARGETS)):
    table = rows[target]
    base = table["bf16"]["plain"]
    for name, arms in table.items():
      call = lambda a: arms[a]["seconds_estimate"] / base["seconds_estimate"]
      window = (arms["prologue"]["seconds_estimate"] + micro * arms["cached"]["seconds_estimate"])
      moved = lambda a: arms[a]["non_gemm_bytes"] / 2**30
      lines.append(f"| {target} | {name} | {call('plain'):.2f} -> {call('cached'):.2f} | "
                   f"{call('plain'):.2f} -> {window / micro / base['seconds_estimate']:.2f} | "
                   f"{moved('plain'):.2f} -> {moved('cached'):.2f} | "
                   f"{arms['cache_bytes'] / 2**20:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d", type=int, default=4096)
  p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
  p.add_argument("--micro", type=int, default=4, help="micro-batches per window")
  p.add_argument("--targets", nargs="+", default=TARGETS)
  p.add_argument("--out", default=None)
  p.add_argument("--measure", action="store_true",
                 help="time the windows on this machine instead of compiling for --targets")
  p.add_argument("--reps", type=int, default=10)
  args = p.parse_args(argv)
  shape = {"d": args.d, "tokens": args.tokens, "micro": args.micro}
  head = (f"accumulation window: {args.micro} micro-batches of {args.tokens} tokens, MLP "
          f"{args.d} -> {4 * args.d} -> {args.d}")
  if args.measure:
    rows, device = measure(args.d, args.tokens, args.micro, args.reps), common.device_name()
    table = "\n".join([f"{head}, timed on {device}"] + [
        f"  {name:22s} {row['median_ms']:9.2f} ms  {row['vs_bf16']:.2f}x bf16's window"
        for name, row in rows.items()])
    shape["reps"] = args.reps
  else:
    rows, device = run(args.d, args.tokens, args.micro, args.targets), DEVICE
    steps = run_multisteps(args.d, args.tokens, args.micro, args.targets)
    table = (f"{head} ({DEVICE})\n{markdown(rows)}\n\nunder optax.MultiSteps, one call "
             f"per micro-batch ({DEVICE})\n{multisteps_markdown(steps, args.micro)}")
  payload = {"meta": {"device": device, "shape": shape, **common.environment()},
             "results": rows}
  if not args.measure:
    payload["multisteps"] = steps
  return common.finish(payload, table, args.out)


if __name__ == "__main__":
  main()
