"""Compile a training step for an NVIDIA H100 without a GPU and count its fp8 products.

JAX can compile for a GPU it does not have: the CUDA PJRT plugin offers a
*compile-only* topology described by a ``GpuTargetConfigProto`` (device info,
compute capability, cuDNN and CUDA versions). XLA:GPU then runs its whole
pipeline, including the cuBLASLt GEMM rewriter and the cuDNN convolution
rewriters, and the optimized HLO shows which products it selected. This
module wraps that recipe:

* :func:`availability` says whether the compile can run here, and why not
  (plugin missing or at another version than jaxlib, ``ptxas`` missing,
  ``JAX_PLATFORMS`` not ``cpu``, plugin not registered).
* :func:`compile_for_h100` compiles any function for one H100 SXM (our own
  copy of XLA's ``h100_sxm.txtpb``, :data:`H100_SXM_TARGET_CONFIG`) and returns a
  frozen :class:`GpuCompileReport`: the optimized HLO, the number of fp8
  cuBLASLt GEMMs (``__cublas$lt$matmul$f8``) among all GEMMs, fp8 cuDNN
  convolutions among all convolutions, Triton GEMM fusions (and those whose
  dot has fp8 operands) and ``memory_analysis()`` figures.
* :func:`make_train_step` / :func:`compile_train_step` build the step that
  proves a layer: it returns the loss, ``dL/dx`` and the gradients of all
  variables (so XLA keeps the three products of every layer: forward, dgrad,
  wgrad), its loss is ``sum(y * r)`` with a random cotangent ``r`` passed as an
  argument (a plain ``sum()`` makes the cotangent all ones, and XLA folds the
  gradient's fp8 cast away), and the variables (parameters, fp8 scales and
  amax histories) are jit arguments, never constants.
* ``python -m fp8_linen.testing.gpu_compile`` prints, per layer and recipe,
  fp8 products / all products and the temp memory of the step.

**What it proves.** For the compiled step, the inputs of the GEMMs and
convolutions are fp8 and XLA selected the cuBLASLt fp8 GEMM / cuDNN fp8
convolution kernels for them (when the pattern match fails XLA *silently*
upcasts an f8 dot to f16/bf16; this is how that is caught). It also gives the
memory XLA plans for the step. **What it does not prove**: speed (nothing runs;
no autotuning, no kernel timing), numerical results on the device, or that
cuDNN accepts at run time a graph XLA emitted at compile time.

Notes:

* The CUDA plugin only registers itself when CUDA is not an active platform
  on a machine without a driver, so the process must run with
  ``JAX_PLATFORMS=cpu`` *before JAX initializes its backends* (any first
  computation does). :func:`use_cpu_platform` does that where it still can; a
  test suite sets ``os.environ["JAX_PLATFORMS"] = "cpu"`` in its root
  ``conftest.py``.
* Without a device XLA cannot autotune, so by default every GEMM would become
  a Triton GEMM fusion; :data:`DEFAULT_COMPILER_OPTIONS` disables Triton GEMMs
  so dots go to the cuBLAS rewriter, whose fp8 pattern match is what the
  counts check (on a device XLA autotunes between the two routes). Compile
  with ``{"xla_gpu_enable_triton_gemm": True}`` to see the Triton route
  (:attr:`GpuCompileReport.fp8_triton_gemms`: fusions whose dot has fp8
  operands).
* fp8_linen picks its GEMM lowering and its fp8 encoder for the backend it
  traces for, which is ``"cpu"`` here. :func:`compile_for_h100` traces under
  ``fl.target_backend('gpu')`` (:func:`gpu_tracing`), so the default recipes
  (``gemm='auto'``) take their GPU form, exactly what a GPU user gets.
* Install: ``pip install "jax-cuda12-plugin==<jaxlib version>"
  nvidia-cuda-nvcc-cu12`` (about 225 MB; cuBLAS/cuDNN wheels are not needed).

Example:
  >>> import flax.linen as nn, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.testing import gpu_compile
  >>> gpu_compile.use_cpu_platform()  # doctest: +SKIP
  >>> report = gpu_compile.compile_train_step(
  ...     fl.QDense(256), (128, 256))  # doctest: +SKIP
  >>> report.fp8_gemms, report.gemms  # doctest: +SKIP
  (3, 3)

  The HLO counting works on any optimized HLO text:

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

import argparse
import collections
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

# jax is imported by the fp8_linen package before this module runs; importing it does not
# start JAX's backends, so use_cpu_platform() can still select the CPU platform.
import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen.core.lowering import target_backend

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
    "cli_cases",
    "main",
]

# Our copy of XLA's H100 SXM description (xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb:
# the device info of an H100 80GB HBM3 SXM5), with the cuDNN and CUDA runtime versions
# this plugin generation is built for (jax-cuda12-plugin 0.10 requires cuDNN >= 9.8).
# XLA's rewriters read the compute capability (fp8 GEMMs need >= 8.9; cuDNN fp8
# convolutions >= 9.0 or >= 8.9 with cuDNN >= 9.8) and the cuDNN/runtime versions.
H100_SXM_TARGET_CONFIG = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84978434048
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
"""The custom-call target of a cuBLASLt GEMM with fp8 operands."""

DEFAULT_COMPILER_OPTIONS: Mapping[str, Any] = {"xla_gpu_enable_triton_gemm": False}
"""Send dots to the cuBLAS(Lt) rewriter (no autotuning is possible without a device)."""

_PLUGIN_DIST = "jax-cuda12-plugin"
_PJRT_DIST = "jax-cuda12-pjrt"
_PLUGIN_MODULE = "jax_plugins.xla_cuda12"
_INSTALL_HINT = ('pip install "jax-cuda12-plugin=={v}" nvidia-cuda-nvcc-cu12 '
                 '(or the fp8_linen[gpu-check] extra)')


class GpuCompileUnavailable(RuntimeError):
  """The deviceless H100 compile cannot run in this process (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Availability:
  """Whether the deviceless H100 compile can run here.

  Attributes:
    ok: True when it can.
    reason: why not (empty when ``ok``).
  """

  ok: bool
  reason: str = ""

  def __bool__(self) -> bool:
    return self.ok


def _jaxlib_version() -> str:
  import jaxlib  # jax imports it anyway; cheap
  return jaxlib.__version__


def plugin_installed() -> bool:
  """Whether the ``jax-cuda12-plugin`` package is installed (nothing is imported)."""
  try:
    importlib.metadata.version(_PLUGIN_DIST)
  except importlib.metadata.PackageNotFoundError:
    return False
  return importlib.util.find_spec(_PLUGIN_MODULE) is not None


def _plugin_problem() -> str | None:
  """A reason the installed plugin cannot work with this jaxlib, or None."""
  want = _jaxlib_version()
  if not plugin_installed():
    return (f"the CUDA PJRT plugin is not installed: {_INSTALL_HINT.format(v=want)}")
  for dist in (_PLUGIN_DIST, _PJRT_DIST):
    try:
      have = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      return f"{dist} is missing: {_INSTALL_HINT.format(v=want)}"
    if have != want:
      return (f"{dist} {have} does not match jaxlib {want} (they must be equal): "
              + _INSTALL_HINT.format(v=want))
  return None


def find_ptxas() -> str | None:
  """The ``ptxas`` XLA will find, or None.

  XLA looks in ``--xla_gpu_cuda_data_dir`` (``XLA_FLAGS``), the
  ``nvidia-cuda-nvcc-cu12`` wheel, the CUDA install directory and ``PATH``.
  """
  candidates = []
  m = re.search(r"--xla_gpu_cuda_data_dir=(\S+)", os.environ.get("XLA_FLAGS", ""))
  if m:
    candidates.append(Path(m.group(1)) / "bin" / "ptxas")
  try:
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  except (ImportError, ValueError):
    spec = None
  for loc in (spec.submodule_search_locations or []) if spec else []:
    candidates.append(Path(loc) / "bin" / "ptxas")
  candidates.append(Path("/usr/local/cuda/bin/ptxas"))
  for c in candidates:
    if c.is_file() and os.access(c, os.X_OK):
      return str(c)
  return shutil.which("ptxas")


def _platforms_setting() -> tuple[str, str | None]:
  """``(where, value)`` of the JAX platform setting that is in force."""
  return "jax.config.jax_platforms", getattr(jax.config, "jax_platforms", None)


def use_cpu_platform() -> None:
  """Makes this process run JAX with ``JAX_PLATFORMS=cpu`` (needed for the compile).

  If no platform was chosen (``JAX_PLATFORMS`` unset or empty when jax was
  imported), sets ``jax.config.jax_platforms = 'cpu'`` and the environment
  variable (for child processes). That is effective while JAX has not
  initialized its backends (its first computation does that);
  :func:`availability` tells when it came too late. The ``fp8_linen`` package
  imports jax, so no module of it can set the variable before that import: a
  test suite sets ``os.environ["JAX_PLATFORMS"] = "cpu"`` at the top of its
  root ``conftest.py``, a script before its first import.

  Raises:
    GpuCompileUnavailable: if another platform was chosen (e.g.
      ``JAX_PLATFORMS=cuda``), naming the setting.
  """
  where, value = _platforms_setting()
  if value not in (None, "", "cpu"):
    raise GpuCompileUnavailable(
        f"{where}={value!r}: the deviceless H100 compile needs JAX_PLATFORMS=cpu (the CUDA "
        "plugin registers its compile-only topology only when CUDA is not an active "
        "platform on a machine without a GPU driver). Run with JAX_PLATFORMS=cpu, set before "
        "jax is imported.")
  if value in (None, ""):
    os.environ["JAX_PLATFORMS"] = "cpu"  # for child processes
    jax.config.update("jax_platforms", "cpu")


_TOPOLOGIES: dict[str, Any] = {}


def _topology(target_config: str):
  topo = _TOPOLOGIES.get(target_config)
  if topo is None:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc("h100", "cuda", target_config=target_config,
                                        topology="1x1x1")
    _TOPOLOGIES[target_config] = topo
  return topo


def availability(target_config: str = H100_SXM_TARGET_CONFIG) -> Availability:
  """Whether :func:`compile_for_h100` can run in this process, with the reason if not.

  Checks, in order: the plugin is installed at jaxlib's version; ``ptxas`` is
  found; the JAX platform setting is ``cpu``; the plugin's compile-only CUDA
  topology can be built (this last check initializes JAX's backends).

  Args:
    target_config: the ``GpuTargetConfigProto`` text to build the topology for.

  Returns:
    An :class:`Availability` (truthy when the compile can run).
  """
  problem = _plugin_problem()
  if problem:
    return Availability(False, problem)
  if find_ptxas() is None:
    return Availability(False, "ptxas not found (XLA runs it on the kernels it emits): pip "
                               "install nvidia-cuda-nvcc-cu12, or put ptxas on PATH")
  where, value = _platforms_setting()
  if value != "cpu":
    return Availability(False, f"{where}={value!r}, not 'cpu': call "
                               "fp8_linen.testing.gpu_compile.use_cpu_platform() (or set "
                               "JAX_PLATFORMS=cpu) before JAX runs its first computation")
  try:
    _topology(target_config)
  except NotImplementedError as e:
    return Availability(False, (
        "the CUDA plugin is installed but not registered in this process (" + str(e) + "): "
        "JAX initialized its backends before JAX_PLATFORMS=cpu was in force, and the "
        "plugin's start-up CUDA check failed without a GPU driver. Set JAX_PLATFORMS=cpu "
        "before the process's first JAX computation (e.g. at the top of the root "
        "conftest.py)"))
  except Exception as e:  # pylint: disable=broad-except  # any plugin/XLA error is the reason
    return Availability(False, f"building the compile-only H100 topology failed: "
                               f"{type(e).__name__}: {e}")
  return Availability(True)


def require_available(target_config: str = H100_SXM_TARGET_CONFIG) -> None:
  """Raises :class:`GpuCompileUnavailable` with the reason unless :func:`availability`."""
  a = availability(target_config)
  if not a:
    raise GpuCompileUnavailable(a.reason)


# ----------------------------------------------------------------------------
# Reading the optimized HLO.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProductCounts:
  """The products (GEMMs, convolutions) of an optimized XLA:GPU HLO module.

  Attributes:
    fp8_gemms: cuBLASLt GEMMs with fp8 operands (``__cublas$lt$matmul$f8``) and
      cuDNN GEMM fusions whose dot has fp8 operands.
    gemms: all library GEMMs (``__cublas$gemm``, ``__cublas$lt$matmul*``, cuDNN
      GEMM fusions).
    fp8_convs: cuDNN convolutions whose input and filter are fp8 (in practice
      ``__cudnn$convForwardGraph`` custom calls).
    convs: all convolutions (``__cudnn$conv*`` custom calls and any plain
      ``convolution`` left in the module).
    fp8_triton_gemms: Triton GEMM fusions whose dot has fp8 operands.
    triton_gemms: all Triton GEMM fusions.
    other_dots: dots lowered neither to a library call nor to a Triton GEMM
      (e.g. tiny ones emitted inside loop fusions).
    int8_gemms: library or fusion GEMMs whose two operands are ``s8`` (the
      integer products of integer QAT and serving, ``s8 x s8 -> s32``).
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
  custom_calls: tuple[tuple[str, int], ...] = ()

  @property
  def fp8_products(self) -> int:
    """fp8 GEMMs + fp8 convolutions + fp8 Triton GEMMs."""
    return self.fp8_gemms + self.fp8_convs + self.fp8_triton_gemms

  @property
  def products(self) -> int:
    """All GEMMs, convolutions, Triton GEMMs and other dots."""
    return self.gemms + self.convs + self.triton_gemms + self.other_dots


_COMP_START = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_TYPED_OPERAND = re.compile(r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+)?%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r'"kind":"([^"]+)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")


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


def _parse_instruction(rest: str):
  """``(element_type, opcode, [(inline_type, operand_name)], attributes_text)``."""
  rest = rest.strip()
  if rest.startswith("("):
    end = _matching(rest, 0)
    etype, rest = "tuple", rest[end + 1:].strip()
  else:
    shape, _, rest = rest.partition(" ")
    etype = re.match(r"\w*", shape).group(0)
  m = re.match(r"([\w\-]+)\(", rest)
  if not m:
    return etype, "", [], rest
  open_at = m.end() - 1
  close_at = _matching(rest, open_at)
  operands = [(t, n) for t, n in _TYPED_OPERAND.findall(rest[open_at + 1:close_at])]
  return etype, m.group(1), operands, rest[close_at + 1:]


def _parse_hlo(text: str):
  """``{computation: [(name, etype, opcode, operands, attrs)]}``, plus types per computation."""
  comps: dict[str, list] = {}
  types: dict[str, dict[str, str]] = {}
  current = None
  for line in text.splitlines():
    if current is None:
      m = _COMP_START.match(line)
      if m and not line.startswith(" "):
        current = m.group(1)
        comps[current], types[current] = [], {}
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    etype, opcode, operands, attrs = _parse_instruction(m.group(2))
    comps[current].append((m.group(1), etype, opcode, operands, attrs))
    types[current][m.group(1)] = etype
  return comps, types


def _is_f8(etype: str | None) -> bool:
  return bool(etype) and etype.startswith("f8") and etype != "f8e8m0fnu"


def _all_s8(etypes) -> bool:
  etypes = list(etypes)
  return len(etypes) == 2 and all(t == "s8" for t in etypes)


def _operand_types(operands, table) -> list:
  return [t or table.get(n) for t, n in operands]


def _find_dot(comp, comps, types, seen=None):
  """The operand types of the first dot in ``comp`` or its nested fusions, or None."""
  seen = seen if seen is not None else set()
  if comp in seen or comp not in comps:
    return None
  seen.add(comp)
  for name, etype, opcode, operands, attrs in comps[comp]:
    if opcode in ("dot", "scaled-dot"):
      return _operand_types(operands, types[comp])
  for name, etype, opcode, operands, attrs in comps[comp]:
    if opcode == "fusion":
      called = _CALLS.search(attrs)
      if called:
        found = _find_dot(called.group(1), comps, types, seen)
        if found is not None:
          return found
  return None


def _reachable(roots, comps):
  out, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c in out or c not in comps:
      continue
    out.add(c)
    for _, _, _, _, attrs in comps[c]:
      todo.extend(_CALLS.findall(attrs))
  return out


def count_products(hlo_text: str) -> ProductCounts:
  """Counts the GEMMs and convolutions of an optimized XLA:GPU HLO module.

  Args:
    hlo_text: ``compiled.as_text()`` of a module compiled for a CUDA GPU.

  Returns:
    A :class:`ProductCounts`.
  """
  comps, types = _parse_hlo(hlo_text)
  c = collections.Counter()
  targets = collections.Counter()
  gemm_fusion_comps = []
  for comp, instrs in comps.items():
    table = types[comp]
    for name, etype, opcode, operands, attrs in instrs:
      if opcode == "custom-call":
        m = _TARGET.search(attrs)
        target = m.group(1) if m else ""
        targets[target] += 1
        if target.startswith("__cublas$gemm") or target.startswith("__cublas$lt$matmul"):
          c["gemms"] += 1
          c["fp8_gemms"] += target == FP8_GEMM_TARGET
          c["int8_gemms"] += _all_s8(_operand_types(operands[:2], table))
        elif target.startswith("__cudnn$conv"):
          c["convs"] += 1
          c["fp8_convs"] += all(map(_is_f8, _operand_types(operands[:2], table)))
      elif opcode == "convolution":
        c["convs"] += 1
        c["fp8_convs"] += all(map(_is_f8, _operand_types(operands[:2], table)))
      elif opcode == "fusion":
        kind = _KIND.search(attrs)
        kind = kind.group(1) if kind else ""
        called = _CALLS.search(attrs)
        if not called or not ("triton" in kind or kind == "__cudnn$fusion"):
          continue
        dot = _find_dot(called.group(1), comps, types)
        if dot is None:
          continue
        gemm_fusion_comps.append(called.group(1))
        fp8 = len(dot) >= 2 and all(map(_is_f8, dot[:2]))
        c["int8_gemms"] += len(dot) >= 2 and _all_s8(dot[:2])
        key = "gemms" if kind == "__cudnn$fusion" else "triton_gemms"
        c[key] += 1
        c["fp8_" + key] += fp8
  fused = _reachable(gemm_fusion_comps, comps)
  for comp, instrs in comps.items():
    if comp in fused:
      continue
    c["other_dots"] += sum(1 for i in instrs if i[2] in ("dot", "scaled-dot"))
  return ProductCounts(
      fp8_gemms=c["fp8_gemms"], gemms=c["gemms"], fp8_convs=c["fp8_convs"], convs=c["convs"],
      fp8_triton_gemms=c["fp8_triton_gemms"], triton_gemms=c["triton_gemms"],
      other_dots=c["other_dots"], int8_gemms=c["int8_gemms"], custom_calls=tuple(sorted(targets.items())))


@dataclasses.dataclass(frozen=True)
class GpuCompileReport(ProductCounts):
  """What XLA compiled for the H100: product counts (see :class:`ProductCounts`) and memory.

  Attributes:
    hlo: the optimized HLO text (``compiled.as_text()``).
    temp_bytes: ``temp_size_in_bytes`` of ``compiled.memory_analysis()``: the
      peak of XLA's temporary buffers for the step.
    argument_bytes: ``argument_size_in_bytes``.
    output_bytes: ``output_size_in_bytes``.
    alias_bytes: ``alias_size_in_bytes`` (outputs that reuse argument buffers).
    compile_seconds: wall time of ``lower`` + ``compile``.
    compiler_options: the XLA options the step was compiled with.
  """

  hlo: str = dataclasses.field(default="", repr=False)
  temp_bytes: int = 0
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  compile_seconds: float = 0.0
  compiler_options: tuple[tuple[str, Any], ...] = ()

  def summary(self) -> str:
    """One line: fp8 products / products, per kind, and temp memory."""
    return (f"fp8 {self.fp8_products}/{self.products} products (GEMMs {self.fp8_gemms}/"
            f"{self.gemms}, convs {self.fp8_convs}/{self.convs}, Triton "
            f"{self.fp8_triton_gemms}/{self.triton_gemms}, other dots {self.other_dots}; "
            f"int8 GEMMs {self.int8_gemms}); "
            f"temp {self.temp_bytes / 2**20:.1f} MiB")


# ----------------------------------------------------------------------------
# Compiling.
# ----------------------------------------------------------------------------


def h100_mesh(target_config: str = H100_SXM_TARGET_CONFIG, axis_name: str = "d"):
  """A one-device ``jax.sharding.Mesh`` of compile-only H100 devices.

  Raises:
    GpuCompileUnavailable: when :func:`availability` is false.
  """
  require_available(target_config)
  from jax.experimental import topologies
  return topologies.make_mesh(_topology(target_config), (1,), (axis_name,))


def abstract_on(tree, mesh):
  """``tree`` as ``jax.ShapeDtypeStruct`` leaves replicated on ``mesh``.

  Leaves may be arrays, ``ShapeDtypeStruct`` or anything with ``shape`` and
  ``dtype``.
  """
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  sharding = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def gpu_tracing():
  """Context in which fp8_linen traces the forms it would trace on a GPU.

  Under a compile-only topology the default backend is still ``'cpu'``, so
  without this the compiled H100 graph would contain the CPU forms (bf16
  upcast GEMMs, the integer fp8 encoder), which XLA:GPU rewrites differently.
  It is :func:`fp8_linen.target_backend` with ``'gpu'``.
  """
  return target_backend("gpu")


def compile_for_h100(fn: Callable, *args, compiler_options: Mapping[str, Any] | None = None,
                     target_config: str = H100_SXM_TARGET_CONFIG,
                     trace_as_gpu: bool = True) -> GpuCompileReport:
  """Compiles ``jax.jit(fn)(*args)`` for one H100 SXM and reads what XLA chose.

  Args:
    fn: the function to compile.
    *args: pytrees of arrays or ``ShapeDtypeStruct`` (shape and dtype are
      used; they become replicated on the compile-only device).
    compiler_options: XLA options (default :data:`DEFAULT_COMPILER_OPTIONS`).
    target_config: the ``GpuTargetConfigProto`` text of the GPU.
    trace_as_gpu: trace under :func:`gpu_tracing` (fp8_linen's GPU forms).

  Returns:
    A :class:`GpuCompileReport`.

  Raises:
    GpuCompileUnavailable: when the compile cannot run here (the reason says
      why). Errors of XLA itself (e.g. a failed compile) propagate.
  """
  use_cpu_platform()
  mesh = h100_mesh(target_config)
  options = dict(DEFAULT_COMPILER_OPTIONS if compiler_options is None else compiler_options)
  t0 = time.perf_counter()
  with gpu_tracing() if trace_as_gpu else contextlib.nullcontext():
    lowered = jax.jit(fn).lower(*abstract_on(args, mesh))
  compiled = lowered.compile(compiler_options=options)
  seconds = time.perf_counter() - t0
  hlo = compiled.as_text()
  mem = compiled.memory_analysis()
  get = lambda field: int(getattr(mem, field, 0) or 0) if mem is not None else 0
  counts = count_products(hlo)
  return GpuCompileReport(**{f.name: getattr(counts, f.name) for f in dataclasses.fields(counts)},
                          hlo=hlo, temp_bytes=get("temp_size_in_bytes"),
                          argument_bytes=get("argument_size_in_bytes"),
                          output_bytes=get("output_size_in_bytes"),
                          alias_bytes=get("alias_size_in_bytes"), compile_seconds=seconds,
                          compiler_options=tuple(sorted(options.items())))


def make_train_step(model) -> Callable:
  """The step that proves a model's products: ``step(variables, x, r) -> (loss, dx, grads)``.

  ``loss = sum(y * r)`` over the output leaves with ``r`` a random cotangent
  passed as an argument (not foldable by XLA); ``dx = dL/dx`` keeps the
  forward and dgrad products alive, ``grads`` (all variable collections: the
  params' gradients and the new fp8 state) the wgrad. For a non-floating ``x``
  (e.g. tokens) ``dx`` is None.

  Args:
    model: anything with ``apply(variables, x)`` (a Linen module or
      :func:`fp8_linen.quantize_model`'s wrapper).

  Returns:
    The (unjitted) step function.
  """
  def loss_fn(variables, x, r):
    y = model.apply(variables, x)
    return sum(jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32))
               for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(r)))

  def step(variables, x, r):
    if jnp.issubdtype(jnp.result_type(x), jnp.floating):
      loss, (grads, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(variables, x, r)
    else:
      (loss, grads), dx = jax.value_and_grad(loss_fn)(variables, x, r), None
    return loss, dx, grads

  return step


def train_step_inputs(model, x, dtype=None):
  """Abstract ``(variables, x, r)`` for :func:`make_train_step`'s step.

  Args:
    model: anything with ``init(rng, x)`` and ``apply(variables, x)``.
    x: the input: a shape tuple, an array or a ``ShapeDtypeStruct``.
    dtype: the input dtype when ``x`` is a shape (default bfloat16).

  Returns:
    ``(variables, x, r)`` as ``ShapeDtypeStruct`` pytrees; ``r`` has the
    output's shapes, in float32.
  """
  if isinstance(x, (tuple, list)):
    x = jax.ShapeDtypeStruct(tuple(x), dtype or jnp.bfloat16)
  else:
    x = jax.ShapeDtypeStruct(x.shape, x.dtype)
  zeros = lambda s: jnp.zeros(s.shape, s.dtype)
  with gpu_tracing():
    variables = jax.eval_shape(lambda s: model.init(jax.random.key(0), zeros(s)), x)
    y = jax.eval_shape(lambda v, s: model.apply(v, zeros(s)), variables, x)
  r = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), y)
  return variables, x, r


def compile_train_step(model, x, dtype=None, **kwargs) -> GpuCompileReport:
  """:func:`compile_for_h100` of :func:`make_train_step` on :func:`train_step_inputs`.

  Args:
    model: a Linen module (or :func:`fp8_linen.quantize_model` wrapper).
    x: the input (shape tuple, array or ``ShapeDtypeStruct``).
    dtype: the input dtype when ``x`` is a shape (default bfloat16).
    **kwargs: passed to :func:`compile_for_h100` (``compiler_options``,
      ``target_config``).

  Returns:
    The step's :class:`GpuCompileReport`.
  """
  use_cpu_platform()
  return compile_for_h100(make_train_step(model), *train_step_inputs(model, x, dtype), **kwargs)


# ----------------------------------------------------------------------------
# The CLI: one row per layer and recipe.
# ----------------------------------------------------------------------------


class DecoderBlock(nn.Module):
  """An unmodified pre-LN decoder block: self-attention and a GELU MLP, both residual.

  Attributes:
    num_heads: attention heads.
    qkv_features: width of the query/key/value projections.
    mlp: hidden width of the MLP.
    dtype: compute dtype (None: float32).
  """

  num_heads: int = 8
  qkv_features: int = 128
  mlp: int = 512
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.SelfAttention(num_heads=self.num_heads, qkv_features=self.qkv_features,
                             dtype=self.dtype, deterministic=True)(h)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.gelu(nn.Dense(self.mlp, dtype=self.dtype)(h))
    return x + nn.Dense(x.shape[-1], dtype=self.dtype)(h)


@dataclasses.dataclass(frozen=True)
class _Case:
  name: str
  what: str
  build: Callable[[], tuple]  # () -> (model, x shape, x dtype)
  expected: str  # what the row should show


def cli_cases() -> list[_Case]:
  """The rows of the CLI table: (name, description, builder, expectation)."""
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel

  fp8 = lambda r: r  # the default gemm='auto' takes the GPU form under gpu_tracing()
  delayed = fl.Fp8Recipe()
  bf16 = jnp.bfloat16
  d, tokens = 256, (128, 256)
  block = DecoderBlock
  mlp = lambda: nn.Sequential([fl.QDense(d, recipe=delayed), nn.gelu,
                               fl.QDense(d, recipe=delayed), nn.gelu,
                               fl.QDense(d, recipe=delayed)])
  return [
      _Case("qdense-delayed", "QDense, delayed scaling", lambda: (
          fl.QDense(d, recipe=delayed), tokens, bf16), "3/3"),
      _Case("qdense-current", "QDense, current scaling", lambda: (
          fl.QDense(d, recipe=fp8(fl.current_scaling())), tokens, bf16), "3/3"),
      _Case("qdense-rowwise", "QDense, row-wise scaling", lambda: (
          fl.QDense(d, recipe=fp8(fl.rowwise_scaling())), tokens, bf16), "3/3"),
      _Case("qdensegeneral-3d", "QDenseGeneral, kernel (256, 8, 32)", lambda: (
          fl.QDenseGeneral(features=(8, 32), recipe=delayed), (4, 64, d), bf16), "3/3"),
      _Case("qeinsum", "QEinsum 'btd,dhk->bthk'", lambda: (
          fl.QEinsum(shape=(d, 8, 32), einsum_str="btd,dhk->bthk", recipe=delayed),
          (4, 64, d), bf16), "3/3"),
      _Case("qconv", "QConv 3x3, 64->64 channels", lambda: (
          fl.QConv(64, (3, 3), recipe=delayed), (8, 16, 16, 64), bf16), "3/3"),
      _Case("dense+fp8dotgeneral", "nn.Dense(dot_general_cls=fl.Fp8DotGeneral)", lambda: (
          nn.Dense(d, dot_general_cls=lambda: fl.Fp8DotGeneral(recipe=delayed)), tokens, bf16),
          "3/3"),
      _Case("fp8activation+qdense", "Fp8Activation -> QDense", lambda: (
          nn.Sequential([fl.Fp8Activation(), fl.QDense(d, recipe=delayed)]), tokens, bf16),
          "3/3"),
      _Case("fp8activation+dense", "Fp8Activation -> nn.Dense (bf16 GEMM)", lambda: (
          nn.Sequential([fl.Fp8Activation(), nn.Dense(d, dtype=bf16)]), tokens, bf16),
          "0/3 (the activation is stored in fp8, the GEMM is bf16)"),
      _Case("mlp-3", "3 x QDense MLP", lambda: (mlp(), tokens, bf16), "9/9"),
      _Case("block-bf16", "pre-LN decoder block via quantize_model, bf16", lambda: (
          fl.quantize_model(block(dtype=bf16), delayed), (2, 64, 128), bf16), "24/24"),
      _Case("block-f32", "pre-LN decoder block via quantize_model, float32", lambda: (
          fl.quantize_model(block(dtype=None), delayed), (2, 64, 128), jnp.float32), "24/24"),
      _Case("mx-block", "QDense, MX block scaling (bf16 emulation)", lambda: (
          fl.QDense(d, recipe=fl.mx_block_scaling()), tokens, bf16),
          "0/3 (emulated: blocks dequantized to bf16)"),
      _Case("bf16-dense", "nn.Dense bf16 (control)", lambda: (
          nn.Dense(d, dtype=bf16), tokens, bf16), "0/3"),
  ]


def _row(case: _Case, triton: bool) -> list[str]:
  model, shape, dtype = case.build()
  try:
    r = compile_train_step(model, shape, dtype)
  except GpuCompileUnavailable:
    raise
  except Exception as e:  # pylint: disable=broad-except  # a failed compile is a result
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return [case.name, "FAILED", "", "", "", "", case.expected, msg[:90]]
  tri = ""
  if triton:
    try:
      t = compile_train_step(model, shape, dtype,
                             compiler_options={"xla_gpu_enable_triton_gemm": True})
      tri = f"{t.fp8_triton_gemms}/{t.triton_gemms}"
    except Exception as e:  # pylint: disable=broad-except
      tri = "FAILED"
  return [case.name, f"{r.fp8_products}/{r.products}", f"{r.fp8_gemms}/{r.gemms}",
          f"{r.fp8_convs}/{r.convs}", tri, f"{r.temp_bytes / 2**20:.1f}", case.expected,
          case.what]


def main(argv: Sequence[str] | None = None) -> int:
  """Prints fp8 products / all products per layer and recipe, compiled for an H100.

  Args:
    argv: command-line arguments (``--only NAME`` (repeatable), ``--no-triton``,
      ``--list``).

  Returns:
    0, or 2 when the compile is not available here (the reason is printed).
  """
  parser = argparse.ArgumentParser(
      prog="python -m fp8_linen.testing.gpu_compile",
      description="Compile each layer's training step for an H100 (no GPU needed) and count "
                  "its fp8 products. Proves the GEMM/conv inputs are fp8 and cuBLASLt/cuDNN "
                  "fp8 kernels are selected; says nothing about speed.")
  parser.add_argument("--only", action="append", default=[], help="run only this case")
  parser.add_argument("--no-triton", action="store_true",
                      help="skip the second compile that counts the Triton GEMM route")
  parser.add_argument("--list", action="store_true", help="list the cases and exit")
  args = parser.parse_args(argv)
  try:
    use_cpu_platform()
  except GpuCompileUnavailable as e:
    print(f"deviceless H100 compile unavailable: {e}", file=sys.stderr)
    return 2
  cases = cli_cases()
  if args.list:
    for c in cases:
      print(f"{c.name:22s} {c.what}")
    return 0
  unknown = sorted(set(args.only) - {c.name for c in cases})
  if unknown:
    parser.error(f"unknown case(s) {unknown}; known: {[c.name for c in cases]}")
  a = availability()
  if not a:
    print(f"deviceless H100 compile unavailable: {a.reason}", file=sys.stderr)
    return 2
  header = ["case", "fp8/all", "GEMMs", "convs", "Triton", "temp MiB", "expected", "what"]
  widths = [22, 8, 7, 6, 7, 9, 10, 0]
  print("Training step (loss, dL/dx, grads) of each layer compiled for an H100 SXM; "
        "fp8 products / all products.")
  print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), flush=True)
  for case in cases:
    if args.only and case.name not in args.only:
      continue
    row = _row(case, triton=not args.no_triton)
    print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip(), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
