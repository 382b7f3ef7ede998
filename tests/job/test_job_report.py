"""Tests of fp8_linen_job.report and .quant_state, non-finite values too."""

import json
import math

import numpy as np
import pytest
import tqdm

from fp8_linen import monitor as qstate
from fp8_linen_job import quant_state
from fp8_linen_job import report
from fp8_linen_job import train as train_lib

OWG = qstate.OWG


def _owg_variables(scale=1.0, history=(3.0, 2.0, 0.0, 0.0)):
  role = lambda: {'input_scale': np.array([scale], np.float32),
                  'input_amax_history': np.array(history, np.float32),
                  'output_grad_scale': np.array([1.0], np.float32),
                  'output_grad_amax_history': np.array(history, np.float32)}
  return {'params': {'a': {'kernel': np.ones((2, 2))}},
          OWG: {'a': role(), 'b': {'c': role()}}}


def test_state_health_counts():
  health = qstate.state_health(_owg_variables(scale=np.nan), steps_done=3)
  assert health == dict(scales=4, nonfinite_scales=2, amax_entries=16,
                        zero_amax=8, skipped_amax=4, nonfinite_amax=0)
  assert qstate.state_health({'params': {}}, steps_done=3) is None


def test_quantized_modules_and_traces():
  variables = _owg_variables()
  modules = qstate.quantized_modules(variables)
  assert modules == [('a',), ('b', 'c')]
  trace = qstate.trace_values(variables, modules[:1])
  assert set(trace) == {'a/input_scale', 'a/input_amax',
                        'a/output_grad_scale', 'a/output_grad_amax'}
  assert float(trace['a/input_amax']) == 3.0
  assert qstate.pick_evenly(list(range(10)), 3) == [0, 4, 9]


def _result(arm, loss, quantized, health=None, trace=None):
  history = train_lib.new_history({})
  steps = list(range(1, 6))
  history.update(step=steps, loss=loss, acc=[0.5] * 5, grad_norm=[1.0] * 5,
                 step_time=[0.01] * 5,
                 eval=[{'step': 5, 'loss': loss[-1], 'acc': 0.5}])
  if trace:
    history['trace_step'] = steps
    history['trace'] = trace
  return train_lib.ArmResult(
      task='lm', arm=arm, quantized=quantized, steps_done=5, param_count=10,
      final_train_loss=float(np.mean(loss[-3:])), val_loss=loss[-1],
      val_acc=0.5, median_step_s=0.01 if arm == 'bf16' else 0.02,
      compile_s=1.0, health=health, history=history)


def _lines_of(text, first_word):
  return [l for l in text.splitlines() if l.split()[:1] == [first_word]]


def test_report_survives_nan(tmp_path):
  nan = float('nan')
  health = quant_state.health(_owg_variables(scale=np.inf), steps_done=5)
  results = [
      _result('bf16', [3.0, 2.0, nan, nan, nan], False),
      _result('fp8', [3.0, 2.5, 2.0, float('inf'), nan], True, health,
              trace={'a/input_scale': [1.0, nan, 0.0, 2.0, np.inf],
                     'a/input_amax': [nan] * 5}),
  ]
  paths = report.write_report(results, str(tmp_path), config={'x': 1},
                              descriptions={'lm': 'test task'},
                              extra={'wall_s': nan})
  text = paths['text']
  assert 'nan' in text and 'test task' in text
  (bf16_row,) = _lines_of(text, 'bf16')
  fp8_row, fp8_health = _lines_of(text, 'fp8')
  assert '2.00x' in fp8_row and bf16_row.split()[-1] == '1.00x'
  # 4 scale entries (2 non-finite) + 16 amax entries, whose zeros all lie
  # among the 5 steps trained: skipped observations.
  assert fp8_health.split() == ['fp8', '20', '2', '8']
  for key in ('loss_png', 'scales_png', 'json', 'table'):
    with open(paths[key], 'rb') as f:
      assert len(f.read()) > 100
  with open(paths['json'], encoding='utf-8') as f:
    summary = json.loads(f.read(), parse_constant=lambda c: 1 / 0)  # strict
  assert summary['wall_s'] is None
  fp8 = summary['results'][1]
  assert fp8['step_time_ratio_vs_bf16'] == 2.0
  assert fp8['history']['loss'][-1] is None
  assert fp8['health']['nonfinite_scales'] == 2


