"""Reporting for the main job: text tables, PNG plots and a JSON summary.

All functions accept non-finite numbers anywhere (a diverged arm has NaN
losses and may have NaN scales): tables print ``nan``, plots leave gaps and
the JSON summary writes ``null``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import textwrap
from typing import Any, Sequence

import numpy as np

from fp8_linen_job import quant_state
from fp8_linen_job import train as train_lib

LOSS_PNG = 'loss_curves.png'
SCALES_PNG = 'scales.png'
SUMMARY_JSON = 'summary.json'
TABLE_TXT = 'results.txt'
REFERENCE_ARM = 'bf16'


def _fmt(value: float | None, spec: str) -> str:
  if value is None:
    return '-'
  if not math.isfinite(value):
    return 'nan' if math.isnan(value) else ('inf' if value > 0 else '-inf')
  return format(value, spec)


def _ratio(result: train_lib.ArmResult,
           results: Sequence[train_lib.ArmResult]) -> float | None:
  ref = next((r for r in results
              if r.task == result.task and r.arm == REFERENCE_ARM), None)
  if ref is None or not ref.median_step_s > 0:
    return None
  return result.median_step_s / ref.median_step_s


TABLE_HEADER = ('arm', 'steps', 'train loss', 'val loss', 'val acc',
                'ms/step', 'vs bf16')
HEALTH_HEADER = ('arm', 'state values', 'non-finite', 'skipped amax')
SERVED_HEADER = ('arm', 'served val loss', 'served val acc', 'vs QAT', 'weights',
                 'vs f32')
WIDTH = 80
"""Every line of the printed report fits a terminal this wide."""


def table_rows(results: Sequence[train_lib.ArmResult]) -> list[list[str]]:
  """One row of strings per result (same order), matching TABLE_HEADER."""
  rows = []
  for r in results:
    ratio = _ratio(r, results)
    rows.append([
        r.arm, str(r.steps_done), _fmt(r.final_train_loss, '.4f'),
        _fmt(r.val_loss, '.4f'), _fmt(r.val_acc, '.4f'),
        _fmt(r.median_step_s * 1e3, '.2f'),
        '-' if ratio is None else _fmt(ratio, '.2f') + 'x'])
  return rows


def health_rows(results: Sequence[train_lib.ArmResult]) -> list[list[str]]:
  """Rows of HEALTH_HEADER for the arms with quantization state."""
  rows = []
  for r in results:
    if r.health is None:
      continue
    h = quant_state.summarize_health(r.health)
    rows.append([r.arm, str(h['values']), str(h['nonfinite']),
                 '-' if h['skipped'] is None else str(h['skipped'])])
  return rows


def served_rows(results: Sequence[train_lib.ArmResult]) -> list[list[str]]:
  """Rows of SERVED_HEADER for the arms that were converted and served."""
  rows = []
  for r in results:
    s = r.served
    if not s:
      continue
    same = s['val_loss'] == r.val_loss and s['val_acc'] == r.val_acc
    diff = ('equal' if same else
            f"{s['val_loss'] - r.val_loss:+.1e}" if math.isfinite(r.val_loss)
            else '-')
    ratio = s['weight_bytes'] / s['float_weight_bytes']
    rows.append([r.arm, _fmt(s['val_loss'], '.4f'), _fmt(s['val_acc'], '.4f'),
                 diff, f"{s['weight_bytes'] / 1024:.0f} KiB",
                 _fmt(ratio, '.2f') + 'x'])
  return rows


def format_table(rows: Sequence[Sequence[str]],
                 header: Sequence[str] = TABLE_HEADER) -> str:
  """Aligns ``rows`` under ``header`` as a plain-text table."""
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  def line(cells):
    return '  '.join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return '\n'.join([line(header), line(['-' * w for w in widths])]
                   + [line(r) for r in rows])


def _wrap(text: str, indent: str = '') -> str:
  return textwrap.fill(text, WIDTH, subsequent_indent=indent,
                       break_on_hyphens=False)


LEGEND = (
    'train loss: mean of the last {window} steps; val: held-out data after '
    'the last step, quantizers frozen (fl.frozen_quantizers: observers keep '
    'their trained ranges, as in the served model).',
    'ms/step: median train-step time of this run (compilation, evaluation '
    'and checkpoints excluded). The arms ran one after another, and on a CPU '
    'fp8 and int8 are emulated (no fp8/int8 units), so "vs bf16" is not a '
    'benchmark: it varies by tens of percent between identical runs. For '
    'timings see benchmarks/ (interleaved, repeated).',
    'quantization state: entries of the scales, amax histories and integer '
    'steps/ranges; non-finite: NaN/inf among them; skipped amax: '
    'observations missing from the steps trained (a NaN/inf batch is '
    'recorded as 0). Healthy: 0 non-finite, 0 skipped.',
    'served model: fl.convert of the final state (weights stored as int8/fp8 '
    'codes, input scales frozen), evaluated on the same held-out data; vs '
    'QAT: "equal" when its loss and accuracy equal the QAT model\'s exactly, '
    'else the loss difference; weights: bytes of the served params, vs f32: '
    'against the QAT model\'s float32 params.',
)


def format_report(results: Sequence[train_lib.ArmResult],
                  descriptions: dict[str, str] | None = None) -> str:
  """One table per task (plus its quantization state), then a legend.

  Every line is at most :data:`WIDTH` characters.
  """
  descriptions = descriptions or {}
  blocks = []
  for task in dict.fromkeys(r.task for r in results):
    task_results = [r for r in results if r.task == task]
    title = f'task {task}'
    if task in descriptions:
      title += f': {descriptions[task]}'
    block = _wrap(title, '  ') + '\n' + format_table(table_rows(task_results))
    health = health_rows(task_results)
    if health:
      block += '\n\nquantization state\n' + format_table(health,
                                                         HEALTH_HEADER)
    served = served_rows(task_results)
    if served:
      block += '\n\nserved model\n' + format_table(served, SERVED_HEADER)
    blocks.append(block)
  legend = '\n'.join(_wrap(p.format(window=train_lib.TRAIN_LOSS_WINDOW))
                      for p in LEGEND)
  text = '\n\n'.join(blocks) + '\n\n' + legend
  notes = list(dict.fromkeys(f'{r.arm}: {n}' for r in results
                             for n in r.notes))
  if notes:
    text += '\nnotes:\n' + '\n'.join(_wrap(f'  {n}', '    ') for n in notes)
  return text


# ---------------------------------------------------------------------------
# JSON.


def _json_safe(value: Any) -> Any:
  """Replaces NaN/inf by None and numpy scalars by Python numbers."""
  if isinstance(value, dict):
    return {str(k): _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  if isinstance(value, np.ndarray):
    return _json_safe(value.tolist())
  if isinstance(value, np.generic):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def summary_dict(results: Sequence[train_lib.ArmResult],
                 config: dict[str, Any], extra: dict[str, Any] | None = None,
                 include_history: bool = True) -> dict[str, Any]:
  """The JSON summary: config, per-arm results and (optionally) curves."""
  arms = []
  for r in results:
    d = dataclasses.asdict(r)
    d['step_time_ratio_vs_bf16'] = _ratio(r, results)
    if not include_history:
      d.pop('history')
    arms.append(d)
  return _json_safe({'config': config, **(extra or {}), 'results': arms})


def write_json(path: str, data: dict[str, Any]) -> None:
  """Writes strict JSON (no NaN tokens)."""
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(_json_safe(data), f, indent=1, allow_nan=False)
    f.write('\n')


# ---------------------------------------------------------------------------
# Plots.


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
  """Trailing moving average that propagates NaN only locally."""
  x = np.asarray(values, dtype=np.float64)
  if window <= 1 or len(x) < window:
    return x
  kernel = np.ones(window) / window
  padded = np.concatenate([np.full(window - 1, x[0]), x])
  return np.convolve(padded, kernel, mode='valid')


ARM_STYLES = {
    'bf16': dict(color='black', ls='-', lw=2.6, alpha=0.45, marker='o'),
    'fp8': dict(color='tab:orange', ls='--', lw=1.6, alpha=1.0, marker='s'),
    'int8': dict(color='tab:blue', ls=':', lw=2.0, alpha=1.0, marker='^'),
}
"""Line style per arm: the reference is wide and translucent, the others
dashed or dotted on top of it, so that arms which track each other closely
all stay visible."""


def _style(arm: str, index: int) -> dict[str, Any]:
  return ARM_STYLES.get(arm, dict(color=f'C{index + 3}', ls='-.', lw=1.6,
                                  alpha=1.0, marker='D'))


def _smoothed(window: int) -> str:
  return f'smoothed over {window} steps' if window > 1 else 'per step'


def _by_step(steps: Sequence[int], values: Sequence[float]) -> dict[int, float]:
  return dict(zip(steps, values))


def plot_losses(results: Sequence[train_lib.ArmResult], path: str) -> None:
  """Loss curves: one column per task.

  Top row: the smoothed train loss of every arm and its validation loss
  (markers). Bottom row (when there is a ``bf16`` arm): each other arm's
  loss minus the ``bf16`` loss at the same step, which shows differences
  that are too small to see on the top row.
  """
  plt = _pyplot()
  task_names = list(dict.fromkeys(r.task for r in results)) or ['(none)']
  has_ref = any(r.arm == REFERENCE_ARM for r in results)
  nrows = 2 if has_ref else 1
  fig, axes = plt.subplots(nrows, len(task_names),
                           figsize=(6.5 * len(task_names), 3.6 * nrows),
                           squeeze=False)
  for col, task in enumerate(task_names):
    ax = axes[0][col]
    task_results = [r for r in results if r.task == task]
    ref = next((r for r in task_results if r.arm == REFERENCE_ARM), None)
    window = 1
    for i, r in enumerate(task_results):
      h, st = r.history, _style(r.arm, i)
      steps = np.asarray(h['step'])
      if len(steps):
        window = max(1, len(steps) // 50)
        ax.plot(steps, _smooth(h['loss'], window), color=st['color'],
                ls=st['ls'], lw=st['lw'], alpha=st['alpha'],
                label=f'{r.arm} train')
      if h['eval']:
        ax.plot([e['step'] for e in h['eval']], [e['loss'] for e in h['eval']],
                st['marker'], color=st['color'], ms=6, mfc='none', mew=1.5,
                label=f'{r.arm} val')
    ax.set_title(f'{task}: loss (train {_smoothed(window)})', fontsize=10)
    ax.set_xlabel('step')
    ax.set_ylabel('cross-entropy')
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, ncol=2)
    if nrows == 1:
      continue
    ax = axes[1][col]
    ax.axhline(0.0, **{k: v for k, v in _style(REFERENCE_ARM, 0).items()
                       if k not in ('marker', 'ls')})
    diff_window = 1
    if ref is not None:
      ref_train = _by_step(ref.history['step'], ref.history['loss'])
      ref_eval = {e['step']: e['loss'] for e in ref.history['eval']}
      for i, r in enumerate(task_results):
        if r is ref:
          continue
        st = _style(r.arm, i)
        train = _by_step(r.history['step'], r.history['loss'])
        steps = sorted(set(train) & set(ref_train))
        if steps:
          diff_window = max(1, len(steps) // 20)
          diff = _smooth([train[k] - ref_train[k] for k in steps], diff_window)
          ax.plot(steps, diff, color=st['color'], ls=st['ls'], lw=st['lw'],
                  label=f'{r.arm} train')
        evals = [(e['step'], e['loss'] - ref_eval[e['step']])
                 for e in r.history['eval'] if e['step'] in ref_eval]
        if evals:
          ax.plot(*zip(*evals), st['marker'], color=st['color'], ms=6,
                  mfc='none', mew=1.5, label=f'{r.arm} val')
    ax.set_title(f'{task}: loss minus {REFERENCE_ARM} loss (train '
                 f'{_smoothed(diff_window)})', fontsize=10)
    ax.set_xlabel('step')
    ax.set_ylabel(f'loss - {REFERENCE_ARM} loss')
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _trace_groups(trace: dict[str, list[float]]) -> dict[str, list[str]]:
  """Groups trace keys ``<layer>/<role>_<what>`` by role."""
  groups: dict[str, list[str]] = {}
  for key in trace:
    leaf = key.rsplit('/', 1)[-1]
    role = leaf.rsplit('_', 1)[0]
    groups.setdefault(role, []).append(key)
  return groups


# What each traced quantity is drawn as, and its y-axis label.
_SOLID = {'scale': 'scale = amax / fp8 max', 'step': 'step size s'}
_DASHED = {'amax': 'amax = max |x|', 'range': 'observer range'}

SCALES_CAPTION = (
    'fp8 (solid): scale = amax * 2^margin / fp8 max, the value of one fp8 '
    'unit (x is stored as x / scale; fp8 max is 448 for e4m3, 57344 for '
    'e5m2; delayed scaling takes the largest amax of the history). Dashed: '
    'the amax (largest |x|) of the newest step.\n'
    'int8 (solid): step size s, x ~= s * q for an integer q in [-128, 127] '
    '(LSQ learns s; mean over channels for per-channel weights). Dashed: an '
    "observer's range, the largest |x| it has seen.")


def plot_scales(results: Sequence[train_lib.ArmResult], path: str) -> None:
  """The traced quantization state of every quantized task/arm.

  One row per quantized task/arm, one column per tensor role (``input``,
  ``kernel``, and ``output_grad`` for fp8). Per layer (colour): the fp8
  scale or integer step size (solid) and the newest amax or observer range
  (dashed), on a log axis. Writes a placeholder figure if no arm has
  quantization state.
  """
  plt = _pyplot()
  traced = [r for r in results if r.history.get('trace')]
  if not traced:
    fig, ax = plt.subplots(figsize=(6, 2))
    ax.axis('off')
    ax.text(0.5, 0.5, 'no quantized arm was trained: no scales to plot',
            ha='center', va='center')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return
  roles = list(dict.fromkeys(
      role for r in traced for role in _trace_groups(r.history['trace'])))
  height = 3.0 * len(traced) + 1.0
  fig, axes = plt.subplots(len(traced), len(roles),
                           figsize=(5.2 * len(roles), height), squeeze=False)
  for row, r in zip(axes, traced):
    steps = np.asarray(r.history['trace_step'])
    groups = _trace_groups(r.history['trace'])
    for ax, role in zip(row, roles):
      keys = groups.get(role, [])
      if not keys:
        ax.axis('off')
        continue
      layers = list(dict.fromkeys(k.rsplit('/', 1)[0] for k in keys))
      kinds = set()
      for i, layer in enumerate(layers):
        for what, style in [(w, '-') for w in _SOLID] + [(w, '--')
                                                       for w in _DASHED]:
          values = np.abs(np.asarray(
              r.history['trace'].get(f'{layer}/{role}_{what}', []),
              dtype=np.float64))
          if not len(values):
            continue
          kinds.add(what)
          values[values == 0] = np.nan  # Log axis: show zeros as gaps.
          ax.plot(steps[:len(values)], values, style, color=f'C{i}', lw=1.2,
                  label=layer)
      ax.set_yscale('log')
      ax.set_title(f'{r.task}/{r.arm}: {role}', fontsize=10)
      ax.set_xlabel('step')
      solid = [_SOLID[k] for k in _SOLID if k in kinds]
      dashed = [_DASHED[k] for k in _DASHED if k in kinds]
      label = ', '.join(solid)
      if dashed:
        label += f' (solid)\n{", ".join(dashed)} (dashed)' if solid else (
            f'{", ".join(dashed)} (dashed)')
      ax.set_ylabel(label, fontsize=9)
      ax.grid(alpha=0.3)
      handles, labels = ax.get_legend_handles_labels()
      if handles:
        first = {}  # One entry per layer (colour), whatever its line style.
        for handle, text in zip(handles, labels):
          first.setdefault(text, handle)
        ax.legend(first.values(), first.keys(), fontsize=7)
  fig.text(0.01, 0.005, SCALES_CAPTION, fontsize=8, va='bottom', ha='left',
           wrap=True)
  fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_report(results: Sequence[train_lib.ArmResult], out_dir: str, *,
                 config: dict[str, Any],
                 descriptions: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, str]:
  """Writes the table, both PNGs and the JSON summary into ``out_dir``.

  Args:
    results: Results of all task/arm runs.
    out_dir: Output directory (created if needed).
    config: The job config as a plain dict.
    descriptions: Task name -> one-line description for the tables.
    extra: More top-level JSON fields (e.g. wall time, device).

  Returns:
    Kind (``table``, ``loss_png``, ``scales_png``, ``json``) -> path, plus
    ``text``: the table text.
  """
  os.makedirs(out_dir, exist_ok=True)
  paths = {'table': os.path.join(out_dir, TABLE_TXT),
           'loss_png': os.path.join(out_dir, LOSS_PNG),
           'scales_png': os.path.join(out_dir, SCALES_PNG),
           'json': os.path.join(out_dir, SUMMARY_JSON)}
  text = format_report(results, descriptions)
  with open(paths['table'], 'w', encoding='utf-8') as f:
    f.write(text + '\n')
  plot_losses(results, paths['loss_png'])
  plot_scales(results, paths['scales_png'])
  write_json(paths['json'], summary_dict(
      results, config, dict(extra or {}, descriptions=descriptions or {})))
  return dict(paths, text=text)
