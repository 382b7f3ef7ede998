"""Pure integer fake-quant numerics against closed forms computed in numpy float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import int_numerics


@pytest.mark.parametrize("bits", range(2, 9))
def test_grids(bits):
  assert (fl.IntQuantConfig(bits=bits).qmin, fl.IntQuantConfig(bits=bits).qmax) == (
      -2 ** (bits - 1), 2 ** (bits - 1) - 1)
  c = fl.IntQuantConfig(bits=bits, narrow_range=True)
  assert (c.qmin, c.qmax) == (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1)
  c = fl.IntQuantConfig(bits=bits, symmetric=False)
  assert (c.qmin, c.qmax) == (0, 2 ** bits - 1)


@pytest.mark.parametrize("field, value, match", [
    ("bits", 1, r"bits=1 must be an int \[2, 8\]"), ("bits", 9, "bits=9"),
    ("bits", 8.0, "bits=8.0"), ("granularity", "row", "allowed values"),
    ("estimator", "adaround", "'lsq'"), ("observer", "hist", "'moving_average'"),
    ("momentum", 1.0, r"\[0, 1\)"), ("group_size", 32, "only allowed with granularity='group'"),
])
def test_bad_int_configs_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    fl.IntQuantConfig(**{field: value})


def test_inconsistent_int_configs():
  with pytest.raises(ValueError, match="group_size is required"):
    fl.IntQuantConfig(granularity="group")
  with pytest.raises(ValueError, match="symmetric: \\[False\\]"):
    fl.IntQuantConfig(estimator="lsq+")
  with pytest.raises(ValueError, match="symmetric: \\[True\\]"):
    fl.IntQuantConfig(estimator="lsq", symmetric=False)
  with pytest.raises(ValueError, match="power_of_two"):
    fl.IntQuantConfig(estimator="lsq", power_of_two=True)
  with pytest.raises(ValueError, match="narrow_range"):
    fl.IntQuantConfig(symmetric=False, narrow_range=True)
  with pytest.raises(ValueError, match=r"IntRecipe.input.granularity='channel'.*\['tensor'\]"):
    fl.IntRecipe(input=fl.IntQuantConfig(granularity="channel"))
  with pytest.raises(ValueError, match="IntRecipe.kernel must be an IntQuantConfig"):
    fl.IntRecipe(kernel=fl.ScalingConfig())


def test_params_from_range_closed_forms():
  lo, hi = np.float32(-0.3), np.float32(5.0)
  s, z = int_numerics.int_params_from_range(lo, hi, fl.IntQuantConfig(bits=8))
  np.testing.assert_allclose(float(s), 5.0 / 127, rtol=1e-6)
  assert float(z) == 0.0
  c = fl.IntQuantConfig(bits=4, symmetric=False)
  s, z = int_numerics.int_params_from_range(lo, hi, c)
  np.testing.assert_allclose(float(s), 5.3 / 15, rtol=1e-6)
  assert float(z) == np.round(0.3 / (5.3 / 15))
  # A positive-only range is widened to include 0: zero point 0.
  s, z = int_numerics.int_params_from_range(np.float32(1.0), np.float32(3.0), c)
  np.testing.assert_allclose(float(s), 3.0 / 15, rtol=1e-6)
  assert float(z) == 0.0
  s, _ = int_numerics.int_params_from_range(lo, hi, fl.IntQuantConfig(bits=8, power_of_two=True))
  assert float(s) == 2.0 ** np.ceil(np.log2(5.0 / 127))
  s, _ = int_numerics.int_params_from_range(np.float32(0), np.float32(0), fl.IntQuantConfig())
  assert float(s) == 1.0  # empty range: finite scale


def _ref_fake_quant(x, s, z, qmin, qmax):
  x = np.asarray(x, np.float64)
  return s * (np.clip(np.round(x / s) + z, qmin, qmax) - z)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_quant_matches_reference_and_error_bound(bits, symmetric):
  cfg = fl.IntQuantConfig(bits=bits, symmetric=symmetric)
  x = np.random.default_rng(bits).normal(size=(64, 32)).astype(np.float32)
  s, z = int_numerics.int_params_from_range(x.min(), x.max(), cfg)
  s, z = float(s), float(z)
  out = np.asarray(jax.jit(int_numerics.int_fake_quant, static_argnums=(3, 4))(
      x, s, z, cfg.qmin, cfg.qmax))
  np.testing.assert_allclose(out, _ref_fake_quant(x, s, z, cfg.qmin, cfg.qmax), rtol=0, atol=1e-6)
  # The range covers x: only rounding error, at most half a step.
  assert np.max(np.abs(out - x)) <= s / 2 * (1 + 1e-5)
  # On the grid: (x_hat / s + z) is an integer in [qmin, qmax].
  k = out / s + z
  np.testing.assert_allclose(k, np.round(k), atol=1e-3)
  assert k.min() >= cfg.qmin - 1e-3 and k.max() <= cfg.qmax + 1e-3
  # quantize / dequantize agree with fake quantization.
  q = int_numerics.int_quantize(x, s, z, cfg.qmin, cfg.qmax)
  np.testing.assert_allclose(np.asarray(int_numerics.int_dequantize(q, s, z)), out, atol=1e-6)


def test_clipping_error_outside_range():
  out = int_numerics.int_fake_quant(jnp.array([100.0, -100.0]), 1.0, 0.0, -8, 7)
  assert out.tolist() == [7.0, -8.0]


def test_int_view_shapes_and_errors():
  w = jnp.ones((8, 3))
  v, axes = int_numerics.int_view(w, (0,), fl.IntQuantConfig())
  assert v.shape == (8, 3) and axes == (0, 1)
  v, axes = int_numerics.int_view(w, (0,), fl.IntQuantConfig(granularity="channel"))
  assert axes == (0,)
  v, axes = int_numerics.int_view(w, (0,), fl.IntQuantConfig(granularity="group", group_size=4))
  assert v.shape == (2, 4, 3) and axes == (1,)
  with pytest.raises(ValueError, match="does not divide"):
    int_numerics.int_view(w, (0,), fl.IntQuantConfig(granularity="group", group_size=3))
  with pytest.raises(ValueError, match="exactly one contracting axis"):
    int_numerics.int_view(jnp.ones((2, 4, 3)), (0, 1),
                      fl.IntQuantConfig(granularity="group", group_size=2))


def test_finer_granularity_has_smaller_error():
  rng = np.random.default_rng(0)
  w = (rng.normal(size=(64, 8)) * np.logspace(-3, 0, 8)).astype(np.float32)
  errs = {}

  def fq(w, cfg):
    v, axes = int_numerics.int_view(w, (0,), cfg)
    s, z = int_numerics.int_params_from_range(v.min(axis=axes, keepdims=True),
                                          v.max(axis=axes, keepdims=True), cfg)
    return int_numerics.int_fake_quant(v, s, z, cfg.qmin, cfg.qmax).reshape(w.shape)

  for g, gs in (("tensor", None), ("channel", None), ("group", 16)):
    cfg = fl.IntQuantConfig(bits=4, granularity=g, group_size=gs)
    out = np.asarray(jax.jit(fq, static_argnums=1)(jnp.asarray(w), cfg))
    # Column with the smallest magnitude: relative error.
    errs[g] = np.linalg.norm(out[:, 0] - w[:, 0]) / np.linalg.norm(w[:, 0])
  assert errs["tensor"] > 0.5          # per-tensor flushes the small column
  assert errs["channel"] < 0.2 and errs["group"] <= errs["channel"] + 1e-6


def test_lsq_inits():
  x = np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)
  s = int_numerics.lsq_init_step(x, (0,), 7)
  np.testing.assert_allclose(np.asarray(s)[0], 2 * np.abs(x).mean(0) / np.sqrt(7), rtol=1e-5)
  s, b = int_numerics.lsq_plus_init(x, (0, 1), 0, 15)
  np.testing.assert_allclose(float(s.reshape(())), (x.max() - x.min()) / 15, rtol=1e-5)
  np.testing.assert_allclose(float(b.reshape(())), x.min(), rtol=1e-6)
