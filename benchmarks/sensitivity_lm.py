"""Precision chosen by measurement on the job's LM: fl.sensitivity's rules vs the hand rule.

The main job's byte-level LM (``fp8_linen_job.tasks.lm_task`` at the job's
default size: d_model 128, 2 blocks, 4 heads, sequences of 64 bytes, batch 16)
is trained in bf16 (``--float-steps``, the job's 300 by default). For each
candidate recipe (NVFP4, ``fl.nvfp4()``; int4, ``fl.int4_lsq_plus()``: 4-bit
LSQ+ weights and activations) over the blocks' projections
(``fl.projection_rules()``: embeddings, attention math and the vocabulary head
stay bf16), :func:`fp8_linen.sensitivity` measures on ``--measure-batches``
training batches the loss change, output error and gradient error of every
projection quantized alone, and chooses the layers to keep in bf16:

* ``all``: every projection quantized (nothing kept);
* ``hand``: the hand rule, ``fl.high_precision_layers('block{i}/mlp', 2,
  last=1)`` (the last block's MLP, two layers; what
  ``bench_block_quality.py``'s NVFP4 arm keeps);
* ``chosen``: ``result.choice(budget=<the hand rule's measured loss change>,
  cost='layers')``: the fewest layers whose measured loss meets what the hand
  rule reaches;
* ``top2``: the two layers with the largest loss change (as many as the hand
  rule keeps).

Each arm is then scored on the held-out validation text twice: as it is
(the float weights with fresh quantizers: every batch scaled by its own amax,
LSQ steps from the float model's activations; "PTQ"), and after a short QAT
fine-tune from the float weights (``--finetune-steps``, AdamW with warm-up and
cosine decay from ``--finetune-lr``), evaluated with frozen quantizers as the
job does; the float model fine-tuned for the same steps is the reference.

Writes ``benchmarks/results/<device>-sensitivity-lm.json``.

Usage:
  python benchmarks/sensitivity_lm.py                 # the full comparison (CPU: ~10 min)
  python benchmarks/sensitivity_lm.py --recipes nvfp4 --finetune-steps 0
  python benchmarks/sensitivity_lm.py --quick         # smoke run (tiny model, few steps)
  python benchmarks/sensitivity_lm.py --seed 1 --out benchmarks/results/cpu-sensitivity-lm-seed1.json
  python benchmarks/sensitivity_lm.py --merge benchmarks/results/cpu-sensitivity-lm.json \\
      benchmarks/results/cpu-sensitivity-lm-seed1.json   # one table over both seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import jax
import numpy as np
from flax.training import train_state as flax_train_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen_job import arms as arms_lib  # noqa: E402
from fp8_linen_job import config as config_lib  # noqa: E402
from fp8_linen_job import tasks as tasks_lib  # noqa: E402
from fp8_linen_job import train as train_lib  # noqa: E402

RECIPES = {"nvfp4": fl.nvfp4, "int4": fl.int4_lsq_plus}
HAND = ("block{i}/mlp", 1)
"""The hand rule: ``fl.high_precision_layers(HAND[0], num_layers, last=HAND[1])``."""
ARM_ORDER = ("all", "hand", "chosen", "top2")


def job_config(args) -> config_lib.JobConfig:
  lm = dataclasses.replace(config_lib.LmConfig(), steps=args.float_steps, eval_every=0,
                           eval_batches=args.eval_batches)
  if args.quick:
    lm = dataclasses.replace(lm, d_model=32, num_heads=2, seq_len=16, batch_size=4,
                             warmup_steps=2, text_bytes=100_000)
  return config_lib.JobConfig(seed=args.seed, tasks=("lm",), progress=False, lm=lm)


def loss_fn(forward, batch):
  """The job's loss (mean cross-entropy) of ``forward`` on one ``{'x', 'y'}`` batch."""
  return tasks_lib.loss_and_accuracy(forward(batch["x"]), batch["y"])[0]


