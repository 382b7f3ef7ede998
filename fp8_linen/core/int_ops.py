"""Integer fake quantization with custom gradients: STE, LSQ, LSQ+ and observers.

All four are module-level ``jax.custom_vjp`` functions with their static
configuration (integer range, gradient scale) as non-differentiable
arguments. The observer's range is overwritten state and rides the same
chain as the fp8 state (:func:`fp8_linen.core.owg.fold_chain`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> jax.grad(lambda x: fl.fake_quant_ste(x, 0.5, 0.0, qmin=-8, qmax=7).sum())(
  ...     jnp.array([0.3, 9.0])).tolist()
  [1.0, 0.0]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8_linen.core import int_numerics, lowering, owg, uses
from fp8_linen.core.numerics import SCALE_FLOOR
from fp8_linen.recipes.integer import IntQuantConfig

__all__ = ["fake_quant_ste", "minmax_fake_quant", "lsq_fake_quant", "lsq_plus_fake_quant",
           "observed_fake_quant", "lsq_elements", "lsq_backward", "observer_qparams",
           "minmax_qparams"]


def _pass_inside(g, v, qmin, qmax, dtype):
  """The straight-through gradient: ``g`` where ``qmin <= v <= qmax``, else 0."""
  return jnp.where((v >= qmin) & (v <= qmax), g, jnp.zeros_like(g)).astype(dtype)


def _sum_to(t, shape):
  """Sums ``t`` over the axes it was broadcast along to reach ``t.shape``."""
  shape = tuple(shape)
  lead = t.ndim - len(shape)
  t = jnp.sum(t, axis=tuple(range(lead))) if lead else t
  axes = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
  return jnp.sum(t, axis=axes, keepdims=True).reshape(shape) if axes else t.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ste(qmin, qmax, x, scale, zero_point):
  return int_numerics.int_fake_quant(x, scale, zero_point, qmin, qmax)


def _ste_fwd(qmin, qmax, x, scale, zero_point):
  return _ste(qmin, qmax, x, scale, zero_point), (x, scale, zero_point)


def _ste_bwd(qmin, qmax, res, g):
  x, scale, zero_point = res
  return (_pass_inside(g, x.astype(jnp.float32) / scale + zero_point, qmin, qmax, x.dtype),
          jnp.zeros_like(scale), jnp.zeros_like(zero_point))


_ste.defvjp(_ste_fwd, _ste_bwd)
_ste = uses.compiled_when_eager(_ste, static_argnums=(0, 1))


def fake_quant_ste(x, scale, zero_point, *, qmin: int, qmax: int):
  """Fake quantization with the straight-through estimator.

  Forward: ``s * (clamp(round(x / s) + z, qmin, qmax) - z)``. Backward: the
  gradient passes unchanged where ``qmin <= x / s + z <= qmax`` and is zero
  outside the clamp range; ``scale`` and ``zero_point`` get zero gradients
  (they come from data or observers, not from the loss).

  Args:
    x: floating array.
    scale: float32 scale, broadcastable against ``x``.
    zero_point: float32 zero point (integer-valued), broadcastable against ``x``.
    qmin: lowest integer level.
    qmax: highest integer level.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> f = lambda x: fl.fake_quant_ste(x, 0.5, 0.0, qmin=-8, qmax=7).sum()
    >>> jax.grad(f)(jnp.array([0.3, 9.0])).tolist()
    [1.0, 0.0]
  """
  x = jnp.asarray(x)
  owg.check_float("x", x)
  scale = jnp.asarray(scale, jnp.float32)
  zero_point = jnp.asarray(zero_point, jnp.float32)
  return _ste(int(qmin), int(qmax), x, scale, zero_point)


def _lsq_v(x, step, offset):
  s = jnp.maximum(step, SCALE_FLOOR)
  return (x.astype(jnp.float32) - offset) / s, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _lsq(qmin, qmax, grad_scale, with_offset, x, step, offset):
  v, s = _lsq_v(x, step, offset)
  return (jnp.clip(jnp.round(v), qmin, qmax) * s + offset).astype(x.dtype)


def _lsq_fwd(qmin, qmax, grad_scale, with_offset, x, step, offset):
  return _lsq(qmin, qmax, grad_scale, with_offset, x, step, offset), (x, step, offset)


def lsq_backward(g, x, step, offset, *, qmin: int, qmax: int, grad_scale: float,
                 with_offset: bool):
  """LSQ/LSQ+ gradients ``(dx, d_step, d_offset)`` given ``g = dL/dx_hat``.

  The closed forms of :func:`lsq_fake_quant` and :func:`lsq_plus_fake_quant`;
  the integer product (:mod:`fp8_linen.core.int_product`) calls this same
  function, so both give the same gradients.
  """
  v, _ = _lsq_v(x, step, offset)
  g32 = g.astype(jnp.float32)
  below, above = v < qmin, v > qmax
  inside = ~(below | above)
  # d x_hat / d s: Q_N below, Q_P above, round(v) - v inside (Esser et al.).
  ds = jnp.where(below, float(qmin), jnp.where(above, float(qmax), jnp.round(v) - v))
  # Sums over sharded axes come back sharded; the step's gradient must be
  # sharded like the step itself (a custom_vjp checks the types).
  d_step = lowering.reshard_like(_sum_to(g32 * ds, step.shape) * grad_scale, step)
  # d x_hat / d beta: 0 inside (the STE cancels it), 1 at the clamps.
  d_off = (lowering.reshard_like(_sum_to(jnp.where(inside, 0.0, g32), offset.shape)
                                 * grad_scale, offset) if with_offset
           else jnp.zeros_like(offset))
  return jnp.where(inside, g32, 0.0).astype(x.dtype), d_step, d_off


def _lsq_bwd(qmin, qmax, grad_scale, with_offset, res, g):
  x, step, offset = res
  return lsq_backward(g, x, step, offset, qmin=qmin, qmax=qmax, grad_scale=grad_scale,
                      with_offset=with_offset)


_lsq.defvjp(_lsq_fwd, _lsq_bwd)
_lsq = uses.compiled_when_eager(_lsq, static_argnums=(0, 1, 2, 3))


def _lsq_args(x, step, *, grad_scale):
  x = jnp.asarray(x)
  owg.check_float("x", x)
  if not float(grad_scale) > 0:
    raise ValueError(f"grad_scale must be > 0, got {grad_scale!r}")
  return x, jnp.asarray(step, jnp.float32)


def lsq_fake_quant(x, step, *, qmin: int, qmax: int, grad_scale: float = 1.0):
  """LSQ fake quantization with a learnable step size (Esser et al., 2020).

  Forward: ``x_hat = s * clamp(round(x / s), qmin, qmax)``. Backward, with
  ``v = x / s``: ``dx_hat/dx = 1`` for ``qmin <= v <= qmax`` and 0 outside;
  ``dx_hat/ds = round(v) - v`` inside, ``qmin`` below and ``qmax`` above, summed
  over the elements ``s`` covers and multiplied by ``grad_scale`` (LSQ uses
  ``1 / sqrt(N * Q_P)``).

  Args:
    x: floating array.
    step: float32 step size ``s`` (> 0), broadcastable against ``x``.
    qmin: lowest integer level (``Q_N`` of the paper, negated).
    qmax: highest integer level (``Q_P``).
    grad_scale: factor applied to the step's gradient.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> f = lambda s: fl.lsq_fake_quant(jnp.array([0.7, 5.0]), s, qmin=-2, qmax=1).sum()
    >>> float(jax.grad(f)(jnp.array(1.0)))  # (round(0.7) - 0.7) + Q_P
    1.2999999523162842
  """
  x, step = _lsq_args(x, step, grad_scale=grad_scale)
  return _lsq(int(qmin), int(qmax), float(grad_scale), False, x, step,
              jnp.zeros((), jnp.float32))


def lsq_plus_fake_quant(x, step, offset, *, qmin: int, qmax: int, grad_scale: float = 1.0):
  """LSQ+ fake quantization: learnable step ``s`` and offset ``beta``.

  Forward: ``x_hat = s * clamp(round((x - beta) / s), qmin, qmax) + beta``.
  Backward, with ``v = (x - beta) / s`` and the STE for ``round``:
  ``dx_hat/dx`` is 1 inside the range and 0 outside; ``dx_hat/ds`` is ``round(v)
  - v`` inside, ``qmin``/``qmax`` at the clamps; ``dx_hat/dbeta`` is 0 inside
  (``s * d round(v)/dbeta + 1 = -1 + 1``) and 1 at the clamps. Both learnable
  gradients are multiplied by ``grad_scale``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> f = lambda b: fl.lsq_plus_fake_quant(jnp.array([0.2, 9.0]), 1.0, b, qmin=0, qmax=3).sum()
    >>> float(jax.grad(f)(jnp.array(0.0)))  # only the clamped element
    1.0
  """
  x, step = _lsq_args(x, step, grad_scale=grad_scale)
  return _lsq(int(qmin), int(qmax), float(grad_scale), True, x, step,
              jnp.asarray(offset, jnp.float32))


def _observe(cfg: IntQuantConfig, old, x):
  """The observer's range ``[-min, max]`` after seeing ``x`` (old ``[0, 0]`` = empty)."""
  x32 = jnp.asarray(x, jnp.float32)
  if x32.size == 0:  # an empty batch observes nothing
    return old
  # Max reductions only (max(-x) is -min(x)): over a sharded x XLA merges their
  # all-reduces into one, where a min and a max would need two (and where it
  # gathers a variadic reduce's partial results instead). On one TPU both are
  # one variadic reduce, so one kernel reads x: XLA:TPU fuses two reductions
  # of one producer apart, each recomputing it from its inputs. XLA:GPU reads
  # x once for both already (and materializes a variadic reduce's float32
  # inputs where a Pallas kernel reads x too); XLA:CPU runs each in its
  # library's fast kernel, which has no variadic form (a 2048 x 2048 STE step
  # 2% slower with one).
  if lowering.on_mesh(x32) or lowering.current_backend() != "tpu":
    cur = jnp.stack([jnp.max(-x32), jnp.max(x32)])
  else:
    ninf = jnp.array(-jnp.inf, jnp.float32)
    cur = jnp.stack(jax.lax.reduce(
        (-x32, x32), (ninf, ninf),
        lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])),
        tuple(range(x32.ndim))))
  cur = jnp.where(jnp.isfinite(cur), cur, old)  # a NaN batch never poisons the range
  empty = jnp.all(old == 0)
  if cfg.observer == "minmax":
    new = jnp.maximum(old, cur)
  else:
    new = cfg.momentum * old + (1.0 - cfg.momentum) * cur
  return jnp.where(empty, cur, new)


