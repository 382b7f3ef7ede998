"""Coming from flax's own fp8 ops (flax.linen.fp8_ops): a trained state is kept.

Every checkpoint here is written by flax's op itself, trained a few steps in
the test. The facts the migration rests on (history order, scale convention,
NANOO formats) are asserted on flax's op first, then the first fp8_linen step
is compared with the step flax's op would have taken from the same state:
bit for bit on inputs that quantize exactly (power-of-two scales), within one
float32 ulp of the scale on random data.
"""

import functools
import inspect
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import FrozenDict
from flax.linen import fp8_ops

import fp8_linen as fl
from fp8_linen import training
from fp8_linen.families import modes
from fp8_linen.linen import flax_fp8

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")

OWG = fl.OWG
OPS = [fp8_ops.Fp8DirectDotGeneralOp, fp8_ops.Fp8DotGeneralOp, fp8_ops.NANOOFp8DotGeneralOp]
L = 4  # history length of the flax runs


class Net(nn.Module):
  """One ``nn.Dense`` with an injected dot_general (state at ``Dense_0/<op>_0``)."""

  dg: object
  features: int = 4

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.features, use_bias=False, dot_general_cls=self.dg)(x)


@functools.lru_cache(maxsize=None)
def flax_net(op, length=L):
  # One model per op: jit_step's traces of flax's op are shared across the tests.
  return Net(functools.partial(op, amax_history_length=length))


def our_net(recipe):
  return Net(functools.partial(fl.Fp8DotGeneral, recipe=recipe))


def step(model, v, x, ct):
  """One step: the output, the variables' gradient (new fp8 state) and dL/dx."""
  y, vjp = jax.vjp(model.apply, v, x)
  gv, gx = vjp(ct)
  return y, gv, gx


# ``step`` jitted (one trace per model: warnings are raised while it traces).
# Op by op, a quantized backward costs seconds; comparisons run jitted on both sides.
jit_step = jax.jit(step, static_argnums=0)


def train(model, v, batches, lr=0.0, run=jit_step):
  """flax's own loop: SGD on params, the OWG "gradient" written over the state."""
  for x, ct in batches:
    _, g, _ = run(model, v, x, ct)
    params = jax.tree.map(lambda p, d: p - lr * d, v["params"], g["params"])
    v = {"params": params, OWG: g[OWG]}
  return v


def rep(rng, shape, top, e):
  """Integers in [-top, top] times 2**-e, amax exactly top * 2**-e."""
  a = rng.integers(-top, top + 1, size=shape).astype(np.float32)
  a.flat[0] = top
  return jnp.asarray(a * 2.0 ** -e)


def fp8_top(op):
  """The integer whose multiples give power-of-two scales: fp8 max = top * 2**k."""
  return 15 if op is fp8_ops.NANOOFp8DotGeneralOp else 7  # 240 = 15 * 16, 448 = 7 * 64


@functools.lru_cache(maxsize=None)
def exact_checkpoint(op, seed=0):
  """A flax checkpoint (3 steps) whose histories give power-of-two scales, and a 4th batch.

  Built once per (op, seed): the tests only read it.
  """
  rng = np.random.default_rng(seed)
  top = fp8_top(op)
  w = rep(rng, (16, 4), top, 2)
  model = flax_net(op)
  v = jax.jit(model.init)(jax.random.key(0), jnp.ones((8, 16)))
  v = {"params": {"Dense_0": {"kernel": w}}, OWG: v[OWG]}
  batches = [(rep(rng, (8, 16), top, e), rep(rng, (8, 4), 7, g))
             for e, g in ((1, 0), (0, 1), (2, 2))]
  v = train(model, v, batches)
  # The 4th batch is smaller than the history's max: a fresh state would scale it by itself.
  return model, v, rep(rng, (8, 16), top, 3), rep(rng, (8, 4), 7, 3)


