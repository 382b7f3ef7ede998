"""From a trained float model: post-training quantization, QAT from PTQ, QLoRA.

The stage the job runs with ``--from-float`` (``from_float.enabled``), after
the ``bf16`` arm of a task has trained. From its trained variables:

* ``ptq int8``: :func:`fp8_linen.ptq` with the ``int8`` arm's recipe
  (activation ranges and weight steps calibrated on a few training batches);
* ``ptq int4``: :func:`fp8_linen.ptq`, int4 weights per channel, float
  activations (``fp8_linen.weight_only(4)``), rounded to nearest;
  ``ptq int4, gptq``: the same rounded by GPTQ;
* ``qat from ptq int4``: a short QAT run (``qat_fraction`` of the task's
  steps) starting from the int4 PTQ's calibrated variables, then
  :func:`fp8_linen.convert`;
* ``qlora int4``: adapters of rank ``lora_rank`` trained for as many steps on
  the served int4 model (its weights stay int4 codes);
  ``qlora int4, merged`` merges them (:func:`fp8_linen.merge_lora`) and
  quantizes again with the same recipe, rounded by GPTQ;
* ``bf16, more steps``: the float model trained for as many steps with the
  same schedule: what extra steps alone give.

Every quantized row is the *served* model's loss on the task's held-out
batches. The products quantized are the model's weight products (not the
attention math; the head only with ``quantize_head``), by
:func:`fp8_linen.quantize_model` rules.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
import optax

import fp8_linen as fl
from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import tasks as tasks_lib
from fp8_linen_job import train as train_lib

PLOT_PNG = 'from_float.png'


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
  """One stage's result.

  Attributes:
    stage: What was done (``'ptq int4'``, ...).
    steps: Optimizer steps of the stage itself (0 for PTQ).
    val_loss: Held-out loss (the served model's for quantized stages).
    val_acc: Held-out accuracy.
    weight_bytes: Bytes of the weights it serves from (``fl.weight_bytes``).
    seconds: Wall time of the stage (calibration, training, conversion).
  """

  stage: str
  steps: int
  val_loss: float
  val_acc: float
  weight_bytes: int
  seconds: float


def rules(quantize_head: bool) -> list:
  """The weight products, the head only if asked; attention's products stay float."""
  out = [] if quantize_head else [fl.QuantizationRule(module_path='head', quantize=False)]
  # Optional: a model without attention has no product of two activations.
  return out + [fl.QuantizationRule(module_path='.*', operands='activations', quantize=False,
                                    optional=True),
                fl.QuantizationRule(module_path='.*', operands='weight')]


def _schedule(peak: float, steps: int):
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 10), max(steps, 2), 0.0)


def _loop(step_fn, state, task: tasks_lib.Task, steps: int, first: int):
  for s in range(steps):
    state = step_fn(state, jax.device_put(task.train_batch(first + s)))
  return state


def _evaluate(task: tasks_lib.Task, apply_fn, params) -> tuple[float, float]:
  return train_lib.evaluate(jax.jit(train_lib.make_eval_step(apply_fn)), params,
                            task.eval_batches)


def run(task: tasks_lib.Task, cfg: config_lib.JobConfig, float_params) -> list[Row]:
  """The stages above for ``task``, from the ``bf16`` arm's trained variables."""
  ff = cfg.from_float
  arm = arms_lib.build_arm('bf16', cfg)
  model = task.build_model(arm)
  k = max(1, round(ff.qat_fraction * task.steps))
  lr = _schedule(ff.learning_rate_scale * task.settings.learning_rate, k)
  first = task.steps  # the extra steps see batches the float run did not
  example = task.example_input()
  calib = [task.train_batch(10_000_000 + i)['x'] for i in range(ff.calibration_batches)]
  rs = rules(task.settings.quantize_head)
  rows = []

  def ptq(recipe, params, config=None):
    qmodel = fl.quantize_model(model, recipe, rs, on_unquantized='ignore')
    return fl.ptq(qmodel, params, calib, config=config)

  t = time.perf_counter()
  rows.append(Row(stage='bf16', steps=task.steps,
                  **_scores(task, model.apply, float_params, float_params), seconds=0.0))

  # Float, k more steps: what the extra steps alone give.
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
  state = fl.TrainState.create(apply_fn=model.apply, params=float_params, tx=tx)
  more = _loop(_jitted_state_step(), state, task, k, first)
  rows.append(Row(stage='bf16, more steps', steps=k,
                  **_scores(task, model.apply, more.params, more.params),
                  seconds=time.perf_counter() - t))

  t = time.perf_counter()
  int8 = ptq(config_lib.build_recipe(cfg.int8_recipe, 'int', 'int8_recipe'), float_params)
  rows.append(Row(stage='ptq int8', steps=0, **_served(task, int8.served, int8.served_params),
                  seconds=time.perf_counter() - t))

  t = time.perf_counter()
  int4_recipe = fl.weight_only(4)
  int4 = ptq(int4_recipe, float_params)
  rows.append(Row(stage='ptq int4', steps=0, **_served(task, int4.served, int4.served_params),
                  seconds=time.perf_counter() - t))

  t = time.perf_counter()
  gptq = ptq(int4_recipe, float_params, fl.PtqConfig(weights='gptq'))
  rows.append(Row(stage='ptq int4, gptq', steps=0,
                  **_served(task, gptq.served, gptq.served_params),
                  seconds=time.perf_counter() - t))

  t = time.perf_counter()
  state = fl.TrainState.create(apply_fn=int4.model.apply, params=int4.variables, tx=tx)
  state = _loop(_jitted_state_step(), state, task, k, first)
  served, sp = fl.convert(int4.model, state.params, example)
  rows.append(Row(stage='qat from ptq int4', steps=k, **_served(task, served, sp),
                  seconds=time.perf_counter() - t))

  t = time.perf_counter()
  lp = fl.add_lora(int4.served, int4.served_params, example, rank=ff.lora_rank,
                   alpha=ff.lora_alpha, seed=cfg.seed)
  adapters, frozen = fl.split_lora(lp)
  ltx = optax.adam(_schedule(ff.lora_learning_rate, k))
  step = _jitted_lora_step(int4.served, ltx)
  opt = ltx.init(adapters)
  for s in range(k):
    adapters, opt = step(adapters, frozen, opt, jax.device_put(task.train_batch(first + s)))
  lp = fl.join_lora(adapters, frozen)
  # Served from the int4 codes; the adapters (float) are counted apart, in the JSON.
  scores = _scores(task, int4.served.apply, lp, int4.served_params)
  rows.append(Row(stage='qlora int4', steps=k, **scores, seconds=time.perf_counter() - t))

  t = time.perf_counter()
  merged = fl.merge_lora(int4.served, lp, example)
  # GPTQ keeps the low-rank update that round to nearest mostly rounds away (on the LM,
  # seed 0: -0.22% vs +0.25% against bf16, the adapters themselves -0.32%).
  again = ptq(int4_recipe, merged, fl.PtqConfig(weights='gptq'))
  rows.append(Row(stage='qlora int4, merged', steps=k,
                  **_served(task, again.served, again.served_params),
                  seconds=time.perf_counter() - t))
  return rows


