"""fp8 granularity: row-wise and MX block scaling, against numpy/ml_dtypes references."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import block_numerics

E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
DN = (((1,), (0,)), ((), ()))


def _st(n=4):
  return fl.RoleState(jnp.ones((1,)), jnp.zeros((n,)))


def _dot(recipe, dn=DN):
  def f(x, w):
    return fl.fp8_dot_general(x, w, dn, input_state=_st(), kernel_state=_st(),
                               output_grad_state=_st(), recipe=recipe)[0]
  return f


def _cast(x, dtype):
  m = float(ml_dtypes.finfo(dtype).max)
  return np.clip(x, -m, m).astype(dtype).astype(np.float64)


def _rowq(x, axis, dtype):
  """numpy reference of per-row current quantization: (q, s) with x ~ q * s."""
  a = np.max(np.abs(x), axis=axis, keepdims=True).astype(np.float64)
  s = np.where(a > 0, a / float(ml_dtypes.finfo(dtype).max), 1.0).astype(np.float32)
  return _cast(x / s.astype(np.float64), dtype), s.astype(np.float64)


def _data(seed=0, m=16, k=64, n=8):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(m, k)) * np.exp(2 * rng.normal(size=(m, 1)))).astype(np.float32)
  w = (rng.normal(size=(k, n)) * np.exp(rng.normal(size=(1, n)))).astype(np.float32)
  g = rng.normal(size=(m, n)).astype(np.float32)
  return x, w, g


# --- recipe validation -------------------------------------------------------

def test_bad_granularity_recipes_name_field_and_allowed():
  with pytest.raises(ValueError, match=r"granularity='col'.*\['tensor', 'row', 'block'\]"):
    fl.Fp8Recipe(granularity="col")
  with pytest.raises(ValueError, match=r"Fp8Recipe.input.scaling='delayed'.*\['current'\]"):
    fl.Fp8Recipe(granularity="row")
  with pytest.raises(ValueError, match=r"gemm='fp8'.*block"):
    fl.Fp8Recipe(granularity="block", gemm="fp8",
                 input=fl.ScalingConfig(scaling="current"),
                 kernel=fl.ScalingConfig(scaling="current"))
  with pytest.raises(ValueError, match="block_size=0"):
    fl.Fp8Recipe(block_size=0)
  with pytest.raises(ValueError, match="e5m2 x e5m2"):
    fl.Fp8Recipe(input=fl.ScalingConfig(dtype="e5m2"), kernel=fl.ScalingConfig(dtype="e5m2"))
  with pytest.raises(ValueError, match="history_length=0"):
    fl.ScalingConfig(history_length=0)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fl.ScalingConfig(dtype="int8")
  # MX blocks every role's values this step (the gradient too: each gradient
  # GEMM blocks it along the axis it contracts), so a delayed scale has no use.
  with pytest.raises(ValueError, match=r"output_grad.scaling='delayed'.*\['current'\]"):
    dataclasses.replace(fl.mx_block_scaling(), output_grad=fl.ScalingConfig(scaling="delayed"))
  # NVFP4 keeps a per-tensor scale per role, which may be delayed.
  assert fl.nvfp4(scaling="delayed").output_grad.scaling == "delayed"


# --- row-wise -----------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True])
def test_rowwise_matches_reference(jit):
  x, w, g = _data()
  f = _dot(fl.rowwise_scaling())
  f = jax.jit(f) if jit else f
  y, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(g)
  qx, sx = _rowq(x, 1, E4)           # per row of x
  qw, sw = _rowq(w, 0, E4)           # per output channel of w
  y_ref = (qx @ qw) * sx * sw
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=2e-6, atol=1e-6 * np.abs(y_ref).max())
  # dgrad: the kernel's channel scale is folded into g before its per-row cast.
  g1 = g.astype(np.float64) * sw
  qg1, sg1 = _rowq(g1.astype(np.float32), 1, E5)
  dx_ref = (qg1 @ qw.T) * sg1
  np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max())
  # wgrad: the activation's row scale is folded into g before its per-column cast.
  g2 = g.astype(np.float64) * sx
  qg2, sg2 = _rowq(g2.astype(np.float32), 0, E5)
  dw_ref = (qx.T @ qg2) * sg2
  np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-5, atol=1e-5 * np.abs(dw_ref).max())
  # And all three are close to the exact float64 products.
  for got, exact in ((y, x.astype(np.float64) @ w), (dx, g @ w.T.astype(np.float64)),
                     (dw, x.T.astype(np.float64) @ g)):
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.08


def test_rowwise_keeps_tiny_rows_that_per_tensor_flushes():
  x, w, _ = _data(1)
  x[0] *= 1e-7  # a row ~1e7 times smaller than the others
  exact = x.astype(np.float64) @ w
  rel = lambda y: np.linalg.norm(np.asarray(y)[0] - exact[0]) / np.linalg.norm(exact[0])
  assert rel(jax.jit(_dot(fl.current_scaling()))(x, w)) > 0.3   # underflows in e4m3
  assert rel(jax.jit(_dot(fl.rowwise_scaling()))(x, w)) < 0.06


def test_rowwise_batched_dimension_numbers():
  rng = np.random.default_rng(2)
  x = rng.normal(size=(3, 5, 32)).astype(np.float32) * np.array([1e-3, 1.0, 1e3])[:, None, None]
  w = rng.normal(size=(3, 32, 4)).astype(np.float32)
  g = rng.normal(size=(3, 5, 4)).astype(np.float32)
  dn = (((2,), (1,)), ((0,), (0,)))
  y, (dx, dw) = jax.jit(lambda x, w, g: (lambda y, vjp: (y, vjp(g)))(
      *jax.vjp(_dot(fl.rowwise_scaling(), dn), x, w)))(x, w, g)
  qx, sx = _rowq(x, 2, E4)
  qw, sw = _rowq(w, 1, E4)
  y_ref = np.einsum("bmk,bkn->bmn", qx * sx, qw * sw)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-6 * np.abs(y_ref).max())
  assert dx.shape == x.shape and dw.shape == w.shape
  for got, exact in ((dx, np.einsum("bmn,bkn->bmk", g, w)), (dw, np.einsum("bmk,bmn->bkn", x, g))):
    for b in range(3):  # every batch entry, whatever its magnitude
      assert np.linalg.norm(got[b] - exact[b]) / np.linalg.norm(exact[b]) < 0.08


def test_rowwise_residuals_are_fp8_and_scale_vectors():
  x, w, _ = _data()
  _, vjp = jax.vjp(_dot(fl.rowwise_scaling()), jnp.asarray(x), jnp.asarray(w))
  leaves = [l for l in jax.tree.leaves(vjp) if hasattr(l, "dtype")]
  big = [l for l in leaves if l.size >= x.size // 2]
  assert big and all(l.dtype.itemsize == 1 for l in big)


# --- MX block -----------------------------------------------------------------

def _mxq(x, axis, bs=32, dtype=E4):
  """numpy reference of MX block quantization (no clipping; e = ceil(log2(amax/max)))."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  n = x.shape[-1]
  pad = (-n) % bs
  xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,))], -1).reshape(x.shape[:-1] + (-1, bs))
  a = np.abs(xp).max(-1, keepdims=True)
  e = np.where(a > 0, np.ceil(np.log2(np.maximum(a, 1e-300) / float(ml_dtypes.finfo(dtype).max))), 0)
  s = 2.0 ** e
  d = (_cast(xp / s, dtype) * s).reshape(x.shape[:-1] + (-1,))[..., :n]
  return np.moveaxis(d, -1, axis)


