"""The fp8 convolution: ``lax.conv_general_dilated`` with fp8 operands and gradients.

:func:`fp8_conv_general_dilated` is ``lax.conv_general_dilated`` with both
operands quantized per tensor (``recipe.input`` / ``recipe.kernel``, e4m3 by
default) and the output gradient quantized to ``recipe.output_grad`` (e5m2 by
default) before the input-gradient and kernel-gradient convolutions. Only the
fp8 copies of the operands are kept for the backward pass (named
:data:`fp8_linen.CHECKPOINT_NAME` for remat policies). The state update
and the *chain* that links several uses of one state in a step follow
:mod:`fp8_linen.core.owg` exactly.

Lowerings (``recipe.gemm``):

* ``'fp8'`` (``'auto'`` on GPU): each fp8 operand is converted and multiplied by
  its scalar scale right before the convolution (``conv(convert(x_f8) * s_x,
  convert(w_f8) * s_w)``), the form XLA:GPU's cuDNN fp8 convolution rewrite
  matches. The input gradient is a convolution of the same form (e5m2 gradient x
  e4m3 kernel); the kernel gradient runs as fp8 GEMMs, one per kernel offset
  (see :func:`_fp8_wgrad`).
* ``'bf16'`` (``'auto'`` elsewhere): fp8 values are upcast exactly to bfloat16,
  the forward convolution accumulates in float32, and the product of the two
  scales multiplies the output. The gradient convolutions run in bfloat16.
* ``'f32'``: as ``'bf16'`` with float32 convolutions (exact reference path).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> st = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
  >>> f = lambda x, w: fl.fp8_conv_general_dilated(x, w, (1, 1), 'SAME', input_state=st(),
  ...     kernel_state=st(), output_grad_state=st(), recipe=fl.Fp8Recipe(gemm='fp8'))[0]
  >>> jax.grad(lambda w: f(jnp.ones((1, 2, 4, 4)), w).sum())(jnp.ones((3, 2, 3, 3))).shape
  (3, 2, 3, 3)
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8_linen.core import lowering, mesh, numerics, owg
from fp8_linen.core.fp8_vjp import Fp8Spec, fp8_vjp
from fp8_linen.recipes.fp8 import Fp8Recipe

__all__ = ["ConvSpec", "fp8_conv_general_dilated", "fp8_conv_of", "conv_config", "conv_kwargs_from"]


def _conv(a, b, cfg, compute_dtype, preferred=None):
  strides, padding, lhs_dil, rhs_dil, dn, groups = cfg
  return lowering.lax_conv_general_dilated(
      a.astype(compute_dtype), b.astype(compute_dtype), strides, padding, lhs_dilation=lhs_dil,
      rhs_dilation=rhs_dil, dimension_numbers=dn, feature_group_count=groups,
      preferred_element_type=preferred, out_sharding=lowering.conv_out_sharding(a, b, dn))


def _deq(q, s):
  return q.astype(jnp.float32) * jnp.reshape(s, ())


def _fp8_dgrad(q_l, q_r, q_g, s_r, s_g, cfg):
  """The input gradient as a convolution whose operands are ``convert(fp8) * scale``.

  XLA:GPU's cuDNN fp8 rewrite matches only forward convolutions whose operands
  are directly ``convert(f8) * scalar``. Differentiating the dequantized
  kernel puts a reversal between the dequantize and the convolution, so the
  kernel is reversed in fp8 first and reversed back inside the differentiated
  function: autodiff's own reversal cancels it and XLA folds the pair.
  """
  spatial = tuple(cfg[4].rhs_spec[2:])
  r_rev = lax.rev(q_r, spatial)
  # The function is linear in ``a``: any point with ``q_l``'s type (sharding
  # included) linearizes it.
  _, vjp = jax.vjp(lambda a: _conv(a, lax.rev(_deq(r_rev, s_r), spatial), cfg, jnp.float32),
                   q_l.astype(jnp.float32))
  return vjp(_deq(q_g, s_g))[0]


def _fp8_wgrad(q_l, q_g, q_r, cfg):
  """The kernel gradient as one fp8 GEMM per kernel offset (``None`` where unsupported).

  XLA classifies a kernel-gradient convolution as a backward-filter
  convolution, which its fp8 rewrite never matches; as GEMMs of fp8 slices of
  the padded input by the fp8 gradient (which XLA merges into one cuBLASLt fp8
  matmul) it runs in fp8. The slices cost one fp8 copy of the input per kernel
  offset. Grouped and input-dilated convolutions return ``None``.
  """
  strides, padding, lhs_dil, rhs_dil, dn, groups = cfg
  if groups != 1 or any(d != 1 for d in lhs_dil):
    return None
  lhs_spec, rhs_spec, out_spec = dn
  n = len(lhs_spec) - 2
  ks = [q_r.shape[d] for d in rhs_spec[2:]]
  in_sp = [q_l.shape[d] for d in lhs_spec[2:]]
  out_sp = [q_g.shape[d] for d in out_spec[2:]]
  if isinstance(padding, str):
    eff = [(k - 1) * d + 1 for k, d in zip(ks, rhs_dil)]
    padding = lax.padtype_to_pads(in_sp, eff, strides, padding)
  pads = [(0, 0, 0)] * q_l.ndim
  for i, d in enumerate(lhs_spec[2:]):
    pads[d] = (padding[i][0], padding[i][1], 0)
  xp = lax.pad(q_l, jnp.zeros((), q_l.dtype), pads)
  l_con = (lhs_spec[0],) + tuple(lhs_spec[2:])
  g_con = (out_spec[0],) + tuple(out_spec[2:])
  perm = [0] * (n + 2)  # (k..., I, O) -> the kernel's layout
  perm[rhs_spec[0]], perm[rhs_spec[1]] = n + 1, n
  for i, d in enumerate(rhs_spec[2:]):
    perm[d] = i
  # On an explicit mesh each (I, O) product is sharded like the kernel's features.
  w_sharding = lowering.like_sharding(q_r, perm)
  io_sharding = (None if w_sharding is None
                 else w_sharding.update(spec=P(*tuple(w_sharding.spec)[n:])))
  outs = []
  for k in itertools.product(*[range(x) for x in ks]):
    start, limit, step = [0] * xp.ndim, list(xp.shape), [1] * xp.ndim
    for i, d in enumerate(lhs_spec[2:]):
      start[d] = k[i] * rhs_dil[i]
      limit[d] = start[d] + (out_sp[i] - 1) * strides[i] + 1
      step[d] = strides[i]
    xk = lax.slice(xp, start, limit, step)
    outs.append(lowering.lax_dot_general(xk, q_g, ((l_con, g_con), ((), ())),
                                         preferred_element_type=jnp.float32,
                                         out_sharding=io_sharding))  # (C_in, C_out)
  w = jnp.stack(outs).reshape(tuple(ks) + outs[0].shape)  # (k..., I, O)
  return jnp.transpose(w, perm)


def _on_mesh(a, b, conv_cfg, which: str, local, a_scale, b_scale, out_sharding=None):
  """``local(a, b, (a_scale,), (b_scale,), out_sharding)``, fp8 codes moved as codes on a mesh.

  See :func:`fp8_linen.core.mesh.multiply_codes`; the scalar scales ride along as
  size-1 arrays of the operands' rank. Grouped convolutions run as they are.
  """
  as_param = lambda s, like: jnp.reshape(jnp.asarray(s, jnp.float32), (1,) * like.ndim)
  pa, pb = (as_param(a_scale, a),), (as_param(b_scale, b),)
  if conv_cfg[5] != 1:
    return local(a, b, pa, pb, out_sharding)
  return mesh.multiply_codes(a, b, mesh.conv_roles(conv_cfg[4], a.ndim, which), local,
                             lhs_params=pa, rhs_params=pb, out_sharding=out_sharding)


def fp8_conv_of(q_l, s_l, q_r, s_r, conv_cfg, gemm: str, out_dtype):
  """The forward convolution of two fp8 operands with scalar scales, lowered as ``gemm``.

  Shared by the training product and the served model (``core/fp8_serve.py``).
  ``conv_cfg`` is :func:`conv_config`'s tuple. On a mesh the operands move as
  fp8 codes (:func:`fp8_linen.core.mesh.multiply_codes`).
  """
  def local(a, b, pa, pb, _):
    (sa,), (sb,) = pa, pb
    if gemm == "fp8":  # dequantize-then-conv: the cuDNN fp8 graph form
      return _conv(_deq(a, sa), _deq(b, sb), conv_cfg, jnp.float32).astype(out_dtype)
    up = jnp.bfloat16 if gemm == "bf16" else jnp.float32  # fp8 -> bf16 is exact
    y = _conv(a, b, conv_cfg, up, preferred=jnp.float32)
    return (y * jnp.reshape(numerics.scale_product(sa, sb), ())).astype(out_dtype)

  return _on_mesh(q_l, q_r, conv_cfg, "forward", local, s_l, s_r)


def conv_config(n: int, window_strides, padding, lhs_dilation, rhs_dilation, dn,
                feature_group_count: int) -> tuple:
  """Checked, static convolution arguments for ``n`` spatial dimensions (see :func:`fp8_conv_of`)."""
  return (_ints("window_strides", window_strides, n), _padding(padding, n),
          _ints("lhs_dilation", lhs_dilation, n), _ints("rhs_dilation", rhs_dilation, n),
          dn, feature_group_count)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvSpec(Fp8Spec):
  """A per-tensor fp8 convolution (a spec of :func:`fp8_linen.core.fp8_vjp.fp8_vjp`)."""

  conv_cfg: Any

  def forward(self, lhs, rhs, states):
    c_l, c_r, _ = self.cfgs
    q_l, s_l, a_l = numerics.quantize_with(c_l, *states[0], lhs)
    q_r, s_r, a_r = numerics.quantize_with(c_r, *states[1], rhs, weight=True, barrier=False)
    y = fp8_conv_of(q_l, s_l, q_r, s_r, self.conv_cfg, self.gemm, self.out_dtype)
    return y, (q_l, q_r), (a_l, a_r), (s_l, s_r)

  def backward(self, q_l, q_r, extras, states, g):
    s_l, s_r = extras
    q_g, s_g, a_g = numerics.quantize_with(self.cfgs[2], *states[2], g, gradient=True)
    cfg = self.conv_cfg
    (x_n, x_c), (w_o, w_i), (y_n, y_o) = (cfg[4].lhs_spec[:2], cfg[4].rhs_spec[:2],
                                          cfg[4].out_spec[:2])
    groups = cfg[5]

    # Each gradient is a product of the gradient's fp8 codes and one operand's,
    # moved as codes on a mesh (the ones the forward product moved). The
    # shapes below are those of the codes each device holds then.
    def x_shape(gq, wq):
      shape = list(q_l.shape)
      shape[x_n], shape[x_c] = gq.shape[y_n], wq.shape[w_i] * groups
      return tuple(shape)

    def w_shape(xq, gq):
      shape = list(q_r.shape)
      shape[w_o], shape[w_i] = gq.shape[y_o], xq.shape[x_c] // groups
      return tuple(shape)

    if self.gemm == "fp8":
      def dgrad(gq, wq, pg, pw, sharding):
        at = mesh.sharded_zeros(x_shape(gq, wq), q_l.dtype, sharding)
        return _fp8_dgrad(at, wq, gq, pw[0], pg[0], cfg)

      def wgrad(xq, gq, px, pg, sharding):
        d = _fp8_wgrad(xq, gq, mesh.sharded_zeros(w_shape(xq, gq), q_r.dtype, sharding), cfg)
        if d is None:  # grouped / input-dilated: the dequantized (non-fp8) form
          _, vjp = jax.vjp(lambda b: _conv(_deq(xq, px[0]), b, cfg, jnp.float32),
                           mesh.sharded_zeros(w_shape(xq, gq), jnp.float32, sharding))
          return vjp(_deq(gq, pg[0]))[0]
        return d * jnp.reshape(numerics.scale_product(px[0], pg[0]), ())
    else:
      up = jnp.bfloat16 if self.gemm == "bf16" else jnp.float32

      def dgrad(gq, wq, pg, pw, sharding):
        _, vjp = jax.vjp(lambda a: _conv(a, wq.astype(up), cfg, up),
                         mesh.sharded_zeros(x_shape(gq, wq), up, sharding))
        d = vjp(gq.astype(up))[0]
        return d.astype(jnp.float32) * jnp.reshape(numerics.scale_product(pg[0], pw[0]), ())

      def wgrad(xq, gq, px, pg, sharding):
        _, vjp = jax.vjp(lambda b: _conv(xq.astype(up), b, cfg, up),
                         mesh.sharded_zeros(w_shape(xq, gq), up, sharding))
        d = vjp(gq.astype(up))[0]
        return d.astype(jnp.float32) * jnp.reshape(numerics.scale_product(pg[0], px[0]), ())

    d_lhs = _on_mesh(q_g, q_r, cfg, "dgrad", dgrad, s_g, s_r, lowering.like_sharding(
        q_l, tuple(range(q_l.ndim))))
    d_rhs = _on_mesh(q_l, q_g, cfg, "wgrad", wgrad, s_l, s_g, lowering.like_sharding(
        q_r, tuple(range(q_r.ndim))))
    return d_lhs.astype(self.lhs_dtype), d_rhs.astype(self.rhs_dtype), a_g


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
                             feature_group_count: int = 1, *, input_state: owg.RoleState,
                             kernel_state: owg.RoleState, output_grad_state: owg.RoleState,
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
    input_state: :class:`~fp8_linen.RoleState` of ``lhs``.
    kernel_state: :class:`~fp8_linen.RoleState` of ``rhs``.
    output_grad_state: :class:`~fp8_linen.RoleState` of the output gradient.
    recipe: the :class:`~fp8_linen.Fp8Recipe` (default: delayed e4m3/e5m2).
    out_dtype: output dtype (default: the result type of ``lhs`` and ``rhs``).
    chain: ``None`` for the first use of these states in a step, else the
      previous use's ``chain_out``.

  Returns:
    ``(out, chain_out)``.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> st = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
    >>> y, _ = fl.fp8_conv_general_dilated(
    ...     jnp.ones((1, 1, 5)), jnp.ones((1, 1, 3)), (1,), 'VALID',
    ...     input_state=st(), kernel_state=st(), output_grad_state=st())
    >>> [round(v, 4) for v in y.ravel().tolist()]
    [3.0, 3.0, 3.0]
  """
  recipe = recipe or Fp8Recipe()
  if recipe.granularity != "tensor":
    raise ValueError(
        f"fp8_conv_general_dilated: recipe.granularity={recipe.granularity!r} is not "
        "supported for convolutions (only 'tensor'); use current_scaling() or "
        "delayed_scaling() for convolutions")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  owg.check_float("lhs", lhs)
  owg.check_float("rhs", rhs)
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
  conv_cfg = conv_config(n, window_strides, padding, lhs_dilation, rhs_dilation, dn,
                         feature_group_count)
  states = tuple(owg.check_state(name, st) for name, st in zip(
      owg.ROLES, (input_state, kernel_state, output_grad_state)))
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  first = chain is None
  spec = ConvSpec(conv_cfg=conv_cfg, recipe=recipe, gemm=lowering.resolve_gemm(recipe),
                  out_dtype=out_dtype, lhs_dtype=jnp.dtype(lhs.dtype),
                  rhs_dtype=jnp.dtype(rhs.dtype), first=first,
                  frozen=owg.quantizers_frozen())
  return fp8_vjp(spec, lhs, rhs, states, owg.chain_init(3) if first else chain)


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
