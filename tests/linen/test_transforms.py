"""Every Linen transform and wrapper around a quantized layer: max of uses, or a clear error.

Each case trains a model with a :class:`fl.QDense` (or a ``quantize_model``'d
``nn.Dense``) under one transform for :data:`STEPS` steps of ``fl.TrainState``
and reads the ``input`` amax history. A state used once per step records the
input's amax; a state used several times records the max of the uses (never
their sum: a sum would compound every step, ``[11.5, 34.5, 103, ...]``); a use
whose updates JAX would sum and no chain can link raises
:class:`~fp8_linen.core.uses.StateUseError` naming the layer, the transform
and the fix. The soak (20 steps over a 4-long history) shows the histories
stay bounded.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl
from fp8_linen.core.uses import StateUseError

R = fl.delayed_scaling(history_length=4)
STEPS = 20
X = jax.random.normal(jax.random.key(1), (4, 8))
AMAX = float(jnp.max(jnp.abs(X)))


def _dense():
  return fl.QDense(8, recipe=R)


def _train(model, x=X, steps=STEPS, variables=None):
  """The OWG collection after ``steps`` jitted TrainState steps.

  The learning rate is 0: every step sees the same inputs, so a history that
  grows shows a sum, not a changing model.
  """
  # Jitted: op by op, a quantized forward costs seconds.
  v = jax.jit(model.init)(jax.random.key(0), x) if variables is None else variables
  state = fl.TrainState.create(apply_fn=model.apply, params=v, tx=optax.sgd(0.0))

  @jax.jit
  def step(state, x):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn(p, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(steps):
    state = step(state, x)
  return state.params[fl.OWG]


def _history(owg, *path):
  for p in path:
    owg = owg[p]
  return np.asarray(owg["input_amax_history"])


def _assert_steady(hist, amax):
  """Every slot of a full history holds ``amax``: the max of the uses, bounded."""
  np.testing.assert_allclose(hist, np.full_like(hist, amax), rtol=1e-6)


# ----------------------------------------------------------------------------
# Transforms whose state is used once (or linked) per step.


class Plain(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _dense()(x)


class Twice(nn.Module):
  """One layer applied to x and 3x: its state records the max, 3 * amax."""

  @nn.compact
  def __call__(self, x):
    d = _dense()
    return d(x) + d(3.0 * x)


class Jit(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.jit(fl.QDense)(8, recipe=R)(x)


class Remat(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.remat(fl.QDense)(8, recipe=R)(x)


class Cond(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.cond(True, lambda m, x: m(2.0 * x), lambda m, x: m(x), _dense(), x)


class Switch(nn.Module):

  @nn.compact
  def __call__(self, x):
    branches = [lambda m, x: m(x), lambda m, x: m(2.0 * x)]
    return nn.switch(1, branches, _dense(), x)


class MapVariables(nn.Module):

  @nn.compact
  def __call__(self, x):
    layer = nn.map_variables(fl.QDense, "params", lambda p: p, init=True)
    return layer(8, recipe=R)(x)


class VmapShared(nn.Module):
  """One state for every vmapped instance: it records the amax of the whole batch."""

  @nn.compact
  def __call__(self, x):
    layer = nn.vmap(fl.QDense, variable_axes={"params": None, fl.OWG: None},
                    split_rngs={"params": False})
    return layer(8, recipe=R)(x)


class RawVmap(nn.Module):

  @nn.compact
  def __call__(self, x):
    d = _dense()
    return jax.vmap(d)(x)


@pytest.mark.parametrize("model, path, amax", [
    (Plain(), ("QDense_0",), AMAX),
    (Twice(), ("QDense_0",), 3 * AMAX),
    (Jit(), ("JitQDense_0",), AMAX),
    (Remat(), ("CheckpointQDense_0",), AMAX),
    (Cond(), ("QDense_0",), 2 * AMAX),
    (Switch(), ("QDense_0",), 2 * AMAX),
    (MapVariables(), ("Map_variablesQDense_0",), AMAX),
    (VmapShared(), ("VmapQDense_0",), AMAX),
    (RawVmap(), ("QDense_0",), AMAX),
], ids=["plain", "twice", "nn.jit", "nn.remat", "nn.cond", "nn.switch", "nn.map_variables",
        "nn.vmap-shared-state", "raw-jax.vmap"])
def test_state_records_the_max_of_its_uses_and_stays_bounded(model, path, amax):
  _assert_steady(_history(_train(model), *path), amax)


def test_vmapped_instances_with_their_own_state_record_their_own_rows():
  class VmapOwn(nn.Module):

    @nn.compact
    def __call__(self, x):
      layer = nn.vmap(fl.QDense, variable_axes={"params": 0, fl.OWG: 0},
                      split_rngs={"params": True})
      return layer(8, recipe=R)(x)

  hist = _history(_train(VmapOwn(), steps=3), "VmapQDense_0")
  chex.assert_shape(hist, (4, 4))
  rows = np.asarray(jnp.max(jnp.abs(X), axis=1))
  np.testing.assert_allclose(hist[:, :3], np.repeat(rows[:, None], 3, axis=1), rtol=1e-6)


def test_vmap_of_a_whole_apply_over_shared_variables_takes_the_batch_max():
  model = Plain()
  v = jax.jit(model.init)(jax.random.key(0), X[:1])

  def loss(v):
    y = jax.vmap(lambda r: model.apply(v, r[None]))(X)
    return jnp.mean(y ** 2)

  # Jitted: op by op, a quantized backward costs seconds.
  new = jax.jit(jax.grad(loss))(v)[fl.OWG]["QDense_0"]["input_amax_history"]
  assert float(new[0]) == pytest.approx(AMAX)


class Block(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(_dense()(x)), None


def test_scan_with_a_state_per_step_keeps_one_history_per_step():
  class Scanned(nn.Module):

    @nn.compact
    def __call__(self, x):
      stack = nn.scan(Block, variable_axes={"params": 0, fl.OWG: 0},
                      split_rngs={"params": True}, length=3)
      return stack()(x, None)[0]

  hist = _history(_train(Scanned()), "ScanBlock_0", "QDense_0")
  chex.assert_shape(hist, (3, 4))
  assert float(hist[0, 0]) == pytest.approx(AMAX)
  for row in hist:  # each step's own input: bounded, the same every training step
    _assert_steady(row, row[0])
  assert np.all(hist <= AMAX * 1.01)  # tanh outputs: never summed up


def test_remat_inside_scan_inside_jit_keeps_per_layer_state():
  class Nested(nn.Module):

    @nn.compact
    def __call__(self, x):
      stack = nn.jit(nn.scan(nn.remat(Block), variable_axes={True: 0},
                             split_rngs={"params": True}, length=2))
      return stack()(x, None)[0]

  owg = _train(Nested(), steps=6)
  (hist,) = [np.asarray(h) for p, h in jax.tree_util.tree_leaves_with_path(owg)
             if "input_amax_history" in jax.tree_util.keystr(p)]
  chex.assert_shape(hist, (2, 4))
  assert float(hist[0, 0]) == pytest.approx(AMAX)
  for row in hist:
    _assert_steady(row, row[0])


def test_nn_while_loop_runs_quantized_forward():
  class While(nn.Module):

    @nn.compact
    def __call__(self, x):
      d = _dense()
      d(x)
      return nn.while_loop(lambda m, c: c[1] < 3, lambda m, c: (m(c[0]), c[1] + 1), d, (x, 0),
                           broadcast_variables=("params", fl.OWG))[0]

  model = While()
  v = jax.jit(model.init)(jax.random.key(0), X)
  y = jax.jit(model.apply)(v, X)
  ref = jax.jit(Plain().apply)({"params": {"QDense_0": v["params"]["QDense_0"]},
                                fl.OWG: {"QDense_0": v[fl.OWG]["QDense_0"]}}, X)
  assert fl.OWG in v and y.shape == X.shape and bool(jnp.all(jnp.isfinite(y)))
  assert not np.allclose(np.asarray(y), np.asarray(ref))  # three applications, not one


# ----------------------------------------------------------------------------
# Loops that would sum a state's updates: an error naming the layer, the loop
# and the fix.


def test_scan_with_a_broadcast_state_raises_naming_layer_and_fix():
  class Shared(nn.Module):

    @nn.compact
    def __call__(self, x):
      stack = nn.scan(Block, variable_broadcast=["params", fl.OWG],
                      split_rngs={"params": False}, length=3)
      return stack()(x, None)[0]

  with pytest.raises(StateUseError, match=r"ScanBlock_0/QDense_0.*scan.*variable_axes"):
    _train(Shared(), steps=1)


def test_raw_lax_scan_over_a_layer_raises():
  class RawScan(nn.Module):

    @nn.compact
    def __call__(self, x):
      d = _dense()
      d(x)
      return jax.lax.scan(lambda c, _: (d(c), None), x, None, length=3)[0]

  with pytest.raises(StateUseError, match=r"QDense_0 is applied inside a scan"):
    _train(RawScan(), steps=1)


class Cell(nn.RNNCellBase):

  @nn.compact
  def __call__(self, carry, x):
    h = jnp.tanh(_dense()(x) + carry)
    return h, h

  @nn.nowrap
  def initialize_carry(self, rng, input_shape):
    return jnp.zeros(input_shape[:-1] + (8,))

  @property
  def num_feature_axes(self):
    return 1


def test_rnn_without_the_collection_raises_at_init_naming_the_fix():
  class Rnn(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.RNN(Cell())(x)

  with pytest.raises(StateUseError, match=r"Cell_0/QDense_0.*does not carry.*variable_axes"):
    Rnn().init(jax.random.key(0), jnp.ones((2, 3, 8)))


def test_rnn_with_a_state_per_time_step_trains():
  class Rnn(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.RNN(Cell(), variable_axes={fl.OWG: 0})(x[:, None].repeat(3, axis=1))

  hist = _history(_train(Rnn()), "Cell_0", "QDense_0")
  chex.assert_shape(hist, (3, 4))
  for row in hist:  # the input projection sees x at every time step
    _assert_steady(row, AMAX)


# ----------------------------------------------------------------------------
# Raw jax.jit / jax.checkpoint inside a module method (MaxText wraps its
# decoder layers in jax.checkpoint).


class Wrapped(nn.Module):
  """``d`` called inside a raw JAX transform; ``outside`` also calls it outside first."""

  wrap: str = "checkpoint"
  outside: bool = False
  times: int = 1

  @nn.compact
  def __call__(self, x):
    d = fl.QDense(8, recipe=R, name="d")
    transform = {"checkpoint": jax.checkpoint, "jit": jax.jit}[self.wrap]
    y = d(x) if self.outside else 0.0
    for i in range(self.times):
      y = y + transform(lambda x: d(x))((i + 1.0) * x)
    return y


class Direct(nn.Module):

  @nn.compact
  def __call__(self, x):
    return fl.QDense(8, recipe=R, name="d")(x)


@functools.lru_cache(maxsize=None)
def _direct_variables():
  """Direct's variables, initialized once (jitted: op by op, a quantized forward costs seconds)."""
  return jax.jit(Direct().init)(jax.random.key(0), X)


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_raw_transform_inside_a_method_trains(wrap):
  v = _direct_variables()
  _assert_steady(_history(_train(Wrapped(wrap), variables=v), "d"), AMAX)


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_raw_transform_after_a_call_outside_is_linked(wrap):
  v = _direct_variables()
  # Outside: x; inside (a nested trace, linked to the outer chain): x again.
  _assert_steady(_history(_train(Wrapped(wrap, outside=True), variables=v, steps=5), "d"), AMAX)