@pytest.mark.parametrize("k", [64, 40])  # 40: the last block is padded
def test_mx_quantize_reference_and_no_clipping(k):
  x = np.random.default_rng(k).normal(size=(6, k)).astype(np.float32) * 100
  q, s = block_numerics.mx_quantize(jnp.asarray(x), 1, 32, jnp.float8_e4m3fn)
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float8_e8m0fnu
  assert s.shape == (6, -(-k // 32))
  sf = np.asarray(s.astype(jnp.float32))
  np.testing.assert_array_equal(sf, 2.0 ** np.round(np.log2(sf)))   # powers of two
  d = np.asarray(block_numerics.mx_dequantize(q, s, 1, 32))
  np.testing.assert_array_equal(d, _mxq(x, 1))
  assert np.all(np.abs(d - x) <= np.abs(x) * 2.0 ** -4 + 1e-30)      # rounding only, no clip


@pytest.mark.parametrize("jit", [False, True])
def test_mx_block_dot_matches_reference(jit):
  """Each GEMM blocks its operands along the axis it contracts, the gradient included."""
  x, w, g = _data(3, m=48, k=96)
  rec = fl.mx_block_scaling()
  f = jax.jit(_dot(rec)) if jit else _dot(rec)
  y, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(g)
  xd, wd = _mxq(x, 1), _mxq(w, 0)          # forward: both along K
  np.testing.assert_allclose(np.asarray(y), xd @ wd, rtol=1e-5, atol=1e-6 * np.abs(xd @ wd).max())
  g_n, w_n = _mxq(g, 1), _mxq(w, 1)        # dgrad: g and w along N
  np.testing.assert_allclose(np.asarray(dx), g_n @ w_n.T, rtol=1e-4,
                             atol=1e-5 * np.abs(g_n @ w_n.T).max())
  g_m, x_m = _mxq(g, 0), _mxq(x, 0)        # wgrad: g and x along M
  np.testing.assert_allclose(np.asarray(dw), x_m.T @ g_m, rtol=1e-4,
                             atol=1e-5 * np.abs(x_m.T @ g_m).max())


# --- through the layers ---------------------------------------------------------

@pytest.mark.parametrize("recipe", [fl.rowwise_scaling(history_length=4),
                                    fl.mx_block_scaling(history_length=4)],
                         ids=["row", "block"])
@pytest.mark.parametrize("how", ["QDense", "Dense+Fp8DotGeneral"])
def test_layers_accept_fine_recipes(recipe, how):
  if how == "QDense":
    model = fl.QDense(8, recipe=recipe)
  else:
    model = nn.Dense(8, dot_general_cls=functools.partial(fl.Fp8DotGeneral, recipe=recipe))
  x, _, _ = _data(4, m=16, k=64, n=8)
  v = jax.jit(model.init)(jax.random.key(0), x)
  kernel = v["params"]["kernel"]
  ct = jnp.asarray(np.random.default_rng(5).normal(size=(16, 8)), jnp.float32)

  @jax.jit
  def run(v):
    y, grads = jax.value_and_grad(lambda v: jnp.sum(model.apply(v, x) * ct))(v)
    return model.apply(v, x), _dot(recipe)(x, v["params"]["kernel"]) + v["params"]["bias"], grads

  y, ref, grads = run(v)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)
  owg = jax.tree.leaves_with_path(grads[fl.OWG])
  hist = {jax.tree_util.keystr(p): np.asarray(l) for p, l in owg if "amax_history" in jax.tree_util.keystr(p)}
  # The monitoring histories record the global amaxes of this step.
  (h_in,) = [h for k, h in hist.items() if "input" in k]
  (h_k,) = [h for k, h in hist.items() if "kernel" in k]
  (h_g,) = [h for k, h in hist.items() if "output_grad" in k]
  assert h_in[0] == pytest.approx(np.abs(x).max())
  assert h_k[0] == pytest.approx(float(jnp.abs(kernel).max()))
  assert h_g[0] == pytest.approx(float(jnp.abs(ct).max()))
  assert np.all(h_in[1:] == 0)
  assert np.isfinite(np.asarray(grads["params"]["kernel"])).all()


def test_shared_fine_layer_takes_max_not_sum():
  rec = fl.rowwise_scaling(history_length=4)

  class Twice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
      d = fl.QDense(4, recipe=rec)
      return d(a) + d(b)

  a = np.ones((2, 8), np.float32)
  b = 3 * np.ones((2, 8), np.float32)
  m = Twice()
  v = jax.jit(m.init)(jax.random.key(0), a, b)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, a, b))))(v)
  assert float(grads[fl.OWG]["QDense_0"]["input_amax_history"][0]) == 3.0


