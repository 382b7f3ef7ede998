"""Post-training quantization (Linen): fl.ptq, its calibration methods and GPTQ.

The NNX entry point and the Linen/NNX parity are in tests/nnx/test_nnx_ptq.py.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import calibration as core_calibration
from fp8_linen.core import gptq as core_gptq
from fp8_linen.core.numerics import SCALE_FLOOR


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64)(x))
    return nn.Dense(8)(h)


class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    return nn.Dense(4)(x.reshape(x.shape[0], -1))


def _batches(shape, n=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  return [jax.random.normal(k, shape) for k in keys]


@functools.lru_cache(maxsize=None)
def _mlp():
  model = MLP()
  batches = _batches((64, 32))
  return model, model.init(jax.random.key(7), batches[0]), batches


@functools.lru_cache(maxsize=None)
def _ptq(recipe, config=fl.PtqConfig()):
  model, params, batches = _mlp()
  return fl.ptq(model, params, batches, recipe=recipe, config=config)


def _frozen(model, variables, x):
  @jax.jit
  def f(v, x):
    with fl.frozen_quantizers():
      return model.apply(v, x)
  return f(variables, x)


def _serve(res, x):
  return jax.jit(res.served.apply)(res.served_params, x)


def _rel_err(y, ref):
  return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


CASES = {
    "int8 weight-only per channel": (fl.weight_only(8), fl.PtqConfig()),
    "int4 weight-only per group": (fl.weight_only(4, granularity="group", group_size=16),
                                   fl.PtqConfig()),
    "int4 weight-only GPTQ per group": (fl.weight_only(4, granularity="group", group_size=16),
                                        fl.PtqConfig(weights="gptq")),
    "int4 weight-only STE (int4_group preset)": (fl.load_recipe("int4_group"), fl.PtqConfig()),
    "w8a8 int8 STE percentile": (fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel")),
                                 fl.PtqConfig(activation="percentile", percentile=99.9)),
    "w8a8 int8 LSQ mse": (fl.int8_lsq(), fl.PtqConfig(activation="mse", mse_grid=20)),
    "fp8 delayed": (fl.delayed_scaling(16), fl.PtqConfig()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_served_is_the_calibrated_qat_model_bit_for_bit(name):
  recipe, config = CASES[name]
  res = _ptq(recipe, config)
  x_new = jax.random.normal(jax.random.key(99), (64, 32)) * 2.0  # beyond the calibration
  for x in (_mlp()[2][0], x_new):
    y = jax.jit(res.served.apply)(res.served_params, x)
    chex.assert_trees_all_equal(y, _frozen(res.model, res.variables, x))
  kernel = res.served_params["params"]["Dense_0"]["kernel"]
  chex.assert_shape(kernel, (32, 64))
  want = {8: jnp.int8, 4: jnp.int4}.get(getattr(recipe.kernel, "bits", None),
                                         jnp.float8_e4m3fn)
  chex.assert_type(kernel, want)


def test_weight_only_ptq_is_close_to_float():
  model, params, batches = _mlp()
  ref = jax.jit(model.apply)(params, batches[0])
  errs = {}
  for name in ("int8 weight-only per channel", "int4 weight-only per group",
               "int4 weight-only GPTQ per group"):
    res = _ptq(*CASES[name])
    errs[name] = _rel_err(_serve(res, batches[0]), ref)
  print("PTQ ||y - y_float|| / ||y_float||:", errs)
  assert errs["int8 weight-only per channel"] < 0.01
  assert errs["int4 weight-only per group"] < 0.15
  # The weights now take a quarter / an eighth of float32's bytes (plus scales).
  res = _ptq(*CASES["int8 weight-only per channel"])
  kernels = lambda p: {k: v["kernel"] for k, v in p["params"].items()}
  assert fl.weight_bytes(kernels(res.served_params)) * 4 == fl.weight_bytes(kernels(params))


def test_w8a8_and_fp8_ptq_are_close_to_float():
  model, params, batches = _mlp()
  ref = jax.jit(model.apply)(params, batches[1])
  errs = {}
  for name in ("w8a8 int8 STE percentile", "w8a8 int8 LSQ mse", "fp8 delayed"):
    res = _ptq(*CASES[name])
    errs[name] = _rel_err(_serve(res, batches[1]), ref)
  print("PTQ ||y - y_float|| / ||y_float|| (a batch not calibrated on):", errs)
  # e4m3 keeps 3 mantissa bits: about 4% rms rounding error per operand.
  assert errs["w8a8 int8 STE percentile"] < 0.05 and errs["w8a8 int8 LSQ mse"] < 0.05, errs
  assert errs["fp8 delayed"] < 0.1, errs


def test_convolutions_and_library_layers():
  model = CNN()
  batches = _batches((4, 6, 6, 3))
  params = model.init(jax.random.key(0), batches[0])
  # Weight-only convolutions serve the dequantized codes (w8a8 ones run on codes, as
  # convert's tests show for QAT models). GPTQ rounds the dense layer; the convolution,
  # whose input has no Hessian recorded, is rounded to nearest.
  for recipe in (fl.weight_only(8),):
    res = fl.ptq(model, params, batches, recipe=recipe, config=fl.PtqConfig(weights="gptq"))
    chex.assert_type(res.served_params["params"]["Conv_0"]["kernel"], jnp.int8)
    w = params["params"]["Conv_0"]["kernel"]
    chex.assert_trees_all_close(res.variables["params"]["Conv_0"]["kernel_step"],
                                jnp.max(jnp.abs(w), axis=(0, 1, 2), keepdims=True) / 127,
                                rtol=1e-6)
    chex.assert_trees_all_equal(res.variables["params"]["Conv_0"]["kernel"], w)
    chex.assert_trees_all_equal(_serve(res, batches[0]),
                                _frozen(res.model, res.variables, batches[0]))
    assert _rel_err(_serve(res, batches[0]),
                    jax.jit(model.apply)(params, batches[0])) < 0.05
  # A model built from the library's layers carries its own recipe.
  layer = fl.QDense(8, recipe=fl.weight_only(8))
  x = _batches((8, 16))
  float_params = nn.Dense(8).init(jax.random.key(1), x[0])
  res = fl.ptq(layer, float_params, x)
  assert isinstance(res.served, fl.ServedModule)
  chex.assert_trees_all_close(_serve(res, x[0]), x[0] @ float_params["params"]["kernel"] +
                              float_params["params"]["bias"], atol=0.03)


def _heavy_tailed(n=8192, seed=0):
  return jax.random.t(jax.random.key(seed), 3.0, (n,))


def test_percentile_and_mse_clip_outliers_and_mse_lowers_the_error():
  x = _heavy_tailed()
  cfg = fl.IntQuantConfig(bits=4)
  qdq = core_calibration.int_qdq(cfg)
  lo, hi = x.min(), x.max()
  ranges = {m: core_calibration.choose_range(x, lo, hi, method=m, percentile=99.0, qdq=qdq)
            for m in core_calibration.METHODS}
  width = {m: float(r[1] - r[0]) for m, r in ranges.items()}
  assert width["percentile"] < width["minmax"] and width["mse"] < width["minmax"]
  err = {m: float(core_calibration.qdq_error(x, *r, qdq)) for m, r in ranges.items()}
  assert err["mse"] < err["minmax"] and err["mse"] <= err["percentile"]
  # The symmetric percentile is the percentile of |x|.
  np.testing.assert_allclose(ranges["percentile"][1], np.quantile(np.abs(np.asarray(x)), 0.99),
                             rtol=1e-5)
  # fp8's grid: its MSE range never does worse than min/max either.
  fq = core_calibration.fp8_qdq(fl.ScalingConfig())
  r = core_calibration.choose_range(x, lo, hi, method="mse", qdq=fq)
  assert core_calibration.qdq_error(x, *r, fq) <= core_calibration.qdq_error(x, lo, hi, fq)


def test_merged_samples_stay_bounded_and_draw_from_every_batch():
  from fp8_linen.families import calibration
  stats = None
  for b in range(4):
    x = jnp.full((50, 20), float(b))  # batch b holds only the value b
    rec = calibration.record(x, jnp.ones((20, 3)), (1,), (0,), (), recipe=fl.IntRecipe(),
                             samples=200, with_hessian=True)
    stats = calibration.merge(stats, rec)
  chex.assert_shape(stats.sample, (200,))
  counts = np.bincount(stats.sample.astype(int), minlength=4)
  assert counts.min() > 25, counts                       # about 50 of each
  assert (stats.lo, stats.hi, stats.batches) == (0.0, 3.0, 4)
  np.testing.assert_allclose(stats.hessian, 50 * 14 * np.ones((20, 20)))  # sum_b 50 * b^2


def test_activation_methods_set_the_observer_range():
  # What both ptq entry points write (the w8a8 cases above run it end to end).
  from fp8_linen.families import calibration
  recipe = fl.IntRecipe(input=fl.IntQuantConfig(bits=4), kernel=fl.IntQuantConfig(bits=4))
  xs = [x.reshape(64, 16) for x in (_heavy_tailed(1024, 1), _heavy_tailed(1024, 2))]
  stats = None
  for x in xs:
    stats = calibration.merge(stats, calibration.record(
        x, jnp.ones((16, 4)), (1,), (0,), (), recipe=recipe, samples=4096, with_hessian=False))
  x = jnp.concatenate([x.ravel() for x in xs])
  qdq = core_calibration.int_qdq(recipe.input)
  widths, errors = {}, {}
  for method in core_calibration.METHODS:
    values, kernel = calibration.calibrated(
        stats, fl.PtqConfig(activation=method, percentile=99.0, mse_grid=50), where="layer")
    assert kernel is None and set(values) == {"input_range"}
    rng = values["input_range"]
    widths[method] = float(rng.sum())
    errors[method] = float(core_calibration.qdq_error(x, -rng[0], rng[1], qdq))
  np.testing.assert_allclose(widths["minmax"], float(x.max() - x.min()), rtol=1e-6)
  assert widths["percentile"] < widths["minmax"] and widths["mse"] < widths["minmax"]
  assert errors["mse"] < errors["minmax"]


# ---------------------------------------------------------------------------- GPTQ


def _gptq_reference(w, h, qmin, qmax, group_size, damping):
  """GPTQ in float64 numpy, written from the paper's update rule with explicit loops."""
  w = np.array(w, np.float64)
  h = np.array(h, np.float64)
  k_rows, n = w.shape
  dead = np.diag(h) == 0
  h[dead, dead] = 1.0
  w[dead, :] = 0.0
  h += np.eye(k_rows) * damping * np.mean(np.diag(h))
  u = np.linalg.cholesky(np.linalg.inv(h)).T
  codes = np.zeros((k_rows, n), np.int64)
  scales = []
  for k in range(k_rows):
    if k % group_size == 0:
      block = w[k:k + group_size]
      s = np.maximum(-np.minimum(block.min(0), 0.0), np.maximum(block.max(0), 0.0)) / qmax
      s = np.where(s > SCALE_FLOOR, s, 1.0)
      scales.append(s)
    for j in range(n):
      codes[k, j] = min(max(np.round(w[k, j] / s[j]), qmin), qmax)
      err = (w[k, j] - codes[k, j] * s[j]) / u[k, k]
      for i in range(k + 1, k_rows):
        w[i, j] -= u[k, i] * err
  return codes, np.stack(scales)


