"""Test setup: 8 virtual CPU devices for the data-parallel tests.

XLA reads the flag when the backend starts (on first use), so it is set here,
before any test touches a device.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
