"""Tests for fp8_linen.training: merging, accumulation, data parallel, checkpoints."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fp8_linen as fl


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jax.nn.relu(fl.QDense(16, name="l1")(x))
    return fl.QDense(4, name="l2")(x)


def rand(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


def setup(tx=None, x=None):
  m = MLP()
  x = rand((8, 6), 0) if x is None else x
  v = jax.jit(m.init)(jax.random.key(0), x)
  return m, fl.TrainState.create(apply_fn=m.apply, params=v, tx=tx or optax.adam(1e-2))


def loss_fn(v, apply_fn, x, y):
  return jnp.mean((apply_fn(v, x) - y) ** 2)


# Jitted, here and below: op by op, a quantized backward costs seconds.
grad_fn = jax.jit(jax.grad(loss_fn), static_argnums=1)
evaluate = jax.jit(loss_fn, static_argnums=1)


@jax.jit
def train_step(state, x, y):
  grads = jax.grad(loss_fn)(state.params, state.apply_fn, x, y)
  return state.apply_gradients(grads=grads), grads


def test_optimizer_sees_only_params_and_owg_is_overwritten():
  tx = optax.adamw(1e-2, weight_decay=0.5)
  m, state = setup(tx)
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(tx.init(state.params["params"]))
  x, y = rand((8, 6), 1, 5.0), rand((8, 4), 2)
  new, grads = train_step(state, x, y)
  jax.tree.map(np.testing.assert_array_equal, new.params[fl.OWG], grads[fl.OWG])
  assert float(new.params[fl.OWG]["l1"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(x).max()))
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.params["params"],
                         new.params["params"])
  assert all(jax.tree.leaves(changed))
  assert int(new.step) == 1


def test_training_loss_decreases_and_tracks_float32():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 6)), jnp.float32)
  y = jnp.asarray(np.sin(np.asarray(x) @ rng.normal(size=(6, 4))), jnp.float32)
  m, state = setup(optax.adam(1e-2), x)
  ref = nn.Sequential([nn.Dense(16), jax.nn.relu, nn.Dense(4)])
  p_ref = {"params": {"layers_0": state.params["params"]["l1"],
                      "layers_2": state.params["params"]["l2"]}}
  s_ref = fl.TrainState.create(apply_fn=ref.apply, params=p_ref, tx=optax.adam(1e-2))
  # Evaluated jitted: 120 eager forwards of the quantized model cost more than the training.
  evaluate = jax.jit(lambda v: loss_fn(v, m.apply, x, y))
  evaluate_ref = jax.jit(lambda v: loss_fn(v, ref.apply, x, y))
  losses, ref_losses = [], []
  for _ in range(60):
    losses.append(float(evaluate(state.params)))
    ref_losses.append(float(evaluate_ref(s_ref.params)))
    state, _ = train_step(state, x, y)
    s_ref, _ = train_step(s_ref, x, y)
  assert losses[-1] < 0.4 * losses[0]
  assert abs(losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[0]


def test_first_step_gradient_scale_comes_from_the_gradient_itself():
  # With a fixed first-step scale of 1 a gradient of ~1e-9 underflows e5m2
  # (smallest subnormal 2**-16) and a large one clips; with the scale taken from
  # the gradient's own amax on step one it survives.
  m, state = setup(optax.sgd(0.0))
  x, y = rand((8, 6), 1), rand((8, 4), 2)
  tiny = lambda v: 1e-9 * loss_fn(v, m.apply, x, y)
  g = jax.jit(jax.grad(tiny))(state.params)
  ref = nn.Sequential([nn.Dense(16), jax.nn.relu, nn.Dense(4)])
  p_ref = {"params": {"layers_0": state.params["params"]["l1"],
                      "layers_2": state.params["params"]["l2"]}}
  g_ref = jax.grad(lambda p: 1e-9 * loss_fn(p, ref.apply, x, y))(p_ref)
  got, want = g["params"]["l2"]["kernel"], g_ref["params"]["layers_2"]["kernel"]
  assert float(jnp.abs(got).max()) > 0
  assert float(jnp.abs(got - want).max()) < 0.2 * float(jnp.abs(want).max())
  g_amax = float(g[fl.OWG]["l2"]["output_grad_amax_history"][0])
  np.testing.assert_allclose(g[fl.OWG]["l2"]["output_grad_scale"], [g_amax / 57344.0], rtol=1e-6)


def test_multisteps_advances_history_once_with_max_of_microbatches():
  k = 3
  tx = optax.MultiSteps(optax.sgd(1e-3), every_k_schedule=k)
  m, state = setup(tx)
  old = state.params[fl.OWG]
  scales = [1.0, 7.0, 3.0]
  for i, sc in enumerate(scales):
    state, _ = train_step(state, rand((8, 6), 10 + i, sc), rand((8, 4), 20 + i))
    if i < k - 1:  # state frozen during the window
      jax.tree.map(np.testing.assert_array_equal, state.params[fl.OWG], old)
  h = state.params[fl.OWG]["l1"]["input_amax_history"]
  expect = max(float(jnp.abs(rand((8, 6), 10 + i, sc)).max()) for i, sc in enumerate(scales))
  assert float(h[0]) == pytest.approx(expect)
  assert float(jnp.sum(h[1:])) == 0.0  # advanced exactly once
  # next window starts fresh (not max'ed with the previous window)
  for i in range(k):
    state, _ = train_step(state, rand((8, 6), 30 + i, 0.01), rand((8, 4), 40 + i))
  h = state.params[fl.OWG]["l1"]["input_amax_history"]
  assert float(h[0]) < 0.1 and float(h[1]) == pytest.approx(expect)


def test_hand_written_accumulation_helpers():
  m, state = setup(optax.sgd(0.1))
  xs = [rand((8, 6), 50 + i, s) for i, s in enumerate((1.0, 9.0))]
  ys = [rand((8, 4), 60 + i) for i in range(2)]
  acc = None
  for x, y in zip(xs, ys):
    acc = fl.accumulate_gradients(acc, grad_fn(state.params, state.apply_fn, x, y))
  grads = fl.finalize_accumulated(acc, 2)
  full = jax.jit(jax.grad(lambda v: 0.5 * (loss_fn(v, m.apply, xs[0], ys[0]) +
                                           loss_fn(v, m.apply, xs[1], ys[1]))))(state.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               grads["params"], full["params"])
  assert float(grads[fl.OWG]["l1"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(xs[1]).max()))
  with pytest.raises(ValueError, match="num_microbatches"):
    fl.finalize_accumulated(acc, 0)


def test_data_parallel_jit_sharded_amax_is_global():
  assert jax.device_count() == 8
  m, state = setup(optax.sgd(0.1))
  x = rand((16, 6), 3) * jnp.arange(1, 17)[:, None]  # the largest rows live on the last device
  y = rand((16, 4), 4)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ys = jax.device_put(y, NamedSharding(mesh, P("data")))
  sharded, _ = train_step(state, xs, ys)
  single, _ = train_step(state, x, y)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               sharded.params[fl.OWG], single.params[fl.OWG])
  assert float(sharded.params[fl.OWG]["l1"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(x).max()))


def test_shard_map_reduce_gradients_takes_max_not_mean():
  m, state = setup(optax.sgd(0.1))
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  # Device 0 sees amax 3, device 1 sees amax 30: a pmean would record 16.5.
  x = jnp.concatenate([jnp.full((4, 6), 3.0), jnp.full((4, 6), 30.0)])
  y = rand((8, 4), 5)

  def per_device(v, x, y):
    g = jax.grad(loss_fn)(v, m.apply, x, y)
    return fl.reduce_gradients(g, "data")

  f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                    check_vma=False)
  g = jax.jit(f)(state.params, x, y)
  assert float(g[fl.OWG]["l1"]["input_amax_history"][0]) == 30.0
  # Each device scaled its rows by the global amax (30), as one device would.
  full = grad_fn(state.params, m.apply, x, y)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               g["params"], full["params"])
  new = state.apply_gradients(grads=g)
  assert float(new.params[fl.OWG]["l1"]["input_scale"][0]) == pytest.approx(30.0 / 448.0)


def test_grad_works_directly_on_variables_and_merge_owg():
  m, state = setup()
  x, y = rand((8, 6), 1), rand((8, 4), 2)
  grads = grad_fn(state.params, m.apply, x, y)
  merged = fl.merge_owg(state.params, grads)
  assert merged["params"] is state.params["params"]
  jax.tree.map(np.testing.assert_array_equal, merged[fl.OWG], grads[fl.OWG])
  rest, owg = fl.split_owg(merged)
  assert set(rest) == {"params"} and owg is merged[fl.OWG]
  with pytest.raises(ValueError, match="does not match"):
    fl.merge_owg(state.params, {fl.OWG: {"l1": {}}})


def test_apply_gradients_rejects_params_only_grads():
  m, state = setup()
  with pytest.raises(ValueError, match="whole variables dict"):
    state.apply_gradients(grads=state.params["params"])


def test_nan_batch_leaves_state_finite_and_training_recovers():
  m, state = setup(optax.sgd(0.01))
  x, y = rand((8, 6), 1), rand((8, 4), 2)
  state, _ = train_step(state, x, y)
  bad = x.at[0, 0].set(jnp.nan)
  after_nan, _ = train_step(state, bad, y)
  for leaf in jax.tree.leaves(after_nan.params[fl.OWG]):
    assert np.all(np.isfinite(np.asarray(leaf)))
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(lambda a: a, after_nan.params[fl.OWG]["l1"]["input_scale"]),
               state.params[fl.OWG]["l1"]["input_scale"])
  # the fp8 state of a NaN step can still be combined with a clean state
  clean, _ = train_step(state.replace(params={**state.params, "params": state.params["params"]}),
                        x, y)
  assert np.isfinite(float(evaluate(clean.params, m.apply, x, y)))


def test_orbax_round_trip_is_exact(tmp_path):
  m, state = setup(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))
  for i in range(3):
    state, _ = train_step(state, rand((8, 6), i, 3.0), rand((8, 4), 9 + i))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "ckpt", state)
  ckpt.wait_until_finished()
  restored = ckpt.restore(tmp_path / "ckpt", state)
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  a, _ = train_step(state, rand((8, 6), 7), rand((8, 4), 8))
  b, _ = train_step(restored, rand((8, 6), 7), rand((8, 4), 8))
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_shard_map_with_vma_checks_reduces_state_by_max():
  # With check_vma (shard_map's default) JAX sums the gradients of replicated
  # inputs itself; the fp8 ops reduce their state cotangents with pmax instead.
  m, state = setup(optax.sgd(0.1))
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  x = jnp.concatenate([jnp.full((4, 6), 3.0), jnp.full((4, 6), 30.0)])
  y = rand((8, 4), 5)
  f = jax.shard_map(lambda v, x, y: jax.grad(loss_fn)(v, m.apply, x, y), mesh=mesh,
                    in_specs=(P(), P("data"), P("data")), out_specs=P())
  g = jax.jit(f)(state.params, x, y)
  assert float(g[fl.OWG]["l1"]["input_amax_history"][0]) == 30.0
  # Both devices quantize with the global amax's scale, as one device would:
  # the sum of the two halves' mean losses is twice the whole batch's.
  summed = jax.jit(jax.grad(lambda v: 2 * loss_fn(v, m.apply, x, y)))(state.params)
  jax.tree.map(lambda a, b: np.testing.assert_array_less(
      np.linalg.norm(a - b), 2e-2 * np.linalg.norm(b)), g["params"], summed["params"])


@pytest.mark.parametrize("recipe", [fl.rowwise_scaling(), fl.mx_block_scaling(), fl.nvfp4()],
                         ids=["rowwise", "mx_block", "nvfp4"])
def test_shard_map_vma_for_finer_granularity(recipe):
  # Every fp8 op reduces its state by max (and its gradients by sum) under shard_map.
  m = fl.QDense(4, recipe=recipe)
  x = jnp.concatenate([jnp.full((4, 32), 3.0), jnp.full((4, 32), 30.0)])
  v = jax.jit(m.init)(jax.random.key(0), x)
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  f = jax.shard_map(lambda v, x: jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2))(v), mesh=mesh,
                    in_specs=(P(), P("data")), out_specs=P())
  g = jax.jit(f)(v, x)
  assert float(g[fl.OWG]["input_amax_history"][0]) == 30.0
  full = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2)))(v)
  # Each device blocks its own rows for wgrad; e2m1 codes (NVFP4) round far
  # more coarsely than fp8 when the blocks differ.
  rtol = 0.15 if recipe.is_nvfp4 else 2e-2
  np.testing.assert_allclose(g["params"]["kernel"], full["params"]["kernel"], rtol=rtol, atol=1e-3)


# ---------------------------------------------------------------------------
# Steps optax skips leave the fp8 state as it was.
# ---------------------------------------------------------------------------

def _nan_loss_batch(scale):
  """A batch with finite inputs (finite amaxes) whose loss is NaN."""
  return rand((8, 6), 70, scale), rand((8, 4), 71).at[0, 0].set(jnp.nan)


def test_apply_if_finite_skipped_step_leaves_the_fp8_state():
  m, state = setup(optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=5))
  state, _ = train_step(state, rand((8, 6), 1), rand((8, 4), 2))
  x, y = _nan_loss_batch(50.0)
  new, grads = train_step(state, x, y)
  assert not bool(new.opt_state.last_finite)
  # The batch's amaxes were finite and would have been recorded.
  assert float(grads[fl.OWG]["l1"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(x).max()))
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)
  good, _ = train_step(new, rand((8, 6), 3), rand((8, 4), 4))
  assert float(good.params[fl.OWG]["l1"]["input_amax_history"][1]) == pytest.approx(
      float(state.params[fl.OWG]["l1"]["input_amax_history"][0]))


def test_multisteps_skip_not_finite_leaves_the_window_and_the_state():
  tx = optax.MultiSteps(optax.sgd(1e-3), every_k_schedule=2,
                        should_skip_update_fn=optax.skip_not_finite)
  m, state = setup(tx)
  amax = lambda s: float(s.params[fl.OWG]["l1"]["input_amax_history"][0])
  state, _ = train_step(state, rand((8, 6), 10, 1.0), rand((8, 4), 20))
  state, _ = train_step(state, *_nan_loss_batch(100.0))  # skipped micro-batch
  state, _ = train_step(state, rand((8, 6), 11, 2.0), rand((8, 4), 21))  # commits
  expect = max(float(jnp.abs(rand((8, 6), 10 + i, s)).max()) for i, s in enumerate((1.0, 2.0)))
  assert amax(state) == pytest.approx(expect)  # not the skipped batch's ~300
  # A skipped micro-batch right after a commit (optax's has_updated is still
  # true then) must not commit anything either.
  before = state
  state, _ = train_step(state, *_nan_loss_batch(100.0))
  jax.tree.map(np.testing.assert_array_equal, state.params, before.params)
  jax.tree.map(np.testing.assert_array_equal, state.owg_accum, before.owg_accum)
  for leaf in jax.tree.leaves(state.params[fl.OWG]):
    assert np.all(np.isfinite(leaf))


# ---------------------------------------------------------------------------
# Checkpoints: a float run's, another history length, params only.
# ---------------------------------------------------------------------------

class FloatMLP(nn.Module):
  """MLP without fp8: the same params tree as MLP."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="l2")(jax.nn.relu(nn.Dense(16, name="l1")(x)))


