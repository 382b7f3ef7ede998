"""fp8 GEMMs and convolutions of training steps compiled for an H100, without a GPU.

Every step returns the loss, dL/dx and the gradients of all variables, so each
quantized layer has three products: forward, dgrad and wgrad. Its loss is
``sum(y * r)`` with a random cotangent ``r`` passed as an argument, and the
variables (params, fp8 scales and amax histories) are jit arguments
(``fp8_linen.testing.train_step``); the step is traced as a GPU traces it.
A step that is one of ``fp8_linen.testing.cases`` is read from
``cases.compile_case`` (compiled once per run, shared with tests/targets);
the others are compiled here.

What passing proves: XLA:GPU selected cuBLASLt fp8 GEMMs
(``__cublas$lt$matmul$f8``) / cuDNN fp8 convolutions for those products, i.e.
their inputs are fp8. Not speed.
"""

import collections
import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fp8_linen as fl
from fp8_linen.testing import cases
from fp8_linen.testing.compile import compile_train_step

# The default gemm='auto': compile_train_step traces for a GPU (fl.target_backend('gpu')),
# so these are exactly the recipes a GPU user gets.
DELAYED = fl.Fp8Recipe()
CURRENT = fl.current_scaling()
ROWWISE = fl.rowwise_scaling()
D = 256
TOKENS = (128, D)

# With -n, in the process that compiles the H100 cases (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("h100")


@pytest.fixture(autouse=True)
def _needs_h100(h100):
  """Every test here needs the deviceless compile (fails with the reason if absent)."""
  del h100


def compile_step(model, x=TOKENS, dtype=jnp.bfloat16, **kw):
  return compile_train_step(model, x, dtype, target="h100", **kw)


def case_step(name):
  """The H100 program of the case ``name`` (a bf16 model; see ``fp8_linen.testing.cases``)."""
  return cases.compile_case(name, "h100")


def assert_all_fp8(report, products):
  """``products`` products, every one an fp8 GEMM/conv, none left to another route."""
  assert (report.fp8_products, report.products) == (products, products), report.summary()
  assert report.other_dots == 0, report.summary()


# ----------------------------------------------------------------------------
# One layer: 3 of 3 products in fp8.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
def test_qdense_three_fp8_gemms(recipe):
  r = case_step(f"qdense-{recipe}")
  assert (r.fp8_gemms, r.gemms) == (3, 3), r.summary()
  assert_all_fp8(r, 3)
  if recipe != "rowwise":  # row-wise scales every GEMM's float32 output in a pass anyway
    assert_products_write(r, {"bf16": 3})


def assert_products_write(report, dtypes):
  """The products' output dtypes, counted: a bfloat16 layer's GEMMs write bfloat16.

  The weight's gradient too, over float32 parameters: an optimizer update in
  the same step fuses its cast to float32 and reads half the bytes of a
  float32 GEMM output, and the wider output also made the GPU's first compile
  slower (docs/accelerators.md, "The weight gradient's dtype").
  """
  outs = dict(collections.Counter(p.out for p in report.product_list))
  assert outs == dtypes, (outs, report.summary())


def test_qdensegeneral_3d_kernel():
  r = case_step("qdensegeneral")  # kernel (256, 8, 32)
  assert (r.fp8_gemms, r.gemms) == (3, 3), r.summary()
  assert_all_fp8(r, 3)


def test_qeinsum():
  r = case_step("qeinsum")  # 'btd,dhk->bthk'
  assert_all_fp8(r, 3)


def test_flax_dense_with_fp8_dot_general():
  layer = nn.Dense(D, dot_general_cls=functools.partial(fl.Fp8DotGeneral, recipe=DELAYED))
  r = compile_step(layer)
  assert_all_fp8(r, 3)


def test_fp8_activation_around_a_dense():
  model = nn.Sequential([fl.Fp8Activation(), fl.QDense(D, recipe=DELAYED), fl.Fp8Activation()])
  r = compile_step(model)
  assert_all_fp8(r, 3)


@pytest.mark.parametrize("depth,case", [(1, "qdense-delayed"), (3, "mlp-3")])
def test_mlp_fp8_gemms_scale_with_depth(depth, case):
  assert_all_fp8(case_step(case), 3 * depth)  # QDense layers with a gelu between


def test_bf16_dense_control_has_no_fp8():
  r = case_step("bf16-dense")  # nn.Dense(256, dtype=bfloat16)
  assert r.fp8_products == 0, r.summary()
  assert r.gemms == 3, r.summary()


def test_mx_block_scaling_is_an_emulation():
  """MX block scaling is emulated: fp8 blocks are dequantized to bf16 and multiplied there.

  No XLA backend has a block-scaled fp8 GEMM for it, so its three GEMMs are
  bf16 GEMMs on exactly dequantized operands: 0 fp8 products is the correct
  figure (the memory win is real, the fp8-GEMM speed-up is not).
  """
  r = case_step("qdense-mx")
  assert (r.fp8_products, r.gemms) == (0, 3), r.summary()


