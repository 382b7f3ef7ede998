"""Test setup: the CPU platform with 8 virtual devices.

JAX_PLATFORMS=cpu keeps the CUDA plugin of the gpu-check extra (installed for
the deviceless H100 compile) from trying to start a GPU backend, and XLA reads
the device-count flag when the backend starts (on first use); both are set
here, before any test touches a device.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
