"""Gradient accumulation with weights quantized once per window (``fl.accumulate_microbatches``).

The window's gradients must be those of the plain loop over micro-batches
(``fl.accumulate_gradients`` then ``fl.finalize_accumulated``), with and
without the hoisting of the work on the variables (``fp8_linen.core.hoist``),
for plain, rematerialized and scanned (stacked-layer) models. What the
hoisting saves is checked in the compiled H100 program: no weight is cast to
fp8 inside the loop.
"""

import functools

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


class Mlp(nn.Module):
  recipe: object = fl.delayed_scaling()

  @nn.compact
  def __call__(self, x):
    h = fl.QDense(4 * D, dtype=jnp.bfloat16, recipe=self.recipe)(x)
    return fl.QDense(D, dtype=jnp.bfloat16, recipe=self.recipe)(jax.nn.gelu(h))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + Mlp()(x), None


class Stack(nn.Module):
  """Three blocks stacked by ``nn.scan`` (optionally each rematerialized)."""

  remat: bool = False

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Block) if self.remat else Block
    scanned = nn.scan(block, variable_axes={"params": 0, fl.OWG: 0},
                      split_rngs={"params": True}, length=3)
    return scanned()(x, None)[0]


class Remat(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(Block)()(x, None)[0]


# Micro-batches of very different ranges: the window's fp8 state is their max.
SCALES = (0.5, 40.0, 3.0)


def _setup(model, n_micro=len(SCALES), rows=8):
  keys = jax.random.split(jax.random.key(0), 2 * n_micro)
  xs = jnp.stack([jax.random.normal(keys[i], (rows, D)) * SCALES[i % len(SCALES)]
                  for i in range(n_micro)]).astype(jnp.bfloat16)
  ys = jnp.stack([jax.random.normal(keys[n_micro + i], (rows, D)) for i in range(n_micro)])
  variables = model.init(jax.random.key(1), xs[0])

  def loss(v, batch):
    x, y = batch
    return jnp.mean((model.apply(v, x).astype(jnp.float32) - y) ** 2)

  return variables, (xs, ys), loss


def _loop(grad_fn, variables, batches):
  # Compiled, as in the scan: eager bf16 ops round each result, XLA's fusions do not.
  grad_fn = jax.jit(grad_fn)
  acc = None
  n = len(jax.tree.leaves(batches)[0])
  for i in range(n):
    acc = fl.accumulate_gradients(acc, grad_fn(variables, jax.tree.map(lambda a: a[i], batches)))
  return fl.finalize_accumulated(acc, n)


class AccumulateMicrobatchesTest(chex.TestCase):

  @parameterized.named_parameters(
      ("delayed", Mlp(fl.delayed_scaling())), ("current", Mlp(fl.current_scaling())),
      ("int8", Mlp(fl.IntRecipe())), ("remat", Remat()), ("scan", Stack()),
      ("scan_remat", Stack(remat=True)))
  def test_same_gradients_as_the_loop(self, model):
    self._check_against_the_loop(model, jax.jit, static_argnums=(0, 3))

  @chex.variants(with_jit=True, without_jit=True)
  def test_same_gradients_with_and_without_jit(self):
    self._check_against_the_loop(Mlp(), self.variant, static_argnums=(0, 3))

  def _check_against_the_loop(self, model, wrap, **kwargs):
    variables, batches, loss = _setup(model)
    grad_fn = jax.grad(loss)
    want = _loop(grad_fn, variables, batches)
    run = wrap(lambda g, v, b, h: fl.accumulate_microbatches(g, v, b, hoist=h), **kwargs)
    for hoist_it in (True, False):
      got = run(grad_fn, variables, batches, hoist_it)
      chex.assert_trees_all_equal_structs(got, want)
      # The fp8 state is the max over the window, bit for bit.
      if fl.OWG in want:
        chex.assert_trees_all_equal(got[fl.OWG], want[fl.OWG])
      # Sums in another order (a scan vs a Python loop): the last bits.
      chex.assert_trees_all_close(got["params"], want["params"], rtol=1e-5, atol=1e-6)
    # The window's state holds the largest micro-batch's amax (the 40x one).
    if fl.OWG in want and "input_amax_history" in want[fl.OWG].get("QDense_0", {}):
      newest = want[fl.OWG]["QDense_0"]["input_amax_history"][0]
      assert float(newest) == pytest.approx(float(jnp.max(jnp.abs(batches[0][1]))))

  def test_hoisted_and_not_are_bit_identical(self):
    variables, batches, loss = _setup(Stack(remat=True))
    grad_fn = jax.grad(loss)
    run = jax.jit(fl.accumulate_microbatches, static_argnums=0, static_argnames="hoist")
    chex.assert_trees_all_equal(run(grad_fn, variables, batches, hoist=True),
                                run(grad_fn, variables, batches, hoist=False))

  def test_aux_is_stacked_over_the_microbatches(self):
    variables, batches, loss = _setup(Mlp())
    grad_fn = jax.grad(lambda v, b: (loss(v, b), loss(v, b)), has_aux=True)
    grads, aux = fl.accumulate_microbatches(grad_fn, variables, batches, has_aux=True)
    assert aux.shape == (len(SCALES),)
    for i in range(len(SCALES)):
      # (Compiled: eager bf16 ops round each result, XLA's fusions do not.)
      _, want = jax.jit(grad_fn)(variables, jax.tree.map(lambda a, i=i: a[i], batches))
      assert float(aux[i]) == pytest.approx(float(want), rel=1e-6)
    assert set(grads) == set(variables)

  def test_bad_microbatches_are_refused(self):
    variables, (xs, ys), loss = _setup(Mlp())
    grad_fn = jax.grad(loss)
    with pytest.raises(ValueError, match="microbatches.*leading"):
      fl.accumulate_microbatches(grad_fn, variables, (xs, ys[:2]))
    with pytest.raises(ValueError, match="microbatches.*leading"):
      fl.accumulate_microbatches(grad_fn, variables, (xs[:0], ys[:0]))
    with pytest.raises(ValueError, match="microbatches has no arrays"):
      fl.accumulate_microbatches(grad_fn, variables, ())
    with pytest.raises(ValueError, match="grad_fn must return"):
      fl.accumulate_microbatches(lambda v, b: jnp.zeros(()), variables, (xs, ys))


def _body_primitives(parts, invariant, x):
  jaxpr = jax.make_jaxpr(lambda inv, pre, x: parts.body(inv, pre, x))(
      invariant, parts.prologue(invariant), x).jaxpr
  return [str(e.primitive) for e in jaxpr.eqns]


class SplitTest(chex.TestCase):

  def test_the_work_on_the_invariant_inputs_moves_out(self):
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    parts = hoist.split(lambda w, x: jnp.dot(x, jnp.tanh(w)), w, x)
    assert [str(p) for p in parts.hoisted_primitives] == ["tanh"]
    assert "tanh" not in _body_primitives(parts, w, x)
    np.testing.assert_array_equal(parts.body(w, parts.prologue(w), x), x @ jnp.tanh(w))

  def test_effects_and_inflating_results_stay_in_the_loop(self):
    w, x = jnp.ones((4096,), jnp.bfloat16), jnp.ones((8, 4096))

    def f(w, x):
      jax.debug.callback(lambda a: None, w)        # a side effect: once per iteration
      wide = w.astype(jnp.float32)                 # 2x its source, read by the loop
      ones = jnp.broadcast_to(jnp.float32(2.0), (8, 4096))  # from a constant
      return x * wide + ones

    parts = hoist.split(f, w, x)
    body = _body_primitives(parts, w, x)
    assert "debug_callback" in body
    assert "convert_element_type" in body
    assert parts.hoisted_bytes == 0

  def test_closure_constants_count_as_invariant(self):
    table = jnp.arange(6.0).reshape(2, 3)
    parts = hoist.split(lambda w, x: x @ jnp.exp(table * w), jnp.float32(2.0), jnp.ones((4, 2)))
    assert "exp" in [str(p) for p in parts.hoisted_primitives]
    np.testing.assert_allclose(parts.body(2.0, parts.prologue(2.0), jnp.ones((4, 2))),
                               jnp.ones((4, 2)) @ jnp.exp(table * 2.0), rtol=1e-6)

  @parameterized.named_parameters(("plain", Mlp()), ("remat", Remat()), ("scan", Stack()),
                                  ("scan_remat", Stack(remat=True)))
  def test_no_weight_is_cast_to_fp8_in_the_loop(self, model):
    variables, batches, loss = _setup(model)
    window = lambda h: jax.make_jaxpr(lambda v, b: fl.accumulate_microbatches(
        jax.grad(loss), v, b, hoist=h))(variables, batches)
    assert not _loop_casts(window(True))
    assert _loop_casts(window(False))  # (the check can fail)


WEIGHTS = {(D, 4 * D), (4 * D, D)}


def _weight_casts(jaxpr, shapes=WEIGHTS, tail=True):
  """Equations (nested ones included) writing fp8 codes of ``shapes`` from floats.

  ``tail``: match the codes' last two axes (a layer's slice of stacked weights).
  """
  for e in jaxpr.eqns:
    # A bitcast or a transpose of codes reads no float: it is no cast.
    floats = [v for v in e.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)
              and "float8" not in str(v.aval.dtype)]
    if floats and any("float8" in str(o.aval.dtype)
                      and (o.aval.shape[-2:] if tail else o.aval.shape) in shapes
                      for o in e.outvars):
      yield e
    for p in e.params.values():
      inner = getattr(p, "jaxpr", p)
      if hasattr(inner, "eqns"):
        yield from _weight_casts(inner, shapes, tail)


