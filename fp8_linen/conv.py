"""fp8 convolution: a custom_vjp op, its recipe dispatch and ``QConv``.

:func:`fp8_conv_general_dilated` is ``lax.conv_general_dilated`` with both
operands quantized per tensor (``recipe.input`` / ``recipe.kernel``, e4m3 by
default) and the output gradient quantized to ``recipe.output_grad`` (e5m2 by
default) before the input-gradient and kernel-gradient convolutions. Only the
fp8 copies of the operands are kept for the backward pass (named
:data:`fp8_linen.ops.CHECKPOINT_NAME` for remat policies). The state update
and the *chain* that links several uses of one state in a step follow
:mod:`fp8_linen.ops` exactly.

Lowerings (``recipe.gemm``):

* ``'fp8'`` (``'auto'`` on GPU): each fp8 operand is converted and multiplied by
  its scalar scale right before the convolution (``conv(convert(x_f8) * s_x,
  convert(w_f8) * s_w)``), the form XLA:GPU's cuDNN fp8 convolution rewrite
  matches. The gradient convolutions take the same dequantized form.
* ``'bf16'`` (``'auto'`` elsewhere): fp8 values are upcast exactly to bfloat16,
  the forward convolution accumulates in float32, and the product of the two
  scales multiplies the output. The gradient convolutions run in bfloat16.
* ``'f32'``: as ``'bf16'`` with float32 convolutions (exact reference path).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> conv = fl.QConv(features=4, kernel_size=(3, 3))
  >>> y, v = conv.init_with_output(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
  >>> y.shape, sorted(v['params'])
  ((1, 8, 8, 4), ['bias', 'kernel'])
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
from jax import lax

from fp8_linen import numerics, ops
from fp8_linen.general import _active
from fp8_linen.layers import ROLES, chained, role_state
from fp8_linen.recipes import Fp8Recipe, resolve_gemm

__all__ = ["fp8_conv_general_dilated", "register_conv", "quantized_conv_on", "QConv"]


def _conv(a, b, cfg, compute_dtype, preferred=None):
  strides, padding, lhs_dil, rhs_dil, dn, groups = cfg
  return lax.conv_general_dilated(a.astype(compute_dtype), b.astype(compute_dtype), strides,
                                  padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
                                  dimension_numbers=dn, feature_group_count=groups,
                                  preferred_element_type=preferred)


@functools.lru_cache(maxsize=None)
def _make_fp8_conv(conv_cfg, recipe: Fp8Recipe, gemm: str, out_dtype, lhs_dtype, rhs_dtype,
                   first: bool):
  cfgs = (recipe.input, recipe.kernel, recipe.output_grad)
  g_cfg = cfgs[2]

  def forward(lhs, rhs, ls, lh, rs, rh):
    q_l, q_r, s_l, s_r, a_l, a_r = ops.quantize_operands(cfgs, lhs, rhs, ls, lh, rs, rh)
    if gemm == "fp8":  # dequantize-then-conv: the cuDNN fp8 graph form
      a = q_l.astype(jnp.float32) * jnp.reshape(s_l, ())
      b = q_r.astype(jnp.float32) * jnp.reshape(s_r, ())
      y = _conv(a, b, conv_cfg, jnp.float32).astype(out_dtype)
    else:
      up = jnp.bfloat16 if gemm == "bf16" else jnp.float32  # fp8 -> bf16 is exact
      y = _conv(q_l, q_r, conv_cfg, up, preferred=jnp.float32)
      y = (y * jnp.reshape(s_l * s_r, ())).astype(out_dtype)
    return y, (q_l, q_r), (s_l, s_r, a_l, a_r)

  def backward(q_l, q_r, extras, states, g, ct_chain):
    s_l, s_r, a_l, a_r = extras
    gs, gh = states[2]
    a_g = numerics.amax(g)
    s_g = numerics.select_scale(g_cfg, gs, gh, a_g)
    q_g = numerics.quantize(g, g_cfg.jnp_dtype, s_g)
    if gemm == "fp8":
      deq = lambda q, s: q.astype(jnp.float32) * jnp.reshape(s, ())
      _, vjp = jax.vjp(lambda a, b: _conv(a, b, conv_cfg, jnp.float32),
                       deq(q_l, s_l), deq(q_r, s_r))
      d_lhs, d_rhs = vjp(deq(q_g, s_g))
    else:
      up = jnp.bfloat16 if gemm == "bf16" else jnp.float32
      _, vjp = jax.vjp(lambda a, b: _conv(a, b, conv_cfg, up), q_l.astype(up), q_r.astype(up))
      d_lhs, d_rhs = vjp(q_g.astype(up))
      d_lhs = d_lhs.astype(jnp.float32) * jnp.reshape(s_g * s_r, ())
      d_rhs = d_rhs.astype(jnp.float32) * jnp.reshape(s_g * s_l, ())
    return ops.operand_op_cotangents(cfgs, states, (a_l, a_r, a_g), ct_chain, first,
                                     d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype), q_l, q_r)

  return ops.operand_op(forward, backward)


def _ints(name: str, value, n: int) -> tuple[int, ...]:
  if value is None:
    return (1,) * n
  if isinstance(value, int):
    value = (value,) * n
  value = tuple(value)
  if len(value) != n or not all(isinstance(v, int) and v >= 1 for v in value):
    raise ValueError(f"fp8_conv_general_dilated: {name}={value!r} must be {n} positive ints "
                     "(one per spatial dimension)")
  return value


def _padding(padding, n: int):
  if isinstance(padding, str):
    if padding.upper() not in ("SAME", "VALID", "SAME_LOWER"):
      raise ValueError(f"fp8_conv_general_dilated: padding={padding!r} must be 'SAME', "
                       "'SAME_LOWER', 'VALID' or a sequence of (low, high) pairs")
    return padding.upper()
  pads = tuple(tuple(int(v) for v in p) for p in padding)
  if len(pads) != n or not all(len(p) == 2 for p in pads):
    raise ValueError(f"fp8_conv_general_dilated: padding={padding!r} must have one (low, high) "
                     f"pair per spatial dimension ({n})")
  return pads


def fp8_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                             rhs_dilation=None, dimension_numbers=None,
                             feature_group_count: int = 1, *, input_state: ops.RoleState,
                             kernel_state: ops.RoleState, output_grad_state: ops.RoleState,
                             recipe: Fp8Recipe | None = None, out_dtype=None, chain=None):
  """``lax.conv_general_dilated`` with fp8 operands and fp8 gradient convolutions.

  Forward: ``lhs`` and ``rhs`` are quantized with per-tensor scalar scales and
  convolved (see the module doc for the lowering). Backward: the output
  gradient is quantized to ``recipe.output_grad`` with a scale from the
  ``output_grad`` state (or from the gradient itself while the history is
  empty) and both gradient convolutions use the fp8 values. The new state of
  all three roles is returned as the cotangent of the state inputs.

  Args:
    lhs: floating input, layout given by ``dimension_numbers``.
    rhs: floating kernel.
    window_strides: one stride per spatial dimension.
    padding: ``'SAME'``, ``'SAME_LOWER'``, ``'VALID'`` or ``(low, high)`` pairs.
    lhs_dilation: input dilation per spatial dimension (default 1).
    rhs_dilation: kernel dilation per spatial dimension (default 1).
    dimension_numbers: as for ``lax.conv_general_dilated`` (default NC..., OI...).
    feature_group_count: grouped convolution count.
    input_state: :class:`~fp8_linen.ops.RoleState` of ``lhs``.
    kernel_state: :class:`~fp8_linen.ops.RoleState` of ``rhs``.
    output_grad_state: :class:`~fp8_linen.ops.RoleState` of the output gradient.
    recipe: the :class:`~fp8_linen.Fp8Recipe` (default: delayed e4m3/e5m2).
    out_dtype: output dtype (default: the result type of ``lhs`` and ``rhs``).
    chain: ``None`` for the first use of these states in a step, else the
      previous use's ``chain_out``.

  Returns:
    ``(out, chain_out)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import conv, ops
    >>> st = lambda: ops.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
    >>> y, _ = conv.fp8_conv_general_dilated(
    ...     jnp.ones((1, 1, 5)), jnp.ones((1, 1, 3)), (1,), 'VALID',
    ...     input_state=st(), kernel_state=st(), output_grad_state=st())
    >>> [round(v, 4) for v in y.ravel().tolist()]
    [3.0, 3.0, 3.0]
  """
  recipe = recipe or Fp8Recipe()
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  ops._check_float("lhs", lhs)
  ops._check_float("rhs", rhs)
  if lhs.ndim < 3 or lhs.ndim != rhs.ndim:
    raise ValueError(f"fp8_conv_general_dilated: lhs (shape {lhs.shape}) and rhs (shape "
                     f"{rhs.shape}) must have the same rank >= 3 (batch, feature, spatial...)")
  n = lhs.ndim - 2
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
  if not isinstance(feature_group_count, int) or feature_group_count < 1:
    raise ValueError(f"fp8_conv_general_dilated: feature_group_count={feature_group_count!r} "
                     "must be a positive int")
  in_feat = lhs.shape[dn.lhs_spec[1]]
  k_in, k_out = rhs.shape[dn.rhs_spec[1]], rhs.shape[dn.rhs_spec[0]]
  if in_feat != k_in * feature_group_count or k_out % feature_group_count:
    raise ValueError(
        f"fp8_conv_general_dilated: lhs has {in_feat} input features but rhs expects "
        f"{k_in} x feature_group_count={feature_group_count}; lhs.shape={lhs.shape}, "
        f"rhs.shape={rhs.shape}")
  conv_cfg = (_ints("window_strides", window_strides, n), _padding(padding, n),
              _ints("lhs_dilation", lhs_dilation, n), _ints("rhs_dilation", rhs_dilation, n),
              dn, feature_group_count)
  states = []
  for name, st in (("input", input_state), ("kernel", kernel_state),
                   ("output_grad", output_grad_state)):
    st = ops._as_state(*st)
    ops._check_state(name, recipe.role(name), st)
    states.append(st)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  first = chain is None
  chain = ops.chain_init(3) if first else chain
  op = _make_fp8_conv(conv_cfg, recipe, resolve_gemm(recipe), out_dtype, jnp.dtype(lhs.dtype),
                      jnp.dtype(rhs.dtype), first)
  (ls, lh), (rs, rh), (gs, gh) = states
  return op(lhs, rhs, ls, lh, rs, rh, gs, gh, chain)


# ----------------------------------------------------------------------------
# Recipe dispatch for convolutions (the analogue of layers.register_dot_general).
# ----------------------------------------------------------------------------


def _fp8_conv_on(module: nn.Module, lhs, rhs, conv_kwargs: dict, recipe: Fp8Recipe,
                 out_dtype=None, key: str = "conv"):
  states = [role_state(module, r, recipe.role(r)) for r in ROLES]
  return chained(module, key, lambda chain: fp8_conv_general_dilated(
      lhs, rhs, **conv_kwargs, input_state=states[0], kernel_state=states[1],
      output_grad_state=states[2], recipe=recipe, out_dtype=out_dtype, chain=chain))


# recipe type -> fn(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key) -> out
_CONV_IMPLS: dict[type, Callable] = {}


def register_conv(recipe_type: type, impl: Callable) -> None:
  """Registers how layers run a convolution for recipes of ``recipe_type``.

  ``impl(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)`` declares the
  state it needs on ``module`` and returns the convolution. ``conv_kwargs``
  holds ``window_strides``, ``padding``, ``lhs_dilation``, ``rhs_dilation``,
  ``dimension_numbers`` and ``feature_group_count`` as for
  ``lax.conv_general_dilated``.
  """
  _CONV_IMPLS[recipe_type] = impl


def quantized_conv_on(module: nn.Module, lhs, rhs, conv_kwargs: dict, recipe,
                      out_dtype=None, key: str = "conv"):
  """Runs the quantized convolution that ``recipe``'s type registered."""
  for klass in type(recipe).__mro__:
    if klass in _CONV_IMPLS:
      return _CONV_IMPLS[klass](module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)
  raise TypeError(f"{type(recipe).__name__} has no registered convolution; known recipe "
                  f"types: {sorted(t.__name__ for t in _CONV_IMPLS)}")


