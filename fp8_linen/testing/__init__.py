"""Compile-only proofs: what XLA multiplies, moves and plans for accelerators this machine lacks.

One idea per module, each importing only those above it:

* :mod:`~fp8_linen.testing.hlo`: parses optimized HLO text (computations,
  instructions, their arrays and the call graph).
* :mod:`~fp8_linen.testing.hlo_products`: the GEMMs and convolutions of a
  parsed program, the dtypes that feed them and their FLOPs.
* :mod:`~fp8_linen.testing.hlo_collectives`: its collectives and the bytes
  each moves.
* :mod:`~fp8_linen.testing.hlo_kernels`: its top-level kernels with their
  FLOPs and bytes (the estimate's input).
* :mod:`~fp8_linen.testing.estimate`: a step-time estimate (compile only)
  from those kernels and published peaks.
* :mod:`~fp8_linen.testing.targets`: the targets (H100, B200, TPU v5e/v6e/7x,
  8 x H100, a 2x2 TPU v6e slice), whether each can compile here and why not,
  and meshes of their compile-only devices.
* :mod:`~fp8_linen.testing.train_step`: the step that proves a layer (loss,
  ``dL/dx`` and every gradient, a random cotangent, variables as arguments).
* :mod:`~fp8_linen.testing.compile`: ``compile_for`` / ``compile_train_step``
  and the ``CompileReport`` they return.
* :mod:`~fp8_linen.testing.passes`: the non-GEMM kernels of a step, the
  bytes each moves and what it is for, and a dense layer's minimum.
* :mod:`~fp8_linen.testing.cases`: the cases every target is checked on
  (``DecoderBlock`` among them), what each must multiply, and
  ``compile_case`` (once per process).
* :mod:`~fp8_linen.testing.cli`: ``python -m fp8_linen.testing.cli``, the
  table of every case on every target (the README's accelerator table).
* :mod:`~fp8_linen.testing.collectives`: what a sharded (FSDP) step moves.

GPU targets need the optional CUDA plugin (at jaxlib's exact version) and
``ptxas``; TPU targets libtpu: the ``fp8_linen[targets]`` extra. Submodules
are imported on first use, so ``import fp8_linen.testing`` costs nothing and
``python -m fp8_linen.testing.cli`` runs its module as ``__main__`` once.

Example:
  >>> from fp8_linen import testing
  >>> testing.hlo_products.FP8_GEMM_TARGET
  '__cublas$lt$matmul$f8'
"""

from __future__ import annotations

import importlib

__all__ = ["hlo", "hlo_products", "hlo_collectives", "hlo_kernels", "estimate", "targets",
           "train_step", "compile", "passes", "cases", "cli", "collectives"]


def __getattr__(name: str):
  if name in __all__:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
