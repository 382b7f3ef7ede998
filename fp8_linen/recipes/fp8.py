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

from fp8_linen.recipes._validate import check_bool, check_choice

__all__ = [
    "FP8_DTYPES",
    "FP4_DTYPES",
    "ScalingConfig",
    "Fp8Recipe",
    "delayed_scaling",
    "current_scaling",
    "canonical_fp8_dtype",
    "GRANULARITIES",
    "rowwise_scaling",
    "mx_block_scaling",
    "nvfp4",
    "ActivationRecipe",
    "Fp8WeightOnly",
]

# Name -> numpy dtype for every fp8 format the library knows.
FP8_DTYPES: dict[str, np.dtype] = {
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
}
# The 4-bit element format of NVFP4 (block granularity only): the largest value
# is 6 and there is no Inf or NaN (a NaN block rides on its e4m3 block scale).
FP4_DTYPES: dict[str, np.dtype] = {"float4_e2m1fn": np.dtype(ml_dtypes.float4_e2m1fn)}
_E5M2 = {"float8_e5m2", "float8_e5m2fnuz"}
_FNUZ = {"float8_e4m3fnuz", "float8_e5m2fnuz"}
_SCALINGS = ("delayed", "current")
_ALGOS = ("max", "most_recent")
_GEMMS = ("auto", "fp8", "block", "bf16", "f32")
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


