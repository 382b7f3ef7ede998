"""Block scaling (MXFP8, NVFP4) of all three GEMMs, on CPU.

* NVFP4's numerics against a NumPy / ml_dtypes reference: e4m3 block scales,
  e2m1 codes, the per-tensor factor, 16x16 weight tiles, the random Hadamard
  transform and stochastic rounding of the gradient;
* the block-scaled form (the codes and scales handed to a block-scaled GEMM:
  ``jax.nn.scaled_matmul`` on a GPU, XLA's ``scaled_dot`` composite here) and
  the emulation (the same codes dequantized into the layer's own
  ``dot_general``) give the same output and gradients;
* traced for a Blackwell GPU, every product is ``scaled_matmul``.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import block_numerics, lowering, randomness

E2M1, E4M3 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn
DN = (((1,), (0,)), ((), ()))
PLAIN_NV = fl.nvfp4(kernel_2d_blocks=False, wgrad_hadamard=0, grad_stochastic_rounding=False)


def _st(n=4):
  return fl.RoleState(jnp.ones((1,)), jnp.zeros((n,)))


def _product(recipe, dn=DN, grad_state=None):
  def f(x, w):
    return fl.fp8_dot_general(x, w, dn, input_state=_st(), kernel_state=_st(),
                               output_grad_state=grad_state or _st(), recipe=recipe)[0]
  return f


def _run(recipe, x, w, g, dn=DN, grad_state=None):
  y, vjp = jax.vjp(jax.jit(_product(recipe, dn, grad_state)), x, w)
  return (y, *vjp(g))


# Jitted: op by op, the transform and the noise cost a compile per operation and shape.
_random_hadamard = jax.jit(randomness.random_hadamard, static_argnums=1)
_uniform_noise = jax.jit(randomness.uniform_noise, static_argnums=(0, 2))


def _data(seed, m, k, n):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(m, k)) * np.exp(rng.normal(size=(m, 1)))).astype(np.float32)
  w = (rng.normal(size=(k, n)) * np.exp(rng.normal(size=(1, n)))).astype(np.float32)
  g = (rng.normal(size=(m, n)) * np.exp(rng.normal(size=(m, 1)))).astype(np.float32)
  return x, w, g


# --- a NumPy reference of NVFP4 ----------------------------------------------


def _tensor_factor(t):
  """NVFP4's per-tensor factor with current scaling, in float32 as the library forms it."""
  a = np.float32(np.abs(np.asarray(t, np.float32)).max())
  return np.float32(np.float32(a / np.float32(6.0)) / np.float32(448.0))


