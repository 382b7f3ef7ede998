"""``quantize_once_per_window`` (Linen, NNX): under ``optax.MultiSteps``, weights quantized once
per window.

The wrapped step must leave the state exactly where the plain step leaves it,
call after call, for fp8, integer and float models, plain, rematerialized and
scanned; build its cache once per window (checked by identity on the host and
by the cached branch's program, which casts no weight); and give the plain
step's values whenever the cache is stale (a wrong ``every_k``, a skipped
micro-batch, a state whose parameters were replaced).
"""

from unittest import mock

import chex
from absl.testing import parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl
from fp8_linen.core import hoist

D = 16
K = 3


class Mlp(nn.Module):
  recipe: object = fl.delayed_scaling()
  d: int = D

  @nn.compact
  def __call__(self, x):
    make = ((lambda n: nn.Dense(n, dtype=jnp.bfloat16)) if self.recipe is None else
            (lambda n: fl.QDense(n, dtype=jnp.bfloat16, recipe=self.recipe)))
    return make(self.d)(jax.nn.gelu(make(4 * self.d)(x)))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + Mlp()(x), None


class Stack(nn.Module):
  """Two blocks stacked by ``nn.scan``, each rematerialized."""

  @nn.compact
  def __call__(self, x):
    scanned = nn.scan(nn.remat(Block), variable_axes={"params": 0, fl.OWG: 0},
                      split_rngs={"params": True}, length=2)
    return scanned()(x, None)[0]


# Micro-batches of very different ranges: the window's fp8 state is their max.
SCALES = (0.5, 40.0, 3.0, 7.0)


def _batches(n, rows=8):
  keys = jax.random.split(jax.random.key(0), 2 * n)
  return [((jax.random.normal(keys[i], (rows, D)) * SCALES[i % len(SCALES)]).astype(jnp.bfloat16),
           jax.random.normal(keys[n + i], (rows, D))) for i in range(n)]


def _setup(model, tx=None, d=D):
  variables = model.init(jax.random.key(1), jnp.ones((8, d), jnp.bfloat16))
  tx = tx or optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K)
  state = fl.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

  def step(state, x, y):
    def loss(v):
      return jnp.mean((state.apply_fn(v, x).astype(jnp.float32) - y) ** 2)
    loss_value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), loss_value

  return state, step


def _run(step, state, batches):
  losses = []
  for x, y in batches:
    state, loss = step(state, x, y)
    losses.append(loss)
  return state, losses


def _assert_same(got, want):
  """Every array of two TrainStates (the cache aside) and the losses, bit for bit."""
  (gs, gl), (ws, wl) = got, want
  chex.assert_trees_all_equal(gs.replace(window_cache=None, tx=ws.tx, apply_fn=ws.apply_fn), ws)
  chex.assert_trees_all_equal(gl, wl)