def _canonical_element_dtype(dtype) -> str:
  """An fp8 name (:func:`canonical_fp8_dtype`) or ``'float4_e2m1fn'`` (NVFP4 elements)."""
  if isinstance(dtype, str):
    name = dtype
  else:
    try:
      name = np.dtype(dtype).name
    except TypeError:
      name = None
  if name in ("e2m1", "float4_e2m1fn"):
    return "float4_e2m1fn"
  try:
    return canonical_fp8_dtype(dtype)
  except ValueError:
    raise ValueError(f"dtype={dtype!r} is not an fp8 or fp4 format; allowed: "
                     f"{sorted(FP8_DTYPES) + sorted(FP4_DTYPES)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingConfig:
  """How one tensor role is quantized to fp8.

  The scale ``s`` maps the tensor into the fp8 range: ``x_fp8 = saturate(x / s)``
  and ``x ~= x_fp8 * s``, with ``s = amax * 2**margin / fp8_max``.

  Attributes:
    dtype: fp8 format name (see :data:`FP8_DTYPES`); dtypes are accepted too.
      ``'float4_e2m1fn'`` (NVFP4's e2m1 elements) only in an
      :class:`Fp8Recipe` of ``granularity='block'``, where the scale this
      config chooses is NVFP4's per-tensor scale (see :func:`nvfp4`).
    scaling: ``'delayed'`` (scale from the amax history of earlier steps) or
      ``'current'`` (scale from this step's amax).
    history_length: number of past amax values kept (index 0 is the newest).
      ``0`` (``'current'`` scaling only) keeps no state at all: nothing to
      monitor or checkpoint for the role, and the layer can run where state
      cannot travel, e.g. a model's own ``jax.lax.scan`` over its layers
      (MaxText's ``scan_layers``), where a per-layer state would be refused.
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
    object.__setattr__(self, "dtype", _canonical_element_dtype(self.dtype))
    check_choice("ScalingConfig", "scaling", self.scaling, _SCALINGS)
    check_choice("ScalingConfig", "amax_compute_algo", self.amax_compute_algo, _ALGOS)
    if (not isinstance(self.history_length, (int, np.integer))
        or isinstance(self.history_length, bool) or self.history_length < 0):
      raise ValueError(
          f"ScalingConfig.history_length={self.history_length!r} must be an int >= 1 "
          "(or 0 with scaling='current': no state kept)")
    if self.history_length == 0 and self.scaling != "current":
      raise ValueError(
          "ScalingConfig.history_length=0 keeps no amax history, which delayed scaling "
          "reads its scale from; use scaling='current' or history_length >= 1")
    if (not isinstance(self.margin, (int, np.integer)) or isinstance(self.margin, bool)
        or not -64 <= self.margin <= 64):
      raise ValueError(
          f"ScalingConfig.margin={self.margin!r} must be an int in [-64, 64]")
    if not isinstance(self.power_of_two, bool):
      raise ValueError(
          f"ScalingConfig.power_of_two={self.power_of_two!r} must be True or False")

  @property
  def keeps_state(self) -> bool:
    """Whether the role keeps a scale and an amax history (``history_length > 0``)."""
    return self.history_length > 0

  @property
  def jnp_dtype(self):
    """The element dtype (fp8, or e2m1 for NVFP4) as a numpy/JAX dtype."""
    return FP8_DTYPES.get(self.dtype) or FP4_DTYPES[self.dtype]

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
    gemm: how the product is lowered. ``'auto'`` feeds fp8 operands to the
      GEMM on GPU and upcasts them exactly to bfloat16 elsewhere (XLA:CPU has no
      fp8 units and its default f32 lowering is twice as slow); block recipes
      run as block-scaled GEMMs where the target has them (a Blackwell GPU,
      see :func:`~fp8_linen.target_backend`) and are emulated elsewhere.
      ``'fp8'``, ``'bf16'`` and ``'f32'`` force one lowering; ``'block'``
      (block granularity only) forces the block-scaled GEMM
      (``jax.nn.scaled_matmul`` on a GPU; elsewhere XLA's ``scaled_dot``
      composite, which dequantizes and multiplies).
    granularity: how finely the operands are scaled.

      * ``'tensor'``: one scale per tensor and role (delayed or current).
      * ``'row'``: the activation gets one scale per row and the weight one per
        output channel (amax over the contracting axes). The GEMM itself runs
        on unscaled fp8 operands and the outer product of the two scale vectors
        multiplies its output, so it stays a plain fp8 GEMM. The gradient is
        scaled per row of each backward GEMM (see
        :func:`~fp8_linen.fp8_dot_general`).
      * ``'block'``: block scaling of all three GEMMs (forward, dgrad, wgrad):
        each operand is quantized in blocks of ``block_size`` elements along
        the axis *that GEMM* contracts (so the activation, the weight and the
        gradient are each quantized twice, once per GEMM they feed, as
        TransformerEngine does "rowwise and columnwise"). fp8 elements give
        MXFP8 (one power-of-two e8m0 scale per block, 32 elements on
        Blackwell); ``float4_e2m1fn`` elements give NVFP4 (one e4m3 scale per
        block of 16 and one float32 scale per tensor, from the role's
        :class:`ScalingConfig`; see :func:`nvfp4`).

      Row scales and MX block scales are computed from this step's values, so
      they need ``scaling='current'`` for the roles they scale finely (a
      per-row history cannot be kept across batches of different sizes). The
      OWG state is still declared and then only records a monitoring history
      of each role's global amax; NVFP4's per-tensor scale may be delayed.
    block_size: elements per block for ``granularity='block'`` (32 in MXFP8,
      16 in NVFP4: the sizes Blackwell's block-scaled GEMMs take).
    kernel_2d_blocks: block granularity: quantize the weight in
      ``block_size x block_size`` tiles with one scale per tile, so the
      forward and the dgrad GEMM (which contract different weight axes) read
      the same codes (NVIDIA's NVFP4 recipe). ``False``: the weight is
      quantized once along each axis.
    wgrad_hadamard: block granularity: size of the random Hadamard transform
      applied to both weight-gradient operands along the axis that GEMM
      contracts (the tokens), before they are quantized; it spreads outliers
      over a group and leaves the exact product unchanged (the transform is
      orthogonal and the same on both sides). ``0`` turns it off; 16 in
      NVIDIA's NVFP4 recipe; a power of two otherwise.
    grad_stochastic_rounding: block granularity: round the output gradient's
      elements stochastically (unbiased) instead of to nearest, in both
      gradient GEMMs (NVIDIA's NVFP4 recipe). The random bits are seeded by
      the layer's ``output_grad`` state (its amax history changes every step
      and is the same on every device), so a step is reproducible and a
      sharded step draws the same bits as one device. Micro-batches of one
      accumulated step share their bits.
    four_over_six: NVFP4 only: each block's e4m3 scale maps the block's amax
      to 6 or to 4, whichever reconstructs the block with the smaller squared
      error ("Four Over Six", arXiv 2512.02010): near its amax e2m1's grid is
      4, 6, so a block whose large values sit around 2/3 of its amax loses
      less on the grid 3, 4. Every role, every GEMM; the choice is made per
      block from round-to-nearest codes (stochastic rounding then rounds with
      the chosen scale). The GEMM is unchanged: same codes, same scales.

  Example:
    >>> import fp8_linen as fl
    >>> fl.Fp8Recipe().output_grad.dtype
    'float8_e5m2'
  """

  input: ScalingConfig = dataclasses.field(default_factory=_e4m3)
  kernel: ScalingConfig = dataclasses.field(default_factory=_e4m3)
  output_grad: ScalingConfig = dataclasses.field(default_factory=_e5m2)
  gemm: Literal["auto", "fp8", "block", "bf16", "f32"] = "auto"
  granularity: Literal["tensor", "row", "block"] = "tensor"
  block_size: int = 32
  kernel_2d_blocks: bool = False
  wgrad_hadamard: int = 0
  grad_stochastic_rounding: bool = False
  four_over_six: bool = False

  def __post_init__(self):
    check_choice("Fp8Recipe", "granularity", self.granularity, GRANULARITIES)
    if (not isinstance(self.block_size, (int, np.integer)) or isinstance(self.block_size, bool)
        or self.block_size < 1):
      raise ValueError(f"Fp8Recipe.block_size={self.block_size!r} must be an int >= 1")
    for role in ("input", "kernel", "output_grad"):
      cfg = getattr(self, role)
      if not isinstance(cfg, ScalingConfig):
        raise ValueError(
            f"Fp8Recipe.{role} must be a ScalingConfig, got {type(cfg).__name__}")
    check_choice("Fp8Recipe", "gemm", self.gemm, _GEMMS)
    self._check_block_options()
    if self.granularity == "block" and self.gemm == "fp8":
      raise ValueError(
          "Fp8Recipe.gemm='fp8' is not allowed with granularity='block' (a block recipe "
          "runs a block-scaled GEMM or its emulation); allowed values: "
          "['auto', 'block', 'bf16', 'f32']")
    if self.gemm == "block" and self.granularity != "block":
      raise ValueError(
          f"Fp8Recipe.gemm='block' is not allowed with granularity={self.granularity!r} "
          "(a block-scaled GEMM needs block scales); allowed values: "
          "['auto', 'fp8', 'bf16', 'f32']")
    fp4 = [r for r in ("input", "kernel", "output_grad") if getattr(self, r).dtype in FP4_DTYPES]
    # MX block scales are this step's own (there is no per-tensor scale); NVFP4
    # keeps a per-tensor scale per role, which may be delayed.
    fine_roles = {"row": ("input", "kernel", "output_grad"),
                  "block": () if fp4 else ("input", "kernel", "output_grad")
                  }.get(self.granularity, ())
    for role in fine_roles:
      cfg = getattr(self, role)
      if cfg.scaling != "current":
        raise ValueError(
            f"Fp8Recipe.{role}.scaling={cfg.scaling!r} is not allowed with "
            f"granularity={self.granularity!r}: row/block scales come from this step's "
            "values; allowed values: ['current']")
    if fp4 and (self.granularity != "block" or len(fp4) != 3):
      raise ValueError(
          f"Fp8Recipe.{fp4[0]}.dtype='float4_e2m1fn' needs granularity='block' and e2m1 "
          "for all three roles (NVFP4: every operand of every GEMM is e2m1 with e4m3 block "
          f"scales); got granularity={self.granularity!r} and dtypes "
          f"{[getattr(self, r).dtype for r in ('input', 'kernel', 'output_grad')]}")
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

  def _check_block_options(self):
    check_bool("Fp8Recipe", "kernel_2d_blocks", self.kernel_2d_blocks)
    check_bool("Fp8Recipe", "grad_stochastic_rounding", self.grad_stochastic_rounding)
    check_bool("Fp8Recipe", "four_over_six", self.four_over_six)
    if self.four_over_six and not self.is_nvfp4:
      raise ValueError(
          "Fp8Recipe.four_over_six=True needs NVFP4 (granularity='block' with "
          f"float4_e2m1fn elements); got granularity={self.granularity!r}, "
          f"input.dtype={self.input.dtype!r}: MX scales are powers of two, fine and per-tensor "
          "scales have no 4-or-6 choice; allowed values here: [False]")
    h = self.wgrad_hadamard
    if (not isinstance(h, (int, np.integer)) or isinstance(h, bool) or h < 0
        or (h and (h < 2 or h & (h - 1)))):
      raise ValueError(f"Fp8Recipe.wgrad_hadamard={h!r} must be 0 (off) or a power of two "
                       ">= 2 (16 in NVFP4)")
    if self.granularity != "block":
      for name, off in (("kernel_2d_blocks", False), ("wgrad_hadamard", 0),
                        ("grad_stochastic_rounding", False)):
        if getattr(self, name) != off:
          raise ValueError(
              f"Fp8Recipe.{name}={getattr(self, name)!r} needs granularity='block' (got "
              f"granularity={self.granularity!r}); allowed values here: [{off!r}]")
    if self.gemm == "block" and self.block_size < 2:
      raise ValueError(f"Fp8Recipe.block_size={self.block_size!r} with gemm='block': a "
                       "block-scaled GEMM needs blocks of at least 2 elements")

  @property
  def is_nvfp4(self) -> bool:
    """Whether this is a block recipe with e2m1 elements (NVFP4)."""
    return self.granularity == "block" and self.input.dtype in FP4_DTYPES

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
                     grad_dtype: str = "float8_e4m3fn") -> Fp8Recipe:
  """MXFP8: e4m3 elements with one e8m0 (power-of-two) scale per ``block_size`` block.

  All three GEMMs of a layer are block scaled, each operand along the axis
  that GEMM contracts (see :class:`Fp8Recipe`): on a GPU with block-scaled
  GEMMs (Blackwell) they are cuDNN block-scaled dots; elsewhere the blocks
  are dequantized exactly to bfloat16 and multiplied there (the same numbers).
  Block scales round the block's amax *up* to a power of two, so no element
  is clipped (the "RCEIL" rule NVIDIA's MXFP8 pretraining recipe found
  necessary), and the gradient is e4m3 too, as in that recipe and
  TransformerEngine's MXFP8 default (block scales give e5m2's range
  anyway; e4m3 has one more mantissa bit).

  Args:
    block_size: elements per block along each GEMM's contracting axis (32 in
      MX; other sizes run emulated only).
    history_length: length of the monitoring amax histories.
    grad_dtype: the output gradient's element format (``'float8_e4m3fn'`` or
      ``'float8_e5m2'``).

  Example:
    >>> import fp8_linen as fl
    >>> r = fl.mx_block_scaling()
    >>> r.block_size, r.output_grad.dtype
    (32, 'float8_e4m3fn')
  """
  kw = dict(scaling="current", history_length=history_length)
  return Fp8Recipe(input=ScalingConfig(dtype="float8_e4m3fn", **kw),
                   kernel=ScalingConfig(dtype="float8_e4m3fn", **kw),
                   output_grad=ScalingConfig(dtype=grad_dtype, **kw),
                   granularity="block", block_size=block_size)