def test_row_quantize_makes_only_a_non_finite_row_nan():
  """Row-wise codes: a row's amax is its finite check; the other rows keep their codes."""
  from fp8_linen.core import numerics
  from fp8_linen.recipes import ScalingConfig
  cfg = ScalingConfig(scaling="current")
  x = np.random.default_rng(6).normal(size=(3, 16)).astype(np.float32) * 1000
  clean, s_clean, a_clean = numerics.row_quantize(jnp.asarray(x), (1,), cfg)
  assert float(a_clean) == float(np.max(np.abs(x)))
  # Each row against an ml_dtypes cast of x / its own scale, clamped (float64 division).
  a = np.max(np.abs(x), axis=1, keepdims=True)
  s_ref = np.asarray(s_clean)
  ref = np.clip(x.astype(np.float64) / s_ref, -448, 448).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(clean, np.float32),
                                ref.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
  assert np.all(np.abs(np.asarray(clean, np.float32)).max(axis=1) == 448.0) and a.all()
  x[2, 3] = -np.inf
  q, s, _ = numerics.row_quantize(jnp.asarray(x), (1,), cfg)
  q = np.asarray(q, np.float32)
  assert np.all(np.isnan(q[2])) and np.all(np.isfinite(q[:2]))
  np.testing.assert_array_equal(q[:2], np.asarray(clean, np.float32)[:2])
  np.testing.assert_array_equal(np.asarray(s)[:2], np.asarray(s_clean)[:2])
