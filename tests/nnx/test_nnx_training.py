"""fl.nnx in training: accumulation, nnx.scan, nnx.remat, data parallel, NaN, orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fp8_linen as fl
import fp8_linen.nnx as fnnx


def _x(shape, seed=1, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def _pure(model, kind=fnnx.QuantState):
  return nnx.as_pure(nnx.state(model, kind))


def _assert_trees_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_multisteps_advances_history_once_per_optimizer_step():
  model = fnnx.Linear(4, 2, rngs=nnx.Rngs(0))
  opt = fnnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  kernel0 = model.kernel[...]

  @nnx.jit
  def step(model, opt, x):
    opt.update(model, fnnx.grad(lambda m: m(x).sum())(model))

  step(model, opt, jnp.full((1, 4), 3.0))
  assert model.input_amax_history[...].tolist()[:2] == [0.0, 0.0]  # held during accumulation
  np.testing.assert_array_equal(model.kernel[...], kernel0)
  step(model, opt, jnp.full((1, 4), 5.0))
  assert model.input_amax_history[...].tolist()[:2] == [5.0, 0.0]  # max of the two, once
  step(model, opt, jnp.full((1, 4), 2.0))
  step(model, opt, jnp.full((1, 4), 1.0))
  assert model.input_amax_history[...].tolist()[:3] == [2.0, 5.0, 0.0]


class Block(nnx.Module):

  def __init__(self, d, rngs):
    self.q = fnnx.Quantizer()
    self.dense = fnnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.dense(self.q(x)))


def test_scan_over_layers_records_each_layers_state():
  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return fnnx.Linear(8, 8, rngs=rngs)

  layers = make(nnx.Rngs(0))
  x = _x((2, 8))

  def loss(layers):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, layer):
      return layer(h)

    return body(x, layers).sum()

  opt = fnnx.Optimizer(layers, optax.sgd(0.01))
  _, grads = nnx.jit(fnnx.value_and_grad(loss))(layers)
  opt.update(layers, grads)
  hist = layers.input_amax_history[...]
  assert hist.shape == (3, fl.Fp8Recipe().input.history_length)
  assert float(hist[0, 0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
  assert (hist[:, 0] > 0).all() and len(set(hist[:, 0].tolist())) == 3
  assert float(layers.output_grad_amax_history[...][2, 0]) == 1.0  # the last layer's cotangent


def test_remat_matches_plain_and_updates_state():
  x = _x((4, 16))
  policy = jax.checkpoint_policies.save_only_these_names(fl.CHECKPOINT_NAME)

  def run(remat):
    block = Block(16, nnx.Rngs(0))
    call = nnx.remat(lambda b, x: b(x), policy=policy) if remat else (lambda b, x: b(x))
    grads = nnx.jit(fnnx.grad(lambda b: call(b, x).sum()))(block)
    fnnx.update_state(block, grads)
    return grads, block

  g_plain, b_plain = run(False)
  g_remat, b_remat = run(True)
  _assert_trees_equal(nnx.as_pure(g_plain), nnx.as_pure(g_remat))
  _assert_trees_equal(_pure(b_plain), _pure(b_remat))
  assert float(b_remat.q.input_amax_history[...][0]) == pytest.approx(
      float(jnp.max(jnp.abs(x))))


def test_data_parallel_sharded_batch_records_global_max():
  assert jax.device_count() == 8
  mesh = Mesh(np.array(jax.devices()), ("data",))
  x = _x((16, 8)).at[13, 2].set(40.0)  # the max lives on one device's shard only

  def train(x):
    model = fnnx.Linear(8, 4, rngs=nnx.Rngs(0))
    opt = fnnx.Optimizer(model, optax.sgd(0.1))

    @nnx.jit
    def step(model, opt, x):
      loss, grads = fnnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
      opt.update(model, grads)
      return loss

    step(model, opt, x)
    return model

  sharded = train(jax.device_put(x, NamedSharding(mesh, P("data"))))
  single = train(x)
  assert float(sharded.input_amax_history[...][0]) == 40.0
  _assert_trees_equal(_pure(sharded), _pure(single))


@nnx.jit
def _update_state(model, x):
  """Jitted: op by op, a quantized backward costs seconds."""
  fnnx.update_state(model, fnnx.grad(lambda m: m(x).sum())(model))


def test_nan_batch_never_enters_the_state():
  model = fnnx.Linear(4, 4, rngs=nnx.Rngs(0))
  _update_state(model, _x((2, 4)))
  good = _pure(model)
  bad = _x((2, 4)).at[0, 0].set(jnp.nan)
  _update_state(model, bad)
  for v in jax.tree.leaves(_pure(model)):
    assert np.isfinite(v).all()
  np.testing.assert_array_equal(model.input_scale[...], good["input_scale"])
  assert float(model.input_amax_history[...][0]) == 0.0  # a non-finite amax counts as 0


def test_orbax_round_trip_is_exact(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  model = nnx.Sequential(fnnx.Quantizer(), fnnx.Linear(8, 4, rngs=nnx.Rngs(0)))
  opt = fnnx.Optimizer(model, optax.adam(1e-2))

  @nnx.jit  # op by op, a quantized backward costs seconds
  def step(model, opt, x):
    _, grads = fnnx.value_and_grad(lambda m: m(x).sum())(model)
    opt.update(model, grads)

  step(model, opt, _x((2, 8)))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", nnx.state(model))
  ckpt.wait_until_finished()
  fresh = nnx.Sequential(fnnx.Quantizer(), fnnx.Linear(8, 4, rngs=nnx.Rngs(7)))
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: fresh))
  restored = ckpt.restore(tmp_path / "state", abstract)
  nnx.update(fresh, restored)
  _assert_trees_equal(nnx.as_pure(nnx.state(model)), nnx.as_pure(nnx.state(fresh)))
  assert float(fresh.layers[1].input_amax_history[...][0]) > 0
