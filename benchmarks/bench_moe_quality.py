"""Quality of quantized MoE experts: the job's LM with a mixture of experts, bf16 vs fp8 vs int8.

The main job's byte-level language model (``fp8_linen_job.tasks.lm_task``: its
data, batches, optimizer and evaluation; d_model 128, 2 blocks, 4 heads,
sequences of 64 bytes, batch 16) with each block's MLP replaced by a
mixture of experts written as MaxText's ``sparse_matmul`` and gemma's
``MoERagged`` write theirs: a float32 router, top-1 routing, the routed
tokens sorted by expert and multiplied by every expert's weights with
``jax.lax.ragged_dot`` (one grouped GEMM in, GELU, one out), the outputs
unsorted and scaled by the router's probability. The model is the same in
every arm; only ``fl.quantize_model`` changes:

* ``bf16``: the model as written (bfloat16 compute);
* ``fp8``: ``fl.quantize_model(model, fl.Fp8Recipe(), rules)``: the experts
  through ``fl.fp8_ragged_dot`` (e4m3 forward, e5m2 gradients, delayed
  scaling: one scale per expert's weight, one for the routed tokens, one for
  the gradient), the attention projections quantized the same way;
* ``fp8_h16``: the same with a 16-step amax history (``fl.delayed_scaling(16)``);
* ``fp8_e4m3g``: ``fp8`` with e4m3 gradients too (``output_grad=fl.ScalingConfig(
  dtype='float8_e4m3fn')``): on a GPU all three of the experts' grouped GEMMs are
  then fp8 in the library's kernels (e5m2 x e4m3 multiplies as float16 there);
* ``int8``: the same rules with ``fl.IntRecipe`` (STE; the experts' weights
  per expert and output channel, the routed tokens under one min/max
  observer): the integer QAT numerics, fake-quantized;
* ``int8_g8``: ``int8`` with ``grad_bits=8``: the experts' gradient GEMMs
  (dgrad and the ragged-contracting wgrad) multiply int8 codes too, the
  output gradient stochastically rounded (the recipe meant for TPU v5e/v6e).

The rules (``fl.projection_rules()`` with the router kept in float32) leave
attention math, the embeddings and the head in bf16, as in the job.

Writes ``benchmarks/results/<device>-moe-quality.json``: per run the final
validation loss, per arm the mean and the mean of per-seed ratios to bf16.

Usage:
  python benchmarks/bench_moe_quality.py                 # 3 seeds x 1200 steps x 6 arms
  python benchmarks/bench_moe_quality.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen_job import arms as arms_lib  # noqa: E402
from fp8_linen_job import config as config_lib  # noqa: E402
from fp8_linen_job import models  # noqa: E402
from fp8_linen_job import tasks as tasks_lib  # noqa: E402
from fp8_linen_job import train as train_lib  # noqa: E402

ARMS = ("bf16", "fp8", "fp8_h16", "fp8_e4m3g", "int8", "int8_g8")
NUM_EXPERTS = 4
TARGETS = {"fp8": 0.005, "fp8_h16": 0.005, "fp8_e4m3g": 0.005, "int8": 0.01, "int8_g8": 0.01}
"""Largest allowed relative excess of the validation loss over bf16's (the dense
model's targets plus the experts' own quantization: fp8 0.5%, int8 1%)."""


class MoeMlp(nn.Module):
  """Top-1 mixture of experts as grouped GEMMs (``jax.lax.ragged_dot``)."""

  num_experts: int
  hidden: int
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    tokens = x.reshape(-1, d)
    logits = nn.Dense(self.num_experts, dtype=jnp.float32, name="router")(
        tokens.astype(jnp.float32))
    probs = jax.nn.softmax(logits, -1)
    expert = jnp.argmax(probs, -1)
    gate = jnp.take_along_axis(probs, expert[:, None], -1)
    order = jnp.argsort(expert)
    sizes = jnp.bincount(expert, length=self.num_experts).astype(jnp.int32)
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    w_in = self.param("w_in", init, (self.num_experts, d, self.hidden))
    w_out = self.param("w_out", init, (self.num_experts, self.hidden, d))
    routed = tokens[order].astype(self.dtype)
    h = nn.gelu(jax.lax.ragged_dot(routed, w_in.astype(self.dtype), sizes))
    y = jax.lax.ragged_dot(h, w_out.astype(self.dtype), sizes)
    y = jnp.zeros_like(y).at[order].set(y) * gate.astype(y.dtype)
    return y.reshape(b, t, d)


class MoeBlock(nn.Module):
  num_heads: int
  mlp_ratio: int
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
    x = x + models.CausalSelfAttention(self.num_heads, nn.Dense, self.dtype, name="attn")(h)
    h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
    return x + MoeMlp(NUM_EXPERTS, self.mlp_ratio * x.shape[-1], self.dtype, name="moe")(h)


class MoeLM(nn.Module):
  """The job's ``TransformerLM`` with :class:`MoeBlock` s."""

  max_len: int
  d_model: int
  num_heads: int
  num_layers: int
  mlp_ratio: int
  vocab_size: int = 256
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, name="embed")(tokens)
    x = x + nn.Embed(self.max_len, self.d_model, dtype=self.dtype, name="pos_embed")(
        jnp.arange(tokens.shape[1])[None, :])
    for i in range(self.num_layers):
      x = MoeBlock(self.num_heads, self.mlp_ratio, self.dtype, name=f"block{i}")(x)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def recipe_of(arm: str):
  if arm == "fp8":
    return fl.Fp8Recipe()
  if arm == "fp8_h16":  # a 16-step amax history: what docs/recipes.md advises for short runs
    return fl.delayed_scaling(16)
  if arm == "fp8_e4m3g":
    return fl.Fp8Recipe(output_grad=fl.ScalingConfig(dtype="float8_e4m3fn"))
  if arm == "int8":
    return fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
  if arm == "int8_g8":
    return fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"), grad_bits=8)
  return None


