"""Post-training quantization of NNX models (fl.nnx.ptq), and its parity with Linen's fl.ptq."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fp8_linen as fl


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64, name="up")(x))
    return nn.Dense(8, name="down")(h)


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(32, 64, rngs=rngs)
    self.down = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def _pair():
  """A Linen MLP and an NNX MLP holding the same float weights, and calibration batches."""
  batches = [jax.random.normal(k, (64, 32)) for k in jax.random.split(jax.random.key(0), 2)]
  nnx_model = NnxMLP(nnx.Rngs(3))
  params = {"params": {n: {"kernel": getattr(nnx_model, n).kernel[...],
                           "bias": getattr(nnx_model, n).bias[...]} for n in ("up", "down")}}
  return LinenMLP(), params, nnx_model, batches


RECIPES = {
    "int4 weight-only GPTQ per group": (fl.weight_only(4, granularity="group", group_size=16),
                                        fl.PtqConfig(weights="gptq")),
    "w8a8 int8 STE percentile": (fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel")),
                                 fl.PtqConfig(activation="percentile", percentile=99.9)),
    "fp8 delayed mse": (fl.delayed_scaling(16), fl.PtqConfig(activation="mse", mse_grid=20)),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_linen_and_nnx_serve_the_same_arrays(name):
  recipe, config = RECIPES[name]
  linen_model, params, nnx_model, batches = _pair()
  lin = fl.ptq(linen_model, params, batches, recipe=recipe, config=config)
  served, qmodel = fl.nnx.ptq(nnx_model, batches, recipe=recipe, config=config)
  for layer in ("up", "down"):
    linen_arrays = lin.served_params["params"][layer]
    nnx_layer = getattr(served, layer)
    nnx_arrays = {k: getattr(nnx_layer, k)[...] for k in linen_arrays}
    chex.assert_trees_all_equal(nnx_arrays, linen_arrays)
    chex.assert_trees_all_equal_dtypes(nnx_arrays, linen_arrays)
  # The float model is left as it was; the served model is the calibrated one, frozen.
  assert type(nnx_model.up) is nnx.Linear
  qmodel.eval()
  y = nnx.jit(lambda m, x: m(x))(served, batches[1])
  chex.assert_trees_all_equal(y, nnx.jit(lambda m, x: m(x))(qmodel, batches[1]))
  chex.assert_trees_all_equal(y, jax.jit(lin.served.apply)(lin.served_params, batches[1]))


class ConvNet(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.proj = nnx.LinearGeneral((6, 6, 8), 16, axis=(-3, -2, -1), rngs=rngs)
    self.head = nnx.Einsum("bd,dk->bk", (16, 4), rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.proj(nnx.relu(self.conv(x)))))


def test_convolutions_general_layers_and_einsums():
  xs = [jax.random.normal(k, (4, 6, 6, 3)) for k in jax.random.split(jax.random.key(0), 2)]
  model = ConvNet(nnx.Rngs(0))
  served, qmodel = fl.nnx.ptq(model, xs, recipe=fl.weight_only(4),
                              config=fl.PtqConfig(weights="gptq"))
  assert [getattr(served, n).kernel[...].dtype for n in ("conv", "proj", "head")] == [jnp.int4] * 3
  chex.assert_shape(qmodel.proj.kernel_step[...], (1, 1, 1, 16))
  qmodel.eval()
  forward = nnx.jit(lambda m, x: m(x))
  chex.assert_trees_all_equal(forward(served, xs[1]), forward(qmodel, xs[1]))


def test_nnx_layers_and_errors():
  x = [jax.random.normal(jax.random.key(1), (8, 16))]
  layer = fl.nnx.Linear(16, 4, recipe=fl.weight_only(8), rngs=nnx.Rngs(0))
  float_kernel = layer.kernel[...]
  served, _ = fl.nnx.ptq(layer, x)
  chex.assert_type(served.kernel[...], jnp.int8)
  chex.assert_trees_all_close(served(x[0]), x[0] @ float_kernel + layer.bias[...], atol=0.02)
  model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="batches is empty"):
    fl.nnx.ptq(model, [], recipe=fl.weight_only(8))
  with pytest.raises(ValueError, match=r"batches\[0\] holds NaN"):
    fl.nnx.ptq(model, [x[0].at[0, 0].set(jnp.inf)], recipe=fl.weight_only(8))
  with pytest.raises(ValueError, match="ran no quantized product"):
    fl.nnx.ptq(model, x, recipe=fl.weight_only(8),
               rules=[fl.QuantizationRule(module_path=".*", quantize=False)],
               )
  with pytest.raises(TypeError, match="for a Linen model use fl.ptq"):
    fl.nnx.ptq(nn.Dense(4), x, recipe=fl.weight_only(8))


_DN = (((1,), (0,)), ((), ()))


class LinenOwn(nn.Module):
  """Projections of a model's own code (MaxText's, EasyDeL's layers), in Linen..."""

  @nn.compact
  def __call__(self, x):
    w1 = self.param("w1", nn.initializers.zeros, (32, 64))
    w2 = self.param("w2", nn.initializers.zeros, (64, 8))
    return jnp.einsum("bk,kn->bn", nn.relu(jax.lax.dot_general(x, w1, _DN)), w2)


class NnxOwn(nnx.Module):
  """... and in NNX."""

  def __init__(self):
    self.w1 = nnx.Param(jax.random.normal(jax.random.key(5), (32, 64)) * 0.2)
    self.w2 = nnx.Param(jax.random.normal(jax.random.key(6), (64, 8)) * 0.2)

  def __call__(self, x):
    return jnp.einsum("bk,kn->bn", nnx.relu(jax.lax.dot_general(x, self.w1[...], _DN)),
                      self.w2[...])


@pytest.mark.parametrize("name", list(RECIPES))
def test_products_of_own_modules_are_calibrated_and_served_as_linens(name):
  recipe, config = RECIPES[name]
  batches = [jax.random.normal(k, (64, 32)) for k in jax.random.split(jax.random.key(0), 2)]
  nnx_model = NnxOwn()
  params = {"params": {"w1": nnx_model.w1[...], "w2": nnx_model.w2[...]}}
  lin = fl.ptq(LinenOwn(), params, batches, recipe=recipe, config=config)
  served, qmodel = fl.nnx.ptq(nnx_model, batches, recipe=recipe, config=config)
  assert fl.nnx.product_report(qmodel, batches[0]).counts == {"quantized": 2}
  linen = lin.served_params["params"]
  # The weights are stored as the same codes, the calibrated arrays are the same.
  for w in ("w1", "w2"):
    assert linen[w].dtype in (jnp.int4, jnp.int8, jnp.float8_e4m3fn)
    chex.assert_trees_all_equal(served_w := getattr(served, w).get_raw_value(), linen[w])
    chex.assert_trees_all_equal_dtypes(served_w, linen[w])
  for site in ("dot_general_0", "einsum_0"):
    chex.assert_trees_all_equal(
        {k: getattr(getattr(served, site), k)[...] for k in linen[site]}, linen[site])
  y = nnx.jit(lambda m, x: m(x))(served, batches[1])
  chex.assert_trees_all_equal(y, jax.jit(lin.served.apply)(lin.served_params, batches[1]))
  with fl.frozen_quantizers():
    chex.assert_trees_all_equal(y, nnx.jit(lambda m, x: m(x))(qmodel, batches[1]))
