"""The collectives of a compiled program, read from its optimized HLO.

:func:`collectives` lists every all-reduce, all-gather, reduce-scatter,
all-to-all, ... of a parsed module (:func:`fp8_linen.testing.hlo.parse`) as a
:class:`Collective` with the bytes it moves, marking those that run only in a
``lax.cond`` branch; :func:`collective_totals` sums them by kind. What a
sharded training step moves, read with these, is
:mod:`fp8_linen.testing.collectives`.

Example:
  >>> from fp8_linen.testing import hlo, hlo_collectives
  >>> text = '''ENTRY %main (x: bf16[64,32]) -> bf16[64,32] {
  ...   %x = bf16[64,32]{1,0} parameter(0)
  ...   ROOT %r = bf16[64,32]{1,0} all-reduce(%x), replica_groups={}
  ... }'''
  >>> hlo_collectives.collective_totals(hlo_collectives.collectives(hlo.parse(text)))
  {'all-reduce': (1, 4096.0)}
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from fp8_linen.testing.hlo import ArrayType, Module, branches, called

__all__ = ["KINDS", "Collective", "collectives", "collective_totals"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
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


def _inbranches(module: Module) -> set[str]:
  """The computations that run only inside a branch of some ``conditional``."""
  roots = [n for instrs in module.computations.values() for i in instrs
           if i.opcode == "conditional" for n in branches(i)]
  out, todo = set(), roots
  while todo:
    c = todo.pop()
    if c not in out and c in module.computations:
      out.add(c)
      todo.extend(called(module, c))
  return out


def collectives(module: Module) -> list[Collective]:
  """Every collective of a compiled program (each asynchronous pair once).

  Example:
    >>> from fp8_linen.testing import hlo, hlo_collectives
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
    >>> [(c.kind, c.nbytes, c.dtypes) for c in hlo_collectives.collectives(hlo.parse(text))]
    [('all-reduce', 4096, ('bf16',))]
  """
  out = []
  branched = _inbranches(module)
  for comp, instrs in module.computations.items():
    for inst in instrs:
      op = inst.opcode
      base = op[:-len("-start")] if op.endswith("-start") else op
      if base not in KINDS:
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