def nvfp4(*, kernel_2d_blocks: bool = True, wgrad_hadamard: int = 16,
          grad_stochastic_rounding: bool = True, scaling: str = "current",
          history_length: int = 16, four_over_six: bool = False) -> Fp8Recipe:
  """NVFP4 training: e2m1 elements, e4m3 scales per 16 elements, a float32 scale per tensor.

  NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149, TransformerEngine's
  ``NVFP4BlockScaling``) for all three GEMMs of a layer; every technique it
  needs to converge is a field you can switch off:

  * ``kernel_2d_blocks``: the weight is quantized in 16x16 tiles, so the
    forward and the dgrad GEMM see the same weight;
  * ``wgrad_hadamard=16``: a 16-point random Hadamard transform on both
    weight-gradient operands (along the tokens) before they are quantized;
  * ``grad_stochastic_rounding``: the output gradient is rounded
    stochastically in both gradient GEMMs (activations and weights round to
    nearest).

  The fourth, keeping the last layers in higher precision, is a choice of
  *which* layers get this recipe: :func:`~fp8_linen.high_precision_layers`.

  Each element is ``q * s_block * s_tensor``: ``s_tensor`` maps the tensor's
  amax to ``6 * 448`` (the largest e2m1 value times the largest e4m3 block
  scale), each block's e4m3 scale maps its amax to 6 (rounded to nearest, so
  a block's largest element may saturate at 6 by up to a sixteenth). The
  role's :class:`ScalingConfig` chooses ``s_tensor``: its stored scale is
  ``amax / 6`` (e2m1's largest value), ``s_tensor`` that over 448; current
  scaling (the default) from this step's amax, delayed from the history. On
  a Blackwell GPU the products are cuDNN's NVFP4 block-scaled dots;
  elsewhere they are emulated with the same numbers (exact bfloat16
  dequantization).

  Args:
    kernel_2d_blocks: 16x16 weight tiles (``False``: 1x16 along each axis).
    wgrad_hadamard: random Hadamard size for the wgrad operands (0: off).
    grad_stochastic_rounding: stochastic rounding of the output gradient.
    scaling: ``'current'`` or ``'delayed'`` per-tensor scales, all roles.
    history_length: length of the amax histories.
    four_over_six: each block scaled to 4 or 6, whichever loses less
      (:class:`Fp8Recipe`'s field; not in NVIDIA's recipe, off by default).

  Example:
    >>> import fp8_linen as fl
    >>> r = fl.nvfp4()
    >>> r.input.dtype, r.block_size, r.kernel_2d_blocks, r.wgrad_hadamard
    ('float4_e2m1fn', 16, True, 16)
  """
  kw = dict(dtype="float4_e2m1fn", scaling=scaling, history_length=history_length)
  return Fp8Recipe(input=ScalingConfig(**kw), kernel=ScalingConfig(**kw),
                   output_grad=ScalingConfig(**kw), granularity="block", block_size=16,
                   kernel_2d_blocks=kernel_2d_blocks, wgrad_hadamard=wgrad_hadamard,
                   grad_stochastic_rounding=grad_stochastic_rounding,
                   four_over_six=four_over_six)


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


