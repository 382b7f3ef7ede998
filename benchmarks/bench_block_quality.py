"""Quality of the block-scaled recipes: the job's LM, bf16 vs fp8 vs MXFP8 vs NVFP4.

The main job's byte-level language model (``fp8_linen_job.models.TransformerLM``
at the job's default size: d_model 128, 2 blocks, 4 heads, sequences of 64
bytes, batch 16, AdamW with warm-up and cosine decay; ``fp8_linen_job.tasks.lm_task``)
is trained from scratch per arm, seed and run length, on the same batches in
the same order, and its loss on held-out text is compared with bf16's:

* ``bf16``: plain ``nn.Dense`` in bfloat16 (the job's ``bf16`` arm);
* ``fp8_delayed``: ``QDense`` with the library default (per-tensor delayed
  scaling, e4m3/e5m2);
* ``mxfp8``: ``QDense`` with ``fl.mx_block_scaling()`` (32-element e8m0
  blocks along each GEMM's contracting axis, forward, dgrad and wgrad);
* ``nvfp4``: NVIDIA's NVFP4 recipe: ``fl.nvfp4()`` (e2m1 codes, e4m3 scales
  per 16, per-tensor float32 scale; 16x16 weight tiles, a 16-point random
  Hadamard transform on the wgrad operands, stochastic rounding of the
  gradient) on the blocks' projections by ``fl.quantize_model`` rules, with
  the last layers kept in bf16 by ``fl.high_precision_layers`` (``--keep``);
* ablations (``--arms``): ``nvfp4_no_2d``, ``nvfp4_no_rht``, ``nvfp4_no_sr``,
  ``nvfp4_no_keep`` (every projection in NVFP4) and ``nvfp4_plain`` (none of
  the four techniques), each one change from ``nvfp4``;
* options beyond NVIDIA's recipe (:data:`NVFP4_OPTIONS`): ``four_over_six``
  block scales (``nvfp4_46``), a precision tail (the last ``--tail-fraction``
  of the steps in bf16 or MXFP8 through ``fl.switch_precision``:
  ``nvfp4_tail_bf16``, ``nvfp4_tail_mxfp8``) and combinations;
* integer arms (:data:`INT_ARMS`): the job's int8 LSQ arm with integer
  gradient GEMMs (``grad_bits=8``), round to nearest or stochastically;
* ``fp8_delayed_h16``: delayed scaling with a 16-step amax history.

In every quantized arm the embeddings, norms, attention math and vocabulary
head stay bf16, as in the job. On CPU the block recipes run their emulation:
the same codes and scales a Blackwell GPU multiplies, dequantized exactly to
bfloat16 (``tests/core/test_block_scaling.py`` checks that the two forms
agree), so the losses are the ones a B200 would give up to float32 summation
order.

Writes ``benchmarks/results/<device>-block-quality.json`` (device, versions,
sizes, seeds, per-run losses and curves, per-arm means and ratios to bf16,
and the targets: MXFP8 within 0.3% of bf16, NVFP4 within 1.5%).

Usage:
  python benchmarks/bench_block_quality.py --estimate            # time one run per arm
  python benchmarks/bench_block_quality.py                       # 3 seeds x (1x, 4x) x 4 arms
  python benchmarks/bench_block_quality.py --arms nvfp4 nvfp4_no_sr --lengths 1 --seeds 0
  python benchmarks/bench_block_quality.py --quick               # smoke run
  python benchmarks/bench_block_quality.py --merge a.json b.json --out all.json  # one table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import flax.linen as nn
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen_job import arms as arms_lib  # noqa: E402
from fp8_linen_job import config as config_lib  # noqa: E402
from fp8_linen_job import tasks as tasks_lib  # noqa: E402
from fp8_linen_job import train as train_lib  # noqa: E402

TUNED_NVFP4 = "nvfp4_46_no_sr_tail20_bf16"
"""NVFP4 as measured best here: four_over_six, gradients rounded to nearest, the last 20% of
the steps in bf16 (see :data:`NVFP4_OPTIONS`)."""
MAIN_ARMS = ("bf16", "fp8_delayed", "mxfp8", "nvfp4", TUNED_NVFP4)
ABLATIONS = ("nvfp4_no_2d", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_no_keep", "nvfp4_plain")
NVFP4_OPTIONS = {
    "nvfp4_no_2d": dict(kernel_2d_blocks=False), "nvfp4_no_rht": dict(wgrad_hadamard=0),
    "nvfp4_no_sr": dict(grad_stochastic_rounding=False),
    "nvfp4_plain": dict(kernel_2d_blocks=False, wgrad_hadamard=0,
                        grad_stochastic_rounding=False),
    "nvfp4_46": dict(four_over_six=True),
    "nvfp4_tail_bf16": dict(tail="bf16"), "nvfp4_tail_mxfp8": dict(tail="mxfp8"),
    "nvfp4_46_no_sr_tail_bf16": dict(four_over_six=True, grad_stochastic_rounding=False,
                                     tail="bf16"),
    "nvfp4_46_no_sr_tail20_bf16": dict(four_over_six=True, grad_stochastic_rounding=False,
                                       tail="bf16", tail_fraction=0.2),
    # The layer fl.sensitivity chose for NVFP4 on this LM (cpu-sensitivity-lm.json) kept in
    # bf16 instead of the hand rule's last MLP: one layer instead of two.
    "nvfp4_46_no_sr_tail20_bf16_chosen": dict(
        four_over_six=True, grad_stochastic_rounding=False, tail="bf16", tail_fraction=0.2,
        keep=("block0/attn/qkv",)),
}
"""What each NVFP4 arm changes from ``fl.nvfp4()``: recipe fields, and ``tail``: the
precision of the run's last ``tail_fraction`` of steps (``fl.switch_precision``; default
``--tail-fraction``)."""
OPTIONS = tuple(a for a in NVFP4_OPTIONS if a not in ABLATIONS and a != TUNED_NVFP4)
INT_ARMS = ("int8_grad8", "int8_grad8_sr")
"""The job's int8 arm (``fl.int8_lsq()``) with integer gradient GEMMs (``grad_bits=8``, round
to nearest), and with their codes rounded stochastically."""
FP8_ARMS = ("fp8_delayed_h16",)
"""fp8 delayed scaling with a 16-step amax history instead of the default 1024 (a run of 1200
steps otherwise scales by the largest amax since its start)."""
ARM_CHOICES = MAIN_ARMS + ABLATIONS + OPTIONS + INT_ARMS + FP8_ARMS
TARGETS = {"mxfp8": 0.003, "nvfp4": 0.015, "int8_grad8": 0.005}
LONG_TARGETS = {TUNED_NVFP4: (3000, 0.010)}
"""Targets from a run length on: (steps, largest relative excess over bf16)."""


def target_of(arm: str, steps: int | None = None) -> float | None:
  """The arm's target excess over bf16 at ``steps`` (``None``: no target)."""
  if arm in LONG_TARGETS and steps is not None and steps >= LONG_TARGETS[arm][0]:
    return LONG_TARGETS[arm][1]
  family = "nvfp4" if arm.startswith("nvfp4") else arm
  return TARGETS.get(family) if arm in ("mxfp8", "nvfp4", "int8_grad8", TUNED_NVFP4) else None