def test_raw_transform_init_declares_state_as_constants():
  # The state is declared inside the checkpoint's trace; its value must not
  # be a tracer of that trace (flax's own params are, and leak: that is flax's).
  class OnlyState(nn.Module):

    @nn.compact
    def __call__(self, x):
      return jax.checkpoint(lambda x: fl.Fp8Activation(name="a")(x))(x)

  v = OnlyState().init(jax.random.key(0), X)
  hist = v[fl.OWG]["a"]["input_amax_history"]
  assert not isinstance(hist, jax.core.Tracer)


def test_two_sibling_raw_transforms_raise():
  v = _direct_variables()
  with pytest.raises(StateUseError, match=r"d is called in two JAX traces"):
    _train(Wrapped("checkpoint", times=2), variables=v, steps=1)


def test_forward_only_loops_do_not_raise():
  # Evaluation never forms the state's cotangent: nothing can be summed.
  class RawScan(nn.Module):

    @nn.compact
    def __call__(self, x):
      d = _dense()
      d(x)
      return jax.lax.scan(lambda c, _: (d(c), None), x, None, length=3)[0]

  model = RawScan()
  v = jax.jit(model.init)(jax.random.key(0), X)
  chex.assert_shape(jax.jit(model.apply)(v, X), X.shape)


