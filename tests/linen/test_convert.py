"""fl.convert: the served model computes the QAT forward from stored low-precision weights.

Every layer x recipe is trained for a few steps (so the fp8 histories and the
observer ranges hold data), converted, and the served forward is compared
with the QAT model evaluated with frozen quantizers (``fl.frozen_quantizers``)
on the same variables, both compiled: equal bit for bit, also for batches far
outside the recorded observer ranges (which both clip).
"""

import dataclasses
import functools
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import block_numerics
from fp8_linen.testing import hlo as hlo_text
from fp8_linen.testing import hlo_products

RECIPES = {
    "fp8_delayed": fl.Fp8Recipe(),
    "fp8_current": fl.current_scaling(),
    "fp8_rowwise": fl.rowwise_scaling(),
    "fp8_mx": fl.mx_block_scaling(),
    "fp8_mx_2d": dataclasses.replace(fl.mx_block_scaling(), kernel_2d_blocks=True),
    "nvfp4": fl.nvfp4(),
    "nvfp4_delayed": fl.nvfp4(scaling="delayed"),
    "nvfp4_1d": fl.nvfp4(kernel_2d_blocks=False),
    "int8_ste_tensor": fl.IntRecipe(),
    "int8_ste_channel": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel")),
    "int8_ste_group": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="group", group_size=8)),
    "int8_ste_asym": fl.IntRecipe(input=fl.IntQuantConfig(symmetric=False),
                                  kernel=fl.IntQuantConfig(symmetric=False,
                                                           granularity="channel")),
    "int8_ste_moving_average": fl.IntRecipe(
        input=fl.IntQuantConfig(observer="moving_average", momentum=0.9),
        kernel=fl.IntQuantConfig(granularity="channel")),
    "int8_lsq": fl.int8_lsq(),
    "int4_lsq_plus": fl.int4_lsq_plus(),
}

LAYERS = {
    "QDense": (lambda r: fl.QDense(8, recipe=r), (4, 32)),
    "QDenseGeneral": (lambda r: fl.QDenseGeneral((2, 4), recipe=r), (4, 32)),
    "QEinsum": (lambda r: fl.QEinsum((32, 8), "bk,kn->bn", recipe=r), (4, 32)),
    "QConv": (lambda r: fl.QConv(8, (3, 3), recipe=r), (2, 6, 6, 32)),
    "nn.Dense+Fp8DotGeneral": (
        lambda r: nn.Dense(8, dot_general_cls=functools.partial(fl.Fp8DotGeneral, recipe=r)),
        (4, 32)),
}

# fp8 convolutions are per tensor (no row-wise or block scales); a group of the kernel's
# 3x3x32 contraction is not one axis.
NOT_A_LAYER_RECIPE = {("QConv", r) for r, recipe in RECIPES.items()
                      if r in ("fp8_rowwise", "int8_ste_group")
                      or getattr(recipe, "granularity", None) == "block"}

STORED = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int4,
          "fp4": jnp.float4_e2m1fn}


def _stored(recipe: str) -> str:
  return ("fp4" if recipe.startswith("nvfp4") else "fp8" if recipe.startswith("fp8") else
          "int4" if recipe.startswith("int4") else "int8")


def _train(model, v, xs):
  """A few QAT steps that update the quantization state (params stay)."""
  # Jitted: op by op, a quantized backward costs seconds.
  step = jax.jit(lambda v, x: fl.merge_owg(v, jax.grad(
      lambda v, x: jnp.sum(model.apply(v, x) ** 2))(v, x)))
  for x in xs:
    v = step(v, x)
  return v


