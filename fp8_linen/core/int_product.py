"""The integer product: int8 codes in, one exact integer GEMM, the scales once.

An integer QAT product ``dot_general(x_hat, w_hat)`` (or a convolution) of two
fake-quantized operands is computed here from their integer *codes*:

* each operand is quantized once to an int8 array of codes ``c`` with float32
  parameters so that its fake-quantized value is exactly ``x_hat = scale * (c -
  centre) + offset`` (``centre``: the zero point minus the storage shift; 8-bit
  unsigned grids ``[0, 255]`` are stored shifted by 128 so they fit ``int8``;
  ``offset``: LSQ+'s learned ``beta``);
* the codes are multiplied in one integer GEMM, ``lax.dot_general(int8, int8,
  preferred_element_type=int32)``, exact; zero points, offsets and groups are
  corrected with row sums of the codes, and the scales are applied once to the
  int32 result (:func:`int_gemm`);
* the backward pass reads the codes (STE) or the operand itself (LSQ/LSQ+,
  whose step gradient needs each element's rounding error ``round(v) - v``,
  which a code does not hold), never a float fake-quantized copy, and gives
  the same gradients as the fake-quant ops of :mod:`fp8_linen.core.int_ops`
  (LSQ/LSQ+ through the very same :func:`~fp8_linen.core.int_ops.lsq_backward`).

Lowering of the forward product (``IntRecipe.gemm``):

* ``'int8'``: int8 x int8 -> int32, the form integer units (GPU IMMA, CPU VNNI)
  run;
* ``'bf16'``: the codes are upcast exactly to bfloat16 and accumulated in
  float32. Every partial sum is an integer of magnitude at most ``K * max|c_x|
  * max|c_w|``; while that is ``<= 2**24`` float32 holds it exactly, so the
  result is bit-identical to ``'int8'``. Allowed only when the bound holds.
* ``'auto'``: ``'int8'`` on GPU/TPU; on CPU ``'bf16'`` where it is exact (XLA:CPU
  runs bf16 GEMMs faster than int8 ones) and ``'int8'`` otherwise.

STE masks: a weight quantized with its own min/max and an activation under a
``'minmax'`` observer (whose range includes the batch) have no element outside
the range, so their straight-through gradient passes everywhere and only the
codes are saved. A ``'moving_average'`` observer can clip, so its mask is kept
as packed bits (1/8 byte per element).

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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8_linen.core import dims, int_numerics, int_ops, lowering, mesh, owg
from fp8_linen.core.lowering import grad_gemm, relayout
from fp8_linen.core.numerics import SCALE_FLOOR
from fp8_linen.recipes.integer import COMPUTE_DTYPES, IntQuantConfig, IntRecipe

__all__ = ["Operand", "Codes", "quantize", "dequantize", "resolve_int_gemm",
           "resolve_compute_dtype", "int_gemm", "int_conv", "encode", "contracted",
           "kernel_code_sum", "conv_static", "operand_params", "run_product", "conv_supported",
           "dot_supported", "int_dot_general", "int_conv_general_dilated", "code_bound",
           "INT_GEMMS"]

INT_GEMMS = ("auto", "int8", "bf16")
_EXACT = 2 ** 24  # float32 holds every integer up to this magnitude


class Codes(NamedTuple):
  """An operand quantized to int8 codes: ``x_hat = scale * (codes - centre) + offset``.

  ``codes`` has the operand's *view* shape (a ``'group'`` contracting axis split
  in two, see :func:`~fp8_linen.core.int_numerics.int_view`); ``scale``,
  ``centre`` and ``offset`` are float32 and broadcast against it (size 1 along
  the axes one value covers). ``centre`` and ``offset`` are ``None`` where they
  are zero for every value of the recipe (symmetric grids, no learned offset).
  ``code_sum``: a weight's codes summed over the product's contracting axes
  (:func:`kernel_code_sum`), where known in advance (a served weight's, folded
  at conversion); ``None``: :func:`int_gemm` sums them when it needs them.
  """

  codes: Any
  scale: Any
  centre: Any = None
  offset: Any = None
  code_sum: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operand:
  """How one operand of an integer product is quantized (static, hashable).

  Attributes:
    cfg: its :class:`~fp8_linen.IntQuantConfig`.
    role: ``'input'`` (activation: observer or learned step) or ``'kernel'``
      (weight: own min/max or learned step).
    contract: its contracting axes in the product.
    grad_scale: LSQ's gradient scale ``1 / sqrt(N * Q_P)`` (learned only).
  """

  cfg: IntQuantConfig
  role: str
  contract: tuple
  grad_scale: float = 1.0

  @property
  def kind(self) -> str:
    """``'observer'``, ``'minmax'``, ``'lsq'`` or ``'lsq+'``."""
    if self.cfg.learned:
      return self.cfg.estimator
    return "observer" if self.role == "input" else "minmax"

  @property
  def shift(self) -> int:
    """What is subtracted from a grid level to store it as ``int8``."""
    return 128 if self.cfg.qmax > 127 else 0

  @property
  def max_code(self) -> int:
    """The largest ``|code|`` of the grid as stored."""
    return max(abs(self.cfg.qmin - self.shift), abs(self.cfg.qmax - self.shift))

  @property
  def has_centre(self) -> bool:
    return self.shift != 0 or not self.cfg.symmetric

  @property
  def has_offset(self) -> bool:
    return self.cfg.estimator == "lsq+"

  @property
  def keeps_mask(self) -> bool:
    """Whether the STE mask can differ from all-ones (a clipping observer)."""
    return self.kind == "observer" and self.cfg.observer == "moving_average"


def _params_of(op: Operand, x, view, axes, params, frozen: bool):
  """``(scale, zero_point, offset, new_range)`` of ``op`` for this operand."""
  cfg = op.cfg
  if op.kind == "observer":
    new, s, z = int_ops.observer_qparams(cfg, x, params[0], frozen)
    return s, z, None, new
  if op.kind == "minmax":
    s, z = int_ops.minmax_qparams(view, axes, cfg)
    return s, z, None, None
  s = jnp.maximum(params[0], SCALE_FLOOR)
  return s, None, (params[1] if op.kind == "lsq+" else None), None


def quantize(op: Operand, x, params, frozen: bool = False):
  """Quantizes ``x`` to :class:`Codes` as ``op`` says.

  Args:
    op: the :class:`Operand`.
    x: the operand (floating).
    params: its parameters: ``(observer_range,)`` for an observer, ``()`` for a
      min/max weight, ``(step,)`` for LSQ, ``(step, offset)`` for LSQ+ (steps
      and offsets broadcastable to the view).
    frozen: an observer quantizes with its range as recorded (see
      :func:`~fp8_linen.core.owg.frozen_quantizers`).

  Returns:
    ``(codes, new_range, inside)``: ``new_range`` is the observer's updated
    range (``None`` otherwise); ``inside`` is the STE mask in the view's shape
    where it can differ from all-ones (:attr:`Operand.keeps_mask`), else ``None``.
  """
  view, axes = int_numerics.int_view(x, op.contract, op.cfg)
  s, z, b, new = _params_of(op, x, view, axes, params, frozen)
  # A frozen 'minmax' range no longer includes the batch, so it can clip too.
  c, inside = encode(op, view, s, z, b,
                     keep_mask=op.keeps_mask or (frozen and op.kind == "observer"))
  return c, new, inside


def encode(op: Operand, view, scale, zero_point=None, offset=None, keep_mask=None):
  """``view`` as :class:`Codes` with given parameters; also the STE mask (or ``None``).

  The mask is computed where ``keep_mask`` (default :attr:`Operand.keeps_mask`)
  says the STE can clip.

  STE (``zero_point`` given): ``clamp(round(x / s) + z)``, the expression of
  :func:`~fp8_linen.core.int_numerics.int_fake_quant`; LSQ/LSQ+:
  ``clamp(round((x - offset) / s))``, that of
  :func:`~fp8_linen.core.int_ops.lsq_fake_quant`. The codes are stored shifted
  into ``int8`` (:attr:`Operand.shift`).
  """
  cfg = op.cfg
  x32 = view.astype(jnp.float32)
  inside = None
  keep_mask = op.keeps_mask if keep_mask is None else keep_mask
  if zero_point is not None:
    q = jnp.clip(jnp.round(x32 / scale) + zero_point, cfg.qmin, cfg.qmax)
    if keep_mask:
      v = x32 / scale + zero_point
      inside = (v >= cfg.qmin) & (v <= cfg.qmax)
  else:
    q = jnp.clip(jnp.round(((x32 - offset) if offset is not None else x32) / scale),
                 cfg.qmin, cfg.qmax)
  centre = None
  if op.has_centre:
    centre = (zero_point if zero_point is not None else jnp.zeros_like(scale)) - op.shift
  return Codes((q - op.shift).astype(jnp.int8), scale, centre, offset), inside


def dequantize(c: Codes, dtype=jnp.float32):
  """``scale * (codes - centre) + offset``: bit for bit the fake-quantized value."""
  q = c.codes.astype(jnp.float32)
  if c.centre is not None:
    q = q - c.centre
  y = c.scale * q
  if c.offset is not None:
    y = y + c.offset
  return y.astype(dtype)


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


# ----------------------------------------------------------------------------
# The forward product (shared with serving)


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
  acc = mesh.product(
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
  mw = None if wc.centre is None else to_out(_full(wc.centre, wc.codes), lay.rhs_to_out
                                             ).astype(jnp.int32)
  # (c_x - m_x) . (c_w - m_w), exactly, in int32.
  if mw is not None or mx is not None:
    acc = acc.astype(jnp.int32)
  if mw is not None:
    acc = acc - mw * sx
  if mx is not None:
    acc = acc - mx * sw + (k * mx * mw if mw is not None else 0)
  s_w = to_out(_full(wc.scale, wc.codes), lay.rhs_to_out)
  s_x = jnp.reshape(xc.scale, ())
  y = acc.astype(jnp.float32) * (s_x * s_w)
  if wc.offset is not None:  # s_x b_w sum(c_x - m_x)
    sum_a = sx if mx is None else sx - k * mx
    y = y + (s_x * to_out(_full(wc.offset, wc.codes), lay.rhs_to_out)) * sum_a.astype(
        jnp.float32)
  if xc.offset is not None:  # b_x (s_w sum(c_w - m_w) + K b_w)
    sum_b = sw if mw is None else sw - k * mw
    b_x = jnp.reshape(xc.offset, ())
    term = s_w * sum_b.astype(jnp.float32)
    if wc.offset is not None:
      term = term + k * to_out(_full(wc.offset, wc.codes), lay.rhs_to_out)
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


def _full(t, like):
  """``t`` with ``like``'s rank (leading size-1 axes), for relayout."""
  t = jnp.asarray(t, jnp.float32)
  return t.reshape((1,) * (like.ndim - t.ndim) + t.shape)


