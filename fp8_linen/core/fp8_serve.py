"""fp8 served products: the QAT forward of an fp8 recipe run from stored codes.

A weight is quantized once to fp8 (or fp4) codes with exactly the scale the
QAT forward used (:func:`fold_fp8_kernel`: per tensor, row-wise, MXFP8,
NVFP4); the activation's scale is frozen from its amax history where the
forward reads one (:func:`freeze_fp8_input`: delayed per-tensor scaling,
NVFP4 delayed) and measured per batch otherwise, as in QAT. The served
products (:func:`fp8_dot`, :func:`fp8_conv`) run the "quantize" half of the
QAT forward with those arrays and then the very "multiply" half QAT runs
(:func:`~fp8_linen.core.dot_general.fp8_dot_of`,
:meth:`~fp8_linen.core.block_dot.BlockDot.serve`,
:func:`~fp8_linen.core.conv.fp8_conv_of`, all through
:func:`~fp8_linen.core.lowering.gemm`), so serving and QAT agree by
construction. A right operand that is not a weight is quantized on the fly
(:func:`live_fp8_kernel`). :func:`fp8_record` is what a conversion run
records of one product; :func:`fp8_served_dot` / :func:`fp8_served_conv` are
the recipe table's served products. The stored arrays' names:
:mod:`fp8_linen.core.serve`.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import fp8_serve
  >>> arrays = fp8_serve.fold_fp8_kernel(fl.rowwise_scaling(), jnp.array([[0.5, 2.0], [-1.0, 4.0]]),
  ...                                    (0,), None)
  >>> arrays['kernel'].dtype, arrays['kernel_scale'].shape
  (dtype(float8_e4m3fn), (1, 2))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax import lax

from fp8_linen.core import conv as conv_ops
from fp8_linen.core import dims, lowering, numerics, owg, ragged_dot
from fp8_linen.core.block_dot import BlockDot, block_factor, block_fold_kernel
from fp8_linen.core.dot_general import fp8_dot_of
from fp8_linen.core.serve import ServedRecord, record, require_arrays
from fp8_linen.recipes.fp8 import Fp8Recipe, ScalingConfig

__all__ = ["weight_codes", "served_weight", "fold_fp8_kernel", "freeze_fp8_input", "live_fp8_kernel", "fp8_dot", "fp8_conv",
           "fp8_servable", "fp8_record", "fp8_served_dot", "fp8_served_conv", "tensor_quantize",
           "ragged_record", "served_ragged_dot"]


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
    q, s, _ = numerics.row_quantize(w, tuple(contract), cfg)
    return {"kernel": q, "kernel_scale": s}
  s = numerics.select_scale(cfg, kernel_state[0], kernel_state[1], numerics.amax(w))
  return {"kernel": numerics.quantize(w, cfg.jnp_dtype, s), "kernel_scale": s}


def weight_codes(rhs, recipe: Fp8Recipe):
  """The stored weight codes in their storage dtype (the layer may hand them over as float)."""
  return jnp.asarray(rhs).astype(recipe.kernel.jnp_dtype)


def served_weight(codes, contract, batch, *, recipe: Fp8Recipe, arrays: dict, where: str):
  """The float32 weight a served fp8 product multiplies: codes times their scale.

  Per tensor and row-wise (the scale broadcasts in the weight's layout).

  Raises:
    ValueError: naming ``where``, for block recipes (MXFP8, NVFP4), whose
      stored scales are laid out for the GEMM, not the weight.
  """
  del contract, batch
  if recipe.granularity == "block":
    raise ValueError(f"{where}: a served {recipe.kernel.dtype} block-scaled weight (MXFP8 / "
                     "NVFP4) is not dequantized here; LoRA adapters and merging need a "
                     "per-tensor or row-wise fp8 recipe, or an integer one")
  return jnp.asarray(codes).astype(jnp.float32) * jnp.asarray(arrays["kernel_scale"], jnp.float32)


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


def tensor_quantize(cfg: ScalingConfig, x, scale):
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
    quantize = lambda x, cfg, contract, scale: tensor_quantize(cfg, x, scale)
  else:
    quantize = lambda x, cfg, contract, scale: numerics.row_quantize(x, contract, cfg)[:2]
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
  q_l, s_l = tensor_quantize(recipe.input, lhs, arrays.get("input_scale"))
  return conv_ops.fp8_conv_of(q_l, s_l, q_r, s_r, cfg, lowering.resolve_gemm(recipe), out_dtype)


def _frozen_fp8_input(recipe: Fp8Recipe) -> bool:
  """Whether the input's scale is frozen (delayed per tensor) rather than measured per batch."""
  return _delayed_tensor_scale(recipe, recipe.input)


def fp8_record(recipe: Fp8Recipe, rhs, contract, input_state, kernel_state, *,
               conv: bool = False, batch=()) -> ServedRecord:
  """What serving needs of one fp8 product (see :func:`~fp8_linen.core.serve.served_from_record`).

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
  return record(fold_fp8_kernel(recipe, rhs, contract, kernel_state, batch),
                 {} if conv else live_fp8_kernel(recipe, kernel_state),
                 freeze_fp8_input(recipe, input_state), ok)


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
  require_arrays(where, arrays, need)
  return fp8_dot(lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                 folded="kernel_scale" in arrays, out_dtype=out_dtype)


def fp8_served_conv(lhs, rhs, conv_kwargs: dict, *, recipe: Fp8Recipe, arrays: dict, out_dtype,
                    where: str):
  """The served fp8 convolution from a layer's stored ``arrays`` (codes in ``rhs``)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  require_arrays(where, arrays, ("kernel_scale",))
  return fp8_conv(lhs, rhs, conv_kwargs, recipe=recipe, arrays=arrays, out_dtype=out_dtype)


# ----------------------------------------------------------------------------
# Serving: the frozen forward of a trained grouped GEMM.
# ----------------------------------------------------------------------------


def _kernel_scales(cfg, state, grouped: bool):
  """The weight's delayed scale(s) as the next QAT step would use them."""
  one = lambda s, h: numerics.select_scale(cfg, s, h, jnp.zeros((), jnp.float32))
  return jax.vmap(one)(state.scale, state.amax_history) if grouped else one(*state)


def _expert_codes(recipe: Fp8Recipe, rhs, live):
  """``(codes, scales)`` of the experts' weights: one scale per expert (``(g, 1)``) or one."""
  if live is None or jnp.ndim(live) == 2:
    scales = None if live is None else jnp.asarray(live)
    return jax.vmap(lambda w, s: tensor_quantize(recipe.kernel, w, s),
                    in_axes=(0, None if scales is None else 0))(rhs, scales)
  return tensor_quantize(recipe.kernel, rhs, live)


def ragged_record(recipe: Fp8Recipe, input_state, kernel_state, rhs) -> ServedRecord:
  """What serving a trained fp8 grouped GEMM needs (see :func:`served_ragged_dot`).

  The experts' weights (``rhs``) are folded to fp8 codes with their delayed
  scale(s) as training left them (``(g, 1)`` per expert) or, with current
  scaling, their own amax (``kernel``, ``kernel_scale``), used where the
  weight reaches the product unchanged; otherwise they are quantized at each
  call with those scales (``kernel_live_scale``). The input's delayed scale
  is frozen (``input_scale``).
  """
  grouped = jnp.ndim(kernel_state[0]) == 2
  live = ({"kernel_live_scale": _kernel_scales(recipe.kernel, owg.as_state(*kernel_state),
                                                 grouped)}
          if recipe.kernel.scaling == "delayed" else {})
  codes, scales = _expert_codes(recipe, jnp.asarray(rhs), live.get("kernel_live_scale"))
  frozen = freeze_fp8_input(recipe, input_state)
  ok = jnp.any(input_state.amax_history > 0) if frozen else True
  return record({"kernel": codes, "kernel_scale": scales}, live, frozen, ok)


def served_ragged_dot(lhs, rhs, group_sizes, *, recipe: Fp8Recipe, arrays: dict, out_dtype=None):
  """The served fp8 grouped GEMM: the frozen QAT forward of :func:`~fp8_linen.core.ragged_dot.fp8_ragged_dot`.

  The routed tokens are quantized with the frozen ``input_scale`` (delayed;
  current scaling measures the batch), each expert's weight read from its
  stored codes (``kernel_scale``) or quantized with its ``kernel_live_scale``
  (or its own amax), and the codes multiplied as in training: the same
  output, bit for bit, as the QAT forward under
  :func:`~fp8_linen.frozen_quantizers`.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  q_l, s_l = tensor_quantize(recipe.input, lhs, arrays.get("input_scale"))
  if "kernel_scale" in arrays:
    q_r, s_r = rhs.astype(recipe.kernel.jnp_dtype), jnp.asarray(arrays["kernel_scale"])
  else:
    q_r, s_r = _expert_codes(recipe, rhs, arrays.get("kernel_live_scale"))
  return ragged_dot.ragged_gemm(q_l, q_r, group_sizes, lowering.resolve_gemm(recipe),
                                ragged_dot.group_scales(s_l, s_r), out_dtype)
