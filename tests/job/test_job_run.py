"""End-to-end tests of the main job: tiny runs, exact resume, NaN losses.

Tests marked ``needs_core`` use the fp8 arm and need the library core
(``fp8_linen.QDense``, ``Fp8Recipe``, ``TrainState``); all others use the
bf16 arm (plain flax) only.
"""

import dataclasses
import functools
import importlib
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp8_linen.job import arms as arms_lib
from fp8_linen.job import main as main_lib
from fp8_linen.job import models
from fp8_linen.job import report
from fp8_linen.job import tasks as tasks_lib
from fp8_linen.job import train as train_lib


def _has_core() -> bool:
  try:
    fl = importlib.import_module('fp8_linen')
  except ImportError:
    return False
  return all(hasattr(fl, n) for n in ('QDense', 'Fp8Recipe', 'TrainState'))


needs_core = pytest.mark.skipif(
    not _has_core(), reason='fp8 arm needs fp8_linen.QDense/Fp8Recipe/'
    'TrainState (library core)')


def _final_checkpoint(out_dir, task, arm):
  """The newest checkpoint of ``task``/``arm`` as plain nested arrays."""
  directory = os.path.abspath(os.path.join(out_dir, 'checkpoints', task, arm))
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), history=ocp.args.JsonRestore()))
  return step, restored['state'], restored['history']


def _assert_trees_identical(a, b):
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_models_use_injected_classes():
  no_bias = functools.partial(nn.Dense, use_bias=False)
  lm = models.TransformerLM(max_len=8, d_model=16, num_heads=2, num_layers=1,
                            dense_cls=no_bias)
  params = jax.eval_shape(lm.init, jax.random.PRNGKey(0),
                          jnp.zeros((2, 8), jnp.int32))['params']
  assert set(params['block0']['attn']['qkv']) == {'kernel'}
  assert set(params['head']) == {'kernel', 'bias'}
  logits = jax.eval_shape(lm.apply, {'params': params},
                          jnp.zeros((2, 8), jnp.int32))
  assert logits.shape == (2, 8, 256) and logits.dtype == jnp.float32
  cnn = models.DigitsCNN(conv_features=(4, 8), hidden=8,
                         conv_cls=functools.partial(nn.Conv, use_bias=False))
  params = jax.eval_shape(cnn.init, jax.random.PRNGKey(0),
                          jnp.zeros((2, 8, 8, 1)))['params']
  assert set(params['conv1']) == {'kernel'} and 'bias' in params['fc']


def test_tiny_run_end_to_end(tmp_path, capsys):
  out = str(tmp_path / 'run')
  rc = main_lib.main(['--config', 'tiny', '--arms', 'bf16', '--out', out])
  assert rc == 0
  stdout = capsys.readouterr().out
  assert 'task lm' in stdout and 'task digits' in stdout
  for name in (report.TABLE_TXT, report.LOSS_PNG, report.SCALES_PNG,
               report.SUMMARY_JSON):
    assert os.path.getsize(os.path.join(out, name)) > 100, name
  with open(os.path.join(out, report.SUMMARY_JSON), encoding='utf-8') as f:
    summary = json.load(f)
  assert [(r['task'], r['arm']) for r in summary['results']] == [
      ('lm', 'bf16'), ('digits', 'bf16')]
  for r in summary['results']:
    assert r['steps_done'] == 8 and len(r['history']['loss']) == 8
    assert np.isfinite(r['final_train_loss']) and r['health'] is None
    assert r['history']['eval'][-1]['step'] == 8
  step, state, _ = _final_checkpoint(out, 'digits', 'bf16')
  assert step == 8 and int(state['step']) == 8


