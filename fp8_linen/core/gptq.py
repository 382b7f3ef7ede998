"""GPTQ: rounding a weight to an integer grid so the layer's output error stays small.

Round to nearest quantizes every weight on its own. GPTQ (Frantar et al.,
2023) quantizes the rows of a weight ``W`` (``(K, N)``: ``K`` inputs, ``N``
outputs, as ``x @ W``) one at a time and spreads each row's rounding error
over the rows not yet quantized, weighted by the inverse of the Hessian ``H
= X^T X`` of the layer's calibration inputs ``X``; this minimises (greedily)
``||X W - X Q||^2`` instead of ``||W - Q||^2``. With ``U`` the upper Cholesky
factor of ``H^-1`` (``H^-1 = U^T U``), for each row ``k``::

  q_k = clamp(round(w_k / s), qmin, qmax)
  e_k = (w_k - s * q_k) / U[k, k]
  w_j -= U[k, j] * e_k          for every j > k

Scales: per tensor and per channel from the weight before any update; per
group, each group's from its rows as the updates left them when the group is
reached (the order GPTQ uses). A diagonal damping ``damping * mean(diag H)``
keeps ``H`` invertible; inputs that never fire (``H[k, k] = 0``) get zero
weight rows. Symmetric grids only.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fp8_linen.core import gptq
  >>> from fp8_linen.recipes import IntQuantConfig
  >>> x = jax.random.normal(jax.random.key(0), (64, 8))
  >>> w = jax.random.normal(jax.random.key(1), (8, 4))
  >>> codes, scale = gptq.gptq(w, x.T @ x, IntQuantConfig(bits=4, granularity='channel'))
  >>> codes.shape, scale.shape, int(jnp.abs(codes).max()) <= 8
  ((8, 4), (1, 4), True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8_linen.core import int_numerics, lowering
from fp8_linen.recipes.integer import IntQuantConfig

__all__ = ["gptq", "hessian"]


def hessian(x, contract_axes) -> jax.Array:
  """``X^T X`` (float32, ``(K, K)``) of an input, its contracting axes flattened last in order."""
  x = jnp.asarray(x, jnp.float32)
  contract_axes = tuple(a % x.ndim for a in contract_axes)
  free = tuple(a for a in range(x.ndim) if a not in contract_axes)
  k = 1
  for a in contract_axes:
    k *= x.shape[a]
  x2 = jnp.transpose(x, free + contract_axes).reshape(-1, k)
  # The original lax function lowering binds: under fl.quantize_model this Hessian is not
  # a product of the model.
  return lowering.lax_dot_general(x2, x2, (((0,), (0,)), ((), ())),
                                  precision=jax.lax.Precision.HIGHEST,
                                  preferred_element_type=jnp.float32)


def _scale(rows, cfg: IntQuantConfig, all_rows: bool):
  """Symmetric scale(s) of ``rows`` (over every element, or per column)."""
  axis = None if all_rows else 0
  lo = jnp.min(rows, axis=axis, keepdims=True)
  hi = jnp.max(rows, axis=axis, keepdims=True)
  s, _ = int_numerics.int_params_from_range(lo, hi, cfg)
  return jnp.broadcast_to(s, (1, rows.shape[1]))


def gptq(w, hessian_, cfg: IntQuantConfig, *, damping: float = 0.01):
  """GPTQ's integer codes of ``w`` and their scales (see the module doc).

  Args:
    w: the weight ``(K, N)`` (float).
    hessian_: ``X^T X`` of its calibration inputs, ``(K, K)`` (:func:`hessian`).
    cfg: a symmetric grid; ``granularity`` ``'tensor'``, ``'channel'`` or
      ``'group'`` (groups of ``group_size`` rows of ``w``).
    damping: fraction of the mean diagonal of ``H`` added to its diagonal.

  Returns:
    ``(codes, scales)``: int32 codes ``(K, N)`` in ``[qmin, qmax]`` and float32
    scales ``(G, N)`` (``G = 1`` per tensor or channel, ``K / group_size`` per
    group); ``w`` is approximated by ``codes * scales`` (the scale of row
    ``k`` is row ``k // group_size``).

  Raises:
    ValueError: an asymmetric grid, or a group size that does not divide ``K``.
  """
  if not cfg.symmetric:
    raise ValueError("gptq: cfg.symmetric=False is not supported (GPTQ here rounds to a "
                     "symmetric grid); allowed values: [True]")
  w = jnp.asarray(w, jnp.float32)
  h = jnp.asarray(hessian_, jnp.float32)
  k_rows, n = w.shape
  if h.shape != (k_rows, k_rows):
    raise ValueError(f"gptq: hessian has shape {h.shape}, the weight {w.shape} needs "
                     f"{(k_rows, k_rows)}")
  gs = cfg.group_size if cfg.granularity == "group" else k_rows
  if k_rows % gs:
    raise ValueError(f"gptq: group_size={gs} does not divide the weight's {k_rows} rows")
  diag = jnp.diagonal(h)
  dead = diag == 0
  h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
  w = jnp.where(dead[:, None], 0.0, w)
  h = h + jnp.eye(k_rows, dtype=jnp.float32) * (damping * jnp.mean(jnp.diagonal(h)))
  hinv = jnp.linalg.inv(h)
  hinv = (hinv + hinv.T) / 2
  u = jnp.linalg.cholesky(hinv).T
  n_groups = k_rows // gs
  if cfg.granularity == "group":
    scales0 = jnp.ones((n_groups, n), jnp.float32)
  else:
    scales0 = _scale(w, cfg, cfg.granularity == "tensor")
  rows = jnp.arange(k_rows)

  def step(k, carry):
    w, codes, scales = carry
    g = k // gs
    if cfg.granularity == "group":
      fresh = _scale(jax.lax.dynamic_slice(w, (k, 0), (gs, n)), cfg, False)[0]
      scales = jnp.where(k % gs == 0, scales.at[g].set(fresh), scales)
    s = scales[g]
    row = w[k]
    q = jnp.clip(jnp.round(row / s), cfg.qmin, cfg.qmax)
    err = (row - q * s) / u[k, k]
    w = w - jnp.where(rows > k, u[k], 0.0)[:, None] * err[None, :]
    return w, codes.at[k].set(q.astype(jnp.int32)), scales

  _, codes, scales = jax.lax.fori_loop(
      0, k_rows, step, (w, jnp.zeros((k_rows, n), jnp.int32), scales0))
  return codes, scales
