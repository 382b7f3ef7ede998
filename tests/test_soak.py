"""A few hundred steps of NaN, Inf, zero, huge and empty batches among clean ones.

Whatever arrives, the fp8 state stays finite with scales in range, a skipped
step (non-finite gradients, what both optax wrappers skip) changes nothing, an
empty batch leaves the state as it was, and training still converges on the
clean batches.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl
from fp8_linen.core import numerics


class Net(nn.Module):
  quantized: bool = True

  @nn.compact
  def __call__(self, x):
    if not self.quantized:  # the float twin: same params tree
      return nn.Dense(4, name="l2")(jax.nn.relu(nn.Dense(16, name="l1")(x)))
    h = jax.nn.relu(fl.QDense(16, recipe=fl.delayed_scaling(16), name="l1")(x))
    return fl.QDense(4, recipe=fl.current_scaling(), name="l2")(fl.Fp8Activation(name="act")(h))


KINDS = ["clean"] * 6 + ["nan", "inf", "zeros", "huge", "empty", "nan_target"]


def _batch(rng, kind, w):
  n = 0 if kind == "empty" else 16
  x = rng.normal(size=(n, 6)).astype(np.float32)
  y = np.sin(x @ w).astype(np.float32)
  if kind == "nan":
    x[rng.integers(n), rng.integers(6)] = np.nan
  elif kind == "inf":
    x[rng.integers(n), rng.integers(6)] = np.inf * rng.choice([-1, 1])
  elif kind == "zeros":
    x[:] = 0.0
  elif kind == "huge":
    x *= np.float32(1e3)  # a spike the scales must follow and then forget
  elif kind == "nan_target":
    y[0, 0] = np.nan
  return x, y


def _tx(wrapper):
  if wrapper == "apply_if_finite":
    return optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=10 ** 6)
  return optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2,
                          should_skip_update_fn=optax.skip_not_finite)


def _step_fn():
  @jax.jit
  def step(state, x, y):
    loss, grads = jax.value_and_grad(
        lambda v: jnp.mean((state.apply_fn(v, x) - y) ** 2))(state.params)
    # What both optax wrappers skip on: a non-finite gradient.
    return state.apply_gradients(grads=grads), loss, ~fl.all_finite(grads["params"])
  return step


@pytest.mark.parametrize("wrapper", ["apply_if_finite", "multisteps"])
def test_soak_with_non_finite_zero_and_empty_batches(wrapper):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(6, 4)).astype(np.float32)
  batches = []
  for _ in range(300):
    kind = KINDS[rng.integers(len(KINDS))]
    batches.append((kind,) + _batch(rng, kind, w))
  assert {k for k, _, _ in batches} == set(KINDS)
  xe, ye = _batch(np.random.default_rng(1), "clean", w)
  eval_loss = lambda s: float(jnp.mean((s.apply_fn(s.params, xe) - ye) ** 2))

  m, ref = Net(), Net(quantized=False)
  v = m.init(jax.random.key(0), jnp.ones((16, 6)))
  state = fl.TrainState.create(apply_fn=m.apply, params=v, tx=_tx(wrapper))
  float_state = fl.TrainState.create(apply_fn=ref.apply, params={"params": v["params"]},
                                     tx=_tx(wrapper))
  first, step, float_step = eval_loss(state), _step_fn(), _step_fn()
  for kind, x, y in batches:
    new, loss, skipped = step(state, x, y)
    float_state = float_step(float_state, x, y)[0]
    old_owg, new_owg = jax.device_get((state.params[fl.OWG], new.params[fl.OWG]))
    for path, leaf in jax.tree_util.tree_leaves_with_path(new_owg):
      assert np.all(np.isfinite(leaf)), (kind, path)
      if path[-1].key.endswith("_scale"):
        assert numerics.SCALE_FLOOR <= float(leaf[0]) <= numerics.SCALE_CEIL, (kind, path)
    assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(new.params["params"])), kind
    if kind in ("nan", "inf", "nan_target"):
      assert bool(skipped) and not np.isfinite(float(loss)), kind
    committed = (wrapper == "multisteps"
                 and int(new.opt_state.gradient_step) != int(state.opt_state.gradient_step))
    if bool(skipped) or (kind == "empty" and not committed):
      jax.tree.map(np.testing.assert_array_equal, new_owg, old_owg)
      if wrapper == "multisteps":  # nothing entered the window either
        jax.tree.map(np.testing.assert_array_equal, new.owg_accum, state.owg_accum)
    elif kind == "empty":  # an empty micro-batch ends a window: the window commits
      jax.tree.map(lambda n, a, o: np.testing.assert_array_equal(n, a if np.any(a > -np.inf) else o),
                   new_owg, jax.device_get(state.owg_accum), old_owg)
    if bool(skipped):
      jax.tree.map(np.testing.assert_array_equal, new.params["params"], state.params["params"])
    state = new
  # It trains as the float twin does on the same batches (skipped the same way).
  last, float_last = eval_loss(state), eval_loss(float_state)
  assert last < 0.9 * first and last < 1.25 * float_last + 0.01, (first, last, float_last)