class WindowCacheTest(chex.TestCase):

  @parameterized.named_parameters(
      ("delayed", Mlp()), ("current", Mlp(fl.current_scaling())), ("int8", Mlp(fl.IntRecipe())),
      ("mxfp8", Mlp(fl.mx_block_scaling())), ("bf16", Mlp(None)), ("scan_remat", Stack()))
  def test_same_state_as_the_plain_step(self, model):
    state, step = _setup(model)
    batches = _batches(2 * K + 1)
    want = _run(jax.jit(step), state, batches)
    _assert_same(_run(fl.quantize_once_per_window(step, every_k=K), state, batches), want)
    # Two windows went by: the weights and their fp8 state moved.
    assert int(want[0].opt_state.gradient_step) == 2

  def test_a_donated_state_gives_the_same_values(self):
    state, step = _setup(Mlp())
    batches = _batches(2 * K)
    want = _run(jax.jit(step), state, batches)
    fresh, _ = _setup(Mlp())  # (the donated buffers are gone after the call)
    _assert_same(_run(fl.quantize_once_per_window(step, every_k=K, donate_state=True), fresh,
                      batches), want)

  def test_the_cache_is_built_once_per_window(self):
    state, step = _setup(Mlp())
    wrapped = fl.quantize_once_per_window(step, every_k=K)
    built = []
    for x, y in _batches(2 * K):
      state, _ = wrapped(state, x, y)
      built.append(state.window_cache[1][0])
    firsts = [built[0], built[K]]
    assert all(b is firsts[i // K] for i, b in enumerate(built))
    assert firsts[0] is not firsts[1]
    assert [int(state.window_cache[0])] == [1]

  def test_the_cached_branch_casts_no_weight(self):
    state, step = _setup(Mlp())
    wrapped = fl.quantize_once_per_window(step, every_k=K)
    x, y = _batches(1)[0]
    rest, extra = state.replace(params=None), ((x, y), {})
    cache = wrapped.prologue(state.params, rest, extra)
    jaxpr = jax.make_jaxpr(wrapped.steady)(state.params, rest, cache,
                                           state.opt_state.gradient_step, extra).jaxpr
    (call,) = jaxpr.eqns  # (the jitted program)
    (cond,) = [e for e in call.params["jaxpr"].jaxpr.eqns if str(e.primitive) == "cond"]
    stale, fresh = cond.params["branches"]  # (index 0: the predicate is false)
    assert _weight_casts(stale.jaxpr) and not _weight_casts(fresh.jaxpr)

  @parameterized.named_parameters(("too_few", K - 1), ("too_many", K + 2))
  def test_a_wrong_every_k_costs_time_not_values(self, every_k):
    state, step = _setup(Mlp())
    batches = _batches(3 * K)
    _assert_same(_run(fl.quantize_once_per_window(step, every_k=every_k), state, batches),
                 _run(jax.jit(step), state, batches))

  def test_a_skipped_microbatch_keeps_the_window(self):
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K,
                          should_skip_update_fn=optax.skip_not_finite)
    state, step = _setup(Mlp(), tx)
    batches = _batches(2 * K + 1)
    x, y = batches[1]
    batches[1] = (x.at[0, 0].set(jnp.nan), y)
    want = _run(jax.jit(step), state, batches)
    got = _run(fl.quantize_once_per_window(step, every_k=K), state, batches)
    _assert_same(got, want)
    # The NaN micro-batch did not count, so the second window began a call later than
    # the wrapper counted (its calls 5 and 6 found a stale cache) and ended with the last.
    assert int(want[0].opt_state.gradient_step) == 2
    assert int(want[0].opt_state.mini_step) == 0

  def test_replaced_parameters_drop_the_cache(self):
    state, step = _setup(Mlp())
    wrapped = fl.quantize_once_per_window(step, every_k=K)
    x, y = _batches(1)[0]
    state, _ = wrapped(state, x, y)
    assert state.window_cache is not None
    assert fl.resize_histories(state, 8).window_cache is None
    tail = Mlp(fl.current_scaling())
    fresh = tail.init(jax.random.key(1), x)
    assert fl.switch_precision(state, apply_fn=tail.apply, variables=fresh).window_cache is None

  def test_a_restarted_wrapper_finds_its_place_in_the_window(self):
    state, step = _setup(Mlp())
    batches = _batches(2 * K)
    want = _run(jax.jit(step), state, batches)
    mid, _ = _run(fl.quantize_once_per_window(step, every_k=K), state, batches[:2])
    # A new wrapper (a restarted job) with a restored state and its cache.
    again = fl.quantize_once_per_window(step, every_k=K)
    state, losses = _run(again, mid.replace(window_cache=None), batches[2:])
    _assert_same((state, losses), (want[0], want[1][2:]))

  def test_bad_arguments_are_refused(self):
    state, step = _setup(Mlp(), optax.adam(1e-2))
    for bad in (0, -1, 2.0, True, None):
      with pytest.raises(ValueError, match="every_k must be a positive int"):
        fl.quantize_once_per_window(step, every_k=bad)
    wrapped = fl.quantize_once_per_window(step, every_k=K)
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match="optax.MultiSteps"):
      wrapped(state, x, y)
    with pytest.raises(ValueError, match="fl.TrainState"):
      wrapped(state.params, x, y)
    ms_state, _ = _setup(Mlp())
    with pytest.raises(TypeError, match="must return the new fl.TrainState"):
      fl.quantize_once_per_window(lambda s, x, y: s.params, every_k=K)(ms_state, x, y)