RULES = (fl.QuantizationRule(module_path=".*/router", quantize=False),) + fl.projection_rules()


def build_task(cfg: config_lib.JobConfig, arm_name: str):
  """The job's LM task with :class:`MoeLM`, and the arm that trains it."""
  task = tasks_lib.lm_task(cfg)
  s = cfg.lm
  recipe = recipe_of(arm_name)

  def build_model(arm):
    model = MoeLM(max_len=s.seq_len, d_model=s.d_model, num_heads=s.num_heads,
                  num_layers=s.num_layers, mlp_ratio=s.mlp_ratio, dtype=arm.dtype)
    return arm.wrap_model(model)

  arm = arms_lib.build_arm("bf16", cfg)
  if recipe is not None:
    arm = dataclasses.replace(
        arm, name=arm_name, recipe=recipe, train_state_cls=fl.TrainState, quantized=True,
        wrap_model=lambda m: fl.quantize_model(m, recipe, rules=RULES, on_unquantized="ignore"))
  return dataclasses.replace(task, build_model=build_model), arm


def job_config(args, seed: int) -> config_lib.JobConfig:
  lm = dataclasses.replace(config_lib.LmConfig(), steps=args.steps, eval_every=0,
                           eval_batches=args.eval_batches)
  if args.quick:
    lm = dataclasses.replace(lm, steps=10, d_model=32, num_heads=2, seq_len=16, batch_size=4,
                             warmup_steps=2, text_bytes=100_000, eval_batches=2)
  return config_lib.JobConfig(seed=seed, tasks=("lm",), progress=False, lm=lm)