def _conv_fn(conv, out_sharding=None):
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
  local = lambda a, b, _pa, _pb, sharding: _code_product(a, b, how, _conv_fn(conv, sharding))
  if conv[5] != 1:  # grouped: the input and kernel features differ in size
    acc = local(xc.codes, wc.codes, (), (), out_sharding)
  else:
    acc = mesh.product(xc.codes, wc.codes, mesh.conv_roles(conv[4], xc.codes.ndim), local,
                       out_sharding=out_sharding)
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


# ----------------------------------------------------------------------------
# The custom_vjp


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
  frozen: bool = False  # owg.frozen_quantizers() when the product was called


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
    rt = jnp.float32 if self.w.cfg.learned else self.rhs_dtype
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
    rt = jnp.float32 if self.w.cfg.learned else self.rhs_dtype
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
    g1 = g32 * relayout(_full(wc.scale, wc.codes), lay.rhs_to_out, g32.ndim)
    q1, s1 = _int_rows(g1, lay.rhs_free_out, qmax)
    d_x = grad_gemm(q1, wc.codes, self.dn, *nd, "lhs", "fp8", jnp.int32, one)
    d_x = d_x.astype(jnp.float32) * relayout(s1, dims.flip(lay.lhs_to_out), d_x.ndim)
    q2, s2 = _int_rows(g32, lay.lhs_free_out, qmax)
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
  y = mesh.product(a, b, mesh.dot_roles(gdn, a.ndim, b.ndim), local, lhs_params=pa,
                   rhs_params=pb, out_sharding=lowering.like_sharding(like, perm))
  return jnp.transpose(y.astype(out_dtype), perm)


