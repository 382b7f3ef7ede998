"""The products (GEMMs, convolutions) of a compiled program, read from its optimized HLO.

:func:`products` lists every product of a parsed module
(:func:`fp8_linen.testing.hlo.parse`) as a :class:`Product`: cuBLAS/cuBLASLt
GEMMs, cuDNN convolutions and block-scaled dots, Triton and cuDNN GEMM fusions
and plain dots on a GPU; ``convolution`` instructions (every GEMM on a TPU is
one), with the dtypes of the operands they are fed and their FLOPs (taps on
padding or dilation holes excluded). :func:`operand_class` names what a
product multiplies (fp8, int8, fp4, bf16, f32) for a peak-rate table, and
:func:`count_products` gives the GPU summary :class:`ProductCounts` the H100
proof tests assert on.

Example:
  >>> from fp8_linen.testing import hlo, hlo_products
  >>> text = '''ENTRY %main (a: f8e4m3fn[16,32], b: f8e4m3fn[32,8]) -> f32[16,8] {
  ...   %a = f8e4m3fn[16,32]{1,0} parameter(0)
  ...   %b = f8e4m3fn[32,8]{1,0} parameter(1)
  ...   ROOT %d = f32[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }'''
  >>> [(p.kind, p.operands, p.flops) for p in hlo_products.products(hlo.parse(text))]
  [('dot', ('f8e4m3fn', 'f8e4m3fn'), 8192)]
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterable

import numpy as np

from fp8_linen.testing.hlo import (ArrayType, Instruction, Module, backend_json, parse,
                                   reachable)

__all__ = ["Product", "products", "operand_class", "ProductCounts", "counts_of",
           "count_products", "FP8_GEMM_TARGET", "BLOCK_SCALED_DOT_TARGET"]

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
"""The custom-call target of a cuBLASLt GEMM with fp8 operands."""

PALLAS_TRITON_TARGET = "__gpu$xla.gpu.triton"
"""The custom-call target of a Pallas kernel compiled by Triton."""

BLOCK_SCALED_DOT_TARGET = "__cudnn$blockScaledDot"
"""The custom-call target of cuDNN's block-scaled (MXFP8 / NVFP4) dot on Blackwell."""

_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
_BATCH_GROUPS = re.compile(r"batch_group_count=(\d+)")


def _is_f8(t) -> bool:
  return bool(t) and t.startswith("f8") and t != "f8e8m0fnu"


def operand_class(lhs: str | None, rhs: str | None) -> str:
  """What a product with these operand element types multiplies, for a peak-rate table.

  ``'fp8'`` (both 8-bit floats), ``'int8'`` (both 8-bit integers), ``'fp4'``
  (both e2m1), ``'f32'`` (an f32 operand), else ``'bf16'`` (16-bit floats or
  mixed).

  Example:
    >>> from fp8_linen.testing import hlo_products
    >>> hlo_products.operand_class('f8e5m2', 'f8e4m3fn'), hlo_products.operand_class('f32', 'bf16')
    ('fp8', 'f32')
  """
  pair = (lhs or "", rhs or "")
  if all(map(_is_f8, pair)):
    return "fp8"
  if all(t in ("s8", "u8") for t in pair):
    return "int8"
  if all(t == "f4e2m1fn" for t in pair):
    return "fp4"
  if "f32" in pair or "f64" in pair:
    return "f32"
  return "bf16"


