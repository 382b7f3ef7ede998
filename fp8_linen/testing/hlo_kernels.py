"""The top-level kernels of a compiled program with their FLOPs and bytes: the estimate's input.

:func:`kernels` lists what the device runs one after another (a parsed
module's top-level instructions: fusions, library calls, ...; a ``while``
body counted its known trip count times, ``conditional`` branches marked) as
:class:`Kernel` s, each with the FLOPs of its products by operand class
(:mod:`fp8_linen.testing.hlo_products`), the bytes it reads and writes, and
XLA:TPU's own cycle estimate where the program carries one. Collectives are
not kernels here (:mod:`fp8_linen.testing.hlo_collectives`). The step-time
estimate built on them is :mod:`fp8_linen.testing.estimate`.

Example:
  >>> from fp8_linen.testing import hlo, hlo_kernels
  >>> text = '''ENTRY %main (a: bf16[16,32], b: bf16[32,8]) -> f32[16,8] {
  ...   %a = bf16[16,32]{1,0} parameter(0)
  ...   %b = bf16[32,8]{1,0} parameter(1)
  ...   ROOT %d = f32[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }'''
  >>> [(k.name, k.flops, k.bytes_read, k.bytes_written)
  ...  for k in hlo_kernels.kernels(hlo.parse(text))]
  [('d', (('bf16', 8192),), 1536, 512)]
"""

from __future__ import annotations

import collections
import dataclasses
import re

from fp8_linen.testing.hlo import Module, branches, reachable
from fp8_linen.testing.hlo_collectives import KINDS as COLLECTIVE_KINDS
from fp8_linen.testing.hlo_products import Product, products

__all__ = ["Kernel", "kernels", "every_step_branches", "is_scalar_unit", "trip_count"]

_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')

# Asynchronous copies (prefetches between memory spaces) overlap the kernels around them,
# and the kernel that reads the copy counts those bytes itself. XLA:TPU's memory-space
# assignment also prefetches a buffer in slices: a ``slice-start`` per slice (an
# asynchronous slice into the alternate memory, whose result tuple repeats the whole
# operand) and a ``ConcatBitcast`` custom call that names the slices, already contiguous
# there, as one buffer; neither moves data of its own either.
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                "conditional", "call", "after-all", "partition-id", "replica-id",
                "add-dependency", "opt-barrier", "domain", "copy-start", "copy-done",
                "slice-start", "send-done", "recv-done", "async-done", "async-update", ""}
