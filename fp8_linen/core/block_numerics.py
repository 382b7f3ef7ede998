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

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from fp8_linen.core import lowering
from fp8_linen.core.numerics import (E4M3_MAX, SCALE_FLOOR, decode_fp8, fp8_max, pow2,
                                     saturate_measured)

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
    "e2m1_codes",
    "e2m1_round",
    "code_values",
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

  ``scale = 2**e`` with ``e = ceil(log2(a / m))`` clamped to [-126, 127], so
  no element exceeds ``m`` after division; a zero or non-finite amax gets
  ``e = 0``. ``e`` is int32: ``e + 127`` is the scale's ``float8_e8m0fnu``
  bit pattern.

  ``e`` is read off the exponent and mantissa bits of ``a`` and ``m``, with no
  division or logarithm: XLA:GPU computes ``log2(a / m)`` as ``log(a * (1 /
  m)) * (1 / ln 2)``, which misses the integer when ``a / m`` is a power of
  two and doubles that block's scale (seen on an H200), and the backends'
  logarithms differ in their last bits. Bits give the same exponent on every
  backend and in the Pallas kernels.
  """
  a = jnp.asarray(a, jnp.float32)
  # a / m = (1.fa / 1.fm) * 2**(ea - em): a power of two when the mantissas
  # are equal, else one more than ea - em when a's mantissa is the larger.
  frac, ex = math.frexp(float(m))
  em, fm = ex - 1, int(round((frac * 2.0 - 1.0) * 2.0 ** 23))
  bits = lax.bitcast_convert_type(jnp.maximum(a, SCALE_FLOOR), jnp.int32)  # a normal float
  ea, fa = (bits >> 23) - 127, bits & 0x7FFFFF
  e = ea - em + (fa > fm).astype(jnp.int32)
  e = jnp.where(jnp.isfinite(a) & (a > 0), e, 0)
  e = jnp.clip(e, -126, 127)
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
  s = jnp.repeat(code_values(scales).astype(dtype), block_size, axis=axis)
  s = lax_slice_axis(s, axis, q.shape[axis])
  return code_values(q).astype(dtype) * s


def _blocks(x, block_size: int, rows: int):
  """``x`` (..., R, C) as (..., R / rows, rows, C / block_size, block_size)."""
  *lead, r, c = x.shape
  return x.reshape(*lead, r // rows, rows, c // block_size, block_size)


# Jitted: traced once per shape and format, not once per call (see numerics.encode_fp8).
@functools.partial(jax.jit, static_argnames=("block_size", "dtype", "tile", "four_over_six"))
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
      err6 = jnp.sum(jnp.square(e2m1_round(y) * den - xb), axis=(-3, -1), keepdims=True)
      err4 = jnp.sum(jnp.square(e2m1_round(y4) * den4 - xb), axis=(-3, -1), keepdims=True)
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
  # The stored scale's value read from its bits: XLA:GPU would otherwise
  # divide by the unrounded ``d`` (see numerics.decode_fp8), and the codes
  # would not match the scale the GEMM multiplies them by.
  den = decode_fp8(stored) * g
  y = jnp.clip(jnp.where(den > 0, xb / jnp.where(den > 0, den, 1.0), 0.0),
               -E2M1_MAX, E2M1_MAX)
  return stored, den, y


def _signed_like(r, y):
  """``r`` (>= 0, float32) with the sign bit of ``y``; -0.0 stays -0.0.

  From the bits: a Pallas kernel compiled by Triton turned ``copysign(0.0,
  y < 0)`` into +0.0 (seen on an H200), where XLA gives -0.0.
  """
  sign = lax.bitcast_convert_type(jnp.asarray(y, jnp.float32), jnp.uint32) & np.uint32(0x80000000)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(r, jnp.uint32) | sign, jnp.float32)


def _e2m1_magnitude(mag):
  """``mag`` (>= 0, float32) rounded to nearest-even on e2m1's grid, saturating at 6."""
  # e2m1's spacing is 0.5 below 2, 1 up to 4, 2 up to 6. Round half to even by
  # hand (Triton has no round): v / step is a small multiple of 1/2**k, exact.
  step = jnp.where(mag < 2.0, 0.5, jnp.where(mag < 4.0, 1.0, 2.0))
  v = mag / step
  low = jnp.floor(v)
  odd = low - 2.0 * jnp.floor(low * 0.5)
  up = (v - low > 0.5) | ((v - low == 0.5) & (odd == 1.0))
  return jnp.minimum(jnp.where(up, low + 1.0, low) * step, E2M1_MAX)


