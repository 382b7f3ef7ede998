"""Layers on inputs at the edges: empty batches, NaN/Inf, extreme margins, wrong recipes."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl

# name -> (layer, its flax twin or None, init shape, empty shape)
EMPTY = {
    "QDense": (lambda: fl.QDense(4), lambda: nn.Dense(4), (2, 3), (0, 3)),
    "QDense_rowwise": (lambda: fl.QDense(4, recipe=fl.rowwise_scaling()), None, (2, 3), (0, 3)),
    "QDense_mx": (lambda: fl.QDense(4, recipe=fl.mx_block_scaling()), None, (2, 32), (0, 32)),
    "QDense_nvfp4": (lambda: fl.QDense(4, recipe=fl.nvfp4()), None, (2, 32), (0, 32)),
    "QDense_int8": (lambda: fl.QDense(4, recipe=fl.IntRecipe()), None, (2, 3), (0, 3)),
    "QDenseGeneral": (lambda: fl.QDenseGeneral((2, 2)), lambda: nn.DenseGeneral((2, 2)),
                      (2, 3), (0, 3)),
    "QEinsum": (lambda: fl.QEinsum((3, 4), "btd,dh->bth"), lambda: nn.Einsum((3, 4), "btd,dh->bth"),
                (2, 5, 3), (2, 0, 3)),
    "QConv_valid": (lambda: fl.QConv(4, (3, 3), padding="VALID"),
                    lambda: nn.Conv(4, (3, 3), padding="VALID"), (1, 4, 4, 2), (1, 2, 2, 2)),
    "QConv_valid_fp8_gemm": (lambda: fl.QConv(4, (3, 3), padding="VALID",
                                              recipe=fl.Fp8Recipe(gemm="fp8")),
                             None, (1, 4, 4, 2), (1, 2, 2, 2)),
    "QConv_empty_batch": (lambda: fl.QConv(4, (3, 3)), lambda: nn.Conv(4, (3, 3)),
                          (1, 4, 4, 2), (0, 4, 4, 2)),
    "Fp8Activation": (lambda: fl.Fp8Activation(), None, (2, 3), (0, 3)),
}


def _lived_in(owg):
  """An OWG state as after some steps: histories and scales that are not the initial ones."""
  return jax.tree_util.tree_map_with_path(
      lambda p, a: (jnp.arange(1.0, a.size + 1.0) if p[-1].key.endswith("_amax_history")
                    else jnp.full_like(a, 0.5) if p[-1].key.endswith("_scale") else a + 1.0),
      owg)


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_batch_gives_empty_output_and_leaves_the_state_unchanged(name):
  make, twin, init_shape, shape = EMPTY[name]
  layer = make()
  x0 = jnp.asarray(np.random.default_rng(0).normal(size=init_shape), jnp.float32)
  v = jax.jit(layer.init)(jax.random.key(0), x0)  # jitted: an eager quantized init costs seconds
  v = {**v, fl.OWG: _lived_in(v[fl.OWG])}
  state = fl.TrainState.create(apply_fn=layer.apply, params=v, tx=optax.sgd(0.1))

  @jax.jit
  def step(state, x):
    (_, y), grads = jax.value_and_grad(
        lambda v: (lambda y: (jnp.sum(y ** 2), y))(state.apply_fn(v, x)), has_aux=True)(
            state.params)
    return state.apply_gradients(grads=grads), grads, y

  x = jnp.zeros(shape)
  new, grads, y = step(state, x)
  if twin is not None:
    assert y.shape == jax.eval_shape(
        lambda: twin().apply(twin().init(jax.random.key(0), x0), x)).shape
  assert y.size == 0
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)
  for leaf in jax.tree.leaves(grads.get("params", {})):
    np.testing.assert_array_equal(leaf, jnp.zeros_like(leaf))


class TwiceFirstEmpty(nn.Module):
  @nn.compact
  def __call__(self, x):
    dense = fl.QDense(4)
    return jnp.sum(dense(x[:0])) + jnp.sum(dense(x) ** 2)


def test_empty_first_use_still_records_a_later_use():
  # Only the first use returns the state; an empty one passes on what later
  # uses observed instead of dropping it.
  x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)) * 5, jnp.float32)
  m = TwiceFirstEmpty()
  v = jax.jit(m.init)(jax.random.key(0), x)
  g = jax.jit(jax.grad(lambda v: m.apply(v, x)))(v)[fl.OWG]["QDense_0"]
  assert float(g["input_amax_history"][0]) == pytest.approx(float(jnp.abs(x).max()))
  assert float(g["input_amax_history"][1]) == 0.0


# ---------------------------------------------------------------------------
# Non-finite values propagate; finite ones saturate; no state takes them in.
# ---------------------------------------------------------------------------

RECIPES = {"delayed": fl.Fp8Recipe(), "current": fl.current_scaling(),
           "rowwise": fl.rowwise_scaling(), "mx": fl.mx_block_scaling(block_size=4),
           "nvfp4": fl.nvfp4(),
           "fp8_gemm": fl.Fp8Recipe(gemm="fp8")}


@pytest.mark.parametrize("bad", [-np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_non_finite_input_and_gradient_propagate_like_a_float_layer(recipe, bad):
  layer = fl.QDense(4, recipe=RECIPES[recipe])
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)), jnp.float32)
  v = jax.jit(layer.init)(jax.random.key(0), x)  # jitted: an eager quantized init costs seconds
  ref = nn.Dense(4).apply({"params": v["params"]}, x.at[1, 2].set(bad))

  @jax.jit
  def run(v, x):
    y = layer.apply(v, x.at[1, 2].set(bad))
    # An Inf (NaN) gradient arriving at the output of row 1.
    w = jnp.array([1.0, bad, 1.0])[:, None]
    return y, jax.grad(lambda v, x: jnp.sum(layer.apply(v, x) * w), argnums=(0, 1))(v, x)

  y, g = run(v, x)
  # Like the float layer: the row holding the value is not finite, the others are.
  np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref))
  assert not np.all(np.isfinite(g[1])) and not np.all(np.isfinite(g[0]["params"]["kernel"]))
  for leaf in jax.tree.leaves(g[0][fl.OWG]):
    assert np.all(np.isfinite(leaf))


def test_finite_values_beyond_a_stale_scale_still_saturate():
  layer = fl.QDense(1, use_bias=False, kernel_init=nn.initializers.ones)
  v = jax.jit(layer.init)(jax.random.key(0), jnp.ones((1, 2)))
  v = {**v, fl.OWG: {**v[fl.OWG], "input_amax_history": v[fl.OWG]["input_amax_history"].at[0]
                     .set(1.0), "input_scale": jnp.array([1e-30])}}
  # History says amax 1 -> scale 1/448; the huge (finite) input saturates at 448 * s.
  y = jax.jit(layer.apply)(v, jnp.array([[3e38, 0.5]]))
  assert np.isfinite(float(y[0, 0])) and float(y[0, 0]) == pytest.approx(1.5, rel=0.1)


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    return fl.QDense(2)(fl.Fp8Activation()(jax.nn.relu(fl.QDense(8)(x))))


def test_inf_batch_is_skipped_by_apply_if_finite():
  # Before, an Inf input saturated to a finite value: the loss stayed finite,
  # apply_if_finite could not skip the step and the Inf batch trained the model.
  m = Net()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
  v = jax.jit(m.init)(jax.random.key(0), x)
  state = fl.TrainState.create(apply_fn=m.apply, params=v,
                               tx=optax.apply_if_finite(optax.sgd(0.1), 5))
  loss = lambda v, x: jnp.mean(m.apply(v, x) ** 2)

  @jax.jit
  def step(state, x):
    value, grads = jax.value_and_grad(loss)(state.params, x)
    return state.apply_gradients(grads=grads), value

  state, _ = step(state, x)
  new, value = step(state, x.at[0, 0].set(jnp.inf))
  assert not np.isfinite(float(value))
  assert not bool(new.opt_state.last_finite)
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)


# ---------------------------------------------------------------------------
# Margins the validator accepts never give a non-finite scale or output.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("margin,magnitude", [(64, 1e3), (64, 1e-30), (-64, 1e3), (1, 3e38),
                                              (0, 3.4e38)])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_extreme_margins_keep_scales_and_outputs_finite(margin, magnitude, scaling):
  cfg = dict(scaling=scaling, margin=margin, history_length=4)
  recipe = fl.Fp8Recipe(input=fl.ScalingConfig(**cfg), kernel=fl.ScalingConfig(**cfg),
                        output_grad=fl.ScalingConfig(dtype="float8_e5m2", **cfg))
  layer = fl.QDense(3, recipe=recipe, use_bias=False, kernel_init=nn.initializers.constant(1e3))
  x = jnp.full((2, 4), magnitude, jnp.float32).at[0, 0].set(-magnitude)
  v = jax.jit(layer.init)(jax.random.key(0), x)

  @jax.jit
  def step(v):
    y, g = jax.value_and_grad(lambda v: jnp.sum(layer.apply(v, x)) * 1e-30)(v)
    return {**v, fl.OWG: g[fl.OWG]}, layer.apply(v, x)

  for _ in range(2):  # the second step uses the first one's history
    v, out = step(v)
    for leaf in jax.tree.leaves(v[fl.OWG]):
      assert np.all(np.isfinite(leaf)), v[fl.OWG]
    assert not np.any(np.isnan(out))


# ---------------------------------------------------------------------------
# A wrong recipe is reported the same way by every layer.
# ---------------------------------------------------------------------------

_X2, _X4 = jnp.ones((2, 4)), jnp.ones((1, 4, 4, 2))
LAYERS = {
    "QDense": (lambda r: fl.QDense(3, recipe=r), _X2),
    "QDenseGeneral": (lambda r: fl.QDenseGeneral(3, recipe=r), _X2),
    "QEinsum": (lambda r: fl.QEinsum(shape=(4, 3), einsum_str="bd,dh->bh", recipe=r), _X2),
    "QConv": (lambda r: fl.QConv(3, (3, 3), recipe=r), _X4),
    "Fp8DotGeneral": (lambda r: nn.Dense(3, dot_general_cls=functools.partial(
        fl.Fp8DotGeneral, recipe=r)), _X2),
    "Fp8Activation": (lambda r: fl.Fp8Activation(recipe=r), _X2),
}
BAD = {"string": ("delayed", "load_recipe"), "uncalled": (fl.delayed_scaling, "function"),
       "scaling_config": (fl.ScalingConfig(), "ScalingConfig configures one role"),
       "activation_recipe": (fl.ActivationRecipe(), "for Fp8Activation"),
       "int_recipe": (fl.IntRecipe(), "integer recipes")}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_wrong_recipe_error_names_recipe_and_what_is_accepted(layer, bad):
  make, x = LAYERS[layer]
  recipe, hint = BAD[bad]
  activation = layer == "Fp8Activation"
  if bad == ("activation_recipe" if activation else "int_recipe"):
    jax.eval_shape(make(recipe).init, jax.random.key(0), x)  # a recipe this layer takes
    return
  if activation and bad == "string":
    hint = "a name"
  with pytest.raises(TypeError) as err:
    make(recipe).init(jax.random.key(0), x)
  msg = str(err.value)
  assert msg.startswith(f"{layer}: recipe=") and "is not a recipe it takes" in msg, msg
  assert hint in msg, msg
  accepted = "ActivationRecipe" if activation else "Fp8Recipe or Fp8WeightOnly or IntRecipe"
  assert f"accepted: {accepted}" in msg, msg


def test_two_arrow_einsum_is_reported_as_such():
  with pytest.raises(ValueError, match="at most one '->'"):
    fl.QEinsum(shape=(4, 3), einsum_str="bd,dh->bh->bh").init(jax.random.key(0), _X2)


# ---------------------------------------------------------------------------
# Applying with params only (e.g. evaluating a float checkpoint) works.
# ---------------------------------------------------------------------------

def test_apply_with_params_only_uses_scales_of_the_current_batch():
  m = Net()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)) * 30, jnp.float32)
  v = jax.jit(m.init)(jax.random.key(0), x)
  # Both applies jitted (compared exactly); the warning is given while tracing.
  with pytest.warns(UserWarning, match="model.init's full variables"):
    y = jax.jit(m.apply)({"params": v["params"]}, x)
  # A fresh state (empty histories) takes its scales from the current batch.
  np.testing.assert_array_equal(y, jax.jit(m.apply)(v, x))
