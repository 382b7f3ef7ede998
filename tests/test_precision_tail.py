"""A precision tail: training goes on in another precision with the same parameters and optimizer.

``fl.switch_precision`` (Linen's train state) and ``fl.nnx.switch_precision``
(an NNX model and its optimizer): after the switch a step equals the step of a
model built in the new precision around the same parameters and optimizer
state; the old recipe's quantization state is replaced by fresh state of the
new one; what cannot follow (another parameter tree, LSQ's learned steps) is
refused by name.
"""

import logging

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as flax_train_state

import fp8_linen as fl

X = jax.random.normal(jax.random.key(1), (16, 32))
Y = jax.random.normal(jax.random.key(2), (16, 8))


class MLP(nn.Module):
  """Two dense layers; quantized by ``fl.quantize_model`` (or left float)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="l2")(jax.nn.relu(nn.Dense(32, name="l1")(x)))


def _loss(v, apply_fn):
  return jnp.mean((apply_fn(v, X) - Y) ** 2)


@jax.jit
def _step(state):
  return state.apply_gradients(grads=jax.grad(_loss)(state.params, state.apply_fn))


def _nvfp4_state(tx=None):
  model = fl.quantize_model(MLP(), fl.nvfp4())
  v = jax.jit(model.init)(jax.random.key(0), X)
  state = fl.TrainState.create(apply_fn=model.apply, params=v, tx=tx or optax.adam(1e-2))
  for _ in range(2):
    state = _step(state)
  return state


def test_linen_bf16_tail_is_the_float_models_step_with_the_same_optimizer_state():
  state = _nvfp4_state()
  tail = MLP()
  switched = fl.switch_precision(state, apply_fn=tail.apply,
                                 variables=tail.init(jax.random.key(9), X))
  assert sorted(switched.params) == ["params"]  # the NVFP4 state is gone
  assert int(switched.step) == 2
  chex.assert_trees_all_equal(switched.params["params"], state.params["params"])
  chex.assert_trees_all_equal(switched.opt_state, state.opt_state)
  after = _step(switched)
  # The same step written with flax's own train state around the float model.
  ref = flax_train_state.TrainState(step=state.step, apply_fn=tail.apply,
                                    params=state.params["params"], tx=state.tx,
                                    opt_state=state.opt_state)
  ref = ref.apply_gradients(grads=jax.grad(
      lambda p: jnp.mean((tail.apply({"params": p}, X) - Y) ** 2))(ref.params))
  chex.assert_trees_all_close(after.params["params"], ref.params, rtol=1e-6, atol=1e-7)
  assert int(after.step) == 3
  # And it trained in float: the NVFP4 model's loss on the same parameters differs.
  assert float(_loss(after.params, tail.apply)) != float(
      _loss({**state.params, "params": after.params["params"]}, state.apply_fn))


def _assert_two_steps_compile_once(caplog, name, step, state):
  """Two steps from ``state`` (``state = step(state)``; ``name``: the jitted
  function's) compile it once.

  Fed a mix of committed and uncommitted arrays, jit compiles a step a second
  time for the all-committed state its first call returns.
  """
  with jax.log_compiles(), caplog.at_level(logging.WARNING):
    for _ in range(2):
      state = step(state)
  compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(")
              and f"{name})" in r.getMessage()[:40]]
  assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]


def test_linen_switch_places_the_new_state_with_the_trained_one_so_a_step_compiles_once(
    caplog):
  device = jax.devices()[0]
  state = jax.device_put(_nvfp4_state(), device)  # as a job's state: committed to its device
  fp8 = fl.quantize_model(MLP(), fl.delayed_scaling())
  fresh = jax.jit(fp8.init)(jax.random.key(9), X)
  assert not any(a.committed for a in jax.tree.leaves(fresh))
  switched = fl.switch_precision(state, apply_fn=fp8.apply, variables=fresh)
  for a in jax.tree.leaves(switched.params):
    assert a.committed and a.sharding.device_set == {device}
  step = jax.jit(_step)
  _assert_two_steps_compile_once(caplog, "_step", step, switched)
  # A state that is not on one device is left where the caller put it.
  loose = fl.switch_precision(_nvfp4_state(), apply_fn=fp8.apply, variables=fresh)
  assert not any(a.committed for a in jax.tree.leaves(loose.params[fl.OWG]))


def test_linen_mxfp8_tail_gets_fresh_state_of_its_own_recipe():
  state = _nvfp4_state(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))
  mx = fl.quantize_model(MLP(), fl.mx_block_scaling())
  fresh = jax.jit(mx.init)(jax.random.key(9), X)
  switched = fl.switch_precision(state, apply_fn=mx.apply, variables=fresh)
  chex.assert_trees_all_equal(switched.params[fl.OWG], fresh[fl.OWG])
  # The accumulation window's state starts over with the new recipe's layout.
  assert jax.tree.structure(switched.owg_accum) == jax.tree.structure(fresh[fl.OWG])
  assert all(bool(jnp.all(a == -jnp.inf)) for a in jax.tree.leaves(switched.owg_accum))
  out = mx.apply({**fresh, "params": state.params["params"]}, X)
  np.testing.assert_array_equal(switched.apply_fn(switched.params, X), out)
  for _ in range(2):
    switched = _step(switched)
  assert int(switched.step) == 4
  assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(switched.params))


def test_linen_refuses_what_the_optimizer_state_cannot_follow():
  state = _nvfp4_state()
  wider = nn.Dense(8)  # another model: no l1/l2
  with pytest.raises(ValueError, match=r"parameters differ.*missing: \['l1/bias'"):
    fl.switch_precision(state, apply_fn=wider.apply, variables=wider.init(jax.random.key(0), X))
  lsq = fl.quantize_model(MLP(), fl.int8_lsq())
  with pytest.raises(ValueError, match=r"unexpected: \['l1/input_step'.*LSQ"):
    fl.switch_precision(state, apply_fn=lsq.apply, variables=lsq.init(jax.random.key(0), X))
  with pytest.raises(TypeError, match="fp8_linen TrainState"):
    fl.switch_precision(flax_train_state.TrainState.create(
        apply_fn=None, params=state.params, tx=optax.sgd(1.0)), apply_fn=None, variables={})
  bn = {**state.params, "batch_stats": {"mean": jnp.zeros(3)}}
  with pytest.raises(ValueError, match=r"no collection \['batch_stats'\]"):
    fl.switch_precision(state.replace(params=bn), apply_fn=MLP().apply,
                        variables=MLP().init(jax.random.key(0), X))


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(32, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


@nnx.jit
def _nnx_step(model, opt):
  loss, grads = fl.nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
  opt.update(model, grads)
  return loss


def _nnx_nvfp4():
  model = fl.nnx.quantize_model(NnxMLP(nnx.Rngs(0)), fl.nvfp4())
  opt = fl.nnx.Optimizer(model, optax.adam(1e-2))
  for _ in range(2):
    _nnx_step(model, opt)
  return model, opt


def test_nnx_bf16_tail_keeps_the_variables_and_the_optimizer_state(same_step_as_flax):
  model, opt = _nnx_nvfp4()
  kernel = model.l1.kernel
  new, new_opt = fl.nnx.switch_precision(model, opt)
  assert type(new.l1) is nnx.Linear and type(new.l2) is nnx.Linear
  assert new.l1.kernel is kernel  # the very same variable
  assert not jax.tree.leaves(nnx.state(new, fl.nnx.QuantState))
  assert int(new_opt.step[...]) == 2
  # The reference: a float model and flax's optimizer around copies of the same values.
  same_step_as_flax(new, new_opt, opt, lambda m: jnp.mean((m(X) - Y) ** 2), optax.adam(1e-2))
  assert int(new_opt.step[...]) == 3


def test_nnx_switch_places_the_new_state_with_the_trained_one_so_a_step_compiles_once(caplog):
  device = jax.devices()[0]
  model, opt = _nnx_nvfp4()
  nnx.update(model, jax.device_put(nnx.state(model), device))
  nnx.update(opt, jax.device_put(nnx.state(opt), device))
  new, new_opt = fl.nnx.switch_precision(model, opt, fl.current_scaling())
  for a in jax.tree.leaves(nnx.state(new)):
    assert a.committed and a.sharding.device_set == {device}
  _assert_two_steps_compile_once(  # the NNX step updates the model in place
      caplog, "_nnx_step", lambda m: (_nnx_step(m, new_opt), m)[1], new)


def test_nnx_mxfp8_tail_and_refusals():
  model, opt = _nnx_nvfp4()
  mx = fl.mx_block_scaling()
  new, new_opt = fl.nnx.switch_precision(
      model, opt, mx, rules=[fl.QuantizationRule(module_path="l2", quantize=False),
                             fl.QuantizationRule(module_path=".*")])
  assert type(new.l1) is fl.nnx.Linear and new.l1.recipe == mx
  assert type(new.l2) is nnx.Linear
  assert float(jnp.max(new.l1.input_amax_history[...])) == 0.0  # fresh state
  _nnx_step(new, new_opt)
  assert int(new_opt.step[...]) == 3
  with pytest.raises(ValueError, match="rules need a recipe"):
    fl.nnx.switch_precision(model, opt, rules=[fl.QuantizationRule(module_path=".*")])
  with pytest.raises(ValueError, match=r"added: \['l1/input_step'.*LSQ"):
    fl.nnx.switch_precision(model, opt, fl.int8_lsq())
  lsq = fl.nnx.quantize_model(NnxMLP(nnx.Rngs(0)), fl.int8_lsq())
  with pytest.raises(ValueError, match=r"layer 'l1' learns quantizer parameters"):
    fl.nnx.switch_precision(lsq, fl.nnx.Optimizer(lsq, optax.sgd(0.1)))