def test_triton_route_counts_fp8_dots():
  r = compile_step(fl.QDense(D, recipe=DELAYED),
                   compiler_options={"xla_gpu_enable_triton_gemm": True})
  assert (r.fp8_triton_gemms, r.triton_gemms, r.gemms) == (3, 3, 0), r.summary()


def test_memory_figures():
  r = case_step("qdense-delayed")
  assert r.temp_bytes > 0 and r.argument_bytes > 0 and r.output_bytes > 0, r
  # The parameters' gradients, dL/dx and the new fp8 state are outputs.
  assert r.output_bytes >= D * D * 4 + TOKENS[0] * D * 2, r


# ----------------------------------------------------------------------------
# Convolutions.
# ----------------------------------------------------------------------------


def test_qconv_forward_dgrad_and_wgrad_are_fp8():
  """QConv's forward, input-gradient and kernel-gradient products are all fp8.

  Forward and dgrad must be cuDNN fp8 convolutions. XLA:GPU's cuDNN fp8 graph
  rewrite only matches *forward* convolutions and XLA always classifies a
  kernel-gradient convolution as backward-filter, so the wgrad may instead be
  fp8 cuBLASLt GEMM(s); either way no product of the step may run in
  f32/bf16. (Today: 1 of 3, the backward convolutions get dequantized f32
  operands.)
  """
  r = case_step("qconv")  # QConv(64, (3, 3)) on (8, 16, 16, 64)
  assert r.fp8_convs == r.convs, f"not every convolution is fp8: {r.summary()}"
  assert r.fp8_convs >= 2, f"forward + dgrad fp8 convolutions expected: {r.summary()}"
  assert r.fp8_gemms == r.gemms and r.other_dots == 0, r.summary()
  assert r.fp8_products == r.products >= 3, r.summary()


@pytest.mark.parametrize("target", ["h100", "b200"])
@pytest.mark.parametrize("name", ["qdense-delayed", "qdensegeneral", "qeinsum", "qconv"])
def test_steady_branch_multiplies_what_the_default_step_does(name, target, require_target):
  """``fl.split_first_step``'s steady branch: casts' codes pass barriers there
  (on the H100 every operand's, a weight's flattened; on the B200 a weight's;
  a convolution kernel's none), and every product stays what the default
  step runs, all fp8, convolutions in cuDNN."""
  from fp8_linen.testing import compile as compile_lib  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing import train_step  # pylint: disable=import-outside-toplevel
  require_target(target)
  fn, args = {c.name: c for c in cases.cases()}[name].build("gpu")
  with train_step.steady_branch():
    r = compile_lib.compile_for(target, fn, *args)
    with fl.target_backend("gpu", block_scaled=target == "b200"):
      barriers = str(jax.make_jaxpr(fn)(*args)).count("optimization_barrier")
  default = cases.compile_case(name, target)
  # H100: one per operand (input, weight, gradient); B200: the weight's. A
  # convolution's kernel keeps its own cast.
  want = {"h100": 3, "b200": 1}[target] - (name == "qconv")
  assert barriers == want, barriers
  assert_all_fp8(r, default.products)
  assert (r.fp8_convs, r.convs) == (default.fp8_convs, default.convs), r.summary()
  assert (r.fp8_gemms, r.gemms) == (default.fp8_gemms, default.gemms), r.summary()


# ----------------------------------------------------------------------------
# An unmodified model through quantize_model.
# ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, None], ids=["bfloat16", "float32"])
def test_decoder_block_through_quantize_model(dtype):
  """Pre-LN block (SelfAttention(8 heads) + GELU MLP): every product fp8.

  8 products (query, key, value, out projections, the two attention einsums,
  two MLP layers) x 3 = 24. float32 fails today: XLA reports "A cycle is
  detected ... get-tuple-element(%cublas-gemm...), index=1".
  """
  if dtype == jnp.bfloat16:
    r = case_step("block-fp8")  # this block in bfloat16 through quantize_model
    assert_products_write(r, {"bf16": 24})
  else:
    block = cases.DecoderBlock(num_heads=8, qkv_features=128, mlp=512, dtype=dtype)
    r = compile_step(fl.quantize_model(block, DELAYED), (2, 64, 128), jnp.float32)
  assert_all_fp8(r, 24)


class _MLPBlock(nn.Module):
  """An unmodified two-layer MLP block (residual), as model code writes it."""

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(nn.Dense, dtype=jnp.bfloat16)
    return x + dense(D, name="down")(nn.gelu(dense(2 * D, name="up")(x)))


