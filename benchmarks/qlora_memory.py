"""QLoRA's memory, from the compiled training step: the frozen base held as codes.

A stack of bias-free dense layers (an MLP block's shape) is fine-tuned by
low-rank adapters on a frozen base, in these arms:

* ``bf16_full``: every bf16 weight trained (the gradient of all of them);
* ``bf16_lora``: adapters on a frozen bf16 base (written out here: ``x W +
  s (x A) B``);
* ``qlora_*``: adapters on the served model of :func:`fp8_linen.ptq`
  (:func:`fp8_linen.add_lora`): int4 per channel, int4 per group of 64,
  int8 per channel (weight-only), fp8 delayed and w8a8 int8 bases.

For each arm: the bytes of the frozen base as stored (:func:`fp8_linen.weight_bytes`)
against the bf16 weights', and from the compiled programs of one step (the
gradient of the adapters) for the CPU and, where the CUDA plugin is
installed, an H100 (compile only): their argument and scratch (temp) bytes; and
the residuals the backward pass keeps (``jax.ad_checkpoint.print_saved_residuals``
outside jit): those of a weight's shape, with their dtypes (what is held of
the frozen base between forward and backward: codes, or a float copy), and
the others (activations, adapter products).
These are the program's planned memory (an estimate of what a device would
hold), not a measurement of a device.

  python benchmarks/qlora_memory.py --out benchmarks/results/cpu-qlora-memory.json
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8_linen as fl
from fp8_linen.testing import compile as tcompile
from fp8_linen.testing import targets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


class Stack(nn.Module):
  d: int
  layers: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = nn.Dense(self.d, use_bias=False, name=f"dense_{i}")(x)
      if i < self.layers - 1:
        x = nn.gelu(x)
    return x


def _bf16_lora_step(model, params, x, rank):
  """Adapters on a frozen bf16 base, by hand: the baseline QLoRA is measured against."""
  kernels = {k: v["kernel"] for k, v in params["params"].items()}
  keys = jax.random.split(jax.random.key(0), len(kernels))
  adapters = {k: {"a": 0.01 * jax.random.normal(kk, (w.shape[0], rank)),
                  "b": jnp.zeros((rank, w.shape[1]))} for kk, (k, w) in zip(keys, kernels.items())}

  def forward(a, kernels, x):
    for i in range(model.layers):
      name = f"dense_{i}"
      w = kernels[name]
      x = (jnp.dot(x, w, preferred_element_type=jnp.float32) +
           (x @ a[name]["a"].astype(x.dtype)) @ a[name]["b"].astype(x.dtype)).astype(x.dtype)
      if i < model.layers - 1:
        x = nn.gelu(x)
    return x

  def loss(a, kernels, x):
    return jnp.sum(forward(a, kernels, x).astype(jnp.float32))
  return loss, adapters, kernels


def _measure(loss, trained, frozen, x, weight_shapes, h100: bool) -> dict:
  step = jax.jit(jax.grad(loss))
  mem = step.lower(trained, frozen, x).compile().memory_analysis()
  res = common.saved_residuals(
      lambda t: loss(t, jax.lax.stop_gradient(frozen), jax.lax.stop_gradient(x)), trained)
  # Residuals of a weight's shape are what the backward keeps of the frozen base: their dtype
  # is the claim (codes, or a float copy); the rest are activations and adapters.
  weight = [r for r in res if tuple(r["shape"]) in weight_shapes]
  other = [r for r in res if tuple(r["shape"]) not in weight_shapes and not r["literal"]]
  out = {}
  if h100 and targets.availability("h100"):
    rep = tcompile.compile_for("h100", jax.grad(loss), trained, frozen, x)
    out = {"h100_argument_bytes": rep.argument_bytes, "h100_temp_bytes": rep.temp_bytes}
  return {**out, "argument_bytes": int(mem.argument_size_in_bytes),
          "temp_bytes": int(mem.temp_size_in_bytes),
          "weight_residual_bytes": int(sum(r["bytes"] for r in weight)),
          "weight_residual_dtypes": sorted({r["dtype"] for r in weight}),
          "other_residual_bytes": int(sum(r["bytes"] for r in other))}


def run(d: int, layers: int, tokens: int, rank: int, h100: bool = True) -> dict:
  model = Stack(d=d, layers=layers)
  x = jax.random.normal(jax.random.key(1), (tokens, d)).astype(jnp.bfloat16)
  params = model.init(jax.random.key(0), x)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  bf16_base = fl.weight_bytes(params)
  shapes = {tuple(w.shape) for w in jax.tree.leaves(params)}
  rows = {}

  def full_loss(p, unused, x):
    del unused
    return jnp.sum(model.apply(p, x).astype(jnp.float32))
  rows["bf16_full"] = {"base_bytes": bf16_base, "trained_bytes": bf16_base,
                       **_measure(full_loss, params, {}, x, shapes, h100)}
  loss, adapters, kernels = _bf16_lora_step(model, params, x, rank)
  rows["bf16_lora"] = {"base_bytes": fl.weight_bytes(kernels),
                       "trained_bytes": fl.weight_bytes(adapters),
                       **_measure(loss, adapters, kernels, x, shapes, h100)}
  recipes = {"qlora_int4_channel": fl.weight_only(4),
             "qlora_int4_group64": fl.weight_only(4, granularity="group", group_size=64),
             "qlora_int8_channel": fl.weight_only(8),
             "qlora_fp8_delayed": fl.delayed_scaling(),
             "qlora_w8a8_int8": fl.IntRecipe()}
  for name, recipe in recipes.items():
    res = fl.ptq(model, params, [x], recipe=recipe)
    lp = fl.add_lora(res.served, res.served_params, x, rank=rank)
    trained, frozen = fl.split_lora(lp)

    def qloss(a, frozen, x, served=res.served):
      return jnp.sum(served.apply(fl.join_lora(a, frozen), x).astype(jnp.float32))
    rows[name] = {"base_bytes": fl.weight_bytes(frozen), "trained_bytes": fl.weight_bytes(trained),
                  **_measure(qloss, trained, frozen, x, shapes, h100)}
  for row in rows.values():
    row["base_ratio_vs_bf16"] = row["base_bytes"] / bf16_base
    row["argument_ratio_vs_bf16_full"] = row["argument_bytes"] / rows["bf16_full"][
        "argument_bytes"]
  return rows


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--d", type=int, default=2048)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--tokens", type=int, default=256)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--no-h100", action="store_true", help="CPU programs only")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rows = run(args.d, args.layers, args.tokens, args.rank, h100=not args.no_h100)
  mib = 2.0 ** 20
  print(f"QLoRA memory, {args.layers} x dense {args.d}, {args.tokens} tokens, rank {args.rank} "
        "(estimates from compiled programs)")
  print("MiB; CPU and H100 (compile only): the compiled programs' planned memory")
  print(f"{'arm':20s} {'base':>6s} {'vs bf16':>7s} {'CPU args':>8s} {'CPU temp':>8s} "
        f"{'H100 args':>9s} {'H100 temp':>9s} {'weight resid.':>16s} {'other':>6s}")
  for name, r in rows.items():
    kept = f"{r['weight_residual_bytes'] / mib:.2f} {'/'.join(r['weight_residual_dtypes'])}"
    h100 = (f"{r['h100_argument_bytes'] / mib:9.2f} {r['h100_temp_bytes'] / mib:9.2f}"
            if "h100_temp_bytes" in r else f"{'-':>9s} {'-':>9s}")
    print(f"{name:20s} {r['base_bytes'] / mib:6.2f} {r['base_ratio_vs_bf16']:7.3f} "
          f"{r['argument_bytes'] / mib:8.2f} {r['temp_bytes'] / mib:8.2f} {h100} {kept:>16s} "
          f"{r['other_residual_bytes'] / mib:6.2f}")
  payload = {"meta": {"device": "CPU and H100 (compile only): the compiled programs' memory "
                                "analysis, an estimate",
                      "shape": vars(args), **common.environment()},
             "results": rows}
  if args.out:
    common.write_json_to(args.out, payload)
  return payload


if __name__ == "__main__":
  main()
