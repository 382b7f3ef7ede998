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
  python benchmarks/bench_passes.py --before OLD.json   # ratios as "before -> now"

``--loss mse`` compiles the step with ``0.5 * sum((y - r)^2)`` (the cotangent
``y - r`` depends on the output, as a real loss's does) and ``--optimizer
sgd|adam`` has the step update the parameters, as a training loop's does
(``fp8_linen.testing.train_step``); the JSON's meta says which. The minimum
stays the linear step's.

  python benchmarks/bench_passes.py --targets h100 b200 --loss mse --optimizer adam \
      --out benchmarks/results/estimate-passes-mse-adam.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import flax.linen as nn
import jax.numpy as jnp

import fp8_linen as fl
from fp8_linen.testing import estimate, passes, targets, train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DEVICE = "estimate (compile only)"
TARGETS = ["h100", "b200", "tpu-v5e", "tpu-v6e", "tpu7x"]
ARMS = ["bf16", "fp8_delayed", "fp8_delayed_split", "fp8_current", "fp8_rowwise", "mxfp8",
        "mxfp8_jnp", "nvfp4", "nvfp4_jnp", "int8_ste"]
# Arms compiled with the library's Pallas kernels off: the jnp path they replace.
NO_KERNELS = {"mxfp8_jnp", "nvfp4_jnp"}
# fp8 delayed under fl.split_first_step: the branch it runs once every history holds an
# observation (every step but the first), compiled alone.
SPLIT = {"fp8_delayed_split"}


def arms(target: str) -> dict:
  """``{name: (model factory, low precision?)}`` of the recipes ``target`` runs.

  ``mxfp8_jnp`` and ``nvfp4_jnp`` run with ``fl.pallas_kernels('off')``
  (:data:`NO_KERNELS`); ``fp8_delayed_split`` is traced as ``fl.split_first_step``'s
  steady branch (:data:`SPLIT`).
  """
  out = {"bf16": (lambda n: nn.Dense(n, dtype=jnp.bfloat16), False)}
  gpu = {"fp8_delayed": fl.delayed_scaling(), "fp8_delayed_split": fl.delayed_scaling(),
         "fp8_current": fl.current_scaling(), "fp8_rowwise": fl.rowwise_scaling()}
  if target == "b200":
    gpu.update({"mxfp8": fl.mx_block_scaling(), "mxfp8_jnp": fl.mx_block_scaling(),
                "nvfp4": fl.nvfp4(), "nvfp4_jnp": fl.nvfp4()})
  recipes = gpu if targets.get_target(target).platform == "gpu" else {
      "fp8_delayed": fl.delayed_scaling(), "fp8_delayed_split": fl.delayed_scaling(),
      "int8_ste": fl.IntRecipe()}
  for name, recipe in recipes.items():
    out[name] = (lambda n, r=recipe: fl.QDense(n, dtype=jnp.bfloat16, recipe=r), True)
  return out


def run(m: int, k: int, n: int, target_names, loss: str = "linear",
        optimizer: str = "none") -> dict:
  rows = {}
  for target in common.compilable(target_names):
    table = {}
    for name, (make, low) in arms(target).items():
      steady = train_step.steady_branch() if name in SPLIT else contextlib.nullcontext()
      with fl.pallas_kernels("off" if name in NO_KERNELS else "auto"), steady:
        sp = passes.step_passes(make(n), (m, k), target=target, loss=loss,
                                optimizer=None if optimizer == "none" else optimizer)
      est = estimate.estimate(sp.report.kernel_list, estimate.PEAKS[target])
      table[name] = {"non_gemm_bytes": sp.total, "by_purpose": sp.by_purpose,
                     "step_seconds_estimate": est.seconds,
                     "kernels": [{"name": p.name, "purpose": p.purpose, "bytes": p.bytes,
                                  "first_step_only": not p.every_step}
                                 for p in sp.passes],
                     "minimum_bytes": passes.dense_minimum_bytes(m, k, n, low_precision=low)}
    base = table["bf16"]["non_gemm_bytes"]
    for row in table.values():
      row["vs_bf16"] = row["non_gemm_bytes"] / base
      row["step_vs_bf16_estimate"] = (row["step_seconds_estimate"] /
                                      table["bf16"]["step_seconds_estimate"])
      row["vs_minimum"] = row["non_gemm_bytes"] / row["minimum_bytes"]
    rows[target] = table
  return rows


def markdown(rows: dict, top: int = 3, before: dict | None = None) -> str:
  """The table of docs/accelerators.md (GiB); with ``before`` (an earlier run's
  ``results``), each arm's ratio to bf16's step as ``before -> now``."""
  gib = lambda b: f"{b / 2**30:.1f}"
  lines = ["| target | recipe | non-GEMM GiB | vs bf16's step | vs minimum | step vs bf16 "
           "(estimate) | largest passes (GiB) |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
  order = lambda keys, first: sorted(keys, key=lambda k: (first.index(k) if k in first
                                                          else len(first), k))
  for target in order(rows, TARGETS):
    table = rows[target]
    for name in order(table, ARMS):
      r = table[name]
      largest = sorted(r["by_purpose"].items(), key=lambda kv: -kv[1])[:top]
      big = ", ".join(f"{p} {gib(b)}" for p, b in largest)
      old = (before or {}).get(target, {}).get(name) if name != "bf16" else None
      pair = lambda key: (f"{old[key]:.2f} -> {r[key]:.2f}" if old and key in old
                          else f"{r[key]:.2f}")
      lines.append(f"| {target} | {name} | {gib(r['non_gemm_bytes'])} | {pair('vs_bf16')} | "
                   f"{r['vs_minimum']:.2f} | {pair('step_vs_bf16_estimate')} | {big} |")
  return "\n".join(lines)


LOSS_RUNS = (("sum(y * r)", "estimate-passes.json"), ("mse", "estimate-passes-mse.json"),
             ("mse + Adam", "estimate-passes-mse-adam.json"))
"""The runs of the by-loss table in docs/accelerators.md: (column, JSON under results/)."""


def loss_table(runs: dict, arms=("fp8_delayed", "fp8_delayed_split", "fp8_current", "mxfp8",
                                  "nvfp4")) -> str:
  """The by-loss table of docs/accelerators.md: for each GPU target and arm it
  runs, the non-GEMM bytes vs bf16's step and the step estimate vs bf16's, one
  column per run (``runs``: ``{column: results}``, each bf16 compiled in the
  same run)."""
  cols = list(runs)
  lines = ["| target | recipe | " + " | ".join(f"{c}: bytes / step vs bf16" for c in cols) + " |",
           "| --- | --- |" + " ---: |" * len(cols)]
  for target in [t for t in TARGETS if all(t in r for r in runs.values())]:
    for name in [a for a in arms if all(a in r[target] for r in runs.values())]:
      cells = [f"{runs[c][target][name]['vs_bf16']:.2f} / "
               f"{runs[c][target][name]['step_vs_bf16_estimate']:.2f}" for c in cols]
      lines.append(f"| {target} | {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--m", type=int, default=8 * 2048)
  p.add_argument("--k", type=int, default=8192)
  p.add_argument("--n", type=int, default=32768)
  p.add_argument("--targets", nargs="+", default=TARGETS)
  p.add_argument("--out", default=None)
  p.add_argument("--loss", default="linear", choices=["linear", "mse"])
  p.add_argument("--optimizer", default="none", choices=["none", "sgd", "adam"])
  p.add_argument("--before", default=None,
                 help="an earlier run's JSON: print each ratio as 'before -> now'")
  args = p.parse_args(argv)
  rows = run(args.m, args.k, args.n, args.targets, args.loss, args.optimizer)
  before = None
  if args.before:
    with open(args.before) as f:
      before = json.load(f)["results"]
  print(f"non-GEMM passes of a dense layer's step, x ({args.m}, {args.k}) -> {args.n}, "
        f"loss {args.loss}, optimizer {args.optimizer} ({DEVICE})")
  print(markdown(rows, before=before))
  payload = {"meta": {"device": DEVICE, "shape": {"m": args.m, "k": args.k, "n": args.n},
                      "loss": args.loss, "optimizer": args.optimizer,
                      **common.environment()},
             "results": rows}
  if args.out:
    common.write_json_to(args.out, payload)
  return payload


if __name__ == "__main__":
  main()
