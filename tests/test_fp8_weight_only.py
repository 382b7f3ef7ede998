"""Weight-only fp8 (fl.Fp8WeightOnly): QAT, conversion, PTQ and NNX parity."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import fp8_linen as fl


def _reference_weight(w, granularity, dtype=ml_dtypes.float8_e4m3fn):
  """The fp8 weight computed in numpy with ml_dtypes casts (per output channel or tensor)."""
  w = np.asarray(w, np.float32)
  amax = np.abs(w).max(axis=0, keepdims=True) if granularity == "channel" else np.abs(w).max()
  s = (amax / float(ml_dtypes.finfo(dtype).max)).astype(np.float32)
  return (w / s).astype(dtype).astype(np.float32) * s


class TestDense(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_and_straight_through_gradient(self):
    x = jax.random.normal(jax.random.key(0), (8, 16))
    for granularity in ("channel", "tensor"):
      layer = fl.QDense(4, use_bias=False, recipe=fl.Fp8WeightOnly(granularity=granularity))
      v = layer.init(jax.random.key(1), x)
      w = v["params"]["kernel"]
      apply = self.variant(layer.apply)
      want = np.asarray(x, np.float64) @ _reference_weight(w, granularity).astype(np.float64)
      np.testing.assert_allclose(apply(v, x), want, rtol=1e-5, atol=1e-5)
      g = self.variant(jax.grad(lambda v: jnp.sum(layer.apply(v, x) ** 2)))(v)
      y = np.asarray(apply(v, x), np.float64)
      # The weight's gradient passes straight through its quantization: x^T dL/dy.
      np.testing.assert_allclose(g["params"]["kernel"], np.asarray(x, np.float64).T @ (2 * y),
                                 rtol=1e-4, atol=1e-4)
      assert set(v) == {"params"}  # no quantization state to keep


def test_convert_serves_fp8_codes_bit_exactly_and_nnx_agrees():
  x = jax.random.normal(jax.random.key(0), (8, 16))
  recipe = fl.Fp8WeightOnly()
  layer = fl.QDense(4, recipe=recipe)
  v = layer.init(jax.random.key(1), x)
  served, sp = fl.convert(layer, v, x)
  assert sp["params"]["kernel"].dtype == jnp.float8_e4m3fn
  assert fl.weight_bytes(sp["params"]["kernel"]) * 4 == fl.weight_bytes(v["params"]["kernel"])
  with fl.frozen_quantizers():
    chex.assert_trees_all_equal(jax.jit(served.apply)(sp, x), jax.jit(layer.apply)(v, x))
  twin = fl.nnx.Linear(16, 4, recipe=recipe, rngs=nnx.Rngs(0))
  twin.kernel.set_value(v["params"]["kernel"])
  twin.bias.set_value(v["params"]["bias"])
  nserved = fl.nnx.convert(twin, x)
  chex.assert_trees_all_equal(nserved.kernel[...], sp["params"]["kernel"])
  chex.assert_trees_all_equal(nserved.kernel_scale[...], sp["params"]["kernel_scale"])
  chex.assert_trees_all_equal(nnx.jit(lambda m, x: m(x))(nserved, x),
                              jax.jit(served.apply)(sp, x))


def test_convolution_and_ptq():
  model = nn.Sequential([nn.Conv(8, (3, 3)), nn.relu, lambda h: h.reshape(h.shape[0], -1),
                         nn.Dense(4)])
  xs = [jax.random.normal(k, (2, 6, 6, 3)) for k in jax.random.split(jax.random.key(0), 2)]
  params = model.init(jax.random.key(1), xs[0])
  res = fl.ptq(model, params, xs, recipe=fl.Fp8WeightOnly(dtype="float8_e5m2"))
  assert res.served_params["params"]["layers_0"]["kernel"].dtype == jnp.float8_e5m2
  with fl.frozen_quantizers():
    qat = jax.jit(res.model.apply)(res.variables, xs[1])
  chex.assert_trees_all_equal(jax.jit(res.served.apply)(res.served_params, xs[1]), qat)
  err = jnp.linalg.norm(qat - model.apply(params, xs[1])) / jnp.linalg.norm(qat)
  assert 0.0 < float(err) < 0.2  # e5m2: 2 mantissa bits
  with pytest.raises(ValueError, match="rounds to an integer grid"):
    fl.ptq(model, params, xs, recipe=fl.Fp8WeightOnly(), config=fl.PtqConfig(weights="gptq"))


def test_bad_fields_are_named():
  with pytest.raises(ValueError, match="Fp8WeightOnly.granularity='row'"):
    fl.Fp8WeightOnly(granularity="row")
  with pytest.raises(ValueError, match="not an fp8"):
    fl.Fp8WeightOnly(dtype="int8")
  with pytest.raises(ValueError, match="margin"):
    fl.Fp8WeightOnly(margin=100)
  with pytest.raises(TypeError):
    fl.Fp8WeightOnly("float8_e4m3fn")  # keyword-only
