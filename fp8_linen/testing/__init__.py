"""Testing helpers that need no accelerator.

:mod:`fp8_linen.testing.gpu_compile` compiles a training step for an NVIDIA
H100 on a machine without a GPU (a compile-only CUDA topology) and counts the
fp8 cuBLASLt GEMMs and cuDNN convolutions XLA selected. It needs the optional
``jax-cuda12-plugin`` (at jaxlib's exact version) and ``ptxas``
(``nvidia-cuda-nvcc-cu12``); see that module.

The submodule is imported lazily (``python -m fp8_linen.testing.gpu_compile``
must be able to run it as ``__main__``).

Example:
  >>> from fp8_linen import testing
  >>> testing.gpu_compile.FP8_GEMM_TARGET
  '__cublas$lt$matmul$f8'
"""

from __future__ import annotations

import importlib

__all__ = ["gpu_compile"]


def __getattr__(name: str):
  if name in __all__:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
