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
               in the weight's (view) layout; block (MXFP8 ``float8_e8m0fnu``,
               NVFP4 ``float8_e4m3fn``): per block of the forward's
               contracting axes, ``(B, N, ceil(K / block))`` of the weight's
               (batch, free, contracting) view
kernel_tensor_scale  NVFP4: the weight's per-tensor scale ``(1,)`` as its
               role's ScalingConfig chose it (its factor is this over 448)
kernel_centre  integer grids with a zero point: ``zero_point - storage shift``
kernel_offset  LSQ+'s learned offset
kernel_colsum  the codes summed over the contracting axes (int32), for
               activations with a zero point or LSQ+ offset: folded once
input_scale    the frozen activation scale: fp8 delayed per tensor, and
               NVFP4 delayed (its per-tensor factor is this over 448); absent
               where it is computed from each batch (fp8 current, row-wise,
               MXFP8, NVFP4 current)
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

import dataclasses

import jax
import jax.numpy as jnp

from jax import lax

from fp8_linen.core import conv as conv_ops
from fp8_linen.core import dims, int_numerics, int_ops, int_product, lowering, numerics
from fp8_linen.core.dot_general import (BlockDot, block_factor, block_fold_kernel, fp8_dot_of,
                                        row_quantize)
from fp8_linen.recipes.fp8 import Fp8Recipe, ScalingConfig
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["storage_dtype", "fold_int_kernel", "freeze_int_input", "live_int_kernel", "int_dot",
           "int_conv", "fold_fp8_kernel", "freeze_fp8_input", "live_fp8_kernel", "fp8_dot",
           "fp8_conv", "fp8_servable", "int_servable", "unservable_error", "ServedRecord",
           "fp8_record", "int_quantizer_params", "int_record", "with_kernel_check",
           "folds_kernel", "served_from_record", "untrained_error", "no_product_error",
           "fp8_served_dot", "fp8_served_conv", "int_served_dot", "int_served_conv"]

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
  c, _, _ = int_product.quantize(op, jnp.asarray(w), tuple(params))
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
    out["kernel_colsum"] = int_product.kernel_code_sum(codes, contract,
                                                       cfg.granularity == "group")
  return out


def _kernel_codes(cfg: IntQuantConfig, kernel, arrays, contract) -> int_product.Codes:
  """The weight's :class:`~fp8_linen.core.int_product.Codes` from its stored arrays.

  ``kernel`` may arrive cast to a float type by the layer (exact for integer
  codes); it is cast back to ``int8``.
  """
  codes = jnp.asarray(kernel).astype(jnp.int8)
  view, _ = int_numerics.int_view(codes, contract, cfg)
  return int_product.Codes(view, arrays["kernel_scale"], arrays.get("kernel_centre"),
                           arrays.get("kernel_offset"), arrays.get("kernel_colsum"))


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


def fold_fp8_kernel(recipe: Fp8Recipe, w, contract, kernel_state, batch=()) -> dict:
  """Quantizes a weight once to fp8 (or fp4), with the scale the QAT forward used.

  Per tensor: delayed scaling takes the scale its amax history gives (what
  the next step would use); current scaling the weight's own amax. Row-wise:
  one current scale per output channel (in the weight's layout). Block
  (MXFP8, NVFP4): the codes and block scales the forward GEMM of
  :class:`~fp8_linen.core.dot_general.BlockDot` multiplies (blocked along
  the contracting axes; NVFP4's 2-D tiles: their rows), with NVFP4's
  per-tensor factor chosen as the QAT forward chooses it from
  ``kernel_state`` (delayed: the amax history; current: the weight's amax).

  Args:
    recipe: the product's recipe.
    w: the weight, in the layout the product sees.
    contract: its contracting axes.
    kernel_state: its trained ``RoleState``.
    batch: its batch axes (block products view the weight as (B, N, K)).

  Returns:
    ``{'kernel': codes in w's shape, 'kernel_scale': ...[,
    'kernel_tensor_scale']}``.
  """
  w = jnp.asarray(w)
  cfg = recipe.kernel
  if recipe.granularity == "block":
    a = lowering.global_max(numerics.amax(w))
    if not recipe.is_nvfp4:
      q, s = block_fold_kernel(recipe, w, tuple(contract), tuple(batch), None)
      return {"kernel": q, "kernel_scale": s}
    # The role's scale is stored, not its factor (scale / 448): serving
    # derives the factor with QAT's expression, which XLA then simplifies
    # alike in both (it reassociates the product of the two factors).
    t = numerics.select_scale(cfg, kernel_state[0], kernel_state[1], a)
    q, s = block_fold_kernel(recipe, w, tuple(contract), tuple(batch),
                             numerics.nvfp4_tensor_scale(t))
    return {"kernel": q, "kernel_scale": s, "kernel_tensor_scale": t}
  if recipe.granularity == "row":
    q, s = row_quantize(w, tuple(contract), cfg)
    return {"kernel": q, "kernel_scale": s}
  s = numerics.select_scale(cfg, kernel_state[0], kernel_state[1], numerics.amax(w))
  return {"kernel": numerics.quantize(w, cfg.jnp_dtype, s), "kernel_scale": s}


