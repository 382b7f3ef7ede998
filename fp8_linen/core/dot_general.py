"""The direct fp8 ``dot_general``: per-tensor, row-wise and block (MXFP8, NVFP4) scaling.

:func:`fp8_dot_general` feeds fp8 operands straight into ``lax.dot_general`` and
applies the scales to the output (the form flax and TransformerEngine moved
to; a quantize-dequantize-then-bf16-dot form is silently undone by XLA). Its
backward runs both gradient GEMMs with fp8 operands (e5m2 gradient x e4m3
operand). Only the fp8 copies of the operands are kept for the backward pass.

Each granularity is a spec of :func:`fp8_linen.core.fp8_vjp.fp8_vjp`:
:class:`TensorDot` and :class:`RowDot` here, :class:`~fp8_linen.core.block_dot.BlockDot`
(MXFP8, NVFP4) in :mod:`fp8_linen.core.block_dot`.

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import dot_general
  >>> dot_general._SPECS[fl.rowwise_scaling().granularity].__name__
  'RowDot'
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fp8_linen.core import dims, lowering, numerics, owg
from fp8_linen.core.block_dot import BlockDot
from fp8_linen.core.fp8_vjp import DotSpec, fp8_vjp
from fp8_linen.core.lowering import grad_gemm, relayout_like
from fp8_linen.recipes.fp8 import Fp8Recipe

__all__ = ["TensorDot", "RowDot", "fp8_dot_general", "fp8_dot_of"]


class TensorDot(DotSpec):
  """Per-tensor scales: one scalar per operand and one for the gradient."""

  def quantize(self, lhs, rhs, states):
    c_l, c_r, _ = self.cfgs
    q_l, s_l, a_l = numerics.quantize_with(c_l, *states[0], lhs)
    q_r, s_r, a_r = numerics.quantize_with(c_r, *states[1], rhs, weight=True)
    return q_l, s_l, q_r, s_r, (a_l, a_r)

  @staticmethod
  def multiply(q_l, s_l, q_r, s_r, *, dn, recipe, gemm, out_dtype):
    del recipe
    y = lowering.gemm(q_l, q_r, dn, gemm, out_dtype, lowering.dot_out_sharding(q_l, q_r, dn))
    return lowering.scaled(y, numerics.scale_product(s_l, s_r), out_dtype)

  def backward(self, q_l, q_r, extras, states, g):
    s_l, s_r = extras
    q_g, s_g, a_g = numerics.quantize_with(self.cfgs[2], *states[2], g, gradient=True)
    nd = (q_l.ndim, q_r.ndim)
    d_lhs = grad_gemm(q_g, q_r, self.dn, *nd, "lhs", self.gemm, self.lhs_dtype,
                      numerics.scale_product(s_g, s_r), like=q_l)
    d_rhs = grad_gemm(q_g, q_l, self.dn, *nd, "rhs", self.gemm, self.wgrad_dtype,
                      numerics.scale_product(s_g, s_l), like=q_r).astype(self.rhs_dtype)
    return d_lhs, d_rhs, a_g


class RowDot(DotSpec):
  """Row-wise scales: ``lhs`` per row, ``rhs`` per output channel (see :func:`fp8_dot_general`)."""

  def quantize(self, lhs, rhs, states):
    del states  # current scaling per row; the state only records the global amax
    in_cfg, k_cfg, _ = self.cfgs
    (lc, rc), _ = self.dn
    # lhs / rhs layout, contracting axes size 1.
    q_l, s_l, a_l = numerics.row_quantize(lhs, lc, in_cfg)
    q_r, s_r, _ = numerics.row_quantize(rhs, rc, k_cfg)
    # A kernel's channels are its last axis: reduced columns first, its amax
    # shares the pass of the channels' own (XLA folds a max of the channels'
    # maxima into a reduction of its own).
    return q_l, s_l, q_r, s_r, (a_l, numerics.amax(rhs, columns_first=True))

  @staticmethod
  def multiply(q_l, s_l, q_r, s_r, *, dn, recipe, gemm, out_dtype):
    del recipe
    lay = dims.layout(dn, q_l.ndim, q_r.ndim)
    y = lowering.gemm(q_l, q_r, dn, gemm, out_dtype, lowering.dot_out_sharding(q_l, q_r, dn))
    s_out = numerics.scale_product(relayout_like(s_l, lay.lhs_to_out, y),
                                   relayout_like(s_r, lay.rhs_to_out, y))
    return (y.astype(jnp.float32) * s_out).astype(out_dtype)

  def backward(self, q_l, q_r, extras, states, g):
    s_l, s_r = extras
    g_cfg = self.cfgs[2]
    lay = dims.layout(self.dn, q_l.ndim, q_r.ndim)
    nd = (q_l.ndim, q_r.ndim)
    one = jnp.ones((), jnp.float32)
    g32 = g.astype(jnp.float32)
    # Each operand's scale lies along the *contracted* axis of one gradient
    # GEMM, so it is folded into g before g is quantized for that GEMM.
    # dgrad contracts rhs's free axes: fold s_r into g, scale g per row.
    g1 = g32 * relayout_like(s_r, lay.rhs_to_out, g32)
    q_g1, s_g1, _ = numerics.row_quantize(g1, lay.rhs_free_out, g_cfg)
    d_lhs = grad_gemm(q_g1, q_r, self.dn, *nd, "lhs", self.gemm, jnp.float32, one, like=q_l)
    d_lhs = (d_lhs * relayout_like(s_g1, dims.flip(lay.lhs_to_out), d_lhs)).astype(self.lhs_dtype)
    # wgrad contracts lhs's free axes: fold s_l into g, scale g per column.
    g2 = g32 * relayout_like(s_l, lay.lhs_to_out, g32)
    q_g2, s_g2, _ = numerics.row_quantize(g2, lay.lhs_free_out, g_cfg)
    d_rhs = grad_gemm(q_g2, q_l, self.dn, *nd, "rhs", self.gemm, jnp.float32, one, like=q_r)
    d_rhs = (d_rhs * relayout_like(s_g2, dims.flip(lay.rhs_to_out), d_rhs)).astype(self.rhs_dtype)
    return d_lhs, d_rhs, numerics.amax(g, columns_first=True)


_SPECS = {"tensor": TensorDot, "row": RowDot, "block": BlockDot}


def fp8_dot_of(q_l, s_l, q_r, s_r, dn, *, recipe: Fp8Recipe, gemm: str, out_dtype):
  """The forward product of two quantized operands, as ``recipe.granularity`` multiplies them.

  The "multiply" half of every spec's forward, shared by the training
  product and the served model (``core/fp8_serve.py``), as
  :func:`~fp8_linen.core.conv.fp8_conv_of` is for convolutions. ``s_*`` are
  the scales the "quantize" half made: per tensor scalars, per row/channel
  arrays in the operand's layout. Block products multiply 3-D views of their
  operands: :meth:`BlockDot.serve`.
  """
  if recipe.granularity == "block":
    raise ValueError("fp8_dot_of: block products are served by BlockDot.serve")
  return _SPECS[recipe.granularity].multiply(q_l, s_l, q_r, s_r, dn=dn, recipe=recipe,
                                             gemm=gemm, out_dtype=out_dtype)


def fp8_dot_general(lhs, rhs, dimension_numbers, *, input_state: owg.RoleState,
                    kernel_state: owg.RoleState, output_grad_state: owg.RoleState,
                    recipe: Fp8Recipe | None = None, out_dtype=None, chain=None,
                    rhs_grad_dtype=None, rhs_compute_dtype=None):
  """``lax.dot_general`` with fp8 operands and fp8 gradient GEMMs.

  Forward: ``lhs`` and ``rhs`` are quantized (``recipe.input`` /
  ``recipe.kernel``, e4m3 by default) and multiplied directly in fp8; the
  product of the two scalar scales multiplies the output. Backward: the output
  gradient is quantized (``recipe.output_grad``, e5m2 by default) and both
  gradient GEMMs run with fp8 operands. The new state of all three roles is
  returned as the cotangent of the state inputs.

  On GPU (``recipe.gemm='auto'``) the fp8 operands are fed to the GEMM directly,
  the form XLA rewrites to a cuBLASLt fp8 matmul; on other backends they are
  upcast exactly to bfloat16.

  ``recipe.granularity`` selects finer scales (all from this step's values):

  * ``'row'``: ``lhs`` is scaled per row (amax over its contracting axes) and
    ``rhs`` per output channel. The GEMM runs on the unscaled fp8 operands and
    the outer product of the two scale vectors multiplies its output. In the
    backward pass each scale lies along the *contracted* axis of one gradient
    GEMM, so it is folded into the gradient before that gradient is quantized:
    dgrad quantizes ``g * s_rhs`` per row of ``g`` (amax over the rhs-free
    axes), wgrad quantizes ``g * s_lhs`` per column (amax over the lhs-free
    axes); each GEMM's output is multiplied by its gradient scales. The
    gradient is therefore cast to e5m2 twice; only fp8 operands and the scale
    vectors are kept as residuals.
  * ``'block'`` (MXFP8, NVFP4; see :class:`BlockDot`): every GEMM takes its
    two operands in blocks of ``recipe.block_size`` along the axis it
    contracts (forward: ``lhs`` and ``rhs`` along K; dgrad: the gradient and
    ``rhs`` along N; wgrad: the gradient and ``lhs`` along M), with e8m0 block
    scales (MX) or e4m3 block scales and a per-tensor scale (NVFP4). On a GPU
    with block-scaled GEMMs they run as such (``jax.nn.scaled_matmul``);
    elsewhere the blocks are dequantized exactly to bfloat16 (``gemm='f32'``:
    float32) and multiplied there. Residuals: the backward's codes and their
    scales.

  In all modes the OWG state records the per-tensor amax of each role; the
  stored scale is the per-tensor scale of that amax (used by NVFP4, for
  monitoring only by the row and MX scales).

  Args:
    lhs: floating array (the activation).
    rhs: floating array (the weight).
    dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``
      as for ``lax.dot_general``.
    input_state: :class:`RoleState` of ``lhs``.
    kernel_state: :class:`RoleState` of ``rhs``.
    output_grad_state: :class:`RoleState` of the output gradient.
    recipe: the :class:`~fp8_linen.Fp8Recipe` (default: delayed e4m3/e5m2).
    out_dtype: output dtype (default: the result type of ``lhs`` and ``rhs``).
    chain: ``None`` for the first use of these states in a step, else the
      ``chain_out`` of the previous use.
    rhs_grad_dtype: the dtype of the parameter ``rhs`` was cast from, if
      any: traced for a GPU, the weight-gradient GEMM writes it, so a step
      that returns the gradient needs no pass to cast it
      (:attr:`~fp8_linen.core.fp8_vjp.Fp8Spec.wgrad_dtype`); ignored
      elsewhere. The layers leave it unset: a step that updates the weight
      fuses that cast into the update, which then reads half the bytes, and
      on an H200 the float32 output made the first compile of a delayed
      step several times slower (docs/accelerators.md). The gradient
      returned is ``rhs``'s dtype either way.
    rhs_compute_dtype: the float dtype ``rhs`` is rounded to before it is
      quantized, when ``rhs`` is a layer's parameter handed uncast (a
      float32 weight of a bfloat16 layer), or ``None`` (``rhs``'s own). The
      product and both gradients are those of ``rhs.astype(rhs_compute_dtype)``
      (``rhs``'s gradient then cast to ``rhs.dtype``), bit for bit; the
      default ``out_dtype`` is the result type of ``lhs`` and this dtype.
      Block recipes round inside the product, so where their Pallas kernels
      quantize the weight they read the parameter itself and no rounded copy
      is written; every other recipe rounds it first.

  Returns:
    ``(out, chain_out)``.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> st = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((16,)))
    >>> y, _ = fl.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())),
    ...                           input_state=st(), kernel_state=st(), output_grad_state=st())
    >>> [round(v, 4) for v in y[0].tolist()]
    [3.0, 3.0, 3.0, 3.0]
  """
  recipe = recipe or Fp8Recipe()
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  owg.check_float("lhs", lhs)
  owg.check_float("rhs", rhs)
  compute = lowering.compute_dtype_for(rhs, rhs_compute_dtype, "fp8_dot_general")
  dn = dims.canonical_dn(dimension_numbers, lhs.ndim, rhs.ndim)
  (lc, rc), (lb, rb) = dn
  for ld, rd in zip(lc + lb, rc + rb):
    if lhs.shape[ld] != rhs.shape[rd]:
      raise ValueError(
          f"fp8_dot_general: lhs dimension {ld} (size {lhs.shape[ld]}) does not match rhs "
          f"dimension {rd} (size {rhs.shape[rd]}); lhs.shape={lhs.shape}, rhs.shape={rhs.shape}")
  if recipe.granularity == "block" and not lc:
    raise ValueError("granularity='block' needs at least one contracting dimension")
  states = tuple(owg.check_state(name, st) for name, st in zip(
      owg.ROLES, (input_state, kernel_state, output_grad_state)))
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, compute))
  first = chain is None
  spec = _SPECS[recipe.granularity](
      dn=dn, recipe=recipe, gemm=lowering.resolve_gemm(recipe), out_dtype=out_dtype,
      lhs_dtype=jnp.dtype(lhs.dtype), rhs_dtype=compute, first=first,
      frozen=owg.quantizers_frozen(), rhs_grad_dtype=lowering.grad_dtype_for(rhs, rhs_grad_dtype))
  if compute != rhs.dtype:
    if spec.reads_param(rhs):
      spec = dataclasses.replace(spec, rhs_param_dtype=jnp.dtype(rhs.dtype))
    else:
      rhs = rhs.astype(compute)
  return fp8_vjp(spec, lhs, rhs, states, owg.chain_init(3) if first else chain)