def _nv_ref(t, g, tile=False, u=None, four_over_six=False):
  """``t`` (R, C) in NVFP4 blocks of 16 along C (16x16 tiles), dequantized: q * s * g.

  float32 arithmetic (what the library computes) and ml_dtypes' casts; ``u``:
  uniform noise of the padded shape for stochastic rounding; ``four_over_six``:
  each block scaled to 4 or 6, whichever rounds to nearest with the smaller
  squared error (float64 here).
  """
  t = np.asarray(t, np.float32)
  r, c = t.shape
  rp, cp = (-(-r // 16) * 16 if tile else r), -(-c // 16) * 16
  tp = np.zeros((rp, cp), np.float32)
  tp[:r, :c] = t
  rows = 16 if tile else 1
  b = tp.reshape(rp // rows, rows, cp // 16, 16)
  a = np.abs(b).max(axis=(1, 3), keepdims=True)

  def candidate(top):
    d = np.minimum(a / np.float32(np.float32(top) * g), np.float32(448.0))
    s = d.astype(E4M3).astype(np.float32)
    den = s * g
    y = np.clip(np.where(den > 0, b / np.where(den > 0, den, 1), 0), -6, 6).astype(np.float32)
    err = ((y.astype(E2M1).astype(np.float64) * den - b) ** 2).sum(axis=(1, 3), keepdims=True)
    return s, den, y, err
  s, den, y, err = candidate(6.0)
  if four_over_six:
    s4, den4, y4, err4 = candidate(4.0)
    four = err4 < err
    s, den, y = np.where(four, s4, s), np.where(four, den4, den), np.where(four, y4, y)
  if u is None:
    q = y.astype(E2M1).astype(np.float64)
  else:
    ay = np.abs(y)
    step = np.where(ay < 2, 0.5, np.where(ay < 4, 1.0, 2.0))
    lo = np.floor(ay / step) * step
    up = u.reshape(b.shape) < (ay - lo) / step
    q = np.copysign(np.minimum(np.where(up, lo + step, lo), 6.0), y).astype(np.float64)
    assert np.all(q.astype(E2M1).astype(np.float64) == q)  # on the e2m1 grid
  out = (q * s.astype(np.float64) * np.float64(g)).reshape(rp, cp)
  return out[:r, :c]


@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("tile", [False, True])
@pytest.mark.parametrize("shape", [(8, 32), (20, 40)])  # (20, 40): padded blocks and tiles
def test_nvfp4_block_quantize_matches_numpy(tile, shape, four_over_six):
  rng = np.random.default_rng(1)
  t = (rng.normal(size=shape) * np.exp(3 * rng.normal(size=(shape[0], 1)))).astype(np.float32)
  t[0, :16] = 1e-12  # a block far below the tensor's amax: its e4m3 scale flushes to 0
  g = _tensor_factor(t)
  rp = -(-shape[0] // 16) * 16 if tile else shape[0]
  tp = jnp.pad(jnp.asarray(t), ((0, rp - shape[0]), (0, (-shape[1]) % 16)))
  # Jitted (op by op, each operation and shape costs a compile), as a training step runs it.
  q, s = jax.jit(lambda t: block_numerics.block_quantize(
      t, 16, jnp.float4_e2m1fn, tensor_scale=g, tile=tile, four_over_six=four_over_six))(tp)
  assert q.dtype == jnp.float4_e2m1fn and s.dtype == jnp.float8_e4m3fn
  dequantize = jax.jit(lambda q, s: block_numerics.block_dequantize(q, s, 16, jnp.float32))
  got = np.asarray(dequantize(q, s), np.float64) * np.float64(g)
  np.testing.assert_array_equal(got[:shape[0], :shape[1]],
                                _nv_ref(t, g, tile, four_over_six=four_over_six))
  assert np.all(got[0, :16] == 0)
  if tile:  # one scale per 16x16 tile, repeated on its rows
    sf = np.asarray(s.astype(jnp.float32))
    assert np.all(sf.reshape(-1, 16, sf.shape[-1]) == sf.reshape(-1, 16, sf.shape[-1])[:, :1])


def test_four_over_six_picks_the_scale_that_loses_less():
  """A block of 1, 2, 3, 4 is exact on the grid scaled to 4 (6's grid has no 4.5); the choice
  never loses more than scaling to 6, and on random data it loses less overall."""
  quant = jax.jit(functools.partial(block_numerics.block_quantize, block_size=16,
                                    dtype=jnp.float4_e2m1fn, tensor_scale=jnp.float32(1 / 448)),
                  static_argnames="four_over_six")
  exact = np.tile(np.array([1.0, 2.0, 3.0, 4.0], np.float32), 4)[None]
  for flag, scale in ((False, 4 / 6), (True, 1.0)):
    q, s = quant(jnp.asarray(exact), four_over_six=flag)
    assert float(s.astype(jnp.float32)[0, 0]) / 448 == pytest.approx(scale, rel=0.07)
  q, s = quant(jnp.asarray(exact), four_over_six=True)
  np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)) * 1.0, exact)
  rng = np.random.default_rng(3)
  t = jnp.asarray(rng.normal(size=(64, 256)).astype(np.float32))
  errs = {}
  for flag in (False, True):
    q, s = quant(t, four_over_six=flag)
    d = block_numerics.block_dequantize(q, s, 16, jnp.float32) / 448
    errs[flag] = np.square(np.asarray(d - t, np.float64)).reshape(64, 16, 16).sum(-1)
  assert np.all(errs[True] <= errs[False] * (1 + 1e-6))
  assert errs[True].sum() < 0.9 * errs[False].sum()  # about 16% less on Gaussian blocks
  with pytest.raises(ValueError, match="four_over_six are for e2m1"):
    block_numerics.block_quantize(t, 32, jnp.float8_e4m3fn, four_over_six=True)


def test_nvfp4_scale_saturates_and_nonfinite_blocks_get_a_nan_scale():
  t = np.array([[1.0] * 15 + [100.0], [np.nan] + [1.0] * 15, [np.inf] + [1.0] * 15], np.float32)
  q, s = block_numerics.block_quantize(jnp.asarray(t), 16, jnp.float4_e2m1fn,
                                       tensor_scale=jnp.float32(1e-3))  # too small: saturates
  sf = np.asarray(s.astype(jnp.float32))[:, 0]
  assert sf[0] == 448.0 and np.isnan(sf[1]) and np.isnan(sf[2])
  assert float(q[0, 15].astype(jnp.float32)) == 6.0  # the element saturates too


def _nv_gemm_ref(x, w, g, recipe):
  """y, dx, dw of one NVFP4 dense layer (x: (M, K), w: (K, N), g: (M, N)) in float64."""
  hada = recipe.wgrad_hadamard
  sr = recipe.grad_stochastic_rounding
  _nv = functools.partial(_nv_ref, four_over_six=recipe.four_over_six)
  g_x, g_w, g_g = _tensor_factor(x), _tensor_factor(w), _tensor_factor(g)
  xf = _nv(x, g_x)                                                # along K
  wf = _nv(w.T, g_w, tile=recipe.kernel_2d_blocks)                # (N, K) along K
  y = xf @ wf.T
  wd = (wf.T if recipe.kernel_2d_blocks else _nv(w, g_w))         # (K, N) along N
  pad16 = lambda n: n + (-n) % 16
  # The library's noise source, seeded by the gradient role's state (_st()).
  seed = randomness.bits_seed(*_st())
  u1 = None
  if sr:  # on the padded (1, M, Np) gradient
    u1 = np.asarray(_uniform_noise((1, g.shape[0], pad16(g.shape[1])), seed, 1))[0]
  dx = _nv(g, g_g, u=u1) @ wd.T
  rot = (lambda t: np.asarray(_random_hadamard(t, hada))) if hada else (lambda t: t)
  gt, xt = rot(g.T), rot(x.T)                                    # (N, M), (K, M)
  g_gt = _tensor_factor(gt) if hada else g_g
  g_xt = _tensor_factor(xt) if hada else g_x
  u2 = None
  if sr:  # on the padded (1, N, Mp) transposed gradient
    u2 = np.asarray(_uniform_noise((1, gt.shape[0], pad16(gt.shape[1])), seed, 2))[0]
  dw = (_nv(gt, g_gt, u=u2) @ _nv(xt, g_xt).T).T
  return y, dx, dw


@pytest.mark.parametrize("recipe", [PLAIN_NV, fl.nvfp4(), fl.nvfp4(four_over_six=True)],
                         ids=["plain", "nvidia-recipe", "four-over-six"])
def test_nvfp4_dense_layer_matches_numpy(recipe):
  x, w, g = _data(2, 40, 48, 24)  # blocks, tiles and Hadamard groups padded or partial
  got = _run(recipe, x, w, g)
  for a, b, name in zip(got, _nv_gemm_ref(x, w, g, recipe), ("y", "dx", "dw")):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-5,
                               atol=1e-6 * np.abs(b).max(), err_msg=name)


