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


def test_per_device_histories_agree_on_the_branch():
  """Inside ``shard_map`` with histories that vary over a mesh axis, the test is the same on
  every device (a branch holds collectives): steady only where every device's is observed."""
  from fp8_linen.core import owg  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((1,), ("d",))
  spec = jax.sharding.PartitionSpec
  ready = jax.jit(jax.shard_map(lambda h: owg.all_observed([h]), mesh=mesh, in_specs=spec("d"),
                                out_specs=spec()))
  put = lambda h: jax.device_put(h, jax.sharding.NamedSharding(mesh, spec("d")))
  assert bool(ready(put(jnp.array([3.0, 0.0]))))
  assert not bool(ready(put(jnp.array([0.0, 3.0]))))


def test_scanned_rematerialized_layers_same_values():
  """Stacked per-layer histories ((layers, L)) under ``nn.scan`` of ``nn.remat``: each layer's
  latest entry is tested, and the split step gives the plain step's values."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Layer(nn.Module):

    @nn.compact
    def __call__(self, x, _):
      return jnp.tanh(fl.QDense(16, recipe=fl.delayed_scaling())(x)), None

  class Stack(nn.Module):

    @nn.compact
    def __call__(self, x):
      stack = nn.scan(nn.remat(Layer), variable_axes={"params": 0, fl.OWG: 0},
                      split_rngs={"params": True}, length=3)
      return stack()(x, None)[0]

  model = Stack()
  variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
  chex.assert_shape(variables[fl.OWG]["ScanCheckpointLayer_0"]["QDense_0"]["input_amax_history"],
                    (3, 1024))

  def step(v, x):
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v)
    return fl.merge_owg(jax.tree.map(lambda p, g: p - 1e-3 * g, {"params": v["params"]},
                                     {"params": grads["params"]}) | {fl.OWG: v[fl.OWG]}, grads)

  plain, split = jax.jit(step), jax.jit(fl.split_first_step(step))
  a = b = variables
  for x in _batches():
    a, b = plain(a, x), split(b, x)
    # The fp8 state bit for bit; the parameters to the last bits, where XLA:CPU's code for
    # two different programs (here the update under scan and remat) rounds apart.
    chex.assert_trees_all_equal(a[fl.OWG], b[fl.OWG])
    chex.assert_trees_all_close(a["params"], b["params"], atol=1e-6, rtol=0)
  # tanh saturates on the first batch, so one layer's gradient is 0 there: its history is
  # empty and the next step runs the default branch; by the end every one holds an amax.
  assert bool(fl.histories_ready(b))
