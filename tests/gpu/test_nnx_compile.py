"""An fl.nnx.Linear train step compiled for an H100 runs its three GEMMs in fp8.

The step is the NNX one users write: differentiate w.r.t. the params and the
QuantState (``fl.nnx.DIFF``) and return the loss, dL/dx and the gradients
(which carry the new fp8 state): the ``nnx-linear`` case of
``fp8_linen.testing.cases`` (a 256-wide bf16 ``fl.nnx.Linear``, fp8 delayed
scaling), compiled once per run without a GPU.
"""

import pytest

from fp8_linen.testing import cases

# With -n, in the process that compiles the H100 cases (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("h100")


def test_nnx_linear_three_fp8_gemms(h100):
  report = cases.compile_case("nnx-linear", h100.name)
  assert report.hlo.count("__cublas$lt$matmul$f8") == 3, report.summary()
  assert (report.fp8_gemms, report.gemms) == (3, 3), report.summary()
  assert report.other_dots == 0, report.summary()
  # The float32 kernel's gradient GEMM writes bfloat16, as the Linen layer's does.
  assert sorted(p.out for p in report.product_list) == ["bf16", "bf16", "bf16"]
