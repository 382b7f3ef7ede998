"""quantize_model: unmodified Linen models run with fp8 products by path rules."""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl

ORIG_DOT = jax.lax.dot_general
ORIG_EINSUM = jnp.einsum


class Mixed(nn.Module):
  @nn.compact
  def __call__(self, x):                      # x: (b, 6, 6, 2)
    h = nn.Conv(4, (3, 3), name="conv")(x)
    h = h.reshape(h.shape[0], -1, 4)
    h = nn.DenseGeneral((2, 3), name="dg")(h)  # (b, 36, 2, 3)
    h = nn.Einsum((2, 3, 5), "btij,ijk->btk", name="ein")(h)
    return nn.Dense(3, name="logits")(h.mean(1))


class Raw(nn.Module):
  """A setup-style module with raw jnp.einsum / lax.dot_general calls."""

  def setup(self):
    self.w = self.param("w", nn.initializers.normal(1.0), (4, 5))

  def __call__(self, x):
    h = jnp.einsum("bd,de->be", x, self.w)
    return jax.lax.dot_general(h, h, (((1,), (1,)), ((), ())))


def test_params_unchanged_state_at_layer_paths_and_parity_with_q_layers():
  x = jax.random.normal(jax.random.key(1), (2, 6, 6, 2))
  model = Mixed()
  qm = fl.quantize_model(model, rules=[fl.QuantizationRule(module_path="logits",
                                                           quantize=False),
                                       fl.QuantizationRule(module_path=".*")])
  v = qm.init(jax.random.key(0), x)
  vf = model.init(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(jnp.shape, vf["params"])
  assert sorted(v[fl.OWG]) == ["conv", "dg", "ein"]
  assert "kernel_scale" in v[fl.OWG]["conv"]
  assert jax.lax.dot_general is ORIG_DOT and jnp.einsum is ORIG_EINSUM  # patches undone

  class Twin(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = fl.QConv(4, (3, 3), name="conv")(x)
      h = h.reshape(h.shape[0], -1, 4)
      h = fl.QDenseGeneral((2, 3), name="dg")(h)
      h = fl.QEinsum((2, 3, 5), "btij,ijk->btk", name="ein")(h)
      return nn.Dense(3, name="logits")(h.mean(1))

  twin = Twin()
  np.testing.assert_array_equal(qm.apply(v, x), twin.apply(v, x))
  ct = jax.random.normal(jax.random.key(2), (2, 3))
  g1 = jax.jit(jax.grad(lambda v: jnp.sum(qm.apply(v, x) * ct)))(v)
  g2 = jax.jit(jax.grad(lambda v: jnp.sum(twin.apply(v, x) * ct)))(v)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # The logits layer stayed in f32: same output as the unquantized model's layer.
  assert not np.array_equal(qm.apply(v, x), model.apply(vf, x))


def test_raw_calls_get_per_call_site_state():
  x = jax.random.normal(jax.random.key(1), (3, 4))
  qm = fl.quantize_model(Raw())
  v = qm.init(jax.random.key(0), x)
  assert sorted(v[fl.OWG]) == ["dot_general_0", "einsum_0"]
  assert set(v["params"]) == {"w"}
  y = qm.apply(v, x)
  h = x @ v["params"]["w"]
  np.testing.assert_allclose(y, h @ h.T, rtol=0.15, atol=0.15 * float(jnp.max(jnp.abs(h @ h.T))))
  g = jax.grad(lambda v: jnp.sum(qm.apply(v, x)))(v)
  np.testing.assert_allclose(g[fl.OWG]["einsum_0"]["input_amax_history"][0],
                             jnp.max(jnp.abs(x)), rtol=1e-6)


def test_unmatched_rule_is_reported():
  x = jnp.ones((2, 4))
  rules = [fl.QuantizationRule(module_path="no_such_layer"), fl.QuantizationRule()]
  with pytest.warns(UserWarning, match="no_such_layer"):
    fl.quantize_model(nn.Dense(3), rules=rules).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="no_such_layer"):
    fl.quantize_model(nn.Dense(3), rules=rules, on_unmatched="raise").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="module_path"):
    fl.QuantizationRule(module_path="(")
  with pytest.raises(ValueError, match="ops"):
    fl.QuantizationRule(ops=("tensordot",))
  with pytest.raises(ValueError, match="operands"):
    fl.QuantizationRule(operands="weights")