def observer_qparams(cfg: IntQuantConfig, x, obs, frozen: bool = False):
  """``(new_range, scale, zero_point)`` of an observer that sees ``x``.

  ``frozen`` (:func:`~fp8_linen.core.owg.frozen_quantizers`): the range is
  not updated (``new_range`` is ``obs``) and the scale comes from it, as in
  the served model; only a range that has observed nothing yet takes the
  batch's.
  """
  new = _observe(cfg, obs, x)
  if frozen:
    used = jnp.where(jnp.all(obs == 0), new, obs)
    s, z = int_numerics.int_params_from_range(-used[0], used[1], cfg)
    return obs, s, z
  s, z = int_numerics.int_params_from_range(-new[0], new[1], cfg)
  return new, s, z


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _observed(cfg, first, frozen, x, obs, chain):
  _, s, z = observer_qparams(cfg, x, obs, frozen)
  return int_numerics.int_fake_quant(x, s, z, cfg.qmin, cfg.qmax), chain


def _observed_fwd(cfg, first, frozen, x, obs, chain):
  new, s, z = observer_qparams(cfg, x, obs, frozen)
  return (int_numerics.int_fake_quant(x, s, z, cfg.qmin, cfg.qmax), chain), (x, obs, new, s, z)


def _observed_bwd(cfg, first, frozen, res, cts):
  del frozen  # a frozen observer's "new" range is its old one
  x, obs, new, s, z = res
  g, ct_chain = cts
  dx = _pass_inside(g, x.astype(jnp.float32) / s + z, cfg.qmin, cfg.qmax, x.dtype)
  # The range rides the same chain as fp8 state: the first use returns the
  # widest (elementwise max of [-min, max]) as the new state.
  combined, chain_ct = owg.fold_chain(new, ct_chain, first, like=obs)
  return dx, (jnp.zeros_like(new) if combined is None else combined), chain_ct


