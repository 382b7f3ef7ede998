"""fl.nnx.convert: a trained NNX model becomes a served NNX model holding low-precision codes.

Every layer x recipe trains its quantization state for a few steps (so the
fp8 histories and the observer ranges hold data), is converted, and the
served model is compared with the QAT model evaluated with frozen quantizers
(``model.eval()``), both under ``nnx.jit``: equal bit for bit, also for
batches far beyond the recorded observer ranges.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8_linen as fl
from fp8_linen.testing import hlo as hlo_text
from fp8_linen.testing import hlo_products

_CHANNEL = fl.IntQuantConfig(granularity="channel")
RECIPES = {
    "fp8_delayed": fl.Fp8Recipe(),
    "fp8_current": fl.current_scaling(),
    "fp8_rowwise": fl.rowwise_scaling(),
    "fp8_mx": fl.mx_block_scaling(),
    "nvfp4": fl.nvfp4(),
    "nvfp4_delayed": fl.nvfp4(scaling="delayed"),
    "int8_ste_minmax": fl.IntRecipe(kernel=_CHANNEL),
    "int8_ste_moving_average": fl.IntRecipe(
        input=fl.IntQuantConfig(observer="moving_average", momentum=0.9), kernel=_CHANNEL),
    "int8_ste_group": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="group", group_size=8)),
    "int8_ste_asym": fl.IntRecipe(input=fl.IntQuantConfig(symmetric=False),
                                  kernel=fl.IntQuantConfig(symmetric=False)),
    "int8_lsq": fl.int8_lsq(),
    "int4_lsq_plus": fl.int4_lsq_plus(),
}

LAYERS = {
    "Linear": (lambda r, rngs: fl.nnx.Linear(32, 8, recipe=r, rngs=rngs), (4, 32)),
    "LinearGeneral": (lambda r, rngs: fl.nnx.LinearGeneral(32, (2, 4), recipe=r, rngs=rngs),
                      (4, 32)),
    "Einsum": (lambda r, rngs: fl.nnx.Einsum("bk,kn->bn", (32, 8), (8,), recipe=r, rngs=rngs),
               (4, 32)),
    "Conv": (lambda r, rngs: fl.nnx.Conv(32, 8, (3, 3), recipe=r, rngs=rngs), (2, 6, 6, 32)),
}
# fp8 convolutions are per tensor (no row-wise or block scales); a group of the kernel's
# 3x3x32 contraction is not one axis.
CASES = [(l, r) for l in LAYERS for r in RECIPES
         if not (l == "Conv" and r in ("fp8_rowwise", "fp8_mx", "nvfp4", "nvfp4_delayed",
                                       "int8_ste_group"))]

STORED = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8, "int4": jnp.int4,
          "fp4": jnp.float4_e2m1fn}
TRAINING_ONLY = {"input_step", "kernel_step", "input_amax_history", "input_range",
                 "kernel_amax_history", "output_grad_amax_history"}


@nnx.jit
def _apply(model, x):
  return model(x)


@nnx.jit
def _update_state(model, x):
  fl.nnx.update_state(model, fl.nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x))


def _train(model, shape, seed=0):
  """A few steps that update the quantization state (params stay); returns an inside batch."""
  keys = jax.random.split(jax.random.key(seed), 3)
  xs = [2.0 * jax.random.normal(k, shape) for k in keys]
  fl.nnx.calibrate(model, xs[0])  # LSQ activation steps from data (no-op otherwise)
  for x in xs:  # jitted: op by op, a quantized backward costs seconds
    _update_state(model, x)
  return 0.5 * xs[1]


def _variables(layer) -> dict:
  return {k: v for k, v in vars(layer).items() if isinstance(v, nnx.Variable)}


def _converted(layer: str, recipe: str):
  """``(qat_model, served_model, inside_batch, shape)`` of one layer x recipe."""
  mk, shape = LAYERS[layer]
  model = mk(RECIPES[recipe], nnx.Rngs(0))
  x = _train(model, shape)
  return model, fl.nnx.convert(model, x), x, shape


@pytest.mark.parametrize("layer,recipe", CASES)
def test_served_model_equals_the_frozen_qat_model_bit_for_bit_from_codes(layer, recipe):
  """One conversion per case: what the served layer holds, then what it computes."""
  model, served, x, shape = _converted(layer, recipe)
  _assert_codes_and_no_training_state(model, served, layer, recipe)
  model.eval()  # frozen quantizers
  batches = (x, 0.25 * jax.random.normal(jax.random.key(7), (2,) + shape[1:]),
             10.0 * jax.random.normal(jax.random.key(8), shape))  # beyond every range
  # Every output in one jitted program (one compile, not one per model and batch).
  outs = nnx.jit(lambda s, m, bs: [(s(b), m(b)) for b in bs])(served, model, batches)
  for out, ref in outs:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def _assert_codes_and_no_training_state(model, served, layer, recipe):
  want = ("fp4" if recipe.startswith("nvfp4") else "fp8" if recipe.startswith("fp8") else
          "int4" if recipe.startswith("int4") else "int8")
  assert served.kernel[...].dtype == STORED[want]
  assert served.kernel[...].shape == model.kernel[...].shape
  names = set(_variables(served))
  assert not names & TRAINING_ONLY and "kernel_scale" in names
  assert not jax.tree.leaves(nnx.state(served, fl.nnx.QuantState))
  if recipe == "int4_lsq_plus" and layer != "Conv":
    # The activation's offset needs the codes' column sums: folded once, int32.
    assert served.kernel_colsum[...].dtype == jnp.int32
  # Only small arrays stay in float: scales, offsets, the bias.
  floats = [v[...] for v in _variables(served).values()
            if jnp.issubdtype(v[...].dtype, jnp.floating) and v[...].dtype.itemsize > 1]
  assert all(a.size <= model.kernel[...].size // 4 for a in floats)
  # The QAT model is left as it was.
  assert model.kernel[...].dtype == jnp.float32
  assert set(_variables(model)) & TRAINING_ONLY


def test_training_mode_evaluation_is_not_what_is_served():
  """An STE observer folds an evaluation batch beyond its range into it; frozen, it clips."""
  model = nnx.Sequential(fl.nnx.Linear(16, 16, recipe=RECIPES["int8_ste_minmax"],
                                       rngs=nnx.Rngs(0)), nnx.relu,
                         fl.nnx.Linear(16, 4, recipe=RECIPES["int8_ste_minmax"],
                                       rngs=nnx.Rngs(1)))
  x = _train(model, (4, 16))
  served = fl.nnx.convert(model, x)
  big = 10.0 * jax.random.normal(jax.random.key(3), (4, 16))
  training_mode = np.asarray(_apply(model, big))
  # The context manager inside the jitted function freezes too (no model.eval()).
  @nnx.jit
  def frozen_apply(m, x):
    with fl.nnx.frozen_quantizers():
      return m(x)

  out = np.asarray(_apply(served, big))
  np.testing.assert_array_equal(out, np.asarray(frozen_apply(model, big)))
  assert np.abs(out - training_mode).max() > 1e-3
  model.eval()
  np.testing.assert_array_equal(out, np.asarray(_apply(model, big)))
  model.train()  # nnx.jit traces again: the attribute is static
  np.testing.assert_array_equal(np.asarray(_apply(model, big)), training_mode)


def test_frozen_evaluation_leaves_the_state_unchanged():
  model = nnx.Sequential(fl.nnx.Linear(16, 16, recipe=RECIPES["int8_ste_minmax"],
                                       rngs=nnx.Rngs(0)), nnx.relu, fl.nnx.Quantizer(),
                         fl.nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
  _train(model, (4, 16))
  before = jax.tree.map(np.asarray, nnx.state(model, fl.nnx.QuantState))
  big = 10.0 * jax.random.normal(jax.random.key(3), (4, 16))
  model.eval()
  _apply(model, big)
  # Differentiated, every state's "gradient" is the state itself: writing it changes nothing.
  _update_state(model, big)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, fl.nnx.QuantState), before)
  model.train()
  _update_state(model, big)
  after = nnx.state(model, fl.nnx.QuantState)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after),
                                                       jax.tree.leaves(before)))


# ----------------------------------------------------------------------------
# quantize_model'd models


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.mix = nnx.Einsum("bd,dk->bk", (32, 32), rngs=rngs)
    self.conv = nnx.Conv(1, 4, (3,), rngs=rngs)
    self.down = nnx.Linear(32 * 4, 8, rngs=rngs)

  def __call__(self, x):
    h = nnx.relu(self.mix(nnx.relu(self.up(x))))
    h = nnx.relu(self.conv(h[..., None]))
    return self.down(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("recipe", ["fp8_delayed", "int8_ste_minmax", "int8_lsq",
                                    "int4_lsq_plus"])
def test_quantize_model_is_served_bit_for_bit(recipe):
  model = fl.nnx.quantize_model(_Block(nnx.Rngs(0)), RECIPES[recipe])
  x = _train(model, (6, 16))
  served = fl.nnx.convert(model, x)
  for name in ("up", "mix", "conv", "down"):
    assert getattr(served, name).kernel[...].dtype != jnp.float32, name
  model.eval()
  for batch in (x, 10.0 * jax.random.normal(jax.random.key(4), x.shape)):
    np.testing.assert_array_equal(np.asarray(_apply(served, batch)),
                                  np.asarray(_apply(model, batch)))


def test_served_int_forward_is_one_s8_gemm_fed_by_the_stored_codes():
  """As for Linen: XLA keeps the stored int8 codes all the way to an s8 x s8 -> s32 dot."""
  model = fl.nnx.Linear(64, 64, recipe=fl.IntRecipe(gemm="int8"), rngs=nnx.Rngs(0))
  x = _train(model, (4, 64))
  graphdef, state = nnx.split(fl.nnx.convert(model, x))
  hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).compile().as_text()
  dots = [(*p.operands, p.out) for p in hlo_products.products(hlo_text.parse(hlo))
          if p.kind == "dot"]
  assert dots == [("s8", "s8", "s32")]
  assert "s8[64,64]" in hlo.split("\n", 1)[0]  # an entry parameter is the int8 kernel


# ----------------------------------------------------------------------------
# Deployment: jax.export, orbax, size


def _mlp(recipe, width=16):
  return nnx.Sequential(fl.nnx.Linear(width, width, recipe=recipe, rngs=nnx.Rngs(0)), nnx.relu,
                        fl.nnx.Linear(width, width, recipe=recipe, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("recipe", ["int8_lsq", "int4_lsq_plus", "fp8_delayed"])
def test_exported_served_model_round_trips(recipe):
  from jax import export  # pylint: disable=import-outside-toplevel
  model = _mlp(RECIPES[recipe])
  x = _train(model, (4, 16))
  served = fl.nnx.convert(model, x)
  graphdef, state = nnx.split(served)
  leaves, treedef = jax.tree.flatten(state)  # the arrays alone: a serializable signature
  serve = jax.jit(lambda leaves, x: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(x))
  back = export.deserialize(export.export(serve)(leaves, x).serialize())
  np.testing.assert_array_equal(np.asarray(back.call(leaves, x)),
                                np.asarray(_apply(served, x)))
  assert [str(a.dtype) for a in back.in_avals[:len(leaves)]] == [str(a.dtype) for a in leaves]


def test_orbax_saves_and_restores_the_served_state(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  for name in ("int8_lsq", "int4_lsq_plus", "fp8_delayed", "fp8_mx"):
    model = _mlp(RECIPES[name], width=32)
    x = _train(model, (4, 32))
    served = fl.nnx.convert(model, x)
    graphdef, state = nnx.split(served)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / name, state)
    ckpt.wait_until_finished()
    back = ckpt.restore(tmp_path / name, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert [str(a.dtype) for a in jax.tree.leaves(back)] == \
        [str(a.dtype) for a in jax.tree.leaves(state)]
    np.testing.assert_array_equal(np.asarray(_apply(nnx.merge(graphdef, back), x)),
                                  np.asarray(_apply(served, x)))


@pytest.mark.parametrize("recipe,bound", [("int8_lsq", 0.26), ("int4_lsq_plus", 0.15),
                                          ("fp8_delayed", 0.26), ("nvfp4", 0.15)])
def test_served_weight_bytes_against_the_float_model(recipe, bound):
  model = _mlp(RECIPES[recipe], width=512)
  x = _train(model, (4, 512))
  served = fl.nnx.convert(model, x)
  float_params = nnx.state(_mlp(fl.Fp8Recipe(), width=512), nnx.Param)
  assert fl.weight_bytes(served) == fl.weight_bytes(nnx.state(served, nnx.Param))
  assert fl.weight_bytes(served) / fl.weight_bytes(float_params) <= bound


# ----------------------------------------------------------------------------
# Bad input: the Linen conversion's errors


def test_a_layer_without_trained_state_is_named():
  model = _mlp(fl.Fp8Recipe())
  with pytest.raises(ValueError, match=r"layers/0: has no trained quantization state"):
    fl.nnx.convert(model, jnp.ones((2, 16)))
  with pytest.raises(ValueError, match=r"layers/0: has no trained quantization state"):
    fl.nnx.convert(_mlp(fl.IntRecipe()), jnp.ones((2, 16)))  # an observer that saw nothing


def test_a_recipe_that_cannot_be_served_is_named_with_the_reason():
  model = _mlp(fl.IntRecipe(kernel=None))
  with pytest.raises(ValueError, match=r"layers/0: recipe=.* cannot be served: recipe.kernel "
                                       r"is None"):
    fl.nnx.convert(model, jnp.ones((2, 16)))


def test_a_model_without_quantized_products_is_refused():
  with pytest.raises(ValueError, match="ran no quantized product"):
    fl.nnx.convert(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), jnp.ones((2, 3)))


def test_bad_arguments():
  model = _mlp(fl.int8_lsq())
  x = _train(model, (4, 16))
  with pytest.raises(TypeError, match="example inputs"):
    fl.nnx.convert(model)
  with pytest.raises(TypeError, match="must be an nnx.Module.*fl.convert"):
    fl.nnx.convert(fl.QDense(4), x)
  served = fl.nnx.convert(model, x)
  with pytest.raises(TypeError, match="already served"):
    fl.nnx.convert(served, x)
  # Example inputs may be abstract.
  abstract = fl.nnx.convert(model, jax.ShapeDtypeStruct(x.shape, x.dtype))
  np.testing.assert_array_equal(np.asarray(_apply(abstract, x)), np.asarray(_apply(served, x)))


def test_a_served_layer_missing_an_array_names_it():
  model = _mlp(fl.int8_lsq())
  x = _train(model, (4, 16))
  served = fl.nnx.convert(model, x)
  layer = served.layers[0]
  del layer.input_scale
  layer.serving = dataclasses.replace(
      layer.serving, arrays=tuple(a for a in layer.serving.arrays if a != "input_scale"))
  with pytest.raises(ValueError, match="layers/0: the served params hold no input_scale"):
    served(x)
