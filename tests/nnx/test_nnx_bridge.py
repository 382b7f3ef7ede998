"""Linen fp8 layers inside NNX (nnx.bridge.ToNNX): their OWG state is QuantState."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import bridge

import fp8_linen as fl
import fp8_linen.nnx as fnnx


class Mixed(nnx.Module):
  """An NNX model with a Linen QDense block in the middle."""

  def __init__(self, rngs):
    self.embed = nnx.Linear(8, 16, rngs=rngs)
    self.inner = bridge.ToNNX(fl.QDense(16), rngs=rngs)
    bridge.lazy_init(self.inner, jnp.ones((1, 16)))
    self.head = fnnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.gelu(self.inner(self.embed(x))))


def _x(shape, seed=1):
  return jax.random.normal(jax.random.key(seed), shape)


def test_owg_collection_is_quant_state():
  layer = bridge.ToNNX(fl.QDense(3), rngs=nnx.Rngs(0))
  bridge.lazy_init(layer, jnp.ones((2, 5)))
  assert type(layer.input_amax_history) is fnnx.QuantState
  linen_vars = fl.QDense(3).init(jax.random.key(0), jnp.ones((2, 5)))
  assert sorted(nnx.state(layer, fnnx.QuantState)) == sorted(linen_vars[fl.OWG])


def test_bridged_state_update_is_the_linen_one():
  layer = bridge.ToNNX(fl.QDense(3), rngs=nnx.Rngs(0))
  x = _x((4, 5)) * 3.0
  bridge.lazy_init(layer, x)
  grads = fnnx.grad(lambda m: m(x).sum())(layer)
  variables = {"params": nnx.to_pure_dict(nnx.state(layer, nnx.Param)),
               fl.OWG: nnx.to_pure_dict(nnx.state(layer, fnnx.QuantState))}
  linen = jax.grad(lambda v: fl.QDense(3).apply(v, x).sum())(variables)
  jax.tree.map(np.testing.assert_array_equal,
               nnx.to_pure_dict(nnx.state(grads, fnnx.QuantState)), linen[fl.OWG])
  assert float(linen[fl.OWG]["input_amax_history"][0]) == float(jnp.abs(x).max())


def test_nnx_model_with_linen_block_trains():
  model = Mixed(nnx.Rngs(0))
  opt = fnnx.Optimizer(model, optax.adam(1e-2))
  x = _x((16, 8))
  y = jnp.tanh(x[:, :4])

  @nnx.jit
  def step(model, opt):
    loss, grads = fnnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(6)]
  assert losses[-1] < losses[0]
  hist = model.inner.input_amax_history[...]
  assert float(hist[0]) > 0 and float(hist[5]) > 0 and float(hist[6]) == 0  # six steps recorded
  assert float(model.inner.input_scale[0]) != 1.0  # scales follow the written histories