@functools.lru_cache(maxsize=None)
def _layer_problem():
  # Correlated inputs, as a layer's activations are: where GPTQ's feedback pays.
  z = jax.random.normal(jax.random.key(0), (512, 32))
  mix = jnp.eye(32) + 0.5 * jax.random.normal(jax.random.key(1), (32, 32))
  x = z @ mix
  w = jax.random.normal(jax.random.key(2), (32, 12))
  return x, w


@pytest.mark.parametrize("granularity,group_size", [("channel", None), ("group", 8)])
def test_gptq_matches_a_float64_reference_and_beats_round_to_nearest(granularity, group_size):
  x, w = _layer_problem()
  cfg = fl.IntQuantConfig(bits=4, granularity=granularity, group_size=group_size)
  h = core_gptq.hessian(x, (1,))
  np.testing.assert_allclose(h, np.asarray(x, np.float64).T @ np.asarray(x, np.float64),
                             rtol=1e-5, atol=1e-3)
  codes, scales = jax.jit(functools.partial(core_gptq.gptq, cfg=cfg, damping=0.01))(w, h)
  chex.assert_shape(codes, w.shape)
  chex.assert_type(codes, jnp.int32)
  gs = group_size or w.shape[0]
  ref_codes, ref_scales = _gptq_reference(w, h, cfg.qmin, cfg.qmax, gs, 0.01)
  np.testing.assert_allclose(scales, ref_scales, rtol=1e-4)
  diff = np.abs(np.asarray(codes) - ref_codes)
  # float32 against float64: a code may round the other way at a tie.
  assert diff.max() <= 1 and (diff > 0).mean() < 0.02, (diff > 0).mean()
  deq = codes * jnp.repeat(scales, gs, axis=0)
  # Round to nearest with the same scales (per group: the weight's own).
  view = w.reshape(-1, gs, w.shape[1])
  s_rtn = jnp.max(jnp.abs(view), axis=1, keepdims=True) / cfg.qmax
  rtn = (jnp.clip(jnp.round(view / s_rtn), cfg.qmin, cfg.qmax) * s_rtn).reshape(w.shape)
  e_gptq = float(jnp.linalg.norm(x @ w - x @ deq))
  e_rtn = float(jnp.linalg.norm(x @ w - x @ rtn))
  print(f"{granularity}: ||XW - XQ|| GPTQ {e_gptq:.3f}, round to nearest {e_rtn:.3f}")
  assert e_gptq < e_rtn


