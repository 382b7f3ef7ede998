"""The step the compile-only proofs and the benchmarks compile: its losses and their gradients."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8_linen.testing import train_step


def _dense_and_inputs():
  model = nn.Dense(5)
  x = jax.random.normal(jax.random.key(0), (3, 4), jnp.float32)
  r = jax.random.normal(jax.random.key(1), (3, 5), jnp.float32)
  variables = model.init(jax.random.key(2), x)
  return model, variables, x, r


@pytest.mark.parametrize("loss", ["linear", "mse"])
def test_losses_and_input_gradients_match_float64(loss):
  """``dL/dx`` is ``r W^T`` for the linear loss and ``(y - r) W^T`` for mse (float64 reference)."""
  model, variables, x, r = _dense_and_inputs()
  value, dx, grads = jax.jit(train_step.make_train_step(model, loss=loss))(variables, x, r)
  w = np.asarray(variables["params"]["kernel"], np.float64)
  b = np.asarray(variables["params"]["bias"], np.float64)
  x64, r64 = np.asarray(x, np.float64), np.asarray(r, np.float64)
  y = x64 @ w + b
  cot = r64 if loss == "linear" else y - r64
  want = np.sum(y * r64) if loss == "linear" else 0.5 * np.sum((y - r64) ** 2)
  np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dx), cot @ w.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(grads["params"]["kernel"]), x64.T @ cot, rtol=1e-5,
                             atol=1e-5)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, variables)


def test_the_mse_cotangent_depends_on_the_forward():
  """The linear loss's gradients do not change with the weights' values; mse's do."""
  model, variables, x, r = _dense_and_inputs()
  doubled = jax.tree.map(lambda a: 2 * a, variables)
  for loss, changes in (("linear", False), ("mse", True)):
    step = train_step.make_train_step(model, loss=loss)
    g1, g2 = step(variables, x, r)[2], step(doubled, x, r)[2]
    same = np.allclose(g1["params"]["kernel"], g2["params"]["kernel"])
    assert same != changes, loss


def test_unknown_loss_is_named():
  with pytest.raises(ValueError, match=r"loss must be one of \['linear', 'mse'\], got 'l2'"):
    train_step.make_train_step(nn.Dense(2), loss="l2")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_optimizer_step_updates_the_params_and_merges_the_fp8_state(optimizer):
  """``optimizer``: the params take the optax update of their gradients; the fp8 state the new one."""
  import optax  # pylint: disable=import-outside-toplevel
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  model = fl.QDense(5)
  x = jax.random.normal(jax.random.key(0), (3, 4), jnp.float32)
  r = jax.random.normal(jax.random.key(1), (3, 5), jnp.float32)
  variables = model.init(jax.random.key(2), x)
  tx = train_step.OPTIMIZERS[optimizer]()
  opt_state = tx.init(variables["params"])
  loss, dx, new, new_opt = jax.jit(train_step.make_train_step(model, optimizer=optimizer))(
      variables, opt_state, x, r)
  want_loss, want_dx, grads = train_step.make_train_step(model)(variables, x, r)
  updates, want_opt = tx.update(grads["params"], opt_state, variables["params"])
  chex.assert_trees_all_close((loss, dx), (want_loss, want_dx), rtol=1e-6)
  chex.assert_trees_all_close(new["params"], optax.apply_updates(variables["params"], updates),
                              rtol=1e-6)
  chex.assert_trees_all_close(new[fl.OWG], grads[fl.OWG])  # the state the step produced
  assert not np.allclose(new[fl.OWG]["input_amax_history"],
                         variables[fl.OWG]["input_amax_history"])
  chex.assert_trees_all_close(new_opt, want_opt, rtol=1e-6)


def test_unknown_optimizer_is_named():
  with pytest.raises(ValueError, match=r"optimizer must be None, one of \['adam', 'sgd'\]"):
    train_step.make_train_step(nn.Dense(2), optimizer="lion")