def _int_rows(t, axes, qmax: int):
  """``t`` quantized to int8 with one scale per slice along ``axes`` (kept size 1)."""
  s = jnp.max(jnp.abs(t), axis=tuple(axes), keepdims=True) / qmax if axes else \
      jnp.abs(t) / qmax
  s = jnp.where(s > 0, s, jnp.ones_like(s))
  return jnp.clip(jnp.round(t / s), -qmax, qmax).astype(jnp.int8), s


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ConvSpec(_Spec):
  conv: Any

  def forward(self, xc, wc, lhs_shape):
    del lhs_shape
    return int_conv(xc, wc, self.conv, how=self.how)

  def grads(self, g, xh, wh):
    fn = _conv_fn(self.conv, lowering.conv_out_sharding(xh, wh, self.conv[4]))
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
      at = mesh.point(tuple(shape), self.grad_dtype, sharding)
      fn = _conv_fn(self.conv, lowering.conv_out_sharding(at, wh, cdn))
      return jax.vjp(lambda a: fn(a, wh, pref), at)[1](gl)[0]

    def wgrad(xl, gl, pxs, _pg, sharding):
      xh = _dequantized(xl, pxs, has_x, self.grad_dtype)
      shape = list(self.rhs_shape)
      shape[w_o], shape[w_i] = gl.shape[y_o], xl.shape[x_c]
      at = mesh.point(tuple(shape), self.grad_dtype, sharding)
      fn = _conv_fn(self.conv, lowering.conv_out_sharding(xh, at, cdn))
      return jax.vjp(lambda b: fn(xh, b, pref), at)[1](gl)[0]

    d_x = mesh.product(ct, wc.codes, mesh.conv_roles(cdn, nd, "dgrad"), dgrad, rhs_params=pw,
                       out_sharding=lowering.like_sharding(xc.codes, ident))
    d_w = mesh.product(xc.codes, ct, mesh.conv_roles(cdn, nd, "wgrad"), wgrad, lhs_params=px,
                       out_sharding=lowering.like_sharding(wc.codes, ident))
    return d_x, d_w