def _loop_casts(closed, shapes=WEIGHTS, tail=True):
  """The weight casts inside the accumulation loop (the last top-level scan)."""
  (loop,) = [e for e in closed.jaxpr.eqns if str(e.primitive) == "scan"][-1:]
  return list(_weight_casts(loop.params["jaxpr"].jaxpr, shapes, tail))


def test_h100_window_casts_no_weight_in_the_loop(require_target):
  """Compiled for an H100: no kernel of the loop body casts a float to weight-shaped fp8 codes."""
  require_target("h100")
  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing import compile as compile_lib
  from fp8_linen.testing import hlo

  model = Mlp(fl.delayed_scaling())
  variables, batches, loss = _setup(model, rows=32)
  grad_fn = jax.grad(loss)
  def loop_casts(hoist_it):
    report = compile_lib.compile_for(
        "h100", lambda v, b: fl.accumulate_microbatches(grad_fn, v, b, hoist=hoist_it),
        variables, batches)
    module = hlo.parse(report.hlo)
    (loop,) = [i for c in module.computations.values() for i in c if i.opcode == "while"]
    out = []
    for inst in module.computations[loop.body]:
      if inst.opcode not in ("fusion", "convert"):
        continue  # (the loop state's tuple and its elements move nothing)
      codes = [a for a in inst.result if a.dtype.startswith("f8") and a.shape in WEIGHTS]
      # Reading codes to write codes (a transpose of hoisted codes) is no cast.
      floats = [a for arrays in module.operand_arrays(loop.body, inst) for a in arrays
                if a.dtype in ("f32", "bf16", "f16")]
      if codes and floats:
        out.append(inst.name)
    return out

  assert loop_casts(False), "the per-micro-batch program should cast the weights in its loop"
  assert not loop_casts(True)


