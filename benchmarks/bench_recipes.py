"""Train-step time and backward residual bytes per recipe, vs bf16 ``nn.Dense``.

For each square shape M=K=N, every arm (bf16 ``nn.Dense`` baseline and
``QDense`` with each recipe) runs the jitted training step of
``common.make_train_step`` (loss ``sum(y * r)`` with a random cotangent ``r``;
it returns the new state, the loss and dL/dx, so forward, dgrad and wgrad all
run; SGD update and the OWG state merge) on random inputs; variables (params,
scales, histories) are jit *arguments*. Arms are interleaved round by round in
one process; the median of ``--runs`` timed rounds after warm-up is reported
as a ratio to the baseline (min/max too). Residual bytes are those
``jax.ad_checkpoint.print_saved_residuals`` lists for the layer (input and
parameters the backward reads included; the fp8 state excluded); the planned
temp memory of the jitted step is recorded too.

  python benchmarks/bench_recipes.py --out benchmarks/results/cpu-recipes.json
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402

RECIPES = {
    "fp8_delayed": fl.delayed_scaling(16),
    "fp8_current": fl.current_scaling(),
    "fp8_rowwise": fl.rowwise_scaling(),
    "mx_block": fl.mx_block_scaling(),
    "int8_ste": fl.IntRecipe(input=fl.IntQuantConfig(bits=8),
                             kernel=fl.IntQuantConfig(bits=8, granularity="channel"),
                             compute_dtype="bfloat16"),
    "int8_lsq": fl.IntRecipe(input=fl.IntQuantConfig(bits=8, estimator="lsq"),
                             kernel=fl.IntQuantConfig(bits=8, estimator="lsq",
                                                      granularity="channel"),
                             compute_dtype="bfloat16"),
    "int4_lsq_plus": fl.IntRecipe(
        input=fl.IntQuantConfig(bits=4, symmetric=False, estimator="lsq+"),
        kernel=fl.IntQuantConfig(bits=4, symmetric=False, estimator="lsq+",
                                 granularity="channel"),
        compute_dtype="bfloat16"),
}


def main(argv=None) -> dict:
  """Runs the benchmark, writes ``--out`` (if given) and returns the payload."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--out", default=None, help="the JSON file to write")
  args = ap.parse_args(argv)
  out = {"meta": {**common.environment(), "device": jax.devices()[0].device_kind,
                  "backend": jax.default_backend(),
                  "dtype": "bfloat16 activations, float32 params", "runs": args.runs,
                  "step": "jit(loss = sum(y * r) with random r; returns new state, loss and "
                          "dL/dx: fwd + dgrad + wgrad + SGD update + fp8/int state merge), "
                          "donated state"},
         "results": {}}
  for n in args.sizes:
    arms = {"bf16_dense": nn.Dense(n, dtype=jnp.bfloat16)}
    arms.update({k: fl.QDense(n, dtype=jnp.bfloat16, recipe=r) for k, r in RECIPES.items()})
    x = jax.random.normal(jax.random.key(n), (n, n), jnp.bfloat16)
    rows = common.compare_train_arms(arms, x, baseline="bf16_dense", reps=args.runs,
                                     warmup=args.warmup, label=f"n={n:5d}")
    out["results"][str(n)] = rows
  if args.out:
    print("wrote", common.write_json_to(args.out, out))
  return out


if __name__ == "__main__":
  main()
