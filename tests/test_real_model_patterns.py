"""Patterns of real model code (MaxText, gemma) reproduced small, quantized with no glue.

Each test re-creates in plain flax one pattern that broke ``fl.quantize_model``
or the layers on Google's model code (the libraries themselves run in
``tests/third_party`` where they are installed).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl

X = jax.random.normal(jax.random.key(1), (4, 8))


class OverridesInit(nn.Module):
  """A model whose ``init`` runs one of its own methods before binding (MaxText's
  ``transformer_as_linen`` overrides ``init``)."""

  def describe(self):
    return "model"

  def init(self, *args, **kwargs):  # pylint: disable=arguments-differ
    assert self.describe() == "model"
    return super().init(*args, **kwargs)

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jax.nn.relu(nn.Dense(8)(x)))


def test_model_overriding_init_quantizes():
  qm = fl.quantize_model(OverridesInit(), fl.delayed_scaling())
  v = qm.init(jax.random.key(0), X)
  assert sorted(v[fl.OWG]) == ["Dense_0", "Dense_1"]
  assert qm.product_report(v, X).counts == {"quantized": 2}


def test_lsq_declares_its_steps_through_a_patched_param(monkeypatch):
  """gemma patches ``nn.Module.param`` process-wide and requires a shape."""
  original = nn.Module.param
  calls = []

  def param_with_shape(self, name, init_fn, shape, *init_args, **kwargs):
    calls.append((name, tuple(shape)))
    return original(self, name, init_fn, shape, *init_args, **kwargs)

  monkeypatch.setattr(nn.Module, "param", param_with_shape)
  for recipe in (fl.int8_lsq(), fl.int4_lsq_plus()):
    calls.clear()
    layer = fl.QDense(4, recipe=recipe)
    v = layer.init(jax.random.key(0), X)
    names = {n for n, _ in calls}
    assert {"input_step", "kernel_step"} <= names
    assert ("kernel_step", v["params"]["kernel_step"].shape) in calls
    y = layer.apply(v, X)
    assert y.shape == (4, 4) and bool(jnp.all(jnp.isfinite(y)))


def test_quantized_model_trains_under_raw_checkpoint_of_each_layer():
  """MaxText wraps each decoder layer call in a raw ``jax.checkpoint``."""

  class Layer(nn.Module):

    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(8)(jax.nn.gelu(nn.Dense(16)(x)))

  class Decoder(nn.Module):
    checkpointed: bool = True

    @nn.compact
    def __call__(self, x):
      for i in range(2):
        layer = Layer(name=f"layer_{i}")
        x = jax.checkpoint(lambda x: layer(x))(x) if self.checkpointed else layer(x)
      return x

  qm = fl.quantize_model(Decoder(), fl.delayed_scaling(history_length=4))
  # Declared outside the checkpoint (flax's own params leak out of a raw
  # jax.checkpoint at init); trained with it.
  v = fl.quantize_model(Decoder(checkpointed=False), fl.delayed_scaling(history_length=4)).init(
      jax.random.key(0), X)
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-3))

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, X) - X) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(3):
    state = step(state)
  hist = state.params[fl.OWG]["layer_0"]["Dense_1"]["input_amax_history"]  # the first projection
  np.testing.assert_allclose(np.asarray(hist[:3]), float(jnp.max(jnp.abs(X))), rtol=1e-6)
  report = qm.product_report(state.params, X)
  assert report.counts == {"quantized": 4}