class NnxMlp(nnx.Module):

  def __init__(self, rngs):
    self.up = fl.nnx.Linear(D, 4 * D, dtype=jnp.bfloat16, rngs=rngs)
    self.down = fl.nnx.Linear(4 * D, D, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def _nnx_loss(model, batch):
  x, y = batch
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


class NnxAccumulateTest(chex.TestCase):

  def test_same_gradients_as_the_loop(self):
    model = NnxMlp(nnx.Rngs(0))
    _, batches, _ = _setup(Mlp())
    grad_fn = fl.nnx.grad(_nnx_loss)
    step = nnx.jit(grad_fn)
    each = [step(model, jax.tree.map(lambda a, i=i: a[i], batches)) for i in range(len(SCALES))]
    for hoist_it in (True, False):
      got = nnx.jit(lambda m, b, h=hoist_it: fl.nnx.accumulate_microbatches(
          grad_fn, m, b, hoist=h))(model, batches)
      for path, v in nnx.to_flat_state(got):
        parts = [dict(nnx.to_flat_state(g))[path] for g in each]
        if isinstance(v, fl.nnx.QuantState):
          want = functools.reduce(jnp.maximum, [p[...] for p in parts])
          np.testing.assert_array_equal(v[...], want, err_msg=str(path))
        else:
          want = sum(p[...] for p in parts) / len(parts)
          np.testing.assert_allclose(v[...], want, rtol=1e-5, atol=1e-6, err_msg=str(path))

  def test_no_weight_is_cast_to_fp8_in_the_loop(self):
    model = NnxMlp(nnx.Rngs(0))
    _, batches, _ = _setup(Mlp())
    window = lambda h: jax.make_jaxpr(lambda b: fl.nnx.accumulate_microbatches(
        fl.nnx.grad(_nnx_loss), model, b, hoist=h))(batches)
    assert not _loop_casts(window(True))
    assert _loop_casts(window(False))

  def test_a_train_step_writes_the_window_state_once(self):
    model = NnxMlp(nnx.Rngs(0))
    opt = fl.nnx.Optimizer(model, optax.sgd(1e-3))
    _, batches, _ = _setup(Mlp())

    @nnx.jit
    def train_step(model, opt, batches):
      grads, losses = fl.nnx.accumulate_microbatches(
          fl.nnx.grad(lambda m, b: (_nnx_loss(m, b),) * 2, has_aux=True), model, batches,
          has_aux=True)
      opt.update(model, grads)
      return losses

    losses = train_step(model, opt, batches)
    assert losses.shape == (len(SCALES),)
    history = model.up.input_amax_history[...]
    # One optimizer step: one history entry, the window's largest amax (the 40x batch).
    assert float(history[0]) == pytest.approx(float(jnp.max(jnp.abs(batches[0][1]))))
    assert float(history[1]) == 0.0

  def test_grad_fn_must_return_the_model_gradients(self):
    model = NnxMlp(nnx.Rngs(0))
    _, batches, _ = _setup(Mlp())
    with pytest.raises(ValueError, match="nnx.State"):
      fl.nnx.accumulate_microbatches(lambda m, b: {"w": jnp.zeros(())}, model, batches)


def test_an_unobserved_microbatch_adds_nothing_to_the_window():
  # A micro-batch that observes nothing returns its role's state unrolled; its max
  # with the rolled updates of the others would mix history positions.
  old = {"input_amax_history": jnp.array([3.0, 7.0, 0.0]), "input_scale": jnp.array([0.5])}
  variables = {"params": {"w": jnp.float32(1.0)}, fl.OWG: {"layer": old}}

  def grad_fn(v, x):
    h = v[fl.OWG]["layer"]["input_amax_history"]
    rolled = {"input_amax_history": jnp.concatenate([x[None], h[:-1]]),
              "input_scale": (x / 448.0)[None]}
    state = jax.tree.map(lambda r, o: jnp.where(x > 0, r, o), rolled, v[fl.OWG]["layer"])
    return {"params": {"w": x}, fl.OWG: {"layer": state}}

  for hoist_it in (True, False):
    got = fl.accumulate_microbatches(grad_fn, variables, jnp.array([5.0, 0.0]), hoist=hoist_it)
    np.testing.assert_array_equal(got[fl.OWG]["layer"]["input_amax_history"], [5.0, 3.0, 7.0])
    assert float(got["params"]["w"]) == 2.5
    # No micro-batch observed anything: the state stays as it was.
    none = fl.accumulate_microbatches(grad_fn, variables, jnp.zeros((2,)), hoist=hoist_it)
    chex.assert_trees_all_equal(none[fl.OWG]["layer"], old)


class FloatStack(nn.Module):
  """A float model of one's own: flax layers, raw ``jax.checkpoint``, ``nn.scan`` over layers."""

  @nn.compact
  def __call__(self, x):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        up = nn.Dense(4 * D, dtype=jnp.bfloat16)
        h = jax.checkpoint(lambda a: jax.nn.gelu(a))(up(x))
        return x + nn.Dense(D, dtype=jnp.bfloat16)(h), None

    scanned = nn.scan(Layer, variable_axes={"params": 0, fl.OWG: 0},
                      split_rngs={"params": True}, length=2)
    return scanned()(x, None)[0]


def test_quantize_model_window_quantizes_weights_once():
  model = fl.quantize_model(FloatStack(), fl.delayed_scaling())
  variables, batches, loss = _setup(model)
  grad_fn = jax.grad(loss)
  got = jax.jit(lambda v, b: fl.accumulate_microbatches(grad_fn, v, b))(variables, batches)
  want = _loop(grad_fn, variables, batches)
  chex.assert_trees_all_equal(got[fl.OWG], want[fl.OWG])
  chex.assert_trees_all_close(got["params"], want["params"], rtol=1e-5, atol=1e-6)
  window = lambda h: jax.make_jaxpr(lambda v, b: fl.accumulate_microbatches(
      grad_fn, v, b, hoist=h))(variables, batches)
  assert not _loop_casts(window(True))
  assert _loop_casts(window(False))


def test_decoder_block_window_quantizes_weights_once():
  """An unmodified decoder block (flax attention, LayerNorm, MLP) under quantize_model's rules."""
  from fp8_linen.testing import cases  # pylint: disable=import-outside-toplevel

  block = cases.DecoderBlock(num_heads=2, qkv_features=D, mlp=4 * D)
  model = fl.quantize_model(block, fl.delayed_scaling(), rules=fl.projection_rules())
  variables, batches, loss = _setup(model, rows=24)   # (no activation of a kernel's shape)
  window = lambda h: jax.make_jaxpr(lambda v, b: fl.accumulate_microbatches(
      jax.grad(loss), v, b, hoist=h))(variables, batches)
  # Each kernel, and its axes merged into a matrix either way.
  shapes = set()
  for w in jax.tree.leaves(variables["params"]):
    if w.ndim >= 2:
      shapes |= {w.shape, (int(np.prod(w.shape[:-1])), w.shape[-1]),
                 (w.shape[0], int(np.prod(w.shape[1:])))}
  assert len(_loop_casts(window(False), shapes, tail=False)) >= 6   # q, k, v, out, up, down
  assert not _loop_casts(window(True), shapes, tail=False)


@pytest.mark.parametrize("target", ["tpu7x", "h100"])
def test_window_multiplies_fp8_on_the_target(require_target, target):
  """Every product of the window's compiled program stays fp8 when the weights' work moves out
  (on TPU7x the cast itself stays in the loop: codes made before it were multiplied in bf16)."""
  require_target(target)
  from fp8_linen.testing import compile as compile_lib  # pylint: disable=import-outside-toplevel

  variables, batches, loss = _setup(Mlp(fl.delayed_scaling()), rows=32)
  report = compile_lib.compile_for(
      target, lambda v, b: fl.accumulate_microbatches(jax.grad(loss), v, b), variables, batches)
  kinds = {p.operands for p in report.product_list}
  # Two layers' forward and wgrad, and the second's dgrad (the input needs no gradient).
  assert len(report.product_list) == 5 and all(
      all(d.startswith("f8") for d in ops) for ops in kinds), kinds


def _count(jaxpr, name):
  """How many ``name`` equations ``jaxpr`` runs, nested programs included."""
  n = 0
  for e in jaxpr.eqns:
    n += str(e.primitive) == name
    for p in e.params.values():
      inner = getattr(p, "jaxpr", p)
      if hasattr(inner, "eqns"):
        n += _count(inner, name)
  return n


def test_the_default_splits_for_gpu_and_tpu_not_for_cpu():
  variables, batches, loss = _setup(Mlp())

  def loop_amaxes(**kw):
    closed = jax.make_jaxpr(lambda v, b: fl.accumulate_microbatches(
        jax.grad(loss), v, b, **kw))(variables, batches)
    (loop,) = [e for e in closed.jaxpr.eqns if str(e.primitive) == "scan"][-1:]
    return _count(loop.params["jaxpr"].jaxpr, "reduce_max")

  assert loop_amaxes() == loop_amaxes(hoist=False)        # CPU: the split measured slower
  for platform in ("gpu", "tpu"):
    with fl.target_backend(platform):
      # The weights' amaxes leave the loop (on TPU too: only the cast to fp8 stays).
      assert loop_amaxes() == loop_amaxes(hoist=True) < loop_amaxes(hoist=False)


def test_a_jitted_grad_fn_is_seen_through():
  variables, batches, loss = _setup(Stack(remat=True))
  grad_fn = jax.jit(jax.grad(loss))
  window = lambda h: jax.make_jaxpr(lambda v, b: fl.accumulate_microbatches(
      grad_fn, v, b, hoist=h))(variables, batches)
  assert _loop_casts(window(False))
  assert not _loop_casts(window(True))
  run = jax.jit(lambda v, b: fl.accumulate_microbatches(grad_fn, v, b, hoist=True))
  want = jax.jit(lambda v, b: fl.accumulate_microbatches(grad_fn, v, b, hoist=False))
  chex.assert_trees_all_equal(run(variables, batches), want(variables, batches))


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_a_window_sharded_over_a_data_mesh(axis_type):
  """Micro-batches split over 8 devices (their tokens; GSPMD's automatic axes, or Explicit ones
  whose sharding types the split traces with), variables replicated: the split gives the values
  of the unsplit window there, and the fp8 state of one device."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  variables, batches, loss = _setup(Mlp(), rows=16)
  grad_fn = jax.grad(loss)
  window = lambda h: jax.jit(lambda v, b: fl.accumulate_microbatches(grad_fn, v, b, hoist=h))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      AxisType.Auto if axis_type == "auto" else AxisType.Explicit,))
  with jax.set_mesh(mesh):
    sharded = jax.device_put(batches, NamedSharding(mesh, P(None, "data")))
    replicated = jax.device_put(variables, NamedSharding(mesh, P()))
    got = window(True)(replicated, sharded)
    chex.assert_trees_all_equal(got, window(False)(replicated, sharded))
  # The amaxes are global maxes; the bf16 bias sums are added in another order.
  one = window(True)(variables, batches)
  chex.assert_trees_all_equal(got[fl.OWG], one[fl.OWG])
  chex.assert_trees_all_close(got["params"], one["params"], rtol=2e-2, atol=2e-2)
