"""Pure integer fake-quantization numerics (affine/symmetric grids, LSQ inits).

Plain ``jnp`` functions with no autodiff rules, shared by the integer QAT ops.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import int_numerics
  >>> int_numerics.int_fake_quant(jnp.array([0.26, 9.0]), 0.5, 0.0, -8, 7).tolist()
  [0.5, 3.5]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp8_linen.core.numerics import SCALE_FLOOR, pow2
from fp8_linen.recipes.integer import IntQuantConfig

__all__ = [
    "int_view",
    "int_params_from_range",
    "int_levels",
    "int_quantize",
    "int_dequantize",
    "int_fake_quant",
    "lsq_init_step",
    "lsq_plus_init",
]

# ----------------------------------------------------------------------------


def int_view(x: jnp.ndarray, contract_axes, cfg: IntQuantConfig):
  """The view of ``x`` its scales apply to, and the axes each scale covers.

  * ``'tensor'``: ``x`` itself, all axes reduced.
  * ``'channel'``: ``x``, the contracting axes reduced (one scale per output
    channel).
  * ``'group'``: the (single) contracting axis split into ``(n_groups,
    group_size)``; the ``group_size`` axis reduced.

  Scales have the view's shape with the reduced axes of size 1; fake-quantize
  the view and reshape it back to ``x.shape``.

  Raises:
    ValueError: for ``'group'`` with several contracting axes or a size that
      ``group_size`` does not divide.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import recipes
    >>> from fp8_linen.core import int_numerics as numerics
    >>> cfg = recipes.IntQuantConfig(granularity='group', group_size=2)
    >>> v, axes = numerics.int_view(jnp.ones((4, 3)), (0,), cfg)
    >>> v.shape, axes
    ((2, 2, 3), (1,))
  """
  contract_axes = tuple(a % x.ndim for a in contract_axes)
  if cfg.granularity == "tensor":
    return x, tuple(range(x.ndim))
  if cfg.granularity == "channel":
    return x, contract_axes
  if len(contract_axes) != 1:
    raise ValueError(f"granularity='group' needs exactly one contracting axis, got "
                     f"{len(contract_axes)} (axes {contract_axes} of shape {x.shape})")
  (a,) = contract_axes
  if x.shape[a] % cfg.group_size:
    raise ValueError(f"group_size={cfg.group_size} does not divide the contracting axis "
                     f"(size {x.shape[a]}) of shape {x.shape}")
  shape = x.shape[:a] + (x.shape[a] // cfg.group_size, cfg.group_size) + x.shape[a + 1:]
  return x.reshape(shape), (a + 1,)


def int_params_from_range(lo: jnp.ndarray, hi: jnp.ndarray, cfg: IntQuantConfig):
  """Scale and zero point that map ``[lo, hi]`` onto the integer grid.

  Symmetric: ``s = max(|lo|, |hi|) / qmax`` and ``z = 0``. Asymmetric: the
  range is widened to contain 0 (so 0 is exact), ``s = (hi - lo) / (qmax -
  qmin)`` and ``z = clamp(round(qmin - lo / s), qmin, qmax)``. With
  ``power_of_two`` the scale is rounded up to ``2**k``. An empty range gives
  ``s = 1``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import recipes
    >>> from fp8_linen.core import int_numerics as numerics
    >>> s, z = numerics.int_params_from_range(jnp.array(-1.0), jnp.array(3.0),
    ...                                       recipes.IntQuantConfig(bits=2, symmetric=False))
    >>> float(s), float(z)
    (1.3333333730697632, 1.0)
  """
  lo = jnp.minimum(jnp.asarray(lo, jnp.float32), 0.0)
  hi = jnp.maximum(jnp.asarray(hi, jnp.float32), 0.0)
  # Times the float32 reciprocal of the grid's width, not divided by it: XLA
  # rewrites a division by a constant so in some programs and not in others
  # (jax 0.10.0: not eagerly, yes inside a loop), and a multiplication is
  # one rounding everywhere, so the TPU kernel, the interpreter and every
  # path's scale agree bit for bit. XLA 0.10.2 computes this form already.
  if cfg.symmetric:
    s = jnp.maximum(-lo, hi) * np.float32(1.0 / cfg.qmax)
  else:
    s = (hi - lo) * np.float32(1.0 / (cfg.qmax - cfg.qmin))
  if cfg.power_of_two:
    s = pow2(jnp.ceil(jnp.log2(jnp.maximum(s, SCALE_FLOOR))))
  s = jnp.where(jnp.isfinite(s) & (s > SCALE_FLOOR), s, jnp.ones_like(s))
  if cfg.symmetric:
    z = jnp.zeros_like(s)
  else:
    z = jnp.clip(jnp.round(cfg.qmin - lo / s), cfg.qmin, cfg.qmax)
  return s, z


def int_levels(x32, scale, zero_point, qmin: int, qmax: int) -> jnp.ndarray:
  """``clamp(round(x / s) + z, qmin, qmax)`` of float32 ``x32``, as float32 grid levels.

  Round half to even. The one expression of a grid level: the codes of the
  ops, of :mod:`~fp8_linen.core.int_codes` and of the TPU kernel
  (:mod:`~fp8_linen.core.int_kernels`) all come from it.
  """
  return jnp.clip(jnp.round(x32 / scale) + zero_point, qmin, qmax)


def int_quantize(x, scale, zero_point, qmin: int, qmax: int) -> jnp.ndarray:
  """``clamp(round(x / s) + z, qmin, qmax)`` as int32 (round half to even)."""
  return int_levels(jnp.asarray(x, jnp.float32), scale, zero_point, qmin, qmax).astype(jnp.int32)


def int_dequantize(q, scale, zero_point, dtype=jnp.float32) -> jnp.ndarray:
  """``s * (q - z)`` in ``dtype``."""
  return (scale * (q.astype(jnp.float32) - zero_point)).astype(dtype)


def int_fake_quant(x, scale, zero_point, qmin: int, qmax: int) -> jnp.ndarray:
  """Fake quantization ``s * (clamp(round(x / s) + z, qmin, qmax) - z)`` in ``x.dtype``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import int_numerics as numerics
    >>> numerics.int_fake_quant(jnp.array([0.26, 9.0, -9.0]), 0.5, 0.0, -8, 7).tolist()
    [0.5, 3.5, -4.0]
  """
  x = jnp.asarray(x)
  v = jnp.clip(jnp.round(x.astype(jnp.float32) / scale) + zero_point, qmin, qmax)
  return (scale * (v - zero_point)).astype(x.dtype)


def lsq_init_step(x, reduce_axes, qmax: int) -> jnp.ndarray:
  """LSQ's initial step ``2 * mean(|x|) / sqrt(Q_P)`` (over ``reduce_axes``, kept)."""
  m = jnp.mean(jnp.abs(jnp.asarray(x, jnp.float32)), axis=tuple(reduce_axes), keepdims=True)
  s = 2.0 * m / np.sqrt(qmax)
  return jnp.where(s > 0, s, jnp.full_like(s, 1e-3))


def lsq_plus_init(x, reduce_axes, qmin: int, qmax: int):
  """LSQ+ initial ``(step, offset)`` from the min/max of ``x``.

  ``s = (max - min) / (qmax - qmin)`` and ``beta = min - s * qmin``, so the grid
  spans the observed range exactly.
  """
  x = jnp.asarray(x, jnp.float32)
  lo = jnp.min(x, axis=tuple(reduce_axes), keepdims=True)
  hi = jnp.max(x, axis=tuple(reduce_axes), keepdims=True)
  s = (hi - lo) / (qmax - qmin)
  s = jnp.where(s > 0, s, jnp.full_like(s, 1e-3))
  return s, lo - s * qmin