def test_gptq_ptq_lowers_the_layer_error_on_calibration_data():
  model, params, batches = _mlp()
  ref = jax.jit(model.apply)(params, batches[0])
  err = {}
  for name in ("int4 weight-only per group", "int4 weight-only GPTQ per group"):
    res = _ptq(*CASES[name])
    err[name] = float(jnp.linalg.norm(_serve(res, batches[0]) - ref))
  print("int4 per group, ||y - y_float|| on calibration data:", err)
  assert err["int4 weight-only GPTQ per group"] < err["int4 weight-only per group"]
  # GPTQ's kernel is on the grid its scale defines: the served codes are GPTQ's.
  res = _ptq(*CASES["int4 weight-only GPTQ per group"])
  k, step = res.variables["params"]["Dense_0"]["kernel"], res.variables["params"]["Dense_0"][
      "kernel_step"]
  codes = res.served_params["params"]["Dense_0"]["kernel"].astype(jnp.float32)
  np.testing.assert_array_equal(codes.reshape(2, 16, 64) * step, k.reshape(2, 16, 64))


class GeneralMLP(nn.Module):
  """Weights with several free and several contracting axes."""

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((4, 8), axis=-1)(x)                     # kernel (16, 4, 8)
    return nn.DenseGeneral(6, axis=(-2, -1))(nn.relu(h))        # kernel (4, 8, 6)