# ----------------------------------------------------------------------------
# quantize_model: the same rules through the interception, and the jit cache.


def test_quantize_model_vmap_and_scan_follow_the_same_rules():
  class Shared(nn.Module):

    @nn.compact
    def __call__(self, x):
      layer = nn.vmap(nn.Dense, variable_axes={"params": None, fl.OWG: None},
                      split_rngs={"params": False})
      return layer(8)(x)

  qm = fl.quantize_model(Shared(), R)
  _assert_steady(_history(_train(qm), "VmapDense_0"), AMAX)

  class Broadcast(nn.Module):

    @nn.compact
    def __call__(self, x):
      def body(m, c, _):
        return nn.Dense(8)(c), None
      stack = nn.scan(body, variable_broadcast=["params", fl.OWG],
                      split_rngs={"params": False}, length=2)
      return stack(self, x, None)[0]

  with pytest.raises(StateUseError, match="scan"):
    _train(fl.quantize_model(Broadcast(), R), steps=1)


class JitModel(nn.Module):
  """gemma's pattern: the model's __call__ is nn.jit-ed."""

  @nn.jit
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(x)


@pytest.mark.parametrize("float_first", [True, False])
def test_nn_jit_trace_cache_never_crosses_quantized_and_float(float_first, recwarn):
  jax.clear_caches()
  model = JitModel()
  qmodel = fl.quantize_model(model, R)
  runs = [model, qmodel, model, qmodel] if float_first else [qmodel, model, qmodel, model]
  for m in runs:
    v = m.init(jax.random.key(0), X)
    m.apply(v, X)
    assert (fl.OWG in v) == (m is qmodel), f"{'quantized' if m is qmodel else 'float'} model"
  report = qmodel.product_report(qmodel.init(jax.random.key(0), X), X)
  assert report.counts == {"quantized": 1}
  assert not [w for w in recwarn if "matched no module op" in str(w.message)]


