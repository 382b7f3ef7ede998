"""Reading XLA's optimized HLO text: products, collectives and per-kernel costs.

A compiled program (``compiled.as_text()``) says what a target really runs:
which GEMMs and convolutions exist and what their operands are, which
collectives move how many bytes, and which top-level kernels read and write
how much memory. This module reads that text for every target
:mod:`fp8_linen.testing.targets` compiles for. It needs no plugin and no
device: it is plain text processing.

* :func:`parse` turns the text into a :class:`Module` (computations of
  :class:`Instruction`, each with its result arrays and operand names).
* :func:`products` lists every product (:class:`Product`): cuBLAS/cuBLASLt
  GEMMs, cuDNN convolutions and block-scaled dots, Triton and cuDNN GEMM
  fusions and plain dots on a GPU; ``convolution`` instructions (every GEMM on
  a TPU is one), with the dtypes of the operands they are fed.
* :func:`collectives` counts all-reduce / all-gather / reduce-scatter / ...
  and the bytes each moves.
* :func:`kernels` lists the top-level kernels (what runs one after another on
  the device) with their FLOPs by operand class and the bytes they read and
  write: the input of :mod:`fp8_linen.testing.estimate`.
* :func:`count_products` keeps the GPU summary :class:`ProductCounts` the
  H100 proofs were first written against.

Example:
  >>> from fp8_linen.testing import hlo
  >>> text = '''ENTRY %main (a: f8e4m3fn[16,32], b: f8e4m3fn[32,8]) -> f32[16,8] {
  ...   %a = f8e4m3fn[16,32]{1,0} parameter(0)
  ...   %b = f8e4m3fn[32,8]{1,0} parameter(1)
  ...   ROOT %d = f32[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }'''
  >>> [(p.kind, p.operands, p.flops) for p in hlo.products(hlo.parse(text))]
  [('dot', ('f8e4m3fn', 'f8e4m3fn'), 8192)]
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from typing import Iterable

import numpy as np

__all__ = [
    "ArrayType",
    "Instruction",
    "Module",
    "parse",
    "Product",
    "products",
    "operand_class",
    "Collective",
    "collectives",
    "collective_totals",
    "Kernel",
    "kernels",
    "ProductCounts",
    "counts_of",
    "count_products",
    "FP8_GEMM_TARGET",
    "BLOCK_SCALED_DOT_TARGET",
]

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
"""The custom-call target of a cuBLASLt GEMM with fp8 operands."""

BLOCK_SCALED_DOT_TARGET = "__cudnn$blockScaledDot"
"""The custom-call target of cuDNN's block-scaled (MXFP8 / NVFP4) dot on Blackwell."""

# Bytes per element. Sub-byte types are packed two to a byte.
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5, "s8": 1, "u8": 1, "s16": 2,
          "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([^\]]*)\]")
