"""Every NNX transform around a quantized layer: max of uses, or a clear error.

The NNX mirror of ``tests/linen/test_transforms.py``: a ``fl.nnx.Linear``
trained for 20 steps with ``fl.nnx.Optimizer`` under each transform records
the max of its uses in its input history (bounded over the soak), or raises
:class:`~fp8_linen.core.uses.StateUseError` where a loop would add its
iterations' state updates.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl
from fp8_linen.core.uses import StateUseError

R = fl.delayed_scaling(history_length=4)
STEPS = 20
X = jax.random.normal(jax.random.key(1), (4, 8))
AMAX = float(jnp.max(jnp.abs(X)))


def _linear(seed=0):
  return fl.nnx.Linear(8, 8, recipe=R, rngs=nnx.Rngs(seed))


def _train(model, forward, steps=STEPS):
  """``model``'s input histories after ``steps`` jitted steps (learning rate 0)."""
  opt = fl.nnx.Optimizer(model, optax.sgd(0.0))

  @nnx.jit
  def step(model, opt, x):
    _, grads = fl.nnx.value_and_grad(lambda m: jnp.mean(forward(m, x) ** 2))(model)
    opt.update(model, grads)

  for _ in range(steps):
    step(model, opt, X)
  return [np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, fl.nnx.QuantState))
          if str(p[-1]) == "input_amax_history"]


def _scan_broadcast(m, x):
  @nnx.scan(in_axes=(None, nnx.Carry), out_axes=nnx.Carry, length=3)
  def body(m, c):
    return m(c)
  return body(m, x)


def _scan_module_as_carry(m, x):
  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
  def body(mc, xs):
    m, c = mc
    return (m, m(c)), xs
  return body((m, x), jnp.ones((3, 2)))[0][1]


def _fori(m, x):
  return nnx.fori_loop(0, 3, lambda i, mc: (mc[0], mc[0](mc[1])), (m, x))[1]


@pytest.mark.parametrize("forward, amax", [
    (lambda m, x: m(x), AMAX),
    (lambda m, x: m(x) + m(3.0 * x), 3 * AMAX),
    (lambda m, x: nnx.jit(lambda m, x: m(x))(m, x), AMAX),
    (lambda m, x: nnx.remat(lambda m, x: m(x))(m, x), AMAX),
    (lambda m, x: jax.checkpoint(lambda x: m(x))(x), AMAX),
    (lambda m, x: m(x) + jax.checkpoint(lambda x: m(2.0 * x))(x), 2 * AMAX),
    (lambda m, x: nnx.vmap(lambda m, r: m(r), in_axes=(None, 0))(m, x), AMAX),
    (lambda m, x: jax.vmap(lambda r: m(r))(x), AMAX),
    (lambda m, x: nnx.cond(True, lambda m, x: m(2.0 * x), lambda m, x: m(x), m, x), 2 * AMAX),
], ids=["plain", "twice", "nnx.jit", "nnx.remat", "raw-jax.checkpoint",
        "outside-then-checkpoint", "nnx.vmap-shared-state", "raw-jax.vmap", "nnx.cond"])
def test_state_records_the_max_of_its_uses_and_stays_bounded(forward, amax):
  (hist,) = _train(_linear(), forward)
  np.testing.assert_allclose(hist, np.full_like(hist, amax), rtol=1e-6)


def test_scan_over_stacked_layers_keeps_one_state_per_layer():
  @nnx.vmap(in_axes=0, out_axes=0)
  def stack(key):
    return fl.nnx.Linear(8, 8, recipe=R, rngs=nnx.Rngs(params=key))

  def forward(layers, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, c):
      return jnp.tanh(layer(c))
    return body(layers, x)

  (hist,) = _train(stack(jax.random.split(jax.random.key(0), 3)), forward)
  chex.assert_shape(hist, (3, 4))
  assert float(hist[0, 0]) == pytest.approx(AMAX)
  for row in hist:
    np.testing.assert_allclose(row, np.full_like(row, row[0]), rtol=1e-6)
  assert np.all(hist <= AMAX * 1.01)


