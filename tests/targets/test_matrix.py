"""Every case of the targets CLI compiled for every one-device target: what it multiplies.

Each case is a training step that returns the loss, dL/dx and the gradients
of all variables (or a served forward), compiled once per target for the
whole session (``cases.compile_case``): the CLI, these tests and the README
table read the same programs. What passing proves: in the program XLA builds
for that accelerator, the products' operands have the dtypes the case claims
(fp8 recipes: every product f8 x f8; integer recipes: an s8 x s8 forward and
gradients in the model's bf16, never an f32 operand), and on a GPU they run in
the library kernels named (cuBLASLt fp8 / s8 GEMMs, cuDNN fp8 convolutions).
Not speed.
"""

import pytest

from fp8_linen.testing import cases, targets

CASES = {c.name: c for c in cases.cases()}
PAIRS = [(c, t) for c in CASES for t in targets.SINGLE_DEVICE]


def compiled(require_target, case, target):
  require_target(target)
  return cases.compile_case(case, target)


@pytest.mark.parametrize("case,target", PAIRS, ids=[f"{c}-{t}" for c, t in PAIRS])
def test_case_multiplies_what_it_claims(require_target, case, target):
  report = compiled(require_target, case, target)
  assert cases.check(CASES[case], report) is None, report.summary()


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu7x"])
def test_tpu_fp8_products_take_e4m3_forward_and_e5m2_gradients(require_target, target):
  report = compiled(require_target, "qdense-delayed", target)
  pairs = sorted(p.operands for p in report.product_list)
  assert pairs == [("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"), ("f8e5m2", "f8e4m3fn")]
  assert report.by_kind == {"MXU f8": 3}


@pytest.mark.parametrize("target", targets.SINGLE_DEVICE)
@pytest.mark.parametrize("case", ["qdense-int8-ste", "qdense-int8-lsq", "qeinsum-int8-lsq",
                                  "nnx-linear-int8-lsq", "block-int8", "qconv-int8-ste"])
def test_integer_qat_of_a_bf16_model_has_no_f32_operand(require_target, case, target):
  """The integer forward is s8 x s8 -> s32; both gradient products take bf16 operands."""
  report = compiled(require_target, case, target)
  forward = [p for p in report.product_list if p.operands == ("s8", "s8")]
  # cuDNN's int8 convolution accumulates in int32 and writes float32 itself.
  assert forward and all(p.out == "s32" or p.kind == "cudnn-conv" for p in forward), \
      report.summary()
  others = [p.operands for p in report.product_list if p.operands != ("s8", "s8")]
  assert others and all(ops == ("bf16", "bf16") for ops in others), report.summary()


@pytest.mark.parametrize("target", ["h100", "b200"])
@pytest.mark.parametrize("case", ["qdense-delayed", "qdense-current", "qdense-rowwise",
                                  "qdensegeneral", "qeinsum", "nnx-linear"])
def test_gpu_fp8_layers_are_three_cublaslt_fp8_gemms(require_target, case, target):
  report = compiled(require_target, case, target)
  assert report.by_kind == {"cuBLASLt fp8": 3}, report.summary()
  assert dict(report.custom_calls) == {"__cublas$lt$matmul$f8": 3}, report.summary()


@pytest.mark.parametrize("target", ["h100", "b200"])
def test_gpu_qconv_is_two_cudnn_fp8_convolutions_and_one_fp8_gemm(require_target, target):
  report = compiled(require_target, "qconv", target)
  assert report.by_kind == {"cuBLASLt fp8": 1, "cuDNN fp8 conv": 2}, report.summary()


def test_b200_rowwise_is_a_plain_fp8_gemm_not_a_block_scaled_dot(require_target):
  """Row-wise scales multiply the GEMM's output: on Blackwell it stays a tensor-scaled fp8 GEMM."""
  report = compiled(require_target, "qdense-rowwise", "b200")
  assert report.block_scaled_dots == 0 and report.fp8_gemms == 3, report.summary()


@pytest.mark.parametrize("target", targets.SINGLE_DEVICE)
def test_the_bf16_control_has_no_low_precision_product(require_target, target):
  report = compiled(require_target, "bf16-dense", target)
  assert report.low_precision == 0 and len(report.product_list) == 3, report.summary()
