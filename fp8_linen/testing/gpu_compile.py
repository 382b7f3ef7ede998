"""Compile a training step for an NVIDIA H100 without a GPU: the H100 front of :mod:`.targets`.

Everything here is :mod:`fp8_linen.testing.targets` with the target fixed to
one H100 SXM (:data:`H100_SXM_TARGET_CONFIG`), under the names the H100 proofs
were first written with: :func:`compile_for_h100`, :func:`compile_train_step`,
:func:`availability`, :class:`GpuCompileReport` (a
:class:`~fp8_linen.testing.targets.CompileReport`) and
:func:`count_products` (:func:`fp8_linen.testing.hlo.count_products`).
``python -m fp8_linen.testing.gpu_compile`` is the targets CLI for ``h100``.

Example:
  >>> from fp8_linen.testing import gpu_compile
  >>> gpu_compile.FP8_GEMM_TARGET
  '__cublas$lt$matmul$f8'
  >>> hlo = '''ENTRY %main (a: f8e4m3fn[16,16]) -> f32[16,16] {
  ...   %a = f8e4m3fn[16,16]{1,0} parameter(0)
  ...   %g = (f32[16,16]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul$f8"
  ...   ROOT %r = f32[16,16]{1,0} get-tuple-element(%g), index=0
  ... }'''
  >>> counts = gpu_compile.count_products(hlo)
  >>> counts.fp8_gemms, counts.gemms, counts.fp8_products, counts.products
  (1, 1, 1, 1)
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Sequence

from fp8_linen.core.lowering import target_backend
from fp8_linen.testing import targets
from fp8_linen.testing.hlo import FP8_GEMM_TARGET, ProductCounts, count_products
from fp8_linen.testing.targets import (H100_SXM_TARGET_CONFIG, Availability, DecoderBlock,
                                       abstract_on, find_ptxas, make_train_step,
                                       plugin_installed, train_step_inputs, use_cpu_platform)

__all__ = [
    "H100_SXM_TARGET_CONFIG",
    "FP8_GEMM_TARGET",
    "DEFAULT_COMPILER_OPTIONS",
    "GpuCompileUnavailable",
    "Availability",
    "plugin_installed",
    "find_ptxas",
    "use_cpu_platform",
    "availability",
    "require_available",
    "ProductCounts",
    "count_products",
    "GpuCompileReport",
    "h100_mesh",
    "abstract_on",
    "gpu_tracing",
    "compile_for_h100",
    "make_train_step",
    "train_step_inputs",
    "compile_train_step",
    "DecoderBlock",
    "main",
]

DEFAULT_COMPILER_OPTIONS: Mapping[str, Any] = targets.GPU_COMPILER_OPTIONS
GpuCompileUnavailable = targets.TargetUnavailable
GpuCompileReport = targets.CompileReport


def _target(target_config: str) -> targets.Target:
  """The H100 target, or a one-device GPU target described by ``target_config``."""
  if target_config == H100_SXM_TARGET_CONFIG:
    return targets.TARGETS["h100"]
  return targets.custom_gpu_target(target_config)


def availability(target_config: str = H100_SXM_TARGET_CONFIG) -> Availability:
  """Whether :func:`compile_for_h100` can run here, with the reason if not."""
  return targets.availability(_target(target_config))


def require_available(target_config: str = H100_SXM_TARGET_CONFIG) -> None:
  """Raises :class:`GpuCompileUnavailable` with the reason unless :func:`availability`."""
  targets.require_available(_target(target_config))


def h100_mesh(target_config: str = H100_SXM_TARGET_CONFIG, axis_name: str = "d"):
  """A one-device ``jax.sharding.Mesh`` of compile-only H100 devices."""
  return targets.target_mesh(_target(target_config), axis_names=(axis_name,))


def gpu_tracing():
  """Context in which fp8_linen traces the forms it would trace on a GPU (``target_backend``)."""
  return target_backend("gpu")


def compile_for_h100(fn: Callable, *args, compiler_options: Mapping[str, Any] | None = None,
                     target_config: str = H100_SXM_TARGET_CONFIG,
                     trace_as_gpu: bool = True) -> GpuCompileReport:
  """:func:`fp8_linen.testing.targets.compile_for` for one H100 SXM (or ``target_config``)."""
  return targets.compile_for(_target(target_config), fn, *args,
                             compiler_options=compiler_options, trace_as_target=trace_as_gpu)


def compile_train_step(model, x, dtype=None, **kwargs) -> GpuCompileReport:
  """:func:`fp8_linen.testing.targets.compile_train_step` for one H100 SXM.

  Args:
    model: a Linen module (or :func:`fp8_linen.quantize_model` wrapper).
    x: the input (shape tuple, array or ``ShapeDtypeStruct``).
    dtype: the input dtype when ``x`` is a shape (default bfloat16).
    **kwargs: ``compiler_options``, ``target_config``.
  """
  config = kwargs.pop("target_config", H100_SXM_TARGET_CONFIG)
  return targets.compile_train_step(model, x, dtype, target=_target(config), **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
  """The targets CLI (:func:`fp8_linen.testing.targets.main`) for the H100 only."""
  return targets.main(["--target", "h100", *(argv or [])])


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
