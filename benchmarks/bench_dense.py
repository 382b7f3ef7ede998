"""QDense train step vs nn.Dense (f32, bf16) and flax's Fp8DirectDotGeneralOp.

Times the whole training step (``common.make_train_step``: forward, backward
with a random cotangent, SGD update and fp8 state merge; the step returns the
loss and dL/dx, so forward, dgrad and wgrad all run) for every arm,
interleaved in one process, and measures the residual bytes kept for the
backward pass and the step's planned memory. On a GPU it also counts the fp8
products in the compiled step (3 per layer expected).

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
from flax.linen import fp8_ops

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402


def make_arms(layer_factories: dict, shape: tuple[int, int, int], dtype_of: dict):
  """Builds, per arm, a compiled train step (``common.build_train_arm``) and its residuals.

  ``shape`` is ``(M, K, N)``: x is ``(M, K)``, the kernel ``(K, N)``. Every arm
  gets the same random x (in its dtype) and the same random cotangent.
  """
  m, k, _ = shape
  x32 = jax.random.normal(jax.random.key(2), (m, k), jnp.float32)
  arms, residuals = {}, {}
  for name, make in layer_factories.items():
    layer = make()
    arm = common.build_train_arm(layer, x32.astype(dtype_of[name]), seed=0)
    arms[name] = arm
    residuals[name] = common.residual_bytes(layer, arm.variables, arm.x)
  return arms, residuals


def main(argv=None) -> dict:
  """Runs the benchmark, writes the JSON and returns its payload."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  on_gpu = jax.default_backend() == "gpu"
  p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192] if on_gpu else [512, 1024, 2048])
  p.add_argument("--llm", action="store_true",
                 help="also the LLM projection shapes M=8192, (K, N) in {(4096, 4096), "
                      "(4096, 14336), (14336, 4096)} (default on GPU; minutes per shape on CPU)")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--lowerings", action="store_true",
                 help="also time QDense with each forced GEMM lowering (bf16, f32, fp8)")
  p.add_argument("--out-dir", default=None, help="folder for <device>-dense.json "
                 "(default: benchmarks/results)")
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
    arms, residuals = make_arms(sized, shape, {k: dtype_of.get(k, jnp.bfloat16) for k in sized})
    times = common.time_arms(arms, "bf16_dense", reps=args.reps)
    flax_t = times["flax_fp8_direct"]["median_ms"]
    # On CPU the floor is the faster of the bf16 and f32 layers (DESIGN.md section 4).
    floor = min(times[n]["median_ms"] for n in ("bf16_dense", "f32_dense"))
    base_res = residuals["bf16_dense"]["bytes"]
    row = {"M=K=N": size, "shape_MKN": list(shape), "arms": {}}
    for name in arms:
      t = {k: v for k, v in times[name].items() if not k.endswith("ratio")}
      mem = arms[name].memory or {}
      row["arms"][name] = {
          **t,
          "ratio_vs_bf16_dense": times[name]["ratio"],
          "ratio_vs_flax_fp8": times[name]["median_ms"] / flax_t,
          "ratio_vs_faster_plain_dense": times[name]["median_ms"] / floor,
          "residual_bytes": residuals[name]["bytes"],
          "residual_ratio_vs_bf16_dense": residuals[name]["bytes"] / base_res,
          "fp8_state_residual_bytes": residuals[name]["state_bytes"],
          "residuals": residuals[name]["entries"],
          "memory": mem,
          **({"gpu_products": arms[name].products} if arms[name].products else {}),
      }
      products = arms[name].products
      print(f"{size!s:>16} {name:18s} {times[name]['median_ms']:9.2f} ms  "
            f"x{times[name]['ratio']:5.2f} bf16  x{times[name]['median_ms'] / flax_t:5.2f} flax-fp8  "
            f"residuals x{residuals[name]['bytes'] / base_res:6.4f}  temp "
            f"{mem.get('temp_size_in_bytes', 0) / 2**20:7.1f} MiB"
            + (f"  fp8 {products['fp8_products']}/{products['products']}" if products else ""),
            flush=True)
    results.append(row)
  payload = {"benchmark": "dense_train_step", "env": common.environment(), "reps": args.reps,
             "step": "jit(loss = sum(y * r) with random r; returns new state, loss and dL/dx: "
                     "fwd + dgrad + wgrad + SGD update + fp8 state merge), donated state",
             "dtypes": {"x": "bfloat16 (f32 for f32_dense)", "params": "float32"},
             "results": results}
  print("wrote", common.write_json("dense", payload, args.out_dir))
  return payload


if __name__ == "__main__":
  main()