def test_random_hadamard_is_the_signed_sylvester_matrix_and_keeps_products():
  size = 16
  h = np.array([[1.0]])
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  mat = h * randomness.hadamard_signs(size)[None, :] / np.sqrt(size)  # H D / sqrt(n)
  np.testing.assert_allclose(mat @ mat.T, np.eye(size), atol=1e-12)
  rng = np.random.default_rng(3)
  a, b = rng.normal(size=(3, 40)), rng.normal(size=(5, 40))  # 2 groups + 8 left alone
  ra = np.asarray(_random_hadamard(a.astype(np.float32), size), np.float64)
  want = np.concatenate([(a[:, :32].reshape(3, 2, 16) @ mat.T).reshape(3, 32), a[:, 32:]], 1)
  np.testing.assert_allclose(ra, want, rtol=1e-5, atol=1e-6)
  rb = np.asarray(_random_hadamard(b.astype(np.float32), size), np.float64)
  np.testing.assert_allclose(ra @ rb.T, a @ b.T, rtol=1e-5, atol=1e-5)
  # It spreads an outlier over its group.
  spike = np.zeros((1, 16), np.float32)
  spike[0, 3] = 8.0
  np.testing.assert_allclose(np.abs(np.asarray(_random_hadamard(spike, 16))), 2.0)


def test_noise_is_uniform_fused_and_the_same_however_it_is_sharded():
  """Counter-based bits: uniform, distinct within a tensor, independent across seeds and salts,
  no generator op in the program, and on a mesh each device's part equals the whole's."""
  u = np.asarray(_uniform_noise((256, 512), jnp.uint32(12345), 1))
  assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
  hist, _ = np.histogram(u, bins=32)
  assert hist.min() > 0.9 * u.size / 32 and hist.max() < 1.1 * u.size / 32
  assert len(np.unique(u)) > 0.99 * u.size  # 24-bit values of a bijective hash
  for other in (np.asarray(_uniform_noise((256, 512), jnp.uint32(12346), 1)),
                np.asarray(_uniform_noise((256, 512), jnp.uint32(12345), 2)),
                u[:, ::-1]):
    assert abs(np.corrcoef(u.ravel(), other.ravel())[0, 1]) < 0.01
  assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01
  text = _uniform_noise.lower((64, 64), jnp.uint32(1), 1).compile().as_text()
  assert "rng" not in text and "threefry" not in text
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  sharded = jax.jit(randomness.uniform_noise, static_argnums=(0, 2),
                    out_shardings=jax.sharding.NamedSharding(
                        mesh, jax.sharding.PartitionSpec("a", "b")))((256, 512), jnp.uint32(12345), 1)
  np.testing.assert_array_equal(np.asarray(sharded), u)


