"""fl.nnx.quantize_model: float NNX models get their quantized twins, same params."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl
import fp8_linen.nnx as fnnx


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(2)])
    self.head = nnx.Linear(16, 4, use_bias=False, rngs=rngs)

  def __call__(self, x):
    for b in self.blocks:
      x = x + b(x)
    return self.head(x)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, param_dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


class Attn(nnx.Module):

  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(2, 16, qkv_features=16, decode=False, rngs=rngs)
    self.mix = nnx.Einsum('btd,df->btf', (16, 16), (16,), rngs=rngs)
    self.conv = nnx.Conv(16, 16, (3,), padding='CAUSAL', rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    x = x + self.conv(self.mix(x))
    return self.head(x)


def _params(model):
  return nnx.as_pure(nnx.state(model, nnx.Param))


def _x(shape, seed=1):
  return jax.random.normal(jax.random.key(seed), shape)


@nnx.jit
def _apply(model, x):
  """Jitted: op by op, a quantized forward costs seconds."""
  return model(x)


def _train(model, x, y, steps=6):
  opt = fnnx.Optimizer(model, optax.adam(1e-2))

  @nnx.jit
  def step(model, opt):
    loss, grads = fnnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  return [float(step(model, opt)) for _ in range(steps)]


def test_mlp_rules_params_and_training():
  model = MLP(nnx.Rngs(0))
  x = _x((8, 16))
  ref_params, ref_out = _params(model), _apply(model, x)
  q = fnnx.quantize_model(model, rules=[
      fl.QuantizationRule(module_path='head', quantize=False),
      fl.QuantizationRule(module_path='blocks/1/down', recipe=fl.current_scaling()),
      fl.QuantizationRule(module_path='.*')])
  for b in q.blocks:
    assert type(b.up) is fnnx.Linear and type(b.down) is fnnx.Linear
  assert type(q.head) is nnx.Linear  # excluded
  assert q.blocks[1].down.recipe == fl.current_scaling()
  assert q.blocks[0].down.param_dtype == jnp.bfloat16 and q.blocks[0].up.use_bias
  assert q.blocks[0].up.kernel is model.blocks[0].up.kernel  # the very same variables
  new_params = _params(q)
  assert jax.tree.structure(new_params) == jax.tree.structure(ref_params)
  jax.tree.map(np.testing.assert_array_equal, new_params, ref_params)
  out = _apply(q, x)
  np.testing.assert_allclose(out, ref_out, atol=0.15 * float(jnp.abs(ref_out).max()))
  assert not np.array_equal(out, ref_out)  # it did run quantized
  losses = _train(q, x, jnp.tanh(x[:, :4]))
  assert losses[-1] < losses[0]
  assert float(q.blocks[0].up.input_amax_history[...][0]) > 0  # state was written


def test_attention_einsum_conv_replaced_and_train():
  model = Attn(nnx.Rngs(0))
  x = _x((2, 6, 16))
  ref_params = _params(model)
  q = fnnx.quantize_model(model, fl.Fp8Recipe(), rules=[
      fl.QuantizationRule(module_path='attn/out', quantize=False),
      fl.QuantizationRule()])
  for name in ('query', 'key', 'value'):
    assert type(getattr(q.attn, name)) is fnnx.LinearGeneral
  assert type(q.attn.out) is nnx.LinearGeneral
  assert type(q.mix) is fnnx.Einsum and type(q.conv) is fnnx.Conv
  assert q.conv.padding == 'CAUSAL' and q.mix.einsum_str == 'btd,df->btf'
  jax.tree.map(np.testing.assert_array_equal, _params(q), ref_params)
  ref = _apply(model, x)
  np.testing.assert_allclose(_apply(q, x), ref, atol=0.15 * float(jnp.abs(ref).max()))
  losses = _train(q, x, jnp.tanh(x[..., :4]))
  assert losses[-1] < losses[0]


def test_unmatched_rule_warns_and_shared_layer_stays_shared():
  shared = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  model = nnx.Sequential(shared, shared)
  with pytest.warns(UserWarning, match="matched no layer.*'nope'"):
    q = fnnx.quantize_model(model, rules=[fl.QuantizationRule(module_path='nope'),
                                          fl.QuantizationRule()])
  assert type(q.layers[0]) is fnnx.Linear and q.layers[0] is q.layers[1]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fnnx.quantize_model(model, rules=[fl.QuantizationRule(module_path='nope')],
                        on_unmatched='ignore')
  with pytest.raises(ValueError, match="on_unmatched"):
    fnnx.quantize_model(model, on_unmatched='maybe')


def test_custom_product_is_refused_by_name():
  model = nnx.Sequential(nnx.Linear(4, 4, dot_general=lambda *a, **k: jax.lax.dot_general(
      *a, **k), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="'layers/0'.*custom dot_general"):
    fnnx.quantize_model(model)
