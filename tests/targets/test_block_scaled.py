"""MXFP8 and NVFP4 compiled for Blackwell: every product of a layer's step is a block-scaled dot.

Compiled without the hardware (see ``fp8_linen.testing.targets``): the B200
target is traced as a GPU with block-scaled GEMMs, and XLA hands each
``scaled_matmul`` to cuDNN's ``__cudnn$blockScaledDot``. The step returns
the loss, dL/dx and the gradients, so the forward, dgrad and wgrad products
are all there: 3 of 3 per layer, fed fp8 (MXFP8) or e2m1 (NVFP4) codes. On
the H100 the same recipes are the bf16 emulation (no block-scaled GEMM).
"""

import jax.numpy as jnp
import pytest

import fp8_linen as fl
from fp8_linen.testing import cases, hlo_products, targets
from fp8_linen.testing.compile import compile_for, compile_train_step

LAYERS = ["qdense", "qdensegeneral", "qeinsum"]
FORMATS = {"mx": ("f8e4m3fn", "fp8"), "nvfp4": ("f4e2m1fn", "fp4")}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.xdist_group("b200")  # reads cases.compile_case(..., "b200")
def test_b200_runs_forward_dgrad_and_wgrad_as_block_scaled_dots(require_target, layer, fmt):
  require_target("b200")
  report = cases.compile_case(f"{layer}-{fmt}", "b200")
  dtype, cls = FORMATS[fmt]
  assert report.by_kind == {"cuDNN block-scaled": 3}, report.summary()
  # Besides the three dots, only the Pallas (Triton) kernels that quantize the
  # operands: one per operand for MXFP8, two for NVFP4 (amaxes, then codes).
  kernels = {"mx": 3, "nvfp4": 6}[fmt]
  assert dict(report.custom_calls) == {hlo_products.BLOCK_SCALED_DOT_TARGET: 3,
                                       "__gpu$xla.gpu.triton": kernels}, report.summary()
  assert [p.operands for p in report.product_list] == [(dtype, dtype)] * 3
  assert report.classes == {cls: 3}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.xdist_group("h100")  # reads cases.compile_case(..., "h100")
def test_h100_emulates_the_blocks_in_bf16(require_target, layer, fmt):
  require_target("h100")
  report = cases.compile_case(f"{layer}-{fmt}", "h100")
  assert report.block_scaled_dots == 0 and report.low_precision == 0, report.summary()
  assert [p.operands for p in report.product_list] == [("bf16", "bf16")] * 3


def test_a_blackwell_with_an_older_cudnn_is_traced_as_emulation(require_target):
  """XLA gives block-scaled dots to cuDNN only from 9.10: a target that says 9.8 is not asked."""
  require_target("b200")
  old = targets.B200_TARGET_CONFIG.replace("minor: 10 patch: 0", "minor: 8 patch: 0")
  t = targets.custom_gpu_target(old)
  assert not t.block_scaled_gemms and targets.get_target("b200").block_scaled_gemms
  report = compile_train_step(fl.QDense(256, dtype=jnp.bfloat16, recipe=fl.nvfp4()),
                                      (128, 256), target=t)
  assert report.block_scaled_dots == 0 and report.classes == {"bf16": 3}, report.summary()


@pytest.mark.parametrize("recipe", [fl.mx_block_scaling(), fl.nvfp4()], ids=["mx", "nvfp4"])
def test_b200_nnx_linear_is_three_block_scaled_dots(require_target, recipe):
  require_target("b200")
  case = cases._nnx_step_case("nnx", "", recipe, None)  # pylint: disable=protected-access
  fn, args = case.build("gpu")
  report = compile_for("b200", fn, *args)
  assert report.by_kind == {"cuDNN block-scaled": 3}, report.summary()


def test_b200_decoder_block_projections_block_scaled_attention_math_bf16(
    require_target):
  """NVFP4 on the projections by rule; the attention math stays in the model's bf16."""
  require_target("b200")
  block = cases.DecoderBlock(dtype=jnp.bfloat16)
  model = fl.quantize_model(block, fl.nvfp4(), rules=fl.projection_rules())
  report = compile_train_step(model, (2, 64, 128), target="b200")
  # 6 projections (query, key, value, out, 2 MLP) x 3; q.k and p.v x 3 stay bf16.
  assert report.classes == {"fp4": 18, "bf16": 6}, report.summary()
  assert report.block_scaled_dots == 18


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.xdist_group("b200")  # reads cases.compile_case(..., "b200")
def test_b200_served_forward_is_one_block_scaled_dot_per_layer_fed_the_stored_codes(
    require_target, fmt):
  """fl.convert of 2 x QDense: the forward only, each layer a cuDNN block-scaled dot.

  The weight operand is the stored e4m3 / e2m1 codes (a parameter of the
  served program, transposed to the dot's (N, K) but never dequantized), the
  input is quantized in the forward's blocks.
  """
  require_target("b200")
  report = cases.compile_case(f"served-{fmt}", "b200")
  dtype, cls = FORMATS[fmt]
  assert report.by_kind == {"cuDNN block-scaled": 2}, report.summary()
  assert dict(report.custom_calls) == {hlo_products.BLOCK_SCALED_DOT_TARGET: 2}, report.summary()
  assert [p.operands for p in report.product_list] == [(dtype, dtype)] * 2
  assert report.classes == {cls: 2}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.xdist_group("h100")  # reads cases.compile_case(..., "h100")
