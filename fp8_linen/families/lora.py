"""LoRA and QLoRA on served models, written once for both Flax APIs.

A served product (``'serve'`` mode) runs through :func:`served`: the
family's served product made differentiable by the straight-through
estimator (:func:`~fp8_linen.core.lora.straight_through`: gradients reach
the adapters of earlier layers, and only codes are kept for the backward
pass), plus the layer's adapter where it has one (arrays ``lora_a``,
``lora_b``, ``lora_scale`` next to its served ``kernel``, read through its
:class:`~fp8_linen.families.VariableAccess` as the other served arrays).

Two runs of the served model, each API's, build on it:

* :func:`adding` (``fl.add_lora``, ``fl.nnx.add_lora``): every served
  product with a stored weight whose layer path matches records a
  :class:`LoraPlan` (the adapter's shapes, which need the product's
  contracting axes); the API then creates the adapters;
* :func:`merging` (``fl.merge_lora``, ``fl.nnx.merge_lora``): every such
  product records a :class:`LoraMerge`: its weight dequantized from the
  codes plus ``lora_scale * A B``, which the API writes into a float model
  for post-training quantization (``fl.ptq``) to requantize.

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.families import lora
  >>> with lora.adding(rank=4, paths=None):
  ...   lora.phase()
  Adding(rank=4, paths=None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp

from fp8_linen.core import lora as core_lora
from fp8_linen.core import settings
from fp8_linen.families.access import VariableAccess
from fp8_linen.families.table import RecipeFamily

__all__ = ["Adding", "LoraPlan", "LoraMerge", "adding", "merging", "phase", "served",
           "check_rank"]

_PHASE = settings.TraceSetting("lora_phase", default=None)


@dataclasses.dataclass(frozen=True)
class Adding:
  """The adapter-creating run: ``rank``, and the layer paths (a regex, searched) that get one."""

  rank: int
  paths: str | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraPlan:
  """What an adapter-creating run records of one product: the adapter's shapes (static)."""

  a_shape: tuple = dataclasses.field(metadata=dict(static=True))
  b_shape: tuple = dataclasses.field(metadata=dict(static=True))
  fan_in: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraMerge:
  """What a merging run records of one product.

  Attributes:
    kernel: the merged float32 weight, as the product sees it.
    kernel_at: where the layer keeps that weight (``0`` itself, ``1`` its
      parent, ``-1`` nowhere).
  """

  kernel: jax.Array
  kernel_at: jax.Array


def check_rank(who: str, rank) -> int:
  """``rank`` as a positive int, else a ``ValueError`` naming it."""
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"{who}: rank must be a positive int, got {rank!r}")
  return rank


@contextlib.contextmanager
def adding(*, rank: int, paths: str | None):
  """Served products record the :class:`LoraPlan` of the layers ``paths`` matches."""
  if paths is not None:
    re.compile(paths)
  with _PHASE.set(Adding(rank=check_rank("adding", rank), paths=paths)):
    yield


@contextlib.contextmanager
def merging():
  """Served products record their merged weight (:class:`LoraMerge`)."""
  with _PHASE.set("merge"):
    yield


def phase():
  """The LoRA run in force: an :class:`Adding`, ``'merge'`` or ``None``."""
  return _PHASE.get()


def _adapter(where: str, adapters: dict) -> tuple:
  missing = [n for n in core_lora.NAMES if n not in adapters]
  if missing:
    raise ValueError(f"{where}: the LoRA adapter is incomplete (no {', '.join(missing)}); "
                     "create adapters with fl.add_lora / fl.nnx.add_lora")
  return tuple(adapters[n] for n in core_lora.NAMES)