def train(state, task, steps: int, first: int = 0):
  step = jax.jit(train_lib.make_train_step([]), donate_argnums=0)
  losses = []
  for i in range(steps):
    state, metrics = step(state, task.train_batch(first + i))
    losses.append(float(metrics["loss"]))
  return state, losses


def fresh_eval(apply, variables, batches) -> float:
  """Mean loss with the quantizers as they start (each batch scaled by its own amax)."""
  f = jax.jit(lambda v, b: loss_fn(lambda x: apply(v, x), b))
  return float(np.mean([float(f(variables, b)) for b in batches]))


def quantized_variables(qmodel, float_vars, x):
  """The float variables plus the quantizers' own, created from the float model's activations."""
  _, variables = jax.jit(lambda v, x: qmodel.apply(v, x, rngs={"params": jax.random.key(0)},
                                                   mutable=True))(float_vars, x)
  return {k: v for k, v in variables.items() if k != "intermediates"}


def finetune(args, task, model, float_vars, recipe=None, rules=None) -> dict:
  """A short QAT (or float) fine-tune from the float weights; held-out loss, frozen quantizers."""
  settings = dataclasses.replace(task.settings, steps=max(1, args.finetune_steps),
                                 learning_rate=args.finetune_lr,
                                 warmup_steps=min(10, args.finetune_steps))
  tx = tasks_lib.make_optimizer(settings)
  if recipe is None:
    apply, variables = model.apply, float_vars
    state = flax_train_state.TrainState.create(apply_fn=apply, params=variables, tx=tx)
  else:
    qmodel = fl.quantize_model(model, recipe, rules=rules, on_unquantized="ignore")
    apply = qmodel.apply
    variables = quantized_variables(qmodel, float_vars, task.train_batch(0)["x"])
    state = fl.TrainState.create(apply_fn=apply, params=variables, tx=tx)
  t0 = time.perf_counter()
  state, losses = train(state, task, args.finetune_steps, first=args.float_steps)
  evaluate = jax.jit(train_lib.make_eval_step(apply))
  val_loss, val_acc = train_lib.evaluate(evaluate, state.params, task.eval_batches)
  return {"val_loss": val_loss, "val_acc": val_acc, "seconds": time.perf_counter() - t0,
          "finite": bool(np.all(np.isfinite(losses))),
          "train_loss": [round(v, 4) for v in losses[::10]]}