def _trained(model, shape, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  xs = [2.0 * jax.random.normal(keys[i], shape) for i in range(3)]
  v = jax.jit(model.init)(keys[3], xs[0])
  return _train(model, v, xs), 0.5 * xs[1]  # the evaluation batch is inside the range


def _layer_params(params):
  """The leaf dict holding the (possibly nested) kernel."""
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  return flat


CASES = [(l, r) for l in LAYERS for r in RECIPES if (l, r) not in NOT_A_LAYER_RECIPE]


def _frozen(model):
  """The QAT model evaluated with frozen quantizers, jitted (the flag is read while tracing)."""
  def run(v, x):
    with fl.frozen_quantizers():
      return model.apply(v, x)
  return jax.jit(run)


@pytest.mark.parametrize("layer,recipe", CASES)
def test_served_forward_equals_frozen_qat_forward_bit_for_bit_from_codes(layer, recipe):
  """One conversion per case: what the served params hold, then what they compute."""
  mk, shape = LAYERS[layer]
  model = mk(RECIPES[recipe])
  v, x = _trained(model, shape)
  served, sp = fl.convert(model, v, x)
  _assert_codes_and_no_training_state(recipe, v, sp)
  # The batch, one of another size, and one 5x larger than anything the observers saw.
  batches = (x, 0.25 * jax.random.normal(jax.random.key(7), (2,) + shape[1:]),
             10.0 * jax.random.normal(jax.random.key(8), shape))
  pairs, training_mode = _evaluations(model, served, v, sp, batches)
  for out, ref in pairs:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  if recipe != "int8_ste_moving_average":
    # Inside the recorded range a 'minmax' observer's batch changes nothing:
    # the training-mode evaluation is the served model too.
    np.testing.assert_array_equal(np.asarray(pairs[0][0]), np.asarray(training_mode))


def _evaluations(model, served, v, sp, batches):
  """``([(served, frozen QAT) per batch], training-mode QAT of the first batch)``.

  One jitted program (each of these alone would be a compile of its own);
  the frozen-quantizer flag is read while each call is traced.
  """
  def run(v, sp, batches):
    pairs = []
    for b in batches:
      with fl.frozen_quantizers():
        ref = model.apply(v, b)
      pairs.append((served.apply(sp, b), ref))
    return pairs, model.apply(v, batches[0])
  return jax.jit(run)(v, sp, batches)


def test_frozen_evaluation_is_what_is_served_where_training_mode_is_not():
  """An STE model evaluated on a batch beyond its ranges: only the frozen forward is served."""
  model = nn.Sequential([fl.QDense(16, recipe=RECIPES["int8_ste_channel"]), nn.relu,
                         fl.QDense(4, recipe=RECIPES["int8_ste_channel"])])
  v, x = _trained(model, (4, 16))
  served, sp = fl.convert(model, v, x)
  big = 10.0 * jax.random.normal(jax.random.key(3), (4, 16))
  out = np.asarray(jax.jit(served.apply)(sp, big))
  np.testing.assert_array_equal(out, np.asarray(_frozen(model)(v, big)))
  assert np.abs(out - np.asarray(jax.jit(model.apply)(v, big))).max() > 1e-3


@pytest.mark.parametrize("recipe", ["int4_lsq_plus", "int8_ste_asym"])
@pytest.mark.parametrize("compute_dtype,want", [("auto", "bfloat16"), ("float32", "float32")])
def test_bf16_fake_quantized_conv_is_served_bit_for_bit_in_the_qat_compute_dtype(
    recipe, compute_dtype, want, float_gemm_dtypes):
  # These convolutions fake-quantize: the served one multiplies floats in the
  # dtype compute_dtype resolves to, as QAT did (bf16 after the layer's
  # promotion, although the input is float32).
  r = dataclasses.replace(RECIPES[recipe], compute_dtype=compute_dtype)
  model = fl.QConv(8, (3, 3), dtype=jnp.bfloat16, recipe=r)
  v, x = _trained(model, (2, 6, 6, 32))
  served, sp = fl.convert(model, v, x)
  ref = jax.jit(model.apply)(v, x)
  out = jax.jit(served.apply)(sp, x)
  assert out.dtype == ref.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  assert float_gemm_dtypes(served.apply, sp, x, values=False) == [(want, want)]


def _assert_codes_and_no_training_state(recipe, v, sp):
  assert set(sp) == {"params"}  # the OWG collection (histories, ranges) is gone
  flat = _layer_params(sp["params"])
  kernels = {k: a for k, a in flat.items() if k.endswith("kernel")}
  assert len(kernels) == 1
  (kernel,) = kernels.values()
  assert kernel.dtype == STORED[_stored(recipe)]
  qat_kernel = [a for k, a in _layer_params(v["params"]).items() if k.endswith("kernel")][0]
  assert kernel.shape == qat_kernel.shape
  names = {k.rsplit("/", 1)[-1] for k in flat}
  assert not names & {"input_step", "kernel_step", "input_amax_history", "input_range"}
  assert "kernel_scale" in names
  float_arrays = [a for a in flat.values() if jnp.issubdtype(a.dtype, jnp.floating)
                  and a.dtype.itemsize > 1]
  # Only small arrays stay in float: scales, offsets, the bias.
  assert all(a.size <= qat_kernel.size // 4 for a in float_arrays)


def _dots(hlo: str):
  """``(lhs type, rhs type, out type)`` of every dot / convolution in an optimized HLO module."""
  return [(*p.operands, p.out) for p in hlo_products.products(hlo_text.parse(hlo))
          if p.kind in ("dot", "convolution")]


def test_served_int_forward_is_one_s8_gemm_fed_by_the_stored_codes():
  """XLA keeps the stored int8 codes all the way to an s8 x s8 -> s32 dot."""
  model = fl.QDense(64, recipe=fl.IntRecipe(gemm="int8"))
  v, x = _trained(model, (4, 64))
  served, sp = fl.convert(model, v, x)
  hlo = jax.jit(served.apply).lower(sp, x).compile().as_text()
  assert _dots(hlo) == [("s8", "s8", "s32")]
  assert "s8[64,64]" in hlo.split("\n", 1)[0]  # the entry parameter is the int8 kernel
  qat = jax.jit(model.apply).lower(v, x).compile().as_text()
  assert _dots(qat) == [("s8", "s8", "s32")]  # QAT's forward runs the same product


def test_served_int4_kernel_is_unpacked_to_int8_for_the_cpu_gemm():
  model = fl.QDense(64, recipe=dataclasses_replace_gemm(fl.int4_lsq_plus(), "int8"))
  v, x = _trained(model, (4, 64))
  served, sp = fl.convert(model, v, x)
  assert sp["params"]["kernel"].dtype == jnp.int4
  hlo = jax.jit(served.apply).lower(sp, x).compile().as_text()
  assert "s4[64,64]" in hlo.split("\n", 1)[0]
  assert _dots(hlo) == [("s8", "s8", "s32")]


def test_lsq_plus_serving_reads_the_column_sums_stored_at_conversion():
  """The activation's offset needs the weight codes' column sums: summed once, not per call."""
  model = fl.QDense(64, recipe=fl.int4_lsq_plus())
  v, x = _trained(model, (4, 64))
  served, sp = fl.convert(model, v, x)
  p = sp["params"]
  assert p["kernel_colsum"].dtype == jnp.int32 and p["kernel_colsum"].shape == (1, 64)
  np.testing.assert_array_equal(p["kernel_colsum"],
                                jnp.sum(p["kernel"].astype(jnp.int32), axis=0, keepdims=True))
  kernel_sums = r"stablehlo.reduce\(.*\(tensor<64x64xi32>"  # a sum over the (64, 64) codes
  assert not re.search(kernel_sums, jax.jit(served.apply).lower(sp, x).as_text())
  assert re.search(kernel_sums, jax.jit(model.apply).lower(v, x).as_text())  # QAT's weight moves
  # Symmetric activations (LSQ) need no sums: nothing extra is stored.
  lsq = fl.QDense(64, recipe=fl.int8_lsq())
  _, sp8 = fl.convert(lsq, *_trained(lsq, (4, 64)))
  assert "kernel_colsum" not in sp8["params"]


def dataclasses_replace_gemm(recipe, gemm):
  import dataclasses  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(recipe, gemm=gemm)


def test_served_fp8_forward_feeds_fp8_codes_to_the_gemm_when_traced_for_gpu():
  model = fl.QDense(64, recipe=fl.Fp8Recipe())
  v, x = _trained(model, (4, 64))
  served, sp = fl.convert(model, v, x)
  with fl.target_backend("gpu"):
    text = jax.jit(served.apply).lower(sp, x).as_text()
  dots = [l for l in text.splitlines() if "dot_general" in l]
  assert len(dots) == 1 and dots[0].count("f8E4M3FN") >= 2, dots


# ----------------------------------------------------------------------------
# Block recipes (MXFP8, NVFP4): the forward's codes, on blocks that do not divide the axes

BLOCK_RECIPES = ["fp8_mx", "fp8_mx_2d", "nvfp4", "nvfp4_delayed", "nvfp4_1d"]
RAGGED = {
    # K = 5 x 8 = 40 over two contracting axes (partial last block), N = 24 (partial tile)
    "QDenseGeneral": (lambda r: fl.QDenseGeneral((2, 12), axis=(-2, -1), recipe=r), (4, 5, 8)),
    # a batch axis on the weight: the (B, N, K) views of both operands have B = 3
    "QEinsum": (lambda r: fl.QEinsum((3, 40, 8), "bhk,hkn->bhn", recipe=r), (4, 3, 40)),
}


@pytest.mark.parametrize("layer", list(RAGGED))
@pytest.mark.parametrize("recipe", BLOCK_RECIPES)
def test_block_recipes_are_served_bit_for_bit_on_ragged_blocks(layer, recipe):
  mk, shape = RAGGED[layer]
  model = mk(RECIPES[recipe])
  v, x = _trained(model, shape)
  served, sp = fl.convert(model, v, x)
  serve, frozen = jax.jit(served.apply), _frozen(model)
  for batch in (x, 10.0 * jax.random.normal(jax.random.key(8), shape)):
    np.testing.assert_array_equal(np.asarray(serve(sp, batch)), np.asarray(frozen(v, batch)))
  flat = _layer_params(sp["params"])
  k = 40
  bs = RECIPES[recipe].block_size
  b, n = (3, 8) if layer == "QEinsum" else (1, 24)
  # The weight's block scales: one per block of K for each (batch, output) row.
  assert flat["kernel_scale"].shape == (b, n, -(-k // bs))
  assert flat["kernel_scale"].dtype == (jnp.float8_e4m3fn if recipe.startswith("nvfp4")
                                        else jnp.float8_e8m0fnu)
  assert ("kernel_tensor_scale" in flat) == recipe.startswith("nvfp4")
  assert ("input_scale" in flat) == (recipe == "nvfp4_delayed")


def test_nvfp4_served_kernel_codes_are_the_forward_tile_rows():
  """With 2-D tiles the stored codes are the tile codes: each 16 x 16 tile shares one scale."""
  model = fl.QDense(32, recipe=RECIPES["nvfp4"])
  v, x = _trained(model, (4, 64))
  _, sp = fl.convert(model, v, x)
  s = np.asarray(sp["params"]["kernel_scale"].astype(jnp.float32))[0]   # (N, K / 16)
  assert s.shape == (32, 4)
  np.testing.assert_array_equal(s, np.repeat(s[::16], 16, axis=0))
  # The codes are the (N, K) weight's 16 x 16 tiles quantized with its per-tensor factor.
  factor = sp["params"]["kernel_tensor_scale"][0] / 448.0
  q, scales = block_numerics.block_quantize(v["params"]["kernel"].T, 16, jnp.float4_e2m1fn,
                                            tensor_scale=factor, tile=True)
  np.testing.assert_array_equal(np.asarray(sp["params"]["kernel"].T.astype(jnp.float32)),
                                np.asarray(q.astype(jnp.float32)))
  np.testing.assert_array_equal(s, np.asarray(scales.astype(jnp.float32)))


def test_the_nvfp4_input_scale_is_frozen_with_delayed_scaling_and_measured_with_current():
  """A batch 100x larger than training: delayed saturates (frozen factor), current follows it."""
  err = {}
  for name in ("nvfp4", "nvfp4_delayed"):
    model = fl.QDense(8, recipe=RECIPES[name])
    v, x = _trained(model, (4, 32))
    served, sp = fl.convert(model, v, x)
    big = 100.0 * x
    exact = big @ v["params"]["kernel"] + v["params"]["bias"]
    out = jax.jit(served.apply)(sp, big)
    err[name] = float(jnp.max(jnp.abs(out - exact)) / jnp.max(jnp.abs(exact)))
  assert err["nvfp4"] < 0.2 < err["nvfp4_delayed"], err


def test_nvfp4_served_weight_bytes_count_e2m1_codes_at_half_a_byte():
  k, n = 128, 64
  model = fl.QDense(n, recipe=RECIPES["nvfp4"])
  v, x = _trained(model, (4, k))
  _, sp = fl.convert(model, v, x)
  p = sp["params"]
  assert p["kernel"].dtype == jnp.float4_e2m1fn and p["kernel"].shape == (k, n)
  assert fl.weight_bytes(p["kernel"]) == k * n // 2
  scales = (k // 16) * n                   # one e4m3 byte per block of 16
  assert fl.weight_bytes(p) == k * n // 2 + scales + 4 + 4 * n   # + tensor scale, f32 bias
  assert fl.weight_bytes(p) / fl.weight_bytes(v["params"]) < 0.16


# ----------------------------------------------------------------------------
# quantize_model


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32, name="up")(x))
    q = nn.Dense(32, name="q")(h)
    scores = jnp.einsum("bd,cd->bc", q, h)  # an activation x activation product
    return nn.Dense(8, name="down")(h) + jnp.sum(scores, axis=-1, keepdims=True) * 1e-3


@pytest.mark.parametrize("recipe", ["fp8_delayed", "int8_ste_tensor", "int8_lsq",
                                    "int4_lsq_plus"])
def test_quantize_model_is_served_bit_for_bit(recipe):
  qm = fl.quantize_model(_Block(), RECIPES[recipe], on_unquantized="ignore")
  v, x = _trained(qm, (6, 16))
  served, sp = fl.convert(qm, v, x)
  for name in ("up", "q", "down"):
    assert sp["params"][name]["kernel"].dtype != jnp.float32
  # The attention-like product has no weight: it quantizes both operands on the fly.
  assert "kernel" not in sp["params"]["einsum_0"]
  for batch in (x, 10.0 * jax.random.normal(jax.random.key(4), x.shape)):
    np.testing.assert_array_equal(np.asarray(jax.jit(served.apply)(sp, batch)),
                                  np.asarray(_frozen(qm)(v, batch)))


def test_an_mlp_is_served_bit_for_bit_and_other_collections_are_kept():
  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = fl.QDense(32, recipe=fl.int8_lsq())(x)
      x = nn.BatchNorm(use_running_average=True)(x)
      return fl.QDense(4, recipe=fl.int8_lsq())(nn.relu(x))

  model = Mlp()
  v, x = _trained(model, (4, 16))
  served, sp = fl.convert(model, v, x)
  assert set(sp) == {"params", "batch_stats"}
  np.testing.assert_array_equal(np.asarray(jax.jit(served.apply)(sp, x)),
                                np.asarray(jax.jit(model.apply)(v, x)))


# ----------------------------------------------------------------------------
# Bad input


def test_a_layer_without_trained_state_is_named():
  model = nn.Sequential([fl.QDense(8), fl.QDense(4)])
  x = jnp.ones((2, 8))
  v = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"layers_0: has no trained quantization state"):
    fl.convert(model, v, x)
  with pytest.warns(UserWarning, match="found no '_overwrite_with_gradient'"), \
      pytest.raises(ValueError, match=r"layers_0: has no trained quantization state"):
    fl.convert(model, {"params": v["params"]}, x)  # the state collection left out


def test_an_observer_that_saw_nothing_is_named():
  model = fl.QDense(4, recipe=fl.IntRecipe(), name="proj")
  x = jnp.ones((2, 8))
  v = nn.Sequential([model]).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"layers_0: has no trained quantization state"):
    fl.convert(nn.Sequential([fl.QDense(4, recipe=fl.IntRecipe())]), v, x)


def test_a_recipe_that_cannot_be_served_is_named_with_the_reason():
  model = nn.Sequential([fl.QDense(4, recipe=fl.IntRecipe(kernel=None))])
  x = jax.random.normal(jax.random.key(0), (2, 8))
  v = model.init(jax.random.key(1), x)
  with pytest.raises(ValueError, match=r"layers_0: recipe=.* cannot be served: recipe.kernel "
                                       r"is None"):
    fl.convert(model, v, x)


def test_variables_of_another_model_are_refused_naming_the_parameter():
  x = jax.random.normal(jax.random.key(0), (2, 8))
  other = nn.Sequential([fl.QDense(5, recipe=fl.int8_lsq())])
  v = other.init(jax.random.key(1), x)
  model = nn.Sequential([fl.QDense(4, recipe=fl.int8_lsq())])
  with pytest.raises(ValueError, match=r"variables do not fit the model.*layers_0"):
    fl.convert(model, v, x)


def test_a_model_without_quantized_products_is_refused():
  model = nn.Dense(4)
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="ran no quantized product"):
    fl.convert(model, model.init(jax.random.key(0), x), x)