_CONCAT_BITCAST = 'custom_call_target="ConcatBitcast"'


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
    scalar: an instruction XLA:TPU runs on the TensorCore's scalar unit, not
      as a vector kernel (:func:`is_scalar_unit`).
  """

  name: str
  opcode: str
  flops: tuple[tuple[str, int], ...]
  bytes_read: float
  bytes_written: float
  count: int = 1
  xla_cycles: int | None = None
  branch: tuple[str, int] | None = None
  scalar: bool = False

  @property
  def is_product(self) -> bool:
    return bool(self.flops)


# A copy into scalar memory is a DMA from HBM; the others are vector kernels whenever
# XLA:TPU leaves them unfused.
_NOT_SCALAR_UNIT = {"copy", "custom-call", "fusion", "reduce", "rng", "rng-bit-generator"}


def is_scalar_unit(inst) -> bool:
  """Whether XLA:TPU runs the top-level instruction ``inst`` on the scalar unit.

  XLA:TPU leaves the arithmetic on one-element arrays (a scale, a finite
  check, a history's bookkeeping) unfused, in scalar memory, and gives it no
  vector-kernel configuration (``window_config``, with the ``estimated_cycles``
  of its cost model) in the backend config it writes on every instruction
  (``flag_configs``). Such an instruction is a few scalar instructions of the
  TensorCore (a bundle issues per cycle, a scalar-memory load takes 4), not
  a kernel with a pipeline to fill. No GPU program has one: XLA:GPU runs
  every top-level instruction as a kernel.

  Example:
    >>> from fp8_linen.testing import hlo, hlo_kernels
    >>> text = '''ENTRY %main (a: f32[1]) -> pred[1] {
    ...   %a = f32[1]{0:T(128)S(6)} parameter(0)
    ...   ROOT %f = pred[1]{0:T(512)S(6)} is-finite(%a), backend_config={"flag_configs":[]}
    ... }'''
    >>> [k.scalar for k in hlo_kernels.kernels(hlo.parse(text))]
    [True]
  """
  return ('"flag_configs"' in inst.attrs and '"window_config"' not in inst.attrs
          and inst.opcode not in _NOT_SCALAR_UNIT and all(a.size <= 1 for a in inst.result))


def trip_count(module: Module, comp: str, loop) -> int:
  """How many times the ``while`` instruction ``loop`` (in computation ``comp``) runs its body.

  XLA:GPU writes a loop's known trip count into its backend config; XLA:TPU
  does not, so the count is read from the loop itself where it has the form
  ``lax.scan`` and ``fori_loop`` give it: a condition ``i < N`` on a counter
  that starts at a constant. 1 when neither says.
  """
  m = _TRIP.search(loop.attrs)
  if m:
    return int(m.group(1))
  cond = module.computations.get(loop.condition or "", [])
  root = cond[-1] if cond else None
  if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
    return 1
  ops = [module.instruction(loop.condition, n) for n in root.operands]
  if len(ops) != 2 or None in ops or ops[0].opcode != "get-tuple-element" or \
      ops[1].opcode != "constant":
    return 1
  index = re.search(r"\bindex=(\d+)", ops[0].attrs)
  init = module.instruction(comp, loop.operands[0]) if loop.operands else None
  if index is None or init is None or init.opcode != "tuple":
    return 1
  start = module.instruction(comp, init.operands[int(index.group(1))])
  while start is not None and start.opcode in ("copy", "bitcast") and start.operands:
    start = module.instruction(comp, start.operands[0])  # (XLA:TPU copies the counter in)
  try:
    first = int(start.literal) if start is not None and start.opcode == "constant" else None
    return max(int(ops[1].literal) - first, 1) if first is not None else 1
  except ValueError:
    return 1


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
        if inst.body:
          todo.append((inst.body, times * trip_count(module, comp, inst), branch))
      elif inst.opcode == "call":
        if inst.to_apply:
          todo.append((inst.to_apply, times, branch))
      elif inst.opcode == "conditional":
        todo.extend((n, times, branch or (inst.name, i))
                    for i, n in enumerate(branches(inst)))
      elif inst.opcode in ("async-start",) and inst.calls:
        todo.append((inst.calls, times, branch))
  return out


def kernels(module: Module) -> list[Kernel]:
  """The top-level kernels of a compiled program with their FLOPs and memory traffic.

  Collectives are not kernels here (see
  :func:`~fp8_linen.testing.hlo_collectives.collectives`); nor are
  parameters, tuples, bitcasts and control flow, whose bodies are read in
  their place (a ``while`` body counts its known trip count), nor
  prefetches between memory spaces (their readers count the bytes).
  """
  by_comp: dict[str, list[Product]] = collections.defaultdict(list)
  for p in products(module):
    by_comp[p.computation].append(p)
  fused = module.fusion_computations()
  inner: dict[str, list[Product]] = {}

  def inner_products(comp: str) -> list[Product]:
    if comp not in inner:
      inner[comp] = [p for c in reachable(module, [comp]) for p in by_comp.get(c, ())]
    return inner[comp]

  out = []
  for comp, times, branch in _top_level(module):
    if comp in fused:
      continue
    own = {p.name: p for p in by_comp.get(comp, ())}
    for inst in module.computations[comp]:
      op = inst.opcode
      base = op[:-len("-start")] if op.endswith("-start") else op
      if op in _NOT_KERNELS or base in COLLECTIVE_KINDS or op.endswith("-done"):
        continue
      if op == "custom-call" and _CONCAT_BITCAST in inst.attrs:
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
                        int(cycles.group(1)) if cycles else None, branch,
                        is_scalar_unit(inst)))
  return out


def every_step_branches(costs) -> set:
  """The ``(conditional, branch)`` keys a step runs every time: each conditional's cheapest.

  A ``lax.cond`` runs one branch per step; delayed scaling's first-step
  branch (the scale from this step's amax) is the expensive one and runs
  once. Which index it has depends on how XLA prints the conditional (a
  predicate's true/false pair or an indexed list), so the cheapest branch is
  chosen by cost, not by index; a branch without kernels costs nothing.

  Args:
    costs: ``(branch, cost)`` pairs, ``branch`` a :attr:`Kernel.branch`
      (None for kernels outside any conditional: always kept).

  Returns:
    The set of branch keys to count (None included).

  Example:
    >>> from fp8_linen.testing import hlo_kernels
    >>> sorted(hlo_kernels.every_step_branches([(("c", 0), 9.0), (("c", 1), 1.0), (None, 5.0)]),
    ...        key=str)
    [('c', 1), None]
    >>> hlo_kernels.every_step_branches([(("c", 1), 9.0)])
    {None}
  """
  sums = collections.defaultdict(float)
  for branch, cost in costs:
    sums[branch] += cost
  keep = {None}
  by_cond = collections.defaultdict(dict)
  for branch in sums:
    if branch is not None:
      by_cond[branch[0]][branch[1]] = sums[branch]
  for cond, per in by_cond.items():
    if len(per) < 2:
      continue  # the other branch runs no kernel: it is the cheapest
    keep.add((cond, min(per, key=per.get)))
  return keep