# ---------------------------------------------------------------------------
# What flax's ops do (the facts the conversion relies on).


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_flax_history_is_a_ring_newest_at_0_oldest_at_1(op):
  model = flax_net(op)
  x = jnp.ones((2, 16))
  init = jax.jit(model.init)
  v = init(jax.random.key(0), x)
  assert list(v[OWG]["Dense_0"]) == [f"{op.__name__}_0"]  # flax's auto-name
  v = train(model, v, [(x * a, jnp.ones((2, 4))) for a in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)])
  h = v[OWG]["Dense_0"][f"{op.__name__}_0"]["input_amax_history"]
  np.testing.assert_array_equal(h, [6.0, 3.0, 4.0, 5.0])
  np.testing.assert_array_equal(flax_fp8.flax_history_order(h), [6.0, 5.0, 4.0, 3.0])
  # Before the ring is full too: [3, 0, 1, 2] is 3, 2, 1 newest first.
  v3 = train(model, init(jax.random.key(0), x),
             [(x * a, jnp.ones((2, 4))) for a in (1.0, 2.0, 3.0)])
  h3 = v3[OWG]["Dense_0"][f"{op.__name__}_0"]["input_amax_history"]
  np.testing.assert_array_equal(h3, [3.0, 0.0, 1.0, 2.0])
  np.testing.assert_array_equal(flax_fp8.flax_history_order(h3), [3.0, 2.0, 1.0, 0.0])


def test_history_reorder_is_its_own_inverse_and_matches_a_loop():
  h = jnp.arange(7.0)
  np.testing.assert_array_equal(flax_fp8.flax_history_order(flax_fp8.flax_history_order(h)), h)
  np.testing.assert_array_equal(flax_fp8.flax_history_order(h),
                                [float((-k) % 7) for k in range(7)])


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_flax_scale_is_ours_amax_over_fp8_max_not_its_inverse(op):
  # The stored scale divides x (q = x / s): it is amax / fp8_max, the quantity
  # fp8_linen stores, not fp8_max / amax. NANOO's e4m3fnuz max is 240.
  model = flax_net(op)
  x = jnp.ones((2, 16))
  init = jax.jit(model.init)
  v = train(model, init(jax.random.key(0), x), [(x * 3.0, jnp.ones((2, 4)))] * 2)
  st = v[OWG]["Dense_0"][f"{op.__name__}_0"]
  e4m3_max = 240.0 if op is fp8_ops.NANOOFp8DotGeneralOp else 448.0
  np.testing.assert_allclose(st["input_scale"], [3.0 / e4m3_max], rtol=2 ** -23)
  np.testing.assert_allclose(st["output_grad_scale"], [1.0 / 57344.0], rtol=2 ** -23)
  recipe = fl.flax_fp8_recipe(op)
  assert (recipe.input.fp8_max, recipe.output_grad.fp8_max) == (e4m3_max, 57344.0)
  # flax's first step quantized with the stored scale 1 (the clip trap fp8_linen avoids).
  v1 = train(model, init(jax.random.key(0), x), [(x * 3.0, jnp.ones((2, 4)))])
  np.testing.assert_array_equal(v1[OWG]["Dense_0"][f"{op.__name__}_0"]["input_scale"], [1.0])


def test_flax_op_names_and_our_copies_agree():
  for name in flax_fp8.FLAX_OPS:
    assert inspect.isclass(getattr(fp8_ops, name)), name
  assert tuple(flax_fp8.FLAX_DOT_OPS) == training._FLAX_DOT_OPS
  assert nn.Fp8DotGeneral is fp8_ops.Fp8DirectDotGeneralOp  # same class, same state name


# ---------------------------------------------------------------------------
# The first fp8_linen step uses the trained scales: bit for bit.


def converted(v, how):
  """The checkpoint as the fp8_linen model reads it: as written, or converted once."""
  if how == "automatic":
    return v
  out, report = fl.from_flax_fp8(v)
  assert len(report) == 1
  return out