def train_once(arm_name: str, cfg: config_lib.JobConfig) -> dict:
  t0 = time.perf_counter()
  task, arm = build_task(cfg, arm_name)
  state = train_lib.init_state(task, arm, cfg.seed)
  report = None
  if arm.recipe is not None:
    model = task.build_model(arm)
    report = model.product_report(state.params, task.example_input()).counts
  step = jax.jit(train_lib.make_train_step([]), donate_argnums=0)
  losses = []
  for i in range(cfg.lm.steps):
    state, metrics = step(state, task.train_batch(i))
    losses.append(float(metrics["loss"]))
  evaluate = jax.jit(train_lib.make_eval_step(state.apply_fn))
  val_loss, val_acc = train_lib.evaluate(evaluate, state.params, task.eval_batches)
  return {"arm": arm_name, "seed": cfg.seed, "steps": cfg.lm.steps, "val_loss": val_loss,
          "val_acc": val_acc, "finite": bool(np.all(np.isfinite(losses))),
          "train_loss": [round(v, 4) for v in losses[::25]], "products": report,
          "recipe": repr(arm.recipe) if arm.recipe is not None else "bf16",
          "seconds": time.perf_counter() - t0}


def summarize(runs: list[dict]) -> dict:
  by_seed = {(r["arm"], r["seed"]): r["val_loss"] for r in runs}
  seeds = sorted({r["seed"] for r in runs})
  out = {}
  for arm in ARMS:
    losses = [by_seed[(arm, s)] for s in seeds if (arm, s) in by_seed]
    if not losses:
      continue
    ratios = [by_seed[(arm, s)] / by_seed[("bf16", s)] for s in seeds
              if (arm, s) in by_seed and ("bf16", s) in by_seed]
    out[arm] = {"val_loss": float(np.mean(losses)), "seeds": len(losses),
                "excess_vs_bf16": float(np.mean(ratios)) - 1 if ratios else None,
                "target": TARGETS.get(arm)}
  return out


def markdown(payload: dict) -> str:
  rows = ["| arm | val loss | vs bf16 | target | seeds |", "| --- | ---: | ---: | ---: | ---: |"]
  # In the arms' own order (the JSON may keep its keys sorted).
  summary = payload["summary"]
  for arm, s in sorted(summary.items(), key=lambda kv: (
      ARMS.index(kv[0]) if kv[0] in ARMS else len(ARMS), kv[0])):
    excess = "–" if s["excess_vs_bf16"] is None or arm == "bf16" else \
        f"{100 * s['excess_vs_bf16']:+.2f}%"
    target = "–" if s["target"] is None else f"{100 * s['target']:.1f}%"
    rows.append(f"| `{arm}` | {s['val_loss']:.4f} | {excess} | {target} | {s['seeds']} |")
  return "\n".join(rows)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  p.add_argument("--merge", nargs="+", default=None,
                 help="JSON files of earlier runs to merge into one (with --out)")
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=1200)
  p.add_argument("--eval-batches", type=int, default=32)
  p.add_argument("--quick", action="store_true", help="tiny model, 10 steps (smoke test)")
  p.add_argument("--out", default=None, help="JSON path (default: results/<device>-moe-quality"
                 ".json; --quick writes nothing unless given)")
  return p.parse_args(argv)


def merge(paths) -> dict:
  """The runs of several JSON files in one payload (the first file's header)."""
  payloads = [json.load(open(p)) for p in paths]
  runs = [r for p in payloads for r in p["runs"]]
  return dict(payloads[0], runs=runs, summary=summarize(runs),
              seeds=sorted({r["seed"] for r in runs}),
              seconds=sum(p["seconds"] for p in payloads))


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.merge:
    payload = merge(args.merge)
    print(markdown(payload))
    common.write_json_to(args.out or args.merge[0], payload)
    return payload
  t0 = time.perf_counter()
  runs = []
  for seed in args.seeds:
    for arm in args.arms:
      run = train_once(arm, job_config(args, seed))
      runs.append(run)
      print(f"{arm:5s} seed {seed}: val loss {run['val_loss']:.4f} "
            f"({run['seconds']:.0f} s)", flush=True)
  payload = {"device": common.device_name(), "environment": common.environment(),
             "experts": NUM_EXPERTS, "steps": args.steps, "seeds": args.seeds,
             "runs": runs, "summary": summarize(runs),
             "seconds": time.perf_counter() - t0}
  print(markdown(payload))
  if args.out:
    common.write_json_to(args.out, payload)
  elif not args.quick:
    common.write_json("moe-quality", payload)
  return payload


if __name__ == "__main__":
  main()