def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
  y = jnp.asarray(np.linspace(-6, 6, 97), jnp.float32)
  grid = np.array(sorted({float(v) for v in np.arange(-6, 6.5, 0.5).astype(np.float32)
                          .astype(E2M1).astype(np.float32)}))
  n = 4000
  u = jax.random.uniform(jax.random.key(0), (n,) + y.shape)
  r = np.asarray(jax.vmap(lambda u: block_numerics.stochastic_round_e2m1(y, u))(u))
  lo = grid[np.searchsorted(grid, np.asarray(y), side="right") - 1]
  hi = grid[np.minimum(np.searchsorted(grid, np.asarray(y), side="left"), len(grid) - 1)]
  assert np.all((r == lo) | (r == hi))
  # The mean is y (unbiased); round-to-nearest is off by up to half a step.
  np.testing.assert_allclose(r.mean(0), np.asarray(y), atol=0.06)
  nearest = np.asarray(y.astype(jnp.float4_e2m1fn).astype(jnp.float32))
  assert np.abs(nearest - np.asarray(y)).max() >= 0.5


def test_stochastic_rounding_is_reproducible_and_differs_from_nearest():
  x, w, g = _data(4, 32, 32, 32)
  sr = fl.nvfp4(kernel_2d_blocks=False, wgrad_hadamard=0)
  a, b = _run(sr, x, w, g), _run(sr, x, w, g)
  for u, v in zip(a, b):
    np.testing.assert_array_equal(u, v)
  rtn = _run(PLAIN_NV, x, w, g)
  np.testing.assert_array_equal(a[0], rtn[0])      # the forward rounds to nearest
  assert np.abs(np.asarray(a[1]) - np.asarray(rtn[1])).max() > 0  # gradients do not
  assert np.abs(np.asarray(a[2]) - np.asarray(rtn[2])).max() > 0
  # The bits come from the layer's gradient state: the next step (another
  # amax in the history) draws other ones.
  later = fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)).at[0].set(0.7))
  c = _run(sr, x, w, g, grad_state=later)
  assert np.abs(np.asarray(c[1]) - np.asarray(a[1])).max() > 0


@pytest.mark.parametrize("tiles", [True, False])
def test_2d_weight_tiles_give_forward_and_dgrad_the_same_weight(tiles):
  """With x = g = I the forward returns the forward's weight and dgrad the dgrad's."""
  w = np.random.default_rng(5).normal(size=(32, 32)).astype(np.float32)
  eye = np.eye(32, dtype=np.float32)
  rec = dataclasses.replace(PLAIN_NV, kernel_2d_blocks=tiles)
  y, dx, _ = _run(rec, eye, w, eye)
  # Identical codes and scales; XLA may order the float32 scale products differently.
  diff = np.abs(np.asarray(y) - np.asarray(dx).T).max() / np.abs(np.asarray(y)).max()
  assert (diff < 1e-6) if tiles else (diff > 1e-2), diff


# --- emulated vs block-scaled --------------------------------------------------

CASES = {  # name: (lhs shape, rhs shape, dimension numbers)
    "dense": ((40, 96), (96, 24), DN),
    "batched": ((3, 20, 48), (3, 48, 40), (((2,), (1,)), ((0,), (0,)))),
    "two-contracting": ((6, 8, 16), (8, 16, 24), (((1, 2), (0, 1)), ((), ()))),
    "rhs-first": ((12, 64), (24, 64), (((1,), (1,)), ((), ()))),
}
RECIPES = {"mxfp8": fl.mx_block_scaling(), "mxfp8-8": fl.mx_block_scaling(8),
           "nvfp4": fl.nvfp4(), "nvfp4-plain": PLAIN_NV,
           "mxfp8-nvidia-techniques": dataclasses.replace(
               fl.mx_block_scaling(), kernel_2d_blocks=True, wgrad_hadamard=16,
               grad_stochastic_rounding=False)}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_and_block_scaled_forms_agree(case, recipe):
  ls, rs, dn = CASES[case]
  rng = np.random.default_rng(6)
  x = (rng.normal(size=ls) * np.exp(rng.normal(size=ls[:-1] + (1,)))).astype(np.float32)
  w = rng.normal(size=rs).astype(np.float32)
  y0 = jax.eval_shape(_product(RECIPES[recipe], dn), x, w)
  g = rng.normal(size=y0.shape).astype(np.float32)
  emulated = _run(dataclasses.replace(RECIPES[recipe], gemm="f32"), x, w, g, dn)
  scaled = _run(dataclasses.replace(RECIPES[recipe], gemm="block"), x, w, g, dn)
  for a, b, name in zip(emulated, scaled, ("y", "dx", "dw")):
    assert a.shape == b.shape and a.dtype == b.dtype
    # The same codes and scales: only the order of the float32 sums differs.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6 * float(np.abs(np.asarray(a)).max()), err_msg=name)
  # And the product is the float one, up to the format's rounding.
  ref = jax.lax.dot_general(x, w, dn)
  rel = float(jnp.linalg.norm(emulated[0] - ref) / jnp.linalg.norm(ref))
  assert rel < (0.2 if "nvfp4" in recipe else 0.06), rel


