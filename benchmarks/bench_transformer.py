"""Decoder-only transformer train step: bf16 vs fp8 (delayed, current scaling).

Two parts, both on the main job's byte-level language model
(``fp8_linen_job.models.TransformerLM``, built by ``fp8_linen_job.tasks.lm_task``
and trained on the Python standard library's own source) with the job's arms
(``fp8_linen_job.arms.build_arm``: plain flax ``nn.Dense`` in bfloat16, or
``fp8_linen.QDense`` with a recipe, for every dense layer inside the blocks;
embeddings, norms, attention scores and the vocabulary head stay bf16):

1. Speed and memory. The whole jitted training step (forward, backward,
   AdamW update with gradient clipping, fp8 state merge; state donated) of
   every arm is timed interleaved in one process after warm-up: median of
   ``--reps`` runs with min and max, and the ratio to the bf16 arm. The inputs
   are random byte tokens and random next-token labels, so the loss's
   cotangent (softmax minus one-hot) is data dependent and cannot be folded
   away. The scales and amax histories live in the train state, a jit
   argument. The step returns the loss, so every forward GEMM runs, and the
   embeddings below the blocks take gradients, so every dgrad runs too (a
   token input has no dL/dx of its own). Recorded per arm:
   ``compiled.memory_analysis()`` (temp, argument, output bytes) where the
   backend offers it and, on a GPU, the fp8 products among all products of
   the compiled step (3 per quantized dense layer expected: 4 layers per
   block).
2. Accuracy parity. Each arm is trained ``--steps`` steps from the same seed
   on the same batches in the same order (batch ``i`` is a pure function of
   the seed and ``i``), and the loss curves, final train loss (mean of the
   last 10 steps) and validation loss of each fp8 arm are compared with bf16
   (ratio and absolute difference).

Writes ``benchmarks/results/<device>-transformer.json`` and a PNG of the loss
curves beside it (``--out-dir`` puts both elsewhere).

Sizes: on CPU (default) about 3.3M parameters (d_model 256, 4 layers, seq
128, batch 16, 150 parity steps); on a GPU (``jax.default_backend() ==
'gpu'``) about 126M parameters (d_model 1024, 10 layers, 8 heads, seq 1024,
batch 32, 500 parity steps). ``--quick`` shrinks everything for a smoke run
(1 layer, d_model 64: 10-20 s per arm on CPU, nearly all of it compilation).

Usage:
  python benchmarks/bench_transformer.py              # defaults for this device
  python benchmarks/bench_transformer.py --quick      # smoke run
  python benchmarks/bench_transformer.py --steps 300 --reps 30 --arms bf16 fp8_current
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plot_results  # noqa: E402

from fp8_linen_job import arms as arms_lib  # noqa: E402
from fp8_linen_job import config as config_lib  # noqa: E402
from fp8_linen_job import tasks as tasks_lib  # noqa: E402
from fp8_linen_job import train as train_lib  # noqa: E402

ARM_CHOICES = ("bf16", "fp8_delayed", "fp8_current", "int8")
"""Arms this benchmark can build (``--arms``)."""

_CURRENT_SCALING = {"defaults": {"scaling": "current", "history_length": 16}}
"""``fp8_recipe`` settings of the current-scaling arm (configs/recipes/fp8_current.yaml)."""

# Sizes per mode: (d_model, num_layers, num_heads, seq_len, batch, steps, reps,
# learning rate, warm-up steps, text bytes, eval batches).
_SIZES = {
    "cpu": dict(d_model=256, layers=4, heads=4, seq_len=128, batch=16, steps=150, reps=20,
                lr=3e-3, warmup_steps=30, text_bytes=2_000_000, eval_batches=4),
    "gpu": dict(d_model=1024, layers=10, heads=8, seq_len=1024, batch=32, steps=500, reps=30,
                lr=6e-4, warmup_steps=100, text_bytes=8_000_000, eval_batches=8),
    "quick": dict(d_model=64, layers=1, heads=2, seq_len=32, batch=4, steps=20, reps=5,
                  lr=3e-3, warmup_steps=4, text_bytes=100_000, eval_batches=2),
}


def job_config(args: argparse.Namespace) -> config_lib.JobConfig:
  """The job config whose ``lm`` task has this benchmark's sizes."""
  lm = config_lib.LmConfig(
      steps=args.steps, batch_size=args.batch, seq_len=args.seq_len, d_model=args.d_model,
      num_heads=args.heads, num_layers=args.layers, learning_rate=args.lr,
      warmup_steps=min(args.warmup_steps, args.steps), text_bytes=args.text_bytes,
      eval_every=0, eval_batches=args.eval_batches)
  return config_lib.JobConfig(seed=args.seed, tasks=("lm",), progress=False, lm=lm)