def test_flax_multi_head_attention_all_products_quantized():
  mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  qm = fl.quantize_model(mha)
  v = qm.init(jax.random.key(0), x)
  assert sorted(v[fl.OWG]) == ["einsum_0", "einsum_1", "key", "out", "query", "value"]
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(
      jnp.shape, mha.init(jax.random.key(0), x)["params"])
  y = jax.jit(qm.apply)(v, x)
  yf = mha.apply({"params": v["params"]}, x)
  assert float(jnp.max(jnp.abs(y - yf))) < 0.15 * float(jnp.max(jnp.abs(yf)))
  # Keeping the softmax path (the module's own einsums) in high precision.
  qm2 = fl.quantize_model(mha, rules=[fl.QuantizationRule(module_path="", ops=("einsum",),
                                                          quantize=False),
                                      fl.QuantizationRule()])
  assert sorted(qm2.init(jax.random.key(0), x)[fl.OWG]) == ["key", "out", "query", "value"]


class Decoder(nn.Module):
  vocab: int = 32
  d: int = 32
  layers: int = 1
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens):
    dt = self.dtype
    h = nn.Embed(self.vocab, self.d, dtype=dt)(tokens)
    mask = nn.make_causal_mask(tokens)
    for i in range(self.layers):
      a = nn.LayerNorm(dtype=dt)(h)
      h = h + nn.MultiHeadDotProductAttention(num_heads=4, dtype=dt, name=f"attn_{i}")(a, mask=mask)
      a = nn.LayerNorm(dtype=dt)(h)
      h = h + nn.Dense(self.d, dtype=dt, name=f"down_{i}")(
          nn.gelu(nn.Dense(4 * self.d, dtype=dt, name=f"up_{i}")(a)))
    return nn.Dense(self.vocab, dtype=jnp.float32, name="logits")(nn.LayerNorm(dtype=dt)(h))


def _train(apply_fn, variables, tokens, steps=6):
  def loss_fn(v):
    logits = apply_fn(v, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  state = fl.TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.adam(3e-3))

  @jax.jit
  def step(state):
    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), loss

  losses = []
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
  return state, np.array(losses)


def test_decoder_trains_close_to_bf16():
  tokens = jax.random.randint(jax.random.key(3), (8, 17), 0, 32)
  tokens = tokens.at[:, 1::2].set((tokens[:, 0::2][:, :8] + 1) % 32)   # learnable structure
  model = Decoder(dtype=jnp.bfloat16)  # the reference is the same model run in bf16
  rules = [fl.QuantizationRule(module_path="logits", quantize=False),
           fl.QuantizationRule(module_path="attn_[0-9]+", ops=("einsum",), quantize=False),
           fl.QuantizationRule()]
  qm = fl.quantize_model(model, fl.delayed_scaling(16), rules)
  v = qm.init(jax.random.key(0), tokens[:, :-1])
  assert "logits" not in v[fl.OWG] and "einsum_0" not in v[fl.OWG]["attn_0"]
  assert "kernel_scale" in v[fl.OWG]["attn_0"]["query"]
  state, q_losses = _train(qm.apply, v, tokens)
  _, ref_losses = _train(model.apply, {"params": v["params"]}, tokens)
  assert q_losses[-1] < q_losses[0] - 0.3
  np.testing.assert_allclose(q_losses, ref_losses, rtol=0.03)
  hist = state.params[fl.OWG]["up_0"]["output_grad_amax_history"]
  assert int(jnp.sum(hist > 0)) == 6   # one observation per step, none summed