@pytest.mark.parametrize("how", ["explicit", "automatic"])
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_first_step_equals_flax_next_step_bit_for_bit(op, how):
  model, v, x, ct = exact_checkpoint(op)
  name = f"{op.__name__}_0"
  ours = our_net(fl.flax_fp8_recipe(op, amax_history_length=L))
  y_f, g_f, gx_f = jit_step(model, v, x, ct)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y_o, g_o, gx_o = jit_step(ours, converted(v, how), x, ct)
  messages = [str(w.message) for w in caught]
  # The trained scales were used: the history's max (2**-4 or 2**-6 for the
  # input), not this batch's amax as a fresh state would (8x smaller).
  trained = {"input": 2.0 ** (-4 if fp8_top(op) == 15 else -6),
             "kernel": 2.0 ** (-6 if fp8_top(op) == 15 else -8), "output_grad": 2.0 ** -13}
  st_f = g_f[OWG]["Dense_0"][name]
  st_o = g_o[OWG]["Dense_0"][name if how == "automatic" else "Fp8DotGeneral_0"]
  for role, s in trained.items():
    np.testing.assert_array_equal(st_f[f"{role}_scale"], [s])
    np.testing.assert_array_equal(st_o[f"{role}_scale"], [s])
    h_o = st_o[f"{role}_amax_history"]
    # Automatic: written back in flax's order at flax's path; explicit: newest first.
    want = st_f[f"{role}_amax_history"]
    np.testing.assert_array_equal(h_o if how == "automatic" else flax_fp8.flax_history_order(h_o),
                                  want)
  np.testing.assert_array_equal(y_o, y_f)
  np.testing.assert_array_equal(gx_o, gx_f)
  np.testing.assert_array_equal(g_o["params"]["Dense_0"]["kernel"],
                                g_f["params"]["Dense_0"]["kernel"])
  # A reference computed another way: the quantization is lossless here.
  w = v["params"]["Dense_0"]["kernel"]
  np.testing.assert_array_equal(y_o, np.asarray(x) @ np.asarray(w))
  np.testing.assert_array_equal(gx_o, np.asarray(ct) @ np.asarray(w).T)
  if how == "automatic":
    assert any(f"continuing the flax fp8 state found at Dense_0/{name}" in m
               and "history converted" in m for m in messages), messages
  else:
    assert not any("flax fp8 state" in m for m in messages), messages
  assert not any("no '_overwrite_with_gradient' collection" in m for m in messages), messages


@pytest.mark.parametrize("how", ["explicit", "automatic"])
def test_train_state_keeps_continuing_like_flax(how):
  # Three more steps through fl.TrainState: the state (automatic: at flax's
  # path, in flax's order) is what flax's own op would have stored.
  op = fp8_ops.Fp8DirectDotGeneralOp
  model, v, x, ct = exact_checkpoint(op, seed=1)
  ours = our_net(fl.flax_fp8_recipe(op, amax_history_length=L))
  state = fl.TrainState.create(apply_fn=ours.apply, params=converted(v, how), tx=optax.sgd(0.0))
  ref = v
  for k in range(3):
    xk, ctk = x * 2.0 ** -k, ct * 2.0 ** k
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      _, grads, _ = jit_step(ours, state.params, xk, ctk)
    state = state.apply_gradients(grads=grads)
    ref = train(model, ref, [(xk, ctk)])
  got = state.params[OWG]["Dense_0"]
  want = ref[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]
  if how == "automatic":
    chex.assert_trees_all_equal(got["Fp8DirectDotGeneralOp_0"], want)
  else:
    chex.assert_trees_all_equal(
        got["Fp8DotGeneral_0"],
        {k: (flax_fp8.flax_history_order(a) if k.endswith("history") else a)
         for k, a in want.items()})


