"""Precision chosen by measurement on NNX models (fl.nnx.sensitivity), and its parity with Linen."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl

NAMES = ("dense0", "dense1", "dense2")


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(32, name="dense0")(x))
    x = nn.relu(nn.Dense(32, name="dense1")(x))
    return nn.Dense(8, name="dense2")(x)


class NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.dense0 = nnx.Linear(16, 32, rngs=rngs)
    self.dense1 = nnx.Linear(32, 32, rngs=rngs)
    self.dense2 = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.dense2(nnx.relu(self.dense1(nnx.relu(self.dense0(x)))))


def xent(model, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@functools.lru_cache(maxsize=None)
def _pair():
  """Twin models holding the same weights (an outlier in dense1), batches labelled by them."""
  nnx_model = NnxMLP(nnx.Rngs(3))
  k = nnx_model.dense1.kernel
  k.set_value(k[...].at[0, 0].set(100 * jnp.abs(k[...]).max()))
  nnx_model.dense2.kernel.set_value(nnx_model.dense2.kernel[...] * 4)
  params = {"params": {n: {"kernel": getattr(nnx_model, n).kernel[...],
                           "bias": getattr(nnx_model, n).bias[...]} for n in NAMES}}
  xs = [jax.random.normal(k, (64, 16)) for k in jax.random.split(jax.random.key(0), 2)]
  forward = nnx.jit(lambda m, x: m(x))
  batches = [(x, jnp.argmax(forward(nnx_model, x), -1)) for x in xs]
  return LinenMLP(), params, nnx_model, batches


@functools.lru_cache(maxsize=None)
def _results():
  linen_model, params, nnx_model, batches = _pair()
  recipe = fl.int4_lsq_plus()   # learned steps: calibrated from the first batch in both APIs
  lin = fl.sensitivity(linen_model, params, batches, recipe=recipe, loss_fn=xent)
  nx = fl.nnx.sensitivity(nnx_model, batches, recipe=recipe, loss_fn=xent)
  return lin, nx


def test_linen_and_nnx_twins_measure_the_same():
  lin, nx = _results()
  assert lin.paths == nx.paths and set(nx.paths) == set(NAMES)
  for a, b in zip(lin.layers, nx.layers):
    assert a.weights == b.weights
    np.testing.assert_allclose([a.loss_change, a.output_error, a.grad_error],
                               [b.loss_change, b.output_error, b.grad_error], rtol=2e-4)
  np.testing.assert_allclose(lin.float_loss, nx.float_loss, rtol=1e-6)
  np.testing.assert_allclose(lin.quantized_loss_change, nx.quantized_loss_change, rtol=2e-4)


def test_nnx_choice_is_verified_with_nnx_quantize_model():
  _, _, nnx_model, batches = _pair()
  lin, nx = _results()
  top = nx.paths[0]  # the head: 4-bit activations of confident logits
  budget = nx.evaluate(nx.rules_keeping([top])) + 0.01
  choice = nx.choice(budget, cost="layers")
  assert choice.kept == (top,) and choice.met
  assert lin.choice(budget, cost="layers").kept == choice.kept
  # The float model is untouched; quantized by the chosen rules it has the measured loss.
  assert all(type(getattr(nnx_model, n)) is nnx.Linear for n in NAMES)
  qmodel = fl.nnx.quantize_model(nnx_model, fl.int4_lsq_plus(), rules=choice.rules)
  assert [type(getattr(qmodel, n)) is nnx.Linear for n in NAMES] == [n == top for n in NAMES]
  fl.nnx.calibrate(qmodel, batches[0][0])
  loss = nnx.jit(xent)
  total = sum(float(loss(qmodel, b)) for b in batches)
  ref = sum(float(loss(nnx_model, b)) for b in batches)
  np.testing.assert_allclose(choice.loss_change, total / ref - 1, rtol=1e-4)


def test_nnx_bad_arguments_name_the_argument():
  linen_model, _, nnx_model, batches = _pair()
  kw = dict(recipe=fl.nvfp4(), loss_fn=xent)
  with pytest.raises(ValueError, match="batches is empty"):
    fl.nnx.sensitivity(nnx_model, [], **kw)
  with pytest.raises(ValueError, match=r"batches\[0\] holds NaN"):
    fl.nnx.sensitivity(nnx_model, [(batches[0][0] * jnp.inf, batches[0][1])], **kw)
  with pytest.raises(TypeError, match="recipe"):
    fl.nnx.sensitivity(nnx_model, batches, recipe=None, loss_fn=xent)
  with pytest.raises(TypeError, match="nnx.Module"):
    fl.nnx.sensitivity(linen_model, batches, **kw)
  with pytest.raises(TypeError, match="already holds quantized layers"):
    fl.nnx.sensitivity(fl.nnx.quantize_model(nnx_model), batches, **kw)
  with pytest.raises(ValueError, match="no layer matched"):
    fl.nnx.sensitivity(nnx_model, batches, rules=[fl.QuantizationRule(quantize=False)], **kw)
  with pytest.raises(ValueError, match="matched no quantized layer"):
    fl.nnx.sensitivity(nnx_model, batches, candidates=["head"], **kw)
  chex.assert_equal(type(nnx_model.dense0), nnx.Linear)
