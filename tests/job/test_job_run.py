"""End-to-end tests of the main job: tiny runs, exact resume, NaN losses.

The fp8 and int8 arms run the library's layers and train-state helper for
real; the other tests use the bf16 arm (plain flax) only.
"""

import dataclasses
import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import main as main_lib
from fp8_linen_job import models
from fp8_linen_job import report
from fp8_linen_job import tasks as tasks_lib
from fp8_linen_job import train as train_lib


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


def _train_all(cfg, out_dir, **kwargs):
  """Trains every task and arm of ``cfg`` (no report, to save time)."""
  arms = [arms_lib.build_arm(a, cfg) for a in cfg.arms]
  return [train_lib.train_arm(tasks_lib.build_task(t, cfg), arm, cfg, out_dir,
                              **kwargs) for t in cfg.tasks for arm in arms]


def _resume_matches_straight(cfg, tmp_path):
  straight, stopped = str(tmp_path / 'straight'), str(tmp_path / 'stopped')
  _train_all(cfg, straight)
  _train_all(cfg, stopped, stop_after=4)
  for task in cfg.tasks:
    for arm in cfg.arms:
      assert _final_checkpoint(stopped, task, arm)[0] == 4
  results = _train_all(cfg, stopped, resume=True)
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
  _train_all(cfg, out, stop_after=4)
  other = dataclasses.replace(
      cfg, digits=dataclasses.replace(cfg.digits, hidden=4))
  with pytest.raises(ValueError, match=r'digits\.hidden: 8 -> 4'):
    _train_all(other, out, resume=True)


def test_resume_without_checkpoint_starts_fresh(tiny_cfg, tmp_path):
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',))
  results = _train_all(cfg, str(tmp_path / 'new'), resume=True)
  assert results[0].steps_done == 8


def test_nan_loss_does_not_crash(tiny_cfg, tmp_path):
  task = tasks_lib.build_task('digits', tiny_cfg)
  clean = task.train_batch

  def poisoned(step):
    batch = dict(clean(step))
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


def test_fp8_arm_tiny_run(tmp_path):
  cfg = dataclasses.replace(config_lib.load_config('tiny'), tasks=('lm',),
                            arms=('bf16', 'fp8'))
  results, paths = main_lib.run_job(cfg, str(tmp_path))
  bf16, fp8 = results
  assert fp8.quantized and fp8.health is not None
  assert fp8.health['scales'] > 0 and fp8.health['nonfinite_scales'] == 0
  assert fp8.health['skipped_amax'] == 0
  assert fp8.history['trace'] and len(fp8.history['trace_step']) == 8
  assert np.isfinite(fp8.final_train_loss) and np.isfinite(fp8.val_loss)
  # Same init and data: the first-step losses of the arms are close.
  assert abs(fp8.history['loss'][0] - bf16.history['loss'][0]) < 0.1
  row = next(l for l in paths['text'].splitlines() if l.startswith('fp8'))
  assert row.split()[-3] == f'0/{fp8.health["scales"]}'
  assert os.path.getsize(os.path.join(str(tmp_path), report.SCALES_PNG)) > 1000


def test_resume_equals_straight_fp8(tiny_cfg, tmp_path):
  # The LM only: its programs are already compiled by test_fp8_arm_tiny_run.
  cfg = dataclasses.replace(tiny_cfg, tasks=('lm',), arms=('fp8',))
  _resume_matches_straight(cfg, tmp_path)


def test_int8_arm_tiny_run(tiny_cfg, tmp_path):
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',), arms=('int8',),
                            int8_recipe={'kernel': {'granularity': 'channel'}})
  (result,) = _train_all(cfg, str(tmp_path))
  assert result.quantized and np.isfinite(result.final_train_loss)
  assert result.health['scales'] > 0  # The observers' input ranges.
  assert result.health['nonfinite_scales'] == 0


def test_bad_recipe_names_config_key(tiny_cfg):
  cfg = dataclasses.replace(tiny_cfg, fp8_recipe={'input': {'bogus': 1}})
  with pytest.raises(ValueError, match='fp8_recipe'):
    arms_lib.build_arm('fp8', cfg)
