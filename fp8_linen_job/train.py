"""Training loop of the main job: jit step, evaluation, checkpoints, resume.

One call of :func:`train_arm` trains one task in one arm. Training is
deterministic given the config: the initial variables come from
``PRNGKey(seed)`` and batch ``i`` is a pure function of ``(seed, i)``, so
arms see the same data in the same order, and a run resumed from a checkpoint
continues bit for bit as if it had never stopped.

Checkpoints (orbax) hold the whole train state (every pytree field: ``step``,
the full variables dict including the ``_overwrite_with_gradient``
collection, ``opt_state``, and any field a train-state subclass adds) plus the
metric history so far, under
``<out>/checkpoints/<task>/<arm>/<step>``.

Ctrl-C (SIGINT) stops training after the step in flight, writes a checkpoint
and raises :class:`Interrupted`, which says where to resume; a second Ctrl-C
stops at once.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm

import fp8_linen as fl
from fp8_linen import monitor
from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import quant_state
from fp8_linen_job import tasks as tasks_lib

History = dict[str, Any]

TRAIN_LOSS_WINDOW = 10
"""The reported final train loss is the mean over this many last steps."""

_RESUMABLE_KEYS = ('steps', 'eval_every', 'eval_batches')


@dataclasses.dataclass(kw_only=True)
class ArmResult:
  """What training one task in one arm produced.

  Attributes:
    task: Task name.
    arm: Arm name.
    quantized: Whether the arm carries quantization state.
    steps_done: Optimizer steps taken in total (over all sessions).
    param_count: Number of trainable parameters.
    final_train_loss: Mean train loss over the last steps.
    val_loss: Loss on the held-out data after the last step.
    val_acc: Accuracy on the held-out data after the last step.
    median_step_s: Median wall time of one train step (compile excluded).
    compile_s: Seconds spent compiling the train step (last session).
    health: :func:`quant_state.health` of the final state (``None`` for
      unquantized arms).
    history: Curves: per-step ``loss``, ``acc``, ``grad_norm``,
      ``step_time``; ``eval`` records; ``trace`` of quantization scales.
    notes: Remarks of the arm (e.g. which layers are quantized).
    details: More facts about the arm (e.g. the recipe).
    total_steps: Steps the schedule runs to (``steps_done`` is less when the
      run was stopped early with ``stop_after``).
    checkpoint_step: Step of the latest checkpoint (``None``: none).
    served: What the served model (:func:`fp8_linen.convert` of the final
      state) gives on the held-out data: ``val_loss``, ``val_acc``,
      ``weight_bytes`` (its params) and ``float_weight_bytes`` (the QAT
      model's float params). ``None`` for unquantized arms and for runs
      stopped before the last step.
  """

  task: str
  arm: str
  quantized: bool
  steps_done: int
  param_count: int
  final_train_loss: float
  val_loss: float
  val_acc: float
  median_step_s: float
  compile_s: float
  health: dict[str, int] | None
  history: History
  notes: tuple[str, ...] = ()
  details: dict[str, str] = dataclasses.field(default_factory=dict)
  total_steps: int = 0
  checkpoint_step: int | None = None
  served: dict[str, Any] | None = None


class ResumeError(ValueError):
  """A checkpoint cannot be resumed with the current settings."""


class Interrupted(KeyboardInterrupt):
  """Training of one task and arm was interrupted (Ctrl-C).

  A subclass of ``KeyboardInterrupt``, so code that does not catch it stops
  as on any Ctrl-C.

  Attributes:
    task: Task name.
    arm: Arm name.
    step: Steps done when training stopped (``None``: interrupted before
      the state was built).
    checkpoint: Step of the latest checkpoint (``None``: there is none).
    directory: The checkpoint directory of this task and arm.
  """

  def __init__(self, *, task: str, arm: str, step: int | None,
               checkpoint: int | None, directory: str):
    super().__init__(f'{task}/{arm}: interrupted at step {step}, last '
                     f'checkpoint at {checkpoint}')
    self.task, self.arm, self.step = task, arm, step
    self.checkpoint, self.directory = checkpoint, directory


class _StopRequest:
  """While active, turns the first Ctrl-C into a request to stop.

  A ``KeyboardInterrupt`` raised wherever Python happens to be (usually deep
  inside jax, waiting for the device) leaves the train state and the history
  out of step and prints a long traceback. With the flag, the loop finishes
  the step in flight, checkpoints and stops. A second Ctrl-C raises
  ``KeyboardInterrupt`` at once. Only Python's default handler is replaced
  (and only in the main thread, the only one that receives signals).
  """

  def __init__(self):
    self.requested = False
    self._installed = False

  def _handle(self, signum, frame):
    del signum, frame
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True

  def __enter__(self) -> '_StopRequest':
    if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
      signal.signal(signal.SIGINT, self._handle)
      self._installed = True
    return self

  def __exit__(self, *exc_info) -> None:
    if self._installed:
      signal.signal(signal.SIGINT, signal.default_int_handler)
      self._installed = False


def new_history(fingerprint: dict[str, Any]) -> History:
  """An empty metric history for a run with settings ``fingerprint``."""
  return {'fingerprint': fingerprint, 'step': [], 'loss': [], 'acc': [],
          'grad_norm': [], 'step_time': [], 'eval': [], 'trace_step': [],
          'trace': {}, 'sessions': []}


def fingerprint(cfg: config_lib.JobConfig, task: tasks_lib.Task,
                arm: arms_lib.Arm) -> dict[str, Any]:
  """Settings that must match for a checkpoint to be resumed."""
  # The recipe itself, not how the config named it: a shipped name and the
  # same recipe written out are the same run.
  recipe = fl.recipe_to_dict(arm.recipe) if arm.recipe is not None else {}
  out = {'task': task.name, 'arm': arm.name, 'seed': cfg.seed,
         'settings': config_lib.to_dict(task.settings), 'recipe': recipe}
  if arm.api != 'linen':  # (absent for linen: older checkpoints still resume)
    out['api'] = arm.api
  return out


def check_resumable(saved: dict[str, Any], current: dict[str, Any],
                    where: str) -> None:
  """Raises if a checkpoint was written with different settings.

  Changing ``steps`` (or evaluation settings) is allowed, with a warning for
  ``steps`` because the learning-rate schedule depends on it.

  Raises:
    ResumeError: Naming the settings that differ.
  """
  saved = dict(saved, settings=dict(saved.get('settings', {})))
  current = dict(current, settings=dict(current['settings']))
  for key in _RESUMABLE_KEYS:
    old = saved['settings'].pop(key, None)
    new = current['settings'].pop(key, None)
    if key == 'steps' and old is not None and old != new:
      print(f'warning: {where}: steps changed from {old} to {new}; the '
            'learning-rate schedule changes with it', file=sys.stderr)
  diffs = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key), current.get(key)
    label = current['task'] if key == 'settings' else key  # e.g. lm.d_model
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += [f'{label}.{k}: {a.get(k)!r} -> {b.get(k)!r}'
                for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    elif a != b:
      diffs.append(f'{key}: {a!r} -> {b!r}')
  if diffs:
    raise ResumeError(f'cannot resume {where}: the checkpoint was written '
                     f'with other settings ({"; ".join(diffs)}); use another '
                     '--out or run without --resume')


def make_train_step(modules: list[tuple[str, ...]]):
  """Builds the (unjitted) train step.

  Args:
    modules: Quantized module paths whose scales are traced.

  Returns:
    ``step(state, batch) -> (state, metrics)``. ``state.params`` is the full
    variables dict; the gradient is taken over all of it, so quantization
    state updates arrive as its "gradient" and ``apply_gradients``
    overwrites them.
  """
  def train_step(state, batch):
    def loss_fn(variables):
      logits = state.apply_fn(variables, batch['x'])
      return tasks_lib.loss_and_accuracy(logits, batch['y'])

    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params)
    new_state = state.apply_gradients(grads=grads)
    metrics = {'loss': loss, 'acc': acc,
               'grad_norm': optax.tree.norm(grads['params']),
               'trace': quant_state.trace_values(new_state.params, modules)}
    return new_state, metrics
  return train_step


def make_eval_step(apply_fn):
  """``eval(variables, batch) -> (loss, acc)`` for one batch (unjitted).

  The quantizers are frozen (:func:`fp8_linen.frozen_quantizers`): observers
  quantize with the ranges recorded in training instead of folding each
  held-out batch in, so the QAT model is evaluated as it will be served.
  The flag is read while ``eval_step`` is traced, so it holds under ``jit``.
  """
  def eval_step(variables, batch):
    with fl.frozen_quantizers():
      logits = apply_fn(variables, batch['x'])
    return tasks_lib.loss_and_accuracy(logits, batch['y'])
  return eval_step


def evaluate(eval_fn, variables, batches) -> tuple[float, float]:
  """Example-weighted mean loss and accuracy over ``batches``."""
  total_loss = total_acc = count = 0.0
  for batch in batches:
    loss, acc = jax.device_get(eval_fn(variables, batch))
    n = len(batch['y'])
    total_loss += float(loss) * n
    total_acc += float(acc) * n
    count += n
  return total_loss / count, total_acc / count


def _checkpoint_tree(state) -> dict[str, Any]:
  """Every pytree field of a train state (step, params, opt_state, ...).

  Static fields (``apply_fn``, ``tx``) are left out; they are rebuilt from
  the config. Fields a train-state subclass adds (e.g. accumulators) are
  included.
  """
  return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
          if f.metadata.get('pytree_node', True)}


def _manager(directory: str, cfg: config_lib.JobConfig) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=cfg.checkpoints_to_keep, create=True,
      enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_checkpoint(manager: ocp.CheckpointManager, state,
                    history: History) -> None:
  """Saves the train state and the history at ``state.step``."""
  step = int(state.step)
  if manager.latest_step() == step:
    return
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(_checkpoint_tree(state)),
      history=ocp.args.JsonSave(history)))
  manager.wait_until_finished()


def restore_checkpoint(manager: ocp.CheckpointManager, state,
                       expected: dict[str, Any] | None = None):
  """Restores the latest checkpoint into the structure of ``state``.

  Args:
    manager: The checkpoint manager of one task and arm.
    state: A freshly initialized train state (gives structure and dtypes).
    expected: If given, the :func:`fingerprint` the checkpoint must match;
      checked before any array is read.

  Returns:
    ``(state, history)``, or ``(state, None)`` if there is no checkpoint.

  Raises:
    ResumeError: If the checkpoint's fingerprint differs from ``expected``.
  """
  step = manager.latest_step()
  if step is None:
    return state, None
  history = manager.restore(step, args=ocp.args.Composite(
      history=ocp.args.JsonRestore()))['history']
  if expected is not None:
    check_resumable(history['fingerprint'], expected,
                    os.path.join(str(manager.directory), str(step)))
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          _checkpoint_tree(state))
  tree = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract)))['state']
  return state.replace(**tree), history


def init_state(task: tasks_lib.Task, arm: arms_lib.Arm, seed: int):
  """Builds the model and its train state from ``PRNGKey(seed)``."""
  model = task.build_model(arm)
  tx = task.make_optimizer()

  def create(key, example):
    variables = dict(model.init(key, example))
    return arm.train_state_cls.create(apply_fn=model.apply, params=variables,
                                      tx=tx)
  # One compiled program instead of many small eager ones (optimizer init).
  state = jax.jit(create)(jax.random.PRNGKey(seed), task.example_input())
  # Make the fresh state look exactly like a restored one (strongly typed
  # step, arrays committed to the device), so the train and eval steps
  # lower to the same programs fresh or resumed (one compile, cache hits).
  state = state.replace(step=jnp.asarray(state.step, jnp.int32))
  return jax.device_put(state, jax.devices()[0])


def trained_variables(task: tasks_lib.Task, arm: arms_lib.Arm, cfg: config_lib.JobConfig,
                      out_dir: str):
  """The variables of ``arm``'s finished run of ``task``, from its last checkpoint in ``out_dir``.

  Raises:
    ResumeError: If there is no checkpoint of a finished run with these settings.
  """
  ckpt_dir = os.path.join(out_dir, 'checkpoints', task.name, arm.name)
  manager = _manager(ckpt_dir, cfg)
  try:
    state, history = restore_checkpoint(manager, init_state(task, arm, cfg.seed),
                                        fingerprint(cfg, task, arm))
  finally:
    manager.close()
  if history is None or int(state.step) != task.steps:
    raise ResumeError(f'{task.name}/{arm.name}: no checkpoint of a finished run in {ckpt_dir}')
  return state.params


def _param_count(state) -> int:
  return sum(int(np.prod(x.shape))
             for x in jax.tree.leaves(state.params['params']))


def _record_step(history: History, step: int, metrics: dict[str, Any],
                 step_time: float, trace_every: int) -> None:
  history['step'].append(step)
  history['loss'].append(float(metrics['loss']))
  history['acc'].append(float(metrics['acc']))
  history['grad_norm'].append(float(metrics['grad_norm']))
  history['step_time'].append(step_time)
  if metrics['trace'] and step % trace_every == 0:
    history['trace_step'].append(step)
    for key, value in metrics['trace'].items():
      history['trace'].setdefault(key, []).append(float(value))


def _record_eval(history: History, step: int, loss: float, acc: float) -> None:
  if history['eval'] and history['eval'][-1]['step'] == step:
    return
  history['eval'].append({'step': step, 'loss': loss, 'acc': acc})


BAR_FORMAT = ('{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} '
              '[{elapsed}<{remaining}{postfix}]')
"""Progress bar layout: tqdm's own rate is left out; the postfix shows ours
(:func:`bar_postfix`), the same measure as the table's ms/step."""


def bar_postfix(loss: float, step_times: list[float]) -> str:
  """``'loss 2.345, 12.3 step/s'``: the latest loss and the train-step rate.

  The rate is ``1 / median`` of the last 20 step times: compilation,
  evaluation and checkpoints excluded, as in the results table.
  """
  rate = 1.0 / float(np.median(step_times[-20:])) if step_times else 0.0
  return f'loss {loss:.3f}, {rate:.1f} step/s'


def _progress(task: tasks_lib.Task, arm: arms_lib.Arm, start: int,
              enabled: bool) -> tqdm.tqdm:
  return tqdm.tqdm(total=task.steps, initial=start, unit='step',
                   desc=f'{task.name}/{arm.name}', disable=not enabled,
                   dynamic_ncols=True, file=sys.stderr, leave=True,
                   bar_format=BAR_FORMAT)


def train_arm(task: tasks_lib.Task, arm: arms_lib.Arm,
              cfg: config_lib.JobConfig, out_dir: str, *,
              resume: bool = False, stop_after: int | None = None) -> ArmResult:
  """Trains ``task`` in ``arm``, checkpointing under ``out_dir``.

  Args:
    task: The task.
    arm: The arm.
    cfg: The job config.
    out_dir: The job's output directory.
    resume: Continue from the latest checkpoint of this task and arm if
      there is one. Otherwise any old checkpoints of it are deleted.
    stop_after: Stop (with a checkpoint) once this step is reached, without
      changing the schedule; simulates an interrupted run. Evaluations
      happen on the usual schedule only, so a stopped-and-resumed run records
      the same history as a straight one.

  Returns:
    The :class:`ArmResult`.

  Raises:
    ResumeError: If resuming a checkpoint written with other settings.
    Interrupted: On Ctrl-C; the state is checkpointed first when the
      interrupt came during the training loop.
  """
  ckpt_dir = os.path.join(out_dir, 'checkpoints', task.name, arm.name)
  if not resume and os.path.isdir(ckpt_dir):
    shutil.rmtree(ckpt_dir)
  manager = _manager(ckpt_dir, cfg)
  where = {'step': None}  # Steps done so far, for an interrupt's message.
  try:
    state, history, compile_s = _train(task, arm, cfg, manager, ckpt_dir,
                                       resume, stop_after, where)
    checkpoint = manager.latest_step()
  except KeyboardInterrupt as e:
    if isinstance(e, Interrupted):
      raise
    # A Ctrl-C outside the loop (data, compilation, a second Ctrl-C).
    raise Interrupted(task=task.name, arm=arm.name, step=where['step'],
                      checkpoint=manager.latest_step(),
                      directory=ckpt_dir) from None
  finally:
    manager.close()
  result = summarize(task, arm, state, history, compile_s, checkpoint)
  if result.steps_done == task.steps:
    result.served = serve_and_evaluate(task, arm, state)
  return result


def serve_and_evaluate(task: tasks_lib.Task, arm: arms_lib.Arm,
                       state) -> dict[str, Any] | None:
  """Converts the trained model and evaluates it.

  Linen models go through :func:`fp8_linen.convert`, NNX models through
  :func:`fp8_linen.nnx.convert`. The served model computes in low precision
  from int8/int4/fp8 weights with frozen input scales; on the held-out
  batches it gives the QAT model's loss and accuracy (evaluated with frozen
  quantizers, :func:`make_eval_step`).

  Returns:
    ``{'val_loss', 'val_acc', 'weight_bytes', 'float_weight_bytes'}``, or
    ``None`` for an unquantized arm.
  """
  if not arm.quantized:
    return None
  model = task.build_model(arm)
  if arm.api == 'nnx':
    apply, params = model.convert(state.params, task.example_input())
    served_bytes = fl.weight_bytes(params)  # the served NNX model's variables
  else:
    served, params = fl.convert(model, state.params, task.example_input())
    apply, served_bytes = served.apply, fl.weight_bytes(params['params'])
  loss, acc = evaluate(jax.jit(make_eval_step(apply)), params, task.eval_batches)
  return {'val_loss': loss, 'val_acc': acc, 'weight_bytes': served_bytes,
          'float_weight_bytes': fl.weight_bytes(state.params['params'])}


def _train(task: tasks_lib.Task, arm: arms_lib.Arm, cfg: config_lib.JobConfig,
           manager: ocp.CheckpointManager, ckpt_dir: str, resume: bool,
           stop_after: int | None, where: dict[str, Any]):
  """The body of :func:`train_arm`: returns ``(state, history, compile_s)``."""
  state = init_state(task, arm, cfg.seed)
  print_ = tqdm.tqdm.write
  history = None
  if resume:
    state, history = restore_checkpoint(manager, state,
                                        fingerprint(cfg, task, arm))
    if history is None:
      print_(f'{task.name}/{arm.name}: no checkpoint in {ckpt_dir}; '
             'starting from scratch')
    else:
      print_(f'{task.name}/{arm.name}: resuming from step {int(state.step)}')
  if history is None:
    history = new_history(fingerprint(cfg, task, arm))

  modules = monitor.pick_evenly(quant_state.quantized_modules(state.params),
                                cfg.trace_layers)
  last = task.steps if stop_after is None else min(task.steps, stop_after)
  start = int(state.step)
  where['step'] = start
  eval_fn = jax.jit(make_eval_step(state.apply_fn))

  compile_s = 0.0
  if start < last:
    t0 = time.perf_counter()
    step_fn = jax.jit(make_train_step(modules)).lower(
        state, task.train_batch(start)).compile()
    compile_s = time.perf_counter() - t0
  history['sessions'].append({'start_step': start, 'compile_s': compile_s,
                              'device': str(jax.devices()[0])})

  bar = _progress(task, arm, start, cfg.progress)
  try:
    with _StopRequest() as stop:
      for step in range(start, last):
        batch = jax.device_put(task.train_batch(step))
        t0 = time.perf_counter()
        new_state, metrics = step_fn(state, batch)
        metrics = jax.device_get(metrics)
        step_time = time.perf_counter() - t0
        _record_step(history, step + 1, metrics, step_time, cfg.trace_every)
        # Only now: the state never runs ahead of the recorded history.
        state = new_state
        done = where['step'] = step + 1
        bar.set_postfix_str(bar_postfix(history['loss'][-1],
                                        history['step_time']), refresh=False)
        bar.update(1)
        if done == task.steps or (task.eval_every and
                                  done % task.eval_every == 0):
          _record_eval(history, done, *evaluate(eval_fn, state.params,
                                                 task.eval_batches))
        if (done % cfg.checkpoint_every == 0 or done == last
            or stop.requested):
          save_checkpoint(manager, state, history)
        if stop.requested and done < last:
          raise Interrupted(task=task.name, arm=arm.name, step=done,
                            checkpoint=manager.latest_step(),
                            directory=ckpt_dir)
  finally:
    bar.close()
  return state, history, compile_s


def summarize(task: tasks_lib.Task, arm: arms_lib.Arm, state,
              history: History, compile_s: float,
              checkpoint_step: int | None = None) -> ArmResult:
  """Condenses a finished (or stopped) run into an :class:`ArmResult`."""
  steps_done = int(state.step)
  losses = history['loss'][-TRAIN_LOSS_WINDOW:]
  times = history['step_time']
  final_eval = history['eval'][-1] if history['eval'] else {}
  return ArmResult(
      task=task.name, arm=arm.name, quantized=arm.quantized,
      steps_done=steps_done, param_count=_param_count(state),
      final_train_loss=float(np.mean(losses)) if losses else float('nan'),
      val_loss=final_eval.get('loss', float('nan')),
      val_acc=final_eval.get('acc', float('nan')),
      median_step_s=float(np.median(times)) if times else float('nan'),
      compile_s=compile_s,
      health=(quant_state.health(state.params, steps_done)
              if arm.quantized else None),
      history=history, notes=arm.notes, details=dict(arm.details),
      total_steps=task.steps, checkpoint_step=checkpoint_step)
