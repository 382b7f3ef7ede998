"""Setup of the deviceless H100 compile tests (``fp8_linen.testing.targets``' ``h100``).

The ``h100`` fixture is the root conftest's ``require_target('h100')``: these
tests skip only when the CUDA plugin is not installed (the `targets` extra),
never where ``FP8_LINEN_REQUIRE_TARGETS=1`` (CI sets it), and fail with the
reason for anything else.
"""

import pytest


@pytest.fixture(scope="session")
def h100(require_target):
  """The ``h100`` :class:`~fp8_linen.testing.targets.Target`, once it can compile here."""
  return require_target("h100")