register_conv(Fp8Recipe, _fp8_conv_on)


# ----------------------------------------------------------------------------
# QConv.
# ----------------------------------------------------------------------------

_ACTIVE_CONV: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_active_conv",
                                                              default=None)


def conv_kwargs_from(window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                     dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                     **unused) -> dict:
  """Collects ``lax.conv_general_dilated``'s layout arguments into a dict.

  ``precision`` and ``preferred_element_type`` are dropped (fp8 convolutions
  choose their own); ``batch_group_count`` other than 1 is rejected.
  """
  unused.pop("precision", None)
  unused.pop("preferred_element_type", None)
  if unused:
    raise TypeError(f"unsupported conv_general_dilated arguments: {sorted(unused)}")
  if batch_group_count != 1:
    raise NotImplementedError("fp8 convolutions do not support batch_group_count != 1")
  return dict(window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation,
              rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
              feature_group_count=feature_group_count)


def _layer_conv(lhs, rhs, *args, **kwargs):
  """The ``conv_general_dilated`` a :class:`QConv` hands to flax's body."""
  active = _ACTIVE_CONV.get()
  if active is None:
    raise RuntimeError("fp8_linen: this convolution only runs inside QConv.__call__")
  module, recipe, out_dtype = active
  return quantized_conv_on(module, lhs, rhs, conv_kwargs_from(*args, **kwargs), recipe,
                           out_dtype=out_dtype or jnp.result_type(lhs, rhs))