@dataclasses.dataclass(frozen=True)
class Product:
  """One GEMM or convolution of a compiled program.

  Attributes:
    kind: ``'cublas'`` (a cuBLAS/cuBLASLt GEMM custom call), ``'cudnn-conv'``,
      ``'block-scaled-dot'`` (cuDNN's MXFP8/NVFP4 dot), ``'mosaic-grouped-gemm'``
      (XLA:TPU's grouped GEMM kernel for ``ragged_dot``, or megablox's ``tgmm``
      the library runs for its wgrad), ``'cudnn-gemm'`` or
      ``'triton-gemm'`` (a GEMM fusion), ``'pallas-grouped-gemm'`` (the
      library's Triton grouped GEMMs for ``ragged_dot``; operands: the dtype
      its dots are fed), ``'convolution'`` (a convolution
      instruction: every GEMM and convolution on a TPU) or ``'dot'`` (a dot
      left to a generic emitter).
    operands: the element types of its two operands, as they are fed to it.
    out: the element type of its result.
    flops: multiply-adds x 2.
    target: the custom-call target or fusion kind (``''`` otherwise).
    computation: the computation it is in; ``name`` its instruction name.
  """

  kind: str
  operands: tuple[str | None, str | None]
  out: str
  flops: int
  target: str = ""
  computation: str = ""
  name: str = ""

  @property
  def operand_class(self) -> str:
    """:func:`operand_class` of its operands."""
    return operand_class(*self.operands)

  @property
  def low_precision(self) -> bool:
    """Both operands are 8-bit (or 4-bit) floats or integers."""
    return self.operand_class in ("fp8", "int8", "fp4")


def _gemm_flops(out: ArrayType, lhs: ArrayType | None, contracting: Iterable[int]) -> int:
  k = math.prod(lhs.shape[d] for d in contracting) if lhs is not None else 0
  return 2 * out.size * k


def _window(attrs: str) -> dict[str, list]:
  """The ``window={...}`` attribute as lists per spatial dimension."""
  m = _WINDOW.search(attrs)
  out: dict[str, list] = {}
  for item in (m.group(1).split() if m else ()):
    key, _, value = item.partition("=")
    parts = value.split("x")
    out[key] = ([tuple(int(v) for v in p.split("_")) for p in parts] if key == "pad"
                else [int(p) for p in parts])
  return out


def _taps(length: int, out: int, size: int, stride: int, lo: int, lhs_dilate: int,
          rhs_dilate: int) -> int:
  """(output position, window tap) pairs of one spatial dimension that read a real element.

  Taps that land on padding or on the holes of a dilated input multiply zeros:
  XLA:TPU writes batched matmuls as convolutions whose windows do exactly
  that, and counting them would multiply the FLOPs by the batch size.
  """
  p = (np.arange(out)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - lo)
  real = (p >= 0) & (p < (length - 1) * lhs_dilate + 1) & (p % lhs_dilate == 0)
  return int(real.sum())


def _conv_flops(inst: Instruction, lhs: ArrayType | None, rhs: ArrayType | None) -> int:
  """2 x the multiply-adds a convolution really does (taps on padding or dilation holes excluded)."""
  m = _DIM_LABELS.search(inst.attrs)
  if lhs is None or rhs is None or not inst.result or not m:
    return 0
  lhs_l, rhs_l, out_l = m.groups()
  out = inst.result[0]
  if len(lhs_l) != len(lhs.shape) or len(rhs_l) != len(rhs.shape) or len(out_l) != len(out.shape):
    return 0
  win = _window(inst.attrs)
  spatial = sorted(c for c in out_l if c.isdigit())
  pairs = 1
  for k, c in enumerate(spatial):
    get = lambda key, default: win.get(key, [default] * len(spatial))[k]
    lo, _ = get("pad", (0, 0))
    pairs *= _taps(lhs.shape[lhs_l.index(c)], out.shape[out_l.index(c)], get("size", 1),
                   get("stride", 1), lo, get("lhs_dilate", 1), get("rhs_dilate", 1))
  rest = math.prod(n for c, n in zip(out_l, out.shape) if not c.isdigit())
  groups = _BATCH_GROUPS.search(inst.attrs)
  per_group_batch = lhs.shape[lhs_l.index("b")] // int(groups.group(1)) if groups else 1
  return 2 * rest * pairs * rhs.shape[rhs_l.index("i")] * per_group_batch


