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

__all__ = [
    "FP8_DTYPES",
    "ScalingConfig",
    "Fp8Recipe",
    "delayed_scaling",
    "current_scaling",
    "canonical_fp8_dtype",
    # issue 4: granularity, integer QAT
    "GRANULARITIES",
    "rowwise_scaling",
    "mx_block_scaling",
    "IntQuantConfig",
    "IntRecipe",
    "int8_lsq",
    "int4_lsq_plus",
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


def _check_choice(owner: str, field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(
        f"{owner}.{field}={value!r} is not allowed; allowed values: {list(allowed)}")


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
    _check_choice("ScalingConfig", "scaling", self.scaling, _SCALINGS)
    _check_choice("ScalingConfig", "amax_compute_algo", self.amax_compute_algo, _ALGOS)
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
        :func:`~fp8_linen.ops.fp8_dot_general`).
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
    _check_choice("Fp8Recipe", "granularity", self.granularity, GRANULARITIES)
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
    _check_choice("Fp8Recipe", "gemm", self.gemm, _GEMMS)
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
    _check_choice("Fp8Recipe", "role", name, ("input", "kernel", "output_grad"))
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


def resolve_gemm(recipe: Fp8Recipe) -> str:
  """Resolves ``recipe.gemm='auto'`` against the default JAX backend."""
  if recipe.gemm != "auto":
    return recipe.gemm
  import jax  # local: keep module import cheap
  return "fp8" if jax.default_backend() == "gpu" else "bf16"



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


# ----------------------------------------------------------------------------
# Integer quantization-aware training (seed 003).
# ----------------------------------------------------------------------------

_INT_GRANULARITIES = ("tensor", "channel", "group")
_ESTIMATORS = ("ste", "lsq", "lsq+")
_OBSERVERS = ("minmax", "moving_average")


def _check_int(owner: str, field: str, value, lo: int, hi: int | None = None) -> None:
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  if not ok or value < lo or (hi is not None and value > hi):
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise ValueError(f"{owner}.{field}={value!r} must be an int {rng}")


def _check_bool(owner: str, field: str, value) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{owner}.{field}={value!r} must be True or False")


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntQuantConfig:
  """How one tensor role is fake-quantized to a ``bits``-bit integer grid.

  Fake quantization (seed 003): ``x_hat = s * (clamp(round(x / s) + z, qmin,
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
    _check_int(o, "bits", self.bits, 2, 8)
    for f in ("symmetric", "narrow_range", "power_of_two"):
      _check_bool(o, f, getattr(self, f))
    _check_choice(o, "granularity", self.granularity, _INT_GRANULARITIES)
    _check_choice(o, "estimator", self.estimator, _ESTIMATORS)
    _check_choice(o, "observer", self.observer, _OBSERVERS)
    if self.granularity == "group":
      if self.group_size is None:
        raise ValueError(f"{o}.group_size is required when granularity='group'")
      _check_int(o, "group_size", self.group_size, 1)
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

  The GEMM runs on fake-quantized operands in float (``compute_dtype``);
  gradients are not quantized. ``None`` leaves a role in float.

  Attributes:
    input: the activation (left operand); per-tensor only.
    kernel: the weight (right operand).
    compute_dtype: dtype the fake-quantized operands are multiplied in.

  Example:
    >>> import fp8_linen as fl
    >>> fl.IntRecipe(kernel=fl.IntQuantConfig(bits=4)).kernel.qmax
    7
  """

  input: IntQuantConfig | None = dataclasses.field(default_factory=IntQuantConfig)
  kernel: IntQuantConfig | None = dataclasses.field(default_factory=IntQuantConfig)
  compute_dtype: Literal["float32", "bfloat16"] = "float32"

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
    _check_choice("IntRecipe", "compute_dtype", self.compute_dtype, ("float32", "bfloat16"))


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
