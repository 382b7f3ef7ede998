"""A step-time estimate from a compiled program and a target's published peaks.

**An estimate (compile only), not a measurement.** For each top-level kernel
of the optimized program (:func:`fp8_linen.testing.hlo_kernels.kernels`) the time is
the larger of its FLOPs at the peak rate of its operand class (bf16, fp8,
int8, fp4, f32) and its bytes at the HBM bandwidth; the step is the sum over
kernels plus a fixed per-kernel floor (launch and pipeline fill, which the
roofline leaves out); on a TPU the arithmetic XLA leaves on one-element
arrays in scalar memory runs on the TensorCore's scalar unit
(:func:`~fp8_linen.testing.hlo_kernels.is_scalar_unit`) and costs a much
smaller floor of its own. A ``conditional`` counts its cheapest branch (a step
runs one; delayed scaling's first-step branch runs once). Collectives are not included (see
:func:`fp8_linen.testing.hlo_collectives.collectives`). It ignores caches, overlap,
fusion inside library kernels and partial-tile waste, so it is a lower bound
of the kind that ranks recipes, not a prediction of wall time.

The peaks (:data:`PEAKS`) are dense (no sparsity) figures per JAX device, with
the source next to each. Where a target has no native mode for an operand
class, that class runs at the rate XLA's own TPU cost model gives it
(``estimated_cycles`` in the compiled program's backend config, per kernel):
on TPU v5e and v6e an ``f8e4m3fn`` product costs what a bf16 one does (their
MXUs take e5m2 and int8 natively, not e4m3fn), on TPU7x an int8 product costs
what a bf16 one does (its MXU has fp8, no int8 mode), and f32 operands at
DEFAULT precision cost a bf16 pass on v5e/v6e and about 1.8 on TPU7x.

Example:
  >>> from fp8_linen.testing import estimate, hlo_kernels
  >>> k = hlo_kernels.Kernel("gemm", "custom-call", (("bf16", 2 * 8192 ** 3),),
  ...                        2 * 2 * 8192 ** 2, 2 * 8192 ** 2)
  >>> round(estimate.estimate([k], estimate.PEAKS["h100"]).seconds * 1e3, 2)  # ms
  1.11
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping

from fp8_linen.testing import hlo_kernels

__all__ = ["Peaks", "PEAKS", "KernelTime", "Estimate", "estimate"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peaks:
  """Published peak rates of one JAX device (dense, no sparsity).

  Attributes:
    flops: FLOP/s per operand class (``'bf16'``, ``'fp8'``, ``'int8'``,
      ``'fp4'``, ``'f32'``). A class without a native mode is given the rate
      it really runs at (see the module docstring).
    hbm: HBM bandwidth, bytes/s.
    kernel_floor: seconds every kernel costs at least on top of its roofline
      time (launch and pipeline fill).
    source: where the figures come from.
    scalar_floor: seconds a scalar-unit instruction costs (a TPU's; None: such
      an instruction is a kernel like any other).
  """

  flops: Mapping[str, float]
  hbm: float
  kernel_floor: float
  source: str
  scalar_floor: float | None = None

  def rate(self, operand_class: str) -> float:
    return self.flops.get(operand_class) or self.flops["bf16"]


_NVIDIA_H100 = ("NVIDIA H100 Tensor Core GPU datasheet, SXM5 (dense = half the sparse "
                "figures): BF16 989, FP8 1979, INT8 1979 TOPS, TF32 495 TFLOP/s; HBM3 "
                "3.35 TB/s")
# The H200 SXM is the H100's Hopper chip (same SMs and clocks, so the same tensor
# peaks) with more and faster memory; its peaks serve a measurement on a real
# H200 (benchmarks/bench_gpu.py). There is no compile-only H200 target: its
# programs are the H100's.
_NVIDIA_H200 = ("NVIDIA H200 Tensor Core GPU datasheet, SXM (dense = half the sparse "
                "figures): BF16 989, FP8 1979, INT8 1979 TOPS, TF32 495 TFLOP/s (the H100 "
                "SXM's); HBM3e 4.8 TB/s")
_NVIDIA_B200 = ("NVIDIA HGX/DGX B200 datasheet, per GPU, dense: BF16 2.25, FP8 and INT8 4.5, "
                "FP4 9 PFLOP/s, TF32 1.1 PFLOP/s; HBM3e 8 TB/s")
_JAX_TPU = ("JAX Pallas 'TPU hardware reference' (docs.jax.dev/en/latest/pallas/tpu/"
            "hardware.html; jax 0.10.2) and Cloud TPU docs, per JAX device")
_GPU_FLOOR = 2e-6   # a kernel launch plus its tail on a busy stream
_TPU_FLOOR = 1e-6   # one TPU program step (no host launch)
# A scalar-unit instruction of a TPU: a few scalar instructions, each bundle issuing in one
# cycle and a scalar-memory load taking 4 (measured on a TPU v4 at 1050 MHz:
# ayaka14732.github.io/pallas-tpu-tutorial, chapter 1), so about 10 cycles: an assumption,
# 100 times below a vector kernel's floor.
_TPU_SCALAR_FLOOR = 1e-8

PEAKS: dict[str, Peaks] = {
    "h100": Peaks(flops={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12, "f32": 494.5e12},
                  hbm=3.35e12, kernel_floor=_GPU_FLOOR, source=_NVIDIA_H100),
    "h200": Peaks(flops={"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12, "f32": 494.5e12},
                  hbm=4.8e12, kernel_floor=_GPU_FLOOR, source=_NVIDIA_H200),
    "b200": Peaks(flops={"bf16": 2.25e15, "fp8": 4.5e15, "int8": 4.5e15, "fp4": 9e15,
                         "f32": 1.1e15},
                  hbm=8e12, kernel_floor=_GPU_FLOOR, source=_NVIDIA_B200),
    # v5e: no fp8 mode: e4m3fn products run at the bf16 rate (XLA's cycles agree).
    "tpu-v5e": Peaks(flops={"bf16": 197e12, "fp8": 197e12, "int8": 394e12, "f32": 197e12},
                     hbm=819e9, kernel_floor=_TPU_FLOOR, scalar_floor=_TPU_SCALAR_FLOOR,
                     source=_JAX_TPU + ": v5e BF16 197, INT8 394 TOPS, no FP8; HBM 819 GB/s"),
    # v6e: the table's FP8 peak equals BF16's.
    "tpu-v6e": Peaks(flops={"bf16": 918e12, "fp8": 918e12, "int8": 1836e12, "f32": 918e12},
                     hbm=1640e9, kernel_floor=_TPU_FLOOR, scalar_floor=_TPU_SCALAR_FLOOR,
                     source=_JAX_TPU + ": v6e BF16 918, FP8 918 (= BF16), INT8 1836 TOPS; "
                                       "HBM 1640 GB/s"),
    # TPU7x: 2 TensorCores per chip, each a JAX device; no int8 mode.
    "tpu7x": Peaks(flops={"bf16": 1153.5e12, "fp8": 2307e12, "int8": 1153.5e12,
                          "f32": 640e12},
                   hbm=3.7e12, kernel_floor=_TPU_FLOOR, scalar_floor=_TPU_SCALAR_FLOOR,
                   source=_JAX_TPU + ": TPU7x per chip BF16 2307, FP8 4614 TFLOP/s, no INT8; "
                                     "HBM 7.4 TB/s; halved per device (2 per chip)"),
}
PEAKS["h100x8"] = PEAKS["h100"]
PEAKS["tpu-v6e-2x2"] = PEAKS["tpu-v6e"]


@dataclasses.dataclass(frozen=True)
class KernelTime:
  """One kernel's estimated time and what bounds it (``'compute'``, ``'memory'``)."""

  kernel: hlo_kernels.Kernel
  seconds: float
  bound: str