class ContinuationVariantsTest(chex.TestCase):
  """The automatic continuation traces the same under jit as eagerly."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_continuation_equals_flax_next_step(self):
    op = fp8_ops.Fp8DirectDotGeneralOp
    model, v, x, ct = exact_checkpoint(op, seed=2)
    ours = our_net(fl.flax_fp8_recipe(op, amax_history_length=L))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      got = self.variant(lambda v, x, ct: step(ours, v, x, ct))(v, x, ct)
    chex.assert_trees_all_equal(got, step(model, v, x, ct))


def test_shared_layer_continuing_flax_state_records_the_max_not_the_sum():
  # flax's op, used twice in a step, returns two state "gradients" that
  # jax.grad adds; fl.Fp8DotGeneral links the uses, also on flax's state.
  class Twice(nn.Module):
    dg: object

    @nn.compact
    def __call__(self, x):
      dense = nn.Dense(16, use_bias=False, dot_general_cls=self.dg)
      return dense(dense(x) * 0.0 + 3.0 * x)

  x = jnp.ones((2, 16))
  flax_model = Twice(functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=L))
  v = jax.jit(flax_model.init)(jax.random.key(0), x)
  v = train(flax_model, v, [(x, jnp.ones((2, 16)))])
  ours = Twice(functools.partial(fl.Fp8DotGeneral,
                                 recipe=fl.flax_fp8_recipe(amax_history_length=L)))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _, g, _ = jit_step(ours, v, x, jnp.ones((2, 16)))
  h = g[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
  assert float(h[0]) == 3.0  # the max of the two uses' amaxes (1 and 3), not 4
  _, g_f, _ = jit_step(flax_model, v, x, jnp.ones((2, 16)))
  assert float(g_f[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"][0]) == 4.0


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.__name__)
def test_random_training_run_first_step_scale_within_one_ulp(op):
  # A realistic checkpoint: random data, SGD on the kernel, history 8. flax
  # computes 1 / (fp8_max / amax), we amax / fp8_max: equal up to one ulp.
  # Op by op, as the claim is stated (our ops, called eagerly, otherwise run
  # compiled: jax.disable_jit): compiled, the two expressions can differ by
  # more than one ulp.
  rng = np.random.default_rng(3)
  model = flax_net(op, 8)
  v = model.init(jax.random.key(0), jnp.ones((8, 16)))
  batches = [(jnp.asarray(rng.normal(size=(8, 16)) * (1 + k), jnp.float32),
              jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)) for k in range(5)]
  v = train(model, v, batches, lr=0.1, run=step)
  x, ct = batches[1]
  y_f, g_f, _ = step(model, v, x, ct)
  name = f"{op.__name__}_0"
  ours = our_net(fl.flax_fp8_recipe(op, amax_history_length=8))
  for how in ("explicit", "automatic"):
    with warnings.catch_warnings(), jax.disable_jit():
      warnings.simplefilter("ignore")
      y_o, g_o, _ = step(ours, converted(v, how), x, ct)
    st_o = g_o[OWG]["Dense_0"][name if how == "automatic" else "Fp8DotGeneral_0"]
    st_f = g_f[OWG]["Dense_0"][name]
    for role in fl.ROLES:
      chex.assert_trees_all_close(st_o[f"{role}_scale"], st_f[f"{role}_scale"],
                                  rtol=2 ** -23, atol=0)
      # The trained scale, not a fresh one: the history's max over fp8's max.
      hist = v[OWG]["Dense_0"][name][f"{role}_amax_history"]
      fmax = fl.flax_fp8_recipe(op).role(role).fp8_max
      chex.assert_trees_all_close(st_o[f"{role}_scale"], jnp.max(hist, keepdims=True) / fmax,
                                  rtol=2 ** -23, atol=0)
    # The same quantization up to that last bit: outputs agree within fp8 rounding.
    chex.assert_trees_all_close(y_o, y_f, rtol=0.07, atol=0.05 * float(jnp.abs(y_f).max()))


# ---------------------------------------------------------------------------
# The warning, and errors that name what to change.


def test_continuation_warns_what_it_found_once_per_apply():
  model, v, x, ct = exact_checkpoint(fp8_ops.NANOOFp8DotGeneralOp)
  ours = our_net(fl.Fp8Recipe(input=fl.ScalingConfig(history_length=L),
                              kernel=fl.ScalingConfig(history_length=L),
                              output_grad=fl.ScalingConfig(dtype="e5m2", history_length=L)))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ours.apply(v, x)
  messages = [str(w.message) for w in caught if "fp8_linen" in str(w.message)]
  assert len(messages) == 1, messages
  (m,) = messages
  assert m.startswith("fp8_linen: Dense_0/Fp8DotGeneral_0 has no state of its own: continuing "
                      "the flax fp8 state found at Dense_0/NANOOFp8DotGeneralOp_0 "
                      "(NANOOFp8DotGeneralOp; history converted from flax's ring order")
  # An OCP recipe on a NANOO state: the formats differ and the warning says so.
  assert "float8_e4m3fnuz/float8_e5m2fnuz, this recipe to float8_e4m3fn/float8_e5m2" in m
  assert "fl.from_flax_fp8(variables)" in m


def test_history_length_mismatch_names_the_recipe_and_the_fix():
  model, v, x, _ = exact_checkpoint(fp8_ops.Fp8DirectDotGeneralOp)
  with pytest.raises(ValueError, match=r"amax_history_length=4 but the recipe's input asks "
                     r"for history_length=1024.*fl.flax_fp8_recipe\('Fp8DirectDotGeneralOp', "
                     r"amax_history_length=4\)"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      our_net(fl.Fp8Recipe()).apply(v, x)


def test_two_flax_states_for_one_module_is_an_error():
  _, v, x, _ = exact_checkpoint(fp8_ops.Fp8DirectDotGeneralOp)
  owg = dict(v[OWG]["Dense_0"])
  owg["Fp8DotGeneralOp_0"] = owg["Fp8DirectDotGeneralOp_0"]
  v2 = {"params": v["params"], OWG: {"Dense_0": owg}}
  with pytest.raises(ValueError, match="holds the fp8 state of 2 flax ops"):
    our_net(fl.flax_fp8_recipe(amax_history_length=L)).apply(v2, x)


def test_convert_mode_asks_for_the_explicit_conversion():
  _, v, x, _ = exact_checkpoint(fp8_ops.Fp8DirectDotGeneralOp)
  with pytest.raises(ValueError, match=r"convert the checkpoint first with fl.from_flax_fp8"):
    with modes.mode("convert"), warnings.catch_warnings():
      warnings.simplefilter("ignore")
      our_net(fl.flax_fp8_recipe(amax_history_length=L)).apply(v, x, mutable=True)


def test_integer_recipe_leaves_the_flax_state_alone_and_says_so():
  _, v, x, ct = exact_checkpoint(fp8_ops.Fp8DirectDotGeneralOp)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _, g, _ = jit_step(our_net(fl.IntRecipe()), v, x, ct)
  assert any("does not use the flax fp8 state found at Dense_0/Fp8DirectDotGeneralOp_0" in
             str(w.message) for w in caught)
  chex.assert_trees_all_equal(g[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"],
                              jax.tree.map(jnp.zeros_like,
                                           v[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]))


def test_resize_histories_refuses_flax_ordered_state():
  _, v, _, _ = exact_checkpoint(fp8_ops.Fp8DirectDotGeneralOp)
  with pytest.raises(ValueError, match=r"Dense_0/Fp8DirectDotGeneralOp_0/input_amax_history is "
                     r"a flax fp8 op's state.*fl.from_flax_fp8\(variables, recipe\)"):
    fl.resize_histories(v, 8)
  fl.resize_histories(fl.from_flax_fp8(v)[0], 8)  # converted: fine


# ---------------------------------------------------------------------------
# The explicit conversion: layouts, resizing, report, errors.


def test_from_flax_fp8_resizes_keeping_the_newest_entries():
  model = flax_net(fp8_ops.Fp8DirectDotGeneralOp, 6)
  x = jnp.ones((2, 16))
  v = train(model, jax.jit(model.init)(jax.random.key(0), x),
            [(x * a, jnp.ones((2, 4))) for a in range(1, 9)])
  np.testing.assert_array_equal(
      v[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"],
      [8.0, 3.0, 4.0, 5.0, 6.0, 7.0])
  short, report = fl.from_flax_fp8(v, fl.delayed_scaling(4))
  np.testing.assert_array_equal(short[OWG]["Dense_0"]["Fp8DotGeneral_0"]["input_amax_history"],
                                [8.0, 7.0, 6.0, 5.0])
  assert report.resized_to == (("input", 4), ("kernel", 4), ("output_grad", 4))
  assert report.history_lengths == (6,)
  long, _ = fl.from_flax_fp8(v, fl.delayed_scaling(9))
  np.testing.assert_array_equal(long[OWG]["Dense_0"]["Fp8DotGeneral_0"]["input_amax_history"],
                                [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 0.0, 0.0, 0.0])
  # Scales are kept as they are; params untouched (the same arrays).
  chex.assert_trees_all_equal(short[OWG]["Dense_0"]["Fp8DotGeneral_0"]["input_scale"],
                              v[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_scale"])
  assert short["params"] is v["params"]


def test_from_flax_fp8_into_layer_feeds_qdense():
  op = fp8_ops.Fp8DirectDotGeneralOp
  model, v, x, ct = exact_checkpoint(op)
  moved, report = fl.from_flax_fp8(v, into="layer")
  assert report.moved == (("Dense_0/Fp8DirectDotGeneralOp_0", "Dense_0", op.__name__),)
  assert sorted(moved[OWG]["Dense_0"]) == sorted(flax_fp8._STATE_NAMES)

  class QNet(nn.Module):
    @nn.compact
    def __call__(self, x):
      return fl.QDense(4, use_bias=False, name="Dense_0",
                       recipe=fl.flax_fp8_recipe(op, amax_history_length=L))(x)

  y_o, g_o, _ = jit_step(QNet(), moved, x, ct)
  y_f, g_f, _ = jit_step(model, v, x, ct)
  np.testing.assert_array_equal(y_o, y_f)
  for role in fl.ROLES:
    np.testing.assert_array_equal(g_o[OWG]["Dense_0"][f"{role}_scale"],
                                  g_f[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"][f"{role}_scale"])


def test_from_flax_fp8_report_and_frozen_dict():
  _, v, _, _ = exact_checkpoint(fp8_ops.Fp8DotGeneralOp)
  out, report = fl.from_flax_fp8(FrozenDict(v), fl.flax_fp8_recipe(fp8_ops.Fp8DotGeneralOp,
                                                                   amax_history_length=4))
  assert isinstance(out, FrozenDict)
  text = str(report)
  assert text.splitlines()[0].startswith("from_flax_fp8: converted 1 flax fp8 state(s)")
  assert "Dense_0/Fp8DotGeneralOp_0 (Fp8DotGeneralOp, history 4) -> Dense_0/Fp8DotGeneral_0" \
      in text
  nothing, empty = fl.from_flax_fp8(out)  # already converted: nothing left to find
  assert len(empty) == 0 and str(empty) == "from_flax_fp8: no flax fp8 state found"
  chex.assert_trees_all_equal(nothing, out)
  # A NANOO checkpoint converted for an OCP recipe: noted.
  _, vn, _, _ = exact_checkpoint(fp8_ops.NANOOFp8DotGeneralOp)
  _, rn = fl.from_flax_fp8(vn, fl.delayed_scaling(4))
  assert rn.notes and "float8_e4m3fnuz/float8_e5m2fnuz" in rn.notes[0]


def test_from_flax_fp8_errors_name_the_argument():
  _, v, _, _ = exact_checkpoint(fp8_ops.Fp8DirectDotGeneralOp)
  with pytest.raises(TypeError, match="variables must be a model's variables dict"):
    fl.from_flax_fp8([v])
  with pytest.raises(TypeError, match=r"recipe=.* must be an fl.Fp8Recipe"):
    fl.from_flax_fp8(v, fl.int8_lsq())
  with pytest.raises(ValueError, match=r"into='qdense' must be one of"):
    fl.from_flax_fp8(v, into="qdense")
  twice = {"params": v["params"], OWG: {"Dense_0": {
      **v[OWG]["Dense_0"], "Fp8DotGeneral_0": v[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]}}}
  with pytest.raises(ValueError, match="Dense_0/Fp8DotGeneral_0 already exists"):
    fl.from_flax_fp8(twice)
  two_ops = {"params": v["params"], OWG: {"Dense_0": {
      **v[OWG]["Dense_0"], "Fp8DirectDotGeneralOp_1": v[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]}}}
  with pytest.raises(ValueError, match="holds 2 flax fp8 op states.*use into='dot_general_cls'"):
    fl.from_flax_fp8(two_ops, into="layer")
  assert len(fl.from_flax_fp8(two_ops)[1]) == 2  # one Fp8DotGeneral_<n> each


def test_flax_fp8_recipe_reads_the_op_and_names_bad_arguments():
  part = functools.partial(fp8_ops.Fp8DotGeneralOp, amax_history_length=16,
                           e4m3_dtype=jnp.float8_e4m3fnuz, e5m2_dtype=jnp.float8_e5m2fnuz)
  r = fl.flax_fp8_recipe(part)
  assert (r.input.dtype, r.kernel.dtype, r.output_grad.dtype, r.input.history_length) == \
      ("float8_e4m3fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz", 16)
  inst = fl.flax_fp8_recipe(fp8_ops.NANOOFp8DotGeneralOp(amax_history_length=8))
  assert (inst.input.dtype, inst.input.history_length) == ("float8_e4m3fnuz", 8)
  with pytest.raises(ValueError, match=r"flax_fp8_recipe: op=.* quantizes to "
                     r"float8_e4m3fnuz/float8_e5m2, a mix of fnuz"):
    fl.flax_fp8_recipe(functools.partial(fp8_ops.Fp8DotGeneralOp, e4m3_dtype="e4m3fnuz"))
  # The direct op ignores its dtype fields: it always quantizes to e4m3fn / e5m2.
  direct = fl.flax_fp8_recipe(functools.partial(fp8_ops.Fp8DirectDotGeneralOp,
                                                e4m3_dtype=jnp.float8_e4m3fnuz))
  assert direct.input.dtype == "float8_e4m3fn" and direct.input.history_length == 1024
  assert fl.flax_fp8_recipe() == fl.Fp8Recipe()  # flax's direct op is our default recipe
  with pytest.raises(ValueError, match=r"op='Dense' is not one of flax's fp8 ops"):
    fl.flax_fp8_recipe("Dense")
  with pytest.raises(ValueError, match=r"amax_history_length=0 must be an int >= 1"):
    fl.flax_fp8_recipe(amax_history_length=0)


# ---------------------------------------------------------------------------
# fl.Fp8Einsum: flax's call, flax's state names, every recipe, attention.

EQ = "bqhd,bkhd->bhqk"


def test_fp8einsum_call_matches_flax_signature():
  ours = list(inspect.signature(fl.Fp8Einsum.__call__).parameters)
  theirs = list(inspect.signature(fp8_ops.Fp8Einsum.__call__).parameters)
  assert ours == theirs == ["self", "eqn", "lhs", "rhs", "precision", "preferred_element_type"]


class EinsumNet(nn.Module):
  """An einsum module called inside a parent, as attention calls it (state at Fp8Einsum_0)."""

  einsum_cls: object

  @nn.compact
  def __call__(self, lhs, rhs):
    return self.einsum_cls()(EQ, lhs, rhs)


def flax_einsum_checkpoint():
  """flax's Fp8Einsum trained 3 steps on representable inputs (power-of-two scales)."""
  rng = np.random.default_rng(5)
  shapes = (2, 3, 2, 8), (2, 5, 2, 8)
  net = EinsumNet(functools.partial(fp8_ops.Fp8Einsum, amax_history_length=L))
  v = jax.jit(net.init)(jax.random.key(0), jnp.ones(shapes[0]), jnp.ones(shapes[1]))

  @jax.jit  # op by op, a quantized backward costs seconds
  def new_state(v, lhs, rhs, ct):
    _, vjp = jax.vjp(lambda v: net.apply(v, lhs, rhs), v)
    return {OWG: vjp(ct)[0][OWG]}

  for e in (1, 0, 2):
    lhs, rhs = rep(rng, shapes[0], 7, e), rep(rng, shapes[1], 7, e + 1)
    ct = rep(rng, (2, 2, 3, 5), 7, e)
    v = new_state(v, lhs, rhs, ct)
  nxt = rep(rng, shapes[0], 7, 3), rep(rng, shapes[1], 7, 3), rep(rng, (2, 2, 3, 5), 7, 3)
  return net, v, nxt