_COMP_START = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"([^"]+)"')
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_TO_APPLY = re.compile(r"\bto_apply=%([\w.\-]+)")
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_PRED_BRANCHES = re.compile(r"\b(?:true|false)_computation=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
_BATCH_GROUPS = re.compile(r"batch_group_count=(\d+)")


def _bytes_per(dtype: str) -> float:
  if dtype.startswith("f8"):
    return 1
  return _BYTES.get(dtype, 4)


@dataclasses.dataclass(frozen=True)
class ArrayType:
  """One array of an instruction's result: element type and dimensions."""

  dtype: str
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> float:
    return self.size * _bytes_per(self.dtype)


def _arrays(text: str) -> tuple[ArrayType, ...]:
  """Every array type written in ``text`` (a shape or a tuple of shapes), in order."""
  out = []
  for dtype, dims in _ARRAY.findall(text):
    shape = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
    out.append(ArrayType(dtype, shape))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction.

  Attributes:
    name: its name (without ``%``).
    opcode: e.g. ``'fusion'``, ``'custom-call'``, ``'convolution'``.
    result: the arrays it produces (one for an array, several for a tuple,
      flattened in order).
    operands: the names of its operands.
    attrs: the text after the operand list (attributes, backend config).
  """

  name: str
  opcode: str
  result: tuple[ArrayType, ...]
  operands: tuple[str, ...]
  attrs: str

  @property
  def dtype(self) -> str:
    """Element type of the (first) result array."""
    return self.result[0].dtype if self.result else ""

  @property
  def target(self) -> str:
    """The custom-call target, or ``''``."""
    m = _TARGET.search(self.attrs)
    return m.group(1) if m else ""

  @property
  def fusion_kind(self) -> str:
    """A fusion's backend kind (``'__triton_gemm'``, ``'__cudnn$fusion'``, ...), or ``''``."""
    m = _KIND.search(self.attrs)
    return m.group(1) if m else ""

  @property
  def calls(self) -> str | None:
    """The computation a fusion (or an async op) runs."""
    m = _CALLS.search(self.attrs)
    return m.group(1) if m else None


def _matching(s: str, i: int) -> int:
  """Index of the bracket closing the one at ``s[i]``."""
  pairs = {"(": ")", "[": "]", "{": "}"}
  stack = []
  for j in range(i, len(s)):
    c = s[j]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return j
  return len(s) - 1


def _instruction(name: str, rest: str) -> Instruction:
  rest = rest.strip()
  if rest.startswith("("):
    end = _matching(rest, 0)
    result, rest = _arrays(rest[:end + 1]), rest[end + 1:].strip()
  else:
    shape, _, rest = rest.partition(" ")
    result = _arrays(shape)
  m = re.match(r"([\w\-]+)\(", rest)
  if not m:
    return Instruction(name, "", result, (), rest)
  open_at = m.end() - 1
  close_at = _matching(rest, open_at)
  operands = tuple(_NAME.findall(rest[open_at + 1:close_at]))
  return Instruction(name, m.group(1), result, operands, rest[close_at + 1:])


@dataclasses.dataclass
class Module:
  """A parsed HLO module.

  Attributes:
    computations: ``{name: [Instruction, ...]}`` in text order.
    entry: the name of the ENTRY computation.
  """

  computations: dict[str, list[Instruction]]
  entry: str

  def __post_init__(self):
    self._by_name = {c: {i.name: i for i in instrs} for c, instrs in self.computations.items()}

  def instruction(self, computation: str, name: str) -> Instruction | None:
    return self._by_name.get(computation, {}).get(name)

  def operand_types(self, computation: str, inst: Instruction, n: int | None = None) -> tuple:
    """The (first) element types of ``inst``'s operands, read from their definitions."""
    names = inst.operands if n is None else inst.operands[:n]
    out = []
    for name in names:
      d = self.instruction(computation, name)
      out.append(d.dtype if d is not None else None)
    return tuple(out)

  def operand_arrays(self, computation: str, inst: Instruction) -> list[tuple[ArrayType, ...]]:
    return [(d.result if d is not None else ())
            for d in (self.instruction(computation, n) for n in inst.operands)]

  def fusion_computations(self) -> set[str]:
    """Computations run by a fusion instruction (their instructions are not kernels)."""
    return {i.calls for instrs in self.computations.values() for i in instrs
            if i.opcode == "fusion" and i.calls}


def parse(text: str) -> Module:
  """Parses ``compiled.as_text()`` (or any HLO module text) into a :class:`Module`."""
  comps: dict[str, list[Instruction]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      m = _COMP_START.match(line)
      if m and not line.startswith(" "):
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      comps[current].append(_instruction(m.group(1), m.group(2)))
  return Module(comps, entry)


# ----------------------------------------------------------------------------
# Products.
# ----------------------------------------------------------------------------


def _is_f8(t) -> bool:
  return bool(t) and t.startswith("f8") and t != "f8e8m0fnu"


def operand_class(lhs: str | None, rhs: str | None) -> str:
  """What a product with these operand element types multiplies, for a peak-rate table.

  ``'fp8'`` (both 8-bit floats), ``'int8'`` (both 8-bit integers), ``'fp4'``
  (both e2m1), ``'f32'`` (an f32 operand), else ``'bf16'`` (16-bit floats or
  mixed).

  Example:
    >>> from fp8_linen.testing import hlo
    >>> hlo.operand_class('f8e5m2', 'f8e4m3fn'), hlo.operand_class('f32', 'bf16')
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
      ``'block-scaled-dot'`` (cuDNN's MXFP8/NVFP4 dot), ``'cudnn-gemm'`` or
      ``'triton-gemm'`` (a GEMM fusion), ``'convolution'`` (a convolution
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


def _backend_json(attrs: str) -> dict:
  i = attrs.find("backend_config=")
  if i < 0:
    return {}
  start = attrs.find("{", i)
  if start < 0:
    return {}
  try:
    return json.loads(attrs[start:_matching(attrs, start) + 1])
  except ValueError:
    return {}


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


def _reachable(module: Module, roots: Iterable[str]) -> set[str]:
  out, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in out or c not in module.computations:
      continue
    out.add(c)
    for inst in module.computations[c]:
      todo.extend(_CALLS.findall(inst.attrs))
  return out


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
    dn = _backend_json(inst.attrs).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
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
  return None


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
  inside = _reachable(module, gemm_fusions)
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
# Collectives.
# ----------------------------------------------------------------------------

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "ragged-all-to-all", "collective-broadcast")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program.

  Attributes:
    kind: ``'all-reduce'``, ``'all-gather'``, ``'reduce-scatter'``, ... (the
      ``-start`` of an asynchronous pair counts as the collective).
    nbytes: the bytes of the full (unsharded) data it reduces or gathers: the
      larger of its inputs and its outputs.
    dtypes: the element types it moves.
    name: its instruction name.
    conditional: it lies in a branch of a ``conditional`` (a ``lax.cond``),
      so it runs only in the steps that take that branch (e.g. the first
      step of delayed scaling, whose history is still empty), not in every
      step.
    arrays: the :class:`ArrayType` s it produces (several when XLA combined
      collectives into one).
  """

  kind: str
  nbytes: float
  dtypes: tuple[str, ...]
  name: str = ""
  conditional: bool = False
  arrays: tuple[ArrayType, ...] = ()


def _branches(inst: Instruction) -> list[str]:
  """The branch computations of a ``conditional`` (either spelling XLA prints)."""
  m = _BRANCHES.search(inst.attrs)
  return _NAME.findall(m.group(1)) if m else _PRED_BRANCHES.findall(inst.attrs)


def _in_branches(module: Module) -> set[str]:
  """The computations that run only inside a branch of some ``conditional``."""
  roots = [n for instrs in module.computations.values() for i in instrs
           if i.opcode == "conditional" for n in _branches(i)]
  out, todo = set(), roots
  while todo:
    c = todo.pop()
    if c not in out and c in module.computations:
      out.add(c)
      todo.extend(_called(module, c))
  return out


def _called(module: Module, comp: str) -> list[str]:
  """Every computation an instruction of ``comp`` names (bodies, branches, fusions)."""
  names = []
  for inst in module.computations.get(comp, []):
    for pattern in (_CALLS, _TO_APPLY, _BODY):
      names.extend(pattern.findall(inst.attrs))
    if inst.opcode == "conditional":
      names.extend(_branches(inst))
  return names


def collectives(module: Module) -> list[Collective]:
  """Every collective of a compiled program (each asynchronous pair once).

  Example:
    >>> from fp8_linen.testing import hlo
    >>> text = '''%add (a: f32[], b: f32[]) -> f32[] {
    ...   %a = f32[] parameter(0)
    ...   %b = f32[] parameter(1)
    ...   ROOT %s = f32[] add(%a, %b)
    ... }
    ...
    ... ENTRY %main (x: bf16[64,32]) -> bf16[64,32] {
    ...   %x = bf16[64,32]{1,0} parameter(0)
    ...   ROOT %r = bf16[64,32]{1,0} all-reduce(%x), replica_groups={}, to_apply=%add
    ... }'''
    >>> [(c.kind, c.nbytes, c.dtypes) for c in hlo.collectives(hlo.parse(text))]
    [('all-reduce', 4096, ('bf16',))]
  """
  out = []
  branched = _in_branches(module)
  for comp, instrs in module.computations.items():
    for inst in instrs:
      op = inst.opcode
      base = op[:-len("-start")] if op.endswith("-start") else op
      if base not in _COLLECTIVES:
        continue
      ins = [a for arrays in module.operand_arrays(comp, inst) for a in arrays]
      in_bytes = sum(a.nbytes for a in ins)
      res = inst.result
      if op.endswith("-start") and len(res) > len(ins):
        # An async start returns (operands..., outputs..., context): the outputs follow.
        res = res[len(ins):len(ins) * 2] if len(res) >= 2 * len(ins) else res[len(ins):]
      out_bytes = sum(a.nbytes for a in res)
      dtypes = tuple(sorted({a.dtype for a in (res or ins)}))
      out.append(Collective(base, max(in_bytes, out_bytes), dtypes, inst.name,
                            comp in branched, tuple(res or ins)))
  return out


def collective_totals(items: Iterable[Collective]) -> dict[str, tuple[int, float]]:
  """``{kind: (count, bytes)}`` over ``items``."""
  acc: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for c in items:
    acc[c.kind][0] += 1
    acc[c.kind][1] += c.nbytes
  return {k: (n, b) for k, (n, b) in sorted(acc.items())}


# ----------------------------------------------------------------------------
# Kernels (for the step-time estimate).
# ----------------------------------------------------------------------------

# Asynchronous copies (prefetches between memory spaces) overlap the kernels around them,
# and the kernel that reads the copy counts those bytes itself.
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                "conditional", "call", "after-all", "partition-id", "replica-id",
                "add-dependency", "opt-barrier", "domain", "copy-start", "copy-done",
                "send-done", "recv-done", "async-done", "async-update", ""}


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One top-level kernel of a compiled program (what the device runs in sequence).

  Attributes:
    name: instruction name; ``opcode`` its opcode.
    flops: ``((operand class, FLOPs), ...)`` of the products it runs (empty
      for a kernel without products).
    bytes_read: bytes of its operands.
    bytes_written: bytes of its results (a GEMM's workspace excluded).
    count: how many times it runs per step (a loop body's trip count).
    xla_cycles: XLA:TPU's own cost-model estimate of the kernel's cycles (the
      ``estimated_cycles`` of its backend config), or None (other targets).
    branch: ``(conditional, branch index)`` when the kernel runs only in one
      branch of a ``conditional`` (a ``lax.cond``), else None.
  """

  name: str
  opcode: str
  flops: tuple[tuple[str, int], ...]
  bytes_read: float
  bytes_written: float
  count: int = 1
  xla_cycles: int | None = None
  branch: tuple[str, int] | None = None

  @property
  def is_product(self) -> bool:
    return bool(self.flops)


def _top_level(module: Module) -> list[tuple[str, int, tuple[str, int] | None]]:
  """``(computation, times per step, branch)`` of the computations whose instructions are kernels.

  ``branch`` is ``(conditional, branch index)`` of the outermost ``conditional``
  the computation runs under, or None.
  """
  out, todo, seen = [], [(module.entry, 1, None)], set()
  while todo:
    comp, times, branch = todo.pop()
    if comp in seen or comp not in module.computations:
      continue
    seen.add(comp)
    out.append((comp, times, branch))
    for inst in module.computations[comp]:
      if inst.opcode == "while":
        m = _TRIP.search(inst.attrs)
        body = _BODY.search(inst.attrs)
        if body:
          todo.append((body.group(1), times * (int(m.group(1)) if m else 1), branch))
      elif inst.opcode == "call":
        m = _TO_APPLY.search(inst.attrs)
        if m:
          todo.append((m.group(1), times, branch))
      elif inst.opcode == "conditional":
        todo.extend((n, times, branch or (inst.name, i))
                    for i, n in enumerate(_branches(inst)))
      elif inst.opcode in ("async-start",) and inst.calls:
        todo.append((inst.calls, times, branch))
  return out


def kernels(module: Module) -> list[Kernel]:
  """The top-level kernels of a compiled program with their FLOPs and memory traffic.

  Collectives are not kernels here (see :func:`collectives`); nor are
  parameters, tuples, bitcasts and control flow, whose bodies are read in
  their place (a ``while`` body counts its known trip count).
  """
  by_comp: dict[str, list[Product]] = collections.defaultdict(list)
  for p in products(module):
    by_comp[p.computation].append(p)
  fused = module.fusion_computations()
  inner: dict[str, list[Product]] = {}

  def inner_products(comp: str) -> list[Product]:
    if comp not in inner:
      inner[comp] = [p for c in _reachable(module, [comp]) for p in by_comp.get(c, ())]
    return inner[comp]

  out = []
  for comp, times, branch in _top_level(module):
    if comp in fused:
      continue
    own = {p.name: p for p in by_comp.get(comp, ())}
    for inst in module.computations[comp]:
      op = inst.opcode
      base = op[:-len("-start")] if op.endswith("-start") else op
      if op in _NOT_KERNELS or base in _COLLECTIVES or op.endswith("-done"):
        continue
      if op == "fusion" and inst.calls and inst.name not in own:
        prods = inner_products(inst.calls)
      else:
        prods = [own[inst.name]] if inst.name in own else []
      flops = collections.Counter()
      for p in prods:
        flops[p.operand_class] += p.flops
      read = sum(a.nbytes for arrays in module.operand_arrays(comp, inst) for a in arrays)
      res = inst.result
      if op == "custom-call" and len(res) > 1 and res[-1].dtype in ("s8", "u8"):
        res = res[:-1]  # a library call's scratch workspace
      cycles = _CYCLES.search(inst.attrs)
      out.append(Kernel(inst.name, op, tuple(sorted(flops.items())), read,
                        sum(a.nbytes for a in res), times,
                        int(cycles.group(1)) if cycles else None, branch))
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
    fp8_triton_gemms: Triton GEMM fusions whose dot has fp8 operands.
    triton_gemms: all Triton GEMM fusions.
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
    elif p.kind == "triton-gemm":
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