def test_vmapped_layers_with_their_own_state_record_their_own_rows():
  @nnx.vmap(in_axes=0, out_axes=0)
  def ensemble(key):
    return fl.nnx.Linear(8, 8, recipe=R, rngs=nnx.Rngs(params=key))

  forward = lambda m, x: nnx.vmap(lambda m, r: m(r), in_axes=(0, 0))(m, x)  # noqa: E731
  (hist,) = _train(ensemble(jax.random.split(jax.random.key(0), 4)), forward, steps=3)
  rows = np.asarray(jnp.max(jnp.abs(X), axis=1))
  np.testing.assert_allclose(hist[:, :3], np.repeat(rows[:, None], 3, axis=1), rtol=1e-6)


@pytest.mark.parametrize("forward", [_scan_broadcast, _scan_module_as_carry, _fori],
                         ids=["nnx.scan-broadcast", "nnx.scan-module-carry", "nnx.fori_loop"])
def test_loops_carrying_the_state_raise_naming_the_fix(forward):
  with pytest.raises(StateUseError, match=r"Linear is applied inside .*carry.*in_axes=0"):
    _train(_linear(), forward, steps=1)


def test_sibling_raw_checkpoints_raise():
  def forward(m, x):
    return jax.checkpoint(lambda x: m(x))(x) + jax.checkpoint(lambda x: m(2.0 * x))(x)

  with pytest.raises(StateUseError, match="two JAX traces"):
    _train(_linear(), forward, steps=1)


def test_evaluation_in_a_loop_does_not_raise():
  model = _linear()
  model.eval()
  y = nnx.jit(_scan_broadcast)(model, X)
  chex.assert_shape(y, X.shape)


def test_nnx_model_in_a_linen_bridge_trains_with_train_state():
  from flax.nnx import bridge  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.a = fl.nnx.Linear(8, 8, recipe=R, rngs=rngs)
      self.b = fl.nnx.Linear(8, 4, recipe=R, rngs=rngs)

    def __call__(self, x):
      return self.b(self.a(x))

  class Outer(nn.Module):

    @nn.compact
    def __call__(self, x):
      return bridge.ToLinen(Net, args=())(x)

  model = Outer()
  v = jax.jit(model.init)(jax.random.key(0), X)  # op by op, a quantized init costs seconds
  state = fl.TrainState.create(apply_fn=model.apply, params=v, tx=optax.sgd(0.0))

  @jax.jit
  def step(state):
    g = jax.grad(lambda p: jnp.mean(state.apply_fn(p, X) ** 2))(state.params)
    return state.apply_gradients(grads=g)

  for _ in range(STEPS):
    state = step(state)
  hist = np.asarray(state.params[fl.OWG]["ToLinen_0"]["a"]["input_amax_history"])
  np.testing.assert_allclose(hist, np.full_like(hist, AMAX), rtol=1e-6)


def test_a_stateless_recipe_keeps_no_state_and_trains_through_a_raw_scan():
  model = fl.nnx.Linear(8, 8, recipe=fl.current_scaling(history_length=0), rngs=nnx.Rngs(0))
  assert not jax.tree.leaves(nnx.state(model, fl.nnx.QuantState))
  opt = fl.nnx.Optimizer(model, optax.sgd(0.1))

  def loss(m):
    return jnp.mean(jax.lax.scan(lambda c, _: (m(c), None), X, None, length=3)[0] ** 2)

  @nnx.jit
  def step(m, opt):
    value, grads = nnx.value_and_grad(loss)(m)
    opt.update(m, grads)
    return value

  first = step(model, opt)
  for _ in range(3):
    last = step(model, opt)
  assert float(last) < float(first)
  # fp8, not float: the layer's output differs from a float product with its kernel.
  y = nnx.jit(lambda m, x: m(x))(model, X)
  assert not np.allclose(np.asarray(y), np.asarray(X @ model.kernel[...] + model.bias[...]),
                         atol=1e-6)