def test_gptq_on_multi_axis_weights_and_fp8_dot_general_layers():
  xs = _batches((32, 2, 16))
  model = GeneralMLP()
  params = model.init(jax.random.key(3), xs[0])
  res = fl.ptq(model, params, xs, recipe=fl.weight_only(4), config=fl.PtqConfig(weights="gptq"))
  steps = [v["kernel_step"] for v in res.variables["params"].values()]
  chex.assert_shape(steps, [(1, 4, 8), (1, 1, 6)])
  chex.assert_trees_all_equal(_serve(res, xs[1]), _frozen(res.model, res.variables, xs[1]))
  # A product module in a flax layer rounds its parent's kernel.
  dg = functools.partial(fl.Fp8DotGeneral, recipe=fl.weight_only(4))
  layer, x = nn.Dense(3, dot_general_cls=dg), [x.reshape(32, 32) for x in xs]
  res = fl.ptq(layer, nn.Dense(3).init(jax.random.key(0), x[0]), x,
               config=fl.PtqConfig(weights="gptq"))
  chex.assert_shape(res.variables["params"]["Fp8DotGeneral_0"]["kernel_step"], (1, 3))
  chex.assert_type(res.served_params["params"]["kernel"], jnp.int4)
  chex.assert_trees_all_equal(_serve(res, x[1]), _frozen(layer, res.variables, x[1]))