@dataclasses.dataclass(frozen=True)
class Estimate:
  """An estimated step time (compile only) and where it goes.

  Attributes:
    seconds: the estimated step time.
    product_seconds: time of the kernels that run products (GEMMs, convolutions).
    low_precision_seconds: time of the kernels whose products are all 8- or
      4-bit (fp8, int8, fp4).
    other_bytes: bytes read and written by the kernels without products
      (amax reductions, casts, transposes, element-wise ops).
    flops: total FLOPs per operand class.
    kernels: every kernel's :class:`KernelTime`.
    peaks: the :class:`Peaks` used.
  """

  seconds: float
  product_seconds: float
  low_precision_seconds: float
  other_bytes: float
  flops: Mapping[str, int]
  kernels: tuple[KernelTime, ...]
  peaks: Peaks

  @property
  def low_precision_share(self) -> float:
    """Share of the step the low-precision product kernels take."""
    return self.low_precision_seconds / self.seconds if self.seconds else 0.0


def estimate(kernels: Iterable[hlo_kernels.Kernel], peaks: Peaks) -> Estimate:
  """Estimates a step's time from its kernels (an estimate, compile only).

  Args:
    kernels: the program's top-level kernels (:func:`fp8_linen.testing.hlo_kernels.kernels`).
    peaks: the target's :class:`Peaks`.

  Returns:
    An :class:`Estimate`.
  """
  times = []
  # Sums per (conditional, branch); None: the kernels every step runs.
  parts: dict = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, collections.Counter()])
  for k in kernels:
    compute = sum(f / peaks.rate(c) for c, f in k.flops)
    memory = (k.bytes_read + k.bytes_written) / peaks.hbm
    floor = peaks.scalar_floor if k.scalar and peaks.scalar_floor is not None else \
        peaks.kernel_floor
    t = (max(compute, memory) + floor) * k.count
    times.append(KernelTime(k, t, "compute" if compute >= memory else "memory"))
    acc = parts[k.branch]
    acc[0] += t
    for c, f in k.flops:
      acc[4][c] += f * k.count
    if k.is_product:
      acc[1] += t
      if all(c in ("fp8", "int8", "fp4") for c, _ in k.flops):
        acc[2] += t
    else:
      acc[3] += (k.bytes_read + k.bytes_written) * k.count
  # A conditional runs one branch per step: count its cheapest (delayed
  # scaling's first-step branch, which takes the scale from this step's
  # amax, runs once; every later step takes the other).
  keep = hlo_kernels.every_step_branches((b, acc[0]) for b, acc in parts.items())
  chosen = [acc for b, acc in parts.items() if b in keep]
  total, prod, low, other = (sum(a[i] for a in chosen) for i in range(4))
  flops = sum((a[4] for a in chosen), collections.Counter())
  return Estimate(total, prod, low, other, dict(flops), tuple(times), peaks)
