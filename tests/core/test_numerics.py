"""Tests for fp8_linen.numerics against ml_dtypes/numpy references."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import numerics
from fp8_linen.recipes import ScalingConfig

FORMATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


@pytest.mark.parametrize("name", FORMATS)
def test_fp8_max_matches_ml_dtypes(name):
  dt = getattr(ml_dtypes, name)
  assert numerics.fp8_max(dt) == float(ml_dtypes.finfo(dt).max)


@pytest.mark.parametrize("name", FORMATS)
def test_quantize_saturates_and_rounds_like_numpy(name):
  dt = getattr(ml_dtypes, name)
  m = float(ml_dtypes.finfo(dt).max)
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.normal(size=200) * m / 3, [m * 10, -m * 10, m * 1.0001, 0.0]])
  scale = np.array([0.5], np.float32)
  got = np.asarray(numerics.quantize(jnp.asarray(x, jnp.float32), dt, jnp.asarray(scale)))
  ref = np.clip(x.astype(np.float32) / np.float32(0.5), -m, m).astype(dt)
  np.testing.assert_array_equal(got.astype(np.float32), ref.astype(np.float32))
  assert np.all(np.isfinite(got.astype(np.float32)))  # saturating: never inf/nan


def test_quantize_keeps_shape_of_scalar_input():
  q = numerics.quantize(jnp.float32(3.0), jnp.float8_e4m3fn, jnp.ones((1,)))
  assert q.shape == ()


def test_dequantize_and_qdq():
  x = jnp.array([1.0, 2.5, -300.0, 1e6])
  s = jnp.array([2.0])
  y = numerics.qdq(x, jnp.float8_e4m3fn, s)
  # -300/2 = -150 rounds to -144 (e4m3 step 16 there); 1e6 saturates at 448*2.
  np.testing.assert_array_equal(np.asarray(y), [1.0, 2.5, -288.0, 896.0])


def test_roll_history_newest_first_and_nan_is_nothing():
  h = jnp.array([3.0, 2.0, 1.0])
  np.testing.assert_array_equal(numerics.roll_history(h, 5.0), [5.0, 3.0, 2.0])
  np.testing.assert_array_equal(numerics.roll_history(h, jnp.nan), [0.0, 3.0, 2.0])
  np.testing.assert_array_equal(numerics.roll_history(h, jnp.inf), [0.0, 3.0, 2.0])


def _cfg(**kw):
  return ScalingConfig(history_length=4, **kw)


def test_select_scale_delayed_max_and_most_recent():
  h = jnp.array([1.0, 448.0 * 4, 2.0, 0.0])
  prev = jnp.ones((1,))
  s_max = numerics.select_scale(_cfg(), prev, h, jnp.float32(99.0))
  s_recent = numerics.select_scale(_cfg(amax_compute_algo="most_recent"), prev, h,
                                   jnp.float32(99.0))
  np.testing.assert_allclose(s_max, [4.0])
  np.testing.assert_allclose(s_recent, [1.0 / 448.0], rtol=1e-7)


def test_select_scale_first_step_uses_current_amax():
  # Empty history + a gradient of 1000 must not clip at the e5m2/e4m3 max.
  cfg = _cfg(dtype="float8_e5m2")
  s = numerics.select_scale(cfg, jnp.ones((1,)), jnp.zeros((4,)), jnp.float32(1000.0))
  np.testing.assert_allclose(s, [1000.0 / 57344.0], rtol=1e-7)
  q = numerics.quantize(jnp.float32(1000.0), cfg.jnp_dtype, s)
  assert float(numerics.dequantize(q, s, jnp.float32)) == pytest.approx(1000.0, rel=1e-6)


def test_select_scale_current_ignores_history():
  s = numerics.select_scale(_cfg(scaling="current"), jnp.ones((1,)),
                            jnp.array([1e6, 0, 0, 0.0]), jnp.float32(448.0))
  np.testing.assert_allclose(s, [1.0])


def test_margin_and_power_of_two():
  a = jnp.float32(300.0)
  s = numerics.scale_from_amax(a, jnp.ones((1,)), _cfg(margin=2))
  np.testing.assert_allclose(s, [300.0 * 4 / 448.0], rtol=1e-6)
  s2 = numerics.scale_from_amax(a, jnp.ones((1,)), _cfg(power_of_two=True))
  np.testing.assert_allclose(s2, [1.0])  # 300/448 rounded *up* to a power of two
  assert float(s2[0]) * 448.0 >= 300.0


@pytest.mark.parametrize("a", [0.0, 1e-45, np.nan, np.inf, -1.0])
def test_scale_never_inf_or_nan(a):
  prev = jnp.array([0.25])
  s = numerics.scale_from_amax(jnp.float32(a), prev, _cfg())
  assert np.all(np.isfinite(np.asarray(s))) and float(s[0]) > 0
  assert np.isfinite(1.0 / float(s[0]))
  if not (np.isfinite(a) and a > 0):
    assert float(s[0]) == 0.25  # previous scale stays


def test_tiny_amax_is_floored():
  s = numerics.scale_from_amax(jnp.float32(1e-44), jnp.ones((1,)), _cfg())
  assert float(s[0]) >= numerics.SCALE_FLOOR


def test_bad_previous_scale_is_replaced():
  for prev in (jnp.array([jnp.nan]), jnp.array([0.0]), jnp.array([-1.0])):
    s = numerics.scale_from_amax(jnp.float32(0.0), prev, _cfg())
    assert float(s[0]) == 1.0


def test_select_scale_under_jit_matches_eager():
  h = jnp.array([0.0, 7.0, 0.0, 0.0])
  f = lambda h, a: numerics.select_scale(_cfg(), jnp.ones((1,)), h, a)
  np.testing.assert_array_equal(jax.jit(f)(h, 3.0), f(h, 3.0))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_integer_encoder_is_bit_identical_to_astype(name):
  dt = getattr(ml_dtypes, name)
  m = float(ml_dtypes.finfo(dt).max)
  rng = np.random.default_rng(0)
  vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
  vals = np.sort(vals[np.isfinite(vals)])
  ties = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)  # round-half-even
  x = np.concatenate([vals, ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf),
                      rng.normal(size=20000) * m / 4, rng.normal(size=5000) * 1e-4,
                      rng.normal(size=5000) * 1e-7, [0.0, -0.0, np.nan]]).astype(np.float32)
  x = np.clip(x, -m, m)
  got = np.asarray(jax.jit(lambda y: numerics.encode_fp8(y, dt))(jnp.asarray(x)))
  np.testing.assert_array_equal(got.view(np.uint8), x.astype(dt).view(np.uint8))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scale", [0.5, 3.0e-3, 2.0 ** 100])
def test_quantize_measured_equals_quantize_on_finite_tensors(name, scale):
  """The clamp-only cast (its amax says every element is finite) gives quantize's codes."""
  dt = getattr(ml_dtypes, name)
  m = float(ml_dtypes.finfo(dt).max)
  rng = np.random.default_rng(1)
  x = np.concatenate([rng.normal(size=(300,)) * m * scale,
                      [m * scale * 10, -m * scale * 10, 3.0e38, -3.0e38, 0.0, -0.0]])
  x = jnp.asarray(x.astype(np.float32))
  s = jnp.asarray([scale], jnp.float32)
  got = numerics.quantize_measured(x, dt, s, numerics.amax(x))
  want = numerics.quantize(x, dt, s)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
  ref = np.clip(np.asarray(x, np.float64) / scale, -m, m).astype(np.float32).astype(dt)
  np.testing.assert_array_equal(np.asarray(got).astype(np.float32), ref.astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_measured_makes_a_non_finite_tensor_all_nan(bad):
  """A NaN or Inf anywhere: every code is NaN (nothing non-finite is hidden by a clamp)."""
  x = jnp.asarray([1.0, 1e6, bad, -2.0], jnp.float32)
  for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
    got = numerics.quantize_measured(x, dt, jnp.ones((1,)), numerics.amax(x))
    assert np.all(np.isnan(np.asarray(got, np.float32)))


@pytest.mark.parametrize("shape", [(7,), (5, 9), (2, 3, 17), (0, 4), (3, 0)])
def test_amax_over_any_rank_is_the_largest_magnitude(shape):
  """Leading axes first, then the last: the same value as max(|x|) over everything."""
  x = np.random.default_rng(2).normal(size=shape).astype(np.float32) * 5
  want = float(np.max(np.abs(x))) if x.size else 0.0
  assert float(numerics.amax(jnp.asarray(x))) == want
  if x.size:
    x.flat[x.size // 2] = np.nan
    assert np.isnan(float(numerics.amax(jnp.asarray(x))))


@pytest.mark.parametrize("backend", ["gpu", "cpu", "tpu"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("history", ["empty", "seen"])
@pytest.mark.parametrize("role", ["activation", "weight", "gradient"])
def test_quantize_with_gives_the_same_codes_however_the_step_is_shaped(
    backend, scaling, history, role):
  """The role and the backend change how the step is shaped, not the codes.

  The reference is an activation traced for the CPU (delayed scaling's
  first step a ``lax.cond`` on the history). On GPU every role's scale
  waits for its amax on one device (a select: no conditional in the
  program); on CPU and TPU a delayed scale does not wait.
  """
  from fp8_linen.core import lowering
  cfg = ScalingConfig(scaling=scaling)
  x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 48)) * 700, jnp.bfloat16)
  h = jnp.zeros((8,)) if history == "empty" else jnp.zeros((8,)).at[0].set(300.0)
  flags = {"activation": {}, "weight": {"weight": True}, "gradient": {"gradient": True}}[role]
  with lowering.target_backend("cpu"):
    ref = jax.jit(lambda x, s, h: numerics.quantize_with(cfg, s, h, x))(x, jnp.ones((1,)), h)
  with lowering.target_backend(backend):
    fn = lambda x, s, h: numerics.quantize_with(cfg, s, h, x, **flags)
    got = jax.jit(fn)(x, jnp.ones((1,)), h)
    conds = str(jax.make_jaxpr(fn)(x, jnp.ones((1,)), h)).count("cond[")
  np.testing.assert_array_equal(np.asarray(ref[0]).view(np.uint8),
                                np.asarray(got[0]).view(np.uint8))
  np.testing.assert_array_equal(ref[1], got[1])
  assert float(ref[2]) == float(got[2]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
  assert conds == (0 if scaling == "current" or backend == "gpu" else 1)
  # The first step takes its scale from the tensor: nothing clips (700 sigma > 448).
  if history == "empty" or scaling == "current":
    assert float(jnp.max(jnp.abs(ref[0].astype(jnp.float32)))) == 448.0


@pytest.mark.parametrize("role", ["activation", "gradient"])
def test_quantize_with_keeps_the_first_step_branch_on_a_mesh(role):
  """On a mesh an amax is an all-reduce: an activation's or gradient's delayed scale
  does not wait for it in every step (a ``lax.cond`` on the history), on GPU too."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fp8_linen.core import lowering
  cfg = ScalingConfig()
  mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  x = jax.device_put(jnp.asarray(np.random.default_rng(4).normal(size=(64, 48)) * 700,
                                 jnp.bfloat16), NamedSharding(mesh, P("d")))
  s, h = jnp.ones((1,)), jnp.zeros((8,))
  fn = lambda x, s, h: numerics.quantize_with(cfg, s, h, x, gradient=role == "gradient")
  with lowering.target_backend("gpu"):
    assert lowering.on_mesh(x)
    assert str(jax.make_jaxpr(fn)(x, s, h)).count("cond[") == 1
    got = jax.jit(fn)(x, s, h)
    one = jax.jit(fn)(np.asarray(x), s, h)  # on one device: the select form
  np.testing.assert_array_equal(np.asarray(one[0]).view(np.uint8),
                                np.asarray(got[0]).view(np.uint8))
  np.testing.assert_array_equal(one[1], got[1])


# XLA:GPU (excess precision allowed, its default) compiles `x.astype(f8).astype(f32)`
# to `x`; the decoders read codes through their bits so the rounding survives there
# (tests/targets/test_block_scaled.py checks the compiled GPU programs).


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_decode_fp8_is_the_cast_on_every_code(name):
  dt = getattr(ml_dtypes, name)
  codes = np.arange(256, dtype=np.uint8).view(dt)
  got = np.asarray(numerics.decode_fp8(jnp.asarray(codes)))
  want = codes.astype(np.float32)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_array_equal(got[ok], want[ok])
  np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))  # -0.0 kept


def test_helpers_are_traced_once_for_layers_of_one_shape(jaxpr_eqns):
  """Same-shaped layers share each helper's trace (one jaxpr), not one trace per layer."""
  layers = nn.Sequential([fl.QDense(16), fl.QDense(16), fl.QDense(16)])
  x = jnp.ones((4, 16))
  v = jax.jit(layers.init)(jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(jax.grad(lambda v: layers.apply(v, x).sum()))(v)
  calls = {}
  for e in jaxpr_eqns(jaxpr):
    if e.primitive.name in ("pjit", "jit"):
      calls.setdefault(e.params["name"], []).append(e.params["jaxpr"])
  for name in ("encode_fp8", "scale_from_amax", "new_state"):
    # Every layer quantizes / updates its state through the helper ...
    assert len(calls.get(name, ())) >= 3, sorted(calls)
  # ... and the three layers' identical calls are one trace.
  assert len({id(j) for j in calls["new_state"]}) < len(calls["new_state"])


@pytest.mark.parametrize("backend,block_scaled", [("gpu", False), ("gpu", True), ("cpu", False),
                                                  ("tpu", False)])
@pytest.mark.parametrize("role", ["activation", "weight", "gradient"])
def test_steady_casts_on_an_h100_are_kept_apart_from_their_transpose(backend, block_scaled, role):
  """In ``split_first_step``'s steady branch the codes (and the amax) pass an
  optimization barrier where the fp8 GEMMs take both operands K-major (a GPU
  without block-scaled GEMMs), and a weight's on any GPU; the codes are unchanged.

  The barrier is what lets XLA:GPU cast in the input's own layout beside the
  amax and the bias gradient's sum (``tests/targets/test_passes.py`` checks
  the compiled H100 program); a weight's codes pass it flattened.
  """
  from fp8_linen.core import lowering
  cfg = ScalingConfig()
  x = jnp.asarray(np.random.default_rng(5).normal(size=(64, 48)) * 700, jnp.bfloat16)
  s, h = jnp.full((1,), 2.0), jnp.zeros((8,)).at[0].set(300.0)
  flags = {"activation": {}, "weight": {"weight": True}, "gradient": {"gradient": True}}[role]
  fn = lambda x, s, h: numerics.quantize_with(cfg, s, h, x, **flags)
  with numerics.histories_observed():
    with lowering.target_backend("cpu"):
      ref = jax.jit(fn)(x, s, h)
    with lowering.target_backend(backend, block_scaled=block_scaled):
      got = jax.jit(fn)(x, s, h)
      jaxpr = jax.make_jaxpr(fn)(x, s, h)
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  # Any GPU's weight; on one whose fp8 GEMMs take both operands K-major, every role.
  apart = backend == "gpu" and (not block_scaled or role == "weight")
  assert len(barriers) == int(apart)
  if apart:  # the codes and the amax; a weight's codes flattened where the GEMMs are K-major
    shapes = [v.aval.shape for v in barriers[0].invars]
    flat = role == "weight" and not block_scaled
    assert shapes == [(x.size,) if flat else x.shape, ()], shapes
  np.testing.assert_array_equal(np.asarray(ref[0]).view(np.uint8),
                                np.asarray(got[0]).view(np.uint8))
  np.testing.assert_array_equal(ref[1], got[1])
  # The history's scale (300 / 448), not the tensor's (its amax is about 2800).
  assert float(ref[1][0]) == pytest.approx(300.0 / 448.0)
  # Saturated where |x| > 448, so the codes are the history's, not a fresh amax's.
  assert float(jnp.max(jnp.abs(ref[0].astype(jnp.float32)))) == 448.0


def test_steady_weight_on_a_mesh_keeps_its_measured_cast():
  """Flattening a weight's codes would merge axes a mesh may shard: on a mesh
  the steady branch casts a weight as the default step does, with no barrier."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from fp8_linen.core import lowering
  cfg = ScalingConfig()
  mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  w = jax.device_put(jnp.asarray(np.random.default_rng(6).normal(size=(64, 48)), jnp.bfloat16),
                     NamedSharding(mesh, P(None, "d")))
  s, h = jnp.ones((1,)), jnp.zeros((8,)).at[0].set(3.0)
  fn = lambda w, s, h: numerics.quantize_with(cfg, s, h, w, weight=True)
  with numerics.histories_observed(), lowering.target_backend("gpu"):
    assert lowering.on_mesh(w)
    assert "optimization_barrier" not in str(jax.make_jaxpr(fn)(w, s, h))
    got = jax.jit(fn)(w, s, h)
    one = jax.jit(fn)(np.asarray(w), s, h)  # one device: the flattened barrier
    assert "optimization_barrier" in str(jax.make_jaxpr(fn)(np.asarray(w), s, h))
  np.testing.assert_array_equal(np.asarray(one[0]).view(np.uint8),
                                np.asarray(got[0]).view(np.uint8))


def test_steady_weight_with_barrier_off_keeps_its_measured_cast():
  """``barrier=False`` (a convolution's kernel): no barrier, the same codes."""
  from fp8_linen.core import lowering
  cfg = ScalingConfig()
  w = jnp.asarray(np.random.default_rng(7).normal(size=(3, 3, 8, 16)), jnp.bfloat16)
  s, h = jnp.ones((1,)), jnp.zeros((8,)).at[0].set(3.0)
  fn = lambda w, barrier: numerics.quantize_with(cfg, s, h, w, weight=True, barrier=barrier)
  with numerics.histories_observed(), lowering.target_backend("gpu"):
    kept = jax.make_jaxpr(lambda w: fn(w, False))(w)
    flat = jax.make_jaxpr(lambda w: fn(w, True))(w)
    a, b = jax.jit(lambda w: fn(w, False))(w), jax.jit(lambda w: fn(w, True))(w)
  assert "optimization_barrier" not in str(kept)
  assert "optimization_barrier" in str(flat)
  np.testing.assert_array_equal(np.asarray(a[0]).view(np.uint8), np.asarray(b[0]).view(np.uint8))