_observed.defvjp(_observed_fwd, _observed_bwd)
_observed = uses.compiled_when_eager(_observed, static_argnums=(0, 1, 2))


def observed_fake_quant(x, observer_range, *, cfg: IntQuantConfig, chain=None):
  """STE fake quantization with a range observer whose state is overwritten.

  The observer state is ``[-min, max]`` (float32 ``(2,)``; ``[0, 0]`` means
  nothing observed yet). Forward: the range is updated with this batch
  (``'minmax'``: running min/max; ``'moving_average'``: EMA with
  ``cfg.momentum``; the first batch is taken as is), the scale and zero point
  come from it (:func:`~fp8_linen.core.int_numerics.int_params_from_range`) and ``x`` is
  fake-quantized. Backward: STE for ``x``; the updated range is returned as the
  cotangent of ``observer_range`` (the ``_overwrite_with_gradient``
  convention), linked across uses through ``chain`` like the fp8 ops. Under
  :func:`~fp8_linen.frozen_quantizers` the range is read, never updated.

  Returns:
    ``(x_hat, chain_out)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen import recipes
    >>> cfg = recipes.IntQuantConfig(bits=8)
    >>> f = lambda x, r: fl.observed_fake_quant(x, r, cfg=cfg)[0].sum()
    >>> jax.grad(f, argnums=1)(jnp.array([-1.0, 2.0]), jnp.zeros(2)).tolist()
    [1.0, 2.0]
  """
  x = jnp.asarray(x)
  owg.check_float("x", x)
  observer_range = jnp.asarray(observer_range, jnp.float32)
  if observer_range.shape != (2,):
    raise ValueError(f"observer_range must have shape (2,), got {observer_range.shape}")
  first = chain is None
  return _observed(cfg, first, owg.quantizers_frozen(), x, observer_range,
                   jnp.zeros((2,), jnp.float32) if first else chain)


