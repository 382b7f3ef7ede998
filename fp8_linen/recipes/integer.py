"""Frozen configuration for integer fake quantization (STE, LSQ, LSQ+).

Example:
  >>> import fp8_linen as fl
  >>> fl.int8_lsq().kernel.granularity
  'channel'
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from fp8_linen.recipes._validate import check_bool, check_choice, check_int

__all__ = ["IntQuantConfig", "IntRecipe", "int8_lsq", "int4_lsq_plus", "weight_only"]

_INT_GRANULARITIES = ("tensor", "channel", "group")
_ESTIMATORS = ("ste", "lsq", "lsq+")
_OBSERVERS = ("minmax", "moving_average")
# IntRecipe.compute_dtype; core/int_product.py resolves 'auto'.
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntQuantConfig:
  """How one tensor role is fake-quantized to a ``bits``-bit integer grid.

  Fake quantization: ``x_hat = s * (clamp(round(x / s) + z, qmin,
  qmax) - z)``. Symmetric grids have ``z = 0`` and the signed range
  ``[-2**(b-1), 2**(b-1) - 1]`` (``narrow_range``: ``±(2**(b-1) - 1)``);
  asymmetric grids use ``[0, 2**b - 1]`` and a zero point (or, for LSQ+, a
  learned float offset ``beta``: ``x_hat = s * clamp(round((x - beta) / s)) +
  beta``).

  Attributes:
    bits: integer width, 2..8.
    symmetric: signed grid without zero point (``True``) or unsigned grid with
      a zero point / offset (``False``).
    narrow_range: drop the most negative level of a symmetric grid.
    power_of_two: round scales up to powers of two (bit-shift friendly). Only
      for ``estimator='ste'`` (a learned step is a free float).
    granularity: ``'tensor'`` (one scale), ``'channel'`` (one per output
      channel: the weight's non-contracting axes) or ``'group'`` (one per
      ``group_size`` elements of the contracting axis and per output channel).
      Activations (the ``input`` role) support ``'tensor'`` only.
    group_size: elements per group for ``granularity='group'``.
    estimator: ``'ste'`` (straight-through; ranges from the data or an
      observer), ``'lsq'`` (learned step size, Esser et al. 2020; symmetric) or
      ``'lsq+'`` (learned step and offset, Bhalgat et al. 2020; asymmetric).
      Learned values are ``params`` of the layer.
    observer: for activations under ``'ste'``: ``'minmax'`` (running min/max
      over all steps) or ``'moving_average'`` (EMA of each batch's min/max).
      Weights under ``'ste'`` always use their current min/max.
    momentum: EMA factor of the ``'moving_average'`` observer, in ``[0, 1)``.

  Example:
    >>> import fp8_linen as fl
    >>> cfg = fl.IntQuantConfig(bits=4, narrow_range=True)
    >>> cfg.qmin, cfg.qmax
    (-7, 7)
  """

  bits: int = 8
  symmetric: bool = True
  narrow_range: bool = False
  power_of_two: bool = False
  granularity: Literal["tensor", "channel", "group"] = "tensor"
  group_size: int | None = None
  estimator: Literal["ste", "lsq", "lsq+"] = "ste"
  observer: Literal["minmax", "moving_average"] = "minmax"
  momentum: float = 0.9

  def __post_init__(self):
    o = "IntQuantConfig"
    check_int(o, "bits", self.bits, 2, 8)
    for f in ("symmetric", "narrow_range", "power_of_two"):
      check_bool(o, f, getattr(self, f))
    check_choice(o, "granularity", self.granularity, _INT_GRANULARITIES)
    check_choice(o, "estimator", self.estimator, _ESTIMATORS)
    check_choice(o, "observer", self.observer, _OBSERVERS)
    if self.granularity == "group":
      if self.group_size is None:
        raise ValueError(f"{o}.group_size is required when granularity='group'")
      check_int(o, "group_size", self.group_size, 1)
    elif self.group_size is not None:
      raise ValueError(f"{o}.group_size={self.group_size!r} is only allowed with "
                       "granularity='group'; allowed values: [None]")
    if (isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float))
        or not 0.0 <= self.momentum < 1.0):
      raise ValueError(f"{o}.momentum={self.momentum!r} must be a float in [0, 1)")
    if self.narrow_range and not self.symmetric:
      raise ValueError(f"{o}.narrow_range=True needs symmetric=True (an asymmetric grid "
                       "is [0, 2**bits - 1])")
    if self.estimator == "lsq" and not self.symmetric:
      raise ValueError(f"{o}.estimator='lsq' learns a step on a symmetric grid; with "
                       "symmetric=False use estimator='lsq+' (learned offset); allowed "
                       "values for symmetric: [True]")
    if self.estimator == "lsq+" and self.symmetric:
      raise ValueError(f"{o}.estimator='lsq+' learns an offset (an asymmetric grid); "
                       "allowed values for symmetric: [False]")
    if self.power_of_two and self.estimator != "ste":
      raise ValueError(f"{o}.power_of_two=True is only supported with estimator='ste' "
                       f"(got estimator={self.estimator!r}); allowed values: [False]")

  @property
  def qmin(self) -> int:
    """Lowest integer level of the grid."""
    if not self.symmetric:
      return 0
    return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

  @property
  def qmax(self) -> int:
    """Highest integer level of the grid."""
    return 2 ** self.bits - 1 if not self.symmetric else 2 ** (self.bits - 1) - 1

  @property
  def learned(self) -> bool:
    """Whether the step size (and offset) are learned ``params``."""
    return self.estimator in ("lsq", "lsq+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntRecipe:
  """An integer QAT recipe for one GEMM: an :class:`IntQuantConfig` per role.

  With both roles quantized, the forward product multiplies the operands'
  integer codes in one exact integer GEMM and applies the scales once; the
  backward pass keeps the int8 codes (STE) or the operands (LSQ/LSQ+) and runs
  the gradient GEMMs in float (``compute_dtype``); gradients are not
  quantized. ``None`` leaves a role in float (the other is then fake-quantized
  and the product runs in float). Convolutions run on codes for symmetric
  grids without learned offsets; LSQ+ and zero-point grids fake-quantize there.

  Attributes:
    input: the activation (left operand); per-tensor only.
    kernel: the weight (right operand).
    compute_dtype: dtype of the operands of the gradient GEMMs (and of the
      float product when a role is ``None`` or a convolution fake-quantizes);
      they accumulate in float32 either way. ``'auto'`` (default) follows the
      activation (the left operand, after the layer's dtype promotion):
      ``'bfloat16'`` for bfloat16 activations, ``'float32'`` for all others.
      A bf16 model's backward then reads bf16 operands, half the bytes of
      float32, and a TPU's MXU takes bf16 natively where float32 costs several
      passes; a float32 model keeps float32. float16 activations get float32:
      bfloat16 would round their 11-bit mantissas to 8 bits, and float32 holds
      them exactly. ``'float32'`` or ``'bfloat16'`` pins the dtype for every
      activation.
    gemm: the forward product: ``'int8'`` (int8 x int8 -> int32), ``'bf16'``
      (codes upcast exactly to bfloat16, float32 accumulation; only where that
      is exact, i.e. every partial sum stays below 2**24) or ``'auto'``
      (``'int8'`` on GPU/TPU; on CPU ``'bf16'`` where exact, else ``'int8'``).
      All give the same result.
    grad_bits: ``None`` (float gradient GEMMs) or 2..8: both gradient GEMMs
      run on integer codes, the output gradient quantized to ``grad_bits``
      symmetric integers per row (dgrad, after folding in the weight's
      channel scales) and per column (wgrad), round to nearest. Needs
      symmetric grids without learned offsets and weights per tensor or
      channel; dot products only (convolutions refuse it).
    grad_stochastic_rounding: with ``grad_bits``: round the gradient's codes
      stochastically (``floor(t / s + u)``, ``u`` uniform), so each code is
      the gradient in expectation instead of its nearest grid point. The
      random bits are seeded by the operands' scales (the same on every
      device, new every optimizer step); micro-batches of one accumulated
      step share them.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.core.int_gemm import resolve_compute_dtype
    >>> fl.IntRecipe(kernel=fl.IntQuantConfig(bits=4)).kernel.qmax
    7
    >>> r = fl.IntRecipe()  # compute_dtype='auto'
    >>> [resolve_compute_dtype(r.compute_dtype, a).name for a in (jnp.bfloat16, jnp.float32)]
    ['bfloat16', 'float32']
    >>> resolve_compute_dtype(fl.IntRecipe(compute_dtype='float32').compute_dtype,
    ...                       jnp.bfloat16).name
    'float32'
  """

  input: IntQuantConfig | None = dataclasses.field(default_factory=IntQuantConfig)
  kernel: IntQuantConfig | None = dataclasses.field(default_factory=IntQuantConfig)
  compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
  gemm: Literal["auto", "int8", "bf16"] = "auto"
  grad_bits: int | None = None
  grad_stochastic_rounding: bool = False

  def __post_init__(self):
    for role in ("input", "kernel"):
      cfg = getattr(self, role)
      if cfg is not None and not isinstance(cfg, IntQuantConfig):
        raise ValueError(
            f"IntRecipe.{role} must be an IntQuantConfig or None, got {type(cfg).__name__}")
    if self.input is not None and self.input.granularity != "tensor":
      raise ValueError(
          f"IntRecipe.input.granularity={self.input.granularity!r} is not supported: "
          "activation scales are per tensor; allowed values: ['tensor']")
    check_choice("IntRecipe", "compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
    check_choice("IntRecipe", "gemm", self.gemm, ("auto", "int8", "bf16"))
    check_bool("IntRecipe", "grad_stochastic_rounding", self.grad_stochastic_rounding)
    if self.grad_stochastic_rounding and self.grad_bits is None:
      raise ValueError("IntRecipe.grad_stochastic_rounding=True rounds the integer gradient "
                       "codes and needs grad_bits (2..8); allowed values with "
                       "grad_bits=None: [False]")
    if self.grad_bits is not None:
      check_int("IntRecipe", "grad_bits", self.grad_bits, 2, 8)
      for role in ("input", "kernel"):
        cfg = getattr(self, role)
        if cfg is None or not cfg.symmetric or cfg.granularity == "group":
          raise ValueError(
              f"IntRecipe.grad_bits={self.grad_bits} needs {role} quantized on a symmetric "
              f"grid per tensor or channel (got {role}={cfg!r}); allowed values for "
              "grad_bits with it: [None]")


def int8_lsq(*, granularity: str = "channel") -> IntRecipe:
  """8-bit LSQ for activations (per tensor) and weights (per channel by default).

  Example:
    >>> import fp8_linen as fl
    >>> fl.int8_lsq().kernel.estimator
    'lsq'
  """
  return IntRecipe(input=IntQuantConfig(bits=8, estimator="lsq"),
                   kernel=IntQuantConfig(bits=8, estimator="lsq", granularity=granularity))


def int4_lsq_plus(*, granularity: str = "channel") -> IntRecipe:
  """4-bit LSQ+ (learned step and offset) for activations and weights.

  Example:
    >>> import fp8_linen as fl
    >>> fl.int4_lsq_plus().input.qmax
    15
  """
  return IntRecipe(input=IntQuantConfig(bits=4, symmetric=False, estimator="lsq+"),
                   kernel=IntQuantConfig(bits=4, symmetric=False, estimator="lsq+",
                                         granularity=granularity))


def weight_only(bits: int = 8, *, granularity: str = "channel",
                group_size: int | None = None) -> IntRecipe:
  """Weight-only integer quantization: ``bits``-bit weights, float activations.

  The weight is stored as int8 / int4 codes with its scales (a served model
  a quarter or an eighth of float32's weight bytes) and dequantized for a
  float GEMM; the activation is not quantized (``input=None``). Its scale is
  a learned LSQ step (``kernel_step``), which post-training quantization
  (:func:`fp8_linen.ptq`) sets from the weight's range or from GPTQ and
  which QAT can go on training.

  Args:
    bits: 2..8 (4 is stored as ``jnp.int4``).
    granularity: ``'tensor'``, ``'channel'`` (one scale per output channel)
      or ``'group'`` (one per ``group_size`` inputs and output channel).
    group_size: for ``granularity='group'``.

  Example:
    >>> import fp8_linen as fl
    >>> r = fl.weight_only(4, granularity='group', group_size=32)
    >>> r.input is None, r.kernel.bits, r.kernel.group_size
    (True, 4, 32)
  """
  return IntRecipe(input=None,
                   kernel=IntQuantConfig(bits=bits, estimator="lsq", granularity=granularity,
                                         group_size=group_size))
