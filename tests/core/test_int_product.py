"""The integer product: exact integer GEMM on codes, int8 residuals, QAT gradients."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8_linen as fl
from fp8_linen.core import int_codes, int_gemm, int_numerics, int_ops, int_product

DN = (((1,), (0,)), ((), ()))
Q = fl.IntQuantConfig

RECIPES = {
    "ste_tensor": fl.IntRecipe(),
    "ste_channel": fl.IntRecipe(kernel=Q(granularity="channel")),
    "ste_group": fl.IntRecipe(kernel=Q(granularity="group", group_size=8)),
    "ste_asym8": fl.IntRecipe(input=Q(symmetric=False),
                              kernel=Q(symmetric=False, granularity="channel")),
    "ste_asym8_group": fl.IntRecipe(input=Q(symmetric=False),
                                    kernel=Q(symmetric=False, granularity="group", group_size=16)),
    "ste_int4_narrow": fl.IntRecipe(input=Q(bits=4, narrow_range=True),
                                    kernel=Q(bits=4, narrow_range=True, granularity="channel")),
    "lsq8": fl.int8_lsq(),
    "lsq4_plus": fl.int4_lsq_plus(),
    "lsq8_plus": fl.IntRecipe(input=Q(symmetric=False, estimator="lsq+"),
                              kernel=Q(symmetric=False, estimator="lsq+", granularity="channel")),
}


def _data(shape_x=(8, 32), shape_w=(32, 16), shift=0.0):
  x = jax.random.normal(jax.random.key(0), shape_x) + shift
  w = jax.random.normal(jax.random.key(1), shape_w) * 0.3
  return x, w


def _params(recipe, x, w, contract_w=(0,)):
  """Input/kernel params as a layer would hold them (LSQ inits from the data)."""
  def one(cfg, role, t, contract):
    view, axes = int_numerics.int_view(t, contract, cfg)
    red = tuple(range(view.ndim)) if role == "input" else axes
    if not cfg.learned:
      return (jnp.zeros(2),) if role == "input" else ()
    if cfg.estimator == "lsq":
      s = int_numerics.lsq_init_step(view, red, cfg.qmax)
      return (s.reshape(()) if role == "input" else s,)
    s, b = int_numerics.lsq_plus_init(view, red, cfg.qmin, cfg.qmax)
    return ((s.reshape(()), b.reshape(())) if role == "input" else (s, b))
  return one(recipe.input, "input", x, (1,)), one(recipe.kernel, "kernel", w, contract_w)


def _fake_quant(recipe, x, w, lp, rp, gx=0.1, gw=0.2):
  """The same quantization by the fake-quant ops (float operands)."""
  def one(cfg, role, t, params, contract, g):
    view, axes = int_numerics.int_view(t, contract, cfg)
    if cfg.estimator == "lsq":
      out = int_ops.lsq_fake_quant(view, params[0], qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)
    elif cfg.estimator == "lsq+":
      out = int_ops.lsq_plus_fake_quant(view, *params, qmin=cfg.qmin, qmax=cfg.qmax,
                                        grad_scale=g)
    elif role == "input":
      out = int_ops.observed_fake_quant(t, params[0], cfg=cfg)[0]
    else:
      out = int_ops.minmax_fake_quant(view, axes, cfg)
    return out.reshape(t.shape)
  return (one(recipe.input, "input", x, lp, (1,), gx), one(recipe.kernel, "kernel", w, rp, (0,), gw))


def _int(recipe, x, w, lp, rp, **kw):
  return int_product.int_dot_general(x, w, DN, recipe=recipe, input_params=lp, kernel_params=rp,
                                     input_grad_scale=0.1, kernel_grad_scale=0.2, **kw)[0]


@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_is_the_float64_product_of_the_fake_quantized_operands(name):
  recipe = RECIPES[name]
  x, w = _data(shift=0.7 if "asym" in name or "plus" in name else 0.0)
  lp, rp = _params(recipe, x, w)
  y = np.asarray(_int(recipe, x, w, lp, rp), np.float64)
  xq, wq = _fake_quant(recipe, x, w, lp, rp)
  ref = np.asarray(xq, np.float64) @ np.asarray(wq, np.float64)
  np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("name", ["ste_tensor", "ste_asym8_group", "lsq4_plus"])
def test_int8_and_bf16_lowerings_agree_bit_for_bit(name):
  base = RECIPES[name]
  x, w = _data(shift=0.5)
  lp, rp = _params(base, x, w)
  ys = [_int(fl.IntRecipe(input=base.input, kernel=base.kernel, gemm=g), x, w, lp, rp)
        for g in ("int8", "bf16")]
  np.testing.assert_array_equal(ys[0], ys[1])


def test_the_forward_gemm_is_int8_by_int8_to_int32():
  recipe = fl.IntRecipe(kernel=Q(granularity="channel"), gemm="int8")
  x, w = _data()
  text = jax.jit(lambda x, w: _int(recipe, x, w, (jnp.zeros(2),), ())).lower(x, w).as_text()
  dots = [l for l in text.splitlines() if "dot_general" in l]
  assert any("xi8>, tensor<" in l and "xi32>" in l.split("->")[-1] for l in dots), dots


def test_auto_gemm_on_cpu_uses_exact_bf16_below_the_bound_and_int8_above():
  x_op = int_codes.Operand(cfg=Q(), role="input", contract=(1,))
  w_op = int_codes.Operand(cfg=Q(), role="kernel", contract=(0,))
  assert int_gemm.resolve_int_gemm("auto", 1024, x_op, w_op) == "bf16"  # 1024*128*128 = 2**24
  assert int_gemm.resolve_int_gemm("auto", 1025, x_op, w_op) == "int8"
  with fl.target_backend("gpu"):
    assert int_gemm.resolve_int_gemm("auto", 16, x_op, w_op) == "int8"
  with pytest.raises(ValueError, match=r"gemm='bf16' is not exact"):
    int_gemm.resolve_int_gemm("bf16", 4096, x_op, w_op)


def _residuals(f, *args):
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(f, *args)
  return [l.strip() for l in buf.getvalue().splitlines() if l.strip()]


def test_ste_backward_keeps_only_int8_codes_and_small_scales():
  recipe = RECIPES["ste_channel"]
  x, w = _data((64, 128), (128, 96))
  x = x.astype(jnp.bfloat16)
  res = _residuals(lambda x, w, r: _int(recipe, x, w, (r,), ()), x, w, jnp.zeros(2))
  big = [l for l in res if any(s in l for s in ("[64,128]", "[128,96]"))]
  assert sorted(l.split("[")[0] for l in big) == ["i8", "i8"], res
  small = [l for l in res if l not in big]
  assert all(np.prod([int(d) for d in l.split("[")[1].split("]")[0].split(",") if d]) <= 96
             for l in small), res


def test_lsq_backward_keeps_the_operands_and_no_float_fake_quant_copy():
  recipe = RECIPES["lsq8"]
  x, w = _data((64, 128), (128, 96))
  x = x.astype(jnp.bfloat16)
  lp, rp = _params(recipe, x, w)
  res = _residuals(lambda x, w, a, b: _int(recipe, x, w, (a,), (b,)), x, w, lp[0], rp[0])
  big = [l for l in res if any(s in l for s in ("[64,128]", "[128,96]"))]
  assert len(big) == 2 and all("from the argument" in l for l in big), res


@pytest.mark.parametrize("name", ["lsq8", "lsq4_plus", "lsq8_plus"])
def test_lsq_gradients_are_the_fake_quant_closed_forms(name):
  recipe = RECIPES[name]
  x, w = _data(shift=0.3)
  lp, rp = _params(recipe, x, w)
  r = jax.random.normal(jax.random.key(2), (8, 16))

  def new(x, w, lp, rp):
    return jnp.sum(_int(recipe, x, w, lp, rp) * r)

  def old(x, w, lp, rp):
    xq, wq = _fake_quant(recipe, x, w, lp, rp)
    return jnp.sum((xq @ wq) * r)

  g_new = jax.grad(new, argnums=(0, 1, 2, 3))(x, w, lp, rp)
  g_old = jax.grad(old, argnums=(0, 1, 2, 3))(x, w, lp, rp)
  for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
  assert any(float(np.abs(a).max()) > 0 for a in jax.tree.leaves(g_new[2]))


def test_ste_weight_gradient_passes_at_the_weights_own_extremes():
  # The range is the weight's own min/max, so no element is outside it: the
  # element that sets the range gets its gradient (float rounding of w / s
  # must not clip it).
  recipe = RECIPES["ste_channel"]
  x, w = _data()
  r = jax.random.normal(jax.random.key(2), (8, 16))
  dw = jax.grad(lambda w: jnp.sum(_int(recipe, x, w, (jnp.zeros(2),), ()) * r))(w)
  xq, _ = _fake_quant(recipe, x, w, (jnp.zeros(2),), ())
  np.testing.assert_allclose(dw, xq.T @ r, rtol=1e-5, atol=1e-5)
  assert np.all(np.abs(np.asarray(dw)) > 0)


def test_moving_average_observer_masks_the_clipped_elements():
  recipe = fl.IntRecipe(input=Q(observer="moving_average", momentum=0.5))
  x, w = _data()
  rng = jnp.array([0.5, 0.5])  # the EMA range stays narrower than this batch
  r = jnp.ones((8, 16))
  dx = jax.grad(lambda x: jnp.sum(_int(recipe, x, w, (rng,), ()) * r))(x)
  new, s, z = int_ops.observer_qparams(recipe.input, x, rng)
  v = np.asarray(x) / float(s) + float(z)
  outside = (v < recipe.input.qmin) | (v > recipe.input.qmax)
  assert outside.any() and (~outside).any()
  assert np.all(np.asarray(dx)[outside] == 0)
  assert np.all(np.asarray(dx)[~outside] != 0)


def test_observer_range_is_the_widest_of_two_uses():
  recipe = fl.IntRecipe()
  x, w = _data()

  def f(rng):
    y1, chain = int_product.int_dot_general(x, w, DN, recipe=recipe, input_params=(rng,))
    y2, _ = int_product.int_dot_general(3 * x, w, DN, recipe=recipe, input_params=(rng,),
                                        chain=chain)
    return jnp.sum(y1) + jnp.sum(y2)

  got = jax.grad(f)(jnp.zeros(2))
  np.testing.assert_allclose(got, [3 * -float(x.min()), 3 * float(x.max())], rtol=1e-6)


def test_conv_on_codes_matches_the_fake_quantized_float_conv():
  recipe = fl.IntRecipe(kernel=Q(granularity="channel"), gemm="int8")
  x = jax.random.normal(jax.random.key(0), (2, 9, 9, 4))
  w = jax.random.normal(jax.random.key(1), (3, 3, 4, 6))
  cdn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
  conv = int_gemm.conv_static(4, dict(window_strides=(2, 1), padding="SAME"), cdn)
  rng = jnp.zeros(2)
  y, _ = int_product.int_conv_general_dilated(x, w, conv, recipe=recipe, input_params=(rng,))
  xq = int_ops.observed_fake_quant(x, rng, cfg=recipe.input)[0]
  view, axes = int_numerics.int_view(w, (0, 1, 2), recipe.kernel)
  wq = int_ops.minmax_fake_quant(view, axes, recipe.kernel)
  ref = lax.conv_general_dilated(np.asarray(xq, np.float64), np.asarray(wq, np.float64), (2, 1),
                                 "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  text = jax.jit(lambda x, w: int_product.int_conv_general_dilated(
      x, w, conv, recipe=recipe, input_params=(rng,))[0]).lower(x, w).as_text()
  assert any("convolution" in l and "xi8>" in l and "xi32>" in l for l in text.splitlines())
  assert not int_gemm.conv_supported(fl.int4_lsq_plus())


def test_jit_vmap_and_remat_give_the_eager_gradients():
  recipe = RECIPES["lsq8"]
  x, w = _data()
  lp, rp = _params(recipe, x, w)
  f = lambda x, w: jnp.sum(_int(recipe, x, w, lp, rp) ** 2)
  ref = jax.grad(f, argnums=(0, 1))(x, w)
  for g in (jax.jit(jax.grad(f, argnums=(0, 1))), jax.grad(jax.checkpoint(f), argnums=(0, 1))):
    for a, b in zip(g(x, w), ref):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  ys = jax.vmap(lambda xb: _int(recipe, xb, w, lp, rp))(x.reshape(2, 4, 32))
  np.testing.assert_allclose(ys.reshape(8, 16), _int(recipe, x, w, lp, rp), rtol=1e-6)


def test_empty_batch_is_zero_and_leaves_the_range():
  recipe = fl.IntRecipe()
  _, w = _data()
  rng = jnp.array([1.0, 2.0])
  x = jnp.zeros((0, 32))
  y = _int(recipe, x, w, (rng,), ())
  assert y.shape == (0, 16)
  d_rng = jax.grad(lambda r: jnp.sum(_int(recipe, x, w, (r,), ())))(rng)
  np.testing.assert_array_equal(d_rng, rng)


def test_bad_input_names_the_argument():
  x, w = _data()
  with pytest.raises(ValueError, match="input_params"):
    _int(fl.IntRecipe(), x, w, (), ())
  with pytest.raises(ValueError, match="kernel_params"):
    _int(fl.int8_lsq(), x, w, (jnp.ones(()),), ())
  with pytest.raises(TypeError, match="lhs"):
    _int(fl.IntRecipe(), x.astype(jnp.int32), w, (jnp.zeros(2),), ())
  with pytest.raises(ValueError, match="input.*kernel"):
    _int(fl.IntRecipe(input=None), x, w, (), ())
  with pytest.raises(ValueError, match="gemm"):
    fl.IntRecipe(gemm="int4")


def _np_rows(t, axis, qmax=127):
  s = np.abs(t).max(axis=axis, keepdims=True) / qmax
  s = np.where(s > 0, s, 1.0)
  return np.clip(np.round(t / s), -qmax, qmax) * s


def test_integer_gradients_are_the_products_of_row_and_column_quantized_gradients():
  base = RECIPES["ste_channel"]
  recipe = fl.IntRecipe(input=base.input, kernel=base.kernel, grad_bits=8, gemm="int8")
  x, w = _data()
  r = jax.random.normal(jax.random.key(2), (8, 16))
  rng = jnp.zeros(2)
  dx, dw = jax.grad(lambda x, w: jnp.sum(_int(recipe, x, w, (rng,), ()) * r), argnums=(0, 1))(x, w)
  # Reference another way: numpy, float64, the fake-quantized operands.
  xq, wq = (np.asarray(t, np.float64) for t in _fake_quant(base, x, w, (rng,), ()))
  s_w = np.abs(np.asarray(w, np.float64)).max(axis=0, keepdims=True) / 127
  r64 = np.asarray(r, np.float64)
  ref_dx = _np_rows(r64 * s_w, axis=1) @ (wq / s_w).T
  ref_dw = xq.T @ _np_rows(r64, axis=0)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-5)
  # ... and not the float gradients: the gradient really was quantized.
  assert not np.allclose(dw, xq.T @ r64, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(dw, xq.T @ r64, rtol=0.05, atol=0.05)


def test_integer_gradients_run_three_int8_gemms():
  recipe = fl.IntRecipe(kernel=Q(granularity="channel"), grad_bits=8, gemm="int8")
  x, w = _data()
  f = jax.grad(lambda x, w: jnp.sum(_int(recipe, x, w, (jnp.zeros(2),), ()) ** 2), argnums=(0, 1))
  text = jax.jit(f).lower(x, w).as_text()
  dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
  assert len(dots) == 3 and all(l.count("xi8>") == 2 for l in dots), dots


def test_stochastic_rounding_of_gradient_codes_is_unbiased():
  """floor(t / s + u) averages to t / s over the noise; round to nearest keeps its error."""
  t = jnp.asarray(np.random.default_rng(4).normal(size=(4, 64)), jnp.float32)
  u = jax.random.uniform(jax.random.key(0), (2000, 4, 64))
  codes, s = jax.vmap(lambda n: int_product._int_rows(t, (1,), 7, n))(u)
  mean = jnp.mean(codes.astype(jnp.float32), axis=0) * s[0]
  rtn, s_rtn = int_product._int_rows(t, (1,), 7)
  rtn_err = float(jnp.max(jnp.abs(rtn * s_rtn - t)))
  assert float(jnp.max(jnp.abs(mean - t))) < 0.15 * rtn_err
  assert rtn_err > 0.3 * float(jnp.max(s_rtn))  # 3-bit codes: RTN is visibly off somewhere
  assert np.all(np.abs(np.asarray(codes, np.int32)) <= 7)


def test_integer_gradients_round_stochastically_when_asked():
  base = RECIPES["ste_channel"]
  rtn = fl.IntRecipe(input=base.input, kernel=base.kernel, grad_bits=8, gemm="int8")
  sr = dataclasses.replace(rtn, grad_stochastic_rounding=True)
  x, w = _data()
  r = jax.random.normal(jax.random.key(2), (8, 16))
  rng = jnp.zeros(2)

  def grads(recipe):
    f = lambda x, w: jnp.sum(_int(recipe, x, w, (rng,), ()) * r)
    return jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
  (dx_n, dw_n), (dx_s, dw_s), again = grads(rtn), grads(sr), grads(sr)
  np.testing.assert_array_equal(dw_s, again[1])  # reproducible: the seed is the step's scales
  assert not np.array_equal(dw_s, dw_n) and not np.array_equal(dx_s, dx_n)
  xq, _ = (np.asarray(t, np.float64) for t in _fake_quant(base, x, w, (rng,), ()))
  np.testing.assert_allclose(dw_s, xq.T @ np.asarray(r, np.float64), rtol=0.05, atol=0.05)
  text = jax.jit(jax.grad(lambda x, w: jnp.sum(_int(sr, x, w, (rng,), ()) ** 2),
                          argnums=(0, 1))).lower(x, w).as_text()
  dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
  assert len(dots) == 3 and all(l.count("xi8>") == 2 for l in dots), dots


def test_grad_bits_needs_symmetric_grids():
  with pytest.raises(ValueError, match="grad_bits"):
    fl.IntRecipe(grad_bits=8, kernel=Q(granularity="group", group_size=4))
  with pytest.raises(ValueError, match="grad_bits"):
    fl.IntRecipe(grad_bits=8, input=Q(symmetric=False))
  with pytest.raises(ValueError, match="grad_bits"):
    fl.IntRecipe(grad_bits=9)
  with pytest.raises(ValueError, match=r"grad_stochastic_rounding=True.*needs grad_bits"):
    fl.IntRecipe(grad_stochastic_rounding=True)


# ----------------------------------------------------------------------------
# compute_dtype='auto': the gradient GEMMs in the activations' dtype


def _conv_case(dtype):
  x = jax.random.normal(jax.random.key(0), (2, 9, 9, 4)).astype(dtype)
  w = (0.3 * jax.random.normal(jax.random.key(1), (3, 3, 4, 6))).astype(dtype)
  cdn = lax.conv_dimension_numbers(x.shape, w.shape, ("NHWC", "HWIO", "NHWC"))
  conv = int_gemm.conv_static(4, dict(window_strides=(2, 1), padding="SAME"), cdn)
  r = jax.random.normal(jax.random.key(2), (2, 5, 9, 6))
  return x, w, conv, r


def _conv_grads(recipe, x, w, conv, r):
  rng = jnp.zeros(2)
  f = lambda x, w: jnp.sum(int_product.int_conv_general_dilated(
      x, w, conv, recipe=recipe, input_params=(rng,))[0].astype(jnp.float32) * r)
  return f, jax.grad(f, argnums=(0, 1))


# float16 activations get float32 GEMMs; the output gradient fed to them is
# the model's float16 cotangent widened exactly.
@pytest.mark.parametrize("name", ["ste_channel", "lsq8"])
@pytest.mark.parametrize("dtype,want", [(jnp.bfloat16, ("bfloat16", "bfloat16")),
                                        (jnp.float32, ("float32", "float32")),
                                        (jnp.float16, ("float16", "float32"))])
def test_auto_runs_both_gradient_gemms_in_the_activations_dtype(name, dtype, want,
                                                                float_gemm_dtypes):
  recipe = dataclasses.replace(RECIPES[name], compute_dtype="auto")
  x, w = (t.astype(dtype) for t in _data())
  lp, rp = _params(recipe, x, w)
  r = jax.random.normal(jax.random.key(2), (8, 16))
  f = lambda x, w: jnp.sum(_int(recipe, x, w, lp, rp).astype(jnp.float32) * r)
  # The forward multiplies codes (left out); dgrad and wgrad remain.
  got = float_gemm_dtypes(jax.grad(f, argnums=(0, 1)), x, w)
  assert [tuple(sorted(p)) for p in got] == [want] * 2, got


@pytest.mark.parametrize("dtype,want", [(jnp.bfloat16, "bfloat16"), (jnp.float32, "float32")])
def test_auto_runs_the_gradient_convolutions_in_the_activations_dtype(dtype, want,
                                                                     float_gemm_dtypes):
  x, w, conv, r = _conv_case(dtype)
  _, grad = _conv_grads(fl.IntRecipe(kernel=Q(granularity="channel")), x, w, conv, r)
  got = float_gemm_dtypes(grad, x, w)
  assert len(got) >= 2 and set(got) == {(want, want)}, got


def _np_lsq(t, step, g_hat, cfg, grad_scale, axes):
  """LSQ's ``(dt, d_step)`` in float64 (Esser et al.), given ``g_hat = dL/dt_hat``."""
  v = t / step
  below, above = v < cfg.qmin, v > cfg.qmax
  ds = np.where(below, cfg.qmin, np.where(above, cfg.qmax, np.round(v) - v))
  return (np.where(below | above, 0.0, g_hat),
          np.sum(g_hat * ds, axis=axes, keepdims=True) * grad_scale)