class _RematBlocks(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = nn.remat(_MLPBlock)()(x)
    return x


class _ScanBody(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return _MLPBlock()(x), None


class _ScannedBlocks(nn.Module):
  @nn.compact
  def __call__(self, x):
    layers = nn.scan(nn.remat(_ScanBody), variable_axes={True: 0}, split_rngs={"params": True},
                     length=3)
    return layers()(x, None)[0]


def test_grad_through_remat_of_quantize_model():
  """Two rematerialized blocks of two Dense layers through quantize_model: all 14 GEMMs fp8.

  4 projections x 3 (forward, dgrad, wgrad) = 12, plus the backward's
  recomputation of each block's ``up`` forward (remat; ``down``'s output is
  not needed to differentiate the block) = 14, every one an fp8 GEMM.
  """
  r = compile_step(fl.quantize_model(_RematBlocks(), DELAYED))
  assert_all_fp8(r, 14)


def test_grad_through_scan_of_quantize_model():
  """Three scanned, rematerialized blocks through quantize_model: every GEMM fp8.

  The HLO holds each loop body once: the forward body's 2 projections, and the
  backward body's recomputed ``up`` forward plus dgrad and wgrad of both
  projections (1 + 4): 7 products per layer, all fp8 (3 per Dense plus the
  recomputation).
  """
  r = compile_step(fl.quantize_model(_ScannedBlocks(), DELAYED))
  assert_all_fp8(r, 7)


class _MultiQueryScores(nn.Module):
  """Attention scores with one key head broadcast against four query heads."""

  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((4, 32), dtype=jnp.bfloat16, name="q")(x)
    k = nn.DenseGeneral((1, 32), dtype=jnp.bfloat16, name="k")(x)
    return jnp.einsum("btnh,bsnh->bnts", q, k)


def test_multi_query_einsum_is_one_fp8_gemm():
  """The broadcast key head is squeezed, not materialized: q, k and q.k are 3 x 3 fp8 GEMMs."""
  r = compile_step(fl.quantize_model(_MultiQueryScores(), DELAYED), (2, 64, 128))
  assert_all_fp8(r, 9)


def test_fp8_layers_back_to_back_compile():
  """Smallest form of the same "cycle detected" failure: two fp8 layers, no bias between.

  In the backward pass the second layer's dgrad GEMM output is, alone, the
  first layer's output gradient, which is reduced to its amax and quantized
  with a scale from that amax; XLA fuses both into that fp8 GEMM. Fails today.
  """
  model = nn.Sequential([fl.QDense(D, use_bias=False, recipe=CURRENT), fl.QDense(D, recipe=CURRENT)])
  r = compile_step(model)
  assert_all_fp8(r, 6)


# ----------------------------------------------------------------------------
# The module itself.
# ----------------------------------------------------------------------------


def _python(code, **env):
  full = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  full.update(env)
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                        timeout=300)


def test_unavailable_with_another_platform_says_why():
  out = _python("from fp8_linen.testing import targets as t\n"
                "print('REASON:', t.availability('h100').reason)\n"
                "try:\n  t.use_cpu_platform()\nexcept t.TargetUnavailable as e:\n"
                "  print('RAISED:', e)\n", JAX_PLATFORMS="cuda")
  assert "REASON: jax.config.jax_platforms='cuda', not 'cpu'" in out.stdout, out
  assert "RAISED: jax.config.jax_platforms='cuda'" in out.stdout, out


def test_unavailable_after_backends_started_says_why():
  out = _python("import jax.numpy as jnp\n(jnp.ones(2) + 1).block_until_ready()\n"
                "from fp8_linen.testing import targets as t\nt.use_cpu_platform()\n"
                "print('REASON:', t.availability('h100').reason)\n")
  assert "not registered in this process" in out.stdout, out


# ----------------------------------------------------------------------------
# Integer QAT: the forward product is an s8 x s8 -> s32 GEMM.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["ste", "lsq"])
def test_integer_qat_forward_is_an_int8_gemm(recipe):
  r = case_step(f"qdense-int8-{recipe}")
  assert (r.int8_gemms, r.products, r.fp8_products) == (1, 3, 0), r.summary()
  # The s8 GEMM sums in int32; LSQ writes both gradients in float32 (its step
  # gradients sum them there), STE in the layer's bfloat16.
  assert_products_write(r, {"ste": {"s32": 1, "bf16": 2}, "lsq": {"s32": 1, "f32": 2}}[recipe])
  if recipe == "lsq":
    r = case_step("qeinsum-int8-lsq")  # 'td,dhk->thk'
  else:
    ste = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
    r = compile_step(fl.QEinsum(shape=(D, 4, D // 4), einsum_str="td,dhk->thk", recipe=ste))
  assert (r.int8_gemms, r.products) == (1, 3), r.summary()


def test_fake_quant_path_has_no_int8_gemm():
  # A float input role keeps the fake-quantized float product: no s8 GEMM.
  r = compile_step(fl.QDense(D, recipe=fl.IntRecipe(input=None)))
  assert (r.int8_gemms, r.products) == (0, 3), r.summary()