def test_bf16_emulation_is_the_default_off_blackwell_and_equals_f32_emulation():
  x, w, g = _data(7, 40, 64, 32)
  for rec in (fl.mx_block_scaling(), fl.nvfp4()):
    assert lowering.resolve_gemm(rec) == "bf16"
    a = _run(rec, x, w, g)
    b = _run(dataclasses.replace(rec, gemm="f32"), x, w, g)
    for u, v in zip(a, b):  # dequantization is exact in bf16; both accumulate in f32
      np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)


def _primitives(recipe, block_scaled):
  x, w, g = _data(8, 64, 64, 64)
  step = lambda x, w, g: (lambda y, vjp: (y, vjp(g)))(*jax.vjp(_product(recipe), x, w))
  with fl.target_backend("gpu", block_scaled=block_scaled):
    jaxpr = jax.jit(step).trace(x, w, g).jaxpr
  names = []

  def walk(j):
    for e in j.eqns:
      names.append(e.primitive.name)
      for p in e.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if hasattr(sub, "jaxpr"):
            walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)
  walk(jaxpr)
  return names


@pytest.mark.parametrize("recipe", [fl.mx_block_scaling(), fl.nvfp4(),
                                    fl.nvfp4(four_over_six=True)],
                         ids=["mxfp8", "nvfp4", "nvfp4-four-over-six"])
def test_traced_for_blackwell_every_product_is_scaled_matmul(recipe):
  names = _primitives(recipe, block_scaled=True)
  assert names.count("scaled_matmul_wrapper") == 3
  assert names.count("dot_general") == 0
  hopper = _primitives(recipe, block_scaled=False)
  assert hopper.count("scaled_matmul_wrapper") == 0 and hopper.count("dot_general") == 3


def test_resolve_gemm_picks_the_block_scaled_gemm_only_for_blackwell_formats():
  with fl.target_backend("gpu", block_scaled=True):
    assert lowering.resolve_gemm(fl.mx_block_scaling()) == "block"
    assert lowering.resolve_gemm(fl.nvfp4()) == "block"
    assert lowering.resolve_gemm(fl.mx_block_scaling(16)) == "bf16"  # cuDNN takes 32
    assert lowering.resolve_gemm(fl.Fp8Recipe()) == "fp8"
  with fl.target_backend("gpu"):
    assert lowering.resolve_gemm(fl.mx_block_scaling()) == "bf16"
  assert lowering.resolve_gemm(fl.nvfp4()) == "bf16"  # CPU
  with pytest.raises(ValueError, match="block_scaled=True needs backend='gpu'"):
    with fl.target_backend("tpu", block_scaled=True):
      pass


def test_a_real_blackwell_device_is_detected_from_its_compute_capability(monkeypatch):
  class Device:
    platform = "gpu"

    def __init__(self, cc):
      self.compute_capability = cc

  for cc, want in (("10.0", True), ("12.0", True), ("9.0", False), ("gfx942", False)):
    monkeypatch.setattr(jax, "devices", lambda cc=cc: [Device(cc)])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    lowering._device_has_block_scaled_gemms.cache_clear()  # pylint: disable=protected-access
    assert lowering.block_scaled_gemms() is want, cc
  lowering._device_has_block_scaled_gemms.cache_clear()  # pylint: disable=protected-access


# --- state, non-finite values, remat, layers ------------------------------------