_WEIGHT_ONLY_GRANULARITIES = ("tensor", "channel")
_WEIGHT_ONLY_COMPUTE = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8WeightOnly:
  """Weight-only fp8: the weight stored as fp8 codes with its scales, activations in float.

  The fp8 twin of :func:`~fp8_linen.weight_only`: the weight is quantized to
  ``dtype`` with a scale from its own amax (current scaling: nothing to
  calibrate or keep) and dequantized for a float GEMM, in QAT (the
  straight-through estimator: the weight's gradient passes unchanged) and in
  serving (codes times scales). It halves a bf16 weight's bytes; the GEMM runs in
  float.

  Attributes:
    dtype: the fp8 format (:data:`FP8_DTYPES`).
    granularity: ``'tensor'`` (one scale) or ``'channel'`` (one per output
      channel: the weight's free axes).
    margin: head-room as a power of two (``s *= 2**margin``).
    compute_dtype: the float GEMM's operand dtype: ``'auto'`` (bfloat16 for a
      bfloat16 activation, else float32), ``'float32'`` or ``'bfloat16'``.

  Example:
    >>> import fp8_linen as fl
    >>> fl.Fp8WeightOnly().granularity
    'channel'
  """

  dtype: str = "float8_e4m3fn"
  granularity: str = "channel"
  margin: int = 0
  compute_dtype: str = "auto"

  def __post_init__(self):
    object.__setattr__(self, "dtype", canonical_fp8_dtype(self.dtype))
    check_choice("Fp8WeightOnly", "granularity", self.granularity, _WEIGHT_ONLY_GRANULARITIES)
    check_choice("Fp8WeightOnly", "compute_dtype", self.compute_dtype, _WEIGHT_ONLY_COMPUTE)
    self.kernel  # pylint: disable=pointless-statement  # checks margin

  @property
  def kernel(self) -> ScalingConfig:
    """The weight's scaling: current, from its amax."""
    return ScalingConfig(dtype=self.dtype, scaling="current", history_length=0,
                         margin=self.margin)