@pytest.mark.parametrize("name", ["ste_channel", "lsq8"])
def test_bf16_gradients_under_auto_are_pinned_bf16_ones_and_close_to_float64(name):
  base = RECIPES[name]
  x, w = (t.astype(jnp.bfloat16) for t in _data(shift=0.3))
  lp, rp = _params(base, x, w)
  r = jax.random.normal(jax.random.key(2), (8, 16))

  def grads(compute_dtype):
    recipe = dataclasses.replace(base, compute_dtype=compute_dtype)
    f = lambda x, w, lp, rp: jnp.sum(_int(recipe, x, w, lp, rp).astype(jnp.float32) * r)
    return jax.grad(f, argnums=(0, 1, 2, 3))(x, w, lp, rp)

  auto = grads("auto")
  for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(grads("bfloat16")), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  # float64 reference: the fake-quantized operands, the GEMMs and LSQ's closed forms.
  xq, wq = (np.asarray(t, np.float64) for t in _fake_quant(base, x, w, lp, rp))
  r64 = np.asarray(r, np.float64)
  dxq, dwq = r64 @ wq.T, xq.T @ r64
  if base.input.learned:
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    dx, dsx = _np_lsq(x64, float(lp[0]), dxq, base.input, 0.1, (0, 1))
    dw, dsw = _np_lsq(w64, np.asarray(rp[0], np.float64), dwq, base.kernel, 0.2, (0,))
    refs = (dx, dw, dsx.reshape(()), dsw)
  else:
    refs = (dxq, dwq)
  got = [auto[0], auto[1]] + ([auto[2][0], auto[3][0]] if base.input.learned else [])
  for a, ref in zip(got, refs, strict=True):
    # bf16 operands (2**-9 relative each) and, for STE, bf16 outputs.
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(a, np.float64), ref, rtol=2 ** -6, atol=2 ** -6 * scale)