def test_nvfp4_state_holds_the_per_tensor_scale_of_e2m1():
  m = fl.QDense(8, recipe=fl.nvfp4(scaling="delayed"))
  x = jnp.asarray(_data(9, 16, 32, 8)[0])
  # Jitted: op by op, a quantized backward costs seconds.
  v = jax.jit(m.init)(jax.random.key(0), x)
  g = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2)))(v)
  owg = g[fl.OWG]
  assert float(owg["input_amax_history"][0]) == pytest.approx(float(jnp.abs(x).max()))
  # The stored scale maps the amax to e2m1's largest value, 6.
  assert float(owg["input_scale"][0]) == pytest.approx(float(jnp.abs(x).max()) / 6, rel=1e-6)


def test_nvfp4_delayed_scale_comes_from_the_history():
  x, _, _ = _data(10, 16, 32, 16)
  w = np.eye(32, dtype=np.float32)  # y is x as quantized
  rec = fl.nvfp4(scaling="delayed", wgrad_hadamard=0, grad_stochastic_rounding=False)
  amax = float(np.abs(x).max())

  @jax.jit  # one program for the five histories: op by op, each product costs seconds
  def run(history_amax):
    st = fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)).at[0].set(history_amax))
    return fl.fp8_dot_general(x, w, DN, input_state=st, kernel_state=_st(),
                              output_grad_state=_st(), recipe=rec)[0]
  np.testing.assert_array_equal(run(amax), run(0.0))  # empty history: this step's amax
  # Another amax in the history gives other block scales (by a power of two
  # the e4m3 scales would only shift their exponents: 3x changes their rounding).
  assert np.abs(np.asarray(run(3 * amax)) - np.asarray(run(amax))).max() > 0
  # Half the amax: the tensor factor saturates the largest elements at half of it.
  assert np.abs(np.asarray(run(amax))).max() == pytest.approx(amax, rel=0.07)
  assert np.abs(np.asarray(run(amax / 2))).max() == pytest.approx(amax / 2, rel=1e-5)


@pytest.mark.parametrize("recipe", [fl.mx_block_scaling(8), fl.nvfp4()], ids=["mx", "nvfp4"])
def test_non_finite_inputs_reach_the_output(recipe):
  x, w, _ = _data(11, 8, 32, 8)
  for bad in (np.nan, np.inf):
    xb = x.copy()
    xb[2, 5] = bad
    y = np.asarray(jax.jit(_product(recipe))(xb, w))
    assert not np.all(np.isfinite(y[2])) and np.all(np.isfinite(np.delete(y, 2, 0)))


def test_remat_keeps_the_fp4_codes_exact():
  """The e2m1 codes are saved through remat as uint4 bits (never rounded by remat)."""
  model = fl.QDense(32, recipe=fl.nvfp4())
  x = jnp.asarray(_data(12, 16, 32, 32)[0]) * 100
  v = jax.jit(model.init)(jax.random.key(0), x)
  loss = lambda v: jnp.sum(model.apply(v, x) ** 2)
  policy = jax.checkpoint_policies.save_only_these_names(fl.CHECKPOINT_NAME)
  plain = jax.jit(jax.grad(loss))(v)
  remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(v)
  jax.tree.map(np.testing.assert_array_equal, plain, remat)


def test_block_recipe_validation_names_the_field_and_allowed_values():
  with pytest.raises(ValueError,
                     match=r"kernel_2d_blocks=True needs granularity='block'.*\[False\]"):
    fl.Fp8Recipe(kernel_2d_blocks=True)
  with pytest.raises(ValueError, match=r"wgrad_hadamard=12 must be 0 \(off\) or a power of two"):
    dataclasses.replace(fl.nvfp4(), wgrad_hadamard=12)
  with pytest.raises(ValueError, match=r"grad_stochastic_rounding=1 must be True or False"):
    dataclasses.replace(fl.nvfp4(), grad_stochastic_rounding=1)
  with pytest.raises(ValueError, match=r"gemm='fp8'.*\['auto', 'block', 'bf16', 'f32'\]"):
    dataclasses.replace(fl.nvfp4(), gemm="fp8")
  with pytest.raises(ValueError, match=r"gemm='block'.*granularity='tensor'"):
    fl.Fp8Recipe(gemm="block")
  with pytest.raises(ValueError, match=r"float4_e2m1fn.*e2m1 for all three roles"):
    dataclasses.replace(fl.nvfp4(), output_grad=fl.ScalingConfig(dtype="e5m2"))
  with pytest.raises(ValueError, match=r"float4_e2m1fn.*needs granularity='block'"):
    fl.Fp8Recipe(input=fl.ScalingConfig(dtype="e2m1"), kernel=fl.ScalingConfig(dtype="e2m1"),
                 output_grad=fl.ScalingConfig(dtype="e2m1"))
  with pytest.raises(ValueError, match=r"not an fp8 or fp4 format.*float4_e2m1fn"):
    fl.ScalingConfig(dtype="int4")
  with pytest.raises(ValueError, match=r"four_over_six=True needs NVFP4.*\[False\]"):
    dataclasses.replace(fl.mx_block_scaling(), four_over_six=True)
  with pytest.raises(ValueError, match=r"four_over_six=0 must be True or False"):
    dataclasses.replace(fl.nvfp4(), four_over_six=0)
  assert fl.load_recipe("nvfp4") == fl.nvfp4()
  four = fl.nvfp4(four_over_six=True)
  assert fl.recipe_from_dict(fl.recipe_to_dict(four)) == four
  assert fl.recipe_from_dict(fl.recipe_to_dict(fl.nvfp4())) == fl.nvfp4()