def test_report_fits_80_columns():
  health = quant_state.health(_owg_variables(), steps_done=5)
  results = [_result(arm, [1.2345678] * 5, arm != 'bf16',
                     None if arm == 'bf16' else health)
             for arm in ('bf16', 'fp8', 'int8')]
  for r in results:
    r.median_step_s = 12345.678  # Wide numbers everywhere.
    r.steps_done = 123456
    r.notes = ('a remark long enough to need wrapping in an 80-column '
               'terminal, about the arm and its layers',)
  text = report.format_report(results, {'lm': 'x' * 50 + ' a long description '
                                        'of the task ' + 'y' * 40})
  assert max(len(line) for line in text.splitlines()) <= report.WIDTH == 80
  assert len(_lines_of(text, 'fp8')) == 2  # Results table and state table.


def test_health_reports_only_trouble():
  # Zeros beyond the steps trained are unfilled history: not reported.
  healthy = quant_state.health(_owg_variables(history=(3.0, 2.0, 0.0, 0.0)),
                               steps_done=2)
  sick = quant_state.health(_owg_variables(history=(3.0, 0.0, np.nan, 0.0)),
                            steps_done=3)
  text = report.format_report([_result('fp8', [1.0] * 5, True, healthy),
                               _result('int8', [1.0] * 5, True, sick)])
  assert 'zero amax' not in text
  assert _lines_of(text, 'fp8')[1].split() == ['fp8', '20', '0', '0']
  # One NaN in each of the 4 histories; 1 zero each among the first 3.
  assert _lines_of(text, 'int8')[1].split() == ['int8', '20', '4', '4']


def test_legend_says_the_ratio_is_not_a_benchmark():
  text = report.format_report([_result('bf16', [1.0] * 5, False)])
  flat = ' '.join(text.split())
  assert '"vs bf16" is not a benchmark' in flat and 'benchmarks/' in flat


def _int_variables():
  return {'params': {'fc': {'kernel': np.ones((4, 3)),
                            'input_step': np.array([0.5], np.float32),
                            'kernel_step': np.array([[0.1, 0.2, 0.3]],
                                                    np.float32),
                            'input_offset': np.array([-1.0], np.float32)},
                     'head': {'kernel': np.ones((3, 2))}},
          OWG: {'obs': {'input_range': np.array([2.0, 5.0], np.float32)}}}


def test_int_state_is_traced_and_checked():
  variables = _int_variables()
  modules = quant_state.quantized_modules(variables)
  assert modules == [('fc',), ('obs',)]
  trace = {k: float(v) for k, v in
           quant_state.trace_values(variables, modules).items()}
  assert trace == pytest.approx({'fc/input_step': 0.5, 'fc/kernel_step': 0.2,
                                 'obs/input_range': 5.0})
  h = quant_state.health(variables, steps_done=3)
  assert h['int_values'] == 5 and h['nonfinite_int_values'] == 0
  assert h['scales'] == 2  # The observer range, counted by the monitor.
  variables['params']['fc']['kernel_step'][0, 1] = np.nan
  summary = quant_state.summarize_health(quant_state.health(variables, 3))
  assert summary == {'values': 7, 'nonfinite': 1, 'skipped': None}
  assert quant_state.health({'params': {'fc': {'kernel': np.ones(2)}}},
                            3) is None


def _saved_axes(monkeypatch):
  """Collects the axes of every figure the report saves."""
  import matplotlib.figure  # pylint: disable=g-import-not-at-top
  axes = []
  real_savefig = matplotlib.figure.Figure.savefig

  def savefig(fig, *args, **kwargs):
    axes.extend(fig.axes)
    return real_savefig(fig, *args, **kwargs)

  monkeypatch.setattr(matplotlib.figure.Figure, 'savefig', savefig)
  return axes