def build_arm(name: str, cfg: config_lib.JobConfig) -> arms_lib.Arm:
  """Builds one of :data:`ARM_CHOICES` through the job's arm builders.

  Args:
    name: ``bf16``, ``fp8_delayed`` (the library default recipe),
      ``fp8_current`` (current scaling) or ``int8``.
    cfg: The job config.

  Returns:
    The arm, renamed to ``name``.
  """
  if name == "bf16":
    return arms_lib.build_arm("bf16", cfg)
  if name == "fp8_delayed":
    arm = arms_lib.build_arm("fp8", dataclasses.replace(cfg, fp8_recipe={}))
  elif name == "fp8_current":
    arm = arms_lib.build_arm("fp8", dataclasses.replace(cfg, fp8_recipe=_CURRENT_SCALING))
  elif name == "int8":
    arm = arms_lib.build_arm("int8", cfg)
  else:
    raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARM_CHOICES)}")
  return dataclasses.replace(arm, name=name)


def random_batch(batch: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
  """Random byte tokens and random next-token labels (``int32[batch, seq_len]``)."""
  rng = np.random.default_rng(seed)
  return {"x": rng.integers(0, 256, (batch, seq_len), dtype=np.int32),
          "y": rng.integers(0, 256, (batch, seq_len), dtype=np.int32)}


def prepare_arm(task: tasks_lib.Task, arm: arms_lib.Arm, args: argparse.Namespace) -> dict:
  """Initializes an arm and compiles its train and eval steps (once for both parts).

  Returns:
    ``{"state": initial train state, "step": compiled train step,
    "eval": jitted eval step, "info": facts for the JSON}``. ``step(state,
    batch) -> (state, metrics)`` is the job's train step, jitted with the state
    donated; every batch has the shape and dtype of ``task.train_batch(0)``.
  """
  t0 = time.perf_counter()
  state = train_lib.init_state(task, arm, args.seed)
  step = jax.jit(train_lib.make_train_step([]), donate_argnums=0)
  compiled = step.lower(state, task.train_batch(0)).compile()
  info = {"compile_s": time.perf_counter() - t0,
          "param_count": sum(int(np.prod(p.shape))
                             for p in jax.tree.leaves(state.params["params"])),
          "memory": common.memory_stats(compiled)}
  if jax.default_backend() == "gpu":
    info["gpu_products"] = common.gpu_products(compiled.as_text())
    info["expected_fp8_gemms"] = 3 * 4 * args.layers if arm.quantized else 0
  return {"state": state, "step": compiled,
          "eval": jax.jit(train_lib.make_eval_step(state.apply_fn)), "info": info}


def time_arms(prepared: dict, args: argparse.Namespace) -> dict:
  """Part 1: interleaved step times, memory and fp8 GEMM counts per arm."""
  batch = random_batch(args.batch, args.seq_len, args.seed + 1)
  runners, info = {}, {}
  for name, prep in prepared.items():
    # A copy: the step donates its state, and part 2 starts from the original.
    holder = {"state": jax.tree.map(jnp.copy, prep["state"])}

    def run(compiled=prep["step"], holder=holder):
      holder["state"], metrics = compiled(holder["state"], batch)
      return holder["state"], metrics

    runners[name] = run
    info[name] = prep["info"]
  times = common.time_interleaved(runners, reps=args.reps, warmup=args.warmup)
  base_name = "bf16" if "bf16" in times else next(iter(times))
  base = times[base_name]["median_ms"]
  base_mem = (info[base_name]["memory"] or {}).get("temp_size_in_bytes")
  rows = {}
  for name in runners:
    mem = info[name]["memory"] or {}
    row = {**times[name], **info[name], "ratio_vs_bf16": times[name]["median_ms"] / base,
           "min_ratio_vs_bf16": times[name]["min_ms"] / base,
           "max_ratio_vs_bf16": times[name]["max_ms"] / base}
    if base_mem and "temp_size_in_bytes" in mem:
      row["temp_bytes_ratio_vs_bf16"] = mem["temp_size_in_bytes"] / base_mem
    rows[name] = row
    mem_text = (f"  temp {mem['temp_size_in_bytes'] / 2**20:8.1f} MiB  args "
                f"{mem.get('argument_size_in_bytes', 0) / 2**20:7.1f} MiB" if mem else "")
    print(f"time  {name:12s} {row['median_ms']:9.2f} ms [{row['min_ms']:.2f}, "
          f"{row['max_ms']:.2f}]  x{row['ratio_vs_bf16']:5.3f} {base_name}{mem_text}"
          + (f"  fp8 {row['gpu_products']['fp8_products']}/{row['gpu_products']['products']}"
             if "gpu_products" in row else ""), flush=True)
  return {"baseline": base_name, "reps": args.reps, "warmup": args.warmup,
          "step": "jit(value_and_grad + AdamW(clip) update + fp8 state merge), donated state, "
                  "random tokens and random labels", "arms": rows}


def train_arm(task: tasks_lib.Task, name: str, prep: dict, args: argparse.Namespace) -> dict:
  """Part 2: trains one arm from its initial state; loss curve and final losses."""
  t0 = time.perf_counter()
  state, compiled = prep["state"], prep["step"]
  every = max(1, args.steps // max(1, args.val_points))
  losses, val = [], []

  def evaluate(step, state):
    loss, acc = train_lib.evaluate(prep["eval"], state.params, task.eval_batches)
    val.append([step, loss])
    return loss, acc

  evaluate(0, state)
  for step in range(args.steps):
    state, metrics = compiled(state, task.train_batch(step))
    losses.append(float(metrics["loss"]))
    if (step + 1) % every == 0 and step + 1 < args.steps:
      evaluate(step + 1, state)
  val_loss, val_acc = evaluate(args.steps, state)
  window = min(train_lib.TRAIN_LOSS_WINDOW, len(losses))
  final = float(np.mean(losses[-window:]))
  print(f"train {name:12s} final train loss {final:.4f}  val loss {val_loss:.4f}  "
        f"val acc {val_acc:.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
  return {"train_loss": losses, "val": val, "final_train_loss": final, "val_loss": val_loss,
          "val_acc": val_acc, "finite": bool(np.all(np.isfinite(losses))),
          "seconds": time.perf_counter() - t0}


def _moving_average(values, window):
  v = np.asarray(values, dtype=float)
  window = max(1, min(window, len(v)))
  return np.convolve(v, np.ones(window) / window, mode="valid")


def compare(results: dict, base_name: str) -> dict:
  """Final-loss ratios and differences of each arm against ``base_name``."""
  base = results[base_name]
  out = {}
  for name, r in results.items():
    if name == base_name:
      continue
    a = _moving_average(r["train_loss"], train_lib.TRAIN_LOSS_WINDOW)
    b = _moving_average(base["train_loss"], train_lib.TRAIN_LOSS_WINDOW)
    out[name] = {
        "final_train_loss_ratio": r["final_train_loss"] / base["final_train_loss"],
        "final_train_loss_diff": r["final_train_loss"] - base["final_train_loss"],
        "val_loss_ratio": r["val_loss"] / base["val_loss"],
        "val_loss_diff": r["val_loss"] - base["val_loss"],
        "train_curve_mean_abs_diff": float(np.mean(np.abs(a - b))),
        "train_curve_max_abs_diff": float(np.max(np.abs(a - b))),
    }
    print(f"parity {name:12s} vs {base_name}: train loss x{out[name]['final_train_loss_ratio']:.4f} "
          f"({out[name]['final_train_loss_diff']:+.4f})  val loss x{out[name]['val_loss_ratio']:.4f} "
          f"({out[name]['val_loss_diff']:+.4f})", flush=True)
  return out


def parse_args(argv=None) -> argparse.Namespace:
  """Parses the command line and fills sizes left unset from the mode's defaults."""
  p = argparse.ArgumentParser(
      description="Time a decoder-only transformer train step for bf16 / fp8 arms and "
                  "compare their loss curves.",
      epilog="Sizes left unset come from the mode: --quick, else GPU defaults when "
             "jax.default_backend() == 'gpu', else CPU defaults.")
  p.add_argument("--quick", action="store_true",
                 help="tiny model, few steps and reps: a smoke run (compile-bound)")
  p.add_argument("--steps", type=int, help="training steps per arm for the parity part "
                 "(0 skips it; CPU 150, GPU 500, quick 20)")
  p.add_argument("--reps", type=int, help="timed runs per arm (CPU 20, GPU 30, quick 5)")
  p.add_argument("--warmup", type=int, default=3, help="untimed runs per arm before timing")
  p.add_argument("--arms", nargs="+", choices=ARM_CHOICES,
                 default=["bf16", "fp8_delayed", "fp8_current"],
                 help="arms to run; bf16 is the baseline of every ratio")
  p.add_argument("--d-model", type=int, help="residual stream width")
  p.add_argument("--layers", type=int, help="transformer blocks")
  p.add_argument("--heads", type=int, help="attention heads (must divide --d-model)")
  p.add_argument("--seq-len", type=int, help="tokens (bytes) per sequence")
  p.add_argument("--batch", type=int, help="sequences per step")
  p.add_argument("--lr", type=float, help="peak AdamW learning rate of the parity run")
  p.add_argument("--warmup-steps", type=int, help="learning-rate warm-up steps")
  p.add_argument("--text-bytes", type=int, help="bytes of stdlib source to read")
  p.add_argument("--eval-batches", type=int, help="validation batches per evaluation")
  p.add_argument("--val-points", type=int, default=5,
                 help="validation evaluations during training (plus one at step 0)")
  p.add_argument("--seed", type=int, default=0, help="seeds initialization and data order")
  p.add_argument("--out-dir", default=None,
                 help="folder for <device>-transformer.json/.png (default: benchmarks/results)")
  p.add_argument("--no-plot", action="store_true", help="skip the PNG")
  args = p.parse_args(argv)
  mode = "quick" if args.quick else ("gpu" if jax.default_backend() == "gpu" else "cpu")
  for key, value in _SIZES[mode].items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  args.mode = mode
  if args.d_model % args.heads:
    p.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
  if args.reps < 1:
    p.error("--reps must be at least 1")
  return args


def main(argv=None) -> dict:
  """Runs both parts, writes the JSON (and PNG) and returns the payload."""
  args = parse_args(argv)
  cfg = job_config(args)
  task = tasks_lib.lm_task(cfg)
  arms = {name: build_arm(name, cfg) for name in args.arms}
  print(f"{task.description}; mode {args.mode}; arms {', '.join(arms)}", flush=True)

  prepared = {name: prepare_arm(task, arm, args) for name, arm in arms.items()}
  timing = time_arms(prepared, args)
  parity = None
  if args.steps > 0:
    results = {name: train_arm(task, name, prep, args) for name, prep in prepared.items()}
    base_name = "bf16" if "bf16" in results else next(iter(results))
    parity = {"steps": args.steps, "seed": args.seed, "baseline": base_name,
              "learning_rate": args.lr, "warmup_steps": cfg.lm.warmup_steps,
              "optimizer": "AdamW, linear warm-up then cosine decay to 10%, "
                           f"clip {cfg.lm.grad_clip}, weight decay {cfg.lm.weight_decay}",
              "final_train_loss": f"mean of the last {train_lib.TRAIN_LOSS_WINDOW} steps",
              "data": task.description, "arms": results,
              "vs_baseline": compare(results, base_name)}

  param_count = next(iter(timing["arms"].values()))["param_count"]
  payload = {
      "benchmark": "transformer_train_step", "mode": args.mode, "env": common.environment(),
      "model": {"d_model": args.d_model, "num_layers": args.layers, "num_heads": args.heads,
                "mlp_ratio": cfg.lm.mlp_ratio, "seq_len": args.seq_len,
                "batch_size": args.batch, "vocab": 256, "param_count": param_count,
                "dtypes": "bf16 compute, f32 params; QDense in the blocks for quantized arms, "
                          "bf16 embeddings/norms/attention scores/head"},
      "arms": {name: dict(arm.details) for name, arm in arms.items()},
      "timing": timing, "parity": parity}

  name = f"{common.device_name()}-transformer"
  if args.out_dir is None:
    path = common.write_json("transformer", payload)
  else:
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{name}.json")
    with open(path, "w") as f:
      json.dump(payload, f, indent=1, sort_keys=True)
  print("wrote", path)
  if parity is not None and not args.no_plot:
    png = plot_results.plot_transformer(payload, os.path.splitext(path)[0] + ".png")
    print("wrote", png)
  bad = [n for n, r in timing["arms"].items() if not math.isfinite(r["ratio_vs_bf16"])]
  if parity is not None:
    bad += [n for n, r in parity["arms"].items() if not r["finite"]]
  if bad:
    print("WARNING: non-finite values for", ", ".join(sorted(set(bad))))
  return payload


if __name__ == "__main__":
  main()
