"""Integer served products: the QAT forward of an integer recipe run from stored codes.

A weight is quantized once (:func:`fold_int_kernel`) with exactly the scale
(and zero point, LSQ+ offset) the QAT forward used and stored as ``int8`` or
``int4`` codes; the activation's quantization parameters are frozen from the
trained observer range or learned step (:func:`freeze_int_input`). The served
products (:func:`int_dot`, :func:`int_conv`) then compute the forward of the
QAT product from those arrays with the same functions the QAT product calls
(:func:`~fp8_linen.core.int_gemm.int_gemm`), so serving and QAT agree by
construction. A right operand that is not a weight is quantized on the fly
(:func:`live_int_kernel`). :func:`int_record` is what a conversion run
records of one product; :func:`int_served_dot` / :func:`int_served_conv` are
the recipe table's served products. The stored arrays' names:
:mod:`fp8_linen.core.serve`.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import int_serve
  >>> arrays = int_serve.fold_int_kernel(fl.IntRecipe().kernel, jnp.array([[0.5], [-1.0]]), (0,),
  ...                                    ())
  >>> arrays['kernel'].dtype, arrays['kernel'].ravel().tolist()
  (dtype('int8'), [64, -127])
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax import lax

from fp8_linen.core import (dims, int_codes, int_gemm, int_numerics, int_ops, int_product, lowering,
                            numerics)
from fp8_linen.core.int_gemm import contracted, resolve_int_gemm
from fp8_linen.core.serve import ServedRecord, record, require_arrays, unservable_error
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["storage_dtype", "weight_codes", "served_weight", "fold_int_kernel", "freeze_int_input", "live_int_kernel", "int_dot",
           "weight_only_dot", "int_conv", "int_servable", "int_quantizer_params", "int_record",
           "int_served_dot", "int_served_conv", "int_ragged_record", "int_served_ragged_dot"]

_INT4_SHIFT = 8  # unsigned 4-bit grids [0, 15] are stored shifted into int4's [-8, 7]


def _operand(cfg: IntQuantConfig, role: str, contract) -> int_codes.Operand:
  return int_codes.Operand(cfg=cfg, role=role, contract=tuple(contract))


def storage_dtype(cfg: IntQuantConfig):
  """``jnp.int4`` for grids of at most 4 bits, else ``jnp.int8``."""
  return jnp.int4 if cfg.bits <= 4 else jnp.int8


def _store_shift(op: int_codes.Operand) -> int:
  """What is subtracted from an ``int8`` code (already shifted) to store it."""
  if op.cfg.bits > 4:
    return 0
  lo, hi = op.cfg.qmin - op.shift, op.cfg.qmax - op.shift
  return 0 if -8 <= lo and hi <= 7 else _INT4_SHIFT


def fold_int_kernel(cfg: IntQuantConfig, w, contract, params, *,
                    with_code_sum: bool = False) -> dict:
  """Quantizes a weight once, as the QAT forward does; returns its stored arrays.

  Args:
    cfg: the weight's :class:`~fp8_linen.IntQuantConfig`.
    w: the float weight, in the layout the product sees.
    contract: its contracting axes in the product.
    params: ``()`` (STE: its own min/max), ``(step,)`` (LSQ) or ``(step,
      offset)`` (LSQ+).
    with_code_sum: also store the codes' sums over the contracting axes
      (``kernel_colsum``), which every product with an activation that has a
      zero point or an offset needs: summed once here instead of per call.

  Returns:
    ``{'kernel': codes in w's shape (int8 or int4), 'kernel_scale': ...,
    ['kernel_centre'], ['kernel_offset'], ['kernel_colsum']}``.
  """
  op = _operand(cfg, "kernel", contract)
  c, _, _ = int_codes.quantize(op, jnp.asarray(w), tuple(params))
  k = _store_shift(op)
  codes = c.codes
  if k:
    codes = (codes.astype(jnp.int32) - k).astype(jnp.int8)
  out = {"kernel": codes.reshape(jnp.shape(w)).astype(storage_dtype(cfg)),
         "kernel_scale": jnp.asarray(c.scale, jnp.float32)}
  if c.centre is not None:
    out["kernel_centre"] = jnp.asarray(c.centre, jnp.float32) - k
  if c.offset is not None:
    out["kernel_offset"] = jnp.asarray(c.offset, jnp.float32)
  if with_code_sum:  # of the stored (shifted) codes, which serving multiplies
    out["kernel_colsum"] = int_gemm.kernel_code_sum(codes, contract,
                                                       cfg.granularity == "group")
  return out


def _kernel_codes(cfg: IntQuantConfig, kernel, arrays, contract) -> int_codes.Codes:
  """The weight's :class:`~fp8_linen.core.int_codes.Codes` from its stored arrays.

  ``kernel`` may arrive cast to a float type by the layer (exact for integer
  codes); it is cast back to ``int8``.
  """
  codes = jnp.asarray(kernel).astype(jnp.int8)
  view, _ = int_numerics.int_view(codes, contract, cfg)
  return int_codes.Codes(view, arrays["kernel_scale"], arrays.get("kernel_centre"),
                           arrays.get("kernel_offset"), arrays.get("kernel_colsum"))


def weight_codes(rhs, recipe: IntRecipe):
  """The stored weight codes in their storage dtype (the layer may hand them over as float)."""
  return jnp.asarray(rhs).astype(storage_dtype(recipe.kernel))


def served_weight(codes, contract, batch, *, recipe: IntRecipe, arrays: dict, where: str):
  """The float32 weight a served integer product multiplies: its codes dequantized.

  Bit for bit QAT's fake-quantized weight (:func:`~fp8_linen.core.int_codes.dequantize`).
  """
  del batch, where
  codes = jnp.asarray(codes)
  wc = _kernel_codes(recipe.kernel, codes, arrays, tuple(contract))
  return int_codes.dequantize(wc, jnp.float32).reshape(codes.shape)


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


def _input_codes(cfg: IntQuantConfig, x, arrays) -> int_codes.Codes:
  """The activation's codes with frozen parameters (the QAT quantizer's expressions)."""
  op = _operand(cfg, "input", tuple(range(jnp.ndim(x))))
  s = arrays["input_scale"]
  if op.kind == "observer":
    z = arrays.get("input_zero_point", jnp.zeros((), jnp.float32))
    return int_codes.encode(op, jnp.asarray(x), s, z)[0]
  params = (s,) if op.kind == "lsq" else (s, arrays["input_offset"])
  c, _, _ = int_codes.quantize(op, jnp.asarray(x), params)
  return c


def live_int_kernel(cfg: IntQuantConfig, params) -> dict:
  """What an activation in the weight's role keeps: LSQ's step (and offset)."""
  if not cfg.learned:
    return {}
  out = {"kernel_step": jnp.asarray(params[0], jnp.float32)}
  if cfg.estimator == "lsq+":
    out["kernel_offset"] = jnp.asarray(params[1], jnp.float32)
  return out


def _live_codes(cfg: IntQuantConfig, x, arrays, contract) -> int_codes.Codes:
  op = _operand(cfg, "kernel", contract)
  params = () if not cfg.learned else (
      (arrays["kernel_step"],) if cfg.estimator == "lsq" else
      (arrays["kernel_step"], arrays["kernel_offset"]))
  c, _, _ = int_codes.quantize(op, jnp.asarray(x), params)
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
    arrays: the product's stored arrays (named as :mod:`fp8_linen.core.serve` lists
      them).
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
  how = int_gemm.resolve_int_gemm(
      recipe.gemm, int_gemm.contracted(recipe.kernel, kernel.shape, rc), x_op, w_op)
  y = int_gemm.int_gemm(xc, wc, dn, lhs_shape=lhs.shape, how=how,
                           group=recipe.kernel.granularity == "group")
  return y.astype(out_dtype)


def weight_only_dot(lhs, kernel, dimension_numbers, *, recipe: IntRecipe, arrays: dict,
                    folded: bool, out_dtype):
  """The served ``dot_general`` of a weight-only recipe (``input=None``).

  The float activation times the weight dequantized from its stored codes
  (:func:`~fp8_linen.core.int_codes.dequantize`, bit for bit QAT's
  fake-quantized weight), in ``recipe.compute_dtype`` resolved as QAT
  resolves it: QAT's float product of a fake-quantized weight, from codes.
  The weight is stored as int8/int4 codes (the memory saving); the GEMM runs
  in float.
  """
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  (_, rc), _ = dims.canonical_dn(dimension_numbers, lhs.ndim, kernel.ndim)
  wc = (_kernel_codes(recipe.kernel, kernel, arrays, rc) if folded
        else _live_codes(recipe.kernel, kernel, arrays, rc))
  wq = int_codes.dequantize(wc, kernel.dtype).reshape(kernel.shape)
  cd = int_gemm.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  xq, wq = lhs.astype(cd), wq.astype(cd)
  y = lowering.lax_dot_general(xq, wq, dimension_numbers, preferred_element_type=jnp.float32,
                               out_sharding=lowering.dot_out_sharding(xq, wq,
                                                                      dimension_numbers))
  return y.astype(out_dtype)


def int_conv(lhs, kernel, conv_kwargs: dict, *, recipe: IntRecipe, arrays: dict, out_dtype):
  """The served integer convolution from the stored kernel codes.

  Recipes :func:`~fp8_linen.core.int_gemm.conv_supported` accepts run on
  codes (:func:`~fp8_linen.core.int_gemm.int_conv`); the others (LSQ+,
  zero-point grids) are computed as QAT computes them: the fake-quantized
  input (frozen parameters) and the dequantized stored kernel, convolved in
  ``recipe.compute_dtype`` resolved against ``lhs`` as QAT resolves it
  (:func:`~fp8_linen.core.int_gemm.resolve_compute_dtype`).
  """
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  dn = lax.conv_dimension_numbers(lhs.shape, kernel.shape, conv_kwargs["dimension_numbers"])
  lc, rc = dims.conv_contract(lhs.ndim, kernel.ndim, dn)
  wc = _kernel_codes(recipe.kernel, kernel, arrays, rc)
  if int_gemm.conv_supported(recipe):
    xc = _input_codes(recipe.input, lhs, arrays)
    x_op, w_op = _operand(recipe.input, "input", lc), _operand(recipe.kernel, "kernel", rc)
    how = int_gemm.resolve_int_gemm(
        recipe.gemm, int_gemm.contracted(recipe.kernel, kernel.shape, rc), x_op, w_op)
    y = int_gemm.int_conv(xc, wc, int_gemm.conv_static(lhs.ndim, conv_kwargs, dn),
                             how=how)
    return y.astype(out_dtype)
  cfg = recipe.input
  if cfg is None:  # weight-only
    xq = lhs
  elif cfg.estimator == "ste":
    xq = int_numerics.int_fake_quant(lhs, arrays["input_scale"],
                                     arrays.get("input_zero_point", 0.0), cfg.qmin, cfg.qmax)
  elif cfg.estimator == "lsq":
    xq = int_ops.lsq_fake_quant(lhs, arrays["input_scale"], qmin=cfg.qmin, qmax=cfg.qmax)
  else:
    xq = int_ops.lsq_plus_fake_quant(lhs, arrays["input_scale"], arrays["input_offset"],
                                     qmin=cfg.qmin, qmax=cfg.qmax)
  wq = int_codes.dequantize(wc, kernel.dtype).reshape(kernel.shape)
  cd = int_gemm.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  xq, wq = xq.astype(cd), wq.astype(cd)
  y = lowering.lax_conv_general_dilated(xq, wq, **conv_kwargs, preferred_element_type=jnp.float32,
                                        out_sharding=lowering.conv_out_sharding(xq, wq, dn))
  return y.astype(out_dtype)


def int_servable(recipe: IntRecipe, conv: bool = False) -> str | None:
  """Why ``recipe`` cannot be served, or ``None`` when it can."""
  del conv  # integer convolutions serve whatever their dots serve
  if recipe.kernel is not None:
    return None  # weight-only recipes (input=None) serve the dequantized codes
  return ("recipe.kernel is None: nothing of the weight is quantized, so there are no codes "
          "to store; give the kernel role an IntQuantConfig")


def int_quantizer_params(role: str, cfg: IntQuantConfig, read):
  """``(params, ok)``: one role's trained quantizer values as the served arrays are built from.

  ``read(name)`` returns the layer's stored variable ``name`` (``None`` when
  it has none): ``<role>_step``/``<role>_offset`` (LSQ/LSQ+) or
  ``input_range`` (an STE observer). ``ok`` is ``False`` for an observer that
  has seen nothing.
  """
  if cfg.learned:
    names = [f"{role}_step"] + ([f"{role}_offset"] if cfg.estimator == "lsq+" else [])
    vals = tuple(read(n) for n in names)
    if role == "input":
      vals = tuple(jnp.reshape(v, ()) for v in vals)
    return vals, jnp.asarray(True)
  if role == "input":
    rng = read("input_range")
    if rng is None:
      return (jnp.zeros((2,), jnp.float32),), jnp.asarray(False)
    return (rng,), jnp.any(rng != 0)
  return (), jnp.asarray(True)


def int_record(recipe: IntRecipe, rhs, contract, read, *, conv: bool = False) -> ServedRecord:
  """What serving needs of one integer product (see :func:`int_quantizer_params` for ``read``)."""
  rp, _ = int_quantizer_params("kernel", recipe.kernel, read)
  if recipe.input is None:  # weight-only: nothing of the activation to freeze
    return record(fold_int_kernel(recipe.kernel, jnp.asarray(rhs), contract, rp),
                  live_int_kernel(recipe.kernel, rp), {}, True)
  lp, ok = int_quantizer_params("input", recipe.input, read)
  x_op = _operand(recipe.input, "input", ())
  # Dots of an activation with a zero point / offset need the weight's code sums.
  sums = not conv and (x_op.has_centre or x_op.has_offset)
  return record(fold_int_kernel(recipe.kernel, jnp.asarray(rhs), contract, rp,
                                 with_code_sum=sums),
                 live_int_kernel(recipe.kernel, rp), freeze_int_input(recipe.input, lp), ok)


def _check_int_servable(where: str, recipe: IntRecipe) -> None:
  why = int_servable(recipe)
  if why is not None:
    raise unservable_error(where, recipe, why)


def int_served_dot(lhs, rhs, dimension_numbers, *, recipe: IntRecipe, arrays: dict, out_dtype,
                   where: str):
  """The served integer ``dot_general`` from a layer's stored ``arrays`` (:func:`int_dot`)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  _check_int_servable(where, recipe)
  if recipe.input is None:
    return weight_only_dot(lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                           folded="kernel_scale" in arrays, out_dtype=out_dtype)
  require_arrays(where, arrays, ("input_scale",))
  return int_dot(lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                 folded="kernel_scale" in arrays, out_dtype=out_dtype)


