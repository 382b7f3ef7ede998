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
from typing import Any, Sequence

import numpy as np

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


def _health_cells(result: train_lib.ArmResult) -> list[str]:
  h = result.health
  if h is None:
    return ['-', '-', '-']
  return [f'{h["nonfinite_scales"]}/{h["scales"]}',
          f'{h["zero_amax"]}/{h["amax_entries"]}',
          str(h['skipped_amax'])]


TABLE_HEADER = ('arm', 'steps', 'train loss', 'val loss', 'val acc',
                'step ms (median)', 'vs bf16', 'nonfinite scales',
                'zero amax', 'skipped amax')


def table_rows(results: Sequence[train_lib.ArmResult]) -> list[list[str]]:
  """One row of strings per result (same order), matching TABLE_HEADER."""
  rows = []
  for r in results:
    ratio = _ratio(r, results)
    rows.append([
        r.arm, str(r.steps_done), _fmt(r.final_train_loss, '.4f'),
        _fmt(r.val_loss, '.4f'), _fmt(r.val_acc, '.4f'),
        _fmt(r.median_step_s * 1e3, '.2f'),
        '-' if ratio is None else _fmt(ratio, '.2f') + 'x',
        *_health_cells(r)])
  return rows


def format_table(rows: Sequence[Sequence[str]],
                 header: Sequence[str] = TABLE_HEADER) -> str:
  """Aligns ``rows`` under ``header`` as a plain-text table."""
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  def line(cells):
    return '  '.join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return '\n'.join([line(header), line(['-' * w for w in widths])]
                   + [line(r) for r in rows])


def format_report(results: Sequence[train_lib.ArmResult],
                  descriptions: dict[str, str] | None = None) -> str:
  """One table per task, with a title line naming the task."""
  descriptions = descriptions or {}
  blocks = []
  for task in dict.fromkeys(r.task for r in results):
    task_results = [r for r in results if r.task == task]
    title = f'task {task}'
    if task in descriptions:
      title += f': {descriptions[task]}'
    blocks.append(title + '\n' + format_table(table_rows(task_results)))
  notes = list(dict.fromkeys(f'  {r.arm}: {n}' for r in results
                             for n in r.notes))
  legend = ('train loss: mean of the last '
            f'{train_lib.TRAIN_LOSS_WINDOW} steps; val: held-out data after '
            'the last step; nonfinite scales: NaN/inf entries of *_scale (and '
            'of int observers\' *_range); '
            'zero amax: zero entries of *_amax_history (skipped: zeros among '
            'the entries that training should have filled)')
  text = '\n\n'.join(blocks) + '\n\n' + legend
  if notes:
    text += '\nnotes:\n' + '\n'.join(notes)
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


def plot_losses(results: Sequence[train_lib.ArmResult], path: str) -> None:
  """Train (smoothed) and validation loss of every arm, one panel per task."""
  plt = _pyplot()
  task_names = list(dict.fromkeys(r.task for r in results)) or ['(none)']
  fig, axes = plt.subplots(1, len(task_names),
                           figsize=(6 * len(task_names), 4), squeeze=False)
  for ax, task in zip(axes[0], task_names):
    for i, r in enumerate(x for x in results if x.task == task):
      h = r.history
      color = f'C{i}'
      steps = np.asarray(h['step'])
      if len(steps):
        window = max(1, len(steps) // 50)
        ax.plot(steps, h['loss'], color=color, alpha=0.2, lw=0.8)
        # The first arm (usually bf16) is drawn wider so that a quantized
        # arm tracking it closely stays visible on top.
        ax.plot(steps, _smooth(h['loss'], window), color=color,
                lw=2.8 if i == 0 else 1.3, label=f'{r.arm} train')
      if h['eval']:
        ax.plot([e['step'] for e in h['eval']], [e['loss'] for e in h['eval']],
                'o--', color=color, ms=4, label=f'{r.arm} val')
    ax.set_title(f'{task}: loss')
    ax.set_xlabel('step')
    ax.set_ylabel('cross-entropy')
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _trace_groups(trace: dict[str, list[float]]) -> dict[str, list[str]]:
  """Groups trace keys ``<layer>/<role>_scale|_amax`` by role."""
  groups: dict[str, list[str]] = {}
  for key in trace:
    leaf = key.rsplit('/', 1)[-1]
    role = leaf.rsplit('_', 1)[0]
    groups.setdefault(role, []).append(key)
  return groups


def plot_scales(results: Sequence[train_lib.ArmResult], path: str) -> None:
  """Scales (solid) and newest amax (dashed) of traced quantized layers.

  One row per quantized task/arm, one column per tensor role. Writes a
  placeholder figure if no arm has quantization state.
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
  fig, axes = plt.subplots(len(traced), len(roles),
                           figsize=(5 * len(roles), 3.2 * len(traced)),
                           squeeze=False)
  for row, r in zip(axes, traced):
    steps = r.history['trace_step']
    groups = _trace_groups(r.history['trace'])
    for ax, role in zip(row, roles):
      layers = sorted({k.rsplit('/', 1)[0] for k in groups.get(role, [])})
      for i, layer in enumerate(layers):
        for suffix, style in (('scale', '-'), ('amax', '--')):
          values = np.abs(np.asarray(
              r.history['trace'].get(f'{layer}/{role}_{suffix}', []),
              dtype=np.float64))
          if len(values):
            values[values == 0] = np.nan  # Log axis: show zeros as gaps.
            ax.plot(steps[:len(values)], values, style, color=f'C{i}',
                    lw=1.2, label=f'{layer} {suffix}')
      ax.set_yscale('log')
      ax.set_title(f'{r.task}/{r.arm}: {role}', fontsize=9)
      ax.set_xlabel('step')
      ax.grid(alpha=0.3)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
  fig.tight_layout()
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
