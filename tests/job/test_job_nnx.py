"""The job's `api: nnx` option: every task's model in Flax NNX, same loop and report."""

import dataclasses

import jax
import numpy as np
import pytest

from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import main as main_lib
from fp8_linen_job import tasks as tasks_lib


def _nnx_cfg(**kw):
  cfg = config_lib.load_config('tiny')
  return dataclasses.replace(cfg, **{'tasks': ('lm',), 'api': 'nnx', 'progress': False, **kw})


def test_api_option_from_cli_and_yaml(tmp_path):
  assert config_lib.JobConfig().api == 'linen'
  args = main_lib.parse_args(['--config', 'tiny', '--tasks', 'lm', '--api', 'nnx'])
  assert main_lib.config_from_args(args).api == 'nnx'
  path = tmp_path / 'c.yaml'
  path.write_text('tasks: [lm]\napi: nnx\n')
  assert config_lib.load_config(str(path)).api == 'nnx'
  path.write_text('api: jax\n')
  with pytest.raises(config_lib.ConfigError, match="'jax'.*allowed values: linen, nnx"):
    config_lib.load_config(str(path))
  assert config_lib.JobConfig(api='nnx').tasks == config_lib.TASKS  # every task has one


@pytest.mark.parametrize('arm', ['bf16', 'fp8', 'int8'])
@pytest.mark.parametrize('task_name', ['lm', 'digits'])
def test_nnx_model_has_the_linen_variable_tree(task_name, arm):
  # The train loop, checkpoints and the quantization report read the tree.
  cfg = _nnx_cfg(tasks=(task_name,))
  task = tasks_lib.build_task(task_name, cfg)
  linen_arm = arms_lib.build_arm(arm, dataclasses.replace(cfg, api='linen'))
  nnx_arm = arms_lib.build_arm(arm, cfg)
  key, x = jax.random.PRNGKey(0), task.example_input()
  shapes = [jax.tree.map(np.shape, task.build_model(a).init(key, x))
            for a in (linen_arm, nnx_arm)]
  assert shapes[0] == shapes[1]


def test_nnx_fp8_and_bf16_arms_train_and_report(tmp_path):
  results, paths = main_lib.run_job(_nnx_cfg(arms=('bf16', 'fp8')), str(tmp_path))
  bf16, fp8 = results
  for r in results:
    assert r.details['api'] == 'nnx' and any('NNX' in n for n in r.notes)
    assert r.final_train_loss < r.history['loss'][0]  # it learns
    assert np.isfinite(r.val_loss)
  assert fp8.health['scales'] > 0 and fp8.health['nonfinite_scales'] == 0
  assert fp8.health['amax_entries'] > fp8.health['zero_amax']  # histories written
  assert fp8.history['trace']
  assert abs(fp8.history['loss'][0] - bf16.history['loss'][0]) < 0.1  # same init, data
  rows = [l.split() for l in paths['text'].splitlines() if l.startswith(('bf16', 'fp8'))]
  assert {'bf16', 'fp8'} <= {r[0] for r in rows}


def test_nnx_digits_arms_learn(tmp_path):
  # Wider than the tiny config and a higher rate, so 40 steps reach an
  # accuracy only a working model gets (chance: 0.1).
  cfg = config_lib.load_config('tiny')
  digits = dataclasses.replace(cfg.digits, steps=40, batch_size=32, conv_features=(8,),
                               hidden=32, learning_rate=1e-2, eval_every=0)
  cfg = _nnx_cfg(tasks=('digits',), arms=('fp8', 'int8'), digits=digits)
  (fp8, int8), paths = main_lib.run_job(cfg, str(tmp_path))
  for r in (fp8, int8):
    assert r.details['api'] == 'nnx' and any('NNX' in n for n in r.notes)
    assert r.val_acc > 0.6, (r.arm, r.val_acc)
    assert r.final_train_loss < 0.6 * r.history['loss'][0]
    # Served (fl.nnx.convert) from int8/fp8 weights: the QAT model's numbers, exactly.
    assert r.served['val_loss'] == r.val_loss and r.served['val_acc'] == r.val_acc
    assert r.served['weight_bytes'] < 0.5 * r.served['float_weight_bytes']
  served_rows = [l.split() for l in paths['text'].splitlines()
                 if l.startswith(('fp8', 'int8')) and 'KiB' in l]
  assert [row[3] for row in served_rows] == ['equal', 'equal']
  assert fp8.health['scales'] > 0 and fp8.health['nonfinite_scales'] == 0
  assert fp8.health['amax_entries'] > fp8.health['zero_amax']  # histories written
  assert int8.health['int_values'] > 0 and int8.health['nonfinite_int_values'] == 0
  # The job traces the same layers as for the Linen CNN: the convolution's too.
  assert any(k.startswith('conv0/') for k in fp8.history['trace'])
  assert {k.rsplit('/', 1)[1] for k in int8.history['trace']} == {'input_step', 'kernel_step'}
  assert 'digits' in paths['text']