"""Largest allowed relative excess of the mean final validation loss over bf16's."""


def job_config(args, seed: int, length: int) -> config_lib.JobConfig:
  """The job's default LM config, ``length`` times as many steps, more validation batches."""
  base = config_lib.LmConfig()
  lm = dataclasses.replace(base, steps=base.steps * length, eval_every=0,
                           eval_batches=args.eval_batches)
  if args.quick:
    lm = dataclasses.replace(lm, steps=10 * length, d_model=32, num_heads=2, seq_len=16,
                             batch_size=4, warmup_steps=2, text_bytes=100_000, eval_batches=2)
  return config_lib.JobConfig(seed=seed, tasks=("lm",), progress=False, lm=lm)


def nvfp4_recipe(name: str):
  """``fl.nvfp4()`` with the fields the arm name changes (:data:`NVFP4_OPTIONS`)."""
  fields = {k: v for k, v in NVFP4_OPTIONS.get(name, {}).items()
            if k not in ("tail", "tail_fraction", "keep")}
  return fl.nvfp4(**fields)


def tail_arm(name: str, cfg: config_lib.JobConfig, keep: str):
  """The arm an NVFP4 arm switches to for its last steps, or ``None`` (no tail)."""
  tail = NVFP4_OPTIONS.get(name, {}).get("tail")
  if tail is None:
    return None
  if tail == "bf16":
    return arms_lib.build_arm("bf16", cfg)
  recipe = fl.mx_block_scaling()
  rules = keep_rules(name, cfg, keep) + fl.projection_rules()
  return arms_lib.Arm(name=tail, recipe=recipe,
                      wrap_model=lambda model: fl.quantize_model(model, recipe, rules=rules,
                                                                 on_unquantized="ignore"))


