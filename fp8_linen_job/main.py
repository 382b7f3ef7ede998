"""Command line of the main job: ``python -m fp8_linen`` / ``fp8-linen-train``.

With no arguments it trains a byte-level transformer LM on the Python
standard library's source and a CNN on scikit-learn's digits, each in a
``bf16``, an ``fp8`` and an ``int8`` arm, then prints a table per task and
writes ``results.txt``, ``loss_curves.png``, ``scales.png``,
``summary.json`` and checkpoints to ``runs/latest``. It uses whatever device
JAX picks (CPU by default, a GPU or TPU when there is one).

Only the config module is imported up front, so ``--help`` and
``--print-config`` work without the ``[job]`` extra; a training run first
checks that the extra's packages are there and says how to install them if
not.

Examples::

  python -m fp8_linen                                  # the default run
  python -m fp8_linen --config tiny --out /tmp/run     # seconds
  python -m fp8_linen --tasks digits --arms bf16 --steps 100
  python -m fp8_linen --resume                         # continue runs/latest
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time
from typing import Any, Sequence

import yaml

from fp8_linen_job import config as config_lib

DEFAULT_OUT = os.path.join('runs', 'latest')

JOB_EXTRA = {'tqdm': 'tqdm', 'matplotlib': 'matplotlib',
             'sklearn': 'scikit-learn', 'orbax.checkpoint': 'orbax-checkpoint'}
"""Modules a training run needs from the ``[job]`` extra -> their packages."""

INSTALL_HINT = 'pip install "fp8_linen[job]"'

EXIT_MISSING = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C, as a shell reports a process killed by SIGINT."""


def missing_job_dependencies() -> list[str]:
  """Packages of the ``[job]`` extra whose modules cannot be imported."""
  missing = []
  for module, package in JOB_EXTRA.items():
    try:
      found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # A missing parent package.
      found = False
    if not found:
      missing.append(package)
  return missing


def _missing_message(packages: Sequence[str]) -> str:
  return (f'error: the training job needs {", ".join(packages)} (the [job] '
          f'extra), which cannot be imported here; install it with:\n'
          f'  {INSTALL_HINT}\n(in a source checkout: pip install ".[job]")')


