"""Command line of the main job: ``python -m fp8_linen`` / ``fp8-linen-train``.

With no arguments it trains a byte-level transformer LM on the Python
standard library's source and a CNN on scikit-learn's digits, each in a
``bf16`` and an ``fp8`` arm, then prints a table per task and writes
``results.txt``, ``loss_curves.png``, ``scales.png``, ``summary.json`` and
checkpoints to ``runs/latest``. It uses whatever device JAX picks (CPU by
default, a GPU or TPU when there is one).

Examples::

  python -m fp8_linen                                  # the default run
  python -m fp8_linen --config tiny --out /tmp/run     # seconds
  python -m fp8_linen --tasks digits --arms bf16 --steps 100
  python -m fp8_linen --resume                         # continue runs/latest
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

import jax

from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import report
from fp8_linen_job import tasks as tasks_lib
from fp8_linen_job import train as train_lib

DEFAULT_OUT = os.path.join('runs', 'latest')


def _names(values: Sequence[str] | None) -> tuple[str, ...] | None:
  """Flattens ``--tasks lm digits`` and ``--tasks lm,digits`` alike."""
  if values is None:
    return None
  return tuple(n for v in values for n in v.split(',') if n)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses the command line."""
  p = argparse.ArgumentParser(
      prog='python -m fp8_linen',
      description='Train small models in bf16 and quantized arms on data '
      'that ships with Python and scikit-learn; compare loss, speed and '
      'quantization state.')
  p.add_argument('--config', help='YAML config: a path, or a name in '
                 'configs/job/ (default, tiny, large). Default: built-in '
                 'defaults (same as configs/job/default.yaml).')
  p.add_argument('--out', default=DEFAULT_OUT,
                 help=f'output directory (default: {DEFAULT_OUT})')
  p.add_argument('--steps', type=int,
                 help='override the number of steps of every task')
  p.add_argument('--tasks', nargs='+', metavar='TASK',
                 help=f'tasks to run, from: {", ".join(config_lib.TASKS)}')
  p.add_argument('--arms', nargs='+', metavar='ARM',
                 help=f'arms to train, from: {", ".join(config_lib.ARMS)}')
  p.add_argument('--seed', type=int, help='override the seed')
  p.add_argument('--resume', action='store_true',
                 help='continue each task/arm from its latest checkpoint in '
                 '--out (same data order and state as an uninterrupted run)')
  p.add_argument('--stop-after', type=int, metavar='STEP',
                 help='stop every arm (with a checkpoint) at this step '
                 'without changing the schedule; continue with --resume')
  p.add_argument('--no-progress', action='store_true',
                 help='no progress bars')
  return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> config_lib.JobConfig:
  """Loads ``--config`` and applies the command-line overrides.

  Raises:
    ConfigError: On a bad file, key or value (from the file or the flags).
  """
  cfg = config_lib.load_config(args.config)
  overrides = {}
  if args.tasks is not None:
    overrides['tasks'] = list(_names(args.tasks))
  if args.arms is not None:
    overrides['arms'] = list(_names(args.arms))
  if args.seed is not None:
    overrides['seed'] = args.seed
  if args.no_progress:
    overrides['progress'] = False
  if args.steps is not None:
    for task in config_lib.TASKS:
      overrides[task] = {'steps': args.steps}
  return config_lib.merge(cfg, overrides, where='command line')


def run_job(cfg: config_lib.JobConfig, out_dir: str, *, resume: bool = False,
            stop_after: int | None = None) -> tuple[list[train_lib.ArmResult],
                                                      dict[str, str]]:
  """Trains every task in every arm, then writes the report.

  Args:
    cfg: The job config.
    out_dir: Output directory for checkpoints, plots, table and JSON.
    resume: Continue from the latest checkpoints in ``out_dir``.
    stop_after: Stop each arm at this step (see :func:`train_lib.train_arm`).

  Returns:
    ``(results, paths)``: the per-arm results and the report files
    (``paths['text']`` is the table text).
  """
  t0 = time.perf_counter()
  arms = [arms_lib.build_arm(name, cfg) for name in cfg.arms]  # Fail early.
  results, descriptions = [], {}
  for task_name in cfg.tasks:
    task = tasks_lib.build_task(task_name, cfg)
    descriptions[task.name] = task.description
    for arm in arms:
      results.append(train_lib.train_arm(task, arm, cfg, out_dir,
                                         resume=resume, stop_after=stop_after))
  wall_s = time.perf_counter() - t0
  extra = {'wall_s': wall_s, 'device': str(jax.devices()[0]),
           'backend': jax.default_backend(), 'jax_version': jax.__version__,
           'resumed': resume, 'stop_after': stop_after}
  paths = report.write_report(results, out_dir,
                              config=config_lib.to_dict(cfg),
                              descriptions=descriptions, extra=extra)
  return results, paths


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``python -m fp8_linen`` and ``fp8-linen-train``."""
  args = parse_args(argv)
  try:
    cfg = config_from_args(args)
  except config_lib.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'fp8_linen job: tasks {", ".join(cfg.tasks)}; arms '
        f'{", ".join(cfg.arms)}; device {jax.devices()[0]}; out {args.out}',
        file=sys.stderr)
  t0 = time.perf_counter()
  try:
    _, paths = run_job(cfg, args.out, resume=args.resume,
                       stop_after=args.stop_after)
  except (config_lib.ConfigError,
          train_lib.ResumeError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print()
  print(paths['text'])
  print(f'\nwrote {paths["table"]}, {paths["loss_png"]}, '
        f'{paths["scales_png"]}, {paths["json"]} '
        f'({time.perf_counter() - t0:.0f} s)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