WEIGHTS = {(D, 4 * D), (4 * D, D)}


def _weight_casts(jaxpr):
  """Equations (nested ones included) writing fp8 codes of a weight's shape from floats."""
  out = []
  for e in jaxpr.eqns:
    floats = [v for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)
              and "float8" not in str(v.aval.dtype)]
    if floats and any("float8" in str(o.aval.dtype) and o.aval.shape in WEIGHTS
                      for o in e.outvars):
      out.append(e)
    for p in e.params.values():
      for inner in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          out += _weight_casts(inner)
  return out


def test_h100_steady_call_casts_no_weight_and_moves_less(require_target):
  """Compiled for an H100: the branch a window's later calls run casts no weight to fp8 and
  moves fewer bytes than the plain step (estimates, compile only)."""
  require_target("h100")
  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing import compile as compile_lib
  from fp8_linen.testing import estimate, hlo, hlo_kernels, passes

  d = 512
  state, step = _setup(Mlp(d=d), d=d)
  state = state.replace(step=jnp.asarray(state.step))
  xy = (jax.ShapeDtypeStruct((1024, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((1024, d), jnp.float32))
  wrapped = fl.quantize_once_per_window(step, every_k=K)
  rest, extra = state.replace(params=None), (xy, {})
  with fl.target_backend("gpu"):
    cache = jax.eval_shape(wrapped.prologue, state.params, rest, extra)
  steady = compile_lib.compile_for("h100", wrapped.steady, state.params, rest, cache,
                                   state.opt_state.gradient_step, extra)
  plain = compile_lib.compile_for("h100", step, state, *xy)
  assert any(k.branch for k in steady.kernel_list), "the stale-cache conditional is gone"

  def weight_casts(report):
    module = hlo.parse(report.hlo)
    every = {p.name for p in passes.passes(report) if p.every_step}
    out = []
    for comp, insts in module.computations.items():
      for inst in insts:
        if inst.name not in every or inst.opcode not in ("fusion", "convert"):
          continue
        codes = [a for a in inst.result
                 if a.dtype.startswith("f8") and a.shape in {(d, 4 * d), (4 * d, d)}]
        floats = [a for arrays in module.operand_arrays(comp, inst) for a in arrays
                  if a.dtype in ("f32", "bf16", "f16")]
        if codes and floats:
          out.append(inst.name)
    return out

  def moved(report):
    return sum(p.bytes for p in passes.passes(report) if p.every_step)

  assert weight_casts(plain), "the plain step should cast its weights (the check can fail)"
  assert not weight_casts(steady)
  assert moved(steady) < moved(plain)
  peaks = estimate.PEAKS["h100"]
  assert (estimate.estimate(steady.kernel_list, peaks).seconds
          < estimate.estimate(plain.kernel_list, peaks).seconds)
  # The branch every later call runs multiplies what the plain step multiplies.
  keep = hlo_kernels.every_step_branches(
      (k.branch, k.bytes_read + k.bytes_written) for k in steady.kernel_list)
  classes = lambda ks: sorted(c for k in ks for c, _ in k.flops)
  assert classes(k for k in steady.kernel_list if k.branch in keep) == classes(plain.kernel_list)
  assert plain.fp8_gemms == 5


class NnxMlp(nnx.Module):

  def __init__(self, recipe, rngs):
    self.up = fl.nnx.Linear(D, 4 * D, dtype=jnp.bfloat16, recipe=recipe, rngs=rngs)
    self.down = fl.nnx.Linear(4 * D, D, dtype=jnp.bfloat16, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def _nnx_step(model, opt, x, y):
  loss, grads = fl.nnx.value_and_grad(
      lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2))(model)
  opt.update(model, grads)
  return loss


def _nnx_run(step, recipe, batches):
  model = NnxMlp(recipe, nnx.Rngs(0))
  opt = fl.nnx.Optimizer(model, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K))
  losses = [step(model, opt, x, y) for x, y in batches]
  return nnx.to_flat_state(nnx.state((model, opt))), losses


class NnxWindowCacheTest(chex.TestCase):

  @parameterized.named_parameters(
      ("delayed", fl.delayed_scaling(), K), ("int8", fl.IntRecipe(), K),
      ("wrong_every_k", fl.delayed_scaling(), K + 1),
      ("donated", fl.delayed_scaling(), K, True))
  def test_same_state_as_the_plain_step(self, recipe, every_k, donate=False):
    batches = _batches(2 * K + 1)
    want_state, want_losses = _nnx_run(nnx.jit(_nnx_step), recipe, batches)
    got_state, got_losses = _nnx_run(
        fl.nnx.quantize_once_per_window(_nnx_step, every_k=every_k, donate=donate), recipe,
        batches)
    chex.assert_trees_all_equal(got_losses, want_losses)
    want = dict(want_state)
    assert {p for p, _ in got_state} == set(want)
    for path, v in got_state:
      np.testing.assert_array_equal(v[...], want[path][...], err_msg=str(path))
    assert int(want[(1, "opt_state", "gradient_step")][...]) == 2

  def test_the_cache_is_built_once_per_window(self):
    built, real = [], hoist.window_programs

    def counting(*a, **k):
      prologue, steady = real(*a, **k)
      return (lambda *x: built.append(1) or prologue(*x)), steady

    with mock.patch.object(hoist, "window_programs", counting):
      wrapped = fl.nnx.quantize_once_per_window(_nnx_step, every_k=K)
      _nnx_run(wrapped, fl.delayed_scaling(), _batches(2 * K))
    assert len(built) == 2

  def test_bad_arguments_are_refused(self):
    with pytest.raises(ValueError, match="every_k must be a positive int"):
      fl.nnx.quantize_once_per_window(_nnx_step, every_k=0)
    model = NnxMlp(fl.delayed_scaling(), nnx.Rngs(0))
    x, y = _batches(1)[0]
    plain = fl.nnx.Optimizer(model, optax.adam(1e-2))
    wrapped = fl.nnx.quantize_once_per_window(_nnx_step, every_k=K)
    with pytest.raises(ValueError, match="nnx.Optimizer over optax.MultiSteps"):
      wrapped(model, plain, x, y)
    opt = fl.nnx.Optimizer(model, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=K))
    returns_model = fl.nnx.quantize_once_per_window(
        lambda m, o, x, y: (_nnx_step(m, o, x, y), m), every_k=K)
    with pytest.raises(ValueError, match="must return arrays, not modules"):
      returns_model(model, opt, x, y)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_on_a_mesh_the_state_is_the_plain_steps(axis_type):
  """Data parallel over 8 devices (Explicit and Auto axes): the wrapped step's state is the plain
  jitted step's on the same mesh."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,)
  mesh = jax.make_mesh((8,), ("data",), axis_types=types)
  batches = _batches(2 * K + 1, rows=16)
  with jax.set_mesh(mesh):
    runs = []
    for wrap in (jax.jit, lambda s: fl.quantize_once_per_window(s, every_k=K)):
      state, step = _setup(Mlp())
      state = jax.device_put(state, NamedSharding(mesh, P()))
      sharded = [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batches]
      runs.append(_run(wrap(step), state, sharded))
  _assert_same(*runs[::-1])


def test_the_split_traces_python_numbers_as_jit_does():
  """Outside ``jit`` a TrainState's step counter is a Python int: the split traces it weakly
  typed, as ``jax.jit`` would, and the body gives the step's values."""
  state, step = _setup(Mlp())
  x, y = _batches(1)[0]
  run = lambda p, rest: step(rest[0].replace(params=p), *rest[1])[1]
  rest = (state.replace(params=None), (x, y))
  parts = hoist.split(run, state.params, rest)
  assert parts.hoisted_bytes > 0
  # (Compiled: eager bf16 ops round each result, XLA's fusions do not.)
  got = jax.jit(lambda p, r: parts.body(p, parts.prologue(p), r))(state.params, rest)
  np.testing.assert_array_equal(got, jax.jit(step)(state, x, y)[1])