class OwnWeights(nn.Module):
  """Weights of a module's own code (MaxText's, EasyDeL's layers); ``shared`` is read twice."""

  @nn.compact
  def __call__(self, x):
    dn = (((1,), (0,)), ((), ()))
    w1 = self.param("w1", nn.initializers.lecun_normal(), (32, 64))
    shared = self.param("shared", nn.initializers.lecun_normal(), (64, 64))
    h = nn.relu(jax.lax.dot_general(x, w1, dn))
    h = nn.relu(jax.lax.dot_general(h, shared, dn))
    return jax.lax.dot_general(h, shared.astype(jnp.bfloat16), dn).astype(h.dtype)


def test_gptq_rounds_a_weight_of_a_modules_own_code_that_one_product_reads():
  model, batches = OwnWeights(), _batches((64, 32))
  params = model.init(jax.random.key(4), batches[0])
  qm = fl.quantize_model(model, fl.weight_only(4, granularity="group", group_size=16))
  res = {w: fl.ptq(qm, params, batches, config=fl.PtqConfig(weights=w)) for w in ("gptq", "rtn")}
  p = {w: r.variables["params"] for w, r in res.items()}
  # w1 (one product) is GPTQ's rounding, on its step's grid and stored as those codes;
  # `shared`, which two products read, is left as it was (each rounds it to nearest).
  assert not np.array_equal(p["gptq"]["w1"], p["rtn"]["w1"])
  np.testing.assert_array_equal(p["gptq"]["shared"], params["params"]["shared"])
  np.testing.assert_array_equal(p["rtn"]["w1"], params["params"]["w1"])
  served = res["gptq"].served_params["params"]
  step = p["gptq"]["dot_general_0"]["kernel_step"]
  np.testing.assert_array_equal(served["w1"].astype(jnp.float32).reshape(2, 16, 64) * step,
                                p["gptq"]["w1"].reshape(2, 16, 64))
  assert served["shared"].dtype == jnp.float32  # read twice: quantized at each call
  chex.assert_trees_all_equal(_serve(res["gptq"], batches[1]),
                              _frozen(qm, res["gptq"].variables, batches[1]))
  ref = jax.jit(model.apply)(params, batches[0])
  err = {w: float(jnp.linalg.norm(_serve(r, batches[0]) - ref)) for w, r in res.items()}
  assert err["gptq"] < err["rtn"], err


# ---------------------------------------------------------------------------- errors


def test_bad_input_is_named():
  model, params, batches = _mlp()
  with pytest.raises(ValueError, match="batches is empty"):
    fl.ptq(model, params, [], recipe=fl.weight_only(8))
  with pytest.raises(ValueError, match=r"batches\[1\] holds NaN"):
    fl.ptq(model, params, [batches[0], batches[1].at[0, 0].set(jnp.nan)],
           recipe=fl.weight_only(8))
  with pytest.raises(TypeError, match="batches must be a sequence"):
    fl.ptq(model, params, batches[0], recipe=fl.weight_only(8))
  with pytest.raises(ValueError, match="PtqConfig.activation='max'"):
    fl.PtqConfig(activation="max")
  with pytest.raises(ValueError, match="PtqConfig.weights='awq'"):
    fl.PtqConfig(weights="awq")
  with pytest.raises(ValueError, match="PtqConfig.percentile"):
    fl.PtqConfig(percentile=0)
  with pytest.raises(ValueError, match="ran no quantized product"):
    fl.ptq(model, params, batches, recipe=fl.weight_only(8),
           rules=[fl.QuantizationRule(module_path=".*", quantize=False)])
  with pytest.raises(ValueError, match="weights='gptq'.*fp8"):
    fl.ptq(model, params, batches, recipe=fl.delayed_scaling(16),
           config=fl.PtqConfig(weights="gptq"))
  with pytest.raises(ValueError, match="estimator='lsq'"):
    fl.ptq(model, params, batches, recipe=fl.IntRecipe(), config=fl.PtqConfig(weights="gptq"))
  with pytest.raises(ValueError, match="variables has no 'params/Dense_1/bias'"):
    bad = {"params": {**params["params"], "Dense_1": {"kernel": params["params"]["Dense_1"][
        "kernel"]}}}
    fl.ptq(model, bad, batches, recipe=fl.weight_only(8))
  with pytest.raises(TypeError, match="rules= needs a recipe"):
    fl.ptq(model, params, batches, rules=[fl.QuantizationRule()])