def test_bf16_conv_gradients_under_auto_are_pinned_bf16_ones_and_close_to_float64():
  x, w, conv, r = _conv_case(jnp.bfloat16)
  base = fl.IntRecipe(kernel=Q(granularity="channel"))
  auto = _conv_grads(base, x, w, conv, r)[1](x, w)
  pinned = _conv_grads(dataclasses.replace(base, compute_dtype="bfloat16"), x, w, conv, r)[1](x, w)
  for a, b in zip(auto, pinned, strict=True):
    np.testing.assert_array_equal(a, b)
  xq = int_ops.observed_fake_quant(x, jnp.zeros(2), cfg=base.input)[0]
  view, axes = int_numerics.int_view(w, (0, 1, 2), base.kernel)
  wq = int_ops.minmax_fake_quant(view, axes, base.kernel)
  with jax.enable_x64(True):
    f64 = lambda a, b: lax.conv_general_dilated(a, b, (2, 1), "SAME",
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))
    _, vjp = jax.vjp(f64, jnp.asarray(xq, jnp.float64), jnp.asarray(wq, jnp.float64))
    refs = [np.asarray(t) for t in vjp(jnp.asarray(r, jnp.float64))]
  for a, ref in zip(auto, refs, strict=True):
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(a, np.float64), ref, rtol=2 ** -6, atol=2 ** -6 * scale)


