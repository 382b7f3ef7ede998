"""Block formats of a GEMM operand: MXFP8 and NVFP4 codes with their block scales.

A block format gives every ``block_size`` consecutive elements of the axis a
GEMM contracts a scale of their own:

* MXFP8: fp8 elements (e4m3 / e5m2) with one power-of-two (``e8m0``) scale per
  block of 32 (:func:`mx_quantize` along any axis; :func:`block_quantize`
  along the last one, as :class:`~fp8_linen.core.block_dot.BlockDot` takes its
  operands);
* NVFP4: ``float4_e2m1fn`` elements with one ``e4m3`` scale per block of 16,
  under a float32 per-tensor factor (a role's scale over 448:
  :func:`~fp8_linen.core.numerics.nvfp4_tensor_scale`); a weight may take one
  scale per 16 x 16 tile (``tile=True``) and a gradient may round
  stochastically (:func:`stochastic_round_e2m1`, its noise from
  :mod:`~fp8_linen.core.randomness`).

``jnp`` functions without autodiff rules, like :mod:`~fp8_linen.core.numerics`;
on a mesh with ``Explicit`` axes :func:`mx_quantize` gathers a sharded
blocked axis first (a block must not straddle shards).

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import block_numerics
  >>> q, s = block_numerics.block_quantize(jnp.array([[3.0, -12.0]]), 2, jnp.float4_e2m1fn,
  ...                                      tensor_scale=jnp.float32(1.0))
  >>> block_numerics.block_dequantize(q, s, 2).tolist()
  [[3.0, -12.0]]
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8_linen.core import lowering
from fp8_linen.core.numerics import E4M3_MAX, SCALE_FLOOR, fp8_max, pow2, saturate_measured

__all__ = [
    "E2M1_MAX",
    "block_amax",
    "mx_scale",
    "mx_quantize",
    "mx_dequantize",
    "lax_slice_axis",
    "block_quantize",
    "block_dequantize",
    "e2m1_block",
    "stochastic_round_e2m1",
]

E2M1_MAX = 6.0
"""Largest float4_e2m1fn value (NVFP4's elements)."""

_E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)


def _is_e2m1(dtype) -> bool:
  return np.dtype(dtype) == _E2M1


def block_amax(xb: jnp.ndarray, axis) -> jnp.ndarray:
  """``max(|xb|)`` over ``axis`` (kept), in float32: each block's amax.

  A block whose amax is not finite gets NaN codes
  (:func:`~fp8_linen.core.numerics.saturate_measured`). Whether a NaN
  element makes its block's amax NaN is the backend's reduction's choice
  (XLA:CPU's may skip it; the element's own code is NaN either way).
  """
  return jnp.max(jnp.abs(jnp.asarray(xb, jnp.float32)), axis=axis, keepdims=True)


def mx_scale(a: jnp.ndarray, m: float) -> tuple[jnp.ndarray, jnp.ndarray]:
  """``(scale, e)``: MX's power-of-two block scale for block amaxes ``a`` and its exponent.

  ``scale = 2**e`` with ``e = ceil(log2(a / m))`` clamped to [-126, 127]
  (float32, exact), so no element exceeds ``m`` after division; a zero or
  non-finite amax gets ``e = 0``. ``e`` is int32: ``e + 127`` is the scale's
  ``float8_e8m0fnu`` bit pattern.
  """
  e = jnp.ceil(jnp.log2(jnp.maximum(a, SCALE_FLOOR) / m))
  e = jnp.where(jnp.isfinite(a) & (a > 0), e, 0.0)
  e = jnp.clip(e, -126.0, 127.0).astype(jnp.int32)
  return pow2(e), e


