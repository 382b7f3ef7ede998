"""Train-step time and backward residual bytes per recipe, vs bf16 ``nn.Dense``.

For each square shape M=K=N, every arm (bf16 ``nn.Dense`` baseline and
``QDense`` with each recipe) runs a jitted training step (forward, backward and
the OWG state update) with random inputs and a random cotangent; variables
(params, scales, histories) are jit *arguments*. Arms are interleaved round by
round in one process; the median of ``--runs`` timed rounds after warm-up is
reported as a ratio to the baseline (min/max too). Residual bytes are the sizes
of the arrays saved by ``jax.vjp`` for the backward pass (excluding the
variables themselves, which are alive anyway).

  PYTHONPATH=. python benchmarks/bench_recipes.py --out benchmarks/results/cpu-recipes.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8_linen as fl

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


def make_arm(model, n, key):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (n, n), jnp.bfloat16)
  ct = jax.random.normal(k2, (n, n), jnp.bfloat16)
  variables = flax.core.unfreeze(model.init(k3, x))

  def loss(v, x, ct):
    return jnp.sum(model.apply(v, x).astype(jnp.float32) * ct.astype(jnp.float32))

  @jax.jit
  def step(v, x, ct):
    g = jax.grad(loss)(v, x, ct)
    new = dict(v)
    new["params"] = jax.tree.map(lambda p, d: p - 1e-6 * d.astype(p.dtype), v["params"],
                                 g["params"])
    if fl.OWG in g:
      new[fl.OWG] = g[fl.OWG]
    return new

  # Residuals: what the vjp closure holds beyond the inputs themselves.
  _, vjp = jax.vjp(lambda v, x: model.apply(v, x), variables, x)
  inputs = {id(l) for l in jax.tree.leaves((variables, x))}
  res = [l for l in jax.tree.leaves(vjp) if hasattr(l, "nbytes") and id(l) not in inputs]
  res_bytes = int(sum(l.nbytes for l in res))
  return step, [variables, x, ct], res_bytes


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  out = {"meta": {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
                  "platform": platform.platform(), "jax": jax.__version__,
                  "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
                  "flax": flax.__version__, "optax": optax.__version__,
                  "dtype": "bfloat16 activations, float32 params", "runs": args.runs,
                  "step": "jit(grad + SGD update + OWG overwrite), random x and cotangent"},
         "results": {}}
  for n in args.sizes:
    arms = {"bf16_dense": nn.Dense(n, dtype=jnp.bfloat16)}
    arms.update({k: fl.QDense(n, dtype=jnp.bfloat16, recipe=r) for k, r in RECIPES.items()})
    built = {k: make_arm(m, n, jax.random.key(i)) for i, (k, m) in enumerate(arms.items())}
    times = {k: [] for k in built}
    for _ in range(args.warmup):
      for k, (step, a, _) in built.items():
        jax.block_until_ready(step(*a))
    for _ in range(args.runs):
      for k, (step, a, _) in built.items():
        t0 = time.perf_counter()
        jax.block_until_ready(step(*a))
        times[k].append(time.perf_counter() - t0)
    base_t = np.median(times["bf16_dense"])
    base_r = built["bf16_dense"][2]
    rows = {}
    for k, (_, _, rb) in built.items():
      t = np.asarray(times[k])
      rows[k] = {"median_ms": 1e3 * float(np.median(t)), "ratio_vs_bf16": float(np.median(t) / base_t),
                 "min_ratio": float(t.min() / base_t), "max_ratio": float(t.max() / base_t),
                 "residual_bytes": rb, "residual_ratio_vs_bf16": rb / base_r}
      print(f"n={n:5d} {k:>14}: {rows[k]['ratio_vs_bf16']:.2f}x bf16 "
            f"[{rows[k]['min_ratio']:.2f}, {rows[k]['max_ratio']:.2f}]  "
            f"residuals {rb / 2**20:.2f} MiB ({rows[k]['residual_ratio_vs_bf16']:.2f}x)")
    out["results"][str(n)] = rows
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
