"""The weight-gradient GEMM's output dtype, timed: ``rhs_grad_dtype`` on and off, one run.

A bfloat16 layer over float32 weights (TransformerEngine's dense example:
x (16384, 8192) bf16 -> 32768, float32 kernel) runs its training step
(forward, dgrad, wgrad; loss ``sum(y * r)``) three ways, interleaved in one
process (``common.time_interleaved``): bf16 (``x @ w.astype(bf16)``), fp8
delayed scaling with the weight's gradient written in bfloat16 and cast to
float32 in a pass of its own (``rhs_grad_dtype=None``, what the layers do),
and the same with the GEMM writing float32 (``rhs_grad_dtype=jnp.float32``).
On a GPU it times them; elsewhere the hint does nothing (only a GPU drops the
cast pair) and the script says so. Writes ``<device>-wgrad-dtype.json`` with
each arm's first compile in seconds.

``--optimizers`` adds the optimizer's update to the step (the weight and the
optimizer's state donated), because what the wgrad GEMM's output dtype costs
depends on who reads it: a step that returns the gradient pays a cast pass for
a bfloat16 one, while an optimizer in the same program fuses that cast into its
update and then reads half the bytes of a float32 one. ``--loss mse``
(``0.5 * sum((y - r)^2)``) makes the cotangent depend on the forward, as any
real loss does; with the linear loss XLA may fuse work of the forward into the
optimizer's update, which no real model allows.

  python benchmarks/bench_wgrad_dtype.py                 # on a GPU
  python benchmarks/bench_wgrad_dtype.py --optimizers none sgd adam --loss mse
  python benchmarks/bench_wgrad_dtype.py --m 256 --k 256 --n 512 --reps 3   # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402  pylint: disable=wrong-import-position

import fp8_linen as fl  # noqa: E402  pylint: disable=wrong-import-position
from fp8_linen.testing import train_step  # noqa: E402  pylint: disable=wrong-import-position
from fp8_linen.testing.train_step import LOSSES  # noqa: E402  pylint: disable=wrong-import-position

DN = (((1,), (0,)), ((), ()))


OPTIMIZERS = {"none": None, **train_step.OPTIMIZERS}


def _loss(arm: str, loss_of=LOSSES["linear"]):
  state = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((16,)))
  if arm == "bf16":
    return lambda w, x, r: loss_of((x @ w.astype(jnp.bfloat16)).astype(jnp.float32), r)
  hint = jnp.float32 if arm == "fp8_f32_wgrad" else None

  def loss(w, x, r, states):
    y, _ = fl.fp8_dot_general(x, w.astype(jnp.bfloat16), DN, input_state=states[0],
                              kernel_state=states[1], output_grad_state=states[2],
                              rhs_grad_dtype=hint)
    return loss_of(y.astype(jnp.float32), r)
  return lambda w, x, r: loss(w, x, r, (state(), state(), state()))


def _step(arm: str, optimizer: str, loss: str, w, x, r):
  """``(run, compiled)``: the step (loss and both gradients, then the update if any)."""
  grads = jax.value_and_grad(_loss(arm, LOSSES[loss]), argnums=(0, 1))
  if OPTIMIZERS[optimizer] is None:
    compiled = jax.jit(grads).lower(w, x, r).compile()
    return (lambda: compiled(w, x, r)), compiled
  tx = OPTIMIZERS[optimizer]()

  def step(w, opt_state, x, r):
    loss_value, (g_w, g_x) = grads(w, x, r)
    updates, opt_state = tx.update(g_w, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, loss_value, g_x

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(w, tx.init(w), x, r).compile()
  holder = {"w": jnp.copy(w), "opt": tx.init(w)}

  def run():  # the update writes into the donated weight and state, as in training
    holder["w"], holder["opt"], loss_value, g_x = compiled(holder["w"], holder["opt"], x, r)
    return holder["w"], loss_value, g_x
  return run, compiled


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--m", type=int, default=8 * 2048)
  p.add_argument("--k", type=int, default=8192)
  p.add_argument("--n", type=int, default=32768)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--out-dir", default=None)
  p.add_argument("--optimizers", nargs="+", choices=sorted(OPTIMIZERS), default=["none"],
                 help="what follows the gradients in the step ('none': they are returned)")
  p.add_argument("--loss", choices=sorted(LOSSES), default="linear")
  args = p.parse_args(argv)
  keys = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(keys[0], (args.k, args.n), jnp.float32) * 0.02
  x = jax.random.normal(keys[1], (args.m, args.k), jnp.bfloat16)
  r = jax.random.normal(keys[2], (args.m, args.n), jnp.float32)
  device = common.device_name()
  print(f"{device}: x ({args.m}, {args.k}) bf16 -> {args.n}, float32 weight, {args.loss} loss")
  if jax.default_backend() != "gpu":
    print("not a GPU: rhs_grad_dtype does nothing here, the two fp8 arms are one program")
  results, outs, compile_s = {}, {}, {}
  payload = {"device": device, "env": common.environment(),
             "shape": {"m": args.m, "k": args.k, "n": args.n}, "reps": args.reps,
             "loss": args.loss, "results": results, "compile_s": compile_s, "gpu_products": {}}
  for optimizer in args.optimizers:
    arms = {}
    for arm in ("bf16", "fp8_bf16_wgrad", "fp8_f32_wgrad"):
      key = arm if optimizer == "none" else f"{arm}+{optimizer}"
      t0 = time.perf_counter()
      arms[key], compiled = _step(arm, optimizer, args.loss, w, x, r)
      compile_s[key] = time.perf_counter() - t0
      outs[key] = sorted(common.gpu_products(compiled.as_text()).items())
      print(f"  {key:22s} compiled in {compile_s[key]:.1f} s", flush=True)
    times = common.time_interleaved(arms, reps=args.reps, warmup=3)
    base = times["bf16" if optimizer == "none" else f"bf16+{optimizer}"]["median_ms"]
    for arm, t in times.items():
      results[arm] = {**t, "vs_bf16": t["median_ms"] / base}
      print(f"  {arm:22s} {t['median_ms']:8.2f} ms  x{t['median_ms'] / base:.3f} bf16", flush=True)
    # Written after every optimizer, so a run stopped by its caller keeps what it timed.
    payload["gpu_products"] = {a: [list(kv) for kv in o] for a, o in outs.items()}
    common.write_json("wgrad-dtype", payload, out_dir=args.out_dir)
  return payload


if __name__ == "__main__":
  main()
