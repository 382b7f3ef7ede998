"""Tests for the Linen layers in fp8_linen.layers."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl


def rand(shape, seed, scale=1.0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


@pytest.mark.parametrize("kw", [dict(), dict(use_bias=False),
                                dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)])
def test_qdense_params_tree_matches_nn_dense(kw):
  x = jnp.ones((2, 3, 5))
  # Both jitted (the kernels are compared exactly): an eager quantized init costs seconds.
  vd = jax.jit(nn.Dense(7, **kw).init)(jax.random.key(0), x)
  vq = jax.jit(fl.QDense(7, **kw).init)(jax.random.key(0), x)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), vd["params"]) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), vq["params"])
  np.testing.assert_array_equal(vd["params"]["kernel"], vq["params"]["kernel"])  # same init
  owg = vq[fl.OWG]
  assert sorted(owg) == sorted(f"{r}_{k}" for r in fl.ROLES for k in ("scale", "amax_history"))
  assert owg["input_scale"].shape == (1,) and owg["input_amax_history"].shape == (1024,)
  assert all(v.dtype == jnp.float32 for v in owg.values())


def test_nn_dense_checkpoint_loads_into_qdense_and_matches_on_representable_inputs():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(-8, 9, size=(4, 16)) * 0.25, jnp.float32)
  dense = nn.Dense(6)
  params = dense.init(jax.random.key(1), x)["params"]
  params = {"kernel": jnp.asarray(rng.integers(-8, 9, size=(16, 6)) * 0.5, jnp.float32),
            "bias": params["bias"] + 1.0}
  q = fl.QDense(6)
  owg = dict(jax.jit(q.init)(jax.random.key(0), x)[fl.OWG])
  # Histories that give power-of-two scales (1/64 and 1/16): every x/s and w/s
  # is then representable in e4m3 and the fp8 product is exact.
  owg["input_amax_history"] = owg["input_amax_history"].at[0].set(448.0 / 64)
  owg["kernel_amax_history"] = owg["kernel_amax_history"].at[0].set(448.0 / 16)
  y_ref = dense.apply({"params": params}, x)
  y_q = jax.jit(q.apply)({"params": params, fl.OWG: owg}, x)
  np.testing.assert_array_equal(y_q, y_ref)


def test_dot_general_cls_injection_equals_qdense():
  x = rand((4, 8), 0)
  inj = nn.Dense(5, dot_general_cls=fl.Fp8DotGeneral)
  q = fl.QDense(5)
  # Both sides jitted (compared exactly): op by op, a quantized backward costs seconds.
  vi = jax.jit(inj.init)(jax.random.key(0), x)
  vq = jax.jit(q.init)(jax.random.key(0), x)
  ct = rand((4, 5), 1)
  gi = jax.jit(jax.grad(lambda v: jnp.sum(inj.apply(v, x) * ct)))(vi)
  gq = jax.jit(jax.grad(lambda v: jnp.sum(q.apply(v, x) * ct)))(vq)
  np.testing.assert_array_equal(jax.jit(inj.apply)(vi, x), jax.jit(q.apply)(vq, x))
  np.testing.assert_array_equal(gi["params"]["kernel"], gq["params"]["kernel"])
  for k, v in gq[fl.OWG].items():
    np.testing.assert_array_equal(gi[fl.OWG]["Fp8DotGeneral_0"][k], v)
  custom = functools.partial(fl.Fp8DotGeneral, recipe=fl.delayed_scaling(16))
  v = jax.eval_shape(nn.Dense(5, dot_general_cls=custom).init, jax.random.key(0), x)
  assert v[fl.OWG]["Fp8DotGeneral_0"]["kernel_amax_history"].shape == (16,)


class SharedTwice(nn.Module):
  @nn.compact
  def __call__(self, x):
    d = fl.QDense(4, use_bias=False, name="shared")
    return d(x), d(10.0 * x)


@pytest.mark.parametrize("use_jit", [False, True])
def test_module_used_twice_records_max_not_sum(use_jit):
  m = SharedTwice()
  x = rand((3, 6), 0)
  v = jax.jit(m.init)(jax.random.key(0), x)

  def loss(v):
    a, b = m.apply(v, x)
    return jnp.sum(a * 2.0) + jnp.sum(b * 5.0)

  g = (jax.jit(jax.grad(loss)) if use_jit else jax.grad(loss))(v)[fl.OWG]["shared"]
  xa = float(jnp.abs(x).max())
  assert float(g["input_amax_history"][0]) == pytest.approx(10 * xa, rel=1e-6)
  kmax = float(jnp.abs(v["params"]["shared"]["kernel"]).max())
  assert float(g["kernel_amax_history"][0]) == pytest.approx(kmax)  # the sum would be 2x
  assert float(g["output_grad_amax_history"][0]) == 5.0
  np.testing.assert_allclose(g["kernel_scale"], [kmax / 448.0], rtol=1e-6)
  assert float(jnp.sum(g["input_amax_history"][1:])) == 0.0


def test_qdense_bf16_forward_and_grads():
  x = rand((8, 32), 0, dtype=jnp.bfloat16)
  q = fl.QDense(16, dtype=jnp.bfloat16)
  # Jitted: op by op, a quantized backward costs seconds.
  v = jax.jit(q.init)(jax.random.key(0), x)
  y = jax.jit(q.apply)(v, x)
  assert y.dtype == jnp.bfloat16
  ref = nn.Dense(16, dtype=jnp.float32).apply({"params": v["params"]}, x.astype(jnp.float32))
  err = float(jnp.abs(y.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
  assert err < 0.1  # e4m3 has 3 mantissa bits
  g = jax.jit(jax.grad(lambda v: jnp.sum(q.apply(v, x).astype(jnp.float32))))(v)
  assert g["params"]["kernel"].dtype == jnp.float32
  assert all(np.all(np.isfinite(np.asarray(l))) for l in jax.tree.leaves(g))


class ScannedMLP(nn.Module):
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    block = nn.scan(Block, variable_axes={"params": 0, fl.OWG: 0},
                    split_rngs={"params": True}, length=self.layers)
    x, _ = block(name="blocks")(x, None)
    return x


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(fl.QDense(x.shape[-1], name="dense")(x)), None


def test_nn_scan_keeps_per_layer_state():
  x = rand((4, 8), 0, 3.0)
  m = ScannedMLP()
  v = jax.jit(m.init)(jax.random.key(0), x)
  owg = v[fl.OWG]["blocks"]["dense"]
  assert owg["input_amax_history"].shape == (3, 1024) and owg["input_scale"].shape == (3, 1)
  g = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2)))(v)[fl.OWG]["blocks"]["dense"]
  # Layer 0 sees x; layers 1 and 2 see tanh outputs (amax < 1).
  first = g["input_amax_history"][:, 0]
  assert float(first[0]) == pytest.approx(float(jnp.abs(x).max()))
  assert np.all(np.asarray(first[1:]) < 1.0) and np.all(np.asarray(first[1:]) > 0)
  # Layer 1's state equals that of one QDense run on layer 0's output.
  k = v["params"]["blocks"]["dense"]
  h0 = jnp.tanh(jax.jit(fl.QDense(8).apply)({"params": jax.tree.map(lambda a: a[0], k),
                                    fl.OWG: jax.tree.map(lambda a: a[0], owg)}, x))
  assert float(first[1]) == pytest.approx(float(jnp.abs(h0).max()), rel=1e-6)


def test_nn_remat_gives_same_gradients():
  class Net(nn.Module):
    remat: bool

    @nn.compact
    def __call__(self, x):
      cls = nn.remat(fl.QDense) if self.remat else fl.QDense
      return cls(8, name="b")(jax.nn.relu(cls(8, name="a")(x)))

  x, ct = rand((4, 8), 0), rand((4, 8), 1)
  v = jax.jit(Net(False).init)(jax.random.key(0), x)
  grads = [jax.jit(jax.grad(lambda v, r=r: jnp.sum(Net(r).apply(v, x) * ct)))(v)
           for r in (False, True)]
  jax.tree.map(np.testing.assert_array_equal, grads[0], grads[1])


def test_layer_errors_are_clear():
  with pytest.raises(TypeError, match="floating"):
    fl.QDense(3).init(jax.random.key(0), jnp.ones((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="dot_general_cls"):
    fl.QDense(3, dot_general_cls=fl.Fp8DotGeneral).init(jax.random.key(0), jnp.ones((2, 4)))
  with pytest.raises(ValueError, match="features"):
    fl.QDense(0).init(jax.random.key(0), jnp.ones((2, 4)))
  with pytest.raises(TypeError, match="not a recipe"):
    fl.QDense(3, recipe="fp8").init(jax.random.key(0), jnp.ones((2, 4)))


def test_history_length_mismatch_is_reported():
  x = jnp.ones((2, 4))
  v = jax.jit(fl.QDense(3).init)(jax.random.key(0), x)
  short = fl.QDense(3, recipe=fl.delayed_scaling(16))
  with pytest.raises(ValueError, match="history_length=16"):
    jax.eval_shape(short.apply, v, x)  # raised while tracing; no need to run it
