"""From a trained float model to served int8 / int4 models, over seeds: the job's from-float stage.

Runs the main job's ``bf16`` arm and its from-float stage
(:mod:`fp8_linen_job.from_float`: PTQ int8 and int4, QAT from the int4 PTQ,
QLoRA on the int4 base, merged and requantized) for each seed, on the job's
LM and CNN at the default config, and reports per stage the held-out loss
relative to the trained bf16 model (mean and spread over seeds) and the share
of int4 PTQ's gap each training stage closes. Quality only: nothing is
timed. CPU.

  python benchmarks/from_float.py --seeds 0 1 2 --out benchmarks/results/cpu-from-float.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fp8_linen_job import config as config_lib  # noqa: E402
from fp8_linen_job import main as main_lib  # noqa: E402


def run_seed(seed: int, config: str | None, tasks: list[str], steps: int | None) -> dict:
  """The from-float rows of every task for one seed (a job run in a temporary directory)."""
  overrides = {'seed': seed, 'arms': ['bf16'], 'tasks': tasks, 'progress': False,
               'from_float': {'enabled': True}}
  if steps:
    overrides.update({t: {'steps': steps} for t in tasks})
  cfg = config_lib.merge(config_lib.load_config(config), overrides, where='benchmark')
  with tempfile.TemporaryDirectory() as out:
    main_lib.run_job(cfg, out)
    with open(os.path.join(out, 'summary.json')) as f:
      return json.load(f)['from_float']


def aggregate(per_seed: list[dict]) -> dict:
  """Per task and stage: loss vs bf16 (%) and the gap closed, mean / min / max over seeds."""
  out = {}
  for task in per_seed[0]:
    stages = [r['stage'] for r in per_seed[0][task]]
    rows = {}
    for i, stage in enumerate(stages):
      rel = [100 * (s[task][i]['val_loss'] / s[task][0]['val_loss'] - 1) for s in per_seed]
      acc = [s[task][i]['val_acc'] for s in per_seed]
      row = {'vs_bf16_pct_mean': float(np.mean(rel)), 'vs_bf16_pct_min': float(np.min(rel)),
             'vs_bf16_pct_max': float(np.max(rel)), 'val_acc_mean': float(np.mean(acc)),
             'steps': per_seed[0][task][i]['steps'],
             'weight_bytes': per_seed[0][task][i]['weight_bytes']}
      gaps = [s[task][i].get('int4_gap_closed') for s in per_seed]
      if stage.startswith(('qat', 'qlora')):
        row['int4_gap_closed'] = [None if g is None or np.isnan(g) else float(g) for g in gaps]
        # The gap of the seeds' mean losses (a seed whose int4 PTQ has no gap counts too).
        mean = {st: np.mean([s[task][j]['val_loss'] for s in per_seed])
                for j, st in enumerate(stages)}
        gap = mean['ptq int4'] - mean['bf16']
        row['int4_gap_closed_of_means'] = (float((mean['ptq int4'] - mean[stage]) / gap)
                                           if gap > 0 else None)
      rows[stage] = row
    out[task] = rows
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
  p.add_argument('--config', default=None, help='job config (default: the built-in default)')
  p.add_argument('--tasks', nargs='+', default=list(config_lib.TASKS))
  p.add_argument('--steps', type=int, default=None, help='override every task\'s steps')
  p.add_argument('--out', default=None)
  p.add_argument('--summarize', metavar='JSON', default=None,
                 help='summarize the per-seed rows of an earlier run\'s JSON again (no training)')
  args = p.parse_args(argv)
  if args.summarize:
    with open(args.summarize) as f:
      old = json.load(f)
    per_seed, args.seeds = old['per_seed'], old['meta']['seeds']
  else:
    per_seed = [run_seed(s, args.config, args.tasks, args.steps) for s in args.seeds]
  summary = aggregate(per_seed)
  print(f'from a trained bf16 model, seeds {args.seeds} (CPU; served models)')
  for task, rows in summary.items():
    print(f'{task}:')
    print(f'  {"stage":22s} {"steps":>5s} {"vs bf16 (mean, min..max)":>26s} {"acc":>6s} '
          f'{"gap closed":>10s}')
    for stage, r in rows.items():
      closed = r.get('int4_gap_closed_of_means')
      closed = '' if 'int4_gap_closed' not in r else ('no gap' if closed is None
                                                        else f'{100 * closed:.0f}%')
      print(f'  {stage:22s} {r["steps"]:5d} {r["vs_bf16_pct_mean"]:+8.2f}% '
            f'({r["vs_bf16_pct_min"]:+.2f}..{r["vs_bf16_pct_max"]:+.2f}%) '
            f'{r["val_acc_mean"]:6.3f} {closed:>10s}')
  payload = {'meta': {'device': 'CPU', 'seeds': args.seeds, 'config': args.config or 'default',
                      'steps': args.steps, **common.environment()},
             'summary': summary, 'per_seed': per_seed}
  if args.out:
    common.write_json_to(args.out, payload)
  return payload


if __name__ == '__main__':
  main()
