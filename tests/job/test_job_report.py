"""Tests of fp8_linen_job.report and .qstate, including non-finite values."""

import json
import math

import numpy as np

from fp8_linen import monitor as qstate
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


def test_report_survives_nan(tmp_path):
  nan = float('nan')
  health = qstate.state_health(_owg_variables(scale=np.inf), steps_done=5)
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
  rows = {line.split()[0]: line for line in text.splitlines()
          if line.startswith(('bf16', 'fp8'))}
  assert '2.00x' in rows['fp8'] and '2/4' in rows['fp8']
  assert rows['bf16'].split()[-3:] == ['-', '-', '-']
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