def test_bad_arguments():
  model = fl.QDense(4, recipe=fl.int8_lsq())
  x = jax.random.normal(jax.random.key(0), (2, 8))
  v = model.init(jax.random.key(1), x)
  with pytest.raises(TypeError, match="example inputs"):
    fl.convert(model, v)
  with pytest.raises(TypeError, match="variables must be"):
    fl.convert(model, v["params"], x)
  served, sp = fl.convert(model, v, x)
  with pytest.raises(ValueError, match="kernel is float32, not the low-precision codes"):
    served.apply(v, x)  # the QAT variables given to the served model


def test_example_inputs_may_be_abstract():
  model = fl.QDense(4, recipe=fl.int8_lsq())
  x = jax.random.normal(jax.random.key(0), (2, 8))
  v = model.init(jax.random.key(1), x)
  served, sp = fl.convert(model, v, jax.ShapeDtypeStruct(x.shape, x.dtype))
  np.testing.assert_array_equal(served.apply(sp, x), jax.jit(model.apply)(v, x))


# ----------------------------------------------------------------------------
# Deployment: jax.export and orbax


@pytest.mark.parametrize("recipe", ["int8_lsq", "int4_lsq_plus", "fp8_delayed"])
def test_exported_served_forward_round_trips(recipe):
  from jax import export  # pylint: disable=import-outside-toplevel
  model = nn.Sequential([fl.QDense(16, recipe=RECIPES[recipe]), nn.relu,
                         fl.QDense(4, recipe=RECIPES[recipe])])
  v, x = _trained(model, (4, 16))
  served, sp = fl.convert(model, v, x)
  exp = export.export(jax.jit(served.apply))(sp, x)
  blob = exp.serialize()
  assert isinstance(blob, (bytes, bytearray)) and len(blob) > 0
  back = export.deserialize(blob)
  np.testing.assert_array_equal(np.asarray(back.call(sp, x)),
                                np.asarray(jax.jit(served.apply)(sp, x)))
  leaves = jax.tree.leaves(sp)
  assert [str(a.dtype) for a in back.in_avals[:len(leaves)]] == [str(a.dtype) for a in leaves]