def test_fp8einsum_continues_a_flax_einsum_checkpoint_bit_for_bit():
  net, v, (lhs, rhs, ct) = flax_einsum_checkpoint()
  # Same path and names: converted once, in place.
  conv, report = fl.from_flax_fp8(v)
  assert report.moved == (("Fp8Einsum_0", "Fp8Einsum_0", "Fp8Einsum"),)

  @functools.partial(jax.jit, static_argnums=0)  # both sides jitted, compared bit for bit
  def run(m, v):
    y, vjp = jax.vjp(m.apply, v, lhs, rhs)
    return y, vjp(ct)

  y_f, (g_f, gl_f, gr_f) = run(net, v)
  ours = EinsumNet(functools.partial(
      fl.Fp8Einsum, recipe=fl.flax_fp8_recipe("Fp8Einsum", amax_history_length=L)))
  y_o, (g_o, gl_o, gr_o) = run(ours, conv)
  np.testing.assert_array_equal(y_o, y_f)
  np.testing.assert_array_equal(y_o, np.einsum(EQ, lhs, rhs))
  np.testing.assert_array_equal(gl_o, gl_f)
  np.testing.assert_array_equal(gr_o, gr_f)
  st_f, st_o = g_f[OWG]["Fp8Einsum_0"], g_o[OWG]["Fp8Einsum_0"]
  for role in fl.ROLES:
    assert float(st_o[f"{role}_scale"][0]) < 1  # trained, power-of-two
    np.testing.assert_array_equal(st_o[f"{role}_scale"], st_f[f"{role}_scale"])
    np.testing.assert_array_equal(st_o[f"{role}_amax_history"],
                                  flax_fp8.flax_history_order(st_f[f"{role}_amax_history"]))


