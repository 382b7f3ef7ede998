"""Test setup: the CPU platform with 8 virtual devices, and the compile-only targets.

JAX_PLATFORMS=cpu keeps the CUDA plugin and libtpu of the `targets` extra
(installed for the compile-only proofs) from trying to start a GPU or TPU
backend, and XLA reads the device-count flag when the backend starts (on first
use); both are set here, before any test touches a device.

Tests that compile for a GPU or TPU this machine does not have take the
``require_target`` fixture. They are skipped only when the package the target
needs is not installed (the CUDA plugin for GPU targets, libtpu for TPU ones:
``pip install ".[targets]"``), and never where ``FP8_LINEN_REQUIRE_TARGETS=1``
(CI sets it); any other reason a target cannot compile (wrong plugin or libtpu
version, no ``ptxas``, ``JAX_PLATFORMS`` set to another platform) fails them
with that reason.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pytest  # noqa: E402


def targets_required() -> bool:
  """Whether compile-only targets must run (never skip): CI."""
  return os.environ.get("FP8_LINEN_REQUIRE_TARGETS") == "1"


@pytest.fixture(scope="session")
def require_target():
  """``require(name) -> Target``: skips (package absent) or fails (any other reason)."""
  from fp8_linen.testing import targets  # pylint: disable=import-outside-toplevel

  try:
    targets.use_cpu_platform()
    platform_error = None
  except targets.TargetUnavailable as e:
    platform_error = str(e)

  def require(name):
    t = targets.get_target(name)
    installed = (targets.plugin_installed() if t.platform == "gpu"
                 else targets.libtpu_installed())
    if not installed and not targets_required():
      what = "jax-cuda12-plugin" if t.platform == "gpu" else "libtpu"
      pytest.skip(f"{what} is not installed: pip install the fp8_linen[targets] extra to "
                  f"compile for {t.description} without the hardware")
    if platform_error:
      pytest.fail(platform_error)
    available = targets.availability(t)
    if not available:
      pytest.fail(f"compile-only {t.name} unavailable: {available.reason}")
    return t

  return require
