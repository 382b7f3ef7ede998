"""Tests for the custom_vjp ops in fp8_linen.ops (with and without jit)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import chex
import ml_dtypes
import numpy as np
import pytest
from flax.linen import fp8_ops

import fp8_linen as fl


E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
JIT = [False, True]


def maybe_jit(f, use_jit):
  return jax.jit(f) if use_jit else f


def np_qdq(x, dt, amax):
  """Reference fake-quant in numpy: scale amax/max, saturate, round, rescale."""
  m = float(ml_dtypes.finfo(dt).max)
  s = np.float32(amax) / np.float32(m)
  x = np.asarray(x, np.float32)
  return np.clip(x / s, -m, m).astype(dt).astype(np.float64) * np.float64(s)


def fresh(n=8):
  return fl.RoleState(jnp.ones((1,)), jnp.zeros((n,)))


# --------------------------------------------------------------- quantize pair

def qdq_pair(x, st):
  xq, s, _ = fl.quantize(x, st["is"], st["ih"])
  y, _ = fl.dequantize(xq, s, st["gs"], st["gh"], dtype=jnp.float32)
  return y


def pair_state(n=8):
  return {"is": jnp.ones((1,)), "ih": jnp.zeros((n,)), "gs": jnp.ones((1,)), "gh": jnp.zeros((n,))}


@pytest.mark.parametrize("use_jit", JIT)
def test_seed002_first_step_gradient_is_not_clipped(use_jit):
  # Value 5, cotangent 1000: a scale of 1 on an empty history would clip it to 448.
  f = lambda x, st: 1000.0 * qdq_pair(x, st)
  gx, gst = maybe_jit(jax.grad(f, argnums=(0, 1)), use_jit)(jnp.float32(5.0), pair_state())
  assert float(gx) == pytest.approx(1000.0, rel=2 ** -3)
  assert float(gx) != 448.0
  np.testing.assert_allclose(gst["gh"], [1000.0] + [0.0] * 7)
  np.testing.assert_allclose(gst["gs"], [1000.0 / 57344.0], rtol=1e-6)
  np.testing.assert_allclose(gst["ih"], [5.0] + [0.0] * 7)
  np.testing.assert_allclose(gst["is"], [5.0 / 448.0], rtol=1e-6)


@pytest.mark.parametrize("use_jit", JIT)
def test_pair_forward_is_e4m3_and_gradient_is_e5m2_with_smuggled_scale(use_jit):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(64,)) * 3, jnp.float32)
  ct = jnp.asarray(rng.normal(size=(64,)) * 50, jnp.float32)
  st = pair_state()
  y, vjp = jax.vjp(lambda x, st: qdq_pair(x, st), x, st)
  gx, gst = maybe_jit(vjp, use_jit)(ct)
  np.testing.assert_array_equal(np.asarray(y), np_qdq(x, E4, np.abs(x).max()).astype(np.float32))
  # dequantize's backward quantized the gradient to e5m2 with scale amax/57344
  # and quantize's backward dequantized it with exactly that scale.
  ref = np_qdq(ct, E5, np.abs(np.asarray(ct)).max())
  np.testing.assert_allclose(np.asarray(gx), ref, rtol=1e-6)
  assert float(gst["gh"][0]) == pytest.approx(float(jnp.abs(ct).max()))


def test_pair_second_step_uses_history():
  st = pair_state()
  # Jitted: op by op, each quantized step costs a second or more.
  st = jax.jit(jax.grad(lambda st: 10.0 * qdq_pair(jnp.float32(4.0), st)))(st)  # now [4], [10]
  x = jnp.float32(8.0)  # twice the recorded amax: delayed scaling clips to 4
  y, vjp = jax.vjp(lambda st: qdq_pair(x, st), st)
  assert float(y) == pytest.approx(4.0)
  (new,) = vjp(jnp.float32(40.0))
  np.testing.assert_allclose(new["ih"][:2], [8.0, 4.0])
  np.testing.assert_allclose(new["gh"][:2], [40.0, 10.0])
  np.testing.assert_allclose(new["is"], [4.0 / 448.0], rtol=1e-6)  # the scale used this step


@pytest.mark.parametrize("use_jit", JIT)
def test_nan_batch_does_not_poison_state(use_jit):
  st = pair_state()
  # The setup step jitted (op by op it costs a second); the step under test keeps its variant.
  st = jax.jit(jax.grad(lambda st: 10.0 * qdq_pair(jnp.float32(4.0), st)))(st)
  bad = jnp.array([1.0, jnp.nan, 2.0])
  g = maybe_jit(jax.grad(lambda st: jnp.sum(qdq_pair(bad, st))), use_jit)(st)
  for leaf in jax.tree.leaves(g):
    assert np.all(np.isfinite(np.asarray(leaf)))
  np.testing.assert_allclose(g["ih"][:2], [0.0, 4.0])  # NaN recorded as "nothing observed"
  np.testing.assert_allclose(g["is"], st["is"])


def test_pair_chain_takes_max_of_two_uses():
  def two_uses(x1, x2, st):
    a, s, c = fl.quantize(x1, st["is"], st["ih"])
    b, s2, _ = fl.quantize(x2, st["is"], st["ih"], chain=c)
    ya, d = fl.dequantize(a, s, st["gs"], st["gh"])
    yb, _ = fl.dequantize(b, s2, st["gs"], st["gh"], chain=d)
    return 7.0 * ya + 70.0 * yb

  g = jax.jit(jax.grad(two_uses, argnums=2))(jnp.float32(3.0), jnp.float32(30.0), pair_state())
  assert float(g["ih"][0]) == 30.0 and float(g["gh"][0]) == 70.0
  np.testing.assert_allclose(g["is"], [30.0 / 448.0], rtol=1e-6)
  assert float(g["ih"][1]) == 0.0


def test_quantize_rejects_bad_inputs():
  with pytest.raises(TypeError, match="floating"):
    fl.quantize(jnp.arange(3), jnp.ones((1,)), jnp.zeros((4,)))
  with pytest.raises(ValueError, match=r"input_scale must have shape \(1,\)"):
    fl.quantize(jnp.ones(3), jnp.ones((2,)), jnp.zeros((4,)))
  with pytest.raises(ValueError, match="output_grad_amax_history"):
    fl.dequantize(jnp.ones(3, jnp.float8_e4m3fn), jnp.ones((1,)), jnp.ones((1,)), jnp.zeros((2, 2)))


# --------------------------------------------------------------- fp8 dot_general

DN_MATMUL = (((1,), (0,)), ((), ()))


def dot(x, w, states, dn=DN_MATMUL, recipe=None, chain=None):
  return fl.fp8_dot_general(x, w, dn, input_state=states[0], kernel_state=states[1],
                             output_grad_state=states[2], recipe=recipe, chain=chain)


def rand(shape, seed, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, jnp.float32)


@pytest.mark.parametrize("use_jit", JIT)
@pytest.mark.parametrize("gemm", ["bf16", "f32", "fp8"])
def test_dot_matches_float64_straight_through_reference(use_jit, gemm):
  x, w, ct = rand((16, 32), 0, 2.0), rand((32, 24), 1, 0.1), rand((16, 24), 2, 10.0)
  recipe = fl.Fp8Recipe(gemm=gemm)
  states = (fresh(), fresh(), fresh())
  f = lambda x, w: dot(x, w, states, recipe=recipe)[0]
  y, vjp = jax.vjp(f, x, w)
  gx, gw = maybe_jit(vjp, use_jit)(ct)
  xq, wq = np_qdq(x, E4, np.abs(x).max()), np_qdq(w, E4, np.abs(w).max())
  gq = np_qdq(ct, E5, np.abs(ct).max())
  np.testing.assert_allclose(np.asarray(y), xq @ wq, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), gq @ wq.T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(gw), xq.T @ gq, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dn, xs, ws, eq", [
    ((((2,), (0,)), ((), ())), (2, 3, 8), (8, 5), "abk,kn->abn"),
    ((((2,), (1,)), ((0,), (0,))), (4, 3, 8), (4, 8, 5), "bmk,bkn->bmn"),
    ((((1, 2), (0, 1)), ((), ())), (3, 4, 8), (4, 8, 6), "mij,ijn->mn"),
    ((((0,), (1,)), ((), ())), (8, 3), (5, 8), "km,nk->mn"),
    ((((1,), (2,)), ((0,), (1,))), (4, 8, 3), (5, 4, 8), "bkm,nbk->bmn"),
])
def test_dot_general_dimension_numbers(dn, xs, ws, eq):
  x, w = rand(xs, 3), rand(ws, 4)
  states = (fresh(), fresh(), fresh())
  f = lambda x, w: dot(x, w, states, dn=dn)[0]
  ct = rand(jax.eval_shape(f, x, w).shape, 5)
  # Forward and backward in one jitted program: op by op, the forward costs seconds.
  y, (gx, gw) = jax.jit(lambda x, w, ct: (lambda y, vjp: (y, vjp(ct)))(*jax.vjp(f, x, w)))(
      x, w, ct)
  xq, wq = np_qdq(x, E4, np.abs(x).max()), np_qdq(w, E4, np.abs(w).max())
  gq = np_qdq(ct, E5, np.abs(ct).max())
  ref = lambda x, w: jnp.einsum(eq, x, w, precision="highest")
  y_ref, vjp_ref = jax.vjp(ref, jnp.asarray(xq, jnp.float32), jnp.asarray(wq, jnp.float32))
  gx_ref, gw_ref = vjp_ref(jnp.asarray(gq, jnp.float32))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, gw_ref, rtol=1e-5, atol=1e-5)


def test_dot_output_and_gradient_dtypes():
  x, w = rand((4, 8), 0).astype(jnp.bfloat16), rand((8, 3), 1)
  states = (fresh(), fresh(), fresh())
  # Dtypes only: traced with jax.eval_shape, nothing needs to run.
  def fwd_bwd(x, w):
    y, vjp = jax.vjp(lambda x, w: dot(x, w, states)[0], x, w)
    return y, vjp(jnp.ones_like(y))
  y, (gx, gw) = jax.eval_shape(fwd_bwd, x, w)
  assert y.dtype == jnp.float32  # result type of bf16 and f32
  assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
  y16, _ = jax.eval_shape(lambda x, w: fl.fp8_dot_general(
      x, w, DN_MATMUL, input_state=states[0], kernel_state=states[1],
      output_grad_state=states[2], out_dtype=jnp.bfloat16), x, w)
  assert y16.dtype == jnp.bfloat16


def test_dot_state_update_is_returned_as_gradient():
  x, w, ct = rand((8, 16), 0, 3.0), rand((16, 4), 1), rand((8, 4), 2, 5.0)
  states = (fresh(4), fresh(4), fresh(4))
  g = jax.jit(jax.grad(lambda s: jnp.sum(dot(x, w, s)[0] * ct)))(states)  # eager costs seconds
  for st, t in zip(g, (x, w, ct)):
    a = float(jnp.abs(t).max())
    assert float(st.amax_history[0]) == pytest.approx(a)
    assert float(jnp.sum(st.amax_history[1:])) == 0.0
  np.testing.assert_allclose(g[0].scale, [float(jnp.abs(x).max()) / 448.0], rtol=1e-6)
  np.testing.assert_allclose(g[2].scale, [float(jnp.abs(ct).max()) / 57344.0], rtol=1e-6)


def test_dot_chain_records_max_not_sum():
  x1, x2, w = rand((4, 8), 0, 1.0), rand((4, 8), 1, 10.0), rand((8, 3), 2)

  def f(states):
    y1, c = dot(x1, w, states)
    y2, _ = dot(x2, w, states, chain=c)
    return jnp.sum(y1 * 3.0) + jnp.sum(y2 * 30.0)

  g = jax.jit(jax.grad(f))(tuple(fresh(4) for _ in range(3)))  # eager costs seconds
  assert float(g[0].amax_history[0]) == pytest.approx(float(jnp.abs(x2).max()))
  assert float(g[1].amax_history[0]) == pytest.approx(float(jnp.abs(w).max()))  # not 2x
  assert float(g[2].amax_history[0]) == pytest.approx(30.0)
  np.testing.assert_allclose(g[1].scale, [float(jnp.abs(w).max()) / 448.0], rtol=1e-6)


def test_dot_residuals_are_fp8_copies_only():
  x, w = rand((32, 64), 0).astype(jnp.bfloat16), rand((64, 16), 1)
  states = (fresh(), fresh(), fresh())
  _, vjp = jax.vjp(lambda x, w: dot(x, w, states)[0], x, w)
  big = [r for r in jax.tree.leaves(vjp) if np.size(r) > 8]
  state_leaves = {id(l) for l in jax.tree.leaves(states)}
  # The fp8 copies, kept as their bytes (uint8): remat cannot round them, and
  # on a mesh the gradient GEMMs read the bytes the forward GEMM gathered.
  fp8 = [r for r in big if r.dtype == jnp.uint8]
  assert sorted(r.shape for r in fp8) == [(32, 64), (64, 16)]
  others = [r for r in big if r.dtype != jnp.uint8 and id(r) not in state_leaves]
  assert all(r.shape == (8,) for r in others), [(r.shape, r.dtype) for r in others]


def test_dot_errors_name_the_problem():
  states = (fresh(), fresh(), fresh())
  with pytest.raises(ValueError, match="does not match"):
    dot(jnp.ones((2, 3)), jnp.ones((4, 5)), states)
  with pytest.raises(TypeError, match="rhs must be a floating"):
    dot(jnp.ones((2, 3)), jnp.ones((3, 5), jnp.int32), states)
  with pytest.raises(ValueError, match="kernel_scale"):
    dot(jnp.ones((2, 3)), jnp.ones((3, 5)), (fresh(), fl.RoleState(jnp.ones(()), jnp.zeros(8)),
                                              fresh()))


def test_parity_with_flax_direct_fp8_op_on_representable_inputs():
  # Inputs exactly representable in e4m3, cotangent in e5m2, and histories whose
  # amax makes every scale exactly 1: both implementations are then exact.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(-8, 9, size=(8, 16)) * 0.5, jnp.float32)
  w = jnp.asarray(rng.integers(-8, 9, size=(16, 4)) * 0.25, jnp.float32)
  ct = jnp.asarray(rng.integers(-4, 5, size=(8, 4)), jnp.float32)
  hist = lambda m: jnp.zeros((1024,)).at[3].set(m)

  flax_layer = nn.Dense(4, use_bias=False, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
  ours = fl.QDense(4, use_bias=False)
  owg = {"input_scale": jnp.ones((1,)), "kernel_scale": jnp.ones((1,)),
         "output_grad_scale": jnp.ones((1,)), "input_amax_history": hist(448.0),
         "kernel_amax_history": hist(448.0), "output_grad_amax_history": hist(57344.0)}

  def run(layer, wrap):
    v = {"params": {"kernel": w}, fl.OWG: wrap(owg)}
    return jax.jit(jax.vjp, static_argnums=0)(lambda v, x: layer.apply(v, x), v, x)

  y_f, vjp_f = run(flax_layer, lambda o: {"Fp8DirectDotGeneralOp_0": o})
  y_o, vjp_o = run(ours, lambda o: o)
  np.testing.assert_array_equal(y_f, y_o)
  np.testing.assert_array_equal(y_o, np.asarray(x) @ np.asarray(w))
  (gv_f, gx_f), (gv_o, gx_o) = vjp_f(ct), vjp_o(ct)
  np.testing.assert_array_equal(gx_f, gx_o)
  np.testing.assert_array_equal(gv_f["params"]["kernel"], gv_o["params"]["kernel"])
  np.testing.assert_array_equal(gx_o, np.asarray(ct) @ np.asarray(w).T)
  for name in ("input_scale", "kernel_scale", "output_grad_scale"):
    np.testing.assert_array_equal(gv_f[fl.OWG]["Fp8DirectDotGeneralOp_0"][name],
                                  gv_o[fl.OWG][name])


class WeightGradientDtypeTest(chex.TestCase):
  """``rhs_grad_dtype``: the weight-gradient GEMM writes the parameter's dtype.

  Traced for a GPU (where the hint applies) and run here: XLA:GPU would drop
  the bfloat16 round trip (the compile-only proof is in tests/gpu and
  tests/targets/test_passes.py), XLA:CPU keeps it, so the gradient must be
  the bfloat16 rounding of the exact product: bit for bit the old one where
  the scales are powers of two, and never further than one bfloat16 step
  from it otherwise.
  """

  def _grads(self, variant, x, w, ct, states, wgrad):
    dn = (((1,), (0,)), ((), ()))

    @variant
    def grad(x, w):
      def f(w):
        y, _ = fl.fp8_dot_general(x, w.astype(jnp.bfloat16), dn, input_state=states[0],
                                  kernel_state=states[1], output_grad_state=states[2],
                                  rhs_grad_dtype=wgrad)
        return jnp.sum(y.astype(jnp.float32) * ct)
      return jax.grad(f)(w)

    with fl.target_backend("gpu"):
      return grad(x, w)

  @chex.variants(with_jit=True, without_jit=True)
  def test_the_gradient_is_the_bfloat16_rounding_of_the_exact_product(self):
    rng = np.random.default_rng(1)
    # Operands on the e4m3 grid, the cotangent on e5m2's, amaxes at the formats'
    # maxima: every scale is 1 and the codes are the values.
    x = jnp.asarray(rng.integers(-8, 9, size=(32, 16)) * 0.5, jnp.bfloat16).at[0, 0].set(448)
    w = jnp.asarray(rng.integers(-8, 9, size=(16, 8)) * 0.25, jnp.float32).at[0, 0].set(448)
    ct = jnp.asarray(rng.integers(-4, 5, size=(32, 8)) * 2.0, jnp.float32).at[0, 0].set(57344)
    st = lambda a: fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)).at[0].set(a))
    states = (st(448.0), st(448.0), st(57344.0))
    old = self._grads(self.variant, x, w, ct, states, None)
    new = self._grads(self.variant, x, w, ct, states, jnp.float32)
    exact = np.asarray(x, np.float64).T @ np.asarray(ct.astype(jnp.bfloat16), np.float64)
    chex.assert_type((old, new), jnp.float32)
    np.testing.assert_array_equal(new, exact.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert not np.array_equal(new, exact)  # the bfloat16 rounding is there
    chex.assert_trees_all_equal(new, old)

  @chex.variants(with_jit=True, without_jit=True)
  def test_other_scales_round_once(self):
    x = jax.random.normal(jax.random.key(0), (64, 32), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32)
    ct = jax.random.normal(jax.random.key(2), (64, 16), jnp.float32)
    st = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
    states = (st(), st(), st())
    old = np.asarray(self._grads(self.variant, x, w, ct, states, None))
    new = np.asarray(self._grads(self.variant, x, w, ct, states, jnp.float32))
    # The new value is rounded to bfloat16 once (after the scaling); the old
    # one went through a bfloat16 GEMM output first: within two bfloat16 steps.
    np.testing.assert_array_equal(new, new.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_allclose(new, old, rtol=2 ** -6, atol=0)


@pytest.mark.parametrize("arg", ["rhs_grad_dtype", "rhs_compute_dtype"])
def test_rhs_dtype_arguments_must_be_floating(arg):
  st = fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
  with pytest.raises(TypeError, match=f"{arg} must be a floating dtype"):
    fl.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)), (((1,), (0,)), ((), ())),
                       input_state=st, kernel_state=st, output_grad_state=st,
                       **{arg: jnp.int32})