def _names(values: Sequence[str] | None) -> tuple[str, ...] | None:
  """Flattens ``--tasks lm digits`` and ``--tasks lm,digits`` alike."""
  if values is None:
    return None
  return tuple(n for v in values for n in v.split(',') if n)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses the command line."""
  p = argparse.ArgumentParser(
      prog='python -m fp8_linen', allow_abbrev=False,
      description='Train small models in bf16 and quantized arms on data '
      'that ships with Python and scikit-learn; compare loss, speed and '
      'quantization state.')
  p.add_argument('--config', help='YAML config: a path, or the name of a '
                 f'shipped one ({", ".join(config_lib.config_names())}). '
                 'Default: the built-in defaults (same as "default").')
  p.add_argument('--out', default=DEFAULT_OUT,
                 help=f'output directory (default: {DEFAULT_OUT})')
  p.add_argument('--steps', type=int,
                 help='override the number of steps of every task')
  p.add_argument('--tasks', nargs='+', metavar='TASK',
                 help=f'tasks to run, from: {", ".join(config_lib.TASKS)}')
  p.add_argument('--arms', nargs='+', metavar='ARM',
                 help=f'arms to train, from: {", ".join(config_lib.ARMS)}')
  p.add_argument('--seed', type=int, help='override the seed')
  p.add_argument('--api', choices=config_lib.APIS,
                 help='Flax API of the models (default: linen; nnx: the '
                 'same models built from fp8_linen.nnx layers)')
  p.add_argument('--from-float', action='store_true',
                 help='after each task\'s bf16 arm: post-training quantization '
                 '(int8, int4), QAT from PTQ and QLoRA from its trained model '
                 '(from_float in the config)')
  p.add_argument('--resume', action='store_true',
                 help='continue each task/arm from its latest checkpoint in '
                 '--out (same data order and state as an uninterrupted run)')
  p.add_argument('--stop-after', type=int, metavar='STEP',
                 help='stop every arm (with a checkpoint) at this step '
                 'without changing the schedule; continue with --resume')
  p.add_argument('--no-progress', action='store_true',
                 help='no progress bars')
  p.add_argument('--print-config', action='store_true',
                 help='print the resolved config (YAML, with the overrides '
                 'applied) and exit without training')
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
  if args.api is not None:
    overrides['api'] = args.api
  if args.no_progress:
    overrides['progress'] = False
  if args.from_float:
    overrides['from_float'] = {'enabled': True}
  if args.steps is not None:
    for task in config_lib.TASKS:
      overrides[task] = {'steps': args.steps}
  return config_lib.merge(cfg, overrides, where='command line')


def run_job(cfg: config_lib.JobConfig, out_dir: str, *, resume: bool = False,
            stop_after: int | None = None) -> tuple[list[Any], dict[str, str]]:
  """Trains every task in every arm, then writes the report.

  Args:
    cfg: The job config.
    out_dir: Output directory for checkpoints, plots, table and JSON.
    resume: Continue from the latest checkpoints in ``out_dir``.
    stop_after: Stop each arm at this step (see
      :func:`fp8_linen_job.train.train_arm`).

  Returns:
    ``(results, paths)``: the per-arm
    :class:`~fp8_linen_job.train.ArmResult` list and the report files
    (``paths['text']`` is the table text).

  Raises:
    fp8_linen_job.train.Interrupted: On Ctrl-C during training.
  """
  # Here rather than at the top: these need the [job] extra (see main).
  # pylint: disable=g-import-not-at-top
  import jax
  from fp8_linen_job import arms as arms_lib
  from fp8_linen_job import from_float
  from fp8_linen_job import report
  from fp8_linen_job import tasks as tasks_lib
  from fp8_linen_job import train as train_lib
  # pylint: enable=g-import-not-at-top

  t0 = time.perf_counter()
  arms = [arms_lib.build_arm(name, cfg) for name in cfg.arms]  # Fail early.
  results, descriptions, from_float_rows = [], {}, {}
  for task_name in cfg.tasks:
    task = tasks_lib.build_task(task_name, cfg)
    descriptions[task.name] = task.description
    for arm in arms:
      results.append(train_lib.train_arm(task, arm, cfg, out_dir,
                                         resume=resume, stop_after=stop_after))
    if cfg.from_float.enabled and all(r.steps_done == r.total_steps for r in results):
      bf16 = next(a for a in arms if a.name == 'bf16')
      from_float_rows[task.name] = from_float.run(
          task, cfg, train_lib.trained_variables(task, bf16, cfg, out_dir))
  wall_s = time.perf_counter() - t0
  extra = {'wall_s': wall_s, 'device': str(jax.devices()[0]),
           'backend': jax.default_backend(), 'jax_version': jax.__version__,
           'resumed': resume, 'stop_after': stop_after}
  if from_float_rows:
    extra['from_float'] = {t: from_float.as_dict(r) for t, r in from_float_rows.items()}
  paths = report.write_report(results, out_dir,
                              config=config_lib.to_dict(cfg),
                              descriptions=descriptions, extra=extra)
  if from_float_rows:
    text = '\n\n'.join(from_float.format_table(t, r) for t, r in from_float_rows.items())
    paths['text'] += '\n\n' + text
    with open(paths['table'], 'a', encoding='utf-8') as f:
      f.write('\n' + text + '\n')
    paths['from_float_png'] = os.path.join(out_dir, from_float.PLOT_PNG)
    from_float.plot(from_float_rows, paths['from_float_png'])
  return results, paths


def resume_command(argv: Sequence[str]) -> str:
  """The command that continues a run started with ``argv``.

  The same options, without ``--stop-after`` and with ``--resume``.

  Example:
    >>> resume_command(['--config', 'tiny', '--stop-after', '4'])
    'python -m fp8_linen --config tiny --resume'
  """
  kept, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == '--stop-after':
      skip = True
    elif not arg.startswith('--stop-after=') and arg != '--resume':
      kept.append(arg)
  return shlex.join(['python', '-m', 'fp8_linen', *kept, '--resume'])


def stop_message(what: str, step: int | None, checkpoint: int | None) -> str:
  """``'interrupted at step 7, last checkpoint at 4; rerun with --resume'``.

  Args:
    what: ``'interrupted'`` or ``'stopped'``.
    step: Steps done (``None``: before training started).
    checkpoint: Latest checkpoint step (``None``: none yet).
  """
  at = 'before training started' if step is None else f'at step {step}'
  ckpt = ('no checkpoint yet' if checkpoint is None
          else f'last checkpoint at {checkpoint}')
  return f'{what} {at}, {ckpt}; rerun with --resume'


def _stopped_lines(results: Sequence[Any], stop_after: int) -> list[str]:
  """One line per group of arms that ``--stop-after`` stopped early."""
  groups: dict[tuple[int, int | None], list[str]] = {}
  for r in results:
    if r.steps_done < r.total_steps:
      groups.setdefault((r.steps_done, r.checkpoint_step), []).append(
          f'{r.task}/{r.arm}')
  return [f'{", ".join(names)}: '
          f'{stop_message(f"stopped (--stop-after {stop_after})", *key)}'
          for key, names in groups.items()]


def use_compilation_cache(path: str) -> str | None:
  """Points JAX's persistent compilation cache at ``path``; the directory used, or None.

  Nothing changes when ``path`` is empty, the environment already names a
  cache (``JAX_COMPILATION_CACHE_DIR``: a test run's, a cluster's), or the
  directory cannot be made (a read-only home): the run compiles as without one.
  """
  if not path or os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    return None
  import jax  # pylint: disable=g-import-not-at-top
  path = os.path.expanduser(path)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  jax.config.update('jax_compilation_cache_dir', path)
  return path


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``python -m fp8_linen`` and ``fp8-linen-train``.

  Returns:
    The exit status: 0 on success, 1 if a package of the ``[job]`` extra is
    missing, 2 on a bad config, 130 after Ctrl-C.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  try:
    cfg = config_from_args(args)
  except config_lib.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return EXIT_CONFIG
  if args.print_config:
    print(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False), end='')
    return 0
  missing = missing_job_dependencies()
  if missing:
    print(_missing_message(missing), file=sys.stderr)
    return EXIT_MISSING
  # pylint: disable-next=g-import-not-at-top
  from fp8_linen_job import train as train_lib
  t0 = time.perf_counter()
  try:
    import jax  # pylint: disable=g-import-not-at-top
    use_compilation_cache(cfg.compilation_cache)
    print(f'fp8_linen job: tasks {", ".join(cfg.tasks)}; arms '
          f'{", ".join(cfg.arms)}; device {jax.devices()[0]}; out {args.out}',
          file=sys.stderr)
    results, paths = run_job(cfg, args.out, resume=args.resume,
                             stop_after=args.stop_after)
  except (config_lib.ConfigError, train_lib.ResumeError) as e:
    print(f'error: {e}', file=sys.stderr)
    return EXIT_CONFIG
  except train_lib.Interrupted as e:
    print(f'\n{e.task}/{e.arm}: '
          f'{stop_message("interrupted", e.step, e.checkpoint)}:\n'
          f'  {resume_command(argv)}', file=sys.stderr)
    return EXIT_INTERRUPTED
  except KeyboardInterrupt:
    print(f'\ninterrupted; rerun with --resume:\n  {resume_command(argv)}',
          file=sys.stderr)
    return EXIT_INTERRUPTED
  print()
  print(paths['text'])
  plots = [paths[k] for k in ('loss_png', 'scales_png', 'from_float_png') if k in paths]
  print(f'\nwrote {paths["table"]}, {", ".join(plots)}, {paths["json"]} '
        f'({time.perf_counter() - t0:.0f} s)')
  if args.stop_after is not None:
    lines = _stopped_lines(results, args.stop_after)
    if lines:
      print('\n'.join(lines) + f':\n  {resume_command(argv)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