def _delayed_tensor_scale(recipe: Fp8Recipe, cfg: ScalingConfig) -> bool:
  """Whether a role's per-tensor scale comes from its amax history (fp8 or NVFP4 delayed)."""
  per_tensor = recipe.granularity == "tensor" or (recipe.granularity == "block" and
                                                  recipe.is_nvfp4)
  return per_tensor and cfg.scaling == "delayed"


def live_fp8_kernel(recipe: Fp8Recipe, kernel_state) -> dict:
  """What an activation in the weight's role keeps: a delayed per-tensor scale."""
  if _delayed_tensor_scale(recipe, recipe.kernel):
    return {"kernel_live_scale": _history_scale(recipe.kernel, kernel_state)}
  return {}


def freeze_fp8_input(recipe: Fp8Recipe, input_state) -> dict:
  """The frozen input scale (delayed per-tensor scaling, NVFP4 delayed too), else nothing.

  Current, row-wise and MXFP8 scaling measure each batch, in serving too; so
  does NVFP4's per-tensor factor with current scaling (its block scales
  always do).
  """
  if _frozen_fp8_input(recipe):
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

  The "quantize" half of the QAT forward (:mod:`fp8_linen.core.dot_general`)
  with the input's frozen scale (delayed per tensor; the others measure the
  batch as in QAT) and the kernel read from its codes; then the very
  "multiply" half QAT runs (:func:`~fp8_linen.core.dot_general.fp8_dot_of`;
  block recipes: :meth:`~fp8_linen.core.dot_general.BlockDot.serve`).
  """
  lhs, kernel = jnp.asarray(lhs), jnp.asarray(kernel)
  dn = dims.canonical_dn(dimension_numbers, lhs.ndim, kernel.ndim)
  if recipe.granularity == "block":
    return _block_dot(lhs, kernel, dn, recipe=recipe, arrays=arrays, folded=folded,
                      out_dtype=out_dtype)
  (lc, rc), _ = dn
  in_cfg, k_cfg = recipe.input, recipe.kernel
  if recipe.granularity == "tensor":
    quantize = lambda x, cfg, contract, scale: _tensor_q(cfg, x, scale)
  else:
    quantize = lambda x, cfg, contract, scale: row_quantize(x, contract, cfg)
  if folded:
    q_r, s_r = kernel.astype(k_cfg.jnp_dtype), arrays["kernel_scale"]
  else:
    q_r, s_r = quantize(kernel, k_cfg, rc, arrays.get("kernel_live_scale"))
  q_l, s_l = quantize(lhs, in_cfg, lc, arrays.get("input_scale"))
  return fp8_dot_of(q_l, s_l, q_r, s_r, dn, recipe=recipe, gemm=lowering.resolve_gemm(recipe),
                    out_dtype=out_dtype)


def _block_dot(lhs, kernel, dn, *, recipe: Fp8Recipe, arrays: dict, folded: bool, out_dtype):
  """The served block (MXFP8, NVFP4) ``dot_general``: :meth:`BlockDot.serve`.

  The input is quantized as the QAT forward quantizes it: block scales from
  this batch, NVFP4's per-tensor factor from the frozen ``input_scale``
  (delayed) or this batch's amax (current). A live right operand (no stored
  codes) is quantized as the QAT forward quantizes a weight.
  """
  (_, rc), (_, rb) = dn
  spec = BlockDot(dn=dn, recipe=recipe, gemm=lowering.resolve_gemm(recipe), out_dtype=out_dtype,
                  lhs_dtype=lhs.dtype, rhs_dtype=kernel.dtype, first=True, frozen=True)
  if folded:
    codes, scales = kernel.astype(recipe.kernel.jnp_dtype), arrays["kernel_scale"]
    factor = (numerics.nvfp4_tensor_scale(arrays["kernel_tensor_scale"]) if recipe.is_nvfp4
              else jnp.ones((), jnp.float32))
  else:
    live = arrays.get("kernel_live_scale")
    if live is None:
      cfg = recipe.kernel
      factor = block_factor(recipe, cfg, jnp.ones((1,), jnp.float32),
                            jnp.zeros((cfg.history_length,), jnp.float32),
                            lowering.global_max(numerics.amax(kernel)))
    else:
      factor = numerics.nvfp4_tensor_scale(live)
    codes, scales = block_fold_kernel(recipe, kernel, rc, rb, factor)
  return spec.serve(lhs, codes, scales, factor, arrays.get("input_scale"))


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


# ----------------------------------------------------------------------------
# Conversion records and served products, for both APIs (Linen, NNX)
#
# A conversion run (``fl.convert``, ``fl.nnx.convert``) runs each quantized
# product once and records, per product, the arrays serving needs and the
# checks read after the run (values are traced there, so the record is a
# pytree a jitted function returns).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedRecord:
  """What a conversion run records of one product (see :func:`served_from_record`).

  Attributes:
    fold: the arrays of the weight folded to codes (``kernel``,
      ``kernel_scale``, ...), used when the right operand is the layer's
      unchanged ``kernel``.
    live: what a right operand that is not a weight keeps instead (it is
      quantized on the fly in serving).
    frozen: the input's frozen quantization parameters (``input_scale``, ...).
    state_ok: whether the product has trained state (a bool array).
    kernel_at: where the layer keeps the right operand's ``kernel``: ``0``
      itself, ``1`` its parent, ``-1`` nowhere (an int array; the layer's
      conversion run fills it in with :func:`with_kernel_check`).
    kernel_equal: whether that ``kernel`` reaches the product unchanged.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.core import serve
    >>> rec = jax.jit(lambda w: serve.int_record(fl.IntRecipe(), w, (0,), lambda n: None))(
    ...     jnp.ones((3, 2)))
    >>> sorted(rec.fold), bool(rec.state_ok), rec.kernel_at
    (['kernel', 'kernel_scale'], False, None)
  """

  fold: dict
  live: dict
  frozen: dict
  state_ok: jax.Array
  kernel_at: jax.Array | None = None
  kernel_equal: jax.Array | None = None


def unservable_error(where: str, recipe, why: str) -> ValueError:
  """The error (naming the layer ``where``) for a recipe that cannot be served, and why."""
  return ValueError(f"{where}: recipe={recipe!r} cannot be served: {why}")


def int_servable(recipe: IntRecipe, conv: bool = False) -> str | None:
  """Why ``recipe`` cannot be served, or ``None`` when it can."""
  del conv  # integer convolutions serve whatever their dots serve
  if int_product.dot_supported(recipe):
    return None
  role = "input" if recipe.input is None else "kernel"
  return (f"recipe.{role} is None, so QAT runs a float product of a fake-quantized "
          "operand; give both roles an IntQuantConfig")


def _frozen_fp8_input(recipe: Fp8Recipe) -> bool:
  """Whether the input's scale is frozen (delayed per tensor) rather than measured per batch."""
  return _delayed_tensor_scale(recipe, recipe.input)