def _block_split(x: jnp.ndarray, axis: int, block_size: int):
  n = x.shape[axis]
  pad = (-n) % block_size
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
  shape = x.shape[:axis] + ((n + pad) // block_size, block_size) + x.shape[axis + 1:]
  return x.reshape(shape), n


def mx_quantize(x: jnp.ndarray, axis: int, block_size: int, dtype):
  """MX block quantization: fp8 elements with one e8m0 scale per block.

  Blocks are ``block_size`` consecutive elements along ``axis`` (the last one
  zero-padded). Each block's scale is the power of two ``2**e`` with ``e =
  ceil(log2(amax / fp8_max))`` (clamped to ``[-126, 127]``), so no element is
  clipped (OCP MX v1.0 rounds ``e`` down and may clip; we round up, as the
  "RCEIL" variant does).

  Args:
    x: floating array.
    axis: the blocked axis (a contracting axis of the GEMM).
    block_size: elements per block.
    dtype: the fp8 element dtype.

  Returns:
    ``(q, scales)``: ``q`` has ``x``'s shape and ``dtype``; ``scales`` is
    ``float8_e8m0fnu`` with ``axis`` of size ``ceil(n / block_size)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import block_numerics
    >>> q, s = block_numerics.mx_quantize(jnp.arange(64.0).reshape(1, 64), 1, 32, jnp.float8_e4m3fn)
    >>> s.astype(jnp.float32).tolist()
    [[0.125, 0.25]]
  """
  axis = axis % x.ndim
  # Blocks must not straddle shards: gather a blocked axis an explicit mesh shards.
  x = lowering.unshard_axis(jnp.asarray(x), axis)
  xb, n = _block_split(x.astype(jnp.float32), axis, block_size)
  a = block_amax(xb, axis + 1)
  scale, _ = mx_scale(a, fp8_max(dtype))
  q = saturate_measured(xb, scale, fp8_max(dtype), a).astype(dtype)
  q = q.reshape(q.shape[:axis] + (q.shape[axis] * q.shape[axis + 1],) + q.shape[axis + 2:])
  q = lax_slice_axis(q, axis, n)
  return q, jnp.squeeze(scale, axis + 1).astype(jnp.float8_e8m0fnu)


def lax_slice_axis(x: jnp.ndarray, axis: int, n: int) -> jnp.ndarray:
  """``x`` restricted to its first ``n`` entries along ``axis``."""
  if x.shape[axis] == n:
    return x
  idx = [slice(None)] * x.ndim
  idx[axis] = slice(0, n)
  return x[tuple(idx)]


def mx_dequantize(q: jnp.ndarray, scales: jnp.ndarray, axis: int, block_size: int,
                  dtype=jnp.float32) -> jnp.ndarray:
  """Inverse of :func:`mx_quantize`: ``q * 2**e`` per block, in ``dtype``.

  Exact in bfloat16 and float32 (an fp8 value times a power of two).
  """
  axis = axis % q.ndim
  q, scales = lowering.unshard_axis(q, axis), lowering.unshard_axis(scales, axis)
  s = jnp.repeat(scales.astype(dtype), block_size, axis=axis)
  s = lax_slice_axis(s, axis, q.shape[axis])
  return q.astype(dtype) * s


def _blocks(x, block_size: int, rows: int):
  """``x`` (..., R, C) as (..., R / rows, rows, C / block_size, block_size)."""
  *lead, r, c = x.shape
  return x.reshape(*lead, r // rows, rows, c // block_size, block_size)


def block_quantize(x: jnp.ndarray, block_size: int, dtype, *, tensor_scale=None,
                   tile: bool = False, noise=None, four_over_six: bool = False):
  """Quantizes ``x`` (..., R, C) in blocks of ``block_size`` along its last axis.

  The format follows from ``dtype``:

  * fp8 elements (MXFP8): one e8m0 scale ``2**ceil(log2(amax / fp8_max))`` per
    block (:func:`mx_quantize`'s rule: no element is clipped);
    ``tensor_scale`` must be ``None``.
  * ``float4_e2m1fn`` elements (NVFP4): ``tensor_scale`` (float32 scalar, see
    :func:`~fp8_linen.core.numerics.nvfp4_tensor_scale`) divides ``x``
    first; each block's scale ``amax / 6`` is rounded to nearest in e4m3
    (saturating at 448), and the block's elements ``x / (scale *
    tensor_scale)`` to nearest in e2m1 (or stochastically, see ``noise``),
    saturating at 6. A block whose e4m3 scale underflows to 0 is all zeros;
    a block holding NaN or Inf gets a NaN scale (e2m1 has neither), so the
    non-finite value still reaches the product.

  Args:
    x: floating array of rank >= 2; ``C`` a multiple of ``block_size`` (and
      ``R`` too when ``tile``).
    block_size: elements per block.
    dtype: the element dtype.
    tensor_scale: NVFP4's per-tensor factor; ``None`` for MX.
    tile: one scale per ``block_size x block_size`` tile of the last two axes
      instead of per ``1 x block_size`` block (the weight's 2-D blocks: the
      same codes block both axes).
    noise: e2m1 only: uniform [0, 1) values of ``x``'s shape for stochastic
      rounding (:func:`stochastic_round_e2m1`); ``None`` rounds to nearest.
    four_over_six: e2m1 only: each block's scale maps its amax to 6 or to 4,
      whichever reconstructs the block (rounded to nearest) with the smaller
      squared error. Mapping to 4 trades the top code (6) for a finer step
      near the block's largest values (3, 4 instead of 4, 6), which is the
      better grid for blocks whose large values sit near 2/3 of the amax.
      The choice is made on round-to-nearest codes; ``noise`` then rounds
      with the chosen scale.

  Returns:
    ``(q, scales)``: ``q`` has ``x``'s shape and ``dtype``; ``scales`` has
    shape (..., R, C / block_size) (a tile's scale repeated on its rows),
    ``float8_e8m0fnu`` (MX) or ``float8_e4m3fn`` (NVFP4).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import block_numerics
    >>> q, s = block_numerics.block_quantize(jnp.array([[3.0, -12.0]]), 2, jnp.float4_e2m1fn,
    ...                                      tensor_scale=jnp.float32(1.0))
    >>> q.astype(jnp.float32).tolist(), s.astype(jnp.float32).tolist()
    ([[1.5, -6.0]], [[2.0]])
  """
  x = jnp.asarray(x).astype(jnp.float32)
  rows = block_size if tile else 1
  xb = _blocks(x, block_size, rows)
  a = block_amax(xb, (-3, -1))
  if not _is_e2m1(dtype):
    if tensor_scale is not None or noise is not None or four_over_six:
      raise ValueError("block_quantize: tensor_scale, noise and four_over_six are for e2m1 "
                       "elements (NVFP4)")
    m = fp8_max(dtype)
    scale, _ = mx_scale(a, m)
    q = saturate_measured(xb, scale, m, a).astype(dtype)
    stored = scale.astype(jnp.float8_e8m0fnu)
  else:
    g = jnp.reshape(jnp.asarray(tensor_scale, jnp.float32), ())
    stored, den, y = e2m1_block(xb, a, g, E2M1_MAX)
    if four_over_six:
      stored4, den4, y4 = e2m1_block(xb, a, g, 4.0)
      # Compared in x's units: the two candidates divide by different scales.
      err6 = jnp.sum(jnp.square(_e2m1_nearest(y) * den - xb), axis=(-3, -1), keepdims=True)
      err4 = jnp.sum(jnp.square(_e2m1_nearest(y4) * den4 - xb), axis=(-3, -1), keepdims=True)
      four = err4 < err6
      stored = jnp.where(four, stored4, stored)
      y = jnp.where(four, y4, y)
    if noise is not None:
      y = stochastic_round_e2m1(y, _blocks(jnp.asarray(noise, jnp.float32), block_size, rows))
    q = y.astype(dtype)
  q = q.reshape(x.shape)
  stored = jnp.broadcast_to(stored, xb.shape[:-3] + (rows, xb.shape[-2], 1))
  return q, stored.reshape(x.shape[:-1] + (x.shape[-1] // block_size,))


def e2m1_block(xb, a, g, top: float = E2M1_MAX):
  """``(stored e4m3 scale, scale * g, x / (scale * g) clipped to [-6, 6])`` of blocks ``xb``.

  Each block's scale maps its amax ``a`` to ``top`` (6, or 4 for the 4/6
  choice), rounded to nearest in e4m3 and saturating at 448.
  """
  d = a / (top * g)
  # A non-finite block keeps a NaN scale: its e2m1 codes cannot say so.
  d = jnp.where(jnp.isfinite(a), jnp.minimum(d, E4M3_MAX), jnp.nan)
  stored = d.astype(jnp.float8_e4m3fn)
  den = stored.astype(jnp.float32) * g
  y = jnp.clip(jnp.where(den > 0, xb / jnp.where(den > 0, den, 1.0), 0.0),
               -E2M1_MAX, E2M1_MAX)
  return stored, den, y


def _e2m1_nearest(y):
  """``y`` rounded to nearest in e2m1, as float32."""
  return y.astype(jnp.float4_e2m1fn).astype(jnp.float32)


def block_dequantize(q: jnp.ndarray, scales: jnp.ndarray, block_size: int, dtype=jnp.float32,
                     tensor_scale=None) -> jnp.ndarray:
  """Inverse of :func:`block_quantize`: ``q * scale`` per block (times ``tensor_scale``).

  Exact in bfloat16 and float32 without ``tensor_scale`` (an fp8 value times a
  power of two; an e2m1 value, two significant bits, times an e4m3 scale, four:
  six bits), barring underflow below bfloat16's smallest subnormal.
  """
  s = jnp.repeat(scales.astype(dtype), block_size, axis=-1)
  out = q.astype(dtype) * s
  if tensor_scale is not None:
    out = (out.astype(jnp.float32) * jnp.reshape(tensor_scale, ())).astype(dtype)
  return out


def stochastic_round_e2m1(y: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
  """Rounds ``y`` (float32, within [-6, 6]) to an e2m1 value, up with the right odds.

  e2m1's non-negative values are 0, 0.5, ..., 2 (spacing 0.5), 3, 4 (spacing
  1) and 6. ``|y|`` between neighbours ``lo`` and ``hi`` becomes ``hi`` when
  ``u < (|y| - lo) / (hi - lo)``, so with ``u`` uniform on [0, 1) the
  expected result is ``y`` itself (unbiased), unlike round-to-nearest.
  The result is a float32 on the e2m1 grid (its cast is exact).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import block_numerics
    >>> block_numerics.stochastic_round_e2m1(jnp.array([2.25, 2.25, -5.0]),
    ...                                      jnp.array([0.2, 0.3, 0.4])).tolist()
    [3.0, 2.0, -6.0]
  """
  ay = jnp.abs(y)
  step = jnp.where(ay < 2.0, 0.5, jnp.where(ay < 4.0, 1.0, 2.0))
  lo = jnp.floor(ay / step) * step
  up = u < (ay - lo) / step
  r = jnp.minimum(jnp.where(up, lo + step, lo), E2M1_MAX)
  return jnp.where(jnp.isfinite(y), jnp.copysign(r, y), y)
