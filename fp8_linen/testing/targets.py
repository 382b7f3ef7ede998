"""Compile a training step for an accelerator this machine does not have, and read it.

JAX can compile for hardware it does not have. The CUDA PJRT plugin builds
*compile-only* GPU devices from a ``GpuTargetConfigProto`` (compute
capability, cores, memory, cuDNN and CUDA versions), and libtpu builds
compile-only TPU devices from a topology name. XLA then runs its whole
pipeline for that target, and the optimized program says which products run
in which precision, which collectives move which bytes, and how much memory
the step plans. This module does that for every target our users train on:

======================  ==========================================================
``h100``                one NVIDIA H100 SXM (compute capability 9.0)
``b200``                one NVIDIA B200 (compute capability 10.0, cuDNN 9.10)
``tpu-v5e``             one TPU v5e chip
``tpu-v6e``             one TPU v6e chip
``tpu7x``               one TPU7x TensorCore (each chip is 2 JAX devices)
``h100x8``              8 x H100 in one host (collectives over NVLink)
``tpu-v6e-2x2``         a 2x2 TPU v6e slice (4 chips)
======================  ==========================================================

* :func:`availability` says whether a target can compile here, and why not
  (CUDA plugin or libtpu missing, at another version than jaxlib, ``ptxas``
  missing, JAX started on another platform).
* :func:`compile_for` compiles any function for a target and returns a
  :class:`CompileReport`: every product with the dtypes it is fed
  (:mod:`fp8_linen.testing.hlo`), the low-precision ones by kind (GPU:
  cuBLASLt fp8 / s8 GEMMs, cuDNN fp8 convolutions, cuDNN block-scaled dots;
  TPU: convolutions by operand dtypes), collectives (count and bytes),
  planned memory, and a step-time estimate (:mod:`fp8_linen.testing.estimate`,
  compile only).
* :func:`make_train_step` / :func:`compile_train_step` build the step that
  proves a layer: it returns the loss, ``dL/dx`` and the gradients of all
  variables (so XLA keeps the three products of every layer: forward, dgrad,
  wgrad), its loss is ``sum(y * r)`` with a random cotangent ``r`` passed as
  an argument (a plain ``sum()`` makes the cotangent all ones, and XLA folds
  the gradient's fp8 cast away), and the variables (parameters, fp8 scales,
  amax histories) are jit arguments, never constants.
* ``python -m fp8_linen.testing.targets`` prints, per case and target, what
  the compiled step multiplies (see :func:`main`).

**What it proves.** Which kernels XLA selects for the target and what dtypes
feed them (when XLA's fp8 match fails on a GPU it *silently* upcasts the dot;
this is how that is caught), the collectives of a sharded step and the memory
it plans. **What it does not prove**: speed (nothing runs; the estimate is a
roofline over the compiled kernels), numerical results on the device, or that
a library accepts at run time a call XLA emitted at compile time.

Notes:

* The CUDA plugin only registers itself when CUDA is not an active platform
  on a machine without a driver, so the process must run with
  ``JAX_PLATFORMS=cpu`` *before JAX initializes its backends* (any first
  computation does). :func:`use_cpu_platform` does that where it still can; a
  test suite sets ``os.environ["JAX_PLATFORMS"] = "cpu"`` in its root
  ``conftest.py``.
* Without a device XLA:GPU cannot autotune, so every GEMM would become a
  Triton GEMM fusion; GPU targets compile with Triton GEMMs off
  (:data:`GPU_COMPILER_OPTIONS`) so dots go to the cuBLAS rewriter, whose fp8
  pattern match is what the counts check.
* fp8_linen picks its GEMM lowering for the backend it traces for, which is
  ``'cpu'`` here; :func:`compile_for` traces under
  ``fl.target_backend(target.platform, block_scaled=target.block_scaled_gemms)``,
  exactly the forms a user of that target gets (on the B200, block recipes
  as block-scaled GEMMs).
* libtpu logs warnings about ``TPU_ACCELERATOR_TYPE`` and worker hostnames
  when it builds a compile-only topology: harmless.
* Install: ``pip install "fp8_linen[targets]"`` (the CUDA plugin at jaxlib's
  version, ``ptxas``, and ``jax[tpu]``'s libtpu; about 1 GB installed).

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.testing import targets
  >>> sorted(targets.TARGETS)[:3]
  ['b200', 'h100', 'h100x8']
  >>> targets.use_cpu_platform()  # doctest: +SKIP
  >>> r = targets.compile_train_step(fl.QDense(256), (128, 256), target='tpu-v6e')  # doctest: +SKIP
  >>> r.classes  # doctest: +SKIP
  {'fp8': 3}
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
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
import numpy as np

from fp8_linen.core.lowering import target_backend
from fp8_linen.testing import estimate as estimate_lib
from fp8_linen.testing import hlo

__all__ = [
    "H100_SXM_TARGET_CONFIG",
    "B200_TARGET_CONFIG",
    "GPU_COMPILER_OPTIONS",
    "Target",
    "TARGETS",
    "get_target",
    "custom_gpu_target",
    "TargetUnavailable",
    "Availability",
    "use_cpu_platform",
    "plugin_installed",
    "libtpu_installed",
    "find_ptxas",
    "availability",
    "require_available",
    "target_mesh",
    "abstract_on",
    "CompileReport",
    "compile_for",
    "make_train_step",
    "train_step_inputs",
    "compile_train_step",
    "DecoderBlock",
    "Case",
    "cases",
    "compile_case",
    "check",
    "markdown_cell",
    "SINGLE_DEVICE",
    "main",
]

_GPU_CONFIG = """\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {cores}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {cc_major} minor: {cc_minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: {cudnn_minor} patch: 0 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{name}"
"""

# Our description of an H100 80GB HBM3 SXM5 (the device info of XLA's
# xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb), with the cuDNN and CUDA runtime
# versions this plugin generation needs (jax-cuda12-plugin 0.10 requires
# cuDNN >= 9.8). XLA's rewriters read the compute capability (fp8 GEMMs need
# >= 8.9; cuDNN fp8 convolutions >= 9.0) and the cuDNN/runtime versions.
H100_SXM_TARGET_CONFIG = _GPU_CONFIG.format(
    cores=132, bandwidth=3352320000000, l2=52428800, clock=1.98, memory=84978434048,
    cc_major=9, cc_minor=0, cudnn_minor=8, name="NVIDIA H100 80GB HBM3")

# An NVIDIA B200 (Blackwell, compute capability 10.0): 148 SMs, 228 KiB of
# shared memory per SM, 126.5 MiB of L2, about 180 GiB of HBM3e at 8 TB/s. XLA
# hands block-scaled dots (MXFP8 / NVFP4) to cuDNN on Blackwell only with
# cuDNN >= 9.10 (with 9.8 or 9.9 it dequantizes them to a bf16 GEMM); a
# `jax[cuda12]` install brings a newer one.
B200_TARGET_CONFIG = _GPU_CONFIG.format(
    cores=148, bandwidth=8000000000000, l2=132644864, clock=1.965, memory=191502393344,
    cc_major=10, cc_minor=0, cudnn_minor=10, name="NVIDIA B200")

GPU_COMPILER_OPTIONS: Mapping[str, Any] = {"xla_gpu_enable_triton_gemm": False}
"""Send dots to the cuBLAS(Lt) rewriter (no autotuning is possible without a device)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """An accelerator to compile for.

  Attributes:
    name: the name :func:`compile_for` takes (``'h100'``, ``'tpu-v6e'``, ...).
    platform: ``'gpu'`` or ``'tpu'``.
    description: what it is, in words.
    devices: how many JAX devices the compiled program runs on.
    topology: the topology to build (GPU: ``'1x1xN'``; TPU: libtpu's name,
      e.g. ``'v6e:2x2'``).
    chips_per_host: TPU only: the host bounds of the topology.
    gpu_config: GPU only: the ``GpuTargetConfigProto`` text.
    peaks_of: the name whose :data:`~fp8_linen.testing.estimate.PEAKS` the
      estimate uses (default: ``name``).
    block_scaled_gemms: GPU only: the target multiplies MXFP8/NVFP4 blocks
      natively (Blackwell with cuDNN >= 9.10); block recipes are traced as
      block-scaled GEMMs for it (``fl.target_backend(..., block_scaled=True)``).
  """

  name: str
  platform: str
  description: str
  devices: int = 1
  topology: str = "1x1x1"
  chips_per_host: tuple[int, int, int] = (1, 1, 1)
  gpu_config: str | None = None
  peaks_of: str | None = None
  block_scaled_gemms: bool = False

  @property
  def peaks(self) -> estimate_lib.Peaks:
    """The published peaks the estimate uses (:data:`fp8_linen.testing.estimate.PEAKS`)."""
    return estimate_lib.PEAKS[self.peaks_of or self.name]


TARGETS: dict[str, Target] = {t.name: t for t in [
    Target(name="h100", platform="gpu", description="NVIDIA H100 SXM",
           gpu_config=H100_SXM_TARGET_CONFIG),
    Target(name="b200", platform="gpu", description="NVIDIA B200",
           gpu_config=B200_TARGET_CONFIG, block_scaled_gemms=True),
    Target(name="tpu-v5e", platform="tpu", description="TPU v5e (one chip)",
           topology="v5e:1x1"),
    Target(name="tpu-v6e", platform="tpu", description="TPU v6e (one chip)",
           topology="v6e:1x1"),
    Target(name="tpu7x", platform="tpu", description="TPU7x (one TensorCore)",
           topology="tpu7x:1x1x1"),
    Target(name="h100x8", platform="gpu", description="8 x NVIDIA H100 SXM (one host)",
           devices=8, topology="1x1x8", gpu_config=H100_SXM_TARGET_CONFIG),
    Target(name="tpu-v6e-2x2", platform="tpu", description="TPU v6e 2x2 slice (4 chips)",
           devices=4, topology="v6e:2x2", chips_per_host=(2, 2, 1)),
]}
"""Every target :func:`compile_for` knows, by name."""

SINGLE_DEVICE = ("h100", "b200", "tpu-v5e", "tpu-v6e", "tpu7x")
"""The one-device targets (the CLI's default)."""

_CUSTOM: dict[str, Target] = {}


def _block_scaled_config(gpu_config: str) -> bool:
  """Whether a target config describes a GPU whose block-scaled dots XLA gives cuDNN.

  Compute capability 10 or more with cuDNN 9.10 or newer (older cuDNN: XLA
  dequantizes the blocks to a bf16 GEMM).
  """
  cc = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)", gpu_config)
  dnn = re.search(r"dnn_version_info\s*\{\s*major:\s*(\d+)\s+minor:\s*(\d+)", gpu_config)
  return bool(cc and dnn and int(cc.group(1)) >= 10
              and (int(dnn.group(1)), int(dnn.group(2))) >= (9, 10))