def _record(fold: dict, live: dict, frozen: dict, state_ok) -> ServedRecord:
  return ServedRecord(fold=fold, live=live, frozen=frozen, state_ok=jnp.asarray(state_ok))


def fp8_record(recipe: Fp8Recipe, rhs, contract, input_state, kernel_state, *,
               conv: bool = False, batch=()) -> ServedRecord:
  """What serving needs of one fp8 product (see :func:`served_from_record`).

  Args:
    recipe: the product's recipe.
    rhs: its right operand as the product sees it.
    contract: the right operand's contracting axes.
    input_state: the input's trained ``RoleState``.
    kernel_state: the weight's.
    conv: the product is a convolution (its right operand is always a weight).
    batch: the right operand's batch axes.
  """
  ok = jnp.any(input_state.amax_history > 0) if _frozen_fp8_input(recipe) else True
  return _record(fold_fp8_kernel(recipe, rhs, contract, kernel_state, batch),
                 {} if conv else live_fp8_kernel(recipe, kernel_state),
                 freeze_fp8_input(recipe, input_state), ok)


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
  lp, ok = int_quantizer_params("input", recipe.input, read)
  rp, _ = int_quantizer_params("kernel", recipe.kernel, read)
  x_op = _operand(recipe.input, "input", ())
  # Dots of an activation with a zero point / offset need the weight's code sums.
  sums = not conv and (x_op.has_centre or x_op.has_offset)
  return _record(fold_int_kernel(recipe.kernel, jnp.asarray(rhs), contract, rp,
                                 with_code_sum=sums),
                 live_int_kernel(recipe.kernel, rp), freeze_int_input(recipe.input, lp), ok)