def keep_rules(name: str, cfg: config_lib.JobConfig, keep: str):
  """The layers an NVFP4 arm keeps in bf16 (``fl.high_precision_layers``)."""
  if name in ("nvfp4_no_keep", "nvfp4_plain") or keep == "none":
    return ()
  if "keep" in NVFP4_OPTIONS.get(name, {}):
    return tuple(fl.QuantizationRule(module_path=p, quantize=False)
                 for p in NVFP4_OPTIONS[name]["keep"])
  template, _, last = keep.rpartition(":")
  return fl.high_precision_layers(template, cfg.lm.num_layers, last=int(last))


def build_arm(name: str, cfg: config_lib.JobConfig, keep: str) -> arms_lib.Arm:
  """One arm of :data:`ARM_CHOICES` through the job's arm builders."""
  if name == "bf16":
    return arms_lib.build_arm("bf16", cfg)
  if name == "fp8_delayed":
    return dataclasses.replace(arms_lib.build_arm("fp8", dataclasses.replace(
        cfg, fp8_recipe={})), name=name)
  if name == "fp8_delayed_h16":
    return dataclasses.replace(arms_lib.build_arm("fp8", dataclasses.replace(
        cfg, fp8_recipe=fl.recipe_to_dict(fl.delayed_scaling(16)))), name=name)
  if name == "mxfp8":
    return dataclasses.replace(arms_lib.build_arm("fp8", dataclasses.replace(
        cfg, fp8_recipe="mx_block")), name=name)
  if name in INT_ARMS:
    recipe = dataclasses.replace(fl.int8_lsq(), grad_bits=8,
                                 grad_stochastic_rounding=name == "int8_grad8_sr")
    return dataclasses.replace(arms_lib.build_arm("int8", dataclasses.replace(
        cfg, int8_recipe=fl.recipe_to_dict(recipe))), name=name)
  recipe = nvfp4_recipe(name)
  # The projections of the blocks by rule (the same layers QDense replaces in
  # the other arms: attention math and the head stay bf16), minus the kept ones.
  rules = keep_rules(name, cfg, keep) + fl.projection_rules()
  arm = arms_lib.build_arm("fp8", dataclasses.replace(cfg, fp8_recipe="nvfp4"))
  return dataclasses.replace(
      arm, name=name, dense_cls=nn.Dense, recipe=recipe,
      wrap_model=lambda model: fl.quantize_model(model, recipe, rules=rules,
                                                 on_unquantized="ignore"),
      details=(("recipe", repr(recipe)), ("rules", repr(rules))))