class QConv(nn.Conv):
  """Drop-in for ``nn.Conv`` whose convolution runs in fp8.

  Same arguments (1D/2D/3D ``kernel_size``, ``strides``, ``padding`` incl.
  ``'SAME'``, ``'VALID'``, ``'CAUSAL'``, ``'CIRCULAR'``, ``'REFLECT'`` and explicit
  pairs, ``input_dilation``, ``kernel_dilation``, ``feature_group_count``) and
  the same ``params`` tree (``kernel``, ``bias``) as ``nn.Conv``; the fp8 state
  is added in the :data:`~fp8_linen.OWG` collection at the same path. Shared
  weights only (``nn.ConvLocal`` has no fp8 twin); ``conv_general_dilated`` and
  ``conv_general_dilated_cls`` must be left at their defaults.

  Attributes:
    recipe: the recipe (:class:`~fp8_linen.Fp8Recipe` by default; any type
      registered with :func:`register_conv`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> conv = fl.QConv(features=2, kernel_size=(3,), padding='CAUSAL')
    >>> y, _ = conv.init_with_output(jax.random.key(0), jnp.ones((4, 10, 3)))
    >>> y.shape
    (4, 10, 2)
  """

  conv_general_dilated: Any = _layer_conv
  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs):
    if self.conv_general_dilated is not _layer_conv or self.conv_general_dilated_cls is not None:
      raise ValueError("QConv brings its own fp8 convolution; leave conv_general_dilated and "
                       "conv_general_dilated_cls at their defaults")
    if not self.shared_weights:
      raise ValueError("QConv.shared_weights must be True (unshared convolutions have no fp8 "
                       "path)")
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.floating):
      raise TypeError(f"QConv: inputs must be a floating array, got dtype {inputs.dtype}")
    ks = (self.kernel_size,) if isinstance(self.kernel_size, int) else tuple(self.kernel_size)
    if not all(isinstance(k, int) and k >= 1 for k in ks):
      raise ValueError(f"QConv.kernel_size={self.kernel_size!r} must be positive ints")
    if inputs.ndim < len(ks) + 1:
      raise ValueError(f"QConv: inputs of shape {inputs.shape} have fewer dimensions than "
                       f"kernel_size={ks} needs ({len(ks)} spatial + features)")
    groups = self.feature_group_count
    if not isinstance(groups, int) or groups < 1 or inputs.shape[-1] % groups or \
        self.features % groups:
      raise ValueError(f"QConv.feature_group_count={groups!r} must be a positive int that "
                       f"divides both the input features ({inputs.shape[-1]}) and "
                       f"features ({self.features})")
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    with _active(_ACTIVE_CONV, (self, self.recipe, jnp.dtype(dtype))):
      return super().__call__(inputs)