RECIPES = {
    "delayed": fl.delayed_scaling(16),
    "current": fl.current_scaling(),
    "rowwise": fl.rowwise_scaling(),
    "mx": fl.mx_block_scaling(block_size=8),
    "int8_ste": fl.IntRecipe(),
    "int8_lsq": fl.int8_lsq(),
}


def attention(einsum_cls):
  return nn.MultiHeadDotProductAttention(
      num_heads=2, qkv_features=16, qk_attn_weights_einsum_cls=einsum_cls,
      attn_weights_value_einsum_cls=einsum_cls)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8einsum_in_flax_attention_every_recipe(name):
  recipe = RECIPES[name]
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)
  q = attention(functools.partial(fl.Fp8Einsum, recipe=recipe))
  # Jitted: op by op, a quantized forward or backward costs seconds.
  v = jax.jit(q.init)(jax.random.key(0), x)
  float_y = jax.jit(attention(None).apply)({"params": v["params"]}, x)
  # Both einsums got their own state / quantizer parameters, under flax's auto-names.
  owners = set(v.get(OWG, {})) | {k for k in v["params"] if k.startswith("Fp8Einsum")}
  assert owners == {"Fp8Einsum_0", "Fp8Einsum_1"}, owners
  if isinstance(recipe, fl.Fp8Recipe):
    for k in ("Fp8Einsum_0", "Fp8Einsum_1"):
      assert sorted(v[OWG][k]) == sorted(flax_fp8._STATE_NAMES)

  def loss(v):
    y = q.apply(v, x)
    return jnp.sum(y ** 2), y

  g, y = jax.jit(jax.grad(loss, has_aux=True))(v)   # one program: the output and its gradient
  chex.assert_shape(y, float_y.shape)
  err = float(jnp.linalg.norm(y - float_y) / jnp.linalg.norm(float_y))
  assert err < 0.1, err
  assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))
  assert float(jnp.abs(g["params"]["query"]["kernel"]).sum()) > 0


