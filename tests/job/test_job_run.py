"""End-to-end tests of the main job: tiny runs, exact resume, NaN losses.

The fp8 and int8 arms run the library's layers and train-state helper for
real; the other tests use the bf16 arm (plain flax) only.
"""

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time

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
  # The second fp8 row is the quantization-state table: nothing wrong.
  row = [l for l in paths['text'].splitlines() if l.startswith('fp8')][1]
  assert row.split()[2:] == ['0', '0']
  assert os.path.getsize(os.path.join(str(tmp_path), report.SCALES_PNG)) > 1000
  # The converted model, run from fp8 weights, gives the QAT model's numbers.
  assert bf16.served is None
  assert fp8.served['val_loss'] == fp8.val_loss
  assert fp8.served['val_acc'] == fp8.val_acc
  assert fp8.served['weight_bytes'] < fp8.served['float_weight_bytes']
  served_row = [l for l in paths['text'].splitlines() if l.startswith('fp8')][2]
  assert served_row.split()[3] == 'equal'


def test_resume_equals_straight_fp8(tiny_cfg, tmp_path):
  # The LM only: its programs are already compiled by test_fp8_arm_tiny_run.
  cfg = dataclasses.replace(tiny_cfg, tasks=('lm',), arms=('fp8',))
  _resume_matches_straight(cfg, tmp_path)


def test_int8_arm_tiny_run_traces_lsq_steps(tiny_cfg, tmp_path):
  # The default int8 recipe: LSQ, whose learned step sizes are params.
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',), arms=('int8',))
  (result,) = _train_all(cfg, str(tmp_path))
  assert result.quantized and np.isfinite(result.final_train_loss)
  assert result.health['int_values'] > 0
  assert result.health['nonfinite_int_values'] == 0
  trace = result.history['trace']
  assert {k.rsplit('/', 1)[1] for k in trace} == {'input_step', 'kernel_step'}
  assert all(len(v) == 8 and min(v) > 0 for v in trace.values())
  # The steps are trained: they move.
  assert any(v[0] != v[-1] for v in trace.values())
  # Served from int8 weights: the QAT model's loss and accuracy, exactly.
  assert result.served['val_loss'] == result.val_loss
  assert result.served['val_acc'] == result.val_acc
  # The tiny CNN's biases and per-channel scales weigh as much as its kernels.
  assert result.served['weight_bytes'] < 0.5 * result.served['float_weight_bytes']


def test_int8_arm_with_observers_traces_ranges(tiny_cfg, tmp_path):
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',), arms=('int8',),
                            int8_recipe={'kernel': {'granularity': 'channel'}})
  (result,) = _train_all(cfg, str(tmp_path))
  assert result.quantized and np.isfinite(result.final_train_loss)
  assert result.health['scales'] > 0  # The observers' input ranges.
  # Evaluated with frozen observers, the QAT model is the served one, exactly.
  assert result.served['val_loss'] == result.val_loss
  assert result.served['val_acc'] == result.val_acc
  assert result.health['nonfinite_scales'] == 0
  assert {k.rsplit('/', 1)[1] for k in result.history['trace']} == {
      'input_range'}


def test_bad_recipe_names_config_key(tiny_cfg):
  with pytest.raises(config_lib.ConfigError, match='fp8_recipe'):
    dataclasses.replace(tiny_cfg, fp8_recipe={'input': {'bogus': 1}})


@pytest.fixture
def default_sigint():
  """Python's default SIGINT handler for the test, the one before restored after.

  The job replaces only the default handler (one a user or library installed
  is kept), so a test of its Ctrl-C handling starts from the default.
  """
  # A test run a shell started in the background has SIGINT ignored (Python
  # keeps that), and the job rightly leaves an ignored SIGINT alone.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, previous)


def _signal_at(monkeypatch, step):
  """Sends this process SIGINT while the batch of ``step`` is built."""
  real_build = tasks_lib.build_task

  def build(name, cfg):
    task = real_build(name, cfg)
    clean = task.train_batch

    def train_batch(i):
      if i == step:
        signal.raise_signal(signal.SIGINT)
      return clean(i)

    return dataclasses.replace(task, train_batch=train_batch)

  monkeypatch.setattr(tasks_lib, 'build_task', build)


