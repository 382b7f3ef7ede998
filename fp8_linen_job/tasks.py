"""Tasks: a dataset, a model builder, a loss and an optimizer, bundled.

A :class:`Task` is everything :mod:`fp8_linen_job.train` needs to train one
model in any arm; the arm only changes which layer classes the model gets.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8_linen as fl

from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import data as data_lib
from fp8_linen_job import models

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
  """One training problem, independent of the arm.

  Attributes:
    name: Task name (``'lm'`` or ``'digits'``).
    description: One line for tables and plots.
    steps: Optimizer steps to train.
    eval_every: Evaluate every this many steps (0: only at the end).
    build_model: ``arm -> nn.Module`` (for an arm with ``api='nnx'``, a
      :class:`~fp8_linen_job.models.NnxAsLinen` with the same ``init``/``apply``).
    train_batch: ``step -> batch``; a pure function of the step.
    eval_batches: Fixed evaluation batches.
    make_optimizer: ``() -> optax.GradientTransformation``.
    settings: The task's config section (for the summary).
  """

  name: str
  description: str
  steps: int
  eval_every: int
  build_model: Callable[[arms_lib.Arm], nn.Module]
  train_batch: Callable[[int], Batch]
  eval_batches: list[Batch]
  make_optimizer: Callable[[], optax.GradientTransformation]
  settings: Any

  def example_input(self) -> np.ndarray:
    """An input batch to initialize models with."""
    return self.train_batch(0)['x']


def loss_and_accuracy(logits: jax.Array,
                      labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Mean softmax cross-entropy and accuracy over all label positions."""
  logits = logits.astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  acc = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return loss.mean(), acc.mean()


def make_optimizer(settings: Any) -> optax.GradientTransformation:
  """AdamW with linear warm-up, cosine decay to 10% and optional clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=settings.learning_rate,
      warmup_steps=min(settings.warmup_steps, settings.steps),
      decay_steps=max(settings.steps, settings.warmup_steps + 1),
      end_value=0.1 * settings.learning_rate)
  chain = []
  if settings.grad_clip > 0:
    chain.append(optax.clip_by_global_norm(settings.grad_clip))
  chain.append(optax.adamw(schedule, weight_decay=settings.weight_decay))
  return optax.chain(*chain)


def _head_cls(arm: arms_lib.Arm, quantize_head: bool):
  return arm.dense_cls if quantize_head else None


def lm_task(cfg: config_lib.JobConfig) -> Task:
  """The byte-level transformer LM on stdlib source text."""
  s = cfg.lm
  data = data_lib.make_text_data(
      text_bytes=s.text_bytes, val_fraction=s.val_fraction,
      seq_len=s.seq_len, batch_size=s.batch_size, seed=cfg.seed)

  def build_model(arm: arms_lib.Arm) -> nn.Module:
    if arm.api == 'nnx':
      head = arm.nnx_dense_cls if s.quantize_head else None
      return models.NnxAsLinen(
          lambda rngs: models.NnxTransformerLM(
              max_len=s.seq_len, d_model=s.d_model, num_heads=s.num_heads,
              num_layers=s.num_layers, mlp_ratio=s.mlp_ratio,
              dense_cls=arm.nnx_dense_cls, head_cls=head, dtype=arm.dtype,
              rngs=rngs),
          calibrate=isinstance(arm.recipe, fl.IntRecipe))
    return arm.wrap_model(models.TransformerLM(
        max_len=s.seq_len, d_model=s.d_model, num_heads=s.num_heads,
        num_layers=s.num_layers, mlp_ratio=s.mlp_ratio,
        dense_cls=arm.dense_cls, head_cls=_head_cls(arm, s.quantize_head),
        dtype=arm.dtype))

  description = (f'byte-level transformer LM ({s.num_layers} layers, '
                 f'd_model {s.d_model}, seq {s.seq_len}) on '
                 f'{len(data.train) + len(data.val):,} bytes of stdlib source')
  return Task(name='lm', description=description, steps=s.steps,
              eval_every=s.eval_every, build_model=build_model,
              train_batch=data.train_batch,
              eval_batches=data.eval_batches(s.eval_batches),
              make_optimizer=lambda: make_optimizer(s), settings=s)


def digits_task(cfg: config_lib.JobConfig) -> Task:
  """The small CNN on scikit-learn's 8x8 digits."""
  s = cfg.digits
  data = data_lib.make_digits_data(test_fraction=s.test_fraction,
                                   batch_size=s.batch_size, seed=cfg.seed)

  def build_model(arm: arms_lib.Arm) -> nn.Module:
    if arm.api == 'nnx':
      head = arm.nnx_dense_cls if s.quantize_head else None
      return models.NnxAsLinen(
          lambda rngs: models.NnxDigitsCNN(
              conv_features=s.conv_features, hidden=s.hidden,
              conv_cls=arm.nnx_conv_cls, dense_cls=arm.nnx_dense_cls,
              head_cls=head, dtype=arm.dtype,
              image_size=data.train_x.shape[1], in_channels=data.train_x.shape[3],
              rngs=rngs),
          calibrate=isinstance(arm.recipe, fl.IntRecipe))
    return arm.wrap_model(models.DigitsCNN(
        conv_features=s.conv_features, hidden=s.hidden,
        conv_cls=arm.conv_cls, dense_cls=arm.dense_cls,
        head_cls=_head_cls(arm, s.quantize_head), dtype=arm.dtype))

  description = (f'CNN (conv {list(s.conv_features)}, hidden {s.hidden}) on '
                 f'sklearn digits ({len(data.train_x)} train / '
                 f'{len(data.test_x)} test)')
  return Task(name='digits', description=description, steps=s.steps,
              eval_every=s.eval_every, build_model=build_model,
              train_batch=data.train_batch, eval_batches=data.eval_batches(),
              make_optimizer=lambda: make_optimizer(s), settings=s)


BUILDERS: dict[str, Callable[[config_lib.JobConfig], Task]] = {
    'lm': lm_task,
    'digits': digits_task,
}
"""Task name -> builder. Keep in sync with ``config.TASKS``."""

assert tuple(BUILDERS) == config_lib.TASKS


def build_task(name: str, cfg: config_lib.JobConfig) -> Task:
  """Builds task ``name`` (loads its data)."""
  return BUILDERS[name](cfg)