def test_fp8einsum_attention_trains_with_train_state():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
  target = jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.float32)
  q = attention(functools.partial(fl.Fp8Einsum, recipe=fl.delayed_scaling(16)))
  v = jax.jit(q.init)(jax.random.key(0), x)
  state = fl.TrainState.create(apply_fn=q.apply, params=v, tx=optax.adam(1e-2))
  loss = lambda v: jnp.mean((q.apply(v, x) - target) ** 2)

  @jax.jit
  def train_step(state):
    l, g = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=g), l

  losses = []
  for _ in range(6):
    state, l = train_step(state)
    losses.append(float(l))
  assert losses[-1] < losses[0], losses
  owg = state.params[OWG]
  for k in ("Fp8Einsum_0", "Fp8Einsum_1"):
    h = owg[k]["input_amax_history"]
    assert float(h[0]) > 0 and float(h[5]) > 0 and float(h[6]) == 0  # 6 steps, newest first
    assert float(owg[k]["output_grad_amax_history"][0]) > 0


class Fp8EinsumVariantsTest(chex.TestCase):
  """The same result with and without jit."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_and_state(self):
    lhs = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 2, 8)), jnp.float32)
    rhs = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 2, 8)), jnp.float32)
    mod = fl.Fp8Einsum(recipe=fl.current_scaling())
    # The init is jitted in both variants (op by op it costs seconds); the apply is compared.
    v = jax.jit(lambda k, l, r: mod.init(k, EQ, l, r))(jax.random.key(0), lhs, rhs)
    y = self.variant(lambda v, l, r: mod.apply(v, EQ, l, r))(v, lhs, rhs)
    chex.assert_shape(y, (2, 2, 3, 5))
    chex.assert_trees_all_close(y, jnp.einsum(EQ, lhs, rhs), rtol=0.15, atol=0.3)


def test_fp8einsum_errors_name_the_argument():
  with pytest.raises(TypeError, match=r"Fp8Einsum: recipe='delayed'"):
    fl.Fp8Einsum(recipe="delayed").init(jax.random.key(0), EQ, jnp.ones((1, 2, 1, 4)),
                                        jnp.ones((1, 2, 1, 4)))
  with pytest.raises(TypeError, match=r"Fp8Einsum: eqn=3 must be an einsum equation"):
    fl.Fp8Einsum().init(jax.random.key(0), 3, jnp.ones((1, 2, 1, 4)), jnp.ones((1, 2, 1, 4)))
  with pytest.raises(TypeError, match=r"Fp8Einsum \(rhs\): inputs must be a floating array"):
    fl.Fp8Einsum().init(jax.random.key(0), EQ, jnp.ones((1, 2, 1, 4)),
                        jnp.ones((1, 2, 1, 4), jnp.int32))
