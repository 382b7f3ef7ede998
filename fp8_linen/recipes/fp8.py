"""Frozen, keyword-only configuration for *how* a tensor is quantized.

A recipe says, for every quantized role of a GEMM (``input``, ``kernel`` and
``output_grad``), which fp8 format it uses and how its scale is chosen. Recipes
are plain values: they are validated on construction, hashable (so they can be
static arguments of jitted functions) and never mutated.

Example:
  >>> import fp8_linen as fl
  >>> recipe = fl.Fp8Recipe(input=fl.ScalingConfig(dtype='float8_e4m3fn',
  ...                                               history_length=16))
  >>> recipe.input.history_length
  16
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import ml_dtypes
import numpy as np

from fp8_linen.recipes._validate import check_choice

__all__ = [
    "FP8_DTYPES",
    "ScalingConfig",
    "Fp8Recipe",
    "delayed_scaling",
    "current_scaling",
    "canonical_fp8_dtype",
    "GRANULARITIES",
    "rowwise_scaling",
    "mx_block_scaling",
    "ActivationRecipe",
]

# Name -> numpy dtype for every fp8 format the library knows.
FP8_DTYPES: dict[str, np.dtype] = {
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_E5M2 = {"float8_e5m2", "float8_e5m2fnuz"}
_FNUZ = {"float8_e4m3fnuz", "float8_e5m2fnuz"}
_SCALINGS = ("delayed", "current")
_ALGOS = ("max", "most_recent")
_GEMMS = ("auto", "fp8", "bf16", "f32")
GRANULARITIES = ("tensor", "row", "block")


def canonical_fp8_dtype(dtype) -> str:
  """Returns the canonical name of an fp8 dtype given as a name or a dtype.

  Args:
    dtype: a string such as ``'float8_e4m3fn'`` (``'e4m3'`` and ``'e5m2'`` are
      accepted as short names) or a dtype such as ``jnp.float8_e5m2``.

  Returns:
    One of the keys of :data:`FP8_DTYPES`.

  Raises:
    ValueError: if ``dtype`` is not an fp8 format, naming the allowed values.
  """
  short = {"e4m3": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2",
           "e4m3fnuz": "float8_e4m3fnuz", "e5m2fnuz": "float8_e5m2fnuz"}
  if isinstance(dtype, str):
    name = short.get(dtype, dtype)
  else:
    try:
      name = np.dtype(dtype).name
    except TypeError:
      name = repr(dtype)
  if name not in FP8_DTYPES:
    raise ValueError(
        f"dtype={dtype!r} is not an fp8 format; allowed: {sorted(FP8_DTYPES)}")
  return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingConfig:
  """How one tensor role is quantized to fp8.

  The scale ``s`` maps the tensor into the fp8 range: ``x_fp8 = saturate(x / s)``
  and ``x ~= x_fp8 * s``, with ``s = amax * 2**margin / fp8_max``.

  Attributes:
    dtype: fp8 format name (see :data:`FP8_DTYPES`); dtypes are accepted too.
    scaling: ``'delayed'`` (scale from the amax history of earlier steps) or
      ``'current'`` (scale from this step's amax).
    history_length: number of past amax values kept (index 0 is the newest).
    amax_compute_algo: ``'max'`` over the history or its ``'most_recent'``.
    margin: extra head-room, as a power of two (``s *= 2**margin``).
    power_of_two: round the scale up to a power of two (no rounding error is
      introduced by the scaling itself).
  """

  dtype: str = "float8_e4m3fn"
  scaling: Literal["delayed", "current"] = "delayed"
  history_length: int = 1024
  amax_compute_algo: Literal["max", "most_recent"] = "max"
  margin: int = 0
  power_of_two: bool = False

  def __post_init__(self):
    object.__setattr__(self, "dtype", canonical_fp8_dtype(self.dtype))
    check_choice("ScalingConfig", "scaling", self.scaling, _SCALINGS)
    check_choice("ScalingConfig", "amax_compute_algo", self.amax_compute_algo, _ALGOS)
    if (not isinstance(self.history_length, (int, np.integer))
        or isinstance(self.history_length, bool) or self.history_length < 1):
      raise ValueError(
          f"ScalingConfig.history_length={self.history_length!r} must be an int >= 1")
    if (not isinstance(self.margin, (int, np.integer)) or isinstance(self.margin, bool)
        or not -64 <= self.margin <= 64):
      raise ValueError(
          f"ScalingConfig.margin={self.margin!r} must be an int in [-64, 64]")
    if not isinstance(self.power_of_two, bool):
      raise ValueError(
          f"ScalingConfig.power_of_two={self.power_of_two!r} must be True or False")

  @property
  def jnp_dtype(self):
    """The fp8 dtype as a numpy/JAX dtype."""
    return FP8_DTYPES[self.dtype]

  @property
  def fp8_max(self) -> float:
    """Largest finite value of the format."""
    return float(ml_dtypes.finfo(self.jnp_dtype).max)


def _e4m3(**kw) -> ScalingConfig:
  return ScalingConfig(dtype="float8_e4m3fn", **kw)


def _e5m2(**kw) -> ScalingConfig:
  return ScalingConfig(dtype="float8_e5m2", **kw)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
  """An fp8 recipe for one GEMM: a :class:`ScalingConfig` per role.

  Attributes:
    input: the activation (left operand); e4m3 by default.
    kernel: the weight (right operand); e4m3 by default.
    output_grad: the gradient arriving at the GEMM output; e5m2 by default.
    gemm: how the fp8 product is lowered. ``'auto'`` feeds fp8 operands to the
      GEMM on GPU and upcasts them exactly to bfloat16 elsewhere (XLA:CPU has no
      fp8 units and its default f32 lowering is twice as slow); ``'fp8'``,
      ``'bf16'`` and ``'f32'`` force one lowering.
    granularity: how finely the operands are scaled.

      * ``'tensor'``: one scale per tensor and role (delayed or current).
      * ``'row'``: the activation gets one scale per row and the weight one per
        output channel (amax over the contracting axes). The GEMM itself runs
        on unscaled fp8 operands and the outer product of the two scale vectors
        multiplies its output, so it stays a plain fp8 GEMM. The gradient is
        scaled per row of each backward GEMM (see
        :func:`~fp8_linen.fp8_dot_general`).
      * ``'block'``: MX-style block scaling: blocks of ``block_size`` elements
        along the (last) contracting axis share a power-of-two (e8m0) scale.
        No XLA backend has a block-scaled GEMM, so it is emulated: the blocks
        are dequantized exactly to bfloat16 (or float32) and multiplied there.
        The output gradient is quantized per tensor.

      Row and block scales are computed from this step's values, so
      ``'row'`` and ``'block'`` need ``scaling='current'`` for the roles they
      scale finely (a per-row history cannot be kept across batches of
      different sizes). The OWG state is still declared and then only records a
      monitoring history of each role's global amax.
    block_size: elements per block for ``granularity='block'`` (32 in MX).

  Example:
    >>> import fp8_linen as fl
    >>> fl.Fp8Recipe().output_grad.dtype
    'float8_e5m2'
  """

  input: ScalingConfig = dataclasses.field(default_factory=_e4m3)
  kernel: ScalingConfig = dataclasses.field(default_factory=_e4m3)
  output_grad: ScalingConfig = dataclasses.field(default_factory=_e5m2)
  gemm: Literal["auto", "fp8", "bf16", "f32"] = "auto"
  granularity: Literal["tensor", "row", "block"] = "tensor"
  block_size: int = 32

  def __post_init__(self):
    check_choice("Fp8Recipe", "granularity", self.granularity, GRANULARITIES)
    if (not isinstance(self.block_size, (int, np.integer)) or isinstance(self.block_size, bool)
        or self.block_size < 1):
      raise ValueError(f"Fp8Recipe.block_size={self.block_size!r} must be an int >= 1")
    fine_roles = {"row": ("input", "kernel", "output_grad"),
                  "block": ("input", "kernel")}.get(self.granularity, ())
    for role in fine_roles:
      cfg = getattr(self, role)
      if isinstance(cfg, ScalingConfig) and cfg.scaling != "current":
        raise ValueError(
            f"Fp8Recipe.{role}.scaling={cfg.scaling!r} is not allowed with "
            f"granularity={self.granularity!r}: row/block scales come from this step's "
            "values; allowed values: ['current']")
    if self.granularity == "block" and self.gemm == "fp8":
      raise ValueError(
          "Fp8Recipe.gemm='fp8' is not allowed with granularity='block' (no backend has a "
          "block-scaled fp8 GEMM; it is emulated); allowed values: ['auto', 'bf16', 'f32']")
    for role in ("input", "kernel", "output_grad"):
      cfg = getattr(self, role)
      if not isinstance(cfg, ScalingConfig):
        raise ValueError(
            f"Fp8Recipe.{role} must be a ScalingConfig, got {type(cfg).__name__}")
    check_choice("Fp8Recipe", "gemm", self.gemm, _GEMMS)
    # Every GEMM of the step pairs two roles; e5m2 x e5m2 has no fp8 GEMM.
    pairs = (("input", "kernel"), ("output_grad", "kernel"), ("input", "output_grad"))
    for a, b in pairs:
      if getattr(self, a).dtype in _E5M2 and getattr(self, b).dtype in _E5M2:
        raise ValueError(
            f"Fp8Recipe: {a}.dtype and {b}.dtype are both e5m2; an e5m2 x e5m2 GEMM "
            "is not supported (use e4m3 for at least one operand: allowed pairs are "
            "e4m3 x e4m3 and e4m3 x e5m2)")
    fnuz = {getattr(self, r).dtype in _FNUZ for r in ("input", "kernel", "output_grad")}
    if len(fnuz) > 1:
      raise ValueError(
          "Fp8Recipe: mixing fnuz formats (float8_e4m3fnuz/float8_e5m2fnuz) with "
          "non-fnuz formats is not supported; use one family for all roles")

  def role(self, name: str) -> ScalingConfig:
    """Returns the :class:`ScalingConfig` of role ``name``."""
    check_choice("Fp8Recipe", "role", name, ("input", "kernel", "output_grad"))
    return getattr(self, name)


def delayed_scaling(history_length: int = 1024, *, margin: int = 0,
                    amax_compute_algo: str = "max", fnuz: bool = False) -> Fp8Recipe:
  """Delayed scaling for all roles: scales come from earlier steps' amaxes.

  Example:
    >>> import fp8_linen as fl
    >>> fl.delayed_scaling(16).kernel.history_length
    16
  """
  kw = dict(scaling="delayed", history_length=history_length, margin=margin,
            amax_compute_algo=amax_compute_algo)
  e4, e5 = ("float8_e4m3fnuz", "float8_e5m2fnuz") if fnuz else ("float8_e4m3fn", "float8_e5m2")
  return Fp8Recipe(input=ScalingConfig(dtype=e4, **kw), kernel=ScalingConfig(dtype=e4, **kw),
                   output_grad=ScalingConfig(dtype=e5, **kw))


def current_scaling(*, margin: int = 0, history_length: int = 16,
                    fnuz: bool = False) -> Fp8Recipe:
  """Current (dynamic) scaling for all roles: scales from this step's amax.

  The amax history is still recorded (for monitoring) but not used.

  Example:
    >>> import fp8_linen as fl
    >>> fl.current_scaling().input.scaling
    'current'
  """
  kw = dict(scaling="current", history_length=history_length, margin=margin)
  e4, e5 = ("float8_e4m3fnuz", "float8_e5m2fnuz") if fnuz else ("float8_e4m3fn", "float8_e5m2")
  return Fp8Recipe(input=ScalingConfig(dtype=e4, **kw), kernel=ScalingConfig(dtype=e4, **kw),
                   output_grad=ScalingConfig(dtype=e5, **kw))




def rowwise_scaling(*, margin: int = 0, history_length: int = 16,
                    fnuz: bool = False) -> Fp8Recipe:
  """Row-wise scaling: activation per row, weight per output channel.

  All roles use current scaling; the histories only monitor the global amax.

  Example:
    >>> import fp8_linen as fl
    >>> fl.rowwise_scaling().granularity
    'row'
  """
  base = current_scaling(margin=margin, history_length=history_length, fnuz=fnuz)
  return dataclasses.replace(base, granularity="row")


def mx_block_scaling(block_size: int = 32, *, history_length: int = 16,
                     grad_scaling: str = "current") -> Fp8Recipe:
  """MX-style block scaling (e4m3 elements, e8m0 scales per ``block_size`` block).

  Args:
    block_size: elements per block along the contracting axis (32 in MX).
    history_length: length of the monitoring amax histories.
    grad_scaling: ``'current'`` or ``'delayed'`` per-tensor scaling of the
      e5m2 output gradient.

  Example:
    >>> import fp8_linen as fl
    >>> fl.mx_block_scaling().block_size
    32
  """
  kw = dict(scaling="current", history_length=history_length)
  return Fp8Recipe(input=ScalingConfig(dtype="float8_e4m3fn", **kw),
                   kernel=ScalingConfig(dtype="float8_e4m3fn", **kw),
                   output_grad=ScalingConfig(dtype="float8_e5m2", scaling=grad_scaling,
                                             history_length=history_length),
                   granularity="block", block_size=block_size)


def _act_e4m3() -> ScalingConfig:
  return ScalingConfig(dtype="float8_e4m3fn")


def _act_e5m2() -> ScalingConfig:
  return ScalingConfig(dtype="float8_e5m2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationRecipe:
  """How an activation and its gradient are stored in fp8 (``Fp8Activation``).

  Attributes:
    input: the activation's config (e4m3, delayed scaling by default).
    output_grad: the gradient's config (e5m2, delayed scaling by default).

  Example:
    >>> import fp8_linen as fl
    >>> fl.ActivationRecipe().output_grad.dtype
    'float8_e5m2'
  """

  input: ScalingConfig = dataclasses.field(default_factory=_act_e4m3)
  output_grad: ScalingConfig = dataclasses.field(default_factory=_act_e5m2)

  def __post_init__(self):
    for role in ("input", "output_grad"):
      if not isinstance(getattr(self, role), ScalingConfig):
        raise ValueError(f"ActivationRecipe.{role} must be a ScalingConfig, got "
                         f"{type(getattr(self, role)).__name__}")

  def role(self, name: str) -> ScalingConfig:
    """The config of role ``name`` (``'input'`` or ``'output_grad'``)."""
    if name not in ("input", "output_grad"):
      raise ValueError(f"ActivationRecipe has roles 'input' and 'output_grad', not {name!r}")
    return getattr(self, name)