def test_ctrl_c_checkpoints_and_says_how_to_resume(tmp_path, monkeypatch,
                                                   capsys, default_sigint):
  del default_sigint
  out = str(tmp_path / 'run')
  args = ['--config', 'tiny', '--tasks', 'digits', '--arms', 'bf16', '--out',
          out]
  _signal_at(monkeypatch, 5)  # During step 6: it completes, then stops.
  assert main_lib.main(args) == main_lib.EXIT_INTERRUPTED == 130
  err = capsys.readouterr().err
  assert ('digits/bf16: interrupted at step 6, last checkpoint at 6; rerun '
          f'with --resume:\n  python -m fp8_linen {" ".join(args)} --resume'
          in err)
  assert 'Traceback' not in err
  step, state, history = _final_checkpoint(out, 'digits', 'bf16')
  assert step == int(state['step']) == 6 and len(history['loss']) == 6
  # The handler is gone again: a later Ctrl-C is an ordinary one.
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  monkeypatch.undo()
  assert main_lib.main(args + ['--resume']) == 0
  assert _final_checkpoint(out, 'digits', 'bf16')[0] == 8


def test_ctrl_c_before_the_loop_names_the_last_checkpoint(tiny_cfg, tmp_path,
                                                          monkeypatch):
  cfg = dataclasses.replace(tiny_cfg, tasks=('digits',))
  out = str(tmp_path / 'run')
  _train_all(cfg, out, stop_after=4)

  def interrupted_compile(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(train_lib, 'make_train_step', interrupted_compile)
  with pytest.raises(train_lib.Interrupted) as e:
    _train_all(cfg, out, resume=True)
  assert (e.value.task, e.value.arm) == ('digits', 'bf16')
  assert e.value.step == 4 and e.value.checkpoint == 4
  assert main_lib.stop_message('interrupted', 4, 4) == (
      'interrupted at step 4, last checkpoint at 4; rerun with --resume')
  assert main_lib.stop_message('interrupted', None, None) == (
      'interrupted before training started, no checkpoint yet; rerun with '
      '--resume')


def test_stop_after_says_how_to_resume(tmp_path, capsys):
  out = str(tmp_path / 'run')
  args = ['--config', 'tiny', '--tasks', 'digits', '--arms', 'bf16', '--out',
          out, '--stop-after', '4']
  assert main_lib.main(args) == 0
  stdout = capsys.readouterr().out
  assert ('digits/bf16: stopped (--stop-after 4) at step 4, last checkpoint '
          'at 4; rerun with --resume:\n  python -m fp8_linen --config tiny '
          f'--tasks digits --arms bf16 --out {out} --resume') in stdout


def test_compilation_cache_is_left_to_the_environment_or_off():
  assert main_lib.use_compilation_cache('') is None
  # The test run names its own cache (tests/conftest.py): the job leaves it alone.
  assert os.environ.get('JAX_COMPILATION_CACHE_DIR')
  assert main_lib.use_compilation_cache('~/elsewhere') is None


def test_compilation_cache_that_cannot_be_made_is_skipped(tmp_path, monkeypatch):
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR')
  (tmp_path / 'file').write_text('')  # a directory cannot be made below a file
  assert main_lib.use_compilation_cache(str(tmp_path / 'file' / 'cache')) is None


def test_sigint_in_a_real_run(tmp_path):
  """The whole command: Ctrl-C arrives while jax computes, no traceback.

  Run without a cache in the environment, it keeps its compiled programs in
  the config's ``compilation_cache``.
  """
  out = tmp_path / 'run'
  cache = tmp_path / 'cache'
  config = tmp_path / 'tiny.yaml'
  with open(os.path.join(config_lib.CONFIG_DIR, 'tiny.yaml'), encoding='utf-8') as f:
    config.write_text(f.read() + f'\ncompilation_cache: {cache}\n')
  # `python -m fp8_linen ...`, except that a shell starts background jobs
  # (such as this test run, maybe) with SIGINT ignored, which Python keeps:
  # restore Python's own handler first.
  cmd = [sys.executable, '-c',
         'import runpy, signal; '
         'signal.signal(signal.SIGINT, signal.default_int_handler); '
         'runpy.run_module("fp8_linen", run_name="__main__", alter_sys=True)',
         '--config', str(config), '--tasks', 'digits', '--arms', 'bf16', '--steps',
         '100000', '--out', str(out)]
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  # Every program cached, however quickly it compiles (JAX's default keeps those
  # over a second): the test is that the job points the cache at its directory.
  env.update(JAX_PLATFORMS='cpu', JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)
  ckpt = out / 'checkpoints' / 'digits' / 'bf16'
  deadline = time.monotonic() + 120
  try:
    # Training runs once the first checkpoint (step 4) is there.
    while not (ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())):
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, 'training did not start'
      time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, stderr
  m = re.search(r'digits/bf16: interrupted at step (\d+), last checkpoint at '
                r'(\d+); rerun with --resume', stderr)
  assert m and m.group(1) == m.group(2), stderr
  assert 'Traceback' not in stderr
  assert any(cache.iterdir()), 'nothing in the compilation cache'
