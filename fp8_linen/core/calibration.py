"""Activation ranges for post-training quantization, from a sample of the values a product saw.

Pure ``jnp``. A calibration run keeps, per quantized product, the exact
minimum and maximum of its input and a bounded random sample of its values
(:func:`subsample`); :func:`choose_range` then picks the clipping range the
quantizer is set to:

* ``'minmax'``: the observed ``[min, max]``;
* ``'percentile'``: the ``p``-th percentile of ``|x|`` on symmetric grids
  (of ``x`` on each side for asymmetric ones), so a few outliers do not
  stretch the grid;
* ``'mse'``: of the ranges ``t * [min, max]`` for ``t`` on a grid in ``(0,
  1]``, the one whose quantize-dequantize round trip (``qdq``: the grid the
  recipe uses, :func:`int_qdq` or :func:`fp8_qdq`) has the smallest mean
  squared error on the sample.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import calibration
  >>> from fp8_linen.recipes import IntQuantConfig
  >>> x = jnp.concatenate([jnp.linspace(-1.0, 1.0, 999), jnp.array([50.0])])
  >>> lo, hi = calibration.choose_range(x, x.min(), x.max(), method='percentile',
  ...                                   percentile=99.0, symmetric=True)
  >>> round(float(hi), 2)
  0.99
  >>> import jax
  >>> t = jax.random.t(jax.random.key(0), 3.0, (4096,))  # heavy tails
  >>> qdq = calibration.int_qdq(IntQuantConfig(bits=4))
  >>> lo, hi = calibration.choose_range(t, t.min(), t.max(), method='mse', qdq=qdq)
  >>> bool(hi < t.max() / 2)
  True
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from fp8_linen.core import int_numerics
from fp8_linen.core.numerics import SCALE_FLOOR, decode_fp8
from fp8_linen.recipes.fp8 import ScalingConfig
from fp8_linen.recipes.integer import IntQuantConfig

__all__ = ["METHODS", "subsample", "choose_range", "int_qdq", "fp8_qdq", "qdq_error"]

METHODS = ("minmax", "percentile", "mse")


def subsample(x, n: int, seed: int = 0):
  """At most ``n`` values of ``x`` (float32, flat): all of them, or ``n`` drawn at random.

  A fixed seed: the same batch gives the same sample. Drawn with
  replacement, so the cost does not depend on ``x.size``.
  """
  flat = jnp.ravel(jnp.asarray(x, jnp.float32))
  if flat.size <= n:
    return flat
  idx = jax.random.randint(jax.random.key(seed), (n,), 0, flat.size)
  return flat[idx]


@functools.lru_cache(maxsize=None)  # one function per grid: a jit of choose_range reuses it
def int_qdq(cfg: IntQuantConfig) -> Callable:
  """``qdq(x, lo, hi)``: ``x`` through the integer grid ``cfg`` with the range ``[lo, hi]``."""
  def qdq(x, lo, hi):
    s, z = int_numerics.int_params_from_range(lo, hi, cfg)
    return int_numerics.int_fake_quant(x, s, z, cfg.qmin, cfg.qmax)
  return qdq


@functools.lru_cache(maxsize=None)
def fp8_qdq(cfg: ScalingConfig) -> Callable:
  """``qdq(x, lo, hi)``: ``x`` through ``cfg``'s fp8 format scaled for ``amax = max(-lo, hi)``."""
  fmax = cfg.fp8_max

  def qdq(x, lo, hi):
    amax = jnp.maximum(-lo, hi)
    s = jnp.maximum(amax / fmax, SCALE_FLOOR)
    codes = jnp.clip(x / s, -fmax, fmax).astype(cfg.jnp_dtype)
    # Through the bits: XLA:GPU would fold the plain cast pair to x (no rounding error).
    return decode_fp8(codes) * s
  return qdq


def qdq_error(x, lo, hi, qdq: Callable):
  """Mean squared error of ``qdq`` on ``x`` with the range ``[lo, hi]``."""
  x = jnp.asarray(x, jnp.float32)
  return jnp.mean((qdq(x, lo, hi) - x) ** 2)


def choose_range(sample, lo, hi, *, method: str, percentile: float = 99.99,
                 symmetric: bool = True, qdq: Callable | None = None, grid: int = 100):
  """The clipping range ``(lo, hi)`` (float32 scalars) ``method`` picks (see the module doc).

  Args:
    sample: values the quantizer will see (flat).
    lo: their exact minimum (the sample may have missed it).
    hi: their exact maximum.
    method: ``'minmax'``, ``'percentile'`` or ``'mse'``.
    percentile: for ``'percentile'``, in ``(0, 100]``.
    symmetric: whether the grid is symmetric (only ``max(-lo, hi)`` matters).
    qdq: for ``'mse'``: the grid's round trip ``qdq(x, lo, hi)``.
    grid: for ``'mse'``: how many ranges ``t * [lo, hi]``, ``t`` in ``(0, 1]``.
  """
  lo = jnp.asarray(lo, jnp.float32)
  hi = jnp.asarray(hi, jnp.float32)
  x = jnp.asarray(sample, jnp.float32)
  if method == "minmax":
    return lo, hi
  if method == "percentile":
    q = percentile / 100.0
    if symmetric:
      a = jnp.quantile(jnp.abs(x), q)
      return jnp.maximum(lo, -a), jnp.minimum(hi, a)
    return (jnp.clip(jnp.quantile(x, 1.0 - q), lo, hi),
            jnp.clip(jnp.quantile(x, q), lo, hi))
  if method == "mse":
    if qdq is None:
      raise ValueError("choose_range: method='mse' needs the grid's qdq")
    ts = jnp.arange(1, grid + 1, dtype=jnp.float32) / grid
    errors = jax.lax.map(lambda t: qdq_error(x, lo * t, hi * t, qdq), ts)
    t = ts[jnp.argmin(errors)]
    return lo * t, hi * t
  raise ValueError(f"choose_range: method={method!r}; allowed values: {list(METHODS)}")