@pytest.mark.parametrize("layout", ["variables", "params"])
def test_load_float_state_from_an_orbax_checkpoint(tmp_path, layout):
  from flax.training import train_state as flax_train_state
  tx = optax.adam(1e-2)
  fm, x, y = FloatMLP(), rand((8, 6), 1), rand((8, 4), 2)
  fv = fm.init(jax.random.key(1), x)
  # The job's float arm keeps the variables dict; plain flax keeps params only.
  fparams = fv if layout == "variables" else fv["params"]
  apply = (fm.apply if layout == "variables" else lambda p, x: fm.apply({"params": p}, x))
  fstate = flax_train_state.TrainState.create(apply_fn=apply, params=fparams, tx=tx)
  for i in range(3):
    fstate = fstate.apply_gradients(grads=jax.grad(loss_fn)(fstate.params, apply, x, y * i))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "float", fstate)
  ckpt.wait_until_finished()

  m, state = setup(tx)
  with pytest.raises(Exception):  # the fp8 state is not the float run's structure
    ckpt.restore(tmp_path / "float", state)
  restored = ckpt.restore(tmp_path / "float", fstate)
  loaded = fl.load_float_state(state, restored)
  assert int(loaded.step) == 3
  trained = restored.params["params"] if layout == "variables" else restored.params
  jax.tree.map(np.testing.assert_array_equal, loaded.params["params"], trained)
  inner = lambda s: s.opt_state[0]
  jax.tree.map(np.testing.assert_array_equal, inner(loaded).mu,
               inner(restored).mu["params"] if layout == "variables" else inner(restored).mu)
  jax.tree.map(np.testing.assert_array_equal, loaded.params[fl.OWG], state.params[fl.OWG])
  # It trains, and the first step takes its scales from the batch.
  new, _ = train_step(loaded, x, y)
  assert float(new.params[fl.OWG]["l1"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(x).max()))
  # A raw restore (no target) loads too.
  raw = ckpt.restore(tmp_path / "float")
  jax.tree.map(np.testing.assert_array_equal, fl.load_float_state(state, raw).opt_state,
               loaded.opt_state)
  with pytest.raises(ValueError, match="same model and optimizer"):
    fl.load_float_state(state, {"params": fparams, "opt_state": optax.sgd(0.1).init(fparams)})