def _first_array(module: Module, comp: str, name: str) -> ArrayType | None:
  d = module.instruction(comp, name)
  return d.result[0] if d is not None and d.result else None


def _fused_dot(module: Module, comp: str, seen=None):
  """``(computation, dot instruction)`` of the first dot in ``comp`` or its nested fusions."""
  seen = seen if seen is not None else set()
  if comp in seen or comp not in module.computations:
    return None
  seen.add(comp)
  for inst in module.computations[comp]:
    if inst.opcode in ("dot", "scaled-dot"):
      return comp, inst
  for inst in module.computations[comp]:
    if inst.opcode == "fusion" and inst.calls:
      found = _fused_dot(module, inst.calls, seen)
      if found is not None:
        return found
  return None


def _dot_product(module: Module, comp: str, inst: Instruction, kind: str, target: str = ""):
  types = module.operand_types(comp, inst, 2)
  lhs = _first_array(module, comp, inst.operands[0]) if inst.operands else None
  m = _CONTRACT.search(inst.attrs)
  contracting = [int(d) for d in m.group(1).split(",") if d] if m else []
  return Product(kind, (types + (None, None))[:2], inst.dtype,
                 _gemm_flops(inst.result[0], lhs, contracting), target, comp, inst.name)


def _custom_call_product(module: Module, comp: str, inst: Instruction) -> Product | None:
  target = inst.target
  types = (module.operand_types(comp, inst, 2) + (None, None))[:2]
  arrays = [a[0] if a else None for a in module.operand_arrays(comp, inst)[:2]]
  out = inst.result[0] if inst.result else ArrayType("", ())
  if target.startswith("__cublas$gemm") or target.startswith("__cublas$lt$matmul"):
    dn = backend_json(inst.attrs).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracting = [int(d) for d in dn.get("lhs_contracting_dimensions", [])]
    return Product("cublas", types, out.dtype, _gemm_flops(out, arrays[0], contracting),
                   target, comp, inst.name)
  if target == BLOCK_SCALED_DOT_TARGET:
    # (B, M, K) x (B, N, K) -> (B, M, N); the scales are operands 2 and 3.
    lhs = arrays[0]
    k = lhs.shape[-1] if lhs is not None and lhs.shape else 0
    return Product("block-scaled-dot", types, out.dtype, 2 * out.size * k, target, comp,
                   inst.name)
  if target.startswith("__cudnn$conv"):
    return Product("cudnn-conv", types, out.dtype, _conv_flops(inst, *arrays), target, comp,
                   inst.name)
  if target == "tpu_custom_call" and inst.name.startswith("ragged-dot") \
      and not inst.name.startswith("ragged-dot-metadata"):
    # XLA:TPU's grouped GEMM (jax.lax.ragged_dot) is a Mosaic kernel; its last two
    # operands are the two matrices it multiplies (the first ones, group metadata).
    n = len(inst.operands)
    types = (module.operand_types(comp, inst, n) + (None,) * n)[n - 2:n]
    lhs = (module.operand_arrays(comp, inst) + [None] * n)[n - 2]
    k = lhs[0].shape[-1] if lhs and lhs[0].shape else 0
    return Product("mosaic-grouped-gemm", tuple(types), out.dtype, 2 * out.size * k, target,
                   comp, inst.name)
  if target == "tpu_custom_call" and _TPU_WGRAD_SCOPE in inst.attrs:
    # JAX's megablox grouped wgrad (the library's TPU wgrad): each group's rows of two
    # matrices contracted; they are its last two operands, the second (m, n).
    n = len(inst.operands)
    types = (module.operand_types(comp, inst, n) + (None,) * n)[n - 2:n]
    rhs = (module.operand_arrays(comp, inst) + [None] * n)[n - 1]
    m = rhs[0].shape[0] if rhs and rhs[0].shape else 0
    per_group = out.size // out.shape[0] if out.shape else 0
    return Product("mosaic-grouped-gemm", tuple(types), out.dtype, 2 * m * per_group, target,
                   comp, inst.name)
  if target == PALLAS_TRITON_TARGET:
    return _grouped_kernel_product(module, comp, inst, out)
  return None