def _code_params(c: Codes):
  """``(params, (has_centre, has_offset))``: ``c``'s parameters with the codes' rank."""
  params = tuple(_full(p, c.codes) for p in (c.scale, c.centre, c.offset) if p is not None)
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
    d_params = tuple(owg.match_varying(d, p, lax.psum) for d, p in zip(d_params, params))
    return owg.match_varying(dx, like, lax.psum), d_params
  if inside is not None:
    g_hat = jnp.where(inside.reshape(g_hat.shape), g_hat, jnp.zeros((), g_hat.dtype))
  return owg.match_varying(g_hat.astype(dtype), like, lax.psum), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _int_product(spec, lhs, rhs, lparams, rparams, chain):
  xc, _, _ = quantize(spec.x, lhs, lparams, spec.frozen)
  wc, _, _ = quantize(spec.w, rhs, rparams)
  return spec.forward(xc, wc, lhs.shape).astype(spec.out_dtype), chain


def _int_product_fwd(spec, lhs, rhs, lparams, rparams, chain):
  xc, new, x_in = quantize(spec.x, lhs, lparams, spec.frozen)
  wc, _, w_in = quantize(spec.w, rhs, rparams)
  y = spec.forward(xc, wc, lhs.shape).astype(spec.out_dtype)
  res = (_residual(spec.x, lhs, xc, x_in), _residual(spec.w, rhs, wc, w_in),
         lparams, rparams, new)
  return (y, chain), res