def test_orbax_saves_and_restores_the_low_precision_dtypes(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  x = jax.random.normal(jax.random.key(0), (4, 16))
  for name, recipe in (("int8", fl.int8_lsq()), ("int4", fl.int4_lsq_plus()),
                       ("fp8", fl.Fp8Recipe()), ("mx", fl.mx_block_scaling())):
    model = fl.QDense(8, recipe=recipe)
    v, x = _trained(model, (4, 16))
    served, sp = fl.convert(model, v, x)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / name, sp)
    ckpt.wait_until_finished()
    back = ckpt.restore(tmp_path / name, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sp))
    assert jax.tree.map(lambda a: str(a.dtype), back) == jax.tree.map(
        lambda a: str(a.dtype), sp)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(sp)):
      np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                    np.asarray(b.astype(jnp.float32)))
    serve = jax.jit(served.apply)
    np.testing.assert_array_equal(serve(back, x), serve(sp, x))


# ----------------------------------------------------------------------------
# Size


def _mlp(recipe):
  return nn.Sequential([fl.QDense(512, recipe=recipe), nn.relu,
                        fl.QDense(512, recipe=recipe)])


@pytest.mark.parametrize("recipe,bound", [("int8_lsq", 0.26), ("int8_ste_channel", 0.26),
                                          ("int4_lsq_plus", 0.14), ("fp8_delayed", 0.26),
                                          ("fp8_rowwise", 0.26)])