def e2m1_round(y: jnp.ndarray) -> jnp.ndarray:
  """``y`` (float32) rounded to nearest-even in e2m1, as float32 (saturating at 6).

  The values of ``y.astype(jnp.float4_e2m1fn)``, computed in float32 arithmetic:
  XLA:GPU drops a cast to a narrow float followed by a cast back (see
  :func:`~fp8_linen.core.numerics.decode_fp8`).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import block_numerics
    >>> block_numerics.e2m1_round(jnp.array([0.25, 0.75, 2.5, -5.0, 9.0])).tolist()
    [0.0, 1.0, 2.0, -4.0, 6.0]
  """
  y = jnp.asarray(y, jnp.float32)
  return _signed_like(_e2m1_magnitude(jnp.abs(y)), y)


def e2m1_codes(y: jnp.ndarray) -> jnp.ndarray:
  """The 4-bit e2m1 code (uint8, 0..15) of each float32 ``y``, rounded to nearest even.

  ``y`` within [-6, 6] (larger magnitudes saturate to 6). Integer arithmetic
  only, so it runs where ``float4_e2m1fn`` does not exist (Triton); equal to
  the bits of ``y.astype(jnp.float4_e2m1fn)`` (tested).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import block_numerics
    >>> block_numerics.e2m1_codes(jnp.array([0.25, 0.75, 2.5, -5.0, -0.0])).tolist()
    [0, 2, 4, 14, 8]
  """
  y = jnp.asarray(y, jnp.float32)
  r = _e2m1_magnitude(jnp.abs(y))
  code = jnp.where(r < 2.0, r * 2.0, jnp.where(r < 4.0, r + 2.0, r * 0.5 + 4.0))
  sign = jnp.where(lax.bitcast_convert_type(y, jnp.int32) < 0, 8, 0)
  return (code.astype(jnp.int32) | sign).astype(jnp.uint8)


# Jitted: traced once per shape, not once per call (see numerics.encode_fp8).
@jax.jit
def code_values(q: jnp.ndarray) -> jnp.ndarray:
  """The float32 values of block codes or scales (fp8, ``float4_e2m1fn``, ``float8_e8m0fnu``).

  Read from their bits, so the rounding they carry survives XLA:GPU (see
  :func:`~fp8_linen.core.numerics.decode_fp8`); other dtypes are cast.
  """
  dt = np.dtype(q.dtype)
  if dt == _E2M1:
    c = lax.bitcast_convert_type(q, jnp.uint4).astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    # Normal: (2 + m) * 2**(e - 2); subnormal (e == 0): m / 2.
    mag = jnp.where(e == 0, m.astype(jnp.float32) * 0.5, (m + 2).astype(jnp.float32) * pow2(e - 2))
    return jnp.where(c >= 8, -mag, mag)
  if dt == np.dtype(ml_dtypes.float8_e8m0fnu):
    b = lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
    # pow2 stops at 2**-126 (the smallest normal float32); code 0 is 2**-127.
    value = jnp.where(b == 0, np.float32(2.0 ** -127), pow2(b - 127))
    return jnp.where(b == 255, jnp.nan, value)
  return decode_fp8(q)


@functools.partial(jax.jit, static_argnums=(2, 3))
def block_dequantize(q: jnp.ndarray, scales: jnp.ndarray, block_size: int, dtype=jnp.float32,
                     tensor_scale=None) -> jnp.ndarray:
  """Inverse of :func:`block_quantize`: ``q * scale`` per block (times ``tensor_scale``).

  Exact in bfloat16 and float32 without ``tensor_scale`` (an fp8 value times a
  power of two; an e2m1 value, two significant bits, times an e4m3 scale, four:
  six bits), barring underflow below bfloat16's smallest subnormal.
  """
  s = jnp.repeat(code_values(scales).astype(dtype), block_size, axis=-1)
  out = code_values(q).astype(dtype) * s
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
  return jnp.where(jnp.isfinite(y), _signed_like(r, y), y)