# fp8_linen.core.grouped_kernels.TPU_WGRAD_SCOPE: the name scope of the library's TPU wgrad.
_TPU_WGRAD_SCOPE = "fp8_linen_tpu_grouped_wgrad"

# The library's grouped-GEMM kernels name themselves after the dtype their dots are fed
# (fp8_linen.core.grouped_kernels.kernel_name): mixed fp8 codes multiply in float16.
_GROUPED_KERNEL = re.compile(r'\bname = "fp8_linen_grouped_(gemm|wgrad)_(\w+)"')
_HLO_TYPES = {"float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "int8": "s8",
              "float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def _grouped_kernel_product(module: Module, comp: str, inst: Instruction, out: ArrayType):
  found = _GROUPED_KERNEL.search(inst.attrs)
  if found is None:
    return None
  fed = _HLO_TYPES.get(found.group(2), found.group(2))
  lhs = (module.operand_arrays(comp, inst) + [None])[0]
  rows, cols = lhs[0].shape if lhs and len(lhs[0].shape) == 2 else (0, 0)
  # Each routed row is multiplied once: (m, c) by its group's (c, o).
  per_row = out.shape[-1] * (cols if found.group(1) == "gemm" else out.shape[-2])
  if found.group(1) == "wgrad" and out.shape[-2]:
    rows = rows * cols // out.shape[-2]  # (m, c) or, K-major, (c, m): m either way
  return Product("pallas-grouped-gemm", (fed, fed), out.dtype, 2 * rows * per_row,
                 PALLAS_TRITON_TARGET, comp, inst.name)


def products(module: Module) -> list[Product]:
  """Every GEMM and convolution of a compiled program, as XLA emitted it.

  GEMM fusions (Triton, cuDNN) count once, as the fusion; the dot inside them
  is not counted again. Convolutions are found in every computation (on a TPU
  they sit inside fusions).

  Args:
    module: a parsed optimized HLO module (:func:`parse`).

  Returns:
    A list of :class:`Product` in text order.
  """
  out: list[Product] = []
  gemm_fusions = []
  for comp, instrs in module.computations.items():
    for inst in instrs:
      if inst.opcode != "fusion" or not inst.calls:
        continue
      kind = inst.fusion_kind
      if not ("triton" in kind or kind == "__cudnn$fusion"):
        continue
      found = _fused_dot(module, inst.calls)
      if found is None:
        continue
      gemm_fusions.append(inst.calls)
      dcomp, dot = found
      p = _dot_product(module, dcomp, dot, "cudnn-gemm" if kind == "__cudnn$fusion"
                       else "triton-gemm", kind)
      out.append(dataclasses.replace(p, computation=comp, name=inst.name))
  inside = reachable(module, gemm_fusions)
  for comp, instrs in module.computations.items():
    if comp in inside:
      continue
    for inst in instrs:
      if inst.opcode == "custom-call":
        p = _custom_call_product(module, comp, inst)
        if p is not None:
          out.append(p)
      elif inst.opcode == "convolution":
        types = (module.operand_types(comp, inst, 2) + (None, None))[:2]
        lhs, rhs = (_first_array(module, comp, n) for n in (inst.operands + ("", ""))[:2])
        out.append(Product("convolution", types, inst.dtype, _conv_flops(inst, lhs, rhs), "",
                           comp, inst.name))
      elif inst.opcode in ("dot", "scaled-dot"):
        out.append(_dot_product(module, comp, inst, "dot"))
  return out


# ----------------------------------------------------------------------------
# The GPU summary.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProductCounts:
  """The products (GEMMs, convolutions) of an optimized XLA:GPU HLO module.

  Attributes:
    fp8_gemms: cuBLASLt GEMMs with fp8 operands (``__cublas$lt$matmul$f8``) and
      cuDNN GEMM fusions whose dot has fp8 operands.
    gemms: all library GEMMs (``__cublas$gemm``, ``__cublas$lt$matmul*``, cuDNN
      GEMM fusions).
    fp8_convs: convolutions (cuDNN custom calls or ``convolution``
      instructions) whose two inputs are fp8.
    convs: all convolutions.
    fp8_triton_gemms: Triton GEMM fusions and the library's Triton grouped
      GEMMs whose dots have fp8 operands.
    triton_gemms: all Triton GEMM fusions and grouped-GEMM kernels.
    other_dots: dots lowered neither to a library call nor to a Triton GEMM
      (e.g. tiny ones emitted inside loop fusions).
    int8_gemms: library or fusion GEMMs whose two operands are ``s8`` (the
      integer products of integer QAT and serving, ``s8 x s8 -> s32``).
    block_scaled_dots: cuDNN block-scaled dots (MXFP8 / NVFP4 on Blackwell).
    custom_calls: ``(target, count)`` of every custom call, sorted by target.
  """

  fp8_gemms: int = 0
  gemms: int = 0
  fp8_convs: int = 0
  convs: int = 0
  fp8_triton_gemms: int = 0
  triton_gemms: int = 0
  other_dots: int = 0
  int8_gemms: int = 0
  block_scaled_dots: int = 0
  custom_calls: tuple[tuple[str, int], ...] = ()

  @property
  def fp8_products(self) -> int:
    """fp8 GEMMs + fp8 convolutions + fp8 Triton GEMMs + block-scaled dots."""
    return self.fp8_gemms + self.fp8_convs + self.fp8_triton_gemms + self.block_scaled_dots

  @property
  def products(self) -> int:
    """All GEMMs, convolutions, Triton GEMMs, block-scaled dots and other dots."""
    return (self.gemms + self.convs + self.triton_gemms + self.other_dots
            + self.block_scaled_dots)


def _all_s8(types) -> bool:
  return len(types) == 2 and all(t == "s8" for t in types)


def counts_of(items: Iterable[Product], module: Module) -> ProductCounts:
  """The :class:`ProductCounts` of a product list (see :func:`count_products`)."""
  c = collections.Counter()
  for p in items:
    fp8 = all(map(_is_f8, p.operands))
    if p.kind in ("cublas", "cudnn-gemm"):
      c["gemms"] += 1
      c["fp8_gemms"] += p.target == FP8_GEMM_TARGET or (p.kind == "cudnn-gemm" and fp8)
      c["int8_gemms"] += _all_s8(p.operands)
    elif p.kind in ("cudnn-conv", "convolution"):
      c["convs"] += 1
      c["fp8_convs"] += fp8
    elif p.kind in ("triton-gemm", "pallas-grouped-gemm"):
      c["triton_gemms"] += 1
      c["fp8_triton_gemms"] += fp8
      c["int8_gemms"] += _all_s8(p.operands)
    elif p.kind == "block-scaled-dot":
      c["block_scaled_dots"] += 1
    else:
      c["other_dots"] += 1
  targets = collections.Counter(i.target for instrs in module.computations.values()
                                for i in instrs if i.opcode == "custom-call")
  return ProductCounts(custom_calls=tuple(sorted(targets.items())),
                       **{f.name: c[f.name] for f in dataclasses.fields(ProductCounts)
                          if f.name != "custom_calls"})


def count_products(hlo_text: str) -> ProductCounts:
  """Counts the GEMMs and convolutions of an optimized XLA:GPU HLO module.

  Args:
    hlo_text: ``compiled.as_text()`` of a module compiled for a CUDA GPU.

  Returns:
    A :class:`ProductCounts`.
  """
  module = parse(hlo_text)
  return counts_of(products(module), module)