def train_once(name: str, cfg: config_lib.JobConfig, keep: str, val_points: int,
               tail_fraction: float = 0.1) -> dict:
  """Trains one arm once; its loss curve and final losses.

  An arm with a precision tail runs its last ``tail_fraction`` of the steps
  in the tail's precision: the same parameters and optimizer state go on
  (``fl.switch_precision``), and the final validation loss is the tail
  model's.
  """
  t0 = time.perf_counter()
  task = tasks_lib.lm_task(cfg)
  arm = build_arm(name, cfg, keep)
  state = train_lib.init_state(task, arm, cfg.seed)
  step = jax.jit(train_lib.make_train_step([]), donate_argnums=0)
  evaluate = jax.jit(train_lib.make_eval_step(state.apply_fn))
  steps = cfg.lm.steps
  tail = tail_arm(name, cfg, keep)
  tail_fraction = NVFP4_OPTIONS.get(name, {}).get("tail_fraction", tail_fraction)
  switch_at = steps - int(round(tail_fraction * steps)) if tail is not None else None
  every = max(1, steps // max(1, val_points))
  losses, val = [], []
  for i in range(steps):
    if i == switch_at:
      main_apply, main_vars = state.apply_fn, state.params
      model = task.build_model(tail)
      fresh = jax.jit(model.init)(jax.random.PRNGKey(cfg.seed), task.example_input())
      state = fl.switch_precision(state, apply_fn=model.apply, variables=dict(fresh))
      evaluate = jax.jit(train_lib.make_eval_step(state.apply_fn))
    state, metrics = step(state, task.train_batch(i))
    losses.append(float(metrics["loss"]))
    if (i + 1) % every == 0 and i + 1 < steps:
      val.append([i + 1, train_lib.evaluate(evaluate, state.params, task.eval_batches)[0]])
  val_loss, val_acc = train_lib.evaluate(evaluate, state.params, task.eval_batches)
  val.append([steps, val_loss])
  extra = {}
  if tail is not None:
    # The final weights through the arm's own recipe as well: how much of the
    # tail's gain is the weights, how much the evaluation's precision.
    own = dict(main_vars, params=state.params["params"])
    extra = {"tail": tail.name, "tail_from_step": switch_at,
             "val_loss_own_recipe": train_lib.evaluate(
                 jax.jit(train_lib.make_eval_step(main_apply)), own, task.eval_batches)[0]}
  window = min(train_lib.TRAIN_LOSS_WINDOW, len(losses))
  return {"arm": name, "seed": cfg.seed, "steps": steps, "val_loss": val_loss,
          "val_acc": val_acc, "final_train_loss": float(np.mean(losses[-window:])),
          "finite": bool(np.all(np.isfinite(losses))), "val_curve": val,
          # every 25th step: the curve's shape without half a megabyte of JSON
          "train_loss": [round(v, 4) for v in losses[::25]], "seconds": time.perf_counter() - t0,
          "recipe": dict(arm.details).get("recipe", "bf16"),
          "rules": dict(arm.details).get("rules", ""),
          **extra}


def summarize(runs: list[dict], lengths, base_steps: int) -> dict:
  """Per length and arm: mean/std of the final validation loss and its ratio to bf16."""
  out = {}
  for length in lengths:
    steps = base_steps * length
    sel = [r for r in runs if r["steps"] == steps]
    by_arm = {}
    for r in sel:
      by_arm.setdefault(r["arm"], {})[r["seed"]] = r["val_loss"]
    base = by_arm.get("bf16", {})
    rows = {}
    for arm, per_seed in by_arm.items():
      vals = np.array(list(per_seed.values()))
      row = {"seeds": sorted(per_seed), "val_loss_mean": float(vals.mean()),
             "val_loss_std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0,
             "val_loss_per_seed": {str(s): v for s, v in sorted(per_seed.items())}}
      paired = [per_seed[s] / base[s] for s in per_seed if s in base]
      if base and arm != "bf16":
        row["ratio_vs_bf16_mean"] = float(np.mean(vals)) / float(np.mean(list(base.values())))
        row["ratio_vs_bf16_per_seed"] = paired
        target = target_of(arm, steps)
        if target is not None:
          row["target_excess"] = target
          row["meets_target"] = row["ratio_vs_bf16_mean"] - 1.0 <= target
      rows[arm] = row
    out[f"{steps}_steps"] = rows
  return out


def print_table(summary: dict) -> None:
  for length, rows in summary.items():
    print(f"\n{length}: final validation loss (mean over seeds, +- std) and ratio to bf16")
    for arm, r in rows.items():
      ratio = r.get("ratio_vs_bf16_mean")
      target = ("" if "meets_target" not in r else
                f"  target +{100 * r['target_excess']:.1f}%: "
                f"{'met' if r['meets_target'] else 'MISSED'}")
      print(f"  {arm:15s} {r['val_loss_mean']:.4f} +- {r['val_loss_std']:.4f}"
            + (f"  x{ratio:.4f} ({100 * (ratio - 1):+.2f}%)" if ratio else "") + target,
            flush=True)


def markdown(payload: dict, arms=MAIN_ARMS) -> str:
  """The quality table: per arm and run length, the mean final validation loss, its excess over
  bf16's (the mean of per-seed ratios) and the number of seeds, and the target where there is
  one."""
  lengths = sorted(payload["summary"], key=lambda k: int(k.split("_")[0]))
  head = ["arm"] + [f"{k.replace('_steps', '')} steps: val loss (vs bf16)" for k in lengths]
  lines = ["| " + " | ".join(head + ["target"]) + " |",
           "| --- |" + " ---: |" * len(lengths) + " --- |"]
  for arm in arms:
    cells = []
    for k in lengths:
      r = payload["summary"][k].get(arm)
      if r is None:
        cells.append("-")
        continue
      # Paired: each seed against bf16's run on the same seed (arms may lack some seeds).
      paired = r.get("ratio_vs_bf16_per_seed")
      vs = "" if not paired else f" ({100 * (float(np.mean(paired)) - 1):+.2f}%)"
      cells.append(f"{r['val_loss_mean']:.4f}{vs} [{len(r['seeds'])}]")
    target = target_of(arm)
    target = "" if target is None else f"within {100 * target:.1f}%"
    if target and arm in LONG_TARGETS:
      steps, bound = LONG_TARGETS[arm]
      target += f"; {100 * bound:.1f}% at {steps}"
    lines.append(f"| {arm} | " + " | ".join(cells) + f" | {target} |")
  return "\n".join(lines)


def own_recipe_markdown(payload: dict) -> str:
  """For the arms with a precision tail: the final weights evaluated through the arm's own
  recipe (NVFP4) as well as the tail's, each vs bf16 (mean of per-seed ratios)."""
  base = {(r["seed"], r["steps"]): r["val_loss"] for r in payload["runs"] if r["arm"] == "bf16"}
  lines = ["| arm | steps | tail from step | vs bf16, tail's precision | vs bf16, NVFP4 "
           "forward | seeds |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
  groups = {}
  for r in payload["runs"]:
    if "val_loss_own_recipe" in r and (r["seed"], r["steps"]) in base:
      groups.setdefault((r["arm"], r["steps"]), []).append(r)
  for (arm, steps), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    tail = np.mean([r["val_loss"] / base[(r["seed"], steps)] for r in rs])
    own = np.mean([r["val_loss_own_recipe"] / base[(r["seed"], steps)] for r in rs])
    lines.append(f"| {arm} | {steps} | {rs[0]['tail_from_step']} | {100 * (tail - 1):+.2f}% | "
                 f"{100 * (own - 1):+.2f}% | {len(rs)} |")
  return "\n".join(lines)


def merge(paths) -> dict:
  """One payload from several partial runs' files (later files' runs win per arm, seed, steps)."""
  payloads = [json.load(open(p)) for p in paths]
  runs = {}
  for payload in payloads:
    for r in payload["runs"]:
      runs[(r["arm"], r["seed"], r["steps"])] = r
  runs = list(runs.values())
  base_steps = min(r["steps"] for r in runs)
  lengths = sorted({r["steps"] // base_steps for r in runs})
  merged = dict(payloads[0])
  merged.update(
      runs=runs, summary=summarize(runs, lengths, base_steps),
      seeds=sorted({r["seed"] for r in runs}),
      lengths_steps=[base_steps * n for n in lengths],
      arms=[a for a in ARM_CHOICES if any(r["arm"] == a for r in runs)],
      total_seconds=sum(p["total_seconds"] for p in payloads),
      # complete: every arm ran every seed at every length
      complete=len(runs) == len({r["arm"] for r in runs}) * len(
          {r["seed"] for r in runs}) * len(lengths),
      command=" ; ".join(p["command"] for p in payloads))
  return merged


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--arms", nargs="+", choices=ARM_CHOICES, default=list(MAIN_ARMS))
  p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
  p.add_argument("--lengths", nargs="+", type=int, default=[1, 4],
                 help="run lengths as multiples of the job's default 300 steps")
  p.add_argument("--keep", default="block{i}/mlp:1",
                 help="the NVFP4 arms' high-precision layers, 'TEMPLATE:LAST' for "
                      "fl.high_precision_layers(TEMPLATE, num_layers, last=LAST), or 'none'")
  p.add_argument("--tail-fraction", type=float, default=0.1,
                 help="the share of the steps a *_tail_* arm runs in the tail's precision")
  p.add_argument("--eval-batches", type=int, default=32,
                 help="held-out batches of 16 x 64 bytes for the validation loss")
  p.add_argument("--val-points", type=int, default=4, help="validation evaluations per run")
  p.add_argument("--estimate", action="store_true",
                 help="time 30 steps of each arm and extrapolate the full run's CPU time")
  p.add_argument("--quick", action="store_true", help="a tiny model and 10 steps (smoke run)")
  p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                 help="merge these result files (runs of the same arm, seed and length: the "
                      "later file's) into --out, then print the tables")
  p.add_argument("--out", default=None, help="output JSON (default benchmarks/results/"
                                             "<device>-block-quality.json)")
  return p.parse_args(argv)


def estimate(args) -> dict:
  """Seconds per step of each arm (after compilation) and the full run's total."""
  per_step = {}
  for name in args.arms:
    cfg = job_config(args, 0, 1)
    cfg = dataclasses.replace(cfg, lm=dataclasses.replace(cfg.lm, steps=40))
    task = tasks_lib.lm_task(cfg)
    state = train_lib.init_state(task, build_arm(name, cfg, args.keep), 0)
    step = jax.jit(train_lib.make_train_step([]), donate_argnums=0)
    for i in range(10):
      state, m = step(state, task.train_batch(i))
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(10, 40):
      state, m = step(state, task.train_batch(i))
    jax.block_until_ready(m)
    per_step[name] = (time.perf_counter() - t0) / 30
  base = config_lib.LmConfig().steps
  total = sum(per_step[a] * base * length for a in args.arms for length in args.lengths)
  total *= len(args.seeds)
  for name, s in per_step.items():
    print(f"{name:15s} {1e3 * s:7.1f} ms/step")
  print(f"estimated training time: {total / 60:.1f} min for {len(args.arms)} arms x "
        f"{len(args.seeds)} seeds x lengths {args.lengths} (plus compilation and evaluation)")
  return {"ms_per_step": {k: 1e3 * v for k, v in per_step.items()}, "total_s": total}


def _payload(args, runs, base_steps, seconds, complete: bool, argv) -> dict:
  summary = summarize(runs, args.lengths, base_steps)
  lm = job_config(args, 0, 1).lm
  return {
      "benchmark": "block_quality", "complete": complete,
      "device": "CPU" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind,
      "env": common.environment(),
      "what": "final validation loss of the job's byte-level LM per arm, seed and run length; "
              "block recipes emulated on CPU (the codes and scales a B200 multiplies, "
              "dequantized exactly to bf16)",
      "model": {"d_model": lm.d_model, "num_layers": lm.num_layers, "num_heads": lm.num_heads,
                "mlp_ratio": lm.mlp_ratio, "seq_len": lm.seq_len, "batch_size": lm.batch_size,
                "learning_rate": lm.learning_rate, "warmup_steps": lm.warmup_steps,
                "eval_batches": lm.eval_batches, "quantized": "the blocks' 4 projections "
                "(qkv, out, fc1, fc2); embeddings, norms, attention math, head bf16"},
      "seeds": args.seeds, "lengths_steps": [base_steps * n for n in args.lengths],
      "arms": args.arms, "nvfp4_keep": args.keep, "targets": TARGETS,
      "summary": summary, "runs": runs, "total_seconds": seconds,
      "command": "python benchmarks/bench_block_quality.py " + " ".join(
          argv if argv is not None else sys.argv[1:])}


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.estimate:
    return estimate(args)
  if args.merge:
    payload = merge(args.merge)
    common.write_json_to(args.out or args.merge[0], payload)
    print(markdown(payload), markdown(payload, ABLATIONS), markdown(payload, OPTIONS),
          own_recipe_markdown(payload), markdown(payload, ("bf16",) + INT_ARMS),
          markdown(payload, ("bf16", "fp8_delayed") + FP8_ARMS), sep="\n\n")
    return payload
  base_steps = job_config(args, 0, 1).lm.steps
  path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  f"{common.device_name()}-block-quality.json")
  runs, t0 = [], time.perf_counter()
  for length in args.lengths:
    for seed in args.seeds:
      for name in args.arms:
        cfg = job_config(args, seed, length)
        r = train_once(name, cfg, args.keep, args.val_points, args.tail_fraction)
        runs.append(r)
        print(f"{name:15s} seed {seed} {r['steps']:5d} steps: val loss {r['val_loss']:.4f} "
              f"train {r['final_train_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)
        # What has run so far, so a long measurement that is stopped keeps its runs.
        common.write_json_to(path, _payload(args, runs, base_steps,
                                            time.perf_counter() - t0, False, argv))
  payload = _payload(args, runs, base_steps, time.perf_counter() - t0, True, argv)
  print_table(payload["summary"])
  print(markdown(payload, [a for a in ARM_CHOICES if a in args.arms]))
  common.write_json_to(path, payload)
  print("wrote", path)
  bad = [r["arm"] for r in runs if not r["finite"] or not math.isfinite(r["val_loss"])]
  if bad:
    print("WARNING: non-finite losses in", ", ".join(sorted(set(bad))))
  return payload


if __name__ == "__main__":
  main()
