"""fl.nnx.Fp8Einsum: flax's Fp8Einsum call for NNX, bit for bit with the Linen fl.Fp8Einsum."""

import inspect

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl
import fp8_linen.nnx as fnnx

EQ = "bqhd,bkhd->bhqk"
RECIPES = {
    "delayed": fl.delayed_scaling(8),
    "current": fl.current_scaling(),
    "rowwise": fl.rowwise_scaling(),
    "mx": fl.mx_block_scaling(block_size=8),
    "int8_ste": fl.IntRecipe(),
}


def operands(seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(2, 3, 2, 8)), jnp.float32),
          jnp.asarray(rng.normal(size=(2, 5, 2, 8)), jnp.float32))


def test_call_signature_is_flax_s():
  ours = list(inspect.signature(fnnx.Fp8Einsum.__call__).parameters)
  assert ours == ["self", "eqn", "lhs", "rhs", "precision", "preferred_element_type"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_matches_linen_fp8einsum_bit_for_bit(name):
  recipe = RECIPES[name]
  lhs, rhs = operands()
  ct = jax.random.normal(jax.random.key(3), (2, 2, 3, 5))
  linen = fl.Fp8Einsum(recipe=recipe)
  v = jax.jit(lambda k, l, r: linen.init(k, EQ, l, r))(jax.random.key(0), lhs, rhs)
  if fl.OWG in v:  # a used state, so delayed scaling reads its history
    v = {fl.OWG: {k: (jnp.linspace(0.5, 2.0, a.shape[0]) if k.endswith("history") else a)
                  for k, a in v[fl.OWG].items()}}
  model = fnnx.Fp8Einsum(recipe=recipe)
  for k, a in v.get(fl.OWG, {}).items():
    getattr(model, k)[...] = a

  # Both sides jitted (compared bit for bit): op by op, a quantized backward costs seconds.
  y_l, (g_l, dl_l, dr_l) = jax.jit(jax.value_and_grad(
      lambda v, l, r: jnp.sum(linen.apply(v, EQ, l, r) * ct), argnums=(0, 1, 2)))(v, lhs, rhs)
  y_n, (g_n, dl_n, dr_n) = nnx.jit(nnx.value_and_grad(
      lambda m, l, r: jnp.sum(m(EQ, l, r) * ct),
      argnums=(nnx.DiffState(0, fnnx.DIFF), 1, 2)))(model, lhs, rhs)
  np.testing.assert_array_equal(y_l, y_n)
  np.testing.assert_array_equal(dl_l, dl_n)
  np.testing.assert_array_equal(dr_l, dr_n)
  g_n = nnx.to_pure_dict(g_n)
  assert set(g_n) == set(g_l.get(fl.OWG, {}))
  for k, a in g_l.get(fl.OWG, {}).items():
    np.testing.assert_array_equal(a, g_n[k], err_msg=k)


class Attention(nnx.Module):
  """Self-attention whose two einsums are fl.nnx.Fp8Einsum, through flax's attention function."""

  def __init__(self, d, heads, recipe, rngs):
    self.qkv = nnx.LinearGeneral(d, (3, heads, d // heads), rngs=rngs)
    self.out = nnx.LinearGeneral((heads, d // heads), d, axis=(-2, -1), rngs=rngs)
    self.qk = fnnx.Fp8Einsum(recipe=recipe)
    self.pv = fnnx.Fp8Einsum(recipe=recipe)

  def __call__(self, x):
    qkv = self.qkv(x)
    y = nn.dot_product_attention(qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :],
                                 qk_attn_weights_einsum=self.qk,
                                 attn_weights_value_einsum=self.pv)
    return self.out(y)


def test_attention_trains_with_the_nnx_optimizer():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
  target = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
  model = Attention(16, 2, fl.delayed_scaling(16), nnx.Rngs(0))
  opt = fnnx.Optimizer(model, optax.adam(1e-2))

  @nnx.jit
  def train_step(model, opt):
    loss, grads = fnnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(train_step(model, opt)) for _ in range(6)]
  assert losses[-1] < losses[0], losses
  for einsum in (model.qk, model.pv):
    h = einsum.input_amax_history[...]
    assert float(h[0]) > 0 and float(h[5]) > 0 and float(h[6]) == 0  # 6 steps, newest first
    assert float(einsum.output_grad_amax_history[...][0]) > 0


def test_attention_output_close_to_float():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 16)), jnp.float32)
  model = Attention(16, 2, fl.current_scaling(), nnx.Rngs(0))

  def reference(model, x):
    qkv = model.qkv(x)
    return model.out(nn.dot_product_attention(qkv[..., 0, :, :], qkv[..., 1, :, :],
                                              qkv[..., 2, :, :]))

  # Jitted: op by op, a quantized forward costs seconds.
  y = nnx.jit(lambda m, x: m(x))(model, x)
  ref = nnx.jit(reference)(model, x)
  chex.assert_shape(y, ref.shape)
  assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.1


def test_use_running_average_freezes_the_state():
  lhs, rhs = operands()
  model = fnnx.Fp8Einsum(recipe=fl.delayed_scaling(8), use_running_average=True)
  model.input_amax_history[...] = jnp.full((8,), 2.0)
  # Jitted: op by op, a quantized backward costs seconds.
  _, g = nnx.jit(fnnx.value_and_grad(lambda m: jnp.sum(m(EQ, lhs * 10, rhs))))(model)
  np.testing.assert_array_equal(g["input_amax_history"][...], jnp.full((8,), 2.0))


def test_lsq_input_is_calibrated_and_learned_kernel_is_refused():
  lhs, rhs = operands()
  lsq_input = fl.IntRecipe(input=fl.IntQuantConfig(estimator="lsq"))
  model = fnnx.Fp8Einsum(recipe=lsq_input)
  assert model.input_step[...].shape == (1,)
  fnnx.calibrate(model, EQ, lhs, rhs)
  assert float(model.input_step[...][0]) != 1.0  # set from the batch
  # The shape only, traced: op by op, a quantized forward costs seconds.
  assert nnx.eval_shape(lambda m, l, r: m(EQ, l, r), model, lhs, rhs).shape == (2, 2, 3, 5)
  with pytest.raises(ValueError, match=r"Fp8Einsum: recipe's kernel quantizer is learned "
                     r"\(lsq\).*estimator='ste'"):
    fnnx.Fp8Einsum(recipe=fl.int8_lsq())
  with pytest.raises(TypeError, match=r"Fp8Einsum: recipe='delayed' is not a recipe it takes.*"
                     r"accepted: Fp8Recipe or Fp8WeightOnly or IntRecipe"):
    fnnx.Fp8Einsum(recipe="delayed")
  with pytest.raises(TypeError, match=r"Fp8Einsum: eqn=None must be an einsum equation"):
    fnnx.Fp8Einsum()(None, lhs, rhs)


def test_state_is_quant_state_under_linen_names():
  names = sorted(nnx.to_pure_dict(nnx.state(fnnx.Fp8Einsum(), fnnx.QuantState)))
  assert names == sorted(f"{r}_{k}" for r in fl.ROLES for k in ("scale", "amax_history"))
  assert "Fp8Einsum" in fnnx.__all__
