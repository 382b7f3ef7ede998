"""Every layer takes every recipe, and computes *that* recipe's numerics (or says why not).

Closeness to the float layer alone let a layer silently ignore its recipe, so
each layer x recipe output is also compared with a reference built another
way: operands quantized in NumPy with ml_dtypes casts (per tensor, per row /
channel, per MX block, per NVFP4 block or tile, or on the integer grid) and
multiplied in float64. The
inputs have rows of very different magnitudes, so the granularities differ.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_linen as fl

RECIPES = {
    "fp8_delayed": fl.Fp8Recipe(),
    "fp8_current": fl.current_scaling(),
    "fp8_rowwise": fl.rowwise_scaling(),
    "mx_block": fl.mx_block_scaling(),
    "nvfp4": fl.nvfp4(),
    "int8_ste": fl.IntRecipe(),
    "int8_lsq": fl.int8_lsq(),
    "int4_lsq_plus": fl.int4_lsq_plus(),
}

# Each layer computes x @ K where K is its kernel reshaped to (32, n_out).
LAYERS = {
    "QDense": (lambda r: fl.QDense(8, recipe=r), lambda: nn.Dense(8), (4, 32)),
    "QDenseGeneral": (lambda r: fl.QDenseGeneral((2, 4), recipe=r),
                      lambda: nn.DenseGeneral((2, 4)), (4, 32)),
    "QEinsum": (lambda r: fl.QEinsum((32, 8), "bk,kn->bn", recipe=r),
                lambda: nn.Einsum((32, 8), "bk,kn->bn"), (4, 32)),
    "QConv": (lambda r: fl.QConv(8, (3, 3), recipe=r), lambda: nn.Conv(8, (3, 3)), (2, 6, 6, 32)),
}

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def _uneven(shape):
  """Random input whose rows span four orders of magnitude."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=shape)
  rows = np.logspace(-2, 2, shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
  return jnp.asarray(x * rows, jnp.float32)


def _fp8(x, s):
  """x quantized to e4m3 with scale s (broadcast), dequantized, in float64."""
  x, s = np.asarray(x, np.float64), np.asarray(s, np.float64)
  q = np.clip(x / s, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(E4M3)
  return q.astype(np.float64) * s


def _scale(amax):
  amax = np.asarray(amax, np.float32)
  return np.where(amax > 0, amax / np.float32(E4M3_MAX), 1.0).astype(np.float32)


def _mx(x, axis):
  """MX blocks of 32 along ``axis`` with power-of-two scales (rounded up)."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  b = x.reshape(x.shape[:-1] + (-1, 32))
  amax = np.abs(b).max(-1, keepdims=True)
  s = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-38) / E4M3_MAX)), 1.0)
  q = np.clip(b / s, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(E4M3).astype(np.float64)
  return np.moveaxis((q * s).reshape(x.shape), -1, axis)


def _nvfp4(t, tile):
  """NVFP4 of t (R, C) along C: e4m3 scales per 16 (16x16 tiles), e2m1 codes, current tensor factor."""
  t = np.asarray(t, np.float32)
  g = np.float32(np.float32(np.abs(t).max() / np.float32(6.0)) / np.float32(448.0))
  r, c = t.shape
  rp = -(-r // 16) * 16 if tile else r
  tp = np.zeros((rp, c), np.float32)
  tp[:r] = t
  b = tp.reshape(rp // (16 if tile else 1), 16 if tile else 1, c // 16, 16)
  a = np.abs(b).max(axis=(1, 3), keepdims=True)
  s = np.minimum(a / np.float32(np.float32(6.0) * g), np.float32(448.0)).astype(
      ml_dtypes.float8_e4m3fn).astype(np.float32)
  den = s * g
  y = np.clip(np.where(den > 0, b / np.where(den > 0, den, 1), 0), -6, 6).astype(np.float32)
  q = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * s * np.float64(g)
  return q.reshape(rp, c)[:r]


def _int_fake(x, s, z, qmin, qmax):
  x = np.asarray(x, np.float64)
  return s * (np.clip(np.round(x / s) + z, qmin, qmax) - z)


def _lsq(x, step, offset, qmin, qmax):
  x = np.asarray(x, np.float64)
  return np.clip(np.round((x - offset) / step), qmin, qmax) * step + offset


def _reference(recipe_name, x, kernel, params):
  """The recipe's quantized x @ kernel (x: (M, 32), kernel: (32, N)) in float64."""
  x, k = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  if recipe_name in ("fp8_delayed", "fp8_current"):  # first step: scale from this amax
    xq = _fp8(x, _scale(np.abs(x).max()))
    kq = _fp8(k, _scale(np.abs(k).max()))
  elif recipe_name == "fp8_rowwise":
    xq = _fp8(x, _scale(np.abs(x).max(1, keepdims=True)))
    kq = _fp8(k, _scale(np.abs(k).max(0, keepdims=True)))
  elif recipe_name == "mx_block":
    xq, kq = _mx(x, 1), _mx(k, 0)
  elif recipe_name == "nvfp4":  # the weight in 16x16 tiles of its (out, in) view
    xq, kq = _nvfp4(x, tile=False), _nvfp4(k.T, tile=True).T
  elif recipe_name == "int8_ste":  # observer's first batch; kernel's own min/max
    sx = max(-x.min(), x.max(), 0) / 127
    sk = max(-k.min(), k.max(), 0) / 127
    xq, kq = _int_fake(x, sx, 0, -128, 127), _int_fake(k, sk, 0, -128, 127)
  elif recipe_name == "int8_lsq":
    xq = _lsq(x, float(params["input_step"][0]), 0.0, -128, 127)
    kq = _lsq(k, np.asarray(params["kernel_step"]).reshape(1, -1), 0.0, -128, 127)
  elif recipe_name == "int4_lsq_plus":
    xq = _lsq(x, float(params["input_step"][0]), float(params["input_offset"][0]), 0, 15)
    kq = _lsq(k, np.asarray(params["kernel_step"]).reshape(1, -1),
              np.asarray(params["kernel_offset"]).reshape(1, -1), 0, 15)
  else:
    raise AssertionError(recipe_name)
  return xq @ kq


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_layer_trains_with_recipe(layer_name, recipe_name):
  make_q, make_ref, shape = LAYERS[layer_name]
  recipe = RECIPES[recipe_name]
  x = _uneven(shape)
  q, ref = make_q(recipe), make_ref()
  if layer_name == "QConv" and recipe_name in ("fp8_rowwise", "mx_block", "nvfp4"):
    # Convolutions have per-tensor fp8 scales only; other granularities are refused.
    with pytest.raises(ValueError, match="granularity"):
      q.init(jax.random.key(0), x)
    return
  vq = q.init(jax.random.key(0), x)
  vr = ref.init(jax.random.key(0), x)
  # the flax twin's params are all there, with the same shapes (LSQ adds its step sizes)
  flat_q = {k: v.shape for k, v in jax.tree_util.tree_flatten_with_path(vq["params"])[0]}
  for path, leaf in jax.tree_util.tree_flatten_with_path(vr["params"])[0]:
    assert flat_q[path] == leaf.shape
  y = q.apply(vq, x)
  y_ref = ref.apply({"params": vr["params"]}, x)
  err = float(jnp.abs(y - y_ref).max() / jnp.abs(y_ref).max())
  bound = 0.35 if ("int4" in recipe_name or "nvfp4" in recipe_name) else 0.12
  assert err < bound, err  # quantized, but close to the float layer
  g = jax.jit(jax.grad(lambda v: jnp.sum(q.apply(v, x) ** 2)))(vq)
  for leaf in jax.tree.leaves(g):
    assert np.all(np.isfinite(np.asarray(leaf)))
  assert float(jnp.abs(g["params"]["kernel"]).max()) > 0


def _matmul_layer_output(layer_name, recipe_name, x):
  make_q, _, _ = LAYERS[layer_name]
  q = make_q(RECIPES[recipe_name])
  v = q.init(jax.random.key(0), x)
  y = np.asarray(q.apply(v, x), np.float64).reshape(x.shape[0], -1)
  params = v["params"]
  kernel = np.asarray(params["kernel"]).reshape(32, -1)
  bias = np.asarray(params.get("bias", np.zeros(kernel.shape[1]))).reshape(-1)
  return y, kernel, bias, params


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("layer_name", ["QDense", "QDenseGeneral", "QEinsum"])
def test_layer_computes_its_recipe(layer_name, recipe_name):
  x = _uneven((4, 32))
  y, kernel, bias, params = _matmul_layer_output(layer_name, recipe_name, x)
  want = _reference(recipe_name, x, kernel, params) + bias
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("layer_name", ["QDense", "QDenseGeneral", "QEinsum"])
def test_granularities_differ_on_uneven_rows(layer_name):
  x = _uneven((4, 32))
  outs = {r: _matmul_layer_output(layer_name, r, x)[0]
          for r in ("fp8_current", "fp8_rowwise", "mx_block")}
  for a, b in (("fp8_current", "fp8_rowwise"), ("fp8_current", "mx_block"),
               ("fp8_rowwise", "mx_block")):
    # the small-magnitude row is where per-tensor scaling loses precision
    assert np.abs(outs[a][0] - outs[b][0]).max() > 1e-4 * np.abs(outs[a][0]).max(), (a, b)


@pytest.mark.parametrize("recipe_name", ["fp8_current", "int8_ste"])
def test_conv_computes_its_recipe(recipe_name):
  x = _uneven((2, 6, 6, 32))
  q = fl.QConv(8, (3, 3), padding="VALID", use_bias=False, recipe=RECIPES[recipe_name])
  v = q.init(jax.random.key(0), x)
  y = np.asarray(q.apply(v, x), np.float64)
  k = np.asarray(v["params"]["kernel"], np.float64)
  xr = np.asarray(x, np.float64)
  if recipe_name == "fp8_current":
    xq, kq = _fp8(xr, _scale(np.abs(xr).max())), _fp8(k, _scale(np.abs(k).max()))
  else:
    sx, sk = max(-xr.min(), xr.max()) / 127, max(-k.min(), k.max()) / 127
    xq, kq = _int_fake(xr, sx, 0, -128, 127), _int_fake(k, sk, 0, -128, 127)
  # a VALID 3x3 convolution as a sum of shifted matmuls, in float64
  want = np.zeros(y.shape)
  for i in range(3):
    for j in range(3):
      want += xq[:, i:i + 4, j:j + 4, :] @ kq[i, j]
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
