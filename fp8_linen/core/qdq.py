"""The quantize/dequantize pair, with the gradient's scale passed back as a cotangent.

``quantize(x, scale, history) -> (x_fp8, scale_out, chain)`` and
``dequantize(x_fp8, scale_out, grad_scale, grad_history) -> (x, chain)``. In
the backward pass ``dequantize`` runs first: it picks the gradient's scale,
quantizes the gradient to e5m2 and returns that scale *as the cotangent of
its dummy* ``scale_out`` *input*. ``quantize``'s backward receives exactly that
scale and dequantizes the gradient with it. Both return their role's new
state as the cotangent of its state inputs (:mod:`fp8_linen.core.owg`).

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> xq, s, _ = fl.quantize(jnp.array([1.0, -2.0, 3.0]), jnp.ones((1,)), jnp.zeros((4,)))
  >>> xq.dtype
  dtype(float8_e4m3fn)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8_linen.core import numerics, owg, uses
from fp8_linen.recipes.fp8 import ScalingConfig

__all__ = ["quantize", "dequantize"]


def _observed(a, frozen: bool):
  """``(amax, empty)`` a use reports: nothing at all under frozen quantizers."""
  return (jnp.zeros((), jnp.float32), True) if frozen else (a, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _quantize(cfg, x_dtype, first, frozen, x, state, chain):
  xq, s, _ = numerics.quantize_with(cfg, *state, x)
  return xq, s, chain


def _quantize_fwd(cfg, x_dtype, first, frozen, x, state, chain):
  xq, s, a = numerics.quantize_with(cfg, *state, x)
  return (xq, s, chain), (a, state)


def _quantize_bwd(cfg, x_dtype, first, frozen, res, cts):
  a, state = res
  g_q, g_scale, ct_chain = cts
  # g_q is the fp8 gradient made by dequantize's backward, g_scale the scale
  # it was quantized with (delivered through the dummy ``scale_out``). It
  # leaves the pair for whatever made x, never as a GEMM operand here: read
  # exactly, or XLA:GPU would drop the e5m2 rounding (numerics.decode_fp8).
  dx = numerics.dequantize(g_q, g_scale, x_dtype, exact=True)
  a, empty = _observed(a, frozen)
  (st,), chain_ct = owg.state_cotangents((cfg,), (state,), (a,), ct_chain, first,
                                         empty=empty or g_q.size == 0)
  return dx, st, chain_ct


_quantize.defvjp(_quantize_fwd, _quantize_bwd)
_quantize = uses.compiled_when_eager(_quantize, static_argnums=(0, 1, 2, 3))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _dequantize(grad_cfg, out_dtype, first, frozen, exact, xq, scale_out, grad_state, chain):
  return numerics.dequantize(xq, scale_out, out_dtype, exact=exact), chain


def _dequantize_fwd(grad_cfg, out_dtype, first, frozen, exact, xq, scale_out, grad_state, chain):
  return (numerics.dequantize(xq, scale_out, out_dtype, exact=exact), chain), grad_state


def _dequantize_bwd(grad_cfg, out_dtype, first, frozen, exact, grad_state, cts):
  del exact
  g, ct_chain = cts
  g_q, s, a = numerics.quantize_with(grad_cfg, *grad_state, g, gradient=True)
  a, empty = _observed(a, frozen)
  (st,), chain_ct = owg.state_cotangents((grad_cfg,), (grad_state,), (a,), ct_chain, first,
                                         empty=empty or g.size == 0)
  # The cotangent of the dummy scale_out *is* the gradient's scale.
  return g_q, s, st, chain_ct


_dequantize.defvjp(_dequantize_fwd, _dequantize_bwd)
_dequantize = uses.compiled_when_eager(_dequantize, static_argnums=(0, 1, 2, 3, 4))


def quantize(x, scale, amax_history, *, cfg: ScalingConfig | None = None, chain=None):
  """Quantizes ``x`` to fp8 with a scale chosen by ``cfg``.

  Forward: picks the scale (delayed: from ``amax_history``, or from ``x`` on the
  first step; current: from ``x``) and returns the saturated fp8 value and the
  scale used. Backward: dequantizes the incoming fp8 gradient with the scale
  received through ``scale_out``'s cotangent, and returns the new ``(scale,
  amax_history)`` as the cotangents of those inputs.

  Args:
    x: floating array to quantize.
    scale: float32 ``(1,)``, the stored scale.
    amax_history: float32 ``(L,)``, the stored amax history (index 0 newest).
    cfg: the role's :class:`~fp8_linen.ScalingConfig` (default: e4m3, delayed).
    chain: ``None`` for the first use of this state in a step, else the
      ``chain_out`` of the previous use.

  Returns:
    ``(x_fp8, scale_out, chain_out)``; pass ``x_fp8`` and ``scale_out`` to
    :func:`dequantize`, ``chain_out`` to the next use of the same state.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> xq, s, _ = fl.quantize(jnp.array([2.0, 896.0]), jnp.ones((1,)), jnp.zeros((8,)))
    >>> s.tolist()  # first step: scale from this amax, no clipping
    [2.0]
  """
  cfg = cfg or ScalingConfig()
  x = jnp.asarray(x)
  owg.check_float("x", x)
  state = owg.check_state("input", owg.RoleState(scale, amax_history))
  first = chain is None
  return _quantize(cfg, jnp.dtype(x.dtype), first, owg.quantizers_frozen(), x, state,
                   owg.chain_init(1) if first else chain)


def dequantize(x_fp8, scale_out, grad_scale, grad_amax_history, *,
               grad_cfg: ScalingConfig | None = None, dtype=jnp.float32, chain=None,
               exact: bool = False):
  """Dequantizes ``x_fp8`` and quantizes the gradient flowing back through it.

  Forward: ``x_fp8 * scale_out`` in ``dtype``. Backward: picks the gradient's
  scale (from ``grad_amax_history``, or from the gradient itself on the first
  step), quantizes the gradient to ``grad_cfg.dtype`` (e5m2 by default) and
  returns it as the cotangent of ``x_fp8``, the scale as the cotangent of the
  dummy ``scale_out``, and the new gradient state as the cotangents of
  ``grad_scale``/``grad_amax_history``.

  Args:
    x_fp8: the fp8 value from :func:`quantize`.
    scale_out: the scale output of :func:`quantize`.
    grad_scale: float32 ``(1,)``, the stored gradient scale.
    grad_amax_history: float32 ``(L,)``, the stored gradient amax history.
    grad_cfg: the gradient role's config (default: e5m2, delayed).
    dtype: the dtype to dequantize to.
    chain: ``None`` for the first use of the gradient state, else the previous
      use's ``chain_out``.
    exact: read the codes through their bits. XLA:GPU drops a cast to fp8
      followed by a cast back (excess precision, its default), so a value
      that feeds anything but a dot XLA makes an fp8 GEMM of would carry no
      rounding there; ``True`` keeps it (and keeps XLA from making an fp8
      GEMM of a dot it feeds). ``Fp8Activation`` uses it.

  Returns:
    ``(x, chain_out)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> def f(x):
    ...   xq, s, _ = fl.quantize(x, jnp.ones((1,)), jnp.zeros((8,)))
    ...   return fl.dequantize(xq, s, jnp.ones((1,)), jnp.zeros((8,)))[0]
    >>> float(jax.grad(lambda x: 1000.0 * f(x))(5.0))
    1000.0
  """
  grad_cfg = grad_cfg or ScalingConfig(dtype="float8_e5m2")
  state = owg.check_state("output_grad", owg.RoleState(grad_scale, grad_amax_history))
  first = chain is None
  return _dequantize(grad_cfg, jnp.dtype(dtype), first, owg.quantizers_frozen(), bool(exact),
                     x_fp8, scale_out, state, owg.chain_init(1) if first else chain)
