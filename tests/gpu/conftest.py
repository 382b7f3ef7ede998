"""Setup of the deviceless H100 compile tests (``fp8_linen.testing.gpu_compile``).

The CUDA PJRT plugin registers its compile-only topology only if JAX starts
its backends with ``JAX_PLATFORMS=cpu`` (on a machine without a GPU driver its
start-up check fails otherwise). JAX reads the variable when it is imported
and the plugin reads ``jax.config.jax_platforms`` when the backends start
(the first computation), so this file sets both: the variable in case jax is
not imported yet, the config (``use_cpu_platform``) in case it is. That is in
time as long as no test module collected before this directory ran a JAX
computation at import time; the root ``conftest.py`` setting
``JAX_PLATFORMS=cpu`` at its top makes it independent of collection order.

These tests are skipped only when the plugin is not installed (it is part of
the ``test`` extra on Linux), and never where ``FP8_LINEN_REQUIRE_GPU_CHECK=1``
(CI sets it); any other reason the compile cannot run (wrong plugin version,
no ``ptxas``, plugin not registered, ``JAX_PLATFORMS`` set to another platform)
fails them with that reason.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from fp8_linen.testing import gpu_compile

SKIP_REASON = ("jax-cuda12-plugin is not installed (pip install the fp8_linen[gpu-check] extra "
               "to compile training steps for an H100 without a GPU)")

_PLATFORM_ERROR = None
if gpu_compile.plugin_installed():
  try:
    gpu_compile.use_cpu_platform()
  except gpu_compile.GpuCompileUnavailable as e:
    _PLATFORM_ERROR = str(e)


def pytest_collection_modifyitems(config, items):
  """Skips this directory's compile tests (those using ``h100``) when the plugin is absent."""
  del config
  if gpu_compile.plugin_installed() or os.environ.get("FP8_LINEN_REQUIRE_GPU_CHECK") == "1":
    return
  here = os.path.dirname(os.path.abspath(__file__))
  skip = pytest.mark.skip(reason=SKIP_REASON)
  for item in items:
    if (os.path.abspath(str(item.path)).startswith(here + os.sep)
        and "h100" in getattr(item, "fixturenames", ())):
      item.add_marker(skip)


@pytest.fixture(scope="session")
def h100():
  """Fails (never skips) with the reason when the deviceless compile cannot run."""
  if _PLATFORM_ERROR:
    pytest.fail(_PLATFORM_ERROR)
  available = gpu_compile.availability()
  if not available:
    pytest.fail(f"deviceless H100 compile unavailable: {available.reason}")
  return gpu_compile
