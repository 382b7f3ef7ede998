"""Low-rank adapters on a frozen served product, and the served product's input gradient.

LoRA keeps a served weight ``W`` (stored codes) frozen and trains a pair of
small matrices beside it: the product becomes ``served(x, W) + s * (x A) B``
with ``A`` over the weight's contracting axes and ``rank`` columns, ``B``
from ``rank`` rows to the weight's free axes, and ``s = alpha / rank``.
``B`` starts at zero, so a fresh adapter leaves the served model's output
unchanged. Merging folds ``s * A B`` into the dequantized weight
(:func:`dot_delta_kernel`, :func:`conv_delta_kernel`).

Adapters before a served product train only if gradients pass through it.
The served products quantize their input and multiply codes, which has no
useful derivative; :func:`straight_through` gives them the one QAT's
straight-through estimator gives: the gradient of the float product of the
same operands, with the weight dequantized from its codes *in the backward
pass*. Its residuals are the codes and their scales, never a float copy of
the weight (QLoRA's memory saving holds during training).

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import lora
  >>> lora.dot_shapes((16, 4), (0,), (), rank=2)
  ((16, 2), (2, 4))
"""

from __future__ import annotations

import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8_linen.core import lowering

__all__ = ["ADAPTERS", "NAMES", "dot_shapes", "conv_shapes", "adapter_key", "init_a", "dot_delta", "conv_delta",
           "dot_delta_kernel", "conv_delta_kernel", "straight_through"]

# The adapter pair a layer trains, and everything LoRA stores next to a served kernel.
ADAPTERS = ("lora_a", "lora_b")
NAMES = ADAPTERS + ("lora_scale",)


def dot_shapes(kernel_shape, contract, batch, *, rank: int) -> tuple[tuple, tuple]:
  """``(a_shape, b_shape)`` of an adapter of a ``dot_general`` weight.

  ``A`` has the weight's contracting axes (in ``contract``'s order) then
  ``rank``; ``B`` has ``rank`` then the weight's free axes (in the weight's
  order), so ``(x A) B`` lays its output out as ``x W`` does.

  Raises:
    ValueError: for a weight with batch axes (one adapter per batch entry is
      not a low-rank update of the weight).
  """
  if batch:
    raise ValueError("a LoRA adapter needs a product without batch axes")
  contract = tuple(contract)
  free = [a for a in range(len(kernel_shape)) if a not in contract]
  return (tuple(kernel_shape[a] for a in contract) + (rank,),
          (rank,) + tuple(kernel_shape[a] for a in free))


def conv_shapes(kernel_shape, out_axis: int, *, rank: int, groups: int = 1) -> tuple[tuple, tuple]:
  """``(a_shape, b_shape)`` of a convolution's adapter: ``A`` a kernel of ``rank`` outputs, ``B`` a 1x1.

  Raises:
    ValueError: for a grouped convolution (``feature_group_count > 1``).
  """
  if groups != 1:
    raise ValueError("a LoRA adapter needs a convolution without feature groups "
                     f"(feature_group_count={groups})")
  a = list(kernel_shape)
  a[out_axis] = rank
  return tuple(a), (rank, kernel_shape[out_axis])


def adapter_key(key, path: str):
  """The key of the adapter at ``path``: ``key`` folded with the path (the same in both APIs)."""
  return jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF)


def init_a(key, shape, fan_in: int) -> jax.Array:
  """``A``'s initial value: uniform in ``±1/sqrt(fan_in)`` (float32); ``B`` starts at zero."""
  bound = 1.0 / np.sqrt(max(int(fan_in), 1))
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def _compute_dtype(x):
  x = jnp.asarray(x)
  return x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32


def dot_delta(lhs, a, b, lhs_contract, scale, out_dtype=None):
  """``scale * (lhs A) B``: the adapter's part of a ``dot_general``'s output.

  ``lhs_contract`` are ``lhs``'s contracting axes, paired in order with
  ``A``'s leading axes. Computed in ``lhs``'s float dtype with float32
  accumulation, as two thin GEMMs (``A B`` is never formed).
  """
  lhs = jnp.asarray(lhs)
  lc = tuple(int(c) % lhs.ndim for c in lhs_contract)
  cd = _compute_dtype(lhs)
  out_dtype = out_dtype or lhs.dtype
  h = lowering.lax_dot_general(lhs.astype(cd), jnp.asarray(a).astype(cd),
                               ((tuple(lc), tuple(range(len(lc)))), ((), ())),
                               preferred_element_type=jnp.float32)
  # Scaled at rank width, where the array is smallest.
  h = (jnp.asarray(scale, jnp.float32) * h).astype(cd)
  y = _last_by_first(h, jnp.asarray(b).astype(cd))
  return y.astype(out_dtype)