def custom_gpu_target(gpu_config: str) -> Target:
  """A one-device GPU target described by ``gpu_config`` (a ``GpuTargetConfigProto`` text).

  Its estimate uses the H100's peaks. It has block-scaled GEMMs when the text
  says compute capability >= 10 and cuDNN >= 9.10. The same text gives the
  same target.
  """
  for t in _CUSTOM.values():
    if t.gpu_config == gpu_config:
      return t
  t = Target(name=f"gpu-custom-{len(_CUSTOM)}", platform="gpu",
             description="a GPU described by its target config", gpu_config=gpu_config,
             peaks_of="h100", block_scaled_gemms=_block_scaled_config(gpu_config))
  _CUSTOM[t.name] = t
  return t


def get_target(target: str | Target) -> Target:
  """The :class:`Target` named ``target`` (a ``Target`` is returned as is).

  Raises:
    ValueError: for an unknown name (the message lists the known ones).
  """
  if isinstance(target, Target):
    return target
  if target in TARGETS or target in _CUSTOM:
    return TARGETS.get(target) or _CUSTOM[target]
  raise ValueError(f"target={target!r} is not a known target; known: {sorted(TARGETS)}")


class TargetUnavailable(RuntimeError):
  """A target cannot be compiled for in this process (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Availability:
  """Whether a target can compile here.

  Attributes:
    ok: True when it can.
    reason: why not (empty when ``ok``).
  """

  ok: bool
  reason: str = ""

  def __bool__(self) -> bool:
    return self.ok


# ----------------------------------------------------------------------------
# What a target needs installed.
# ----------------------------------------------------------------------------

_PLUGIN_DIST = "jax-cuda12-plugin"
_PJRT_DIST = "jax-cuda12-pjrt"
_PLUGIN_MODULE = "jax_plugins.xla_cuda12"
_GPU_HINT = ('pip install "jax-cuda12-plugin=={v}" nvidia-cuda-nvcc-cu12 '
             '(or the fp8_linen[targets] extra)')
_TPU_HINT = 'pip install "jax[tpu]=={v}" (or the fp8_linen[targets] extra)'


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def plugin_installed() -> bool:
  """Whether the ``jax-cuda12-plugin`` package is installed (nothing is imported)."""
  return _version(_PLUGIN_DIST) is not None and importlib.util.find_spec(
      _PLUGIN_MODULE) is not None


def libtpu_installed() -> bool:
  """Whether ``libtpu`` is installed (nothing is imported)."""
  return _version("libtpu") is not None


def _gpu_problem() -> str | None:
  import jaxlib  # pylint: disable=import-outside-toplevel  # jax imported it already
  want = jaxlib.__version__
  if not plugin_installed():
    return f"the CUDA PJRT plugin is not installed: {_GPU_HINT.format(v=want)}"
  for dist in (_PLUGIN_DIST, _PJRT_DIST):
    have = _version(dist)
    if have is None:
      return f"{dist} is missing: {_GPU_HINT.format(v=want)}"
    if have != want:
      return (f"{dist} {have} does not match jaxlib {want} (they must be equal): "
              + _GPU_HINT.format(v=want))
  if find_ptxas() is None:
    return ("ptxas not found (XLA runs it on the kernels it emits): pip install "
            "nvidia-cuda-nvcc-cu12, or put ptxas on PATH")
  return None


def _tpu_problem() -> str | None:
  want = jax.__version__
  have = _version("libtpu")
  if have is None:
    return f"libtpu is not installed: {_TPU_HINT.format(v=want)}"
  # jax pins the libtpu it was built against in its 'tpu' extra (e.g. libtpu==0.0.42.*).
  for req in importlib.metadata.requires("jax") or []:
    m = re.match(r"libtpu\s*==\s*([\w.]+?)(\.\*)?\s*;.*extra\s*==\s*['\"]tpu['\"]", req)
    if not m:
      continue
    pinned, wildcard = m.group(1), bool(m.group(2))
    if not (have == pinned or (wildcard and have.startswith(pinned + "."))):
      return (f"libtpu {have} is not the version jax {want} was built with "
              f"(libtpu=={pinned}{'.*' if wildcard else ''}): {_TPU_HINT.format(v=want)}")
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
  """Makes this process run JAX with ``JAX_PLATFORMS=cpu`` (needed for compile-only targets).

  If no platform was chosen (``JAX_PLATFORMS`` unset or empty when jax was
  imported), sets ``jax.config.jax_platforms = 'cpu'`` and the environment
  variable (for child processes). That is effective while JAX has not
  initialized its backends (its first computation does that);
  :func:`availability` tells when it came too late. The ``fp8_linen`` package
  imports jax, so no module of it can set the variable before that import: a
  test suite sets ``os.environ["JAX_PLATFORMS"] = "cpu"`` at the top of its
  root ``conftest.py``, a script before its first import.

  Raises:
    TargetUnavailable: if another platform was chosen (e.g.
      ``JAX_PLATFORMS=cuda``), naming the setting.
  """
  where, value = _platforms_setting()
  if value not in (None, "", "cpu"):
    raise TargetUnavailable(
        f"{where}={value!r}: compile-only targets need JAX_PLATFORMS=cpu (the CUDA plugin "
        "registers its compile-only topology only when CUDA is not an active platform on a "
        "machine without a GPU driver). Run with JAX_PLATFORMS=cpu, set before jax is "
        "imported.")
  if value in (None, ""):
    os.environ["JAX_PLATFORMS"] = "cpu"  # for child processes
    jax.config.update("jax_platforms", "cpu")


_TOPOLOGIES: dict[str, Any] = {}


def _topology(t: Target):
  topo = _TOPOLOGIES.get(t.name)
  if topo is None:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    if t.platform == "gpu":
      topo = topologies.get_topology_desc("h100", "cuda", target_config=t.gpu_config,
                                          topology=t.topology)
    else:
      # libtpu takes a machine-wide lock file on load, meant for processes that drive real
      # chips; compile-only topologies drive none, and several processes (a test suite and
      # the CLI it runs) may compile at once.
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      topo = topologies.get_topology_desc(platform="tpu", topology_name=t.topology,
                                          chip_config_name="default",
                                          chips_per_host_bounds=t.chips_per_host,
                                          num_slices=1)
    _TOPOLOGIES[t.name] = topo
  return topo


def _devices(t: Target) -> list:
  # A TPU7x chip is 2 devices (one per TensorCore): a one-device target takes the first.
  return list(_topology(t).devices)[:t.devices]


def availability(target: str | Target = "h100") -> Availability:
  """Whether :func:`compile_for` can run for ``target`` in this process, and why not.

  Checks, in order: the CUDA plugin (at jaxlib's version) and ``ptxas`` for a
  GPU target, libtpu (at the version jax pins) for a TPU target; the JAX
  platform setting is ``cpu``; the compile-only topology can be built (this
  last check initializes JAX's backends).

  Args:
    target: a target name or :class:`Target`.

  Returns:
    An :class:`Availability` (truthy when the compile can run).
  """
  t = get_target(target)
  problem = _gpu_problem() if t.platform == "gpu" else _tpu_problem()
  if problem:
    return Availability(False, problem)
  where, value = _platforms_setting()
  if value != "cpu":
    return Availability(False, f"{where}={value!r}, not 'cpu': call "
                               "fp8_linen.testing.targets.use_cpu_platform() (or set "
                               "JAX_PLATFORMS=cpu) before JAX runs its first computation")
  try:
    devices = _devices(t)
  except NotImplementedError as e:
    return Availability(False, (
        f"the {'CUDA plugin' if t.platform == 'gpu' else 'TPU runtime (libtpu)'} is "
        f"installed but not registered in this process ({e}): JAX initialized its backends "
        "before JAX_PLATFORMS=cpu was in force, and the plugin's start-up check failed "
        "without a device. Set JAX_PLATFORMS=cpu before the process's first JAX computation "
        "(e.g. at the top of the root conftest.py)"))
  except Exception as e:  # pylint: disable=broad-except  # any plugin/XLA error is the reason
    return Availability(False, f"building the compile-only {t.name} topology failed: "
                               f"{type(e).__name__}: {e}")
  if len(devices) < t.devices:
    return Availability(False, f"the {t.name} topology has {len(devices)} devices, "
                               f"{t.devices} needed")
  return Availability(True)


def require_available(target: str | Target = "h100") -> None:
  """Raises :class:`TargetUnavailable` with the reason unless :func:`availability`."""
  a = availability(target)
  if not a:
    raise TargetUnavailable(a.reason)


def target_mesh(target: str | Target, shape: Sequence[int] | None = None,
                axis_names: Sequence[str] = ("d",)):
  """A ``jax.sharding.Mesh`` of ``target``'s compile-only devices.

  Args:
    target: a target name or :class:`Target`.
    shape: the mesh shape (default: all devices on one axis).
    axis_names: one name per mesh axis.

  Raises:
    TargetUnavailable: when :func:`availability` is false.
  """
  t = get_target(target)
  require_available(t)
  devices = _devices(t)
  shape = tuple(shape) if shape is not None else (len(devices),)
  if len(shape) != len(axis_names):
    raise ValueError(f"target_mesh: shape={shape} and axis_names={tuple(axis_names)} "
                     "must have the same length")
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f"target_mesh: shape={shape} has {int(np.prod(shape))} devices; "
                     f"{t.name} has {len(devices)}")
  return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), tuple(axis_names))


def abstract_on(tree, mesh):
  """``tree`` as ``jax.ShapeDtypeStruct`` leaves on ``mesh``.

  A leaf that already carries a ``NamedSharding`` on ``mesh``'s devices keeps
  its partitioning; every other leaf is replicated. Leaves may be arrays,
  ``ShapeDtypeStruct`` or anything with ``shape`` and ``dtype``.
  """
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  def place(a):
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding) and (
        set(sharding.mesh.devices.flat) == set(mesh.devices.flat)):
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))

  return jax.tree.map(place, tree)


# ----------------------------------------------------------------------------
# The report.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompileReport(hlo.ProductCounts):
  """What XLA compiled for a target.

  The GPU counts of :class:`fp8_linen.testing.hlo.ProductCounts`
  (``fp8_gemms``, ``int8_gemms``, ``block_scaled_dots``, ...) plus:

  Attributes:
    target: the target's name.
    platform: ``'gpu'`` or ``'tpu'``.
    product_list: every :class:`~fp8_linen.testing.hlo.Product` with the
      dtypes it is fed.
    collective_list: every :class:`~fp8_linen.testing.hlo.Collective`.
    kernel_list: the top-level :class:`~fp8_linen.testing.hlo.Kernel` s (the
      estimate's input).
    hlo: the optimized HLO text (``compiled.as_text()``).
    temp_bytes: ``temp_size_in_bytes`` of ``compiled.memory_analysis()``: the
      peak of XLA's temporary buffers for the step.
    argument_bytes, output_bytes, alias_bytes: the other memory figures.
    compile_seconds: wall time of ``lower`` + ``compile``.
    compiler_options: the XLA options it was compiled with.
  """

  target: str = ""
  platform: str = ""
  product_list: tuple[hlo.Product, ...] = dataclasses.field(default=(), repr=False)
  collective_list: tuple[hlo.Collective, ...] = dataclasses.field(default=(), repr=False)
  kernel_list: tuple[hlo.Kernel, ...] = dataclasses.field(default=(), repr=False)
  hlo: str = dataclasses.field(default="", repr=False)
  temp_bytes: int = 0
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  compile_seconds: float = 0.0
  compiler_options: tuple[tuple[str, Any], ...] = ()

  @property
  def classes(self) -> dict[str, int]:
    """Products per operand class: ``{'fp8': 3}``, ``{'int8': 1, 'bf16': 2}``, ..."""
    return dict(sorted(collections.Counter(p.operand_class for p in self.product_list).items()))

  @property
  def operand_pairs(self) -> dict[tuple, int]:
    """Products per ``(lhs dtype, rhs dtype, out dtype)``."""
    return dict(sorted(collections.Counter(
        (*p.operands, p.out) for p in self.product_list).items(), key=str))

  @property
  def low_precision(self) -> int:
    """Products whose two operands are 8-bit (or 4-bit) floats or integers."""
    return sum(p.low_precision for p in self.product_list)

  @property
  def by_kind(self) -> dict[str, int]:
    """Low-precision products by what runs them.

    GPU: ``'cuBLASLt fp8'``, ``'cuBLASLt s8'``, ``'cuDNN fp8 conv'``,
    ``'cuDNN block-scaled'``, ``'Triton fp8'``; TPU: ``'MXU f8'`` /
    ``'MXU s8'`` (convolutions by operand dtypes). A low-precision product
    XLA left to a generic emitter is ``'other'``.
    """
    names = collections.Counter()
    for p in self.product_list:
      if not p.low_precision:
        continue
      cls = p.operand_class
      if self.platform == "tpu":
        names[{"fp8": "MXU f8", "int8": "MXU s8"}.get(cls, f"MXU {cls}")] += 1
      elif p.kind == "block-scaled-dot":
        names["cuDNN block-scaled"] += 1
      elif p.kind in ("cublas", "cudnn-gemm"):
        names["cuBLASLt fp8" if cls == "fp8" else "cuBLASLt s8"] += 1
      elif p.kind in ("cudnn-conv", "convolution"):
        names[f"cuDNN {cls} conv"] += 1
      elif p.kind == "triton-gemm":
        names[f"Triton {cls}"] += 1
      else:
        names["other"] += 1
    return dict(sorted(names.items()))

  def describe(self) -> str:
    """What the program multiplies, in one cell: ``'1/3: 1 MXU s8, 2 bf16'``.

    Low-precision products / all products, then the low-precision ones by
    kernel kind (:attr:`by_kind`) and the others by operand class.
    """
    parts = [f"{n} {k}" for k, n in self.by_kind.items()]
    parts += [f"{n} {c}" for c, n in self.classes.items() if c not in ("fp8", "int8", "fp4")]
    return f"{self.low_precision}/{len(self.product_list)}: " + ", ".join(parts)

  @property
  def collective_totals(self) -> dict[str, tuple[int, float]]:
    """``{kind: (count, bytes)}`` of the collectives."""
    return hlo.collective_totals(self.collective_list)

  def estimate(self, peaks: estimate_lib.Peaks | None = None) -> estimate_lib.Estimate:
    """The step-time estimate (compile only) with this target's published peaks."""
    return estimate_lib.estimate(self.kernel_list, peaks or get_target(self.target).peaks)

  def summary(self) -> str:
    """One line: low-precision products / products, by kind and class, and temp memory."""
    kinds = ", ".join(f"{k} {n}" for k, n in self.by_kind.items()) or "none"
    classes = ", ".join(f"{k} {n}" for k, n in self.classes.items())
    coll = self.collective_totals
    coll_s = ("; collectives " + ", ".join(f"{k} {n}" for k, (n, _) in coll.items())
              if coll else "")
    return (f"{self.target}: low precision {self.low_precision}/{len(self.product_list)} "
            f"products ({kinds}; by operands: {classes}){coll_s}; "
            f"temp {self.temp_bytes / 2**20:.1f} MiB")


def _traced_for(t: Target):
  """``fl.target_backend`` of what runs on ``t`` (a B200: block-scaled GEMMs)."""
  return target_backend(t.platform, block_scaled=t.block_scaled_gemms)


def compile_for(target: str | Target, fn: Callable, *args,
                compiler_options: Mapping[str, Any] | None = None,
                trace_as_target: bool = True) -> CompileReport:
  """Compiles ``jax.jit(fn)(*args)`` for ``target`` and reads what XLA chose.

  Args:
    target: a target name (see :data:`TARGETS`) or :class:`Target`.
    fn: the function to compile.
    *args: pytrees of arrays or ``ShapeDtypeStruct``. Leaves carrying a
      ``NamedSharding`` on a :func:`target_mesh` of this target keep it; the
      others are replicated.
    compiler_options: XLA options (default: :data:`GPU_COMPILER_OPTIONS` on a
      GPU, none on a TPU).
    trace_as_target: trace under ``fl.target_backend(target.platform,
      block_scaled=target.block_scaled_gemms)`` (the forms fp8_linen traces
      on that hardware).

  Returns:
    A :class:`CompileReport`.

  Raises:
    TargetUnavailable: when the target cannot compile here (the reason says
      why). Errors of XLA itself (e.g. a failed compile) propagate.
  """
  t = get_target(target)
  use_cpu_platform()
  mesh = target_mesh(t)
  default = GPU_COMPILER_OPTIONS if t.platform == "gpu" else {}
  options = dict(default if compiler_options is None else compiler_options)
  t0 = time.perf_counter()
  with _traced_for(t) if trace_as_target else contextlib.nullcontext():
    lowered = jax.jit(fn).lower(*abstract_on(args, mesh))
  compiled = lowered.compile(compiler_options=options or None)
  seconds = time.perf_counter() - t0
  return _report(t, compiled.as_text(), compiled.memory_analysis(), seconds, options)


def _report(t: Target, text: str, mem, seconds: float, options) -> CompileReport:
  module = hlo.parse(text)
  prods = hlo.products(module)
  counts = hlo.counts_of(prods, module)
  get = lambda field: int(getattr(mem, field, 0) or 0) if mem is not None else 0
  return CompileReport(
      **{f.name: getattr(counts, f.name) for f in dataclasses.fields(counts)},
      target=t.name, platform=t.platform, product_list=tuple(prods),
      collective_list=tuple(hlo.collectives(module)), kernel_list=tuple(hlo.kernels(module)),
      hlo=text, temp_bytes=get("temp_size_in_bytes"),
      argument_bytes=get("argument_size_in_bytes"), output_bytes=get("output_size_in_bytes"),
      alias_bytes=get("alias_size_in_bytes"), compile_seconds=seconds,
      compiler_options=tuple(sorted(options.items())))


# ----------------------------------------------------------------------------
# The training step that proves a layer.
# ----------------------------------------------------------------------------


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


def train_step_inputs(model, x, dtype=None, platform: str = "gpu"):
  """Abstract ``(variables, x, r)`` for :func:`make_train_step`'s step.

  Args:
    model: anything with ``init(rng, x)`` and ``apply(variables, x)``.
    x: the input: a shape tuple, an array or a ``ShapeDtypeStruct``.
    dtype: the input dtype when ``x`` is a shape (default bfloat16).
    platform: the backend to trace ``init`` for (the variables do not depend
      on it today; the forms traced do).

  Returns:
    ``(variables, x, r)`` as ``ShapeDtypeStruct`` pytrees; ``r`` has the
    output's shapes, in float32.
  """
  if isinstance(x, (tuple, list)):
    x = jax.ShapeDtypeStruct(tuple(x), dtype or jnp.bfloat16)
  else:
    x = jax.ShapeDtypeStruct(x.shape, x.dtype)
  zeros = lambda s: jnp.zeros(s.shape, s.dtype)
  with target_backend(platform):
    variables = jax.eval_shape(lambda s: model.init(jax.random.key(0), zeros(s)), x)
    y = jax.eval_shape(lambda v, s: model.apply(v, zeros(s)), variables, x)
  r = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), y)
  return variables, x, r


def compile_train_step(model, x, dtype=None, *, target: str | Target = "h100",
                       **kwargs) -> CompileReport:
  """:func:`compile_for` of :func:`make_train_step` on :func:`train_step_inputs`.

  Args:
    model: a Linen module (or :func:`fp8_linen.quantize_model` wrapper).
    x: the input (shape tuple, array or ``ShapeDtypeStruct``).
    dtype: the input dtype when ``x`` is a shape (default bfloat16).
    target: the target name or :class:`Target`.
    **kwargs: passed to :func:`compile_for` (``compiler_options``).

  Returns:
    The step's :class:`CompileReport`.
  """
  t = get_target(target)
  use_cpu_platform()
  return compile_for(t, make_train_step(model),
                     *train_step_inputs(model, x, dtype, t.platform), **kwargs)


# ----------------------------------------------------------------------------
# The cases of the CLI (and of the tests that assert them).
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
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                            qkv_features=self.qkv_features, dtype=self.dtype,
                                            deterministic=True)(h)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.gelu(nn.Dense(self.mlp, dtype=self.dtype)(h))
    return x + nn.Dense(x.shape[-1], dtype=self.dtype)(h)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """One row of the CLI: a training step (or served forward) and what it must multiply.

  Attributes:
    name: the row's name.
    what: what is compiled, in words.
    build: ``() -> (fn, args)``: the function to compile and its abstract
      arguments (built lazily: some cases run a model once to make them).
    expected: ``fn(platform) -> {operand class: products}``: the products the
      compiled program must have (see :attr:`CompileReport.classes`), or
      ``None`` where the case makes no claim on that platform.
    note: ``fn(platform) -> str``: what the row shows, where it needs saying.
    on_target: per-target overrides of ``(expected, note)`` by target name,
      where one target of a platform multiplies differently (the B200's
      block-scaled dots: block recipes are emulated on the H100).
  """

  name: str
  what: str
  build: Callable[[str], tuple]
  expected: Callable[[str], Mapping[str, int] | None]
  note: Callable[[str], str] = lambda platform: ""
  on_target: Mapping[str, tuple[Mapping[str, int] | None, str]] = dataclasses.field(
      default_factory=dict)

  def expected_on(self, target: str, platform: str) -> Mapping[str, int] | None:
    """The products the case claims on ``target`` (of ``platform``)."""
    return self.on_target[target][0] if target in self.on_target else self.expected(platform)

  def note_on(self, target: str, platform: str) -> str:
    """The row's note on ``target`` (of ``platform``)."""
    return self.on_target[target][1] if target in self.on_target else self.note(platform)