def test_served_weight_bytes_against_the_float_model(recipe, bound):
  """Served params vs the f32 model's params (kernels, biases, scales: everything served).

  ``jnp.int4`` is counted at half a byte per element (what the format holds).
  In memory on CPU a ``jnp.int4`` array takes one byte per element
  (``nbytes == size``), and orbax writes it as one byte per element too, so
  the int4 saving is only realised where a backend packs it.
  """
  x = jax.random.normal(jax.random.key(0), (4, 512))
  model = _mlp(RECIPES[recipe])
  v, x = _trained(model, (4, 512))
  _, sp = fl.convert(model, v, x)
  float_params = nn.Sequential([nn.Dense(512), nn.relu, nn.Dense(512)]).init(
      jax.random.key(0), x)
  ratio = fl.weight_bytes(sp) / fl.weight_bytes(float_params)
  assert ratio <= bound, ratio
  if recipe == "int4_lsq_plus":
    kernel = sp["params"]["layers_0"]["kernel"]
    assert kernel.nbytes == kernel.size  # one byte per int4 element in memory on CPU


# ----------------------------------------------------------------------------
# Between consecutive quantized layers


def _entry(hlo: str):
  """``(name, type, opcode, operands)`` of the entry computation's instructions."""
  m = hlo_text.parse(hlo)
  return [(i.name, i.dtype, i.opcode, list(i.operands)) for i in m.computations[m.entry]]