def test_h100_served_forward_emulates_the_blocks_in_bf16(require_target, fmt):
  require_target("h100")
  report = cases.compile_case(f"served-{fmt}", "h100")
  assert report.block_scaled_dots == 0 and report.classes == {"bf16": 2}, report.summary()


def _low_precision_types(text: str) -> set[str]:
  """The narrow float types some instruction of an optimized HLO module produces."""
  from fp8_linen.testing import hlo  # pylint: disable=import-outside-toplevel
  narrow = {"f8e4m3fn", "f8e5m2", "f4e2m1fn", "f8e8m0fnu"}
  return {a.dtype for insts in hlo.parse(text).computations.values() for i in insts
          for a in i.result if a.dtype in narrow}


@pytest.mark.parametrize("target", ["h100", "b200"])
@pytest.mark.xdist_group("h100")
def test_the_jnp_block_quantization_still_rounds_after_xla_gpu(require_target, target):
  """XLA:GPU drops a cast to a narrow float followed by a cast back (excess precision).

  Fake quantization written as ``q.astype(f32)`` compiled to no rounding at all
  there: NVFP4's emulation (H100) ran in float, and on both GPUs NVFP4's
  codes were divided by the unrounded block scale, not the e4m3 one stored
  beside them (an H200 run of bench_kernels_gpu.py found it: the jnp codes
  differed from the Pallas kernel's). Codes and scales are now read through
  their bits (block_numerics.code_values), which XLA cannot fold away.
  """
  from fp8_linen.core import block_numerics as bn  # pylint: disable=import-outside-toplevel
  require_target(target)
  g = jnp.float32(1e-3)
  x = jnp.linspace(-1.0, 1.0, 64 * 64, dtype=jnp.float32).reshape(64, 64)
  nv = lambda t, **kw: bn.block_quantize(t, 16, jnp.float4_e2m1fn, tensor_scale=g, **kw)
  cases_ = {
      # Only float32 comes out: any rounding left is in the program's body.
      "nvfp4 fake quant": (lambda t: bn.block_dequantize(*nv(t), 16, tensor_scale=g),
                           {"f4e2m1fn", "f8e4m3fn"}),
      "nvfp4 4/6 fake quant": (lambda t: bn.block_dequantize(*nv(t, four_over_six=True), 16,
                                                             tensor_scale=g),
                               {"f4e2m1fn", "f8e4m3fn"}),
      # What the codes are divided by: the e4m3-rounded scale.
      "nvfp4 codes' divisor": (lambda t: bn.e2m1_block(t.reshape(64, 4, 16),
                                                       bn.block_amax(t.reshape(64, 4, 16), 2),
                                                       g)[2], {"f8e4m3fn"}),
      "mxfp8 fake quant": (lambda t: bn.block_dequantize(*bn.block_quantize(
          t, 32, jnp.float8_e4m3fn), 32), {"f8e4m3fn"}),
  }
  for name, (fn, want) in cases_.items():
    report = compile_for(target, fn, x)
    assert want <= _low_precision_types(report.hlo), (name, _low_precision_types(report.hlo))


def _activation_step():
  """Fp8Activation's e4m3 value and e5m2 gradient go on to any op, not to an fp8 GEMM."""
  import jax  # pylint: disable=import-outside-toplevel
  x = jnp.linspace(-3.0, 3.0, 64 * 64, dtype=jnp.float32).reshape(64, 64)
  act = fl.Fp8Activation()
  v = act.init(jax.random.key(0), x)
  step = lambda v, x: jax.grad(lambda v, x: jnp.sum(jnp.tanh(act.apply(v, x)) ** 2),
                               argnums=(0, 1))(v, x)
  return step, (v, x), {"f8e4m3fn", "f8e5m2"}


def _weight_only_forward():
  """Fp8WeightOnly's QAT weight feeds a bf16 GEMM."""
  import jax  # pylint: disable=import-outside-toplevel
  x = jnp.linspace(-3.0, 3.0, 64 * 64, dtype=jnp.float32).reshape(64, 64).astype(jnp.bfloat16)
  layer = fl.QDense(64, dtype=jnp.bfloat16, recipe=fl.Fp8WeightOnly())
  v = layer.init(jax.random.key(0), x)
  return (lambda v, x: layer.apply(v, x)), (v, x), {"f8e4m3fn"}


def _calibration_error():
  """An MSE range search measures the fp8 rounding error (folded away: clipping only)."""
  from fp8_linen.core import calibration  # pylint: disable=import-outside-toplevel
  qdq = calibration.fp8_qdq(fl.ScalingConfig())
  x = jnp.linspace(-3.0, 3.0, 4096, dtype=jnp.float32)
  return (lambda x: calibration.qdq_error(x, -2.0, 2.0, qdq)), (x,), {"f8e4m3fn"}


@pytest.mark.parametrize("case", [_activation_step, _weight_only_forward, _calibration_error],
                         ids=["fp8_activation", "fp8_weight_only_qat", "fp8_calibration"])
@pytest.mark.xdist_group("h100")
def test_per_tensor_fake_quantization_still_rounds_after_xla_gpu(require_target, case):
  """Read with a plain cast, each compiled to no fp8 at all for the H100 (the layer or search ran in float)."""
  require_target("h100")
  fn, args, want = case()
  report = compile_for("h100", fn, *args)
  assert want <= _low_precision_types(report.hlo), report.summary()
