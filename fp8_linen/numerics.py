"""Pure fp8 numerics: saturating casts, amax bookkeeping and scale selection.

Everything here is a plain ``jnp`` function with no autodiff rules, so it can
be tested against NumPy/ml_dtypes references and reused by every op.

Conventions (shared with ``flax.linen.fp8_ops`` and TransformerEngine):

* a *scale* ``s`` maps a tensor into the fp8 range: ``q = saturate(x / s)``
  and ``x ~= q * s``; scales are float32 arrays of shape ``(1,)``;
* an *amax history* is a float32 vector, index 0 the newest observation;
  ``0`` means "nothing observed" (an amax is never negative).

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen import numerics
  >>> q = numerics.quantize(jnp.array([1.0, 1000.0]), jnp.float8_e4m3fn, jnp.ones((1,)))
  >>> numerics.dequantize(q, jnp.ones((1,)), jnp.float32).tolist()
  [1.0, 448.0]
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8_linen.recipes import ScalingConfig

__all__ = [
    "SCALE_FLOOR",
    "fp8_max",
    "amax",
    "finite_or_zero",
    "quantize",
    "dequantize",
    "qdq",
    "roll_history",
    "scale_from_amax",
    "select_scale",
]

# Smallest scale ever produced: 1/SCALE_FLOOR is finite in float32, so neither a
# zero nor a denormal amax can give an inf scale factor or a NaN product.
SCALE_FLOOR = float(np.finfo(np.float32).tiny)


def _per_tensor(scale) -> jnp.ndarray:
  """A ``(1,)`` per-tensor scale as a scalar (so it never changes ``x``'s shape)."""
  scale = jnp.asarray(scale, jnp.float32)
  return jnp.reshape(scale, ()) if scale.shape == (1,) else scale


def fp8_max(dtype) -> float:
  """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
  return float(ml_dtypes.finfo(dtype).max)


def amax(x: jnp.ndarray) -> jnp.ndarray:
  """``max(|x|)`` over all elements, as a float32 scalar (NaN if any is NaN)."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def finite_or_zero(a: jnp.ndarray) -> jnp.ndarray:
  """Maps a non-finite amax to 0, the "nothing observed" value of a history."""
  return jnp.where(jnp.isfinite(a), a, jnp.zeros_like(a))


def quantize(x: jnp.ndarray, dtype, scale: jnp.ndarray) -> jnp.ndarray:
  """Saturating cast of ``x / scale`` to the fp8 ``dtype``.

  Values beyond the format's range are clamped to ``±fp8_max`` (never inf or
  NaN); NaN stays NaN. The division runs in float32.

  Args:
    x: any floating array.
    dtype: the fp8 dtype to produce.
    scale: a float32 array broadcastable against ``x`` (usually shape ``(1,)``).

  Returns:
    ``x / scale`` rounded to nearest-even in ``dtype``.
  """
  m = fp8_max(dtype)
  y = jnp.asarray(x).astype(jnp.float32) / _per_tensor(scale)
  return jnp.clip(y, -m, m).astype(dtype)


def dequantize(q: jnp.ndarray, scale: jnp.ndarray, dtype) -> jnp.ndarray:
  """``q * scale`` computed in float32, returned in ``dtype``."""
  return (q.astype(jnp.float32) * _per_tensor(scale)).astype(dtype)


def qdq(x: jnp.ndarray, dtype, scale: jnp.ndarray) -> jnp.ndarray:
  """Quantize then dequantize (fake quantization), result in ``x.dtype``."""
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def roll_history(history: jnp.ndarray, new_amax: jnp.ndarray) -> jnp.ndarray:
  """Advances an amax history by one step; index 0 becomes ``new_amax``.

  A non-finite ``new_amax`` (from a NaN/Inf batch) is recorded as 0 ("nothing
  observed"), so it can never reach a later scale.
  """
  new_amax = finite_or_zero(jnp.asarray(new_amax, jnp.float32))
  return jnp.roll(history, 1, axis=0).at[0].set(new_amax)


def scale_from_amax(a: jnp.ndarray, prev_scale: jnp.ndarray, cfg: ScalingConfig) -> jnp.ndarray:
  """The scale that maps amax ``a`` to the fp8 maximum (with margin).

  Falls back to ``prev_scale`` when ``a`` is zero, negative or not finite, and
  never returns less than :data:`SCALE_FLOOR`. A non-finite or non-positive
  ``prev_scale`` is itself replaced by 1.

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
  s = a * (2.0 ** cfg.margin) / cfg.fp8_max
  if cfg.power_of_two:
    # Round up: a power-of-two scale that is never smaller than the exact one.
    s = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(s, SCALE_FLOOR))))
  s = jnp.maximum(s, SCALE_FLOOR)
  ok = jnp.isfinite(a) & (a > 0)
  return jnp.where(ok, s, prev)


def select_scale(cfg: ScalingConfig, prev_scale: jnp.ndarray, history: jnp.ndarray,
                 current_amax: jnp.ndarray) -> jnp.ndarray:
  """The scale to quantize with at this step.

  ``'current'`` scaling uses ``current_amax``. ``'delayed'`` scaling uses the
  history (``max`` or ``most_recent``); when the history holds no observation
  yet (its amax is 0, e.g. on the first step) it uses ``current_amax`` instead,
  so the first step never clips (the bug of seed 002, where a scale of 1 clipped
  a gradient of 1000 to 448).

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
    h = history[:1] if cfg.amax_compute_algo == "most_recent" else jnp.max(history, keepdims=True)
    a = jnp.where(h > 0, h, cur)
  return scale_from_amax(a, prev_scale, cfg)