def test_params_only_train_state_trains_with_a_warning():
  m = MLP()
  x, y = rand((8, 6), 1), rand((8, 4), 2)
  p = {"params": jax.jit(m.init)(jax.random.key(0), x)["params"]}
  tx = optax.adam(1e-2)
  state = fl.TrainState.create(apply_fn=m.apply, params=p, tx=tx)
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(tx.init(p["params"]))
  with pytest.warns(UserWarning, match="load_float_state"):
    new, _ = train_step(state, x, y)
  assert int(new.step) == 1 and np.isfinite(float(evaluate(new.params, m.apply, x, y)))


def test_merge_owg_checks_history_lengths_and_resize_histories_fixes_them():
  m, state = setup()
  x, y = rand((8, 6), 1), rand((8, 4), 2)
  grads = grad_fn(state.params, m.apply, x, y)
  short = fl.resize_histories(state.params, 16)
  assert short[fl.OWG]["l1"]["input_amax_history"].shape == (16,)
  with pytest.raises(ValueError, match=r"l1/input_amax_history has shape \(1024,\).*resize"):
    fl.merge_owg(short, grads)
  back = fl.resize_histories(fl.merge_owg(state.params, grads), {
      "input": 1024, "kernel": 1024, "output_grad": 1024})
  jax.tree.map(np.testing.assert_array_equal, back, fl.merge_owg(state.params, grads))
  # A model with another history length loads the resized variables.
  m16 = nn.Sequential([fl.QDense(16, recipe=fl.delayed_scaling(16)), jax.nn.relu,
                       fl.QDense(4, recipe=fl.delayed_scaling(16))])
  v = {"params": {"layers_0": state.params["params"]["l1"],
                  "layers_2": state.params["params"]["l2"]},
       fl.OWG: {"layers_0": grads[fl.OWG]["l1"], "layers_2": grads[fl.OWG]["l2"]}}
  apply16 = jax.jit(lambda v, x: m16.apply(v, x))
  with pytest.raises(ValueError, match="resize_histories"):
    apply16(v, x)
  v16 = fl.resize_histories(v, fl.delayed_scaling(16))
  assert np.isfinite(np.asarray(apply16(v16, x))).all()
  assert float(v16[fl.OWG]["layers_0"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(x).max()))
  # A TrainState's accumulation window is resized with it.
  _, ms = setup(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  ms = fl.resize_histories(ms, 8)
  assert ms.owg_accum["l2"]["kernel_amax_history"].shape == (8,)


@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_gradients_is_the_mean_with_and_without_vma_checks(check_vma):
  m, state = setup(optax.sgd(0.1))
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  x, y = rand((16, 6), 3, 2.0), rand((16, 4), 4)

  def per_device(v, x, y):
    return fl.reduce_gradients(jax.grad(loss_fn)(v, m.apply, x, y), "data")

  f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                    check_vma=check_vma)
  g = jax.jit(f)(state.params, x, y)
  # Every device quantizes with the global amax (without vma tracking too, where
  # lowering.untracked_axes names the axes): one device's numbers.
  mean = grad_fn(state.params, m.apply, x, y)
  # (fp8 rounding turns float-noise differences upstream into a few percent in
  # single elements downstream; a sum instead of the mean would be 4 times off.)
  jax.tree.map(lambda a, b: np.testing.assert_array_less(
      np.linalg.norm(a - b), 2e-2 * np.linalg.norm(b)), g["params"], mean["params"])
  assert float(g[fl.OWG]["l1"]["input_amax_history"][0]) == pytest.approx(
      float(jnp.abs(x).max()))


