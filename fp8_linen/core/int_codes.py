"""Integer codes: an operand quantized once to int8 with the parameters that make it exact.

An integer QAT operand (the activation or the weight of a product) is
quantized to an int8 array of codes ``c`` with float32 parameters so that its
fake-quantized value is exactly ``x_hat = scale * (c - centre) + offset``
(:class:`Codes`): ``centre`` is the zero point minus the storage shift (8-bit
unsigned grids ``[0, 255]`` are stored shifted by 128 so they fit ``int8``),
``offset`` LSQ+'s learned ``beta``. :class:`Operand` says how one operand is
quantized (observer, own min/max, LSQ, LSQ+); :func:`quantize` and
:func:`encode` make the codes with the expressions of the fake-quant ops
(:mod:`~fp8_linen.core.int_numerics`, :mod:`~fp8_linen.core.int_ops`), and
:func:`dequantize` gives the fake-quantized value back bit for bit.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import int_codes
  >>> op = int_codes.Operand(cfg=fl.IntQuantConfig(), role="kernel", contract=(0,))
  >>> c, _, _ = int_codes.quantize(op, jnp.array([[1.0], [-127.0]]), ())
  >>> c.codes.ravel().tolist(), int_codes.dequantize(c).ravel().tolist()
  ([1, -127], [1.0, -127.0])
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp

from fp8_linen.core import int_kernels, int_numerics, int_ops
from fp8_linen.core.numerics import SCALE_FLOOR
from fp8_linen.recipes.integer import IntQuantConfig

__all__ = ["Codes", "Operand", "quantize", "encode", "dequantize", "rank_like"]


class Codes(NamedTuple):
  """An operand quantized to int8 codes: ``x_hat = scale * (codes - centre) + offset``.

  ``codes`` has the operand's *view* shape (a ``'group'`` contracting axis split
  in two, see :func:`~fp8_linen.core.int_numerics.int_view`); ``scale``,
  ``centre`` and ``offset`` are float32 and broadcast against it (size 1 along
  the axes one value covers). ``centre`` and ``offset`` are ``None`` where they
  are zero for every value of the recipe (symmetric grids, no learned offset).
  ``code_sum``: a weight's codes summed over the product's contracting axes
  (:func:`~fp8_linen.core.int_gemm.kernel_code_sum`), where known in advance
  (a served weight's, folded at conversion); ``None``:
  :func:`~fp8_linen.core.int_gemm.int_gemm` sums them when it needs them.
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


def quantize(op: Operand, x, params, frozen: bool = False, round_to=None):
  """Quantizes ``x`` to :class:`Codes` as ``op`` says.

  Args:
    op: the :class:`Operand`.
    x: the operand (floating).
    params: its parameters: ``(observer_range,)`` for an observer, ``()`` for a
      min/max weight, ``(step,)`` for LSQ, ``(step, offset)`` for LSQ+ (steps
      and offsets broadcastable to the view).
    frozen: an observer quantizes with its range as recorded (see
      :func:`~fp8_linen.core.owg.frozen_quantizers`).
    round_to: the dtype ``x`` (a weight's parameter, handed uncast) is
      quantized in, or None: the codes are those of ``x.astype(round_to)``.
      Where the TPU kernel serves the weight
      (:func:`~fp8_linen.core.int_kernels.channel_codes_mode`), it rounds
      as it reads, and the rounded copy is never written.

  Returns:
    ``(codes, new_range, inside)``: ``new_range`` is the observer's updated
    range (``None`` otherwise); ``inside`` is the STE mask in the view's shape
    where it can differ from all-ones (:attr:`Operand.keeps_mask`), else ``None``.
  """
  if round_to is not None:
    if op.kind == "minmax" and int_kernels.channel_codes_mode(x, op.contract, op.cfg, round_to):
      return Codes(*int_kernels.channel_codes(x, op.contract, op.cfg, round_to)), None, None
    x = x.astype(round_to)
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
    q = int_numerics.int_levels(x32, scale, zero_point, cfg.qmin, cfg.qmax)
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


def rank_like(t, like):
  """``t`` with ``like``'s rank (leading size-1 axes), for relayout."""
  t = jnp.asarray(t, jnp.float32)
  return t.reshape((1,) * (like.ndim - t.ndim) + t.shape)