def test_dense_relu_dense_requantizes_the_int32_accumulator_straight_to_int8():
  """Dense -> ReLU -> Dense served: dequantize, bias, ReLU and the next quantize are one pass.

  The instruction that reads the first GEMM's s32 accumulator writes the
  second GEMM's s8 input; no float activation of the hidden layer exists in
  the program. The arithmetic inside that pass is QAT's, so it stays exact.
  """
  r = fl.IntRecipe(gemm="int8")
  model = nn.Sequential([fl.QDense(256, recipe=r), nn.relu, fl.QDense(128, recipe=r)])
  v, x = _trained(model, (64, 128))
  served, sp = fl.convert(model, v, x)
  hlo = jax.jit(served.apply).lower(sp, x).compile().as_text()
  instrs = _entry(hlo)
  produced = {name: etype for name, etype, _, _ in instrs}
  gemms = [i for i in instrs if produced[i[0]] == "s32"]
  assert len(gemms) == 2
  readers = [i for i in instrs if gemms[0][0] in i[3]]
  assert len(readers) == 1 and readers[0][1] == "s8"      # s32 in, s8 out
  assert readers[0][0] in gemms[1][3]                      # ... the next GEMM's input
  entry = hlo[hlo.index("\nENTRY"):]
  assert "s8[64,256]" in entry and "s32[64,256]" in entry
  assert not re.search(r"(f32|bf16|f16)\[64,256\]", entry)  # no float hidden activation
  # The QAT forward does have one: its observer measures the activation first.
  qat = jax.jit(model.apply).lower(v, x).compile().as_text()
  assert re.search(r"(f32|bf16|f16)\[64,256\]", qat[qat.index("\nENTRY"):])
  np.testing.assert_array_equal(np.asarray(jax.jit(served.apply)(sp, x)),
                                np.asarray(jax.jit(model.apply)(v, x)))


def test_the_served_layer_model_is_a_linen_module_at_the_same_paths():
  model = nn.Sequential([fl.QDense(16, recipe=fl.Fp8Recipe()), nn.relu,
                         fl.QDense(4, recipe=fl.Fp8Recipe())])
  v, x = _trained(model, (4, 8))
  served, sp = fl.convert(model, v, x)
  assert isinstance(served, nn.Module) and isinstance(served, fl.ServedModule)
  assert set(sp["params"]) == set(v["params"]) == {"layers_0", "layers_2"}
  np.testing.assert_array_equal(np.asarray(jax.jit(served.apply)(sp, x)),
                                np.asarray(jax.jit(model.apply)(v, x)))
  qm = fl.quantize_model(nn.Dense(4), fl.int8_lsq(), on_unquantized="ignore")
  vq = qm.init(jax.random.key(0), x)
  served_q, _ = fl.convert(qm, vq, x)
  assert isinstance(served_q, fl.ServedModel)