@pytest.mark.parametrize("name", list(RECIPES))
def test_f32_products_under_auto_are_the_pinned_float32_ones_bit_for_bit(name):
  base = RECIPES[name]
  x, w = _data(shift=0.3)
  lp, rp = _params(base, x, w)
  r = jax.random.normal(jax.random.key(2), (8, 16))

  def run(compute_dtype):
    recipe = dataclasses.replace(base, compute_dtype=compute_dtype)
    f = lambda x, w, lp, rp: jnp.sum(_int(recipe, x, w, lp, rp) * r)
    return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, w, lp, rp)

  for a, b in zip(jax.tree.leaves(run("auto")), jax.tree.leaves(run("float32")), strict=True):
    np.testing.assert_array_equal(a, b)


def test_f32_conv_under_auto_is_the_pinned_float32_one_bit_for_bit():
  x, w, conv, r = _conv_case(jnp.float32)
  base = fl.IntRecipe(kernel=Q(granularity="channel"))
  runs = [_conv_grads(dataclasses.replace(base, compute_dtype=c), x, w, conv, r)
          for c in ("auto", "float32")]
  for a, b in zip(*(jax.tree.leaves((f(x, w), g(x, w))) for f, g in runs), strict=True):
    np.testing.assert_array_equal(a, b)