def test_multisteps_window_with_an_empty_micro_batch_advances_once():
  # An empty micro-batch returns its state unrolled; it must not be max-ed
  # into the rolled updates of the window's other micro-batches.
  m, state = setup(optax.MultiSteps(optax.sgd(1e-3), every_k_schedule=2))
  state, _ = train_step(state, rand((8, 6), 1), rand((8, 4), 2))
  state, _ = train_step(state, rand((8, 6), 3), rand((8, 4), 4))  # commit: history [a, 0, ...]
  base = state.params[fl.OWG]
  x = rand((8, 6), 5, 3.0)
  solo = fl.merge_owg(state.params, grad_fn(state.params, m.apply, x, rand((8, 4), 6)))
  state, _ = train_step(state, x, rand((8, 4), 6))
  state, _ = train_step(state, jnp.zeros((0, 6)), jnp.zeros((0, 4)))  # commits the window
  same = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)  # (two programs)
  jax.tree.map(same, state.params[fl.OWG], solo[fl.OWG])
  h = state.params[fl.OWG]["l1"]["input_amax_history"]
  assert float(h[1]) == float(base["l1"]["input_amax_history"][0]) > 0
  # A window of empty micro-batches only keeps the state.
  state, _ = train_step(state, jnp.zeros((0, 6)), jnp.zeros((0, 4)))
  state, _ = train_step(state, jnp.zeros((0, 6)), jnp.zeros((0, 4)))
  jax.tree.map(same, state.params[fl.OWG], solo[fl.OWG])