def _step_case(name, what, model_fn, x, dtype, expected, note=None, on_target=None) -> Case:
  def build(platform):
    model = model_fn()
    return make_train_step(model), train_step_inputs(model, x, dtype, platform)
  return Case(name=name, what=what, build=build, expected=expected,
              note=note or (lambda platform: ""), on_target=dict(on_target or {}))


def _nnx_step_case(name, what, recipe, expected) -> Case:
  def build(platform):
    from flax import nnx  # pylint: disable=import-outside-toplevel
    import fp8_linen.nnx as fnnx  # pylint: disable=import-outside-toplevel
    model = fnnx.Linear(256, 256, dtype=jnp.bfloat16, recipe=recipe, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x, r):
      model = nnx.merge(graphdef, state)
      loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) * r)
      value, (grads, dx) = nnx.value_and_grad(
          loss, argnums=(nnx.DiffState(0, fnnx.DIFF), 1))(model, x)
      return value, dx, nnx.as_pure(grads)

    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    return step, (nnx.as_pure(state), x, r)
  return Case(name=name, what=what, build=build, expected=expected)


def _served_case(name, what, recipe, expected, note=None, on_target=None) -> Case:
  def build(platform):
    import fp8_linen as fl  # pylint: disable=import-outside-toplevel
    model = nn.Sequential([fl.QDense(256, dtype=jnp.bfloat16, recipe=recipe), nn.relu,
                           fl.QDense(128, dtype=jnp.bfloat16, recipe=recipe)])
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    with target_backend(platform):
      v = model.init(jax.random.key(1), x)
      v = fl.merge_owg(v, jax.grad(lambda v: jnp.sum(model.apply(v, x).astype(jnp.float32)
                                                       ** 2))(v))
      served, params = fl.convert(model, v, x)
    return served.apply, (params, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return Case(name=name, what=what, build=build, expected=expected,
              note=note or (lambda platform: ""), on_target=dict(on_target or {}))


def _all(n: int, cls: str = "fp8"):
  return lambda platform: {cls: n}


def cases() -> list[Case]:
  """The cases of the CLI table, in order (each builds its step lazily)."""
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel

  bf16, d, tokens = jnp.bfloat16, 256, (128, 256)
  delayed = fl.Fp8Recipe()
  ste = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
  lsq = fl.int8_lsq()
  ste8 = dataclasses.replace(ste, grad_bits=8)
  int_fwd = lambda platform: {"int8": 1, "bf16": 2}
  dense = lambda r: (lambda: fl.QDense(d, dtype=bf16, recipe=r))
  mlp = lambda: nn.Sequential([fl.QDense(d, dtype=bf16), nn.gelu, fl.QDense(d, dtype=bf16),
                               nn.gelu, fl.QDense(d, dtype=bf16)])
  mx, nv = fl.mx_block_scaling(), fl.nvfp4()
  block_note = lambda fmt: (lambda p: f"bf16 emulation of the {fmt} blocks: no block-scaled "
                                      "GEMM on this target")
  # Blackwell multiplies the blocks itself: cuDNN block-scaled dots for the
  # forward, dgrad and wgrad.
  on_b200 = lambda cls: {"b200": ({cls: 3}, "cuDNN block-scaled dots (forward, dgrad, wgrad)")}
  # A served model runs the forward only: one block-scaled dot per layer, fed
  # the stored weight codes and the input quantized in the same blocks.
  served_b200 = lambda cls: {"b200": ({cls: 2}, "cuDNN block-scaled dots fed the stored codes")}
  general = lambda r: (lambda: fl.QDenseGeneral(features=(8, 32), dtype=bf16, recipe=r))
  einsum = lambda r: (lambda: fl.QEinsum(shape=(d, 8, 32), einsum_str="btd,dhk->bthk",
                                         dtype=bf16, recipe=r))
  tpu_fp8_note = lambda p: ("e4m3 products: MXU at the bf16 rate on v5e/v6e, fp8 rate on 7x"
                            if p == "tpu" else "")
  return [
      _step_case("qdense-delayed", "QDense, fp8 delayed scaling", dense(delayed), tokens, bf16,
                 _all(3), tpu_fp8_note),
      _step_case("qdense-current", "QDense, fp8 current scaling",
                 dense(fl.current_scaling()), tokens, bf16, _all(3), tpu_fp8_note),
      _step_case("qdense-rowwise", "QDense, fp8 row-wise scaling",
                 dense(fl.rowwise_scaling()), tokens, bf16, _all(3),
                 lambda p: "plain fp8 GEMM, row/column scales on its output"),
      _step_case("qdense-mx", "QDense, MXFP8 block scaling", dense(mx), tokens, bf16,
                 _all(3, "bf16"), block_note("MXFP8"), on_b200("fp8")),
      _step_case("qdensegeneral-mx", "QDenseGeneral (256, 8, 32), MXFP8", general(mx),
                 (4, 32, d), bf16, _all(3, "bf16"), block_note("MXFP8"), on_b200("fp8")),
      _step_case("qeinsum-mx", "QEinsum 'btd,dhk->bthk', MXFP8", einsum(mx), (4, 32, d), bf16,
                 _all(3, "bf16"), block_note("MXFP8"), on_b200("fp8")),
      _step_case("qdense-nvfp4", "QDense, NVFP4 (2-D weight tiles, Hadamard, SR)", dense(nv),
                 tokens, bf16, _all(3, "bf16"), block_note("NVFP4"), on_b200("fp4")),
      _step_case("qdensegeneral-nvfp4", "QDenseGeneral (256, 8, 32), NVFP4", general(nv),
                 (4, 32, d), bf16, _all(3, "bf16"), block_note("NVFP4"), on_b200("fp4")),
      _step_case("qeinsum-nvfp4", "QEinsum 'btd,dhk->bthk', NVFP4", einsum(nv), (4, 32, d),
                 bf16, _all(3, "bf16"), block_note("NVFP4"), on_b200("fp4")),
      _step_case("qdense-int8-ste", "QDense, int8 STE (channel weights)", dense(ste), tokens,
                 bf16, int_fwd, lambda p: "forward s8 x s8 -> s32; gradients bf16"),
      _step_case("qdense-int8-lsq", "QDense, int8 LSQ", dense(lsq), tokens, bf16, int_fwd,
                 lambda p: "forward s8 x s8 -> s32; gradients bf16"),
      _step_case("qdense-int8-grad8", "QDense, int8 STE, grad_bits=8", dense(ste8), tokens,
                 bf16, _all(3, "int8")),
      _step_case("qdensegeneral", "QDenseGeneral, kernel (256, 8, 32)", lambda: fl.QDenseGeneral(
          features=(8, 32), dtype=bf16, recipe=delayed), (4, 32, d), bf16, _all(3)),
      _step_case("qeinsum", "QEinsum 'btd,dhk->bthk'", lambda: fl.QEinsum(
          shape=(d, 8, 32), einsum_str="btd,dhk->bthk", dtype=bf16, recipe=delayed),
          (4, 32, d), bf16, _all(3)),
      _step_case("qeinsum-int8-lsq", "QEinsum 'td,dhk->thk', int8 LSQ", lambda: fl.QEinsum(
          shape=(d, 4, d // 4), einsum_str="td,dhk->thk", dtype=bf16, recipe=lsq),
          tokens, bf16, int_fwd),
      _step_case("qconv", "QConv 3x3, 64->64, fp8 delayed", lambda: fl.QConv(
          64, (3, 3), dtype=bf16, recipe=delayed), (8, 16, 16, 64), bf16, _all(3),
          lambda p: ("forward and dgrad cuDNN fp8 convolutions, wgrad one fp8 GEMM"
                     if p == "gpu" else "")),
      _step_case("qconv-int8-ste", "QConv 3x3, 64->64, int8 STE", lambda: fl.QConv(
          64, (3, 3), dtype=bf16, recipe=ste), (8, 16, 16, 64), bf16, int_fwd,
          lambda p: "forward s8 x s8 -> s32 convolution; gradients bf16"),
      _step_case("fp8activation+qdense", "Fp8Activation -> QDense", lambda: nn.Sequential(
          [fl.Fp8Activation(), fl.QDense(d, dtype=bf16, recipe=delayed)]), tokens, bf16,
          _all(3)),
      _step_case("fp8activation+dense", "Fp8Activation -> nn.Dense (bf16 GEMM)",
                 lambda: nn.Sequential([fl.Fp8Activation(), nn.Dense(d, dtype=bf16)]), tokens,
                 bf16, _all(3, "bf16"), lambda p: "the activation is stored in fp8; the GEMM "
                                                  "after it is the float layer's"),
      _step_case("mlp-3", "3 x QDense MLP", mlp, tokens, bf16, _all(9)),
      _nnx_step_case("nnx-linear", "fl.nnx.Linear, fp8 delayed", delayed, _all(3)),
      _nnx_step_case("nnx-linear-int8-lsq", "fl.nnx.Linear, int8 LSQ", lsq, int_fwd),
      _step_case("block-fp8", "bf16 pre-LN decoder block, quantize_model fp8 delayed", lambda: (
          fl.quantize_model(DecoderBlock(dtype=bf16), delayed)), (2, 64, 128), bf16, _all(24)),
      _step_case("block-int8", "the same block, int8 STE on every product", lambda: (
          fl.quantize_model(DecoderBlock(dtype=bf16), ste)), (2, 64, 128), bf16,
          lambda p: {"int8": 8, "bf16": 16}),
      _served_case("served-int8", "fl.convert of 2 x QDense, int8 LSQ: served forward", lsq,
                   _all(2, "int8")),
      _served_case("served-fp8", "fl.convert of 2 x QDense, fp8 delayed: served forward",
                   delayed, _all(2)),
      _served_case("served-mx", "fl.convert of 2 x QDense, MXFP8: served forward", mx,
                   _all(2, "bf16"), block_note("MXFP8"), served_b200("fp8")),
      _served_case("served-nvfp4", "fl.convert of 2 x QDense, NVFP4: served forward", nv,
                   _all(2, "bf16"), block_note("NVFP4"), served_b200("fp4")),
      _step_case("bf16-dense", "nn.Dense bf16 (control)", lambda: nn.Dense(d, dtype=bf16),
                 tokens, bf16, _all(3, "bf16")),
  ]


@functools.lru_cache(maxsize=None)
def compile_case(case_name: str, target: str) -> CompileReport:
  """The :class:`CompileReport` of one case on one target, compiled once per process."""
  case = {c.name: c for c in cases()}[case_name]
  t = get_target(target)
  use_cpu_platform()
  fn, args = case.build(t.platform)
  return compile_for(t, fn, *args)


def check(case: Case, report: CompileReport) -> str | None:
  """Why ``report`` does not show what ``case`` claims on its target, or None."""
  want = case.expected_on(report.target, report.platform)
  if want is None:
    return None
  if report.classes != dict(want):
    return f"expected products {dict(want)}, compiled {report.classes}"
  if report.platform == "gpu" and report.other_dots:
    return f"{report.other_dots} product(s) left to a generic emitter"
  return None


def _cell(case: Case, r: CompileReport) -> list[str]:
  kinds = ", ".join(f"{k} {n}" for k, n in r.by_kind.items()) or "-"
  classes = ", ".join(f"{k} {n}" for k, n in r.classes.items())
  problem = check(case, r)
  return [case.name, r.target, f"{r.low_precision}/{len(r.product_list)}", kinds, classes,
          f"{r.temp_bytes / 2**20:.1f}", "ok" if problem is None else "NO: " + problem,
          case.note_on(r.target, r.platform) or case.what]


def markdown_cell(case: Case, target: str) -> str:
  """One cell of the README table: :meth:`CompileReport.describe`, flagged if the claim fails."""
  r = compile_case(case.name, target)
  problem = check(case, r)
  return r.describe() + ("" if problem is None else f" (NOT AS CLAIMED: {problem})")


def _markdown(selected: Sequence[Case], names: Sequence[str]) -> int:
  print("| case | " + " | ".join(TARGETS[n].description for n in names) + " |")
  print("| --- |" + " --- |" * len(names))
  failed = False
  for case in selected:
    cells = [markdown_cell(case, n) for n in names]
    failed |= any("NOT AS CLAIMED" in c for c in cells)
    print(f"| `{case.name}` {case.what} | " + " | ".join(cells) + " |", flush=True)
  return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
  """Prints, per case and target, what the compiled step multiplies.

  Columns: low-precision products / all products; the low-precision ones by
  kernel kind; all products by operand class; planned temp memory; whether
  the case's claim holds on that target.

  Args:
    argv: ``--target NAME`` and ``--case NAME`` (repeatable; default all
      single-device targets and all cases), ``--list``, ``--json PATH`` (the
      rows as JSON), ``--markdown`` (one table, cases x targets).

  Returns:
    0; 1 if a claim does not hold; 2 if no requested target is available
    (the reasons are printed).
  """
  parser = argparse.ArgumentParser(
      prog="python -m fp8_linen.testing.targets",
      description="Compile each case's training step for accelerators this machine does not "
                  "have (no GPU or TPU needed) and print what XLA multiplies in low precision. "
                  "Proves the kernels and their input dtypes; says nothing about speed.")
  parser.add_argument("--target", action="append", default=[],
                      help=f"a target (repeatable; default: {', '.join(SINGLE_DEVICE)})")
  parser.add_argument("--case", action="append", default=[], help="a case (repeatable)")
  parser.add_argument("--list", action="store_true", help="list targets and cases, then exit")
  parser.add_argument("--json", help="also write the rows to this JSON file")
  parser.add_argument("--markdown", action="store_true",
                      help="print one markdown table, cases x targets (the README's)")
  args = parser.parse_args(argv)
  all_cases = cases()
  if args.list:
    for t in TARGETS.values():
      print(f"target {t.name:12s} {t.description}")
    for c in all_cases:
      print(f"case   {c.name:22s} {c.what}")
    return 0
  names = args.target or list(SINGLE_DEVICE)
  unknown = sorted(set(names) - set(TARGETS))
  unknown_cases = sorted(set(args.case) - {c.name for c in all_cases})
  if unknown or unknown_cases:
    parser.error(f"unknown target(s) {unknown} / case(s) {unknown_cases}; known targets "
                 f"{sorted(TARGETS)}, cases {[c.name for c in all_cases]}")
  try:
    use_cpu_platform()
  except TargetUnavailable as e:
    print(f"compile-only targets unavailable: {e}", file=sys.stderr)
    return 2
  ready = []
  for n in names:
    a = availability(n)
    if a:
      ready.append(n)
    else:
      print(f"{n}: unavailable: {a.reason}", file=sys.stderr)
  if not ready:
    return 2
  selected = [c for c in all_cases if not args.case or c.name in args.case]
  if args.markdown:
    return _markdown(selected, ready)
  header = ["case", "target", "low/all", "low precision by kernel", "by operands", "temp MiB",
            "claim", "what"]
  widths = [22, 8, 8, 34, 18, 9, 6, 0]
  print("Training step (loss, dL/dx, grads) of each case compiled for each target; "
        "low-precision products / all products.")
  print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), flush=True)
  rows, failed = [], False
  for case in selected:
    for n in ready:
      try:
        r = compile_case(case.name, n)
        row = _cell(case, r)
        failed |= not row[6].startswith("ok")
      except TargetUnavailable:
        raise
      except Exception as e:  # pylint: disable=broad-except  # a failed compile is a result
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        row, failed = [case.name, n, "FAILED", "", "", "", "NO", msg[:90]], True
      rows.append(dict(zip(header, row)))
      print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip(), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
