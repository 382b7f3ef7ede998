"""An MoE expert layer's grouped GEMMs per recipe on GPU targets (compile only): kernels and estimate.

The training step (forward, dgrad, wgrad; loss ``sum(y * r)``) of
``jax.lax.ragged_dot`` over ``--experts`` experts with ``--rows`` routed rows
spread evenly, ``(rows, k) x (experts, k, n)``, bf16 activations and float32
weights, per arm:

* ``bf16``: ``jax.lax.ragged_dot`` in bf16 (XLA's own lowering: on a GPU one
  dense GEMM over every expert, as for fp8);
* ``bf16_kernel``: the same three products in bf16 in the library's grouped
  kernels (``fp8_linen.core.grouped_kernels``): the fair float baseline;
* ``fp8_xla`` / ``fp8``: ``fl.fp8_ragged_dot`` (delayed scaling, one scale per
  expert) with the library's Pallas grouped GEMMs off / on (``fl.pallas_kernels``);
* ``fp8_e4m3_grads``: the same with e4m3 gradients (all three kernels fp8);
* ``fp8_bf16_weights``: ``fp8`` with the experts cast to bfloat16 first, as a
  bfloat16 model over float32 weights does, and told their parameters' dtype
  (``rhs_grad_dtype``; the layers leave it unset): the wgrad kernel writes float32;
* ``int8_xla`` / ``int8``: ``int_ragged_dot`` with ``grad_bits=8``.

On a TPU (``--targets tpu7x tpu-v6e``) XLA runs the forward and dgrad in its own
grouped Mosaic kernel; the library's kernel there is the wgrad (JAX's megablox
``tgmm``, where XLA convolves over every expert), so ``bf16_kernel`` is for GPUs
only and ``*_xla`` arms turn that wgrad kernel off.

Each step is compiled for the target (no GPU needed), its products listed
(kind, operand types, FLOPs) and its time estimated from the compiled program
at the target's published peaks (``fp8_linen.testing.estimate``): **estimates,
compile only**; the Triton kernels' real efficiency needs a GPU.

  python benchmarks/bench_grouped_gemm.py --out benchmarks/results/estimate-grouped-gemm.json
  python benchmarks/bench_grouped_gemm.py --rows 512 --k 256 --n 256 --targets h100  # quick
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fp8_linen as fl
from fp8_linen.core import grouped_kernels, int_product
from fp8_linen.testing.compile import compile_for

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEVICE = "estimate (compile only)"
TARGETS = ["h100", "b200"]
ARMS = ["bf16", "bf16_kernel", "fp8_xla", "fp8", "fp8_e4m3_grads", "fp8_bf16_weights",
        "int8_xla", "int8"]


def _loss(arm: str, groups: int, target: str):
  """``loss(x, w, r, gs)`` of one arm, with its quantization state made inside."""
  if arm == "bf16":
    return lambda x, w, r, gs: jnp.sum(
        jax.lax.ragged_dot(x, w.astype(jnp.bfloat16), gs).astype(jnp.float32) * r)
  if arm.startswith("int8"):
    recipe = fl.IntRecipe(gemm="int8", grad_bits=8,
                          kernel=fl.IntQuantConfig(granularity="channel"))
    return lambda x, w, r, gs: jnp.sum(int_product.int_ragged_dot(
        x, w, gs, recipe=recipe, input_params=(jnp.zeros((2,)),))[0].astype(jnp.float32) * r)
  # TPU7x multiplies fp8 only when asked (gemm='auto' is bf16 on every TPU).
  gemm = "fp8" if target == "tpu7x" else "auto"
  recipe = fl.Fp8Recipe(gemm=gemm)
  if arm == "fp8_e4m3_grads":
    recipe = fl.Fp8Recipe(gemm=gemm, output_grad=fl.ScalingConfig(dtype="float8_e4m3fn"))
  state = lambda shape: fl.RoleState(jnp.ones(shape), jnp.zeros(shape[:-1] + (16,)))

  cast = arm == "fp8_bf16_weights"

  def loss(x, w, r, gs):
    y, _ = fl.fp8_ragged_dot(x, w.astype(jnp.bfloat16) if cast else w, gs,
                             input_state=state((1,)), kernel_state=state((groups, 1)),
                             output_grad_state=state((1,)), recipe=recipe,
                             rhs_grad_dtype=w.dtype if cast else None)
    return jnp.sum(y.astype(jnp.float32) * r)
  return loss


def _kernel_step(x, w, r, sizes):
  """The bf16 step's three products in the grouped kernels (as the autodiff of ragged_dot
  gives them: bf16 output and input gradient, a float32 weight gradient)."""
  bf16 = {"scales": jnp.float32(1), "out_dtype": jnp.bfloat16}
  y = grouped_kernels.grouped_gemm(x, w, sizes, **bf16)
  g = r.astype(jnp.bfloat16)
  return (jnp.sum(y.astype(jnp.float32) * r),
          grouped_kernels.grouped_gemm(g, w, sizes, transpose_rhs=True, **bf16),
          grouped_kernels.grouped_wgrad(x, g, sizes))


def run_arm(target: str, arm: str, rows: int, k: int, n: int, groups: int) -> dict:
  """One arm's compiled step: its products and its estimate (compile only)."""
  sds = jax.ShapeDtypeStruct
  args = (sds((rows, k), jnp.bfloat16), sds((groups, k, n), jnp.float32),
          sds((rows, n), jnp.float32))
  sizes = np.full(groups, rows // groups, np.int32)
  if arm == "bf16_kernel":
    step = lambda x, w, r: _kernel_step(x, w.astype(jnp.bfloat16), r, sizes)
  else:
    loss = _loss(arm, groups, target)
    step = lambda x, w, r: jax.value_and_grad(loss, argnums=(0, 1))(x, w, r, sizes)
  with fl.pallas_kernels("off" if arm.endswith("_xla") else "auto"):
    report = compile_for(target, step, *args)
  est = report.estimate()
  products = [{"kind": p.kind, "operands": list(p.operands), "gflops": p.flops / 1e9}
              for p in report.product_list]
  return {"estimate_ms": est.seconds * 1e3, "product_ms": est.product_seconds * 1e3,
          "other_bytes": est.other_bytes,
          "products": products, "classes": report.classes,
          "gflops": sum(p.flops for p in report.product_list) / 1e9,
          "compile_s": round(report.compile_seconds, 1)}


def markdown(payload: dict) -> str:
  """The results as a table: estimate vs bf16 and the products per arm and target."""
  lines = ["| target | arm | step vs bf16 (estimate) | GEMM GFLOP | the three products |",
           "| --- | --- | ---: | ---: | --- |"]
  for target, rows in payload["results"].items():
    base = rows.get("bf16", next(iter(rows.values())))["estimate_ms"]
    for arm, row in rows.items():
      prods = ", ".join(f"{p['kind']} {'x'.join(sorted(set(p['operands'])))}"
                        for p in row["products"])
      lines.append(f"| {target} | {arm} | {row['estimate_ms'] / base:.2f} | "
                   f"{row['gflops']:.1f} | {prods} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=16384, help="routed rows (tokens x top-k)")
  p.add_argument("--k", type=int, default=4096)
  p.add_argument("--n", type=int, default=14336)
  p.add_argument("--experts", type=int, default=8)
  p.add_argument("--targets", nargs="+", default=TARGETS)
  p.add_argument("--arms", nargs="+", default=ARMS)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  results = {}
  for target in a.targets:
    results[target] = {}
    for arm in a.arms:
      row = run_arm(target, arm, a.rows, a.k, a.n, a.experts)
      results[target][arm] = row
      print(f"{target} {arm}: {row['estimate_ms']:.3f} ms (estimate), {row['gflops']:.1f} GFLOP,"
            f" {row['classes']}", flush=True)
  payload = {"meta": {"device": DEVICE, "shape": {"rows": a.rows, "k": a.k, "n": a.n,
                                                   "experts": a.experts},
                      "environment": common.environment()}, "results": results}
  return common.finish(payload, markdown(payload), a.out)


if __name__ == "__main__":
  main()