def run_recipe(args, name, task, model, float_vars, float_val, float_ft) -> dict:
  recipe = RECIPES[name]()
  cfg_layers = task.settings.num_layers
  base = fl.projection_rules()
  first = args.float_steps + args.finetune_steps  # batches neither training run sees
  batches = [task.train_batch(first + i) for i in range(args.measure_batches)]
  t0 = time.perf_counter()
  res = fl.sensitivity(model, float_vars, batches, recipe=recipe, loss_fn=loss_fn, rules=base)
  measure_s = time.perf_counter() - t0
  print(f"\n{name}: sensitivity of {len(res.layers)} layers in {measure_s:.0f} s; float loss "
        f"{res.float_loss:.4f}, every layer quantized {res.quantized_loss_change:+.2%}")
  print(res.table())
  hand = fl.high_precision_layers(HAND[0], cfg_layers, last=HAND[1]) + base
  hand_kept = [p for p in res.paths if re.fullmatch(hand[0].module_path, p)]
  t0 = time.perf_counter()
  hand_change = res.evaluate(hand)
  # A budget must be > 0: a hand rule that does not raise the loss at all gives a tiny one.
  chosen = res.choice(max(hand_change, 1e-4), cost="layers")
  choose_s = time.perf_counter() - t0
  top2 = res.ranking()[:len(hand_kept)]
  top_rules = res.rules_keeping(top2)
  # arm -> (kept layers, rules, measured loss change on the sensitivity batches)
  arms = {"all": ((), base, res.quantized_loss_change),
          "hand": (tuple(hand_kept), hand, hand_change),
          "chosen": (chosen.kept, chosen.rules, chosen.loss_change),
          f"top{len(top2)}": (top2, top_rules, res.evaluate(top_rules))}
  out = {"recipe": repr(recipe), "measure_seconds": measure_s, "choose_seconds": choose_s,
         "float_loss_measured": res.float_loss,
         "quantized_loss_change": res.quantized_loss_change,
         "layers": [dataclasses.asdict(s) for s in res.layers],
         "table": res.table(),
         "choice": {"budget": chosen.budget, "kept": list(chosen.kept), "met": chosen.met,
                    "loss_change": chosen.loss_change,
                    "predicted_loss_change": chosen.predicted_loss_change,
                    "evaluations": chosen.evaluations},
         "arms": {}}
  for arm, (kept, rules, measured) in arms.items():
    qmodel = fl.quantize_model(model, recipe, rules=rules, on_unquantized="ignore")
    qvars = quantized_variables(qmodel, float_vars, batches[0]["x"])
    row = {"kept": list(kept), "high_precision_layers": len(kept),
           "measured_loss_change": measured,
           "weight_bytes": res.weight_bytes(kept),
           "ptq_val_loss": fresh_eval(qmodel.apply, qvars, task.eval_batches)}
    row["ptq_vs_float"] = row["ptq_val_loss"] / float_val - 1
    if args.finetune_steps:
      row["finetuned"] = finetune(args, task, model, float_vars, recipe, rules)
      row["finetuned_vs_float"] = row["finetuned"]["val_loss"] / float_ft - 1
    out["arms"][arm] = row
    ft = (f", fine-tuned {row['finetuned']['val_loss']:.4f} ({row['finetuned_vs_float']:+.2%})"
          if args.finetune_steps else "")
    print(f"  {arm:7s} keeps {len(kept)} {list(kept)}: measured {row['measured_loss_change']:+.2%}"
          f", held-out {row['ptq_val_loss']:.4f} ({row['ptq_vs_float']:+.2%}){ft}", flush=True)
  return out


