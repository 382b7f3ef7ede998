"""The passes around a dense layer's GEMMs, per recipe and target (compile only): bytes and purposes.

The dense layer of TransformerEngine's JAX example by default: x (8 * 2048,
8192) bf16 -> 32768 features, float32 parameters; forward, dgrad and wgrad
(``fp8_linen.testing.train_step``). Each arm's training step is compiled for
the target (no GPU or TPU needed) and its non-GEMM kernels are listed with
the bytes each moves per step and what it is for
(``fp8_linen.testing.passes``). Per arm: the non-GEMM bytes against bf16's
step and against the minimum (each high-precision operand read once, each
code layout written once: ``passes.dense_minimum_bytes``), and the bytes by
purpose. Figures read from compiled programs: estimates, not measurements.

  python benchmarks/bench_passes.py --out benchmarks/results/estimate-passes.json
  python benchmarks/bench_passes.py --m 512 --k 256 --n 256 --targets h100   # quick
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax.numpy as jnp

import fp8_linen as fl
from fp8_linen.testing import passes, targets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEVICE = "estimate (compile only)"


def arms(target: str) -> dict:
  """``{name: (model factory, low precision?)}`` of the recipes ``target`` runs."""
  out = {"bf16": (lambda n: nn.Dense(n, dtype=jnp.bfloat16), False)}
  gpu = {"fp8_delayed": fl.delayed_scaling(), "fp8_current": fl.current_scaling(),
         "fp8_rowwise": fl.rowwise_scaling()}
  if target == "b200":
    gpu.update({"mxfp8": fl.mx_block_scaling(), "nvfp4": fl.nvfp4()})
  recipes = gpu if targets.get_target(target).platform == "gpu" else {
      "fp8_delayed": fl.delayed_scaling(), "int8_ste": fl.IntRecipe()}
  for name, recipe in recipes.items():
    out[name] = (lambda n, r=recipe: fl.QDense(n, dtype=jnp.bfloat16, recipe=r), True)
  return out


def run(m: int, k: int, n: int, target_names) -> dict:
  rows = {}
  for target in target_names:
    if not targets.availability(target):
      print(f"{target}: cannot compile here ({targets.availability(target).reason})")
      continue
    table = {}
    for name, (make, low) in arms(target).items():
      sp = passes.step_passes(make(n), (m, k), target=target)
      table[name] = {"non_gemm_bytes": sp.total, "by_purpose": sp.by_purpose,
                     "kernels": [{"name": p.name, "purpose": p.purpose, "bytes": p.bytes,
                                  "first_step_only": not p.every_step}
                                 for p in sp.passes],
                     "minimum_bytes": passes.dense_minimum_bytes(m, k, n, low_precision=low)}
    base = table["bf16"]["non_gemm_bytes"]
    for row in table.values():
      row["vs_bf16"] = row["non_gemm_bytes"] / base
      row["vs_minimum"] = row["non_gemm_bytes"] / row["minimum_bytes"]
    rows[target] = table
  return rows


def markdown(rows: dict, top: int = 3) -> str:
  """The table of docs/accelerators.md."""
  lines = ["| target | recipe | non-GEMM MiB | vs bf16's step | vs minimum | largest passes (MiB) |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
  for target, table in rows.items():
    for name, r in table.items():
      big = ", ".join(f"{p} {b / 2**20:.0f}" for p, b in list(r["by_purpose"].items())[:top])
      lines.append(f"| {target} | {name} | {r['non_gemm_bytes'] / 2**20:.0f} | "
                   f"{r['vs_bf16']:.2f} | {r['vs_minimum']:.2f} | {big} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--m", type=int, default=8 * 2048)
  p.add_argument("--k", type=int, default=8192)
  p.add_argument("--n", type=int, default=32768)
  p.add_argument("--targets", nargs="+", default=["h100", "b200", "tpu-v5e", "tpu-v6e", "tpu7x"])
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rows = run(args.m, args.k, args.n, args.targets)
  print(f"non-GEMM passes of a dense layer's step, x ({args.m}, {args.k}) -> {args.n} "
        f"({DEVICE})")
  print(markdown(rows))
  payload = {"meta": {"device": DEVICE, "shape": {"m": args.m, "k": args.k, "n": args.n},
                      **common.environment()},
             "results": rows}
  if args.out:
    common.write_json_to(args.out, payload)
  return payload


if __name__ == "__main__":
  main()