def test_frozen_quantizers_around_a_jitted_call_retrace():
  # The flag is part of the jit key: entering it around a compiled function
  # takes effect instead of replaying the training trace.
  model = fl.QDense(4, recipe=fl.IntRecipe())
  v = jax.jit(model.init)(jax.random.key(0), X)
  v = fl.merge_owg(v, jax.jit(jax.grad(lambda v: model.apply(v, X).sum()))(v))
  run = jax.jit(model.apply)
  train_out = run(v, 3 * X)
  with fl.frozen_quantizers():
    frozen_out = run(v, 3 * X)
  assert not np.allclose(np.asarray(train_out), np.asarray(frozen_out))
  with fl.frozen_quantizers():
    chex.assert_trees_all_close(frozen_out, model.apply(v, 3 * X))


def test_a_scan_around_a_shard_map_is_seen_by_the_state_check():
  """MaxText's scan_layers over its MoE's shard_map: the body's trace has no parent, but
  the scan around the call would still sum the layers' state updates into one."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])

  class Stack(nn.Module):

    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.normal(0.5), (2, 8, 8))
      body = jax.shard_map(lambda h, wl: jnp.einsum("bf,fo->bo", h, wl), mesh=mesh,
                           in_specs=(P(), P()), out_specs=P())
      return jax.lax.scan(lambda h, wl: (body(h, wl), None), x, w)[0]

  qm = fl.quantize_model(Stack(), R)
  v = qm.init(jax.random.key(0), X)
  with pytest.raises(StateUseError, match=r"einsum_0 is applied inside a scan"):
    jax.grad(lambda v: qm.apply(v, X).sum())(v)


@pytest.mark.parametrize("check_vma", [True, False])
def test_raw_shard_map_inside_a_method_declares_and_trains(check_vma):
  """MaxText runs its sparse MoE inside a raw jax.shard_map: state declared there stays constant.

  MaxText's is ``check_vma=False``: JAX then sums the closed-over state's
  gradient over the 4 devices, so without the state handed to one device the
  history would grow 4-fold each step (and each device scale by its own amax).
  """
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  mesh = jax.make_mesh((4,), ("e",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])

  class Sharded(nn.Module):

    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.normal(), (8, 8))
      return jax.shard_map(lambda x, w: jnp.einsum("bd,df->bf", x, w), mesh=mesh,
                           in_specs=(P("e"), P()), out_specs=P("e"), check_vma=check_vma)(x, w)

  qm = fl.quantize_model(Sharded(), R)
  v = qm.init(jax.random.key(0), X)
  assert not any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(v))
  _assert_steady(_history(_train(qm, variables=v), "einsum_0"), AMAX)  # the max over the shards