def test_qconv_refuses_block_recipes():
  """fp8 convolutions scale per tensor; the block granularities are refused by name."""
  conv = fl.QConv(8, (3, 3), recipe=fl.nvfp4())
  with pytest.raises(ValueError, match="granularity='block'"):
    conv.init(jax.random.key(0), jnp.ones((1, 6, 6, 16)))


def test_convert_serves_nvfp4_and_2d_tiles_as_their_forward():
  """Current scaling needs no history: even an untrained layer converts, served as evaluated."""
  x = jnp.asarray(_data(13, 4, 40, 8)[0])
  for recipe in (fl.nvfp4(), fl.nvfp4(four_over_six=True),
                 dataclasses.replace(fl.mx_block_scaling(), kernel_2d_blocks=True)):
    model = fl.QDense(24, recipe=recipe)
    v = jax.jit(model.init)(jax.random.key(0), x)
    served, sp = fl.convert(model, v, x)

    def frozen(v, x):
      with fl.frozen_quantizers():
        return model.apply(v, x)
    np.testing.assert_array_equal(np.asarray(jax.jit(served.apply)(sp, x)),
                                  np.asarray(jax.jit(frozen)(v, x)))


class Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.Dense(32, name=f"block{i}")(nn.gelu(x))
    return x


def test_high_precision_layers_keep_the_last_layers_out_of_nvfp4():
  rules = fl.high_precision_layers("block{i}", 3, last=1) + (fl.QuantizationRule(),)
  qm = fl.quantize_model(Stack(), fl.nvfp4(), rules=rules)
  v = jax.eval_shape(qm.init, jax.random.key(0), jnp.ones((4, 32)))  # the tree is what's checked
  assert sorted(v[fl.OWG]) == ["block0", "block1"]
  keep = fl.high_precision_layers("block{i}", 10, first=1, last=2)
  assert keep[0].module_path == "(?:.*/)?(?:block0|block8|block9)(?:/.*)?"
  assert fl.high_precision_layers("block{i}", 3, last=0) == ()
  with pytest.raises(ValueError, match=r"layer='block' must be a string with an '\{i\}'"):
    fl.high_precision_layers("block", 3)
  with pytest.raises(ValueError, match=r"first=2 \+ last=2 exceeds num_layers=3"):
    fl.high_precision_layers("block{i}", 3, first=2, last=2)


def test_high_precision_layers_match_nnx_paths():
  from flax import nnx  # pylint: disable=import-outside-toplevel

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
      for layer in self.layers:
        x = layer(x)
      return x

  net = fl.nnx.quantize_model(Net(nnx.Rngs(0)), fl.nvfp4(), rules=fl.high_precision_layers(
      "layers/{i}", 4, last=1) + (fl.QuantizationRule(),))
  kinds = [type(layer).__name__ for layer in net.layers]
  assert kinds == ["Linear"] * 4 and [type(l).__module__.startswith("fp8_linen")
                                      for l in net.layers] == [True, True, True, False]


@functools.lru_cache(maxsize=None)
def _trained_mlp(recipe_name):
  recipe = {"mx": fl.mx_block_scaling(), "nvfp4": fl.nvfp4()}[recipe_name]
  model = nn.Sequential([fl.QDense(64, recipe=recipe), nn.gelu, fl.QDense(8, recipe=recipe)])
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
  v = jax.jit(model.init)(jax.random.key(0), x)
  import optax  # pylint: disable=import-outside-toplevel
  state = fl.TrainState.create(apply_fn=model.apply, params=v, tx=optax.adam(3e-3))
  step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(
      lambda p: jnp.mean((s.apply_fn(p, x) - y) ** 2))(s.params)))
  evaluate = jax.jit(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))
  loss = lambda s: float(evaluate(s.params))
  first = loss(state)
  for _ in range(60):
    state = step(state)
  return first, loss(state)


