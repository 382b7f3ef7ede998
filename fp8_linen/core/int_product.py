"""The integer product: int8 codes in, one exact integer GEMM, the scales once.

An integer QAT product ``dot_general(x_hat, w_hat)`` (or a convolution) of two
fake-quantized operands is computed here from their integer *codes*, with
its own custom_vjp:

* each operand is quantized once to int8 codes with float32 parameters that
  make its fake-quantized value exact (:mod:`~fp8_linen.core.int_codes`);
* the codes are multiplied in one exact integer GEMM and the scales applied
  once to the int32 result (:mod:`~fp8_linen.core.int_gemm`, shared with the
  served model);
* the backward pass reads the codes (STE) or the operand itself (LSQ/LSQ+,
  whose step gradient needs each element's rounding error ``round(v) - v``,
  which a code does not hold), never a float fake-quantized copy, and gives
  the same gradients as the fake-quant ops of :mod:`fp8_linen.core.int_ops`
  (LSQ/LSQ+ through the very same :func:`~fp8_linen.core.int_ops.lsq_backward`).

STE masks: a weight quantized with its own min/max and an activation under a
``'minmax'`` observer (whose range includes the batch) have no element outside
the range, so their straight-through gradient passes everywhere and only the
codes are saved. A ``'moving_average'`` observer can clip, so its mask is kept
as packed bits (1/8 byte per element).

The custom_vjp is this module's own, not :func:`~fp8_linen.core.fp8_vjp.fp8_vjp`:
what an integer product carries through it differs from the fp8 state
protocol (its inputs are the quantizers' parameters: an observer's range,
returned as its new value like fp8 state, and LSQ steps and offsets, which get
real gradients; its residuals are codes, scales and packed masks, or the
operand itself).

:func:`int_dot_general` and :func:`int_conv_general_dilated` are the ops;
:func:`operand_params` and :func:`run_product` run one with a layer's
variables (the Linen and NNX layers share them).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import int_product
  >>> # Ranges of 127 make both scales 1, so the codes are the values themselves.
  >>> x = jnp.array([[1.0, -2.0], [127.0, 4.0]]); w = jnp.array([[1.0], [127.0]])
  >>> y, _ = int_product.int_dot_general(x, w, (((1,), (0,)), ((), ())), recipe=fl.IntRecipe(),
  ...     input_params=(jnp.zeros(2),), kernel_params=())
  >>> y.ravel().tolist()
  [-253.0, 635.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8_linen.core import (dims, grouped_kernels, int_numerics, int_ops, lowering, mesh, owg,
                            randomness, uses)
from fp8_linen.core.int_codes import Codes, Operand, dequantize, quantize, rank_like
from fp8_linen.core.int_gemm import (conv_fn, conv_supported, contracted, int_conv, int_gemm,
                                     resolve_compute_dtype, resolve_int_gemm)
from fp8_linen.core.lowering import grad_gemm, relayout
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["int_dot_general", "int_conv_general_dilated", "int_ragged_dot", "ragged_supported",
           "ragged_code_gemm",
           "operand_params", "run_product"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Spec:
  x: Operand
  w: Operand
  how: str          # forward lowering: 'int8' or 'bf16'
  grad_dtype: Any   # operands of the gradient GEMMs (resolve_compute_dtype)
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any
  first: bool
  lhs_shape: tuple
  rhs_shape: tuple
  grad_bits: int | None = None
  grad_sr: bool = False  # IntRecipe.grad_stochastic_rounding
  frozen: bool = False  # owg.frozen_quantizers() when the product was called
  rhs_grad_dtype: Any = None  # the weight's parameter dtype (lowering.grad_dtype_for)
  # The dtype rhs arrives in when it is the layer's parameter handed uncast
  # (rhs_dtype: the dtype it is quantized and differentiated in), or None.
  rhs_param_dtype: Any = None

  @property
  def wgrad_dtype(self):
    """The dtype an STE weight gradient's GEMM writes (``Fp8Spec.wgrad_dtype``'s reason)."""
    return self.rhs_grad_dtype or self.rhs_dtype

  def grad_noise(self, shape, xc: Codes, wc: Codes):
    """``noise(salt)``: the uniform [0, 1) values that round the gradient's codes.

    ``None`` (round to nearest) without ``grad_stochastic_rounding``; the
    draws are seeded by the operands' scales.
    """
    if not self.grad_sr:
      return lambda salt: None
    seed = randomness.bits_seed(xc.scale, wc.scale)
    return lambda salt: randomness.uniform_noise(shape, seed, salt)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DotSpec(_Spec):
  dn: Any

  def forward(self, xc, wc, lhs_shape):
    return int_gemm(xc, wc, self.dn, lhs_shape=lhs_shape, how=self.how,
                    group=self.w.cfg.granularity == "group")

  def grads(self, g, xh, wh):
    one = jnp.ones((), jnp.float32)
    nd = (xh.ndim, wh.ndim)
    # LSQ sums the gradient into its step in float32; STE casts it to the
    # operand's dtype right away.
    lt = jnp.float32 if self.x.cfg.learned else self.lhs_dtype
    rt = jnp.float32 if self.w.cfg.learned else self.wgrad_dtype
    how = "bf16" if self.grad_dtype == jnp.bfloat16 else "f32"
    if how == "bf16" and lowering.current_backend() == "gpu":
      # A GPU GEMM writes its output in the gradient's dtype straight from its
      # float32 accumulator: no output-sized float32 buffer and cast.
      how, g = "fp8", g.astype(jnp.bfloat16)
    return (grad_gemm(g, wh, self.dn, *nd, "lhs", how, lt, one, like=xh),
            grad_gemm(g, xh, self.dn, *nd, "rhs", how, rt, one, like=wh))


  def code_grads(self, g, xc: Codes, wc: Codes):
    """:meth:`grads` with each operand given as its codes, dequantized where it is multiplied.

    The same products bit for bit (each operand is dequantized by the same
    expression, on each device after the codes moved): on a mesh the weight
    an FSDP layer gathers for its input gradient is gathered as int8 codes,
    the very array its forward product gathered, instead of its bfloat16
    dequantized copy. ``None`` where the codes are in another shape than the
    operand (``'group'`` views), for :meth:`grads` to run instead.
    """
    if xc.codes.shape != self.lhs_shape or wc.codes.shape != self.rhs_shape:
      return None
    nd = (len(self.lhs_shape), len(self.rhs_shape))
    lt = jnp.float32 if self.x.cfg.learned else self.lhs_dtype
    rt = jnp.float32 if self.w.cfg.learned else self.wgrad_dtype
    how = "bf16" if self.grad_dtype == jnp.bfloat16 else "f32"
    if how == "bf16" and lowering.current_backend() == "gpu":
      how, g = "fp8", g.astype(jnp.bfloat16)
    return (_code_grad_gemm(g, wc, xc.codes, self.dn, nd, "lhs", how, lt, self.grad_dtype),
            _code_grad_gemm(g, xc, wc.codes, self.dn, nd, "rhs", how, rt, self.grad_dtype))

  def int_grads(self, g, xc: Codes, wc: Codes):
    """Both gradient GEMMs on integer codes (``IntRecipe.grad_bits``).

    Each operand's scale lies along the contracted axis of one gradient GEMM,
    so it is folded into ``g`` before ``g`` is quantized for that GEMM: dgrad
    quantizes ``g * s_w`` per row (over the weight's free axes), wgrad
    quantizes ``g`` per column (over the activation's free axes; ``s_x`` is a
    scalar). Both GEMMs are int8 x int8 -> int32 and their outputs are
    multiplied by the gradient's scales (and ``s_x``).
    """
    one = jnp.ones((), jnp.float32)
    lay = dims.layout(self.dn, len(self.lhs_shape), len(self.rhs_shape))
    nd = (len(self.lhs_shape), len(self.rhs_shape))
    g32 = g.astype(jnp.float32)
    qmax = 2 ** (self.grad_bits - 1) - 1
    noise = self.grad_noise(g32.shape, xc, wc)
    g1 = g32 * relayout(rank_like(wc.scale, wc.codes), lay.rhs_to_out, g32.ndim)
    q1, s1 = _int_rows(g1, lay.rhs_free_out, qmax, noise(1))
    d_x = grad_gemm(q1, wc.codes, self.dn, *nd, "lhs", "fp8", jnp.int32, one)
    d_x = d_x.astype(jnp.float32) * relayout(s1, dims.flip(lay.lhs_to_out), d_x.ndim)
    q2, s2 = _int_rows(g32, lay.lhs_free_out, qmax, noise(2))
    d_w = grad_gemm(q2, xc.codes.reshape(self.lhs_shape), self.dn, *nd, "rhs", "fp8",
                    jnp.int32, one)
    d_w = (d_w.astype(jnp.float32) * relayout(s2, dims.flip(lay.rhs_to_out), d_w.ndim)
           * jnp.reshape(xc.scale, ()))
    return d_x, d_w


def _code_grad_gemm(g, other: Codes, like, dn, nd, wrt: str, how: str, out_dtype, grad_dtype):
  """``grad_gemm(g, dequantize(other))`` w.r.t. ``wrt``, ``other`` moved on a mesh as codes.

  ``like`` is the differentiated operand (its codes): on an explicit mesh the
  gradient is sharded like it.
  """
  gdn, g_first, perm = dims.grad_dims(dn, *nd, wrt)
  params, has = _code_params(other)
  operand = lambda codes, ps: _dequantized(codes, ps, has, grad_dtype)

  if g_first:
    local = lambda a, b, _pa, pb, sh: lowering.gemm(a, operand(b, pb), gdn, how, out_dtype, sh)
    a, b, pa, pb = g, other.codes, (), params
  else:
    local = lambda a, b, pa, _pb, sh: lowering.gemm(operand(a, pa), b, gdn, how, out_dtype, sh)
    a, b, pa, pb = other.codes, g, params, ()
  y = mesh.multiply_codes(a, b, mesh.dot_roles(gdn, a.ndim, b.ndim), local, lhs_params=pa,
                          rhs_params=pb, out_sharding=lowering.like_sharding(like, perm))
  return jnp.transpose(y.astype(out_dtype), perm)


def _int_rows(t, axes, qmax: int, noise=None):
  """``t`` quantized to int8 with one scale per slice along ``axes`` (kept size 1).

  Round to nearest, or with ``noise`` (uniform [0, 1) of ``t``'s shape)
  stochastically: ``floor(t / s + u)`` is ``t / s`` in expectation.
  """
  s = jnp.max(jnp.abs(t), axis=tuple(axes), keepdims=True) / qmax if axes else \
      jnp.abs(t) / qmax
  s = jnp.where(s > 0, s, jnp.ones_like(s))
  return _int_codes(t, s, qmax, noise), s


def _int_codes(t, s, qmax: int, noise=None):
  """``t / s`` as int8 codes in [-qmax, qmax], rounded as :func:`_int_rows` rounds."""
  v = t / s
  v = jnp.round(v) if noise is None else jnp.floor(v + noise)
  return jnp.clip(v, -qmax, qmax).astype(jnp.int8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ConvSpec(_Spec):
  conv: Any

  def forward(self, xc, wc, lhs_shape):
    del lhs_shape
    return int_conv(xc, wc, self.conv, how=self.how)

  def grads(self, g, xh, wh):
    fn = conv_fn(self.conv, lowering.conv_out_sharding(xh, wh, self.conv[4]))
    xh, wh = xh.astype(self.grad_dtype), wh.astype(self.grad_dtype)
    if self.x.cfg.learned or self.w.cfg.learned:
      # LSQ sums its step gradient over these in float32. JAX's convolution
      # transposes then cast the bfloat16 operand up to the float32 cotangent
      # (exact; XLA:TPU still feeds the MXU bfloat16, XLA:GPU multiplies f32).
      _, vjp = jax.vjp(lambda a, b: fn(a, b, jnp.float32), xh, wh)
      return vjp(g.astype(jnp.float32))
    # STE casts both gradients to the operands' dtypes right away: transposing
    # the product in that dtype gives GPU and TPU the same bf16 x bf16
    # convolutions (still accumulated in float32 by the hardware).
    _, vjp = jax.vjp(lambda a, b: fn(a, b, None), xh, wh)
    return vjp(g.astype(self.grad_dtype))

  def code_grads(self, g, xc: Codes, wc: Codes):
    """:meth:`grads` from the codes, dequantized where they are multiplied (see
    :meth:`_DotSpec.code_grads`); ``None`` for grouped convolutions and views."""
    if (xc.codes.shape != self.lhs_shape or wc.codes.shape != self.rhs_shape
        or self.conv[5] != 1):
      return None
    learned = self.x.cfg.learned or self.w.cfg.learned
    # As :meth:`grads`: LSQ transposes into a float32 cotangent, STE in grad_dtype.
    pref, ct = ((jnp.float32, g.astype(jnp.float32)) if learned
                else (None, g.astype(self.grad_dtype)))
    cdn = self.conv[4]
    (x_n, x_c), (w_o, w_i), (y_n, y_o) = cdn.lhs_spec[:2], cdn.rhs_spec[:2], cdn.out_spec[:2]
    nd = len(self.lhs_shape)
    ident = tuple(range(nd))
    px, has_x = _code_params(xc)
    pw, has_w = _code_params(wc)

    def dgrad(gl, wl, _pg, pws, sharding):
      wh = _dequantized(wl, pws, has_w, self.grad_dtype)
      shape = list(self.lhs_shape)
      shape[x_n], shape[x_c] = gl.shape[y_n], wl.shape[w_i]
      at = mesh.sharded_zeros(tuple(shape), self.grad_dtype, sharding)
      fn = conv_fn(self.conv, lowering.conv_out_sharding(at, wh, cdn))
      return jax.vjp(lambda a: fn(a, wh, pref), at)[1](gl)[0]

    def wgrad(xl, gl, pxs, _pg, sharding):
      xh = _dequantized(xl, pxs, has_x, self.grad_dtype)
      shape = list(self.rhs_shape)
      shape[w_o], shape[w_i] = gl.shape[y_o], xl.shape[x_c]
      at = mesh.sharded_zeros(tuple(shape), self.grad_dtype, sharding)
      fn = conv_fn(self.conv, lowering.conv_out_sharding(xh, at, cdn))
      return jax.vjp(lambda b: fn(xh, b, pref), at)[1](gl)[0]

    d_x = mesh.multiply_codes(ct, wc.codes, mesh.conv_roles(cdn, nd, "dgrad"), dgrad,
                              rhs_params=pw, out_sharding=lowering.like_sharding(xc.codes, ident))
    d_w = mesh.multiply_codes(xc.codes, ct, mesh.conv_roles(cdn, nd, "wgrad"), wgrad,
                              lhs_params=px, out_sharding=lowering.like_sharding(wc.codes, ident))
    return d_x, d_w


@dataclasses.dataclass(frozen=True, kw_only=True)
class _RaggedSpec(_Spec):
  """A grouped GEMM ``(m, k) x (g, k, n)``: rows of group ``i`` times weight ``i``.

  Symmetric grids only (no centre): the weight's scale is per tensor or per
  expert and output channel ``(g, 1, n)``; each output row takes its
  group's.
  """

  def forward(self, xc, wc, lhs_shape, group_sizes):
    del lhs_shape
    return ragged_code_gemm(xc, wc, group_sizes, self.how)

  def grads(self, g, xh, wh, group_sizes):
    how = jnp.bfloat16 if self.grad_dtype == jnp.bfloat16 else jnp.float32
    g = g.astype(how)
    # bf16 on a GPU: the grouped kernels (each row by its own expert); f32: XLA's.
    d_x = grouped_kernels.ragged_product(g, wh.astype(how), group_sizes, gpu_kernel=True,
                                         transpose_rhs=True)
    d_w = grouped_kernels.ragged_product(xh.astype(how), g, group_sizes, gpu_kernel=True,
                                         wgrad=True)
    lt = jnp.float32 if self.x.cfg.learned else self.lhs_dtype
    rt = jnp.float32 if self.w.cfg.learned else self.rhs_dtype
    return d_x.astype(lt), d_w.astype(rt)

  def code_grads(self, g, xc, wc):
    del g, xc, wc
    return None  # the gradients multiply the dequantized operands (grads)

  def int_grads(self, g, xc: Codes, wc: Codes, group_sizes):
    """Both gradient grouped GEMMs on integer codes (``IntRecipe.grad_bits``).

    As :meth:`_DotSpec.int_grads`, with each scale constant along the axis
    its GEMM contracts. dgrad ``(m, n) x (g, n, k)``: ``g`` times its row's
    expert's weight scales, quantized per row (over ``n``). wgrad, whose
    contraction runs over each expert's rows: ``g`` quantized per expert and
    column (the amax over that expert's rows), so an expert with small
    gradients keeps its own resolution. Both are int8 x int8 -> int32
    grouped GEMMs; their outputs are multiplied by the gradient's scales
    (and the activation's scalar scale). Rows past the groups' total belong
    to no expert: they neither widen a scale nor reach a gradient.
    """
    g32 = g.astype(jnp.float32)
    m, groups = g32.shape[0], group_sizes.shape[0]
    qmax = 2 ** (self.grad_bits - 1) - 1
    noise = self.grad_noise(g32.shape, xc, wc)
    # Each row's expert (``groups`` for rows past the total).
    row_group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
    s_w = rank_like(wc.scale, wc.codes)  # (g or 1, 1, n or 1)
    s_w = s_w[jnp.minimum(row_group, s_w.shape[0] - 1)] if s_w.shape[0] > 1 else s_w
    q1, s1 = _int_rows(g32 * jnp.reshape(s_w, (-1, s_w.shape[-1])), (1,), qmax, noise(1))
    # The scales multiply in the kernel's epilogue (no int32 copy of the output).
    d_x = _grouped(q1, wc.codes, group_sizes, transpose_rhs=True, row_scales=s1[:, 0])
    amax = jax.ops.segment_max(jnp.abs(g32), row_group, num_segments=groups + 1)[:groups]
    s2 = jnp.maximum(amax, 0.0) / qmax
    s2 = jnp.where(s2 > 0, s2, jnp.ones_like(s2))  # (g, n); an expert without rows: 1
    q2 = _int_codes(g32, jnp.concatenate([s2, jnp.ones_like(s2[:1])])[row_group], qmax,
                    noise(2))
    d_w = _grouped(xc.codes, q2, group_sizes, wgrad=True,
                   scales=s2 * jnp.reshape(xc.scale, ()))
    return d_x, d_w


def _grouped(a, b, group_sizes, *, transpose_rhs: bool = False, wgrad: bool = False,
             scales=None, row_scales=None):
  """An int8 x int8 grouped GEMM, its int32 sums times ``scales`` (per group and output
  column) and ``row_scales`` (per row) in float32: on a GPU in the library's kernel (each
  row by its own group's weight, the scales in its epilogue), else XLA's ``ragged_dot``."""
  return grouped_kernels.ragged_product(a, b, group_sizes, gpu_kernel=True,
                                        transpose_rhs=transpose_rhs, wgrad=wgrad, scales=scales,
                                        row_scales=row_scales, out_dtype=jnp.float32)


def ragged_code_gemm(xc: Codes, wc: Codes, group_sizes, how: str):
  """The grouped GEMM of symmetric int8 codes (float32 out), each row scaled by its group's.

  ``how``: ``'int8'`` (int32 accumulation) or ``'bf16'`` (codes are exact in
  bfloat16; float32 accumulation). Shared by training and serving.
  """
  # One scale per expert and output column, the activation's times the weight's, applied
  # to the exact integer sums once (in the GPU kernel's epilogue): both lowerings agree.
  s_w = rank_like(wc.scale, wc.codes)
  groups, n = wc.codes.shape[0], wc.codes.shape[-1]
  s = jnp.reshape(xc.scale, ()) * jnp.reshape(s_w, (s_w.shape[0], s_w.shape[-1]))
  s = jnp.broadcast_to(s, (groups, n))
  if how == "int8":
    return _grouped(xc.codes, wc.codes, group_sizes, scales=s)
  return grouped_kernels.ragged_product(xc.codes, wc.codes, group_sizes, gpu_kernel=False,
                                        upcast=jnp.bfloat16, scales=s, out_dtype=jnp.float32)


def ragged_supported(recipe: IntRecipe) -> str | None:
  """Why ``recipe`` has no integer grouped GEMM (:func:`int_ragged_dot`), or ``None``."""
  if recipe.input is None or recipe.kernel is None:
    return "a role is not quantized"
  if not (recipe.input.symmetric and recipe.kernel.symmetric):
    return "an asymmetric grid (its zero point would need a correction per group)"
  if recipe.kernel.granularity == "group" or recipe.input.granularity != "tensor":
    return "a 'group' weight or a per-channel activation"
  if recipe.input.learned or recipe.kernel.learned:
    return "learned steps (LSQ)"
  return None


def _code_params(c: Codes):
  """``(params, (has_centre, has_offset))``: ``c``'s parameters with the codes' rank."""
  params = tuple(rank_like(p, c.codes) for p in (c.scale, c.centre, c.offset) if p is not None)
  return params, (c.centre is not None, c.offset is not None)


def _dequantized(codes, params, has, dtype):
  """:func:`dequantize` of codes given with :func:`_code_params`' parameters."""
  ps = iter(params)
  scale = next(ps)
  centre = next(ps) if has[0] else None
  offset = next(ps) if has[1] else None
  return dequantize(Codes(codes, scale, centre, offset), dtype)


def _residual(op: Operand, x, c: Codes, inside):
  """What the backward keeps of one operand: the codes, or (LSQ) the operand."""
  if op.cfg.learned:
    return (x,)
  packed = None if inside is None else jnp.packbits(inside.reshape(-1))
  return (owg.name_fp8_residual(c.codes), c.scale, c.centre, packed)


def _restore(op: Operand, x_shape, res, params, dtype):
  """``(codes, x_hat in x's shape, x or None, inside or None)`` from one residual."""
  if op.cfg.learned:
    (x,) = res
    c, _, _ = quantize(op, x, params)
    return c, dequantize(c, dtype).reshape(x_shape), x, None
  codes, scale, centre, packed = res
  c = Codes(codes, scale, centre, None)
  inside = None
  if packed is not None:
    inside = jnp.unpackbits(packed)[:codes.size].reshape(codes.shape).astype(bool)
  return c, dequantize(c, dtype).reshape(x_shape), None, inside


def _role_grads(op: Operand, g_hat, x, inside, params, like, dtype):
  """``(d_operand, d_params)`` of one operand given ``g_hat = dL/dx_hat``."""
  if op.cfg.learned:
    view, _ = int_numerics.int_view(x, op.contract, op.cfg)
    gv, _ = int_numerics.int_view(g_hat, op.contract, op.cfg)
    off = params[1] if op.kind == "lsq+" else jnp.zeros((), jnp.float32)
    dx, d_step, d_off = int_ops.lsq_backward(
        gv, view, params[0], off, qmin=op.cfg.qmin, qmax=op.cfg.qmax,
        grad_scale=op.grad_scale, with_offset=op.kind == "lsq+")
    dx = dx.reshape(x.shape).astype(dtype)
    d_params = (d_step, d_off) if op.kind == "lsq+" else (d_step,)
    d_params = tuple(owg.match_varying(d, p) for d, p in zip(d_params, params))
    return owg.match_varying(dx, like), d_params
  if inside is not None:
    g_hat = jnp.where(inside.reshape(g_hat.shape), g_hat, jnp.zeros((), g_hat.dtype))
  return owg.match_varying(g_hat.astype(dtype), like), None


def _quantize_rhs(spec, rhs, rparams):
  """The weight's codes; a parameter handed uncast is quantized in ``spec.rhs_dtype``."""
  round_to = spec.rhs_dtype if spec.rhs_param_dtype is not None else None
  return quantize(spec.w, rhs, rparams, round_to=round_to)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int_product(spec, lhs, rhs, lparams, rparams, chain, extra=()):
  xc, _, _ = quantize(spec.x, lhs, lparams, spec.frozen)
  wc, _, _ = _quantize_rhs(spec, rhs, rparams)
  return spec.forward(xc, wc, lhs.shape, *extra).astype(spec.out_dtype), chain


def _int_product_fwd(spec, lhs, rhs, lparams, rparams, chain, extra=()):
  xc, new, x_in = quantize(spec.x, lhs, lparams, spec.frozen)
  wc, _, w_in = _quantize_rhs(spec, rhs, rparams)
  y = spec.forward(xc, wc, lhs.shape, *extra).astype(spec.out_dtype)
  # A parameter handed uncast is kept rounded, as the cast weight was (LSQ's backward reads it).
  w = rhs if spec.rhs_param_dtype is None else rhs.astype(spec.rhs_dtype)
  res = (_residual(spec.x, lhs, xc, x_in), _residual(spec.w, w, wc, w_in),
         lparams, rparams, new, extra)
  return (y, chain), res


def _int_product_bwd(spec, res, cts):
  res_x, res_w, lparams, rparams, new, extra = res
  g, ct_chain = cts
  # The dequantized operands feed the gradient GEMMs only: build them in the
  # GEMMs' dtype, so no float32 copy of an operand is materialized for bf16.
  xc, xh, x, x_in = _restore(spec.x, spec.lhs_shape, res_x, lparams, spec.grad_dtype)
  wc, wh, w, w_in = _restore(spec.w, spec.rhs_shape, res_w, rparams, spec.grad_dtype)
  if spec.grad_bits:
    g_xh, g_wh = spec.int_grads(g, xc, wc, *extra)
  else:
    # The products read the codes (dequantized where they are multiplied);
    # group views and grouped convolutions the dequantized operands.
    grads = spec.code_grads(g, xc, wc)
    g_xh, g_wh = grads if grads is not None else spec.grads(g, xh, wh, *extra)
  dx, dlp = _role_grads(spec.x, g_xh, x, x_in, lparams, xh, spec.lhs_dtype)
  dw, drp = _role_grads(spec.w, g_wh, w, w_in, rparams, wh, spec.rhs_dtype)
  if spec.rhs_param_dtype is not None:
    # The gradient of the cast the parameter skipped: rounded to the compute
    # dtype as the cast weight's was, then widened.
    dw = dw.astype(spec.rhs_param_dtype)
  chain_ct = jnp.zeros_like(ct_chain)
  if spec.x.kind == "observer":
    combined, chain_ct = owg.fold_chain(new, ct_chain, spec.first, like=lparams[0])
    d_range = jnp.zeros_like(new) if combined is None else combined
    dlp = (owg.match_varying(d_range, lparams[0], state=True),)
    chain_ct = owg.match_varying(chain_ct, ct_chain, state=True)
  dlp = dlp if dlp is not None else tuple(jnp.zeros_like(p) for p in lparams)
  drp = drp if drp is not None else tuple(jnp.zeros_like(p) for p in rparams)
  # The extra arrays (a grouped GEMM's group sizes) are integers: no gradient.
  d_extra = tuple(np.zeros(jnp.shape(e), jax.dtypes.float0) for e in extra)
  return dx, dw, dlp, drp, chain_ct, d_extra


_int_product.defvjp(_int_product_fwd, _int_product_bwd)
_int_product = uses.compiled_when_eager(_int_product, static_argnums=(0,))


def operand_params(role: str, x, contract_axes, cfg: IntQuantConfig, *, lsq_params,
                   observer_range):
  """One operand's ``(params, grad_scale)`` as :func:`int_dot_general` takes them.

  The layer APIs differ only in where the values live: ``lsq_params(role,
  view, axes, cfg)`` returns the learned step (and offset) broadcastable to the
  view, ``observer_range()`` the activation observer's range.
  """
  view, axes = int_numerics.int_view(x, contract_axes, cfg)
  if cfg.learned:
    n = int_ops.lsq_elements(x, view, axes, role)
    return lsq_params(role, view, axes, cfg), 1.0 / math.sqrt(n * cfg.qmax)
  if role == "input":
    return (observer_range(),), 1.0
  return (), 1.0


def run_product(recipe: IntRecipe, lhs, rhs, lc, rc, params_of, chained, run):
  """Runs one integer product with a layer's variables.

  Args:
    recipe: the :class:`~fp8_linen.IntRecipe` (both roles set).
    lhs: the activation; ``lc`` its contracting axes.
    rhs: the weight; ``rc`` its contracting axes.
    params_of: ``fn(role, x, contract_axes, cfg) -> (params, grad_scale)``
      (see :func:`operand_params`).
    chained: ``fn(f, state_leaf) -> out`` that runs ``f(chain) -> (out, chain_out)``
      on the layer's observer chain (``state_leaf``: the observer range).
    run: ``fn(**kw) -> (out, chain_out)``: :func:`int_dot_general` or
      :func:`int_conv_general_dilated` with everything but the params bound.
  """
  lp, lg = params_of("input", lhs, lc, recipe.input)
  rp, rg = params_of("kernel", rhs, rc, recipe.kernel)
  kw = dict(kernel_params=rp, input_grad_scale=lg, kernel_grad_scale=rg)
  if recipe.input.learned:
    return run(input_params=lp, **kw)[0]
  return chained(lambda chain: run(input_params=lp, chain=chain, **kw), lp[0])


def _operands(recipe: IntRecipe, lc, rc, input_grad_scale, kernel_grad_scale, owner):
  if not isinstance(recipe, IntRecipe):
    raise TypeError(f"{owner}: recipe must be an IntRecipe, got {type(recipe).__name__}")
  if recipe.input is None or recipe.kernel is None:
    raise ValueError(f"{owner}: both recipe.input and recipe.kernel must be quantized for "
                     "an integer product (a float role runs the fake-quantized float path)")
  return (Operand(cfg=recipe.input, role="input", contract=tuple(lc),
                  grad_scale=float(input_grad_scale)),
          Operand(cfg=recipe.kernel, role="kernel", contract=tuple(rc),
                  grad_scale=float(kernel_grad_scale)))


def _params(op: Operand, params, name: str):
  params = tuple(jnp.asarray(p, jnp.float32) for p in params)
  want = {"observer": 1, "minmax": 0, "lsq": 1, "lsq+": 2}[op.kind]
  if len(params) != want:
    raise ValueError(f"{name} must hold {want} array(s) for a {op.kind!r} {op.role} quantizer "
                     f"(observer: (range,); min/max: (); lsq: (step,); lsq+: (step, offset)), "
                     f"got {len(params)}")
  if op.kind == "observer" and params[0].shape != (2,):
    raise ValueError(f"{name}[0] (the observer range) must have shape (2,), got "
                     f"{params[0].shape}")
  return params


def _run(spec_cls, lhs, rhs, x_op, w_op, k, recipe, input_params, kernel_params, out_dtype,
         chain, owner, extra=(), rhs_grad_dtype=None, rhs_compute_dtype=None, **static):
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  owg.check_float("lhs", lhs)
  owg.check_float("rhs", rhs)
  compute = lowering.compute_dtype_for(rhs, rhs_compute_dtype, owner)
  param_dtype = None if compute == rhs.dtype else jnp.dtype(rhs.dtype)
  lp = _params(x_op, input_params, "input_params")
  rp = _params(w_op, kernel_params, "kernel_params")
  first = chain is None
  spec = spec_cls(x=x_op, w=w_op, how=resolve_int_gemm(recipe.gemm, k, x_op, w_op, owner),
                  grad_dtype=resolve_compute_dtype(recipe.compute_dtype, lhs.dtype),
                  out_dtype=jnp.dtype(out_dtype or jnp.result_type(lhs, compute)),
                  lhs_dtype=jnp.dtype(lhs.dtype), rhs_dtype=compute, first=first,
                  lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
                  grad_bits=recipe.grad_bits, grad_sr=recipe.grad_stochastic_rounding,
                  frozen=owg.quantizers_frozen(),
                  rhs_grad_dtype=lowering.grad_dtype_for(rhs, rhs_grad_dtype),
                  rhs_param_dtype=param_dtype, **static)
  return _int_product(spec, lhs, rhs, lp, rp, owg.chain_init(2) if first else chain, extra)


def int_dot_general(lhs, rhs, dimension_numbers, *, recipe: IntRecipe, input_params=(),
                    kernel_params=(), input_grad_scale: float = 1.0,
                    kernel_grad_scale: float = 1.0, out_dtype=None, chain=None,
                    rhs_grad_dtype=None, rhs_compute_dtype=None):
  """``dot_general`` of the integer-quantized operands, with QAT gradients.

  Forward: both operands quantized to int8 codes (``recipe.input`` per tensor,
  ``recipe.kernel`` per tensor, channel or group) and multiplied in one exact
  integer GEMM (:func:`int_gemm`); equal to the product of the fake-quantized
  operands up to float32 rounding of the scaling. Backward: STE (observer,
  min/max) or LSQ/LSQ+ gradients from the saved codes (STE) or operands
  (LSQ), the gradient GEMMs' operands in ``recipe.compute_dtype`` (``'auto'``:
  bfloat16 when ``lhs`` is bfloat16, else float32; see
  :func:`resolve_compute_dtype`), accumulated in float32. An observer's new
  range is returned as the cotangent of ``input_params[0]``, chained across
  uses like the fp8 state.

  Args:
    lhs: the activation (floating).
    rhs: the weight (floating).
    dimension_numbers: as for ``lax.dot_general``.
    recipe: an :class:`~fp8_linen.IntRecipe` with both roles set.
    input_params: ``(range,)`` (observer), ``(step,)`` (LSQ) or ``(step,
      offset)`` (LSQ+), steps broadcastable to ``lhs``.
    kernel_params: ``()`` (STE), ``(step,)`` or ``(step, offset)``, broadcastable
      to the weight's view (:func:`~fp8_linen.core.int_numerics.int_view`).
    input_grad_scale: LSQ gradient scale of the input's learned values.
    kernel_grad_scale: the same for the weight's.
    out_dtype: output dtype (default: the result type of the operands).
    chain: ``None`` for the first use of the observer state in a step, else the
      previous use's ``chain_out``.
    rhs_grad_dtype: the dtype of the parameter ``rhs`` was cast from, if any:
      an STE weight gradient's GEMM writes it (see
      :func:`~fp8_linen.fp8_dot_general`); the gradient returned is ``rhs``'s
      dtype either way.
    rhs_compute_dtype: the dtype ``rhs`` is quantized and differentiated in
      when it is a layer's parameter handed uncast (default: ``rhs.dtype``).
      The result is that of ``rhs.astype(rhs_compute_dtype)``; a TPU kernel
      quantizes the parameter from one read
      (:mod:`~fp8_linen.core.int_kernels`), so the cast copy is never
      written. The gradient is rounded to it, then returned in ``rhs``'s dtype.

  Returns:
    ``(out, chain_out)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.core import int_product
    >>> y, _ = int_product.int_dot_general(jnp.ones((2, 4)), jnp.ones((4, 3)),
    ...     (((1,), (0,)), ((), ())), recipe=fl.IntRecipe(), input_params=(jnp.zeros(2),))
    >>> y.tolist()[0]
    [4.0, 4.0, 4.0]
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  dn = dims.canonical_dn(dimension_numbers, lhs.ndim, rhs.ndim)
  (lc, rc), (lb, rb) = dn
  for ld, rd in zip(lc + lb, rc + rb):
    if lhs.shape[ld] != rhs.shape[rd]:
      raise ValueError(f"int_dot_general: lhs dimension {ld} (size {lhs.shape[ld]}) does not "
                       f"match rhs dimension {rd} (size {rhs.shape[rd]})")
  x_op, w_op = _operands(recipe, lc, rc, input_grad_scale, kernel_grad_scale, "int_dot_general")
  k = contracted(recipe.kernel, rhs.shape, rc)
  return _run(_DotSpec, lhs, rhs, x_op, w_op, k, recipe, input_params, kernel_params, out_dtype,
              chain, "int_dot_general", rhs_grad_dtype=rhs_grad_dtype,
              rhs_compute_dtype=rhs_compute_dtype, dn=dn)


def int_conv_general_dilated(lhs, rhs, conv, *, recipe: IntRecipe, input_params=(),
                             kernel_params=(), input_grad_scale: float = 1.0,
                             kernel_grad_scale: float = 1.0, out_dtype=None, chain=None):
  """A convolution of the integer-quantized operands (see :func:`int_dot_general`).

  ``conv`` is ``(window_strides, padding, lhs_dilation, rhs_dilation,
  ConvDimensionNumbers, feature_group_count)`` with padding as explicit pairs.
  Only recipes :func:`conv_supported` accepts run here.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if not conv_supported(recipe):
    raise ValueError("int_conv_general_dilated: recipe needs symmetric grids without "
                     "offsets for both roles (see conv_supported)")
  if recipe.grad_bits is not None:
    raise ValueError(f"int_conv_general_dilated: recipe.grad_bits={recipe.grad_bits} is "
                     "supported for dot products only; use grad_bits=None for convolutions")
  cdn = conv[4]
  lc, rc = dims.conv_contract(lhs.ndim, rhs.ndim, cdn)
  x_op, w_op = _operands(recipe, lc, rc, input_grad_scale, kernel_grad_scale,
                         "int_conv_general_dilated")
  k = contracted(recipe.kernel, rhs.shape, rc)
  return _run(_ConvSpec, lhs, rhs, x_op, w_op, k, recipe, input_params, kernel_params,
              out_dtype, chain, "int_conv_general_dilated", conv=conv)


def int_ragged_dot(lhs, rhs, group_sizes, *, recipe: IntRecipe, input_params=(),
                   kernel_params=(), out_dtype=None, chain=None):
  """``jax.lax.ragged_dot`` (an MoE's experts) of integer-quantized operands, with STE gradients.

  Forward: the routed tokens ``lhs`` ``(m, k)`` quantized per tensor by their
  observer, each expert's weight ``rhs[i]`` ``(k, n)`` per tensor or per
  output channel (``recipe.kernel.granularity``: ``'tensor'`` or
  ``'channel'``, which gives ``(g, 1, n)`` scales), multiplied as int8 codes
  in one grouped GEMM with int32 accumulation (``recipe.gemm``; bfloat16 on
  the CPU where exact), each output row scaled by its expert's scales.
  Backward: the STE gradients, both gradient products of the dequantized
  operands in ``recipe.compute_dtype``, or with ``recipe.grad_bits`` both on
  integer codes (int8 x int8 grouped GEMMs: the gradient per row for dgrad,
  per expert and column for wgrad; see ``_RaggedSpec.int_grads``). The
  observer's new range is returned as the cotangent of ``input_params[0]``,
  chained like :func:`int_dot_general`'s. Symmetric grids and STE
  (:func:`ragged_supported` says why not otherwise).

  Args:
    lhs: ``(m, k)`` floating, rows sorted by group.
    rhs: ``(g, k, n)`` floating.
    group_sizes: ``(g,)`` integer.
    recipe: an :class:`~fp8_linen.IntRecipe`.
    input_params: ``(range,)``: the observer's range.
    kernel_params: ``()``.
    out_dtype: output dtype (default: the result type of the operands).
    chain: as for :func:`int_dot_general`.

  Returns:
    ``(out (m, n), chain_out)``.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.core import int_product
    >>> y, _ = int_product.int_ragged_dot(jnp.ones((3, 2)), jnp.ones((2, 2, 4)),
    ...     jnp.array([1, 2]), recipe=fl.IntRecipe(), input_params=(jnp.zeros(2),))
    >>> y.shape, float(y[0, 0])
    ((3, 4), 2.0)
  """
  why = ragged_supported(recipe)
  if why is not None:
    raise ValueError(f"int_ragged_dot: {why} has no integer grouped GEMM; the layer helpers "
                     "fake-quantize such a recipe's experts")
  lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] \
      or group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"int_ragged_dot: expected lhs (m, k), rhs (g, k, n), group_sizes (g,); "
                     f"got {lhs.shape}, {rhs.shape}, {group_sizes.shape}")
  x_op, w_op = _operands(recipe, (1,), (1,), 1.0, 1.0, "int_ragged_dot")
  k = contracted(recipe.kernel, rhs.shape, (1,))
  return _run(_RaggedSpec, lhs, rhs, x_op, w_op, k, recipe, input_params, kernel_params,
              out_dtype, chain, "int_ragged_dot", extra=(group_sizes.astype(jnp.int32),))
