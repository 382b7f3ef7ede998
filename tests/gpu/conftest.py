"""Setup of the deviceless H100 compile tests (``fp8_linen.testing.gpu_compile``).

The ``h100`` fixture is the root conftest's ``require_target('h100')``: these
tests skip only when the CUDA plugin is not installed (the `targets` extra),
never where ``FP8_LINEN_REQUIRE_TARGETS=1`` (CI sets it), and fail with the
reason for anything else.
"""

import pytest

from fp8_linen.testing import gpu_compile


@pytest.fixture(scope="session")
def h100(require_target):
  require_target("h100")
  return gpu_compile