def int_served_conv(lhs, rhs, conv_kwargs: dict, *, recipe: IntRecipe, arrays: dict, out_dtype,
                    where: str):
  """The served integer convolution from a layer's stored ``arrays`` (:func:`int_conv`)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  _check_int_servable(where, recipe)
  require_arrays(where, arrays, ("kernel_scale",) if recipe.input is None
                 else ("input_scale", "kernel_scale"))
  return int_conv(lhs, rhs, conv_kwargs, recipe=recipe, arrays=arrays, out_dtype=out_dtype)


def int_ragged_record(recipe: IntRecipe, rhs, read) -> ServedRecord:
  """What serving a trained integer grouped GEMM needs: the frozen input parameters.

  The experts' weights (``rhs``, ``(experts, k, n)``) are folded to int8
  codes with their scales as training quantized them (min/max per tensor or
  per expert and output channel), used where the weight reaches the product
  unchanged; otherwise they are quantized at each call. Only recipes with an
  integer grouped GEMM (:func:`~fp8_linen.core.int_product.ragged_supported`)
  are recorded.
  """
  lp, ok = int_quantizer_params("input", recipe.input, read)
  return record(fold_int_kernel(recipe.kernel, jnp.asarray(rhs), (1,), ()), {},
                freeze_int_input(recipe.input, lp), ok)


def int_served_ragged_dot(lhs, rhs, group_sizes, *, recipe: IntRecipe, arrays: dict,
                          out_dtype=None):
  """The served integer grouped GEMM: the frozen QAT forward of ``int_ragged_dot``.

  The routed tokens' codes come from the frozen ``input_scale``, each
  expert's weight is read from its stored codes (or quantized as training
  quantized it), and the codes are multiplied by the same grouped GEMM.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  xc = _input_codes(recipe.input, lhs, arrays)
  wc = (_kernel_codes(recipe.kernel, rhs, arrays, (1,)) if "kernel_scale" in arrays
        else _live_codes(recipe.kernel, rhs, arrays, (1,)))
  how = resolve_int_gemm(recipe.gemm, contracted(recipe.kernel, rhs.shape, (1,)),
                         _operand(recipe.input, "input", ()), _operand(recipe.kernel, "kernel",
                                                                       (1,)))
  return int_product.ragged_code_gemm(xc, wc, group_sizes, how).astype(out_dtype)
