"""Served products: the QAT forward run from stored low-precision weights.

After quantization-aware training a weight is a constant: it is quantized
once (:func:`fold_int_kernel`, :func:`fold_fp8_kernel`) with exactly the
scale the QAT forward used, and stored as ``int8``, ``int4`` or fp8 codes with
its scales. The activation's quantization parameters are frozen from the
trained state (:func:`freeze_int_input`, :func:`freeze_fp8_input`). The served
products (:func:`int_dot`, :func:`int_conv`, :func:`fp8_dot`, :func:`fp8_conv`)
then compute the forward of the QAT product from those arrays, with the same
functions the QAT product calls (:func:`~fp8_linen.core.int_product.int_gemm`,
:func:`~fp8_linen.core.lowering.gemm`), so serving and QAT agree by
construction.

Every array here is named as it is stored next to the layer's ``kernel``:

============== ============================================================
name           holds
============== ============================================================
kernel         the weight's codes (``int8``/``int4``/fp8), the weight's shape
kernel_scale   the weight's scale(s): per tensor ``(1,)``, per channel/group
               in the weight's (view) layout; MX: ``float8_e8m0fnu`` per block
kernel_centre  integer grids with a zero point: ``zero_point - storage shift``
kernel_offset  LSQ+'s learned offset
input_scale    the frozen activation scale (absent where it is computed
               from each batch: fp8 current, row-wise, MX)
input_zero_point  STE observers on asymmetric grids
input_offset   LSQ+'s learned activation offset
============== ============================================================

A product whose right operand is not a weight (an activation times an
activation, e.g. attention scores under :func:`~fp8_linen.quantize_model`)
quantizes it on the fly (:func:`live_int_kernel`, :func:`live_fp8_kernel`).

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import serve
  >>> arrays = serve.fold_int_kernel(fl.IntRecipe().kernel, jnp.array([[0.5], [-1.0]]), (0,), ())
  >>> arrays['kernel'].dtype, arrays['kernel'].ravel().tolist()
  (dtype('int8'), [64, -127])
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax import lax

from fp8_linen.core import conv as conv_ops
from fp8_linen.core import dims, int_numerics, int_ops, int_product, lowering, numerics
from fp8_linen.core.dot_general import relayout_like
from fp8_linen.recipes.fp8 import Fp8Recipe, ScalingConfig
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["storage_dtype", "fold_int_kernel", "freeze_int_input", "live_int_kernel", "int_dot",
           "int_conv", "fold_fp8_kernel", "freeze_fp8_input", "live_fp8_kernel", "fp8_dot",
           "fp8_conv", "fp8_servable"]

_INT4_SHIFT = 8  # unsigned 4-bit grids [0, 15] are stored shifted into int4's [-8, 7]


def _operand(cfg: IntQuantConfig, role: str, contract) -> int_product.Operand:
  return int_product.Operand(cfg=cfg, role=role, contract=tuple(contract))


def storage_dtype(cfg: IntQuantConfig):
  """``jnp.int4`` for grids of at most 4 bits, else ``jnp.int8``."""
  return jnp.int4 if cfg.bits <= 4 else jnp.int8


def _store_shift(op: int_product.Operand) -> int:
  """What is subtracted from an ``int8`` code (already shifted) to store it."""
  if op.cfg.bits > 4:
    return 0
  lo, hi = op.cfg.qmin - op.shift, op.cfg.qmax - op.shift
  return 0 if -8 <= lo and hi <= 7 else _INT4_SHIFT


def fold_int_kernel(cfg: IntQuantConfig, w, contract, params) -> dict:
  """Quantizes a weight once, as the QAT forward does; returns its stored arrays.

  Args:
    cfg: the weight's :class:`~fp8_linen.IntQuantConfig`.
    w: the float weight, in the layout the product sees.
    contract: its contracting axes in the product.
    params: ``()`` (STE: its own min/max), ``(step,)`` (LSQ) or ``(step,
      offset)`` (LSQ+).

  Returns:
    ``{'kernel': codes in w's shape (int8 or int4), 'kernel_scale': ...,
    ['kernel_centre'], ['kernel_offset']}``.
  """
  op = _operand(cfg, "kernel", contract)
  c, _, _ = int_product.quantize(op, jnp.asarray(w), tuple(params))
  k = _store_shift(op)
  codes = c.codes.reshape(jnp.shape(w))
  if k:
    codes = (codes.astype(jnp.int32) - k).astype(jnp.int8)
  out = {"kernel": codes.astype(storage_dtype(cfg)),
         "kernel_scale": jnp.asarray(c.scale, jnp.float32)}
  if c.centre is not None:
    out["kernel_centre"] = jnp.asarray(c.centre, jnp.float32) - k
  if c.offset is not None:
    out["kernel_offset"] = jnp.asarray(c.offset, jnp.float32)
  return out


def _kernel_codes(cfg: IntQuantConfig, kernel, arrays, contract) -> int_product.Codes:
  """The weight's :class:`~fp8_linen.core.int_product.Codes` from its stored arrays.

  ``kernel`` may arrive cast to a float type by the layer (exact for integer
  codes); it is cast back to ``int8``.
  """
  codes = jnp.asarray(kernel).astype(jnp.int8)
  view, _ = int_numerics.int_view(codes, contract, cfg)
  return int_product.Codes(view, arrays["kernel_scale"], arrays.get("kernel_centre"),
                           arrays.get("kernel_offset"))


def freeze_int_input(cfg: IntQuantConfig, params) -> dict:
  """The activation's frozen quantization parameters, from its trained values.

  Args:
    cfg: the activation's :class:`~fp8_linen.IntQuantConfig` (per tensor).
    params: ``(range,)`` (STE observer: ``[-min, max]``), ``(step,)`` (LSQ)
      or ``(step, offset)`` (LSQ+).

  Returns:
    ``{'input_scale'[, 'input_zero_point' | 'input_offset']}``, scalars.
  """
  op = _operand(cfg, "input", ())
  if op.kind == "observer":
    rng = jnp.asarray(params[0], jnp.float32)
    s, z = int_numerics.int_params_from_range(-rng[0], rng[1], cfg)
    out = {"input_scale": jnp.reshape(s, ())}
    if not cfg.symmetric:
      out["input_zero_point"] = jnp.reshape(z, ())
    return out
  out = {"input_scale": jnp.reshape(jnp.maximum(jnp.asarray(params[0], jnp.float32),
                                                numerics.SCALE_FLOOR), ())}
  if op.kind == "lsq+":
    out["input_offset"] = jnp.reshape(jnp.asarray(params[1], jnp.float32), ())
  return out


def _input_codes(cfg: IntQuantConfig, x, arrays) -> int_product.Codes:
  """The activation's codes with frozen parameters (the QAT quantizer's expressions)."""
  op = _operand(cfg, "input", tuple(range(jnp.ndim(x))))
  s = arrays["input_scale"]
  if op.kind == "observer":
    z = arrays.get("input_zero_point", jnp.zeros((), jnp.float32))
    return int_product.encode(op, jnp.asarray(x), s, z)[0]
  params = (s,) if op.kind == "lsq" else (s, arrays["input_offset"])
  c, _, _ = int_product.quantize(op, jnp.asarray(x), params)
  return c


def live_int_kernel(cfg: IntQuantConfig, params) -> dict:
  """What an activation in the weight's role keeps: LSQ's step (and offset)."""
  if not cfg.learned:
    return {}
  out = {"kernel_step": jnp.asarray(params[0], jnp.float32)}
  if cfg.estimator == "lsq+":
    out["kernel_offset"] = jnp.asarray(params[1], jnp.float32)
  return out


def _live_codes(cfg: IntQuantConfig, x, arrays, contract) -> int_product.Codes:
  op = _operand(cfg, "kernel", contract)
  params = () if not cfg.learned else (
      (arrays["kernel_step"],) if cfg.estimator == "lsq" else
      (arrays["kernel_step"], arrays["kernel_offset"]))
  c, _, _ = int_product.quantize(op, jnp.asarray(x), params)
  return c


def int_dot(lhs, kernel, dimension_numbers, *, recipe: IntRecipe, arrays: dict, folded: bool,
            out_dtype):
  """The served integer ``dot_general``: int8 codes x int8 codes -> int32, scales once.

  Args:
    lhs: the activation (floating).
    kernel: the stored codes (possibly cast to float by the layer) when
      ``folded``, else the live right operand.
    dimension_numbers: as for ``lax.dot_general``.
    recipe: the layer's :class:`~fp8_linen.IntRecipe`.
    arrays: the product's stored arrays (see the module doc).
    folded: whether ``kernel`` holds codes.
    out_dtype: output dtype.
  """
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  dn = dims.canonical_dn(dimension_numbers, lhs.ndim, kernel.ndim)
  (lc, rc), _ = dn
  xc = _input_codes(recipe.input, lhs, arrays)
  wc = (_kernel_codes(recipe.kernel, kernel, arrays, rc) if folded
        else _live_codes(recipe.kernel, kernel, arrays, rc))
  x_op, w_op = _operand(recipe.input, "input", lc), _operand(recipe.kernel, "kernel", rc)
  how = int_product.resolve_int_gemm(
      recipe.gemm, int_product.contracted(recipe.kernel, kernel.shape, rc), x_op, w_op)
  y = int_product.int_gemm(xc, wc, dn, lhs_shape=lhs.shape, how=how,
                           group=recipe.kernel.granularity == "group")
  return y.astype(out_dtype)


def int_conv(lhs, kernel, conv_kwargs: dict, *, recipe: IntRecipe, arrays: dict, out_dtype):
  """The served integer convolution from the stored kernel codes.

  Recipes :func:`~fp8_linen.core.int_product.conv_supported` accepts run on
  codes (:func:`~fp8_linen.core.int_product.int_conv`); the others (LSQ+,
  zero-point grids) are computed as QAT computes them: the fake-quantized
  input (frozen parameters) and the dequantized stored kernel, convolved in
  ``recipe.compute_dtype`` resolved against ``lhs`` as QAT resolves it
  (:func:`~fp8_linen.core.int_product.resolve_compute_dtype`).
  """
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  dn = lax.conv_dimension_numbers(lhs.shape, kernel.shape, conv_kwargs["dimension_numbers"])
  lc, rc = dims.conv_contract(lhs.ndim, kernel.ndim, dn)
  wc = _kernel_codes(recipe.kernel, kernel, arrays, rc)
  if int_product.conv_supported(recipe):
    xc = _input_codes(recipe.input, lhs, arrays)
    x_op, w_op = _operand(recipe.input, "input", lc), _operand(recipe.kernel, "kernel", rc)
    how = int_product.resolve_int_gemm(
        recipe.gemm, int_product.contracted(recipe.kernel, kernel.shape, rc), x_op, w_op)
    y = int_product.int_conv(xc, wc, int_product.conv_static(lhs.ndim, conv_kwargs, dn),
                             how=how)
    return y.astype(out_dtype)
  cfg = recipe.input
  if cfg.estimator == "ste":
    xq = int_numerics.int_fake_quant(lhs, arrays["input_scale"],
                                     arrays.get("input_zero_point", 0.0), cfg.qmin, cfg.qmax)
  elif cfg.estimator == "lsq":
    xq = int_ops.lsq_fake_quant(lhs, arrays["input_scale"], qmin=cfg.qmin, qmax=cfg.qmax)
  else:
    xq = int_ops.lsq_plus_fake_quant(lhs, arrays["input_scale"], arrays["input_offset"],
                                     qmin=cfg.qmin, qmax=cfg.qmax)
  wq = int_product.dequantize(wc, kernel.dtype).reshape(kernel.shape)
  cd = int_product.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  xq, wq = xq.astype(cd), wq.astype(cd)
  y = lowering.lax_conv_general_dilated(xq, wq, **conv_kwargs, preferred_element_type=jnp.float32,
                                        out_sharding=lowering.conv_out_sharding(xq, wq, dn))
  return y.astype(out_dtype)


# ----------------------------------------------------------------------------
# fp8


def fp8_servable(recipe: Fp8Recipe, conv: bool = False) -> str | None:
  """Why ``recipe`` cannot be served, or ``None`` when it can."""
  if conv and recipe.granularity != "tensor":
    return f"fp8 convolutions are per tensor, granularity={recipe.granularity!r}"
  return None


def _history_scale(cfg: ScalingConfig, state):
  """The delayed scale the QAT forward uses: the one its amax history gives."""
  scale, hist = state
  return numerics.select_scale(cfg, scale, hist, jnp.zeros((), jnp.float32))


def fold_fp8_kernel(recipe: Fp8Recipe, w, contract, kernel_state) -> dict:
  """Quantizes a weight once to fp8, with the scale the QAT forward used.

  Per tensor: delayed scaling takes the scale its amax history gives (what
  the next step would use); current scaling the weight's own amax. Row-wise:
  one current scale per output channel (in the weight's layout). MX: e8m0
  scales per block of the last contracting axis.

  Returns:
    ``{'kernel': fp8 codes in w's shape, 'kernel_scale': ...}``.
  """
  w = jnp.asarray(w)
  cfg = recipe.kernel
  if recipe.granularity == "row":
    s = numerics.row_scale(w, tuple(contract), cfg)
    return {"kernel": numerics.quantize(w, cfg.jnp_dtype, s), "kernel_scale": s}
  if recipe.granularity == "block":
    q, e = numerics.mx_quantize(w, contract[-1], recipe.block_size, cfg.jnp_dtype)
    return {"kernel": q, "kernel_scale": e}
  s = numerics.select_scale(cfg, kernel_state[0], kernel_state[1], numerics.amax(w))
  return {"kernel": numerics.quantize(w, cfg.jnp_dtype, s), "kernel_scale": s}


def live_fp8_kernel(recipe: Fp8Recipe, kernel_state) -> dict:
  """What an activation in the weight's role keeps: a delayed per-tensor scale."""
  if recipe.granularity == "tensor" and recipe.kernel.scaling == "delayed":
    return {"kernel_live_scale": _history_scale(recipe.kernel, kernel_state)}
  return {}


def freeze_fp8_input(recipe: Fp8Recipe, input_state) -> dict:
  """The frozen input scale (delayed per-tensor scaling), else nothing.

  Current, row-wise and MX scaling measure each batch, in serving too.
  """
  if recipe.granularity == "tensor" and recipe.input.scaling == "delayed":
    return {"input_scale": _history_scale(recipe.input, input_state)}
  return {}


def _tensor_q(cfg: ScalingConfig, x, scale):
  """``(q, s)`` of a per-tensor role: the frozen scale, or this batch's."""
  if scale is None:
    s = numerics.select_scale(cfg, jnp.ones((1,), jnp.float32),
                              jnp.zeros((cfg.history_length,), jnp.float32),
                              lowering.global_max(numerics.amax(x)))
  else:
    s = scale
  return numerics.quantize(x, cfg.jnp_dtype, s), s


def fp8_dot(lhs, kernel, dimension_numbers, *, recipe: Fp8Recipe, arrays: dict, folded: bool,
            out_dtype):
  """The served fp8 ``dot_general``: fp8 x fp8 GEMM, the scales applied once.

  The same steps as the QAT forward of each granularity
  (:mod:`fp8_linen.core.dot_general`), with the kernel read from its codes.
  """
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  dn = dims.canonical_dn(dimension_numbers, lhs.ndim, kernel.ndim)
  (lc, rc), _ = dn
  in_cfg, k_cfg = recipe.input, recipe.kernel
  how = lowering.resolve_gemm(recipe)
  if folded:
    q_r, s_r = kernel.astype(k_cfg.jnp_dtype), arrays["kernel_scale"]
  elif recipe.granularity == "tensor":
    q_r, s_r = _tensor_q(k_cfg, kernel, arrays.get("kernel_live_scale"))
  else:
    q_r, s_r = None, None
  if recipe.granularity == "tensor":
    q_l, s_l = _tensor_q(in_cfg, lhs, arrays.get("input_scale"))
    y = lowering.gemm(q_l, q_r, dn, how, out_dtype, lowering.dot_out_sharding(q_l, q_r, dn))
    return lowering.scaled(y, numerics.scale_product(s_l, s_r), out_dtype)
  if recipe.granularity == "row":
    lay = dims.layout(dn, lhs.ndim, kernel.ndim)
    s_l = numerics.row_scale(lhs, lc, in_cfg)
    if q_r is None:
      s_r = numerics.row_scale(kernel, rc, k_cfg)
      q_r = numerics.quantize(kernel, k_cfg.jnp_dtype, s_r)
    q_l = numerics.quantize(lhs, in_cfg.jnp_dtype, s_l)
    y = lowering.gemm(q_l, q_r, dn, how, out_dtype, lowering.dot_out_sharding(q_l, q_r, dn))
    s_out = numerics.scale_product(relayout_like(s_l, lay.lhs_to_out, y),
                                   relayout_like(s_r, lay.rhs_to_out, y))
    return (y.astype(jnp.float32) * s_out).astype(out_dtype)
  bs = recipe.block_size
  l_axis, r_axis = lc[-1], rc[-1]
  if q_r is None:
    q_r, s_r = numerics.mx_quantize(kernel, r_axis, bs, k_cfg.jnp_dtype)
  q_l, e_l = numerics.mx_quantize(lhs, l_axis, bs, in_cfg.jnp_dtype)
  up = jnp.float32 if how == "f32" else jnp.bfloat16
  y = lowering.lax_dot_general(numerics.mx_dequantize(q_l, e_l, l_axis, bs, up),
                               numerics.mx_dequantize(q_r, s_r, r_axis, bs, up), dn,
                               preferred_element_type=jnp.float32,
                               out_sharding=lowering.dot_out_sharding(q_l, q_r, dn))
  return y.astype(out_dtype)


def fp8_conv(lhs, kernel, conv_kwargs: dict, *, recipe: Fp8Recipe, arrays: dict, out_dtype):
  """The served fp8 convolution (per tensor): the forward of :mod:`fp8_linen.core.conv`."""
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  dn = lax.conv_dimension_numbers(lhs.shape, kernel.shape, conv_kwargs["dimension_numbers"])
  cfg = conv_ops.conv_config(lhs.ndim - 2, conv_kwargs["window_strides"], conv_kwargs["padding"],
                         conv_kwargs.get("lhs_dilation"), conv_kwargs.get("rhs_dilation"), dn,
                             conv_kwargs.get("feature_group_count", 1))
  q_r, s_r = kernel.astype(recipe.kernel.jnp_dtype), arrays["kernel_scale"]
  q_l, s_l = _tensor_q(recipe.input, lhs, arrays.get("input_scale"))
  return conv_ops.fp8_conv_of(q_l, s_l, q_r, s_r, cfg, lowering.resolve_gemm(recipe), out_dtype)
