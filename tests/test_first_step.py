"""``fl.split_first_step`` and ``fl.nnx.split_first_step``: the first steps compiled apart.

The wrapped step must give exactly the values of the step it wraps (the
first step included, where delayed scaling falls back to the batch's amax),
run its steady trace only once every history holds an observation, and
refuse arguments it cannot handle. What the steady trace saves is checked in
the compiled B200 program (``tests/targets/test_passes.py``).
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fp8_linen as fl
from fp8_linen.core import numerics
from fp8_linen.recipes import ScalingConfig

# A first batch a scale of 1 would clip (the fallback to its amax matters), then
# batches larger and smaller than the history has seen.
SCALES = (900.0, 50.0, 3000.0, 3.0)


def _batches(shape=(8, 16)):
  keys = jax.random.split(jax.random.key(0), len(SCALES))
  return [jax.random.normal(k, shape) * s for k, s in zip(keys, SCALES)]


def _linen_setup(tx=None):
  model = fl.QDense(8, recipe=fl.delayed_scaling())
  variables = model.init(jax.random.key(1), jnp.ones((8, 16)))
  state = fl.TrainState.create(apply_fn=model.apply, params=variables,
                               tx=tx or optax.sgd(1e-4))

  def step(state, x, *, scale=1.0):
    # The loss's cotangent depends on the output, so the gradient's amax moves too.
    grads = jax.grad(lambda v: scale * jnp.sum(model.apply(v, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  return state, step


class SplitFirstStepTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_same_values_as_the_step_it_wraps(self):
    state, step = _linen_setup()
    plain, split = self.variant(step), self.variant(fl.split_first_step(step))
    a = b = state
    for i, x in enumerate(_batches()):
      assert bool(fl.histories_ready(b.params)) == (i > 0)
      a, b = plain(a, x, scale=0.5), split(b, x, scale=0.5)
      chex.assert_trees_all_equal(a.params, b.params)
      chex.assert_trees_all_equal(a.opt_state, b.opt_state)
    # The histories hold every batch's amax: the first step's fallback observed it too.
    hist = b.params[fl.OWG]["input_amax_history"]
    assert hist[len(SCALES) - 1] == pytest.approx(float(jnp.max(jnp.abs(_batches()[0]))))


def test_nnx_twin_same_values_and_updates_come_out():
  def make():
    model = fl.nnx.Linear(16, 8, rngs=nnx.Rngs(1), recipe=fl.delayed_scaling())
    return model, fl.nnx.Optimizer(model, optax.sgd(1e-4))

  def step(model, opt, x):
    loss, grads = fl.nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss

  (m1, o1), (m2, o2) = make(), make()
  plain, split = nnx.jit(step), nnx.jit(fl.nnx.split_first_step(step))
  for x in _batches():
    l1, l2 = plain(m1, o1, x), split(m2, o2, x)
    assert float(l1) == float(l2)
    chex.assert_trees_all_equal(nnx.state(m1), nnx.state(m2))
  # The updates of the steady branch reached the module: its history moved every step.
  assert float(m2.input_amax_history[...][0]) == pytest.approx(
      float(jnp.max(jnp.abs(_batches()[-1]))))


def test_histories_ready_reads_the_latest_entry_of_every_history():
  state, step = _linen_setup()
  state = fl.split_first_step(step)(state, _batches()[0])
  assert bool(fl.histories_ready(state))
  owg = dict(state.params[fl.OWG])
  owg["output_grad_amax_history"] = owg["output_grad_amax_history"].at[0].set(0.0)
  assert not bool(fl.histories_ready({**state.params, fl.OWG: owg}))


def test_accumulation_window_state_is_not_read_as_a_history():
  """Under ``optax.MultiSteps`` the TrainState's window max starts at -inf; only the OWG
  collection's histories decide."""
  state, step = _linen_setup(optax.MultiSteps(optax.sgd(1e-4), every_k_schedule=2))
  split = jax.jit(fl.split_first_step(step))
  for x in _batches():
    state = split(state, x)
  assert jax.tree.leaves(state.owg_accum)
  assert bool(fl.histories_ready(state))


def test_observed_histories_take_the_scale_from_the_history_alone():
  cfg = ScalingConfig()
  x = jnp.array([4.0, -1792.0])
  empty, seen = jnp.zeros((4,)), jnp.array([896.0, 0.0, 0.0, 0.0])
  # By default an empty history falls back to this tensor's amax.
  assert numerics.quantize_with(cfg, jnp.ones((1,)), empty, x)[1].tolist() == [4.0]
  with numerics.histories_observed():
    # Steady: the history's scale (or the stored one), never the tensor's amax.
    assert numerics.quantize_with(cfg, jnp.ones((1,)), empty, x)[1].tolist() == [1.0]
    assert numerics.quantize_with(cfg, jnp.ones((1,)), seen, x)[1].tolist() == [2.0]
    # Current scaling is unchanged.
    cur = ScalingConfig(scaling="current")
    assert numerics.quantize_with(cur, jnp.ones((1,)), seen, x)[1].tolist() == [4.0]
  assert numerics.quantize_with(cfg, jnp.ones((1,)), seen, x)[1].tolist() == [2.0]


def test_clear_errors():
  float_model = fl.QDense(4, recipe=fl.IntRecipe())
  v = float_model.init(jax.random.key(0), jnp.ones((2, 3)))
  step = fl.split_first_step(lambda v, x: float_model.apply(v, x))
  with pytest.raises(ValueError, match="no fp8 amax history"):
    step(v, jnp.ones((2, 3)))
  model = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="fl.nnx.split_first_step"):
    fl.split_first_step(lambda m, x: m(x))(model, jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="no fp8 amax history"):
    fl.nnx.split_first_step(lambda x: x)(jnp.ones((2, 3)))
