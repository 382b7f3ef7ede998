"""fp8 numerics per tensor (and per row): saturating casts, amax histories, scale selection.

Everything here is a ``jnp`` function with no autodiff rules, so it can be
tested against NumPy/ml_dtypes references and reused by every op. Two facts
of the trace reach it, both through :mod:`~fp8_linen.core.lowering`: the
backend a product is traced for (:func:`encode_fp8` encodes with integer
arithmetic on CPU, bit-identical to a cast) and, inside ``shard_map``, the
mesh axes a tensor varies over (an amax is max-reduced over them, so every
device picks the scale one device would). Block formats (MXFP8, NVFP4) are
in :mod:`~fp8_linen.core.block_numerics`; the per-tensor factor NVFP4 takes
from a role's scale is here (:func:`nvfp4_tensor_scale`).

Conventions (shared with ``flax.linen.fp8_ops`` and TransformerEngine):

* a *scale* ``s`` maps a tensor into the fp8 range: ``q = saturate(x / s)``
  and ``x ~= q * s``; scales are float32 arrays of shape ``(1,)``;
* an *amax history* is a float32 vector, index 0 the newest observation;
  ``0`` means "nothing observed" (an amax is never negative);
* a finite input never gives a non-finite scale: scales lie in
  ``[SCALE_FLOOR, SCALE_CEIL]`` and so does the product of two
  (:func:`scale_product`);
* finite values saturate at the format's largest value; NaN and ±Inf pass
  through a quantization as NaN (e4m3 has no Inf) or ±Inf, so a float layer's
  overflow still reaches the loss and ``optax.apply_if_finite`` can skip the
  step. Non-finite amaxes never enter a history.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import numerics
  >>> q = numerics.quantize(jnp.array([1.0, 1000.0]), jnp.float8_e4m3fn, jnp.ones((1,)))
  >>> numerics.dequantize(q, jnp.ones((1,)), jnp.float32).tolist()
  [1.0, 448.0]
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax
import numpy as np

from fp8_linen.core import lowering, settings
from fp8_linen.recipes.fp8 import ScalingConfig

__all__ = [
    "SCALE_FLOOR",
    "SCALE_CEIL",
    "pow2",
    "scale_product",
    "fp8_max",
    "amax",
    "finite_or_zero",
    "quantize",
    "encode_fp8",
    "decode_fp8",
    "dequantize",
    "qdq",
    "roll_history",
    "scale_from_amax",
    "select_scale",
    "history_amax",
    "step_scale",
    "histories_observed",
    "observed_histories",
    "quantize_with",
    "row_scale",
    "row_quantize",
    "saturate",
    "quantize_measured",
    "saturate_measured",
    "cast_apart_from_transpose",
    "E4M3_MAX",
    "nvfp4_tensor_scale",
]

# Smallest scale ever produced: 1/SCALE_FLOOR is finite in float32, so neither a
# zero nor a denormal amax can give an inf scale factor or a NaN product.
SCALE_FLOOR = float(np.finfo(np.float32).tiny)

# Largest scale ever produced: the largest power of two in float32, so a
# power-of-two scale stays one and ``x / s`` never overflows for finite ``x``.
SCALE_CEIL = 2.0 ** 127

# Largest finite float32: the cap on a product of scales.
_F32_MAX = float(np.finfo(np.float32).max)


def _per_tensor(scale) -> jnp.ndarray:
  """A ``(1,)`` per-tensor scale as a scalar (so it never changes ``x``'s shape)."""
  scale = jnp.asarray(scale, jnp.float32)
  return jnp.reshape(scale, ()) if scale.shape == (1,) else scale


def fp8_max(dtype) -> float:
  """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
  return float(ml_dtypes.finfo(dtype).max)


def pow2(e) -> jnp.ndarray:
  """``2**e`` in float32, exactly, for integer-valued ``e`` (clamped to [-126, 127]).

  Built from the exponent bits: XLA:CPU's ``exp2`` is an approximation
  (``exp2(-13.0)`` is off in the last bits), which would make a "power-of-two"
  scale introduce rounding error after all.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> numerics.pow2(jnp.array([-13.0, 0.0, 3.0])).tolist()
    [0.0001220703125, 1.0, 8.0]
  """
  e = jnp.clip(jnp.asarray(e, jnp.float32), -126.0, 127.0).astype(jnp.int32)
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def scale_product(*scales) -> jnp.ndarray:
  """The product of scales in float32, capped at the largest finite float32.

  Two scales near :data:`SCALE_CEIL` (a ``margin`` of 64, or amaxes near the
  float32 maximum) would multiply to Inf, and the output of a GEMM whose fp8
  operands underflowed to 0 would then be ``0 * Inf = NaN``. Scales are
  positive and finite, so the product is finite and positive (or 0 on
  underflow).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> bool(jnp.isfinite(numerics.scale_product(jnp.float32(2.0 ** 127), jnp.float32(4.0))))
    True
  """
  out = jnp.asarray(scales[0], jnp.float32)
  for s in scales[1:]:
    out = out * jnp.asarray(s, jnp.float32)
  return jnp.minimum(out, _F32_MAX)


def amax(x: jnp.ndarray, *, columns_first: bool = False, weight: bool = False) -> jnp.ndarray:
  """``max(|x|)`` over all elements, as a float32 scalar (NaN if any is NaN).

  An empty ``x`` has amax 0 ("nothing observed").

  Never written with ``abs``: XLA:GPU fuses a ``max(|y|)`` of an fp8 GEMM's
  output ``y`` into the cuBLASLt call as a second output, and when ``y`` is
  then quantized with a scale computed from that amax (a gradient fed to the
  next fp8 GEMM) the fused call depends on itself and compilation fails
  ("cycle detected"). It is one *max* reduction of ``maximum(x, -x)``: over a
  sharded ``x`` that is one max all-reduce, and XLA's all-reduce combiner
  merges all-reduces of one kind that do not depend on each other, so the
  amaxes of a whole step that only feed its new state share one collective.
  On a GPU or a CPU one reduction is fewer kernels than two: two max
  reductions (``max(x)`` and ``max(-x)``) each took a kernel to finish and
  a third to combine them (the README's decoder block, H100, d_model 1024,
  compile only: 239 -> 234 kernels, the step estimate 1.05 -> 1.03x
  bf16's). Besides an output gradient's (below), two keep the two
  reductions: on a TPU, where XLA joins
  them into their producers better (TPU7x, the same block: 5% fewer
  non-GEMM bytes), and a weight's (``weight=True``), whose single reduction
  XLA:GPU took into Adam's update, which then copied the donated weight
  (``test_steady_weight_amax_stays_out_of_the_optimizer_update``).

  ``columns_first=True`` (an output gradient) reduces the leading axes
  first, then the last, in the two-reduction form: a bias gradient reduces
  the same axes of the same cotangent, and XLA computes both in one pass over
  it (a multi-output reduction) instead of reading the cotangent twice; with
  ``maximum(x, -x)`` it cast the cotangent apart (B200, TE's dense layer:
  1.10 -> 1.32x bf16's non-GEMM bytes). Over a batch-sharded tensor its
  all-reduce then carries one value per column instead of one scalar, so the
  other roles reduce everything at once.
  """
  x = jnp.asarray(x)
  if x.size == 0:  # an empty batch: max() of nothing would raise
    return jnp.zeros((), jnp.float32)
  if columns_first and x.ndim >= 2:
    # (No reshape: merging a sharded axis would make the partitioner gather x.)
    lead = tuple(range(x.ndim - 1))
    return jnp.max(jnp.maximum(jnp.max(x, axis=lead), jnp.max(-x, axis=lead))).astype(jnp.float32)
  if weight or lowering.current_backend() == "tpu":
    return jnp.maximum(jnp.max(x), jnp.max(-x)).astype(jnp.float32)
  return jnp.max(jnp.maximum(x, -x)).astype(jnp.float32)


def finite_or_zero(a: jnp.ndarray) -> jnp.ndarray:
  """Maps a non-finite amax to 0, the "nothing observed" value of a history."""
  return jnp.where(jnp.isfinite(a), a, jnp.zeros_like(a))


def quantize(x: jnp.ndarray, dtype, scale: jnp.ndarray) -> jnp.ndarray:
  """Saturating cast of ``x / scale`` to the fp8 ``dtype``.

  Finite values beyond the format's range are clamped to ``±fp8_max``; NaN
  stays NaN and ±Inf stays ±Inf where the format has it (NaN in e4m3fn and the
  fnuz formats), so a non-finite input is never hidden by saturation. The
  division runs in float32.

  Args:
    x: any floating array.
    dtype: the fp8 dtype to produce.
    scale: a float32 array broadcastable against ``x`` (usually shape ``(1,)``).

  Returns:
    ``x / scale`` rounded to nearest-even in ``dtype``.
  """
  return encode_fp8(saturate(jnp.asarray(x).astype(jnp.float32), _per_tensor(scale),
                              fp8_max(dtype)), dtype)


def quantize_measured(x: jnp.ndarray, dtype, scale: jnp.ndarray, a: jnp.ndarray) -> jnp.ndarray:
  """:func:`quantize` for a tensor whose amax ``a`` the scale was chosen from.

  A finite ``a`` says every element is finite, so a plain clamp saturates
  and no element needs its own finite check; a non-finite ``a`` (a NaN or
  Inf anywhere in ``x``) makes every code NaN. Bit-identical to
  :func:`quantize` for a finite tensor. The per-element check would be a
  pass of its own where the cast writes transposed codes (XLA:GPU computes
  the mask apart and reads it back), and the cast waits for ``a`` anyway.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> x = jnp.array([1.0, 1000.0])
    >>> numerics.quantize_measured(x, jnp.float8_e4m3fn, jnp.ones((1,)), numerics.amax(x)).tolist()
    [1.0, 448.0]
  """
  return encode_fp8(saturate_measured(jnp.asarray(x).astype(jnp.float32), _per_tensor(scale),
                                      fp8_max(dtype), a), dtype)


def saturate_measured(x32, scale, m, a):
  """``clip(x / scale, -m, m)`` where the amax ``a`` (broadcastable: a block's) is finite, else NaN.

  The finite check is on ``a``, one value per tensor or block, not on each
  element (see :func:`quantize_measured`).
  """
  # A select on the amax, not an add of NaN-or-0 (which would turn -0 into +0).
  ok = jnp.isfinite(jnp.asarray(a, jnp.float32))
  return jnp.where(ok, jnp.clip(x32 / scale, -m, m), jnp.nan)


def saturate(x32, scale, m):
  """``clip(x / scale, -m, m)`` for finite ``x``; non-finite ``x`` passes unchanged."""
  y = jnp.clip(x32 / scale, -m, m)
  return jnp.where(jnp.isfinite(x32), y, x32)


# (mantissa bits, exponent bias, NaN code, Inf code or None) of the formats
# with an integer encoder.
_ENCODERS = {np.dtype(ml_dtypes.float8_e4m3fn): (3, 7, 0x7F, None),
             np.dtype(ml_dtypes.float8_e5m2): (2, 15, 0x7E, 0x7C)}


# Jitted (here and on the helpers below): a step traces it once per shape and
# config instead of once per call, and lowers it once per program (XLA
# inlines it, so the compiled program is unchanged).
@functools.partial(jax.jit, static_argnums=(1,))
def encode_fp8(y: jnp.ndarray, dtype) -> jnp.ndarray:
  """Rounds float32 ``y`` (finite values within the format's range) to fp8, nearest-even.

  On CPU, e4m3fn and e5m2 are encoded with integer arithmetic on the float32
  bits, which XLA vectorizes (its own conversion is about twice as slow there);
  the result is bit-identical to ``y.astype(dtype)``, NaN and ±Inf included
  (Inf becomes NaN in e4m3fn, which has no Inf). Elsewhere
  (GPUs convert natively) and for the fnuz formats it is ``y.astype(dtype)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> numerics.encode_fp8(jnp.array([0.3, 17.0, -448.0]), jnp.float8_e4m3fn).tolist()
    [0.3125, 16.0, -448.0]
  """
  spec = _ENCODERS.get(np.dtype(dtype))
  if spec is None or lowering.current_backend() != "cpu":
    return y.astype(dtype)
  mant, bias, nan_code, inf_code = spec
  drop = 23 - mant
  bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32)
  sign = (bits >> 31).astype(jnp.uint8) << 7
  a_bits = bits & jnp.uint32(0x7FFFFFFF)
  a = lax.bitcast_convert_type(a_bits, jnp.float32)
  # Normal range: round the float32 mantissa to `mant` bits (nearest-even) and
  # re-bias the exponent; a carry into the exponent is the correct rounding.
  rounded = a_bits + (jnp.uint32((1 << (drop - 1)) - 1) + ((a_bits >> drop) & 1))
  normal = ((rounded >> drop) - jnp.uint32((127 - bias) << mant)).astype(jnp.uint8)
  # Subnormal range: multiples of 2**(1 - bias - mant); rint rounds half to even.
  min_normal = 2.0 ** (1 - bias)
  sub = jnp.rint(a * 2.0 ** (bias - 1 + mant)).astype(jnp.uint8)
  code = jnp.where(a < min_normal, sub, normal) | sign
  # A format without Inf encodes it as NaN, as a cast does.
  inf = nan_code if inf_code is None else inf_code
  code = jnp.where(jnp.isinf(y), jnp.uint8(inf) | sign, code)
  code = jnp.where(jnp.isnan(y), jnp.uint8(nan_code) | sign, code)
  return lax.bitcast_convert_type(code, dtype)


def decode_fp8(q: jnp.ndarray) -> jnp.ndarray:
  """The float32 values of fp8 codes ``q`` (e4m3fn or e5m2), computed from their bits.

  Equal to ``q.astype(jnp.float32)``, but XLA:GPU cannot drop it: with
  excess precision allowed (its default) it removes a ``convert`` to a
  narrow float followed by a ``convert`` back, so ``x.astype(e4m3).astype(f32)``
  compiles to ``x`` there and a fake quantization would silently run in
  float. Codes read through their bits keep the rounding on every backend.
  Other dtypes fall back to ``astype``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> numerics.decode_fp8(jnp.array([0.3, -448.0, 2.0 ** -9], jnp.float8_e4m3fn)).tolist()
    [0.3125, -448.0, 0.001953125]
  """
  spec = _ENCODERS.get(np.dtype(q.dtype))
  if spec is None:
    return q.astype(jnp.float32)
  mant, bias, nan_code, inf_code = spec
  b = lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
  mag = b & 0x7F
  e, m = mag >> mant, mag & ((1 << mant) - 1)
  # Normal: (2**mant + m) * 2**(e - bias - mant); subnormal (e == 0): m * 2**(1 - bias - mant).
  normal = (m + (1 << mant)).astype(jnp.float32) * pow2(e - bias - mant)
  value = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(2.0 ** (1 - bias - mant)), normal)
  if inf_code is None:
    value = jnp.where(mag == nan_code, jnp.nan, value)
  else:
    value = jnp.where(mag == inf_code, jnp.inf, jnp.where(mag > inf_code, jnp.nan, value))
  return jnp.where(b >= 0x80, -value, value)


def dequantize(q: jnp.ndarray, scale: jnp.ndarray, dtype, *, exact: bool = False) -> jnp.ndarray:
  """``q * scale`` computed in float32, returned in ``dtype``.

  ``exact=True`` reads the codes through their bits (:func:`decode_fp8`), so
  XLA:GPU cannot fold the rounding away; the default keeps the plain cast,
  the pattern XLA:GPU turns into an fp8 GEMM when the value feeds a dot.
  """
  values = decode_fp8(q) if exact else q.astype(jnp.float32)
  return (values * _per_tensor(scale)).astype(dtype)


def qdq(x: jnp.ndarray, dtype, scale: jnp.ndarray) -> jnp.ndarray:
  """Quantize then dequantize (fake quantization), result in ``x.dtype``.

  The codes are read exactly (``dequantize(..., exact=True)``): a fake
  quantization feeds no fp8 GEMM, and XLA:GPU would drop a plain cast pair.
  """
  return dequantize(quantize(x, dtype, scale), scale, x.dtype, exact=True)


def roll_history(history: jnp.ndarray, new_amax: jnp.ndarray) -> jnp.ndarray:
  """Advances an amax history by one step; index 0 becomes ``new_amax``.

  A non-finite ``new_amax`` (from a NaN/Inf batch) is recorded as 0 ("nothing
  observed"), so it can never reach a later scale.

  A roll and an update of element 0, which XLA does in place. Written as one
  select over the shifted history (or one concatenation) it took a GPU
  kernel less per role, but XLA:GPU then kept a data-parallel step's state
  all-reduces apart (one per layer instead of two in all,
  ``tests/test_collectives.py``) and laid out Adam's update of a cached
  window's weights transposed (``tests/test_window_cache.py``); so did
  updating a layer's roles as one stacked array.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> numerics.roll_history(jnp.array([3.0, 2.0, 1.0]), jnp.float32(4.0)).tolist()
    [4.0, 3.0, 2.0]
  """
  new_amax = finite_or_zero(jnp.asarray(new_amax, jnp.float32))
  return jnp.roll(history, 1, axis=0).at[0].set(new_amax)


@functools.partial(jax.jit, static_argnums=(2,))
def scale_from_amax(a: jnp.ndarray, prev_scale: jnp.ndarray, cfg: ScalingConfig) -> jnp.ndarray:
  """The scale that maps amax ``a`` to the fp8 maximum (with margin).

  Falls back to ``prev_scale`` when ``a`` is zero, negative or not finite, and
  always returns a value in ``[SCALE_FLOOR, SCALE_CEIL]`` (a finite amax never
  gives a non-finite scale, whatever the margin). A non-finite or
  non-positive ``prev_scale`` is itself replaced by 1.

  Args:
    a: float32 amax, any shape broadcastable against ``prev_scale``.
    prev_scale: the scale to keep when ``a`` carries no information.
    cfg: the role's :class:`~fp8_linen.ScalingConfig`.

  Returns:
    float32 scale with the broadcast shape of ``a`` and ``prev_scale``.
  """
  a = jnp.asarray(a, jnp.float32)
  prev = jnp.asarray(prev_scale, jnp.float32)
  prev = jnp.where(jnp.isfinite(prev) & (prev > 0), prev, jnp.ones_like(prev))
  prev = jnp.clip(prev, SCALE_FLOOR, SCALE_CEIL)
  # Divide first: ``a * 2**margin`` overflows for amaxes near the float32 max
  # (multiplying by a power of two is exact, so the order changes nothing else).
  s = (a / cfg.fp8_max) * (2.0 ** cfg.margin)
  if cfg.power_of_two:
    # Round up: a power-of-two scale that is never smaller than the exact one.
    s = pow2(jnp.ceil(jnp.log2(jnp.clip(s, SCALE_FLOOR, SCALE_CEIL))))
  s = jnp.clip(s, SCALE_FLOOR, SCALE_CEIL)
  ok = jnp.isfinite(a) & (a > 0)
  return jnp.where(ok, s, prev)


@functools.partial(jax.jit, static_argnums=(0,))
def select_scale(cfg: ScalingConfig, prev_scale: jnp.ndarray, history: jnp.ndarray,
                 current_amax: jnp.ndarray) -> jnp.ndarray:
  """The scale to quantize with at this step.

  ``'current'`` scaling uses ``current_amax``. ``'delayed'`` scaling uses the
  history (``max`` or ``most_recent``); when the history holds no observation
  yet (its amax is 0, e.g. on the first step) it uses ``current_amax`` instead,
  so the first step never clips (a scale of 1 would clip a gradient of 1000 to
  448).

  Args:
    cfg: the role's scaling config.
    prev_scale: the stored scale, shape ``(1,)``; kept when no amax is usable.
    history: the stored amax history, shape ``(L,)``.
    current_amax: this step's amax (float32 scalar).

  Returns:
    float32 scale of shape ``(1,)``.
  """
  cur = jnp.reshape(jnp.asarray(current_amax, jnp.float32), (1,))
  if cfg.scaling == "current":
    a = cur
  else:
    h = history_amax(cfg, history)
    a = jnp.where(h > 0, h, cur)
  return scale_from_amax(a, prev_scale, cfg)


# ----------------------------------------------------------------------------
# Finer fp8 granularity: per-row scales (MX and NVFP4 blocks: core/block_numerics.py).
# ----------------------------------------------------------------------------


def row_scale(x: jnp.ndarray, axes, cfg: ScalingConfig) -> jnp.ndarray:
  """Current scales of ``x`` with one scale per slice along ``axes``.

  ``axes`` are reduced (kept with size 1): the scale of a row of an activation
  (reduce the contracting axes) or of an output channel of a weight. A zero
  row gets scale 1 (any scale represents zeros exactly).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import recipes
    >>> from fp8_linen.core import numerics
    >>> cfg = recipes.ScalingConfig(scaling='current')
    >>> numerics.row_scale(jnp.array([[448.0, 1.0], [0.0, 0.0]]), (1,), cfg).tolist()
    [[1.0], [1.0]]
  """
  a = jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True).astype(jnp.float32)
  return scale_from_amax(a, jnp.ones_like(a), cfg)


def row_quantize(x: jnp.ndarray, axes, cfg: ScalingConfig):
  """``(q, s, a)``: ``x`` in ``cfg``'s fp8 format with one current scale per slice along ``axes``.

  The scales of :func:`row_scale`; each slice is cast as
  :func:`quantize_measured` casts a tensor (its amax says whether it is
  finite: a slice holding a NaN or Inf becomes NaN codes). ``a`` is the
  amax of all of ``x`` (float32 scalar), the largest of the slices' amaxes.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import recipes
    >>> from fp8_linen.core import numerics
    >>> q, s, a = numerics.row_quantize(jnp.array([[896.0, 1.0], [3.0, 0.0]]), (1,),
    ...                                 recipes.ScalingConfig(scaling='current'))
    >>> q.astype(jnp.float32).tolist(), s.tolist(), float(a)
    ([[448.0, 0.5], [448.0, 0.0]], [[2.0], [0.0066964291036129]], 896.0)
  """
  x32 = jnp.asarray(x).astype(jnp.float32)
  a = jnp.max(jnp.abs(x32), axis=tuple(axes), keepdims=True)
  s = scale_from_amax(a, jnp.ones_like(a), cfg)
  q = encode_fp8(saturate_measured(x32, s, fp8_max(cfg.jnp_dtype), a), cfg.jnp_dtype)
  return q, s, (jnp.max(a) if a.size else jnp.zeros((), jnp.float32))


def history_amax(cfg: ScalingConfig, history: jnp.ndarray) -> jnp.ndarray:
  """The amax a delayed scale is taken from: ``(1,)``, 0 when the history has none."""
  if cfg.amax_compute_algo == "most_recent":
    return history[:1]
  return jnp.max(history, keepdims=True)


def step_scale(cfg: ScalingConfig, prev_scale: jnp.ndarray, history: jnp.ndarray,
               x: jnp.ndarray) -> jnp.ndarray:
  """The scale ``x`` is quantized with at this step: :func:`select_scale` of its amax.

  Equal to ``select_scale(cfg, prev_scale, history, global amax of x)``, but a
  delayed scale does not wait for ``x``'s amax when the history answers. On a
  mesh that amax is a reduction over every shard (an all-reduce): with
  ``jnp.where(history > 0, history, amax)`` it would sit between every
  quantization and its GEMM in every step, although only a step whose
  history is empty (the first one) reads it. A ``lax.cond`` on the history
  (replicated, so every device takes the same branch) runs the reduction in
  that step only; the amax that feeds the new state is computed apart
  (:func:`quantize_with`) and feeds nothing else, so XLA can defer it and
  merge it with every other one of the step.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> from fp8_linen.recipes import ScalingConfig
    >>> x = jnp.array([4.0, -1792.0])
    >>> numerics.step_scale(ScalingConfig(), jnp.ones((1,)), jnp.array([896.0, 0.0]), x).tolist()
    [2.0]
    >>> numerics.step_scale(ScalingConfig(), jnp.ones((1,)), jnp.zeros((2,)), x).tolist()
    [4.0]
  """
  def current():
    a = jnp.reshape(lowering.global_max(amax(x)), (1,))
    return scale_from_amax(a, prev_scale, cfg)

  def first_step():
    # XLA turns a conditional whose branches are all reductions and
    # elementwise ops into a select of both (ConditionalSimplifier), which
    # would run the reduction in every step again; an optimization barrier
    # counts as an expensive op there, and once the mesh is partitioned the
    # branch holds its all-reduce, which keeps the conditional for good.
    return lax.optimization_barrier(current())

  if cfg.scaling == "current":
    return current()
  h = history_amax(cfg, history)
  if lowering.varying_axes(h) or lowering.varying_axes(prev_scale):
    # Per-device state (shard_map with state that varies): devices may take
    # different branches, and a branch with a collective must not diverge.
    return select_scale(cfg, prev_scale, history, lowering.global_max(amax(x)))
  return lax.cond(h[0] > 0, lambda: scale_from_amax(h, prev_scale, cfg), first_step)


_OBSERVED = settings.TraceSetting("histories_observed", default=False)


@contextlib.contextmanager
def histories_observed():
  """While tracing: every delayed-scaling history holds an observation.

  :func:`fp8_linen.split_first_step` traces its steady branch in this block,
  the branch it runs once every ``<role>_amax_history`` of the step's
  arguments has a nonzero most recent amax. There a delayed role's scale is
  its history's, so the first-step fallback to this step's amax
  (:func:`select_scale`) is left out of the program: a cast no longer waits
  for its tensor's amax, nor reads the tensor in a conditional
  (:func:`quantize_with`). A history without an observation traced here
  would give the stored scale, not this step's amax: only
  ``split_first_step`` should enter this block.

  Example:
    >>> from fp8_linen.core import numerics
    >>> with numerics.histories_observed():
    ...   numerics.observed_histories()
    True
  """
  with _OBSERVED.set(True):
    yield


def observed_histories() -> bool:
  """Whether :func:`histories_observed` is in force while tracing."""
  return _OBSERVED.get()


def cast_apart_from_transpose(q: jnp.ndarray, a: jnp.ndarray, *, flat: bool = False):
  """``(q, a)`` behind an optimization barrier: codes written in their cast's own layout.

  For XLA:GPU's fp8 GEMMs that take both operands K-major (H100), a cast
  whose codes one GEMM reads transposed is otherwise compiled as a transpose
  fusion, which no reduction joins: the amax, the bias gradient's sum and a
  loss that read the same input then read it again (or a bfloat16 copy
  written for them). Behind the barrier XLA casts in the input's layout, in
  one pass with those reductions, and makes the other layout by transposing
  the 1-byte codes.

  The amax ``a`` passes the barrier with the codes, so the products wait for
  it: otherwise XLA may compute it in the optimizer's update (another
  reader of a weight), a reduction whose output then cannot overwrite the
  donated weight, so XLA copies the weight. ``flat=True`` (a weight) passes
  the codes flattened: XLA:GPU would still lay a weight's codes out
  transposed for the forward GEMM, and a 1-D array has one layout only.
  (Flattening merges axes, so it is not for a tensor sharded over a mesh.)

  Only for a cast that waits for nothing (a delayed scale read from the
  history): a cast that waits for its own amax reads its input twice
  anyway, and the barrier only adds the transpose. Values are unchanged.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> q = jnp.ones((2, 2), jnp.float8_e4m3fn)
    >>> q2, a = numerics.cast_apart_from_transpose(q, jnp.float32(1.0), flat=True)
    >>> bool((q2 == q).all()), q2.shape, float(a)
    (True, (2, 2), 1.0)
  """
  if not flat:
    return lax.optimization_barrier((q, a))
  codes, a = lax.optimization_barrier((q.reshape(-1), a))
  return codes.reshape(q.shape), a


def quantize_with(cfg: ScalingConfig, scale: jnp.ndarray, history: jnp.ndarray, x: jnp.ndarray,
                  *, weight: bool = False, gradient: bool = False, barrier: bool = True):
  """Quantizes ``x`` as ``cfg`` says, from a role's stored state.

  The one place a tensor (operand or gradient) is measured, scaled and cast:
  ``a = amax(x)`` (the global amax inside ``shard_map``), ``s =
  select_scale(cfg, scale, history, a)`` (computed by :func:`step_scale`,
  which reads ``a`` only where the scale needs it), ``q = quantize(x, cfg's
  dtype, s)``.

  How the step is shaped, for the passes around the GEMMs (the codes are
  the same either way):

  * On GPU, a scale waits for its tensor's amax (``select_scale`` of ``a``,
    not a ``lax.cond`` on the history) for a weight, and for an activation
    or a gradient traced on one device. A conditional's operand is a
    buffer, so the cond makes XLA:GPU write a copy of the tensor every step
    only for the first-step branch to read, where the producer would
    otherwise fuse into the cast; waiting for the amax instead costs a
    second read of the producer's inputs, which the amax shares with the
    bias gradient's sum (decoder block, H100, compile only: 1.16 / 1.22 /
    1.19x bf16's non-GEMM bytes at d_model 1024 / 4096 / 8192 with the
    cond, 1.09 / 1.16 / 1.12x with the select). A producer that is a cast
    from float32 (a loss's cotangent) is the exception: XLA:GPU writes a
    bfloat16 copy for the amax and the cast reads the float32 again
    (docs/accelerators.md). Activations and gradients on a mesh keep the
    cond: there the amax is an all-reduce that would sit between the cast
    and its GEMM in every step. XLA:TPU fuses the cast into the GEMM's
    operand instead, and there the cond is the cheaper form.
  * A weight whose scale waits for ``a`` (current scaling, or delayed on
    GPU) is cast by :func:`quantize_measured`: no finite check per element
    (a non-finite weight gives NaN codes). Activations and gradients keep
    the per-element check, so a NaN or Inf stays in its own row of the
    output, as in a float layer.
  * ``gradient=True`` (an output gradient): its amax is taken
    ``columns_first`` (:func:`amax`), beside the bias gradient's sum.
  * Under :func:`histories_observed` (the steady branch of
    :func:`fp8_linen.split_first_step`) a delayed scale is the history's
    alone, and the cast waits for nothing, so XLA computes the amax in the
    cast's pass (on B200, TE's dense layer, compile only: 0.96x bf16's
    non-GEMM bytes instead of 1.32x). On a GPU whose fp8 GEMMs take both
    operands K-major (no block-scaled GEMMs: H100) XLA would cast with a
    transpose, which no reduction joins; there the codes pass
    :func:`cast_apart_from_transpose`, so each tensor is cast in its own
    layout beside its amax (and the bias gradient's sum) and its codes are
    transposed (H100, TE's layer, compile only: 1.45x -> 1.16x bf16's
    non-GEMM bytes). There a weight on a mesh keeps the amax-measured cast
    (its codes would be flattened). On any GPU a weight's codes and amax
    pass the barrier (unflattened where the GEMMs are block-scaled: B200),
    so the amax is taken in the cast's pass, not in the optimizer's update
    (which then copies the donated weight: B200, TE's layer with Adam, 1.04x
    -> 0.91x). ``barrier=False`` (a convolution's kernel) keeps the cast out
    of all this: with its codes flattened XLA:GPU ran a convolution in
    float32. A weight cast per element differs from a measured one only
    when the weight is not finite.

  Returns:
    ``(q, s, a)``: the fp8 tensor, the scale used and the observed amax.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import numerics
    >>> from fp8_linen.recipes import ScalingConfig
    >>> q, s, a = numerics.quantize_with(ScalingConfig(), jnp.ones((1,)), jnp.zeros((4,)),
    ...                                  jnp.array([896.0]))
    >>> float(a), s.tolist()
    (896.0, [2.0])
  """
  gpu = lowering.current_backend() == "gpu"
  waits = cfg.scaling == "current" or (gpu and (weight or not lowering.on_mesh(x)))
  # Inside shard_map every device must pick the scale one device would.
  a = lowering.global_max(amax(x, columns_first=gradient, weight=weight))
  if cfg.scaling == "delayed" and _OBSERVED.get():
    s = scale_from_amax(history_amax(cfg, history), scale, cfg)
    k_major = gpu and not lowering.block_scaled_gemms()
    if k_major and weight and (not barrier or lowering.on_mesh(x)):
      return quantize_measured(x, cfg.jnp_dtype, s, a), s, a
    if (k_major or (gpu and weight)) and barrier:
      q, a = cast_apart_from_transpose(quantize(x, cfg.jnp_dtype, s), a,
                                       flat=k_major and weight)
      return q, s, a
    return quantize(x, cfg.jnp_dtype, s), s, a
  if waits:
    s = select_scale(cfg, scale, history, a)
    # A weight's NaN poisons every output anyway; an activation's must stay in
    # its own row, as in a float layer, so activations keep the per-element check.
    q = quantize_measured(x, cfg.jnp_dtype, s, a) if weight else quantize(x, cfg.jnp_dtype, s)
    return q, s, a
  s = step_scale(cfg, scale, history, x)
  return quantize(x, cfg.jnp_dtype, s), s, a


# ----------------------------------------------------------------------------
# NVFP4's per-tensor factor (its block scales: core/block_numerics.py).
# ----------------------------------------------------------------------------

E4M3_MAX = 448.0
"""Largest float8_e4m3fn value (NVFP4's block scales)."""


def nvfp4_tensor_scale(scale) -> jnp.ndarray:
  """NVFP4's per-tensor factor (float32 scalar) from a role's stored scale.

  A role's :class:`~fp8_linen.ScalingConfig` with e2m1 elements chooses
  ``scale = amax / 6`` (like any role: its amax maps to the format's largest
  value). The blocks' e4m3 scales carry up to 448 of that range, so the
  tensor factor is ``scale / 448``: a block as large as the tensor's amax
  gets block scale 448.
  """
  return jnp.reshape(jnp.asarray(scale, jnp.float32), ()) / E4M3_MAX
