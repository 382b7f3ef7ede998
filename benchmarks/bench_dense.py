"""QDense train step vs nn.Dense (f32, bf16) and flax's Fp8DirectDotGeneralOp.

Times the whole training step (forward, backward with a random cotangent, SGD
update and fp8 state merge) for every arm, interleaved in one process, and
measures the residual bytes kept for the backward pass. On a GPU it also counts
the fp8 cuBLASLt GEMMs in the compiled step (3 per layer expected).

Usage:
  python benchmarks/bench_dense.py            # CPU sizes 512, 1024, 2048
  python benchmarks/bench_dense.py --sizes 4096 8192 --reps 30   # on a GPU
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402


def make_arms(layer_factories: dict, shape: tuple[int, int, int], dtype_of: dict):
  """Builds, per arm, a jitted train step and its (state, x, ct) arguments.

  ``shape`` is ``(M, K, N)``: x is ``(M, K)``, the kernel ``(K, N)``.
  """
  m, k, n = shape
  key = jax.random.key(0)
  kx, kc = jax.random.split(key)
  arms, residuals, hlo = {}, {}, {}
  for name, make in layer_factories.items():
    layer = make()
    dt = dtype_of[name]
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dt)
    ct = jax.random.normal(kc, (m, n), jnp.float32).astype(dt)
    variables = layer.init(jax.random.key(1), x)
    state = fl.TrainState.create(apply_fn=layer.apply, params=variables, tx=optax.sgd(1e-3))

    def step(state, x, ct):
      grads = jax.grad(lambda v: jnp.sum((state.apply_fn(v, x) * ct).astype(jnp.float32)))(
          state.params)
      return state.apply_gradients(grads=grads)

    jstep = jax.jit(step, donate_argnums=0)
    holder = {"state": state}

    def run(jstep=jstep, holder=holder, x=x, ct=ct):
      holder["state"] = jstep(holder["state"], x, ct)
      return holder["state"]

    arms[name] = run
    params = variables["params"]
    owg = variables.get(fl.OWG, {})
    residuals[name] = common.residual_bytes(
        lambda p, owg, x, layer=layer: layer.apply({"params": p, **({fl.OWG: owg} if owg else {})}, x),
        params, owg, x)
    if jax.default_backend() == "gpu":
      text = jax.jit(step).lower(state, x, ct).compile().as_text()
      hlo[name] = common.count_in_hlo(text)
  return arms, residuals, hlo


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  on_gpu = jax.default_backend() == "gpu"
  p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192] if on_gpu else [512, 1024, 2048])
  p.add_argument("--llm", action="store_true",
                 help="also the LLM projection shapes M=8192, (K, N) in {(4096, 4096), "
                      "(4096, 14336), (14336, 4096)} (default on GPU; minutes per shape on CPU)")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--lowerings", action="store_true",
                 help="also time QDense with each forced GEMM lowering (bf16, f32, fp8)")
  args = p.parse_args(argv)

  factories = {
      "f32_dense": lambda: nn.Dense(0, use_bias=False),
      "bf16_dense": lambda: nn.Dense(0, use_bias=False, dtype=jnp.bfloat16),
      "flax_fp8_direct": lambda: nn.Dense(0, use_bias=False, dtype=jnp.bfloat16,
                                          dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp),
      "qdense_delayed": lambda: fl.QDense(0, use_bias=False, dtype=jnp.bfloat16),
      "qdense_current": lambda: fl.QDense(0, use_bias=False, dtype=jnp.bfloat16,
                                          recipe=fl.current_scaling()),
  }
  if args.lowerings:
    # The same recipe with each CPU lowering of the fp8 product forced.
    for gemm in ("bf16", "f32", "fp8"):
      factories[f"qdense_gemm_{gemm}"] = (
          lambda g=gemm: fl.QDense(0, use_bias=False, dtype=jnp.bfloat16,
                                   recipe=fl.Fp8Recipe(gemm=g)))
  dtype_of = {"f32_dense": jnp.float32}
  results = []
  shapes = [(s, s, s) for s in args.sizes]
  if args.llm or on_gpu:
    shapes += [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]
  for shape in shapes:
    size = "x".join(map(str, shape)) if len(set(shape)) > 1 else shape[0]
    sized = {k: (lambda f=f: f().clone(features=shape[2])) for k, f in factories.items()}
    arms, residuals, hlo = make_arms(sized, shape, {k: dtype_of.get(k, jnp.bfloat16) for k in sized})
    times = common.time_interleaved(arms, reps=args.reps)
    base = times["bf16_dense"]["median_ms"]
    flax_t = times["flax_fp8_direct"]["median_ms"]
    base_res = residuals["bf16_dense"]["bytes"]
    row = {"M=K=N": size, "shape_MKN": list(shape), "arms": {}}
    for name in arms:
      row["arms"][name] = {
          **times[name],
          "ratio_vs_bf16_dense": times[name]["median_ms"] / base,
          "ratio_vs_flax_fp8": times[name]["median_ms"] / flax_t,
          "residual_bytes": residuals[name]["bytes"],
          "residual_ratio_vs_bf16_dense": residuals[name]["bytes"] / base_res,
          "fp8_state_residual_bytes": residuals[name]["state_bytes"],
          "residuals": residuals[name]["entries"],
          **({"hlo_custom_calls": hlo[name]} if name in hlo else {}),
      }
      print(f"{size!s:>16} {name:18s} {times[name]['median_ms']:9.2f} ms  "
            f"x{times[name]['median_ms'] / base:5.2f} bf16  x{times[name]['median_ms'] / flax_t:5.2f} flax-fp8  "
            f"residuals x{residuals[name]['bytes'] / base_res:6.4f}"
            + (f"  {hlo[name]}" if name in hlo else ""), flush=True)
    results.append(row)
  payload = {"benchmark": "dense_train_step", "env": common.environment(), "reps": args.reps,
             "step": "fwd + bwd (random cotangent) + SGD update + fp8 state merge, jit, donated state",
             "dtypes": {"x": "bfloat16 (f32 for f32_dense)", "params": "float32"},
             "results": results}
  print("wrote", common.write_json("dense", payload))


if __name__ == "__main__":
  main()
