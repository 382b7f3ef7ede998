"""LoRA / QLoRA on served NNX models (fl.nnx.add_lora, fl.nnx.merge_lora), and parity with Linen's."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def _pair(recipe):
  """The same float MLP served by both APIs' PTQ, with adapters from the same seed."""
  batches = [jax.random.normal(k, (32, 32)) for k in jax.random.split(jax.random.key(0), 2)]
  model = NnxMLP(nnx.Rngs(3))
  params = {"params": {n: {"kernel": getattr(model, n).kernel[...],
                           "bias": getattr(model, n).bias[...]} for n in ("up", "down")}}
  lin = fl.ptq(LinenMLP(), params, batches, recipe=recipe)
  lp = fl.add_lora(lin.served, lin.served_params, batches[0], rank=2, alpha=4.0, seed=7)
  served, _ = fl.nnx.ptq(model, batches, recipe=recipe)
  fl.nnx.add_lora(served, batches[0], rank=2, alpha=4.0, seed=7)
  return model, lin, lp, served, batches


def _set_b(lp, served, scale=0.2):
  """Gives both APIs' ``lora_b`` the same non-zero values."""
  lp = jax.tree.map(lambda x: x, lp)
  for i, name in enumerate(("up", "down")):
    b = scale * jax.random.normal(jax.random.key(i), lp["params"][name]["lora_b"].shape)
    lp["params"][name]["lora_b"] = b
    getattr(served, name).lora_b.set_value(b)
  return lp


def test_both_apis_give_the_same_adapters_outputs_and_gradients():
  _, lin, lp, served, batches = _pair(fl.weight_only(4, granularity="group", group_size=16))
  for name in ("up", "down"):
    layer = getattr(served, name)
    assert isinstance(layer.lora_a, fl.nnx.LoraParam)
    chex.assert_trees_all_equal(layer.lora_a[...], lp["params"][name]["lora_a"])
    assert float(layer.lora_scale[...]) == 2.0
  lp = _set_b(lp, served)
  x = batches[1]
  y_nnx = nnx.jit(lambda m, x: m(x))(served, x)
  chex.assert_trees_all_equal(y_nnx, jax.jit(lin.served.apply)(lp, x))
  adapters, frozen = fl.split_lora(lp)
  g_lin = jax.jit(jax.grad(lambda a: jnp.sum(lin.served.apply(fl.join_lora(a, frozen), x))))(
      adapters)
  g_nnx = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x)),
                           argnums=nnx.DiffState(0, fl.nnx.LoraParam)))(served)
  for name in ("up", "down"):
    for n in ("lora_a", "lora_b"):
      chex.assert_trees_all_close(g_nnx[name][n][...], g_lin["params"][name][n], rtol=1e-6)


def test_qlora_trains_with_nnx_optimizer_and_keeps_the_codes():
  _, _, _, served, batches = _pair(fl.weight_only(4))
  x = batches[1]
  y = jnp.tanh(x[:, :8] * 2.0)
  codes = served.up.kernel[...]
  opt = nnx.Optimizer(served, optax.adam(3e-2), wrt=fl.nnx.LoraParam)

  @nnx.jit
  def step(model, opt):
    loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2),
                                 argnums=nnx.DiffState(0, fl.nnx.LoraParam))(model)
    opt.update(model, g)
    return loss

  losses = [float(step(served, opt)) for _ in range(25)]
  assert losses[-1] < 0.5 * losses[0]
  chex.assert_trees_all_equal(served.up.kernel[...], codes)
  assert served.up.kernel[...].dtype == jnp.int4


def test_merge_matches_linen_and_requantizes():
  model, lin, lp, served, batches = _pair(fl.weight_only(4))
  lp = _set_b(lp, served, scale=0.05)
  merged = fl.nnx.merge_lora(served, model, batches[0])
  linen_merged = fl.merge_lora(lin.served, lp, batches[0])
  for name in ("up", "down"):
    chex.assert_trees_all_equal(getattr(merged, name).kernel[...],
                                linen_merged["params"][name]["kernel"])
    assert getattr(merged, name).kernel[...].dtype == jnp.float32
  # The float model given is untouched; the merged one computes what the LoRA model computes.
  assert not np.array_equal(model.up.kernel[...], merged.up.kernel[...])
  x = batches[1]
  chex.assert_trees_all_close(nnx.jit(lambda m, x: m(x))(merged, x),
                              nnx.jit(lambda m, x: m(x))(served, x), rtol=1e-4, atol=1e-4)
  again, _ = fl.nnx.ptq(merged, batches, recipe=fl.weight_only(4))
  assert again.down.kernel[...].dtype == jnp.int4


def test_bad_arguments_are_named():
  model, _, _, served, batches = _pair(fl.weight_only(8))
  with pytest.raises(TypeError, match="not a served model"):
    fl.nnx.add_lora(model, batches[0])
  with pytest.raises(ValueError, match="already holds LoRA adapters"):
    fl.nnx.add_lora(served, batches[0])
  with pytest.raises(ValueError, match="rank must be a positive int"):
    fl.nnx.add_lora(served, batches[0], rank=-1)
  with pytest.raises(ValueError, match="float_model has no layer '(up|down)'"):
    fl.nnx.merge_lora(served, nnx.Linear(3, 3, rngs=nnx.Rngs(0)), batches[0])