def _int_product_bwd(spec, res, cts):
  res_x, res_w, lparams, rparams, new = res
  g, ct_chain = cts
  # The dequantized operands feed the gradient GEMMs only: build them in the
  # GEMMs' dtype, so no float32 copy of an operand is materialized for bf16.
  xc, xh, x, x_in = _restore(spec.x, spec.lhs_shape, res_x, lparams, spec.grad_dtype)
  wc, wh, w, w_in = _restore(spec.w, spec.rhs_shape, res_w, rparams, spec.grad_dtype)
  if spec.grad_bits:
    g_xh, g_wh = spec.int_grads(g, xc, wc)
  else:
    # The products read the codes (dequantized where they are multiplied);
    # group views and grouped convolutions the dequantized operands.
    grads = spec.code_grads(g, xc, wc)
    g_xh, g_wh = grads if grads is not None else spec.grads(g, xh, wh)
  dx, dlp = _role_grads(spec.x, g_xh, x, x_in, lparams, xh, spec.lhs_dtype)
  dw, drp = _role_grads(spec.w, g_wh, w, w_in, rparams, wh, spec.rhs_dtype)
  chain_ct = jnp.zeros_like(ct_chain)
  if spec.x.kind == "observer":
    combined, chain_ct = owg.fold_chain(new, ct_chain, spec.first, like=lparams[0])
    d_range = jnp.zeros_like(new) if combined is None else combined
    dlp = (owg.match_varying(d_range, lparams[0], lax.pmax),)
    chain_ct = owg.match_varying(chain_ct, ct_chain, lax.pmax)
  dlp = dlp if dlp is not None else tuple(jnp.zeros_like(p) for p in lparams)
  drp = drp if drp is not None else tuple(jnp.zeros_like(p) for p in rparams)
  return dx, dw, dlp, drp, chain_ct


_int_product.defvjp(_int_product_fwd, _int_product_bwd)


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
         chain, owner, **static):
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  owg.check_float("lhs", lhs)
  owg.check_float("rhs", rhs)
  lp = _params(x_op, input_params, "input_params")
  rp = _params(w_op, kernel_params, "kernel_params")
  first = chain is None
  spec = spec_cls(x=x_op, w=w_op, how=resolve_int_gemm(recipe.gemm, k, x_op, w_op, owner),
                  grad_dtype=resolve_compute_dtype(recipe.compute_dtype, lhs.dtype),
                  out_dtype=jnp.dtype(out_dtype or jnp.result_type(lhs, rhs)),
                  lhs_dtype=jnp.dtype(lhs.dtype), rhs_dtype=jnp.dtype(rhs.dtype), first=first,
                  lhs_shape=tuple(lhs.shape), rhs_shape=tuple(rhs.shape),
                  grad_bits=recipe.grad_bits, frozen=owg.quantizers_frozen(), **static)
  return _int_product(spec, lhs, rhs, lp, rp, owg.chain_init(2) if first else chain)


def int_dot_general(lhs, rhs, dimension_numbers, *, recipe: IntRecipe, input_params=(),
                    kernel_params=(), input_grad_scale: float = 1.0,
                    kernel_grad_scale: float = 1.0, out_dtype=None, chain=None):
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
              chain, "int_dot_general", dn=dn)


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
