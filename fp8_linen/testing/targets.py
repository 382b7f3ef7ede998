"""The accelerators this machine can compile for without having them, and whether it can now.

JAX can compile for hardware it does not have. The CUDA PJRT plugin builds
*compile-only* GPU devices from a ``GpuTargetConfigProto`` (compute
capability, cores, memory, cuDNN and CUDA versions), and libtpu builds
compile-only TPU devices from a topology name. This module names the targets
our users train on and builds their devices:

======================  ==========================================================
``h100``                one NVIDIA H100 SXM (compute capability 9.0)
``b200``                one NVIDIA B200 (compute capability 10.0, cuDNN 9.10)
``tpu-v5e``             one TPU v5e chip
``tpu-v6e``             one TPU v6e chip
``tpu7x``               one TPU7x TensorCore (each chip is 2 JAX devices)
``h100x8``              8 x H100 in one host (collectives over NVLink)
``tpu-v6e-2x2``         a 2x2 TPU v6e slice (4 chips)
======================  ==========================================================

* :data:`TARGETS` / :func:`get_target`: the :class:`Target` s by name
  (:func:`custom_gpu_target` for a GPU described by its own target config).
* :func:`availability` says whether a target can compile here, and why not
  (CUDA plugin or libtpu missing, at another version than jaxlib, ``ptxas``
  missing, JAX started on another platform); :func:`require_available`
  raises :class:`TargetUnavailable` with that reason.
* :func:`target_mesh`: a mesh of a target's compile-only devices.

Compiling for a target and reading the program is
:mod:`fp8_linen.testing.compile`; the cases every target is checked on,
:mod:`fp8_linen.testing.cases`; the table of them, ``python -m
fp8_linen.testing.cli``.

Notes:

* The CUDA plugin only registers itself when CUDA is not an active platform
  on a machine without a driver, so the process must run with
  ``JAX_PLATFORMS=cpu`` *before JAX initializes its backends* (any first
  computation does). :func:`use_cpu_platform` does that where it still can; a
  test suite sets ``os.environ["JAX_PLATFORMS"] = "cpu"`` in its root
  ``conftest.py``.
* libtpu logs warnings about ``TPU_ACCELERATOR_TYPE`` and worker hostnames
  when it builds a compile-only topology: harmless.
* Install: ``pip install "fp8_linen[targets]"`` (the CUDA plugin at jaxlib's
  version, ``ptxas``, and ``jax[tpu]``'s libtpu; about 1 GB installed).

Example:
  >>> from fp8_linen.testing import targets
  >>> sorted(targets.TARGETS)[:3]
  ['b200', 'h100', 'h100x8']
  >>> targets.get_target('tpu7x').description
  'TPU7x (one TensorCore)'
  >>> targets.availability('h100')  # doctest: +SKIP
  Availability(ok=True, reason='')
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

# jax is imported by the fp8_linen package before this module runs; importing it does not
# start JAX's backends, so use_cpu_platform() can still select the CPU platform.
import jax
import numpy as np

from fp8_linen.testing import estimate as estimate_lib

__all__ = [
    "H100_SXM_TARGET_CONFIG",
    "B200_TARGET_CONFIG",
    "Target",
    "TARGETS",
    "SINGLE_DEVICE",
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """An accelerator to compile for.

  Attributes:
    name: the name every function here takes (``'h100'``, ``'tpu-v6e'``,
      ...).
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
"""Every named target, by name."""

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
  """Whether ``target`` can be compiled for in this process, and why not.

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