def _scores(task, apply_fn, params, weights) -> dict[str, Any]:
  loss, acc = _evaluate(task, apply_fn, params)
  return {'val_loss': loss, 'val_acc': acc, 'weight_bytes': fl.weight_bytes(weights)}


def _served(task, served, served_params) -> dict[str, Any]:
  return _scores(task, served.apply, served_params, served_params)


def _jitted_state_step():
  step = train_lib.make_train_step([])
  return jax.jit(lambda state, batch: step(state, batch)[0])


def _jitted_lora_step(served, tx):
  @jax.jit
  def step(adapters, frozen, opt, batch):
    def loss_fn(a):
      logits = served.apply(fl.join_lora(a, frozen), batch['x'])
      return tasks_lib.loss_and_accuracy(logits, batch['y'])[0]
    grads = jax.grad(loss_fn)(adapters)
    updates, opt = tx.update(grads, opt, adapters)
    return optax.apply_updates(adapters, updates), opt
  return step


def gap_closed(rows: list[Row], stage: str) -> float:
  """The share of int4 PTQ's loss gap to ``bf16`` that ``stage`` closes (1: all of it).

  NaN where int4 PTQ has no gap (its loss is not above ``bf16``'s).
  """
  by = {r.stage: r.val_loss for r in rows}
  gap = by['ptq int4'] - by['bf16']
  return float('nan') if gap <= 0 else (by['ptq int4'] - by[stage]) / gap


def format_table(task: str, rows: list[Row]) -> str:
  """The stage table of one task (fits 80 columns)."""
  base = rows[0].val_loss
  lines = [f'{task}: from the trained bf16 model (served models: their own weights)',
           f'  {"stage":22s} {"steps":>6s} {"val loss":>9s} {"vs bf16":>8s} {"acc":>6s} '
           f'{"weights":>9s} {"gap closed":>10s}']
  for r in rows:
    closed = ''
    if r.stage.startswith(('qat', 'qlora')):
      g = gap_closed(rows, r.stage)
      closed = 'no gap' if np.isnan(g) else f'{100 * g:9.0f}%'

    lines.append(f'  {r.stage:22s} {r.steps:6d} {r.val_loss:9.4f} '
                 f'{100 * (r.val_loss / base - 1):+7.2f}% {r.val_acc:6.3f} '
                 f'{r.weight_bytes / 1024:8.0f}K {closed:>10s}')
  return '\n'.join(lines)


def plot(results: dict[str, list[Row]], path: str) -> None:
  """Held-out loss per stage and task, relative to ``bf16`` (one panel per task)."""
  # pylint: disable=g-import-not-at-top
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  # pylint: enable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
  for ax, (task, rows) in zip(axes[0], results.items()):
    base = rows[0].val_loss
    rel = [100 * (r.val_loss / base - 1) for r in rows]
    colors = ['0.5' if r.stage.startswith('bf16') else 'C0' if r.stage.startswith('ptq')
              else 'C1' if r.stage.startswith('qat') else 'C2' for r in rows]
    ax.barh(np.arange(len(rows)), rel, color=colors)
    ax.set_yticks(np.arange(len(rows)), [f'{r.stage} ({r.steps})' if r.steps and
                                         r.stage != 'bf16' else r.stage for r in rows])
    ax.invert_yaxis()
    ax.axvline(0.0, color='k', lw=0.8)
    ax.set_xlabel('held-out loss vs bf16 (%)')
    ax.set_title(task)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def as_dict(rows: list[Row]) -> list[dict[str, Any]]:
  """The rows for the JSON summary, with the gap each training stage closes."""
  out = []
  for r in rows:
    d = dataclasses.asdict(r)
    if r.stage.startswith(('qat', 'qlora')):
      d['int4_gap_closed'] = gap_closed(rows, r.stage)
    out.append(d)
  return out