def with_kernel_check(record: ServedRecord, at, kernel, rhs) -> ServedRecord:
  """``record`` with its checks of the right operand: is it the layer's ``kernel``, unchanged?

  ``at`` says where the layer keeps ``kernel`` (``0``: itself, ``1``: its
  parent; ``None``: the operand is no weight) and ``kernel`` is its value.
  Only a weight that reaches the product unchanged is folded to codes; any
  other right operand (an activation, a kernel the product sums first) is
  quantized live in serving.
  """
  rhs = jnp.asarray(rhs)
  equal = (jnp.asarray(False) if kernel is None else
           jnp.array_equal(jnp.asarray(kernel).astype(rhs.dtype).reshape(rhs.shape), rhs))
  return dataclasses.replace(record, kernel_at=jnp.asarray(-1 if at is None else at),
                             kernel_equal=equal)


def folds_kernel(record: ServedRecord) -> bool:
  """Whether serving reads the weight's codes (else it quantizes the right operand live)."""
  return int(record.kernel_at) >= 0 and bool(record.kernel_equal)


def untrained_error(where: str) -> ValueError:
  return ValueError(
      f"{where}: has no trained quantization state: its frozen input scale would come from "
      "an empty amax history / observer range. Convert a trained (or calibrated) model with "
      "its quantization state (Linen: the '_overwrite_with_gradient' collection; NNX: its "
      "fl.nnx.QuantState variables)")


def no_product_error(who: str, layers: str) -> ValueError:
  return ValueError(f"{who}: the model ran no quantized product, so there is nothing to serve "
                    f"(build it from {layers})")


def served_from_record(where: str, rec: ServedRecord) -> tuple:
  """``(kernel_codes or None, arrays)``: what a layer stores in place of its QAT variables.

  ``kernel_codes`` (the weight folded to codes, to store in place of
  ``kernel``) is ``None`` where the right operand is quantized live. The
  arrays are named as the module doc lists them.

  Raises:
    ValueError: naming ``where``, for a product without trained state.
  """
  if not bool(rec.state_ok):
    raise untrained_error(where)
  if folds_kernel(rec):
    arrays = {k: v for k, v in rec.fold.items() if k != "kernel"}
    kernel = rec.fold["kernel"]
  else:
    arrays, kernel = dict(rec.live), None
  return kernel, {**arrays, **rec.frozen}


def _require(where: str, arrays: dict, names) -> None:
  for name in names:
    if name not in arrays:
      raise ValueError(f"{where}: the served params hold no {name} for this layer; serve "
                       "the arrays fl.convert (fl.nnx.convert) stored for it")


def fp8_served_dot(lhs, rhs, dimension_numbers, *, recipe: Fp8Recipe, arrays: dict, out_dtype,
                   where: str):
  """The served fp8 ``dot_general`` from a layer's stored ``arrays`` (:func:`fp8_dot`).

  ``rhs`` holds the stored codes (possibly cast to float by the layer) where
  ``arrays`` has a ``kernel_scale``, else the live right operand.
  """
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  need = ("input_scale",) if _frozen_fp8_input(recipe) else ()
  if recipe.granularity == "block" and recipe.is_nvfp4 and "kernel_scale" in arrays:
    need += ("kernel_tensor_scale",)
  _require(where, arrays, need)
  return fp8_dot(lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                 folded="kernel_scale" in arrays, out_dtype=out_dtype)


def fp8_served_conv(lhs, rhs, conv_kwargs: dict, *, recipe: Fp8Recipe, arrays: dict, out_dtype,
                    where: str):
  """The served fp8 convolution from a layer's stored ``arrays`` (codes in ``rhs``)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  _require(where, arrays, ("kernel_scale",))
  return fp8_conv(lhs, rhs, conv_kwargs, recipe=recipe, arrays=arrays, out_dtype=out_dtype)


def _check_int_servable(where: str, recipe: IntRecipe) -> None:
  why = int_servable(recipe)
  if why is not None:
    raise unservable_error(where, recipe, why)


def int_served_dot(lhs, rhs, dimension_numbers, *, recipe: IntRecipe, arrays: dict, out_dtype,
                   where: str):
  """The served integer ``dot_general`` from a layer's stored ``arrays`` (:func:`int_dot`)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  _check_int_servable(where, recipe)
  _require(where, arrays, ("input_scale",))
  return int_dot(lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                 folded="kernel_scale" in arrays, out_dtype=out_dtype)


def int_served_conv(lhs, rhs, conv_kwargs: dict, *, recipe: IntRecipe, arrays: dict, out_dtype,
                    where: str):
  """The served integer convolution from a layer's stored ``arrays`` (:func:`int_conv`)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  _check_int_servable(where, recipe)
  _require(where, arrays, ("input_scale", "kernel_scale"))
  return int_conv(lhs, rhs, conv_kwargs, recipe=recipe, arrays=arrays, out_dtype=out_dtype)
