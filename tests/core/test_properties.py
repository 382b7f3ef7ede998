"""Property tests of the fp8 numerics (hypothesis): bounds that hold for every input.

* quantize -> dequantize error: half a unit in the last place of the format
  (relative in the normal range, absolute in the subnormal range), for every
  fp8 dtype and scale rule (current/delayed, margins, power-of-two);
* saturation: finite values never become non-finite; beyond the range they
  become exactly ``±fp8_max * s``; NaN and Inf pass through;
* monotonicity: quantization never reorders values;
* no finite input gives a non-finite scale (any amax, margin, previous scale);
* history semantics: rolling, and which amax delayed scaling uses.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from fp8_linen.core import block_numerics, int_numerics, numerics
from fp8_linen.recipes import FP8_DTYPES, IntQuantConfig, ScalingConfig

PROPS = settings(max_examples=60, deadline=None, derandomize=True)
F32_MAX = float(np.finfo(np.float32).max)

finite32 = st.floats(min_value=-F32_MAX, max_value=F32_MAX, allow_nan=False, width=32)
# Values spanning the float32 range, with zeros and denormals among them.
arrays = hnp.arrays(np.float32, (16,), elements=finite32)
moderate = hnp.arrays(np.float32, (16,),
                      elements=st.floats(-2.0 ** 99, 2.0 ** 99, allow_nan=False, width=32))
dtypes = st.sampled_from(sorted(FP8_DTYPES))
margins = st.integers(-64, 64)


def _cfg(dtype, **kw):
  return ScalingConfig(dtype=dtype, history_length=4, **kw)


def _scale_for(x, cfg):
  return numerics.select_scale(cfg, jnp.ones((1,)), jnp.zeros((4,)), numerics.amax(x))


@PROPS
@given(x=moderate, dtype=dtypes, margin=st.integers(0, 3), p2=st.booleans(),
       scaling=st.sampled_from(["current", "delayed"]))
def test_round_trip_error_is_half_an_ulp(x, dtype, margin, p2, scaling):
  cfg = _cfg(dtype, margin=margin, power_of_two=p2, scaling=scaling)
  s = _scale_for(jnp.asarray(x), cfg)  # an empty history: both rules use this amax
  fin = ml_dtypes.finfo(FP8_DTYPES[dtype])
  back = np.asarray(numerics.dequantize(numerics.quantize(x, cfg.jnp_dtype, s), s, jnp.float32),
                    np.float64)
  sv = float(np.asarray(s)[0])
  # Round to nearest: half an ulp, relative in the normal range, absolute below.
  bound = np.maximum(np.abs(x.astype(np.float64)) * 2.0 ** -(fin.nmant + 1),
                     sv * float(fin.smallest_subnormal) / 2)
  # float32 arithmetic on the way (x / s, q * s) adds a few float32 ulps.
  slack = np.abs(x.astype(np.float64)) * 2.0 ** -21 + 1e-45
  assert np.all(np.abs(back - x) <= bound + slack), (x, back, sv)


@PROPS
@given(x=arrays, dtype=dtypes, s=st.floats(2.0 ** -99, 2.0 ** 99, width=32))
def test_finite_values_saturate_and_stay_finite(x, dtype, s):
  dt = FP8_DTYPES[dtype]
  m = numerics.fp8_max(dt)
  q = np.asarray(numerics.quantize(x, dt, jnp.array([s], jnp.float32))).astype(np.float32)
  assert np.all(np.isfinite(q)) and np.all(np.abs(q) <= m)
  beyond = np.abs(x.astype(np.float64) / np.float64(s)) >= m * (1 + 2.0 ** -10)
  np.testing.assert_array_equal(q[beyond], np.sign(x[beyond]) * m)


@PROPS
@given(x=arrays, dtype=dtypes, where=st.integers(0, 15),
       bad=st.sampled_from([np.inf, -np.inf, np.nan]))
def test_non_finite_values_pass_through(x, dtype, where, bad):
  dt = FP8_DTYPES[dtype]
  x = x.copy()
  x[where] = bad
  q = np.asarray(numerics.quantize(x, dt, jnp.ones((1,)))).astype(np.float32)
  has_inf = not dtype.endswith(("e4m3fn", "fnuz"))
  if np.isnan(bad) or not has_inf:
    assert np.isnan(q[where])
  else:
    assert q[where] == bad
  others = np.delete(q, where)
  assert np.all(np.isfinite(others))
  # The encoder is bit-exact against the cast, non-finite values included.
  y = np.where(np.isfinite(x), np.clip(x, -numerics.fp8_max(dt), numerics.fp8_max(dt)), x)
  ref = y.astype(dt).astype(np.float32)
  np.testing.assert_array_equal(np.isnan(q), np.isnan(ref))
  np.testing.assert_array_equal(q[~np.isnan(q)], ref[~np.isnan(ref)])


@PROPS
@given(x=arrays, dtype=dtypes, s=st.floats(2.0 ** -99, 2.0 ** 99, width=32))
def test_quantization_is_monotonic(x, dtype, s):
  xs = np.sort(x)
  q = np.asarray(numerics.quantize(xs, FP8_DTYPES[dtype], jnp.array([s], jnp.float32)))
  assert np.all(np.diff(q.astype(np.float64)) >= 0)


@PROPS
@given(a=finite32.map(abs), prev=st.floats(allow_nan=True, allow_infinity=True, width=32),
       dtype=dtypes, margin=margins, p2=st.booleans())
def test_no_finite_amax_gives_a_non_finite_scale(a, prev, dtype, margin, p2):
  cfg = _cfg(dtype, margin=margin, power_of_two=p2)
  s = float(numerics.scale_from_amax(jnp.float32(a), jnp.array([prev], jnp.float32), cfg)[0])
  assert numerics.SCALE_FLOOR <= s <= numerics.SCALE_CEIL
  # (A zero amax keeps the previous scale, whatever it is; XLA flushes denormals to 0.)
  if p2 and a >= np.finfo(np.float32).tiny:
    assert s == 2.0 ** round(np.log2(s))
  # The product of two such scales is finite too (the output scale of a GEMM).
  assert np.isfinite(float(numerics.scale_product(jnp.float32(s), jnp.float32(s))))


@PROPS
@given(x=arrays, h=hnp.arrays(np.float32, (4,), elements=finite32.map(abs)), dtype=dtypes,
       margin=margins, algo=st.sampled_from(["max", "most_recent"]))
def test_every_scale_of_finite_inputs_is_finite(x, h, dtype, margin, algo):
  cfg = _cfg(dtype, margin=margin, amax_compute_algo=algo)
  x = jnp.asarray(x)
  s = numerics.select_scale(cfg, jnp.ones((1,)), jnp.asarray(h), numerics.amax(x))
  rows = numerics.row_scale(x.reshape(4, 4), (1,), cfg)
  _, mx = block_numerics.mx_quantize(x.reshape(2, 8), 1, 4, cfg.jnp_dtype)
  for t in (s, rows, mx.astype(jnp.float32)):
    assert np.all(np.isfinite(np.asarray(t, np.float32))) and np.all(np.asarray(t) > 0)
  lo, hi = float(jnp.min(x)), float(jnp.max(x))
  for sym in (True, False):
    si, z = int_numerics.int_params_from_range(lo, hi, IntQuantConfig(symmetric=sym))
    assert np.isfinite(float(si)) and float(si) > 0 and np.isfinite(float(z))


@PROPS
@given(h=hnp.arrays(np.float32, (6,), elements=st.floats(0, 2.0 ** 99, width=32)),
       a=st.one_of(st.floats(0, 2.0 ** 99, width=32), st.sampled_from([np.nan, np.inf])))
def test_history_rolls_newest_first_and_never_keeps_a_non_finite_amax(h, a):
  out = np.asarray(numerics.roll_history(jnp.asarray(h), a))
  assert out.shape == h.shape
  assert out[0] == (a if np.isfinite(a) else 0.0)
  np.testing.assert_array_equal(out[1:], h[:-1])


@PROPS
@given(h=hnp.arrays(np.float32, (4,), elements=st.floats(0, 2.0 ** 20, width=32)),
       cur=st.floats(0, 2.0 ** 20, width=32), algo=st.sampled_from(["max", "most_recent"]))
def test_delayed_scaling_uses_the_history_and_current_only_when_empty(h, cur, algo):
  cfg = _cfg("float8_e4m3fn", amax_compute_algo=algo)
  used = float(np.max(h)) if algo == "max" else float(h[0])
  if used == 0:
    used = cur  # nothing observed yet: the current amax (no first-step clipping)
  s = float(numerics.select_scale(cfg, jnp.array([0.25]), jnp.asarray(h), jnp.float32(cur))[0])
  expect = used / 448.0 if used > 0 else 0.25  # no information at all: keep the scale
  assert s == pytest.approx(max(expect, numerics.SCALE_FLOOR), rel=1e-6)


@pytest.mark.parametrize("margin,a", [(1, 3.0e38), (64, 1.0e3), (64, 3.0e38), (-64, 1e-30)])
def test_margins_the_validator_accepts_give_finite_scales_eagerly(margin, a):
  # Op by op (no fusion that could reorder the arithmetic): amax * 2**margin
  # used to overflow before the division by fp8_max.
  for dtype in ("float8_e4m3fn", "float8_e5m2"):
    for p2 in (False, True):
      cfg = _cfg(dtype, margin=margin, power_of_two=p2)
      s = numerics.scale_from_amax(jnp.float32(a), jnp.ones((1,)), cfg)
      assert np.isfinite(float(s[0])) and float(s[0]) > 0
      assert np.isfinite(float(numerics.scale_product(s, s)[0]))
