"""A recipe family registered from outside runs everywhere: Linen, NNX, quantize_model, convert, serve."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import fp8_linen as fl
from fp8_linen.core import serve
from fp8_linen.families import table

E4M3 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnscaledFp8:
  """A toy family: both operands cast to e4m3 as they are, the product times a stored gain."""

  gain: float = 2.0


def _gemm(lhs_codes, rhs_codes, dn, gain, out_dtype):
  y = lax.dot_general(lhs_codes, rhs_codes, dn, preferred_element_type=jnp.float32)
  return (y * gain[0]).astype(out_dtype)


def _out_dtype(out_dtype, lhs, rhs):
  return jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))


def _declare(access, recipe, kernel, kernel_contract):
  del kernel, kernel_contract
  access.state("gain", recipe.gain, (1,))


def _dot(access, lhs, rhs, dn, recipe, out_dtype, key):
  gain = access.state("gain", recipe.gain, (1,))
  # The gain is state whose update (its cotangent) is "unchanged": nothing to chain
  # but the use itself.
  return access.chained(key, lambda chain: (_gemm(
      lhs.astype(E4M3), rhs.astype(E4M3), dn, lax.stop_gradient(gain),
      _out_dtype(out_dtype, lhs, rhs)), chain), gain)


def _record(access, recipe, rhs, contract, *, batch, conv):
  del recipe, contract, batch, conv
  return serve.ServedRecord(fold={"kernel": rhs.astype(E4M3), "kernel_scale": jnp.ones((1,))},
                            live={}, frozen={"gain": access.stored("gain")},
                            state_ok=jnp.asarray(True))


def _served_dot(lhs, rhs, dn, *, recipe, arrays, out_dtype, where):
  del recipe, where
  return _gemm(lhs.astype(E4M3), rhs.astype(E4M3), dn, arrays["gain"],
               _out_dtype(out_dtype, lhs, rhs))


FAMILY = fl.RecipeFamily(declare=_declare, dot_general=_dot, record=_record,
                         served_dot=_served_dot)
RECIPE = UnscaledFp8(gain=3.0)


@pytest.fixture(autouse=True)
def registered():
  fl.register_recipe(UnscaledFp8, FAMILY)
  yield
  table.unregister_recipe(UnscaledFp8)


def _x():
  return jax.random.normal(jax.random.key(1), (4, 8))


def _expected(x, kernel, bias):
  y = lax.dot_general(x.astype(E4M3), kernel.astype(E4M3), (((1,), (0,)), ((), ())),
                      preferred_element_type=jnp.float32)
  return y * 3.0 + bias


def test_linen_layer_runs_the_family_and_keeps_its_state():
  x = _x()
  layer = fl.QDense(3, recipe=RECIPE)
  y, v = layer.init_with_output(jax.random.key(0), x)
  assert dict(v[fl.OWG]) == {"gain": pytest.approx(np.array([3.0]))}
  np.testing.assert_array_equal(y, _expected(x, v["params"]["kernel"], v["params"]["bias"]))


def test_nnx_layer_runs_the_family_and_declares_its_state():
  x = _x()
  layer = fl.nnx.Linear(8, 3, recipe=RECIPE, rngs=nnx.Rngs(0))
  assert isinstance(layer.gain, fl.nnx.QuantState)
  np.testing.assert_array_equal(layer(x), _expected(x, layer.kernel[...], layer.bias[...]))


def test_quantize_model_runs_the_family():
  x = _x()
  model = nn.Sequential([nn.Dense(3), nn.relu])
  qmodel = fl.quantize_model(model, RECIPE)
  v = qmodel.init(jax.random.key(0), x)
  assert sorted(v[fl.OWG]["layers_0"]) == ["gain"]
  p = v["params"]["layers_0"]
  np.testing.assert_array_equal(qmodel.apply(v, x),
                                jax.nn.relu(_expected(x, p["kernel"], p["bias"])))
  nnx_model = fl.nnx.quantize_model(nnx.Sequential(nnx.Linear(8, 3, rngs=nnx.Rngs(0))), RECIPE)
  lin = nnx_model.layers[0]
  np.testing.assert_array_equal(nnx_model(x), _expected(x, lin.kernel[...], lin.bias[...]))


def test_convert_and_serve_run_the_family():
  x = _x()
  layer = fl.QDense(3, recipe=RECIPE)
  v = layer.init(jax.random.key(0), x)
  served, params = fl.convert(layer, v, x)
  assert params["params"]["kernel"].dtype == E4M3 and "gain" in params["params"]
  np.testing.assert_array_equal(served.apply(params, x), layer.apply(v, x))

  nnx_layer = fl.nnx.Linear(8, 3, recipe=RECIPE, rngs=nnx.Rngs(0))
  nnx_served = fl.nnx.convert(nnx_layer, x)
  assert nnx_served.kernel[...].dtype == E4M3
  np.testing.assert_array_equal(nnx_served(x), nnx_layer(x))


def test_a_family_without_serving_is_refused_by_convert_naming_the_layer():
  fl.register_recipe(UnscaledFp8, dataclasses.replace(FAMILY, record=None))
  layer = fl.QDense(3, recipe=RECIPE)
  x = _x()
  with pytest.raises(ValueError, match=r"<root>: recipe=.* cannot be served: its family defines "
                     r"no RecipeFamily.record"):
    fl.convert(layer, layer.init(jax.random.key(0), x), x)


def test_a_family_without_convolution_is_refused_by_conv_layers():
  with pytest.raises(TypeError, match="QConv: recipe=.* has no quantized convolution"):
    fl.QConv(2, (3, 3), recipe=RECIPE).init(jax.random.key(0), jnp.ones((1, 5, 5, 2)))
  with pytest.raises(TypeError, match="Conv: recipe=.* has no quantized convolution"):
    fl.nnx.Conv(2, 2, (3, 3), recipe=RECIPE, rngs=nnx.Rngs(0))


def test_an_unregistered_recipe_names_the_registered_ones():
  with pytest.raises(TypeError, match="accepted: Fp8Recipe or Fp8WeightOnly or IntRecipe or UnscaledFp8"):
    fl.nnx.Linear(8, 3, recipe=object(), rngs=nnx.Rngs(0))