def _resume_matches_straight(cfg, tmp_path):
  straight, stopped = str(tmp_path / 'straight'), str(tmp_path / 'stopped')
  main_lib.run_job(cfg, straight)
  _, partial_results = main_lib.run_job(cfg, stopped, stop_after=4)[0], None
  for task in cfg.tasks:
    for arm in cfg.arms:
      assert _final_checkpoint(stopped, task, arm)[0] == 4
  results, _ = main_lib.run_job(cfg, stopped, resume=True)
  assert all(r.steps_done == 8 for r in results)
  for task in cfg.tasks:
    for arm in cfg.arms:
      step_a, state_a, hist_a = _final_checkpoint(straight, task, arm)
      step_b, state_b, hist_b = _final_checkpoint(stopped, task, arm)
      assert step_a == step_b == 8
      # Whole train state, bit for bit: params, OWG state, opt_state, step.
      _assert_trees_identical(state_a, state_b)
      assert hist_a['loss'] == hist_b['loss']
      assert hist_a['trace'] == hist_b['trace']
      assert hist_a['eval'] == hist_b['eval']
      assert [s['start_step'] for s in hist_b['sessions']] == [0, 4]


def test_resume_equals_straight_bf16(tiny_cfg, tmp_path):
  _resume_matches_straight(tiny_cfg, tmp_path)


def test_resume_with_other_settings_fails(tiny_cfg, tmp_path):
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',))
  out = str(tmp_path / 'run')
  main_lib.run_job(cfg, out, stop_after=4)
  other = dataclasses.replace(
      cfg, digits=dataclasses.replace(cfg.digits, hidden=4))
  with pytest.raises(ValueError, match=r'digits\.hidden: 8 -> 4'):
    main_lib.run_job(other, out, resume=True)


def test_resume_without_checkpoint_starts_fresh(tiny_cfg, tmp_path):
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',))
  results, _ = main_lib.run_job(cfg, str(tmp_path / 'new'), resume=True)
  assert results[0].steps_done == 8


def test_nan_loss_does_not_crash(tiny_cfg, tmp_path):
  task = tasks_lib.build_task('digits', tiny_cfg)

  def poisoned(step):
    batch = dict(task.train_batch(step))
    if step >= 3:
      batch['x'] = np.full_like(batch['x'], np.nan)
    return batch

  task = dataclasses.replace(task, train_batch=poisoned)
  arm = arms_lib.build_arm('bf16', tiny_cfg)
  result = train_lib.train_arm(task, arm, tiny_cfg, str(tmp_path))
  assert np.isnan(result.history['loss'][-1])
  assert np.isnan(result.final_train_loss) and np.isnan(result.val_loss)
  paths = report.write_report([result], str(tmp_path), config={})
  assert 'nan' in paths['text']
  with open(paths['json'], encoding='utf-8') as f:
    assert json.load(f)['results'][0]['val_loss'] is None


@needs_core
def test_fp8_arm_tiny_run(tmp_path):
  cfg = dataclasses.replace(main_lib.config_from_args(
      main_lib.parse_args(['--config', 'tiny'])), arms=('bf16', 'fp8'))
  results, paths = main_lib.run_job(cfg, str(tmp_path))
  by_key = {(r.task, r.arm): r for r in results}
  fp8 = by_key[('lm', 'fp8')]
  assert fp8.quantized and fp8.health is not None
  assert fp8.health['scales'] > 0 and fp8.health['nonfinite_scales'] == 0
  assert fp8.health['skipped_amax'] == 0
  assert fp8.history['trace'] and len(fp8.history['trace_step']) == 8
  assert np.isfinite(fp8.final_train_loss)
  # Same init and data: the first-step losses of the arms are close.
  bf16 = by_key[('lm', 'bf16')]
  assert abs(fp8.history['loss'][0] - bf16.history['loss'][0]) < 0.1
  assert 'vs bf16' in paths['text']


@needs_core
def test_resume_equals_straight_fp8(tiny_cfg, tmp_path):
  cfg = dataclasses.replace(tiny_cfg, arms=('fp8',))
  _resume_matches_straight(cfg, tmp_path)
