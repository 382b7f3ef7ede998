"""fl.frozen_quantizers: evaluation reads the quantization state and never changes it.

Training mode folds every batch into an STE observer's range and records the
amaxes of every fp8 role; under frozen quantizers the forward quantizes with
the recorded state only (a batch beyond it is clipped) and, differentiated,
returns the state as it was, so ``fl.merge_owg`` leaves it unchanged.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl

RECIPES = {
    "fp8_delayed": fl.Fp8Recipe(),
    "fp8_current": fl.current_scaling(),
    "fp8_rowwise": fl.rowwise_scaling(),
    "int8_ste_minmax": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel")),
    "int8_ste_moving_average": fl.IntRecipe(
        input=fl.IntQuantConfig(observer="moving_average", momentum=0.9)),
    "int8_ste_asym": fl.IntRecipe(input=fl.IntQuantConfig(symmetric=False)),
    "int8_lsq": fl.int8_lsq(),
}


def _model(recipe):
  return nn.Sequential([fl.QDense(16, recipe=recipe), nn.relu, fl.Fp8Activation(),
                        fl.QConv(4, (3,), recipe=recipe) if recipe.__class__ is fl.IntRecipe
                        or recipe.granularity == "tensor" else fl.QDense(4, recipe=recipe)])


def _loss(model, v, x):
  return jnp.sum(model.apply(v, x) ** 2)


def _train_grad(model):
  """The training-mode gradient, jitted: op by op, a quantized backward costs seconds."""
  return jax.jit(jax.grad(functools.partial(_loss, model)))


def _trained(model, shape, grad):
  keys = jax.random.split(jax.random.key(0), 4)
  v = jax.jit(model.init)(keys[3], jax.random.normal(keys[0], shape))
  for k in keys[:3]:
    v = fl.merge_owg(v, grad(v, jax.random.normal(k, shape)))
  return v


@pytest.mark.parametrize("name", list(RECIPES))
def test_frozen_gradients_return_the_state_unchanged(name):
  model = _model(RECIPES[name])
  shape = (4, 6, 16)
  train_grad = _train_grad(model)   # one program for the training steps and the check below
  v = _trained(model, shape, train_grad)
  big = 10.0 * jax.random.normal(jax.random.key(9), shape)  # beyond every recorded range

  @jax.jit
  def frozen_grad(v, x):
    with fl.frozen_quantizers():
      return jax.grad(functools.partial(_loss, model))(v, x)

  g = frozen_grad(v, big)
  after = fl.merge_owg(v, g)
  jax.tree.map(np.testing.assert_array_equal, after[fl.OWG], v[fl.OWG])
  # The parameters still get gradients (training with frozen quantizers works).
  assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree.leaves(g["params"]))
  # In training mode the same batch does change the state.
  moved = fl.merge_owg(v, train_grad(v, big))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved[fl.OWG]),
                                                       jax.tree.leaves(v[fl.OWG])))


def test_frozen_evaluation_returns_no_new_state_and_clips_at_the_recorded_range():
  model = fl.QDense(4, recipe=RECIPES["int8_ste_minmax"])
  x = jax.random.normal(jax.random.key(0), (8, 16))
  v = jax.jit(model.init)(jax.random.key(1), x)
  v = fl.merge_owg(v, _train_grad(model)(v, x))
  rng = v[fl.OWG]["input_range"]

  def run(v, x):
    with fl.frozen_quantizers():
      return model.apply(v, x, mutable=True)

  y, new = jax.jit(run)(v, 100.0 * x)
  jax.tree.map(np.testing.assert_array_equal, new, v)
  # Input elements beyond the recorded range saturate, as served: cutting them
  # down to twice the range changes nothing (the training-mode forward would
  # widen its range to the batch instead).
  clipped = jnp.clip(100.0 * x, -2 * jnp.max(rng), 2 * jnp.max(rng))
  np.testing.assert_array_equal(y, jax.jit(run)(v, clipped)[0])


def test_the_flag_reaches_backward_rules_traced_after_the_block():
  """``jax.grad`` of a jitted frozen forward: the forward rule is traced after the block."""
  model = fl.QDense(4, recipe=RECIPES["int8_ste_minmax"])
  x = jax.random.normal(jax.random.key(0), (8, 16))
  v = jax.jit(model.init)(jax.random.key(1), x)
  v = fl.merge_owg(v, _train_grad(model)(v, x))

  @jax.jit
  def frozen_loss(v, x):
    with fl.frozen_quantizers():
      return _loss(model, v, x)

  g = jax.grad(frozen_loss)(v, 10.0 * x)
  np.testing.assert_array_equal(fl.merge_owg(v, g)[fl.OWG]["input_range"],
                                v[fl.OWG]["input_range"])


def test_a_range_that_observed_nothing_takes_the_batch():
  """An untrained observer has no range to freeze; it quantizes like the first training step."""
  model = fl.QDense(4, recipe=fl.IntRecipe())
  x = jax.random.normal(jax.random.key(0), (8, 16))
  v = jax.jit(model.init)(jax.random.key(1), x)

  def run(v, x):
    with fl.frozen_quantizers():
      return model.apply(v, x)

  # Both sides jitted (compared exactly): op by op, each forward costs seconds.
  np.testing.assert_array_equal(jax.jit(run)(v, x), jax.jit(model.apply)(v, x))


def test_quantize_model_and_fp8_dot_general_are_frozen_too():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      dg = functools.partial(fl.Fp8DotGeneral, recipe=RECIPES["int8_ste_minmax"])
      return nn.Dense(4, dot_general_cls=dg)(nn.relu(nn.Dense(16)(x)))

  qm = fl.quantize_model(Block(), RECIPES["int8_ste_minmax"], on_unquantized="ignore")
  x = jax.random.normal(jax.random.key(0), (8, 16))
  v = jax.jit(qm.init)(jax.random.key(1), x)
  v = fl.merge_owg(v, _train_grad(qm)(v, x))
  big = 10.0 * x

  def run(v, x):
    with fl.frozen_quantizers():
      return qm.apply(v, x)

  served, sp = fl.convert(qm, v, x)
  np.testing.assert_array_equal(jax.jit(run)(v, big), jax.jit(served.apply)(sp, big))


def test_bad_flag():
  with pytest.raises(TypeError, match="frozen=1 must be a bool"):
    with fl.frozen_quantizers(1):
      pass
