"""Fp8Activation: fp8 round trip, e5m2 gradient, state, remat residual bytes."""

import contextlib
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import numerics

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8_e4m3fn": 1, "f8_e5m2": 1, "s32": 4, "u8": 1}


def residual_bytes(fn, *args) -> int:
  """Bytes of the residuals ``fn`` saves for its backward pass, arguments excluded."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  total = 0
  for line in buf.getvalue().splitlines():
    if "from the argument" in line or "from a literal" in line:
      continue
    m = re.match(r"(\w+)\[([\d,]*)\]", line)
    total += _BYTES[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d]))
  return total


class MLP(nn.Module):
  """Dense -> gelu -> Dense; ``mode`` says what is kept for the backward pass."""

  mode: str = "bf16"   # 'bf16' | 'bf16_named' | 'fp8'

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    if self.mode == "fp8":
      keep = lambda h: fl.Fp8Activation()(h)
    elif self.mode == "bf16_named":
      keep = lambda h: jax.ad_checkpoint.checkpoint_name(h, "bf16_act")
    else:
      keep = lambda h: h
    h = nn.Dense(256, **kw)(keep(x))
    h = nn.gelu(keep(h))
    return nn.Dense(64, **kw)(keep(h))


def mlp_residuals(n_tokens=32):
  """Residual bytes of the MLP block: plain bf16, bf16 remat keeping 3 activations, fp8."""
  x = jax.random.normal(jax.random.key(0), (n_tokens, 64), jnp.bfloat16)
  out = {}
  for mode, name in (("bf16", None), ("bf16_named", "bf16_act"),
                     ("fp8", fl.CHECKPOINT_NAME)):
    m = (MLP(mode) if name is None else
         nn.remat(MLP, policy=jax.checkpoint_policies.save_only_these_names(name))(mode))
    v = jax.jit(m.init)(jax.random.key(1), x)
    out[mode] = residual_bytes(lambda v, x: m.apply(v, x), v, x)
  return out


def test_remat_residuals_are_half_of_bf16():
  r = mlp_residuals()
  assert r["fp8"] == 32 * (64 + 256 + 256)          # exactly the three fp8 copies
  assert r["fp8"] <= 0.55 * r["bf16_named"]
  assert r["fp8"] <= 0.55 * r["bf16"]


def test_forward_is_fp8_round_trip_and_grad_is_e5m2():
  q = fl.Fp8Activation()
  x = jax.random.normal(jax.random.key(1), (4, 8)) * 3.0
  # Jitted, the reference qdq too (compared exactly): op by op, each costs a compile.
  v = jax.jit(q.init)(jax.random.key(0), x)
  y = jax.jit(q.apply)(v, x)
  s = numerics.amax(x) / 448.0   # first step: scale from this amax
  # The op divides inside a compiled lax.cond branch (XLA multiplies by the
  # reciprocal: one ulp from an eager division); the values are its scale's.
  s_op = numerics.step_scale(q.recipe.input, jnp.ones((1,)),
                             v[fl.OWG]["input_amax_history"], x)
  np.testing.assert_allclose(s_op, [s], rtol=1e-6)
  np.testing.assert_array_equal(
      y, jax.jit(lambda x, s: numerics.qdq(x, jnp.float8_e4m3fn, s))(x, s_op))
  ct = jax.random.normal(jax.random.key(2), x.shape) * 1e4
  gx, gv = jax.jit(jax.grad(lambda x, v: jnp.sum(q.apply(v, x) * ct), argnums=(0, 1)))(x, v)
  s_g = numerics.amax(ct) / 57344.0
  np.testing.assert_allclose(gx, numerics.qdq(ct, jnp.float8_e5m2, s_g), rtol=1e-6)
  owg = gv[fl.OWG]
  np.testing.assert_allclose(owg["input_amax_history"][0], numerics.amax(x), rtol=1e-6)
  np.testing.assert_allclose(owg["output_grad_scale"][0], s_g, rtol=1e-6)
  assert set(gv[fl.OWG]) == {"input_scale", "input_amax_history", "output_grad_scale",
                             "output_grad_amax_history"}


def test_shared_use_records_max_and_jit_matches_eager():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
      q = fl.Fp8Activation(name="q")
      return jnp.sum(q(a)) + 4.0 * jnp.sum(q(b))

  a = jax.random.normal(jax.random.key(1), (3, 5)) * 7.0
  b = jax.random.normal(jax.random.key(2), (3, 5))
  m = Twice()
  v = jax.jit(m.init)(jax.random.key(0), a, b)  # the eager gradient below is the point
  loss = lambda v: m.apply(v, a, b)
  ge, gj = jax.grad(loss)(v), jax.jit(jax.grad(loss))(v)
  for x, y in zip(jax.tree.leaves(ge), jax.tree.leaves(gj)):
    np.testing.assert_allclose(x, y, rtol=1e-6)
  owg = gj[fl.OWG]["q"]
  np.testing.assert_allclose(owg["input_amax_history"][0], numerics.amax(a), rtol=1e-6)
  np.testing.assert_allclose(owg["output_grad_amax_history"][0], 4.0, rtol=1e-6)  # not 5
  np.testing.assert_allclose(owg["input_scale"][0], numerics.amax(a) / 448.0, rtol=1e-6)


def test_training_under_remat_updates_state():
  m = nn.remat(MLP, policy=jax.checkpoint_policies.save_only_these_names(
      fl.CHECKPOINT_NAME))("fp8")
  x = jax.random.normal(jax.random.key(0), (8, 64), jnp.bfloat16)
  v = jax.jit(m.init)(jax.random.key(1), x)
  g = jax.jit(jax.grad(lambda v: jnp.mean(m.apply(v, x).astype(jnp.float32) ** 2)))(v)
  for i in range(3):
    assert float(g[fl.OWG][f"Fp8Activation_{i}"]["output_grad_amax_history"][0]) > 0


def test_errors():
  with pytest.raises(TypeError, match="floating"):
    fl.Fp8Activation().init(jax.random.key(0), jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="ActivationRecipe.input"):
    fl.ActivationRecipe(input="e4m3")


def test_remat_saved_fp8_values_survive():
  """jax's remat rounds saved float residuals with reduce_precision(4, 3), which
  overflows e4m3fn values >= 256; the fp8 copy must come back bit-exact."""
  x = jnp.arange(1.0, 9.0)   # scaled so that the largest values quantize to 384 and 448
  m = fl.Fp8Activation()
  v = jax.jit(m.init)(jax.random.key(0), x)
  f = lambda v, x: jnp.sum(jnp.sin(m.apply(v, x)))
  pol = jax.checkpoint_policies.save_only_these_names(fl.CHECKPOINT_NAME)
  # Both jitted (compared exactly): op by op, a quantized backward costs seconds.
  g_plain = jax.jit(jax.grad(f, argnums=(0, 1)))(v, x)
  g_remat = jax.jit(jax.grad(jax.checkpoint(f, policy=pol), argnums=(0, 1)))(v, x)
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_array_equal(a, b)
  assert bool(jnp.all(jnp.isfinite(g_remat[1])))
