"""The job's from-float stage (--from-float): PTQ, QAT from PTQ and QLoRA from the bf16 model."""

import json
import os

import numpy as np
import pytest

from fp8_linen_job import config as config_lib
from fp8_linen_job import from_float
from fp8_linen_job import main as main_lib

STAGES = ['bf16', 'bf16, more steps', 'ptq int8', 'ptq int4', 'ptq int4, gptq', 'qat from ptq int4',
          'qlora int4', 'qlora int4, merged']


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('from_float'))
  status = main_lib.main(['--config', 'tiny', '--tasks', 'digits', '--arms', 'bf16',
                          '--from-float', '--no-progress', '--out', out])
  assert status == 0
  with open(os.path.join(out, 'summary.json')) as f:
    return out, json.load(f)


def test_every_stage_is_reported(run):
  out, summary = run
  rows = summary['from_float']['digits']
  assert [r['stage'] for r in rows] == STAGES
  by = {r['stage']: r for r in rows}
  # Served weights: int4 codes below int8's, both below the float model's; QLoRA serves
  # from the int4 codes (its adapters counted apart, not in the base).
  assert by['ptq int4']['weight_bytes'] < by['ptq int8']['weight_bytes'] < by['bf16'][
      'weight_bytes']
  assert by['qlora int4']['weight_bytes'] == by['ptq int4']['weight_bytes']
  steps = config_lib.load_config('tiny').digits.steps
  assert by['qat from ptq int4']['steps'] == max(1, round(0.2 * steps))
  for r in rows:
    assert np.isfinite(r['val_loss']) and 0.0 <= r['val_acc'] <= 1.0
  table = open(os.path.join(out, 'results.txt')).read()
  assert 'digits: from the trained bf16 model' in table and 'qlora int4, merged' in table
  assert os.path.getsize(os.path.join(out, from_float.PLOT_PNG)) > 0


def test_gap_closed():
  rows = [from_float.Row(stage=s, steps=0, val_loss=v, val_acc=0.0, weight_bytes=0, seconds=0.0)
          for s, v in [('bf16', 1.0), ('ptq int4', 1.2), ('qat from ptq int4', 1.05)]]
  assert from_float.gap_closed(rows, 'qat from ptq int4') == pytest.approx(0.75)
  rows[1] = from_float.Row(stage='ptq int4', steps=0, val_loss=0.9, val_acc=0.0, weight_bytes=0,
                           seconds=0.0)
  assert np.isnan(from_float.gap_closed(rows, 'qat from ptq int4'))


def test_config_errors_name_the_key():
  with pytest.raises(config_lib.ConfigError, match='from_float.enabled needs the bf16 arm'):
    config_lib.merge(config_lib.JobConfig(), {'arms': ['int8'], 'from_float': {'enabled': True}})
  with pytest.raises(config_lib.ConfigError, match='api: linen'):
    config_lib.merge(config_lib.JobConfig(), {'api': 'nnx', 'from_float': {'enabled': True}})
  with pytest.raises(config_lib.ConfigError, match='qat_fraction'):
    config_lib.merge(config_lib.JobConfig(), {'from_float': {'qat_fraction': 2.0}})