def test_resolve_compute_dtype():
  res = lambda c, a: int_gemm.resolve_compute_dtype(c, a).name
  assert [res("auto", a) for a in (jnp.bfloat16, jnp.float32, jnp.float16, np.float64)] == [
      "bfloat16", "float32", "float32", "float32"]
  assert res("float32", jnp.bfloat16) == "float32" and res("bfloat16", jnp.float32) == "bfloat16"
  with pytest.raises(ValueError, match=r"compute_dtype='f16'.*\['auto', 'float32', 'bfloat16'\]"):
    int_gemm.resolve_compute_dtype("f16", jnp.float32)


@pytest.mark.parametrize("observer", ["minmax", "moving_average"])
def test_the_tpu_observer_pass_is_the_two_reductions(observer):
  """Traced for a TPU the observer takes its min and max in one variadic reduce: the same range.

  Including a batch with a NaN or an Inf (the range keeps its old value), one of one sign only,
  and an old range that is empty (the batch's is taken as it is).
  """
  cfg = fl.IntQuantConfig(observer=observer)
  old = jnp.array([0.5, 2.0], jnp.float32)
  batches = [jnp.array([[1.0, -3.0], [2.0, 0.25]], jnp.bfloat16),
             jnp.array([[1.0, jnp.nan], [2.0, 0.25]]), jnp.array([-jnp.inf, 1.0]),
             jnp.array([0.1, 0.2, 0.3]), -jnp.arange(1.0, 9.0).reshape(2, 4)]
  step = jax.jit(lambda x, o: int_ops.observer_qparams(cfg, x, o))
  variadic = lambda x, o: ":2 = stablehlo.reduce(" in step.lower(x, o).as_text()
  for x in batches:
    for start in (old, jnp.zeros(2)):
      want = step(x, start)
      assert not variadic(x, start)  # on a CPU: two reductions
      with fl.target_backend("tpu"):
        got = step(x, start)
        assert variadic(x, start)     # one reduce, two results
      np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
      np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
