"""The exact integer GEMM: int8 codes multiplied once, zero points and scales applied after.

:func:`int_gemm` computes ``dot_general(x_hat, w_hat)`` of two operands given
as :class:`~fp8_linen.core.int_codes.Codes`: the codes are multiplied in one
integer GEMM, ``lax.dot_general(int8, int8, preferred_element_type=int32)``,
exact; zero points, offsets and groups are corrected with row sums of the
codes, and the scales are applied once to the int32 result.
:func:`int_conv` is the same for a convolution (symmetric grids only:
:func:`conv_supported`). Both are the forward of the QAT product
(:mod:`~fp8_linen.core.int_product`) and of the served model
(:mod:`~fp8_linen.core.serve`), so the two agree bit for bit.

Lowering of the forward product (``IntRecipe.gemm``, :func:`resolve_int_gemm`):

* ``'int8'``: int8 x int8 -> int32, the form integer units (GPU IMMA, CPU VNNI)
  run;
* ``'bf16'``: the codes are upcast exactly to bfloat16 and accumulated in
  float32. Every partial sum is an integer of magnitude at most ``K * max|c_x|
  * max|c_w|``; while that is ``<= 2**24`` float32 holds it exactly, so the
  result is bit-identical to ``'int8'``. Allowed only when the bound holds.
* ``'auto'``: ``'int8'`` on GPU/TPU; on CPU ``'bf16'`` where it is exact (XLA:CPU
  runs bf16 GEMMs faster than int8 ones) and ``'int8'`` otherwise.

The gradient GEMMs' operands are in ``IntRecipe.compute_dtype``
(:func:`resolve_compute_dtype`).

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import int_codes, int_gemm
  >>> x = int_codes.Codes(jnp.array([[1, -2]], jnp.int8), jnp.float32(0.5))
  >>> w = int_codes.Codes(jnp.array([[3], [4]], jnp.int8), jnp.ones((1, 1), jnp.float32))
  >>> int_gemm.int_gemm(x, w, (((1,), (0,)), ((), ())), lhs_shape=(1, 2), group=False,
  ...                   how="int8").tolist()
  [[-2.5]]
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from fp8_linen.core import dims, lowering, mesh
from fp8_linen.core.int_codes import Codes, Operand, rank_like
from fp8_linen.core.lowering import relayout
from fp8_linen.recipes.integer import COMPUTE_DTYPES, IntQuantConfig, IntRecipe

__all__ = ["INT_GEMMS", "contracted", "code_bound", "resolve_int_gemm", "resolve_compute_dtype",
           "int_gemm", "kernel_code_sum", "conv_fn", "int_conv", "conv_static", "conv_supported",
           "dot_supported"]

INT_GEMMS = ("auto", "int8", "bf16")
_EXACT = 2 ** 24  # float32 holds every integer up to this magnitude


def contracted(cfg: IntQuantConfig, rhs_shape, rc) -> int:
  """How many elements one integer partial sum adds up: a group, or all contracted ones."""
  if cfg.granularity == "group":
    return cfg.group_size
  return math.prod(rhs_shape[a] for a in rc)


def code_bound(k: int, x: Operand, w: Operand) -> int:
  """The largest magnitude a partial sum of the code product can reach."""
  return k * x.max_code * w.max_code


def resolve_int_gemm(gemm: str, k: int, x: Operand, w: Operand, owner: str = "IntRecipe") -> str:
  """``'int8'`` or ``'bf16'`` for a product contracting ``k`` elements (see module doc)."""
  exact = code_bound(k, x, w) <= _EXACT
  if gemm == "auto":
    return "bf16" if lowering.current_backend() == "cpu" and exact else "int8"
  if gemm == "bf16" and not exact:
    raise ValueError(
        f"{owner}.gemm='bf16' is not exact for this product: {k} contracted elements x codes "
        f"up to {x.max_code} x {w.max_code} can reach {code_bound(k, x, w)} > 2**24; "
        "use gemm='int8' or 'auto'")
  return gemm


def resolve_compute_dtype(compute_dtype: str, activation_dtype):
  """The dtype of an integer product's float GEMM operands (``IntRecipe.compute_dtype``).

  ``'auto'`` follows the activation (the product's left operand):
  bfloat16 for bfloat16, float32 for every other dtype. A bf16 model's
  gradient GEMMs then read bf16 operands (half the bytes, and the form a TPU
  MXU or GPU tensor core takes natively); float16 gets float32, which holds
  it exactly where bfloat16 would drop 3 mantissa bits. The float product of
  a fake-quantized role and the served model resolve it here too, so serving
  computes in the dtype QAT did.

  Args:
    compute_dtype: ``'auto'``, ``'float32'`` or ``'bfloat16'``.
    activation_dtype: the dtype of the activation operand.

  Returns:
    A ``numpy`` dtype: bfloat16 or float32.
  """
  if compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"IntRecipe.compute_dtype={compute_dtype!r} is not allowed; allowed "
                     f"values: {list(COMPUTE_DTYPES)}")
  if compute_dtype == "auto":
    bf16 = jnp.dtype(activation_dtype) == jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.bfloat16 if bf16 else jnp.float32)
  return jnp.dtype(compute_dtype)


def _code_product(a, b, how: str, fn):
  """``fn(a, b, preferred)`` on int8 codes: int32 (``'int8'``) or float32 (``'bf16'``).

  Either holds the exact integer result: the ``'bf16'`` lowering is only
  chosen where every partial sum stays below 2**24.
  """
  if how == "int8":
    return fn(a, b, jnp.int32)
  return fn(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), jnp.float32)


def _group_views(dn, lhs_shape, rhs_view_shape, group: bool):
  """Dimension numbers on the views, and the reshaped lhs shape.

  For a ``'group'`` kernel the (single) contracting axis of both operands is
  split into ``(groups, group_size)`` and the groups become the last batch
  dimension, so one batched integer GEMM gives one partial product per group.
  """
  if not group:
    return dn, tuple(lhs_shape)
  (lc, rc), (lb, rb) = dn
  (al,), (ar,) = lc, rc
  n_groups, size = rhs_view_shape[ar], rhs_view_shape[ar + 1]
  up = lambda axes, a: tuple(i + 1 if i > a else i for i in axes)
  lshape = tuple(lhs_shape[:al]) + (n_groups, size) + tuple(lhs_shape[al + 1:])
  vdn = (((al + 1,), (ar + 1,)), (up(lb, al) + (al,), up(rb, ar) + (ar,)))
  return vdn, lshape


def int_gemm(xc: Codes, wc: Codes, dn, *, lhs_shape, group: bool, how: str):
  """``dot_general(x_hat, w_hat, dn)`` in float32 from the codes of both operands.

  ``xc`` is the activation quantized per tensor (codes in ``lhs_shape``),
  ``wc`` the weight in its view (see :class:`Codes`; ``group``: its contracting
  axis is split into groups). One integer GEMM of the
  codes, exact; zero points/offsets via code sums (exact, int32); then the
  scales: ``y = s_x s_w (c_x - m_x)(c_w - m_w) + s_x b_w sum(c_x - m_x) + b_x
  s_w sum(c_w - m_w) + K b_x b_w``, and for groups a float32 sum over groups.

  This is the forward of the QAT product and of the served model, so the two
  agree bit for bit.
  """
  vdn, lshape = _group_views(dn, lhs_shape, wc.codes.shape, group)
  cx = xc.codes.reshape(lshape)
  (vlc, vrc), _ = vdn
  lay = dims.layout(vdn, cx.ndim, wc.codes.ndim)
  # On an explicit mesh the product is told its output sharding (not for the
  # group view, whose reshaped operands JAX reshards itself).
  out_sharding = None if group else lowering.dot_out_sharding(cx, wc.codes, dn)
  # On a mesh the codes are gathered or sliced as codes (1 byte), before the
  # 'bf16' lowering upcasts them.
  acc = mesh.multiply_codes(
      cx, wc.codes, mesh.dot_roles(vdn, cx.ndim, wc.codes.ndim),
      lambda a, b, _pa, _pb, sharding: _code_product(
          a, b, how, lambda a, b, pref: lowering.lax_dot_general(
              a, b, vdn, preferred_element_type=pref, out_sharding=sharding)),
      out_sharding=out_sharding)
  k = math.prod(cx.shape[a] for a in vlc)
  # Per-row/column terms are laid out like the product (on an explicit mesh
  # also sharded like it: a weight's channel axis may be sharded where the
  # product's is not).
  to_out = lambda t, pairs: lowering.reshard_like(relayout(t, pairs, acc.ndim), acc)
  # Row sums of the codes, needed when the other operand has a zero point or offset.
  need_sx = wc.centre is not None or wc.offset is not None
  need_sw = xc.centre is not None or xc.offset is not None
  sx = to_out(jnp.sum(cx.astype(jnp.int32), axis=vlc, keepdims=True), lay.lhs_to_out) \
      if need_sx else None
  sw = None
  if need_sw:  # a served weight's sum was folded at conversion
    sw = to_out(wc.code_sum if wc.code_sum is not None else
                jnp.sum(wc.codes.astype(jnp.int32), axis=vrc, keepdims=True), lay.rhs_to_out)
  mx = None if xc.centre is None else jnp.reshape(xc.centre, ()).astype(jnp.int32)
  mw = None if wc.centre is None else to_out(rank_like(wc.centre, wc.codes), lay.rhs_to_out
                                             ).astype(jnp.int32)
  # (c_x - m_x) . (c_w - m_w), exactly, in int32.
  if mw is not None or mx is not None:
    acc = acc.astype(jnp.int32)
  if mw is not None:
    acc = acc - mw * sx
  if mx is not None:
    acc = acc - mx * sw + (k * mx * mw if mw is not None else 0)
  s_w = to_out(rank_like(wc.scale, wc.codes), lay.rhs_to_out)
  s_x = jnp.reshape(xc.scale, ())
  y = acc.astype(jnp.float32) * (s_x * s_w)
  if wc.offset is not None:  # s_x b_w sum(c_x - m_x)
    sum_a = sx if mx is None else sx - k * mx
    y = y + (s_x * to_out(rank_like(wc.offset, wc.codes), lay.rhs_to_out)) * sum_a.astype(
        jnp.float32)
  if xc.offset is not None:  # b_x (s_w sum(c_w - m_w) + K b_w)
    sum_b = sw if mw is None else sw - k * mw
    b_x = jnp.reshape(xc.offset, ())
    term = s_w * sum_b.astype(jnp.float32)
    if wc.offset is not None:
      term = term + k * to_out(rank_like(wc.offset, wc.codes), lay.rhs_to_out)
    y = y + b_x * term
  if group:
    y = jnp.sum(y, axis=len(dn[1][0]))
  return y


def kernel_code_sum(codes, contract, group: bool):
  """A weight's codes summed over its contracting axes: int32, those axes kept with size 1.

  ``codes`` in the weight's view (:func:`~fp8_linen.core.int_numerics.int_view`),
  ``contract`` its contracting axes in the product; for a ``'group'`` weight
  the sum runs within each group (:func:`int_gemm`'s view). An activation
  with a zero point or an offset needs this sum of the weight in every
  product; a served weight stores it.
  """
  axes = (contract[0] + 1,) if group else tuple(contract)
  return jnp.sum(codes.astype(jnp.int32), axis=axes, keepdims=True)



def conv_fn(conv, out_sharding=None):
  strides, padding, lhs_dil, rhs_dil, cdn, groups = conv
  return lambda a, b, pref: lowering.lax_conv_general_dilated(
      a, b, strides, padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
      dimension_numbers=cdn, feature_group_count=groups, preferred_element_type=pref,
      out_sharding=out_sharding)


def int_conv(xc: Codes, wc: Codes, conv, *, how: str):
  """``conv(x_hat, w_hat)`` in float32 from the codes (no zero points or offsets).

  ``conv`` is ``(strides, padding, lhs_dilation, rhs_dilation,
  ConvDimensionNumbers, feature_group_count)``. A padded input element must
  be a zero of ``x_hat``, which is code 0 only without a zero point or offset;
  :func:`conv_supported` says which recipes qualify.
  """
  if xc.centre is not None or xc.offset is not None or wc.centre is not None \
      or wc.offset is not None:
    raise ValueError("int_conv: convolutions of integer codes need symmetric grids "
                     "without zero points or offsets")
  out_sharding = lowering.conv_out_sharding(xc.codes, wc.codes, conv[4])
  local = lambda a, b, _pa, _pb, sharding: _code_product(a, b, how, conv_fn(conv, sharding))
  if conv[5] != 1:  # grouped: the input and kernel features differ in size
    acc = local(xc.codes, wc.codes, (), (), out_sharding)
  else:
    acc = mesh.multiply_codes(xc.codes, wc.codes, mesh.conv_roles(conv[4], xc.codes.ndim),
                              local, out_sharding=out_sharding)
  cdn = conv[4]
  shape = [1] * acc.ndim
  s_w = jnp.reshape(wc.scale, (-1,))
  shape[cdn.out_spec[1]] = s_w.shape[0]
  return acc.astype(jnp.float32) * (jnp.reshape(xc.scale, ()) * s_w.reshape(shape))


def conv_static(ndim: int, conv_kwargs: dict, cdn):
  """``lax.conv_general_dilated`` keyword arguments as the static tuple :func:`int_conv` takes.

  ``cdn`` is the resolved ``ConvDimensionNumbers``; string paddings are kept.
  """
  pad = conv_kwargs["padding"]
  pad = pad if isinstance(pad, str) else tuple(tuple(int(v) for v in p) for p in pad)
  ones = (1,) * (ndim - 2)
  as_ints = lambda v: ones if v is None else ((v,) * len(ones) if isinstance(v, int)
                                              else tuple(v))
  return (as_ints(conv_kwargs["window_strides"]), pad, as_ints(conv_kwargs.get("lhs_dilation")),
          as_ints(conv_kwargs.get("rhs_dilation")), cdn,
          int(conv_kwargs.get("feature_group_count", 1)))


def conv_supported(recipe: IntRecipe) -> bool:
  """Whether a convolution under ``recipe`` runs on integer codes (:func:`int_conv`)."""
  return all(cfg is not None and cfg.symmetric and cfg.estimator != "lsq+"
             for cfg in (recipe.input, recipe.kernel))


def dot_supported(recipe: IntRecipe) -> bool:
  """Whether a ``dot_general`` under ``recipe`` runs on integer codes (both roles quantized)."""
  return recipe.input is not None and recipe.kernel is not None