def minmax_fake_quant(view, axes, cfg: IntQuantConfig):
  """STE fake quantization with scales from ``view``'s own min/max over ``axes``.

  How an STE recipe quantizes a weight: no state, the range is the current
  weight's (per tensor, channel or group, as :func:`~fp8_linen.core.int_numerics.int_view`
  laid it out), and the range itself gets no gradient.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import int_ops
    >>> from fp8_linen.recipes import IntQuantConfig
    >>> int_ops.minmax_fake_quant(jnp.array([-1.0, 0.3, 2.0]), (0,), IntQuantConfig(bits=2)).tolist()
    [0.0, 0.0, 2.0]
  """
  s, z = minmax_qparams(jax.lax.stop_gradient(view), axes, cfg)
  return fake_quant_ste(view, s, z, qmin=cfg.qmin, qmax=cfg.qmax)


def minmax_qparams(view, axes, cfg: IntQuantConfig):
  """Scale and zero point from ``view``'s own min/max over ``axes`` (kept as size 1)."""
  # -max(-w), not min(w): on a mesh both reductions are max all-reduces,
  # which XLA merges into one (a weight sharded over its contraction, as
  # under FSDP, needs its per-channel range before it is cast).
  lo = -jnp.max(-view, axis=axes, keepdims=True)
  hi = jnp.max(view, axis=axes, keepdims=True)
  return int_numerics.int_params_from_range(lo, hi, cfg)


def lsq_elements(x, view, axes, role: str) -> int:
  """``N`` of LSQ's gradient scale ``1 / sqrt(N * Q_P)`` for one operand.

  Activations (``role='input'``): the features per example (``x.size /
  x.shape[0]``); weights: the elements one step covers.
  """
  if role == "input":
    return x.size // x.shape[0] if x.ndim > 1 else x.size
  return max(1, math.prod(view.shape[a] for a in axes))
