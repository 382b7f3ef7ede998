"""Served-forward latency (int8, int4, fp8 from ``fl.convert``) next to the float models.

A small transformer-style MLP stack (``blocks`` x [Dense d->4d, gelu, Dense
4d->d, residual], d=512) is built from ``fl.QDense`` for each recipe, its
quantization state is filled by a few QAT steps, and it is converted with
``fl.convert``. Every arm's jitted forward is timed in one process,
interleaved, after warm-up; figures are medians (``common.time_interleaved``)
at batch 1 and 64. Arms:

* ``f32`` / ``bf16``: the same stack of ``nn.Dense`` in float32 / bfloat16
  (bf16 params and compute);
* ``int8``: served ``fl.int8_lsq()`` (``gemm='auto'``: on CPU the codes are
  multiplied as exact bf16 products where that is exact, XLA:CPU's faster
  kernel; int8 x int8 -> int32 elsewhere);
* ``int8_s8gemm``: the same with ``gemm='int8'``: an s8 x s8 -> s32 GEMM on CPU;
* ``int4``: served ``fl.int4_lsq_plus()`` (int4 storage, unpacked to int8 codes
  for the product);
* ``fp8``: served delayed-scaling fp8 (on CPU the e4m3 codes are upcast to bf16
  for the GEMM: XLA:CPU has no fp8 GEMM).

For each arm it records what the CPU compile multiplies (the operand types of
every dot) and, where the deviceless H100 compile is available, what XLA:GPU
selects for the served forward (cuBLAS GEMM targets and their operand types).

Usage: ``python benchmarks/bench_serving.py [--reps 20] [--quick] [--out-dir DIR]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the deviceless H100 compile needs it

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen.testing import hlo as hlo_text  # noqa: E402
from fp8_linen.testing import hlo_products  # noqa: E402
from fp8_linen.testing import targets  # noqa: E402
from fp8_linen.testing.compile import compile_for  # noqa: E402

_SIZES = {"full": {"d": 512, "blocks": 2, "batches": (1, 64)},
          "quick": {"d": 64, "blocks": 1, "batches": (1, 8)}}

RECIPES = {"int8": fl.int8_lsq(), "int8_s8gemm": dataclasses.replace(fl.int8_lsq(), gemm="int8"),
           "int4": fl.int4_lsq_plus(), "fp8": fl.Fp8Recipe()}


class Stack(nn.Module):
  """``blocks`` x (Dense d->4d, gelu, Dense 4d->d, residual)."""

  d: int
  blocks: int
  dense: callable = nn.Dense

  @nn.compact
  def __call__(self, x):
    for i in range(self.blocks):
      h = nn.gelu(self.dense(4 * self.d, name=f"up_{i}")(x))
      x = x + self.dense(self.d, name=f"down_{i}")(h)
    return x


def _float_arm(d, blocks, dtype):
  model = Stack(d, blocks, dense=lambda f, name: nn.Dense(f, dtype=dtype, param_dtype=dtype,
                                                          name=name))
  v = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, d), dtype))
  return model, v, dtype


def _served_arm(d, blocks, recipe):
  model = Stack(d, blocks, dense=lambda f, name: fl.QDense(f, recipe=recipe, name=name))
  keys = jax.random.split(jax.random.key(0), 4)
  calib = [jax.random.normal(k, (16, d)) for k in keys[:3]]
  v = jax.jit(model.init)(keys[3], calib[0])  # one compile, not one per op
  grad = jax.jit(jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))
  for x in calib:  # QAT steps that fill the fp8 histories (params unchanged)
    v = fl.merge_owg(v, grad(v, x))
  served, sp = fl.convert(model, v, calib[0])
  return served, sp, jnp.float32


def cpu_dots(hlo: str) -> list[str]:
  """``'lhs x rhs -> out'`` of every dot in an optimized HLO module."""
  return sorted(f"{p.operands[0]} x {p.operands[1]} -> {p.out}"
                for p in hlo_products.products(hlo_text.parse(hlo)) if p.kind == "dot")


def gpu_gemms(hlo: str) -> list[str]:
  """``'target: lhs x rhs'`` of every cuBLAS GEMM and remaining dot of an XLA:GPU module."""
  out = []
  for p in hlo_products.products(hlo_text.parse(hlo)):
    if p.kind == "cublas":
      out.append(f"{p.target}: {p.operands[0]} x {p.operands[1]}")
    elif p.kind == "dot":
      out.append(f"dot: {p.operands[0]} x {p.operands[1]} -> {p.out}")
  return sorted(out)


def h100_products(apply, params, x) -> dict | None:
  """What XLA:GPU compiles the served forward to, on a compile-only H100 (None if unavailable)."""
  if not targets.availability("h100"):
    return None
  report = compile_for("h100", apply, params, x)
  return {"gemms": gpu_gemms(report.hlo), "fp8_gemms": report.fp8_gemms,
          "all_gemms": report.gemms, "other_dots": report.other_dots}


def main(argv=None) -> dict:
  """Runs the benchmark, writes ``<device>-serving.json`` and returns its payload."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
  ap.add_argument("--no-h100", action="store_true", help="skip the deviceless H100 compile")
  ap.add_argument("--out-dir", default=None,
                  help="folder for <device>-serving.json (default: benchmarks/results)")
  args = ap.parse_args(argv)
  sizes = _SIZES["quick" if args.quick else "full"]
  d, blocks = sizes["d"], sizes["blocks"]
  arms = {"f32": _float_arm(d, blocks, jnp.float32), "bf16": _float_arm(d, blocks, jnp.bfloat16)}
  float_model = {k: v[0] for k, v in arms.items()}
  for name, recipe in RECIPES.items():
    arms[name] = _served_arm(d, blocks, recipe)
  results = {}
  for batch in sizes["batches"]:
    fns, info = {}, {}
    for name, (model, params, dtype) in arms.items():
      x = jax.random.normal(jax.random.key(batch), (batch, d)).astype(dtype)
      fn = jax.jit(model.apply)
      compiled = fn.lower(params, x).compile()
      fns[name] = (lambda c=compiled, p=params, x=x: c(p, x))
      info[name] = {"cpu_dots": cpu_dots(compiled.as_text()),
                    "weight_bytes": fl.weight_bytes(params)}
    times = common.time_interleaved(fns, reps=args.reps, warmup=args.warmup)
    base = times["f32"]["median_ms"]
    results[f"batch_{batch}"] = {
        name: dict(times[name], ratio_to_f32=times[name]["median_ms"] / base, **info[name])
        for name in arms}
  h100 = {}
  if not args.no_h100:
    for name, (model, params, dtype) in arms.items():
      h100[name] = h100_products(model.apply, params,
                                 jax.ShapeDtypeStruct((64, d), dtype))
  del float_model
  payload = {"benchmark": "serving", "device": "CPU" if jax.default_backend() == "cpu"
             else jax.devices()[0].device_kind,
             "model": f"{blocks} x (Dense {d}->{4 * d}, gelu, Dense {4 * d}->{d}, residual)",
             "timing": "jitted forward, arms interleaved in one process, median of "
                       f"{args.reps} runs after {args.warmup} warm-up rounds",
             "weight_bytes": "fl.weight_bytes: jnp.int4 counted at half a byte (in memory on "
                             "CPU an int4 array takes one byte per element)",
             "sizes": dict(sizes, quick=args.quick), "env": common.environment(),
             "results": results,
             "h100_compile": h100 or None,
             "h100_note": "deviceless compile for one H100 SXM (nothing ran): GEMM targets XLA:GPU "
                          "selected for the served forward at batch 64"}
  for batch, rows in results.items():
    print(batch, {k: round(r["median_ms"], 3) for k, r in rows.items()})
  print("wrote", common.write_json("serving", payload, args.out_dir))
  return payload


if __name__ == "__main__":
  main()