def markdown(payload: dict) -> str:
  """The comparison table: per recipe and arm, the layers kept and the losses vs float."""
  ft = payload["finetune_steps"]
  head = ["recipe", "arm", "bf16 layers", "measured (sensitivity batches)",
          "held-out, as quantized"] + ([f"held-out after {ft} QAT steps"] if ft else [])
  lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3)]
  for name, r in payload["recipes"].items():
    for arm, row in r["arms"].items():
      kept = ", ".join(f"`{p}`" for p in row["kept"]) or "none"
      cells = [name, arm, f"{row['high_precision_layers']}: {kept}",
               f"{row['measured_loss_change']:+.2%}",
               f"{row['ptq_val_loss']:.4f} ({row['ptq_vs_float']:+.2%})"]
      if ft:
        cells.append(f"{row['finetuned']['val_loss']:.4f} ({row['finetuned_vs_float']:+.2%})")
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def markdown_seeds(payloads) -> str:
  """One table over runs with different seeds: the kept layers and the losses vs bf16, per seed."""
  seeds = " / ".join(str(p["seed"]) for p in payloads)
  ft = payloads[0]["finetune_steps"]
  head = ["recipe", "arm", "bf16 layers", f"held-out vs bf16, as quantized (seed {seeds})"]
  head += [f"after {ft} QAT steps (seed {seeds})"] if ft else []
  lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3)]
  names = [n for n in RECIPES if n in payloads[0]["recipes"]]
  for name in names:
    arms = sorted(payloads[0]["recipes"][name]["arms"], key=lambda a: (ARM_ORDER + (a,)).index(a))
    for arm in arms:
      rows = [p["recipes"][name]["arms"][arm] for p in payloads]
      per_seed = [", ".join(f"`{k}`" for k in sorted(row["kept"])) or "none" for row in rows]
      layers = (f"{rows[0]['high_precision_layers']}: {per_seed[0]}" if len(set(per_seed)) == 1
                else " / ".join(f"{row['high_precision_layers']}: {k}"
                                for row, k in zip(rows, per_seed)))
      cells = [name, arm, layers, " / ".join(f"{row['ptq_vs_float']:+.2%}" for row in rows)]
      if ft:
        cells.append(" / ".join(f"{row['finetuned_vs_float']:+.2%}" for row in rows))
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--float-steps", type=int, default=300)
  p.add_argument("--measure-batches", type=int, default=4)
  p.add_argument("--finetune-steps", type=int, default=100)
  p.add_argument("--finetune-lr", type=float, default=1e-3)
  p.add_argument("--eval-batches", type=int, default=16)
  p.add_argument("--quick", action="store_true", help="tiny model and few steps (smoke run)")
  p.add_argument("--out", default=None)
  p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                 help="print one table over these result files (runs with different seeds)")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.merge:
    payloads = [json.load(open(p)) for p in args.merge]
    print(markdown_seeds(payloads))
    return {"markdown": markdown_seeds(payloads)}
  if args.quick:
    args.float_steps, args.finetune_steps = min(args.float_steps, 5), min(args.finetune_steps, 3)
    args.measure_batches, args.eval_batches = min(args.measure_batches, 2), 2
  cfg = job_config(args)
  task = tasks_lib.lm_task(cfg)
  arm = arms_lib.build_arm("bf16", cfg)
  model = task.build_model(arm)
  t0 = time.perf_counter()
  state = train_lib.init_state(task, arm, args.seed)
  state, losses = train(state, task, args.float_steps)
  float_vars = jax.device_get(state.params)
  float_val = fresh_eval(model.apply, float_vars, task.eval_batches)
  print(f"bf16: {args.float_steps} steps in {time.perf_counter() - t0:.0f} s, held-out loss "
        f"{float_val:.4f}")
  float_ft = None
  payload = {"benchmark": "sensitivity_lm", "device": "CPU" if jax.default_backend() == "cpu"
             else jax.devices()[0].device_kind, "env": common.environment(),
             "seed": args.seed, "float_steps": args.float_steps,
             "finetune_steps": args.finetune_steps, "finetune_lr": args.finetune_lr,
             "measure_batches": args.measure_batches, "eval_batches": args.eval_batches,
             "model": {"d_model": cfg.lm.d_model, "num_layers": cfg.lm.num_layers,
                       "num_heads": cfg.lm.num_heads, "seq_len": cfg.lm.seq_len,
                       "batch_size": cfg.lm.batch_size},
             "hand_rule": f"fl.high_precision_layers({HAND[0]!r}, {cfg.lm.num_layers}, "
                          f"last={HAND[1]}) + fl.projection_rules()",
             "float": {"val_loss": float_val, "train_loss": [round(v, 4) for v in losses[::10]]},
             "recipes": {}, "quick": args.quick,
             "command": "python benchmarks/sensitivity_lm.py " + " ".join(
                 argv if argv is not None else sys.argv[1:])}
  if args.finetune_steps:
    payload["float"]["finetuned"] = finetune(args, task, model, float_vars)
    float_ft = payload["float"]["finetuned"]["val_loss"]
    print(f"bf16 fine-tuned {args.finetune_steps} steps: held-out {float_ft:.4f}")
  for name in args.recipes:
    payload["recipes"][name] = run_recipe(args, name, task, model, float_vars, float_val,
                                          float_ft)
  payload["markdown"] = markdown(payload)
  print("\n" + payload["markdown"])
  path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                  f"{common.device_name()}-sensitivity-lm.json")
  common.write_json_to(path, payload)
  print("wrote", path)
  return payload


if __name__ == "__main__":
  main()