def served(access: VariableAccess, family: RecipeFamily, recipe, lhs, rhs, *, served_fn,
           float_fn, contract, lhs_contract=None, conv_kwargs=None):
  """One served product, with its adapter, in the LoRA run in force (see the module doc).

  Args:
    access: the layer's variables.
    family: the recipe's family.
    recipe: the product's recipe.
    lhs: the input.
    rhs: the right operand (a stored weight's codes, cast to float by the
      layer, or a live operand).
    served_fn: ``fn(lhs, rhs, arrays) -> out``: the family's served product.
    float_fn: ``fn(lhs, rhs) -> out``: the float product of the same
      operands (its gradient is the served product's).
    contract: ``() -> (contracting, batch)`` axes of ``rhs``.
    lhs_contract: ``() -> contracting axes of lhs`` (dots).
    conv_kwargs: the convolution's arguments (convolutions).
  """
  where = access.path
  arrays = dict(access.served_arrays())
  # The operand itself arrives as rhs; kept in the arrays it would be a float residual.
  arrays.pop("kernel", None)
  adapters = {n: arrays.pop(n) for n in core_lora.NAMES if n in arrays}
  stored = "kernel_scale" in arrays  # the right operand is a weight folded to codes
  rc, rb = contract()
  codes = weight = None
  if stored:
    codes = (lambda r: family.weight_codes(r, recipe)) if family.weight_codes else (lambda r: r)
    if family.served_weight is not None:
      def weight(c, a):
        return family.served_weight(c, rc, rb, recipe=recipe, arrays=a, where=where)
  y = core_lora.straight_through(served_fn, float_fn, lhs, rhs, arrays, codes=codes,
                                 weight=weight, where=where)
  conv = conv_kwargs is not None
  now = _PHASE.get()
  if isinstance(now, Adding) and stored and (now.paths is None or re.search(now.paths, where)):
    access.record(_plan(where, rhs, rc, rb, now.rank, conv_kwargs, lhs))
  if adapters:
    a, b, scale = _adapter(where, adapters)
    if conv:
      delta = core_lora.conv_delta(lhs, a, b, conv_kwargs, scale, y.dtype)
    else:
      delta = core_lora.dot_delta(lhs, a, b, lhs_contract(), scale, y.dtype)
    y = y + delta
  if now == "merge":
    access.record(_merged(where, recipe, rhs, rc, stored, codes, weight, arrays, adapters,
                          access, lhs, conv_kwargs))
  return y


def _merged(where, recipe, rhs, rc, stored, codes, weight, arrays, adapters, access, lhs,
            conv_kwargs) -> LoraMerge:
  """The :class:`LoraMerge` of one product (a live right operand: no weight, ``kernel_at=-1``)."""
  if not stored:
    return LoraMerge(kernel=jnp.zeros((0,), jnp.float32), kernel_at=jnp.asarray(-1))
  if weight is None:
    raise ValueError(f"{where}: {type(recipe).__name__}'s family has no served_weight, so "
                     "its weight cannot be merged")
  w = weight(codes(rhs), arrays).reshape(jnp.shape(rhs))
  if adapters:
    a, b, scale = _adapter(where, adapters)
    w = w + (_conv_delta_kernel(a, b, rhs, lhs, conv_kwargs, scale) if conv_kwargs is not None
             else core_lora.dot_delta_kernel(a, b, jnp.shape(rhs), rc, scale))
  at, _ = access.kernel_for(rhs)
  return LoraMerge(kernel=w, kernel_at=jnp.asarray(-1 if at is None else at))


def _out_axis(lhs, rhs, conv_kwargs) -> int:
  dn = jax.lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs),
                                      conv_kwargs["dimension_numbers"])
  return dn.rhs_spec[0]


def _conv_delta_kernel(a, b, rhs, lhs, conv_kwargs, scale):
  return core_lora.conv_delta_kernel(a, b, _out_axis(lhs, rhs, conv_kwargs), scale)


def _plan(where: str, rhs, rc, rb, rank: int, conv_kwargs, lhs) -> LoraPlan:
  shape = tuple(jnp.shape(rhs))
  try:
    if conv_kwargs is None:
      a_shape, b_shape = core_lora.dot_shapes(shape, rc, rb, rank=rank)
      fan_in = 1
      for c in rc:
        fan_in *= shape[c]
    else:
      out = _out_axis(lhs, rhs, conv_kwargs)
      a_shape, b_shape = core_lora.conv_shapes(shape, out, rank=rank,
                                               groups=conv_kwargs.get("feature_group_count", 1))
      fan_in = 1
      for i, d in enumerate(shape):
        fan_in *= 1 if i == out else d
  except ValueError as e:
    raise ValueError(f"{where}: {e}; leave this layer out with paths=") from None
  return LoraPlan(a_shape=a_shape, b_shape=b_shape, fan_in=int(fan_in))