@pytest.mark.parametrize("recipe_name", ["mx", "nvfp4"])
def test_a_block_scaled_mlp_trains(recipe_name):
  first, last = _trained_mlp(recipe_name)
  assert np.isfinite(last) and last < 0.7 * first


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_block_is_nan_and_the_others_unchanged(bad):
  """The finite check is per block (its amax), not per element: a NaN or Inf makes its block's
  codes NaN, and every other block is cast as if it were alone."""
  x = np.random.default_rng(5).normal(size=(4, 64)).astype(np.float32) * 100
  clean_mx, _ = block_numerics.mx_quantize(jnp.asarray(x), 1, 32, jnp.float8_e4m3fn)
  clean_tile, _ = block_numerics.block_quantize(jnp.asarray(x), 32, jnp.float8_e4m3fn)
  x[1, 40] = bad
  for q, clean in ((block_numerics.mx_quantize(jnp.asarray(x), 1, 32, jnp.float8_e4m3fn)[0],
                    clean_mx),
                   (block_numerics.block_quantize(jnp.asarray(x), 32, jnp.float8_e4m3fn)[0],
                    clean_tile)):
    q32, c32 = np.asarray(q, np.float32), np.asarray(clean, np.float32)
    assert np.all(np.isnan(q32[1, 32:]))
    keep = np.ones_like(q32, bool)
    keep[1, 32:] = False
    np.testing.assert_array_equal(q32[keep], c32[keep])


@pytest.mark.parametrize("name", ["float4_e2m1fn", "float8_e8m0fnu", "float8_e4m3fn"])
def test_code_values_are_the_cast_on_every_code(name):
  """Block codes and scales read from their bits (what the emulated GEMMs multiply)."""
  dt = getattr(ml_dtypes, name)
  bits = jnp.arange(16, dtype=jnp.uint4) if name == "float4_e2m1fn" else jnp.arange(256,
                                                                                  dtype=jnp.uint8)
  codes = jax.lax.bitcast_convert_type(bits, dt)
  got = np.asarray(block_numerics.code_values(codes))
  want = np.asarray(codes.astype(jnp.float32))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  ok = ~np.isnan(want)
  np.testing.assert_array_equal(got[ok], want[ok])
  np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_e2m1_round_is_the_casts_values():
  y = jnp.concatenate([jnp.linspace(-7.0, 7.0, 28001),
                       jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.2, -5.0])])
  got = np.asarray(block_numerics.e2m1_round(y))
  want = np.asarray(y.astype(jnp.float4_e2m1fn).astype(jnp.float32))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_mx_exponent_is_exact_at_and_around_powers_of_two(name):
  """ceil(log2(a / m)) from bits: a = m * 2**k gives k, one ulp above gives k + 1."""
  m = float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max)
  k = np.arange(-100, 100)
  at = (m * np.exp2(k.astype(np.float64))).astype(np.float32)
  above = np.nextafter(at, np.float32(np.inf))
  below = np.nextafter(at, np.float32(0))
  rng = np.random.default_rng(0)
  rand = np.abs(rng.normal(size=2000) * np.exp2(rng.integers(-100, 100, 2000))).astype(np.float32)
  a = np.concatenate([at, above, below, rand, [0.0, np.inf, np.nan]]).astype(np.float32)
  scale, e = block_numerics.mx_scale(jnp.asarray(a), m)
  # The reference in exact rational arithmetic.
  from fractions import Fraction
  def ref(v):
    if not np.isfinite(v) or v <= 0:
      return 0
    q = Fraction(max(float(v), 2.0 ** -126)) / Fraction(m)
    n = q.numerator.bit_length() - q.denominator.bit_length()   # 2**n close to q
    while Fraction(2) ** n < q:
      n += 1
    while Fraction(2) ** (n - 1) >= q:
      n -= 1
    return min(max(n, -126), 127)
  want = np.array([ref(v) for v in a])
  np.testing.assert_array_equal(np.asarray(e), want)
  np.testing.assert_array_equal(np.asarray(e)[:200], k)                # exactly m * 2**k
  np.testing.assert_array_equal(np.asarray(scale), np.exp2(want).astype(np.float32))


def test_stochastic_rounding_keeps_the_sign_of_zero():
  y = jnp.array([-0.2, -0.0, 0.1, -0.01])
  r = np.asarray(block_numerics.stochastic_round_e2m1(y, jnp.full((4,), 0.99)))
  np.testing.assert_array_equal(r, [0.0, 0.0, 0.0, 0.0])
  np.testing.assert_array_equal(np.signbit(r), [True, True, False, True])