def _last_by_first(x, b):
  """``x``'s last axis contracted with ``b``'s first (float32 accumulation).

  The original ``lax`` function: inside ``fl.quantize_model`` the named one is
  intercepted.
  """
  return lowering.lax_dot_general(x, b, (((x.ndim - 1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)


def _feature_last(t, axis):
  return jnp.moveaxis(t, axis, -1)


def conv_delta(lhs, a, b, conv_kwargs: dict, scale, out_dtype=None):
  """``scale * conv(lhs, A) . B``: the adapter's part of a convolution's output.

  ``A`` is a convolution kernel with ``rank`` output features (the layer's
  window, strides, padding and dilations); ``B`` maps them to the output
  features at every position.
  """
  lhs = jnp.asarray(lhs)
  cd = _compute_dtype(lhs)
  out_dtype = out_dtype or lhs.dtype
  dn = lax.conv_dimension_numbers(lhs.shape, jnp.shape(a), conv_kwargs["dimension_numbers"])
  z = lowering.lax_conv_general_dilated(lhs.astype(cd), jnp.asarray(a).astype(cd),
                                        **conv_kwargs, preferred_element_type=jnp.float32)
  f = dn.out_spec[1]
  z = (jnp.asarray(scale, jnp.float32) * z).astype(cd)
  y = _last_by_first(_feature_last(z, f), jnp.asarray(b).astype(cd))
  return jnp.moveaxis(y, -1, f).astype(out_dtype)


def dot_delta_kernel(a, b, kernel_shape, contract, scale):
  """``scale * A B`` laid out as the weight (float32): what merging adds to it."""
  contract = tuple(contract)
  free = tuple(x for x in range(len(kernel_shape)) if x not in contract)
  d = _last_by_first(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  d = jnp.transpose(d, np.argsort(contract + free))
  return jnp.asarray(scale, jnp.float32) * d.reshape(kernel_shape)


def conv_delta_kernel(a, b, out_axis: int, scale):
  """``scale * A . B`` over ``A``'s output-feature axis: the merged convolution kernel's update."""
  d = _last_by_first(_feature_last(jnp.asarray(a, jnp.float32), out_axis),
                     jnp.asarray(b, jnp.float32))
  return jnp.asarray(scale, jnp.float32) * jnp.moveaxis(d, -1, out_axis)


def _zero_cotangent(x):
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def straight_through(served: Callable, float_product: Callable, lhs, rhs, arrays: dict, *,
                     codes: Callable | None, weight: Callable | None, where: str):
  """``served(lhs, rhs, arrays)``, differentiable by the straight-through estimator.

  The forward is the served product, unchanged. The backward is that of
  ``float_product(lhs, w)`` with ``w`` the float right operand:

  * a stored weight (``codes`` given): ``codes(rhs)`` (the codes in their
    storage dtype) and ``arrays`` are the only residuals; ``weight(codes,
    arrays)`` dequantizes them in the backward pass. Only ``lhs`` gets a
    gradient (the weight is frozen);
  * a live right operand (``codes`` is ``None``, e.g. attention's keys):
    both operands get the float product's gradients.

  The stored arrays get zero cotangents.

  Raises:
    ValueError: (when differentiated) naming ``where``, for a stored weight
      its family cannot dequantize (``weight`` is ``None``).
  """
  lhs_aval = jax.ShapeDtypeStruct(jnp.shape(lhs), jnp.result_type(lhs))
  rhs_aval = jax.ShapeDtypeStruct(jnp.shape(rhs), jnp.result_type(rhs))

  @jax.custom_vjp
  def product(lhs, rhs, arrays):
    return served(lhs, rhs, arrays)

  def fwd(lhs, rhs, arrays):
    y = served(lhs, rhs, arrays)
    if codes is not None:
      return y, (codes(rhs), arrays)
    return y, (lhs, rhs, arrays)

  def bwd(res, g):
    if codes is not None:
      stored, arrays = res
      if weight is None:
        raise ValueError(f"{where}: the served weight of this recipe cannot be dequantized, so "
                         "its served product has no input gradient (LoRA adapters before it "
                         "would not train); serve it with a per-tensor or row-wise fp8 or an "
                         "integer recipe, or train the adapters of a model without it")
      # The backward GEMM in the input's float dtype (bf16 training stays bf16, with float32
      # accumulation), not the dtype the layer handed the codes over in.
      dtype = (lhs_aval.dtype if jnp.issubdtype(lhs_aval.dtype, jnp.floating)
               else rhs_aval.dtype)
      w = weight(stored, arrays).astype(dtype).reshape(rhs_aval.shape)
      (dx,) = jax.linear_transpose(lambda x: float_product(x, w).astype(g.dtype), lhs_aval)(g)
      return (dx, jnp.zeros(rhs_aval.shape, rhs_aval.dtype),
              jax.tree.map(_zero_cotangent, arrays))
    x, r, arrays = res
    _, pull = jax.vjp(float_product, x, r)
    dx, dr = pull(g)
    return dx, dr, jax.tree.map(_zero_cotangent, arrays)

  product.defvjp(fwd, bwd)
  return product(lhs, rhs, arrays)
