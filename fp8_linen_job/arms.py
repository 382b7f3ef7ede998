"""Arms: the variants of a model that the job trains side by side.

An :class:`Arm` says which dense and conv classes the models get and which
train-state class holds the variables. The ``bf16`` arm is plain flax; the
``fp8`` and ``int8`` arms use the library's layers and train state.

To add an arm, write a builder ``cfg -> Arm``, add it to :data:`BUILDERS` and
its name to :data:`fp8_linen_job.config.ARMS`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
from flax import nnx
from flax.training import train_state as flax_train_state
import jax.numpy as jnp

import fp8_linen as fl
from fp8_linen_job import config as config_lib

OWG = fl.OWG
"""Name of the collection holding quantization state (scales, histories)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
  """How one arm builds its layers and its train state.

  Attributes:
    name: Arm name, e.g. ``'bf16'``.
    dense_cls: Replaces ``nn.Dense``; called as ``dense_cls(features,
      dtype=..., name=...)``.
    conv_cls: Replaces ``nn.Conv``; called as ``conv_cls(features,
      kernel_size, dtype=..., name=...)``.
    train_state_cls: Has ``create(apply_fn=, params=, tx=)`` taking the full
      variables dict from ``model.init``, and ``apply_gradients(grads=)``.
    quantized: Whether the arm carries quantization state to report.
    wrap_model: Applied to each model after it is built (identity here; the
      hook for a model-level wrapper such as ``fp8_linen.quantize_model``).
    notes: Short remarks for the results table.
    details: More facts for the JSON summary (e.g. the recipe's repr).
    dtype: Compute dtype of the models.
    recipe: The ``fp8_linen`` recipe of a quantized arm (``None`` for
      ``bf16``); a checkpoint is resumed only with the same recipe.
    api: ``'linen'``, or ``'nnx'``: the task builds its NNX model with
      ``nnx_dense_cls`` (see ``JobConfig.api``).
    nnx_dense_cls: Replaces ``nnx.Linear`` in NNX models; called as
      ``nnx_dense_cls(in_features, out_features, dtype=..., rngs=...)``.
    nnx_conv_cls: Replaces ``nnx.Conv`` in NNX models; called as
      ``nnx_conv_cls(in_features, out_features, kernel_size, dtype=...,
      rngs=...)``.
  """

  name: str
  dense_cls: Callable[..., nn.Module] = nn.Dense
  conv_cls: Callable[..., nn.Module] = nn.Conv
  train_state_cls: Any = flax_train_state.TrainState
  quantized: bool = False
  wrap_model: Callable[[nn.Module], nn.Module] = lambda model: model
  notes: tuple[str, ...] = ()
  details: tuple[tuple[str, str], ...] = ()
  dtype: Any = jnp.bfloat16
  recipe: Any = None
  api: str = 'linen'
  nnx_dense_cls: Callable[..., nnx.Module] = nnx.Linear
  nnx_conv_cls: Callable[..., nnx.Module] = nnx.Conv


_NNX_NOTE = 'Flax NNX model ({})'


def _with_api(arm: Arm, cfg: config_lib.JobConfig) -> Arm:
  """``arm`` as configured by ``cfg.api`` (its NNX twin for ``'nnx'``)."""
  if cfg.api == 'linen':
    return arm
  layer = ('fp8_linen.nnx.Linear/Conv' if arm.quantized else 'nnx.Linear/Conv')
  return dataclasses.replace(arm, api=cfg.api, notes=arm.notes + (_NNX_NOTE.format(layer),),
                             details=arm.details + (('api', cfg.api),))


def bf16_arm(cfg: config_lib.JobConfig) -> Arm:
  """Plain ``nn.Dense`` / ``nn.Conv`` computing in bfloat16.

  The train state is flax's own: ``params`` is the full variables dict, which
  here holds only the ``params`` collection, so the optimizer sees exactly
  the same tree as in a quantized arm.
  """
  return _with_api(Arm(name='bf16'), cfg)


def _quantized_arm(name: str, recipe, cfg: config_lib.JobConfig) -> Arm:
  """An arm with ``QDense`` and ``QConv`` (NNX: ``fl.nnx.Linear``, ``Conv``) using ``recipe``."""
  return _with_api(Arm(
      name=name, dense_cls=functools.partial(fl.QDense, recipe=recipe),
      conv_cls=functools.partial(fl.QConv, recipe=recipe),
      nnx_dense_cls=functools.partial(fl.nnx.Linear, recipe=recipe),
      nnx_conv_cls=functools.partial(fl.nnx.Conv, recipe=recipe),
      train_state_cls=fl.TrainState, quantized=True,
      details=(('recipe', repr(recipe)),), recipe=recipe), cfg)


def fp8_arm(cfg: config_lib.JobConfig) -> Arm:
  """``fp8_linen.QDense`` and ``QConv`` with an fp8 recipe.

  Args:
    cfg: The job config; ``cfg.fp8_recipe`` names the recipe (a shipped
      name, a YAML path or a mapping; empty: the library default, delayed
      scaling).

  Returns:
    The arm.

  Raises:
    ConfigError: If ``cfg.fp8_recipe`` is rejected by the library.
  """
  return _quantized_arm(
      'fp8', config_lib.build_recipe(cfg.fp8_recipe, 'fp8', 'fp8_recipe'), cfg)


def int8_arm(cfg: config_lib.JobConfig) -> Arm:
  """``fp8_linen.QDense`` and ``QConv`` with an integer recipe.

  Args:
    cfg: The job config; ``cfg.int8_recipe`` names the recipe like
      ``fp8_recipe`` (default ``int8_lsq``; empty mapping:
      ``fp8_linen.IntRecipe()``, min/max observers).

  Returns:
    The arm.

  Raises:
    ConfigError: If ``cfg.int8_recipe`` is rejected by the library.
  """
  return _quantized_arm(
      'int8', config_lib.build_recipe(cfg.int8_recipe, 'int', 'int8_recipe'), cfg)


BUILDERS: dict[str, Callable[[config_lib.JobConfig], Arm]] = {
    'bf16': bf16_arm,
    'fp8': fp8_arm,
    'int8': int8_arm,
}
"""Arm name -> builder. Keep in sync with ``config.ARMS``."""

assert tuple(BUILDERS) == config_lib.ARMS


def build_arm(name: str, cfg: config_lib.JobConfig) -> Arm:
  """Builds arm ``name``.

  Raises:
    ConfigError: If ``name`` is not a known arm.
  """
  if name not in BUILDERS:
    raise config_lib.ConfigError(
        f'unknown arm {name!r}; allowed values: {", ".join(BUILDERS)}')
  return BUILDERS[name](cfg)
