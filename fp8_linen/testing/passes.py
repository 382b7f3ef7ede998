"""The passes around a training step's GEMMs: what each non-GEMM kernel moves, and what it is for.

A low-precision GEMM pays only when the kernels that feed it (amax
reductions, casts, transposes, block scales, finite checks, state updates)
move little memory. :func:`passes` lists the non-GEMM kernels of a compiled
program (:mod:`fp8_linen.testing.hlo_kernels`) with the bytes each moves per
step and a label read from what it computes (:func:`purpose`: a heuristic
over the opcodes and result dtypes of the kernel's fused computation);
:func:`step_passes` compiles a layer's training step for a target
(:func:`~fp8_linen.testing.compile.compile_train_step`) and sums them.

:func:`dense_minimum_bytes` is the floor fused passes can reach, for a
dense layer ``x (M, K) @ W (K, N)`` trained with a cotangent ``g (M, N)``:
each high-precision operand read once and each layout the GEMMs need written
once (a low-precision operand: its row- and column-major codes; bf16: the
weight's one cast from its float32 master copy).

Example:
  >>> from fp8_linen.testing import passes
  >>> passes.dense_minimum_bytes(16, 32, 8, low_precision=False)
  2560
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

from fp8_linen.testing import hlo, hlo_kernels
from fp8_linen.testing.compile import CompileReport, compile_train_step

__all__ = ["Pass", "purpose", "passes", "StepPasses", "step_passes", "dense_minimum_bytes"]

_LOW = {"f8e4m3fn": "fp8 e4m3", "f8e5m2": "fp8 e5m2", "f8e4m3fnuz": "fp8 e4m3",
        "f8e5m2fnuz": "fp8 e5m2", "f4e2m1fn": "fp4 e2m1", "s8": "int8", "s4": "int4",
        "u8": "uint8", "f8e8m0fnu": "e8m0 block scales"}
# Pallas kernels reach XLA as custom calls: Triton's (GPU) and Mosaic's (TPU).
_PALLAS_TARGETS = ('"__gpu$xla.gpu.triton"', '"tpu_custom_call"', '"mosaic_gpu')
_KERNEL_NAME = re.compile(r'\bname = "([^"]+)"')
_SMALL = 1 << 16  # bytes: a kernel whose results are all this small updates scales and state


@dataclasses.dataclass(frozen=True)
class Pass:
  """One non-GEMM kernel of a step.

  Attributes:
    name: the kernel's instruction name.
    purpose: what it computes (:func:`purpose`).
    bytes: bytes it reads and writes per step (times its count).
    branch: ``(conditional, branch)`` when it runs only in one branch of a
      ``lax.cond`` (e.g. the first step's), else None.
    every_step: False for a kernel of a conditional's branch that is not
      its cheapest (:func:`~fp8_linen.testing.hlo_kernels.every_step_branches`:
      delayed scaling's first-step branch), which runs once.
  """

  name: str
  purpose: str
  bytes: float
  branch: tuple[str, int] | None = None
  every_step: bool = True


def _instruction(module: hlo.Module, name: str) -> hlo.Instruction | None:
  for comp in module.computations:
    inst = module.instruction(comp, name)
    if inst is not None:
      return inst
  return None


def purpose(module: hlo.Module, kernel: hlo_kernels.Kernel) -> str:
  """What a kernel computes, from its fused computation: ``'cast to fp8 e4m3 + amax'``, ...

  Labels, joined by ``' + '`` in this order: ``cast to <format>`` (a convert
  to a low-precision format), ``cast to bf16``, ``amax`` (a max-reduction:
  the library takes an amax as ``max(x)`` and ``max(-x)``), ``sum`` (an
  add-reduction: a bias gradient, the loss), ``finite check``,
  ``transpose``, ``random bits``; else ``cast to f32``; ``scales and state``
  for a kernel whose results are all small; else ``elementwise``. A Pallas
  kernel is ``Pallas kernel <its name>``.
  """
  inst = _instruction(module, kernel.name)
  if inst is None:
    return "other"
  if inst.opcode == "custom-call" and any(f"custom_call_target={t}" in inst.attrs
                                          for t in _PALLAS_TARGETS):
    name = _KERNEL_NAME.search(inst.attrs)
    return f"Pallas kernel {name.group(1)}" if name else "Pallas kernel"
  comps = hlo.reachable(module, [inst.calls]) if inst.calls else set()
  insts = [inst] + [i for c in comps for i in module.computations.get(c, ())]
  ops = collections.Counter(i.opcode for i in insts)
  labels = []
  casts = sorted({_LOW[i.dtype] for i in insts if i.opcode == "convert" and i.dtype in _LOW})
  labels += [f"cast to {c}" for c in casts]
  if any(i.opcode == "convert" and i.dtype == "bf16" for i in insts) and not casts:
    labels.append("cast to bf16")
  reducers = {j.opcode for i in insts if i.opcode == "reduce"
              for j in module.computations.get(i.to_apply or "", ())}
  if "maximum" in reducers:
    labels.append("amax")  # max(x) and max(-x), or max(|x|)
  if "add" in reducers:
    labels.append("sum")
  if ops["is-finite"]:
    labels.append("finite check")
  if ops["transpose"] or (inst.opcode in ("copy", "transpose")):
    labels.append("transpose")
  if ops["rng-bit-generator"] or ops["rng"]:
    labels.append("random bits")
  if not labels and any(i.opcode == "convert" and i.dtype == "f32" for i in insts):
    labels.append("cast to f32")
  if labels:
    return " + ".join(labels)
  if all(a.nbytes <= _SMALL for a in inst.result):
    return "scales and state"
  return "elementwise"


def passes(report: CompileReport) -> list[Pass]:
  """The non-GEMM kernels of a compiled program, largest first."""
  module = hlo.parse(report.hlo)
  out = [Pass(k.name, purpose(module, k), (k.bytes_read + k.bytes_written) * k.count, k.branch)
         for k in report.kernel_list if not k.is_product]
  every = hlo_kernels.every_step_branches((p.branch, p.bytes) for p in out)
  out = [dataclasses.replace(p, every_step=p.branch in every) for p in out]
  return sorted(out, key=lambda p: -p.bytes)


@dataclasses.dataclass(frozen=True)
class StepPasses:
  """The passes of one layer's training step on one target.

  Attributes:
    passes: every non-GEMM kernel (:class:`Pass`), largest first.
    total: their bytes per step, the first-step branch of a ``lax.cond``
      excluded (it runs once).
    by_purpose: ``{purpose: bytes}`` of the same kernels.
    report: the compiled step.
  """

  passes: tuple[Pass, ...]
  total: float
  by_purpose: dict[str, float]
  report: Any = dataclasses.field(repr=False, default=None)


def step_passes(model, x, dtype=None, *, target: str = "h100", loss: str = "linear",
                optimizer=None) -> StepPasses:
  """Compiles ``model``'s training step for ``target`` and sums its non-GEMM kernels.

  ``loss`` and ``optimizer`` are
  :func:`~fp8_linen.testing.compile.compile_train_step`'s: ``'mse'`` makes
  the cotangent depend on the output, as a real loss does; with an optimizer
  the step updates the parameters too, instead of returning their gradients.
  """
  report = compile_train_step(model, x, dtype, target=target, loss=loss, optimizer=optimizer)
  ps = tuple(passes(report))
  by = collections.Counter()
  for p in ps:
    if p.every_step:
      by[p.purpose] += p.bytes
  return StepPasses(passes=ps, total=float(sum(by.values())),
                    by_purpose=dict(by.most_common()), report=report)


def dense_minimum_bytes(m: int, k: int, n: int, *, low_precision: bool, x_bytes: int = 2,
                        w_bytes: int = 4, r_bytes: int = 4, y_bytes: int = 2,
                        code_bytes: float = 1.0) -> int:
  """The fewest non-GEMM bytes of a dense layer's training step (see the module doc).

  The step of :mod:`~fp8_linen.testing.train_step`: its loss ``sum(y * r)``
  reads the output ``y`` and the float32 cotangent ``r`` once and writes the
  gradient ``g`` for the backward GEMMs (bf16: once, ``y_bytes`` per element;
  low precision: as two layouts of codes). bf16 (``low_precision=False``):
  the float32 weight read once and written as bf16 once; the input reaches
  its GEMMs as it is. Low precision: the input and the weight each read once
  and written as two layouts of codes (``code_bytes`` per element).
  """
  loss = m * n * (y_bytes + r_bytes)
  if not low_precision:
    return int(loss + m * n * y_bytes + k * n * (w_bytes + 2))
  return int(loss + m * n * 2 * code_bytes + m * k * (x_bytes + 2 * code_bytes)
             + k * n * (w_bytes + 2 * code_bytes))
