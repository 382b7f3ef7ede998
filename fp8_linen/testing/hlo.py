"""Reading XLA's optimized HLO text: the parser the other ``hlo_*`` readers share.

A compiled program (``compiled.as_text()``) says what a target really runs.
:func:`parse` turns that text into a :class:`Module`: its computations, each a
list of :class:`Instruction` with its result arrays (:class:`ArrayType`),
operand names and attributes, and the call graph between computations
(:func:`reachable`, :func:`called`, :func:`branches`). It needs no plugin and
no device: it is plain text processing. What is read from the parsed module
lives next to it: :mod:`~fp8_linen.testing.hlo_products` (GEMMs and
convolutions with their operand dtypes and FLOPs),
:mod:`~fp8_linen.testing.hlo_collectives` (collectives and their bytes),
:mod:`~fp8_linen.testing.hlo_kernels` (per-kernel FLOPs and bytes, for the
step-time estimate).

Example:
  >>> from fp8_linen.testing import hlo
  >>> text = '''ENTRY %main (a: f8e4m3fn[16,32], b: f8e4m3fn[32,8]) -> f32[16,8] {
  ...   %a = f8e4m3fn[16,32]{1,0} parameter(0)
  ...   %b = f8e4m3fn[32,8]{1,0} parameter(1)
  ...   ROOT %d = f32[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }'''
  >>> m = hlo.parse(text)
  >>> m.entry, [(i.name, i.opcode, i.dtype) for i in m.computations[m.entry]]
  ('main', [('a', 'parameter', 'f8e4m3fn'), ('b', 'parameter', 'f8e4m3fn'), ('d', 'dot', 'f32')])
  >>> m.computations['main'][2].operands, m.computations['main'][2].result
  (('a', 'b'), (ArrayType(dtype='f32', shape=(16, 8)),))
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterable

__all__ = ["ArrayType", "Instruction", "Module", "parse", "reachable", "called", "branches",
           "backend_json"]

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
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_PRED_BRANCHES = re.compile(r"\b(?:true|false)_computation=%([\w.\-]+)")


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
    literal: a ``constant``'s value as written (``'4'``), else ``''``.
  """

  name: str
  opcode: str
  result: tuple[ArrayType, ...]
  operands: tuple[str, ...]
  attrs: str
  literal: str = ""

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

  @property
  def to_apply(self) -> str | None:
    """The computation a ``call`` (or a reduction) applies."""
    m = _TO_APPLY.search(self.attrs)
    return m.group(1) if m else None

  @property
  def body(self) -> str | None:
    """The body computation of a ``while``."""
    m = _BODY.search(self.attrs)
    return m.group(1) if m else None

  @property
  def condition(self) -> str | None:
    """The condition computation of a ``while``."""
    m = _CONDITION.search(self.attrs)
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
  inside = rest[open_at + 1:close_at]
  literal = inside.strip() if m.group(1) == "constant" else ""
  return Instruction(name, m.group(1), result, tuple(_NAME.findall(inside)), rest[close_at + 1:],
                     literal)


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
    # A computation ends at its closing brace, which may carry attributes
    # (TPU7x's SparseCore computations: `}, execution_thread="sparsecore"`).
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      comps[current].append(_instruction(m.group(1), m.group(2)))
  return Module(comps, entry)


# ----------------------------------------------------------------------------
# The call graph and backend configs, which every reader of a parsed module needs.
# ----------------------------------------------------------------------------


def reachable(module: Module, roots: Iterable[str]) -> set[str]:
  """``roots`` and every computation the fusions and async ops (``calls=``) in them run."""
  out, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in out or c not in module.computations:
      continue
    out.add(c)
    for inst in module.computations[c]:
      todo.extend(_CALLS.findall(inst.attrs))
  return out


def called(module: Module, comp: str) -> list[str]:
  """Every computation an instruction of ``comp`` names (bodies, branches, fusions)."""
  names = []
  for inst in module.computations.get(comp, []):
    for pattern in (_CALLS, _TO_APPLY, _BODY):
      names.extend(pattern.findall(inst.attrs))
    if inst.opcode == "conditional":
      names.extend(branches(inst))
  return names


def branches(inst: Instruction) -> list[str]:
  """The branch computations of a ``conditional`` (either spelling XLA prints)."""
  m = _BRANCHES.search(inst.attrs)
  return _NAME.findall(m.group(1)) if m else _PRED_BRANCHES.findall(inst.attrs)


def backend_json(attrs: str) -> dict:
  """The ``backend_config={...}`` JSON of an instruction's ``attrs``, or ``{}``."""
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