def test_scales_png_shows_int_state(tmp_path, monkeypatch):
  axes = _saved_axes(monkeypatch)
  int8 = _result('int8', [1.0] * 5, True, trace={
      'fc/input_step': [0.5] * 5, 'fc/kernel_step': [0.2] * 5,
      'obs/input_range': [5.0] * 5})
  fp8 = _result('fp8', [1.0] * 5, True, trace={
      'a/input_scale': [0.01] * 5, 'a/input_amax': [4.0] * 5,
      'a/output_grad_scale': [1e-8] * 5, 'a/output_grad_amax': [1e-4] * 5})
  path = str(tmp_path / 's.png')
  report.plot_scales([fp8, int8], path)
  panels = {ax.get_title(): ax for ax in axes if ax.get_title()}
  assert set(panels) == {'lm/fp8: input', 'lm/fp8: output_grad',
                         'lm/int8: input', 'lm/int8: kernel'}
  int_input = panels['lm/int8: input']
  assert [l.get_linestyle() for l in int_input.get_lines()] == ['-', '--']
  assert [l.get_label() for l in int_input.get_lines()] == ['fc', 'obs']
  assert 'step size' in int_input.get_ylabel()
  assert 'observer range' in int_input.get_ylabel()
  fp8_input = panels['lm/fp8: input']
  assert 'scale' in fp8_input.get_ylabel() and 'amax' in fp8_input.get_ylabel()
  np.testing.assert_allclose(fp8_input.get_lines()[0].get_ydata(), 0.01)
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_loss_plot_draws_each_arm_distinctly_with_difference_panel(
    tmp_path, monkeypatch):
  axes = _saved_axes(monkeypatch)
  results = [_result(arm, [3.0, 2.0, 1.5, 1.2, 1.0], arm != 'bf16')
             for arm in ('bf16', 'fp8', 'int8')]
  results[2].history['loss'] = [3.1, 2.1, 1.6, 1.3, 1.1]
  results[2].history['eval'] = [{'step': 5, 'loss': 1.1, 'acc': 0.5}]
  report.plot_losses(results, str(tmp_path / 'l.png'))
  top, bottom = axes
  assert 'minus bf16' in bottom.get_title()
  train = {l.get_label(): l for l in top.get_lines()
           if l.get_label().endswith(' train')}
  assert set(train) == {'bf16 train', 'fp8 train', 'int8 train'}
  styles = {(l.get_linestyle(), l.get_color()) for l in train.values()}
  assert len(styles) == 3  # No arm hides another of the same look.
  diffs = {l.get_label(): l.get_ydata() for l in bottom.get_lines()}
  np.testing.assert_allclose(diffs['fp8 train'], 0.0)
  np.testing.assert_allclose(diffs['int8 train'], 0.1)
  np.testing.assert_allclose(diffs['int8 val'], 0.1)


def test_progress_bar_fits_80_columns_with_one_rate():
  meter = tqdm.tqdm.format_meter(
      n=150, total=300, elapsed=12.0, ncols=80, prefix='digits/int8',
      bar_format=train_lib.BAR_FORMAT, unit='step',
      postfix=train_lib.bar_postfix(2.3456, [0.05] * 30))
  assert len(meter) <= 80
  assert 'loss 2.346, 20.0 step/s' in meter
  assert meter.count('/s') == 1  # Not tqdm's rate next to ours.
  assert len(meter.split('|')[1]) >= 10  # The bar itself is not squeezed.


def test_table_without_reference_arm_prints_dash():
  rows = report.table_rows([_result('fp8', [1.0] * 5, True)])
  assert rows[0][report.TABLE_HEADER.index('vs bf16')] == '-'


def test_scales_png_without_quantized_arm(tmp_path):
  path = str(tmp_path / 's.png')
  report.plot_scales([_result('bf16', [1.0] * 5, False)], path)
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_fmt():
  assert report._fmt(math.nan, '.2f') == 'nan'
  assert report._fmt(-math.inf, '.2f') == '-inf'
  assert report._fmt(None, '.2f') == '-'
  assert report._fmt(1.234, '.2f') == '1.23'
