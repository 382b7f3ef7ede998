"""QDenseGeneral and QEinsum: parity with flax, straight-through gradients, state."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import numerics
from fp8_linen import einsum_plan

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = fl.Fp8Recipe(gemm="f32")


def exact(key, shape, k):
  """Small integers times 2**k with one entry 448 * 2**k: the e4m3 scale is 2**k exactly."""
  x = jax.random.randint(key, shape, -8, 9).astype(jnp.float32)
  return (x.reshape(-1).at[0].set(448.0).reshape(shape)) * 2.0 ** k


@functools.partial(jax.jit, static_argnums=1)  # op by op, each shape costs its compiles
def qdq(x, dtype):
  s = numerics.amax(x) / numerics.fp8_max(dtype)
  return numerics.qdq(x, dtype, s)


def with_params(model, variables, params):
  return {**variables, "params": params}


# ----------------------------------------------------------------------------- plan


@pytest.mark.parametrize("eq,ls,rs", [
    ("...qhd,...khd->...hqk", (2, 5, 3, 4), (2, 6, 3, 4)),
    ("bd,dhk->bhk", (5, 4), (4, 2, 3)),
    ("bij,bjk->bki", (2, 3, 4), (2, 4, 5)),
    ("ijx,jk->ki", (2, 3, 7), (3, 4)),
    ("ij,jk", (2, 3), (3, 4)),
    # Broadcasting: size-1 axes (multi-/grouped-query attention) and ellipses of
    # different ranks; the size-1 axis is squeezed out of its operand.
    ("btnh,bsnh->bnts", (1, 4, 2, 8), (1, 4, 1, 8)),
    ("btnh,bsnh->bnts", (2, 4, 1, 8), (1, 5, 3, 8)),
    ("btkgh,bskgh->bkgts", (2, 4, 2, 3, 8), (2, 5, 2, 1, 8)),
    ("...ij,...jk->...ik", (2, 1, 2, 4), (3, 4, 5)),
    ("...ij,...jk", (2, 1, 2, 4), (3, 4, 5)),
    ("bij,bjk->ik", (1, 2, 3), (4, 3, 5)),     # a broadcast axis summed away
])
def test_einsum_plan_matches_jnp_einsum(eq, ls, rs):
  a = np.random.RandomState(0).randn(*ls)
  b = np.random.RandomState(1).randn(*rs)
  p = einsum_plan(eq, ls, rs)
  a2 = a.sum(axis=p.lhs_sum_axes) if p.lhs_sum_axes else a
  b2 = b.sum(axis=p.rhs_sum_axes) if p.rhs_sum_axes else b
  y = np.transpose(jax.lax.dot_general(a2, b2, p.dimension_numbers), p.out_perm)
  np.testing.assert_allclose(y, np.einsum(eq, a, b), rtol=1e-5, atol=1e-5)


def test_einsum_plan_errors():
  with pytest.raises(ValueError, match="size 3 in lhs but 4"):
    einsum_plan("ij,jk->ik", (2, 3), (4, 5))
  with pytest.raises(NotImplementedError, match="diagonals"):
    einsum_plan("ii,ij->j", (3, 3), (3, 4))
  with pytest.raises(ValueError, match="exactly two operands"):
    einsum_plan("ij,jk,kl->il", (2, 3), (3, 4))
  with pytest.raises(ValueError, match="size 2 in lhs but 3"):   # neither size is 1
    einsum_plan("btnh,bsnh->bnts", (1, 4, 2, 8), (1, 4, 3, 8))


def test_einsum_plan_squeezes_a_broadcast_axis_instead_of_materializing_it():
  p = einsum_plan("btnh,bsnh->bnts", (1, 4, 2, 8), (1, 4, 1, 8))
  # k's head axis is squeezed; q's heads become a free axis of the one GEMM.
  assert p.rhs_sum_axes == (2,) and p.lhs_sum_axes == ()
  assert p.dimension_numbers == (((3,), (2,)), ((0,), (0,)))


# ----------------------------------------------------------------------------- QDenseGeneral

DG_CASES = [
    ((4, 3, 5), dict(features=(2, 3), axis=-1)),
    ((4, 3, 5), dict(features=6, axis=(1, 2))),
    ((3, 4, 5), dict(features=(2,), axis=2, batch_dims=0)),
]


@pytest.mark.parametrize("shape,kw", DG_CASES)
def test_dense_general_params_and_exact_parity(shape, kw):
  q, f = fl.QDenseGeneral(**kw), nn.DenseGeneral(**kw)
  x = exact(jax.random.key(1), shape, -1)
  # Jitted, both sides of the exact comparison: op by op, a quantized layer costs seconds.
  vq, vf = jax.jit(q.init)(jax.random.key(0), x), jax.jit(f.init)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, vq["params"]) == jax.tree.map(jnp.shape, vf["params"])
  assert set(vq[fl.OWG]) == {f"{r}_{s}" for r in fl.ROLES for s in ("scale", "amax_history")}
  kernel = exact(jax.random.key(2), vf["params"]["kernel"].shape, -3)
  params = {"kernel": kernel, "bias": vf["params"]["bias"] + 0.5}
  y_q = jax.jit(q.apply)(with_params(q, vq, params), x)
  y_f = jax.jit(f.apply)({"params": params}, x)
  np.testing.assert_array_equal(np.asarray(y_q), np.asarray(y_f))


@pytest.mark.parametrize("shape,kw", DG_CASES[:2])
def test_dense_general_grads_straight_through(shape, kw):
  q = fl.QDenseGeneral(**kw, recipe=F32)
  f = nn.DenseGeneral(**kw)
  x = jax.random.normal(jax.random.key(1), shape)
  v = jax.jit(q.init)(jax.random.key(0), x)
  ct = jax.random.normal(jax.random.key(3), jax.eval_shape(q.apply, v, x).shape) * 100.0
  # Jitted: op by op, a quantized backward costs seconds.
  gx, gv = jax.jit(jax.grad(lambda x, v: jnp.sum(q.apply(v, x) * ct), argnums=(0, 1)))(x, v)
  # Reference: flax layer on qdq'd operands, cotangent qdq'd to e5m2.
  p_ref = {"kernel": qdq(v["params"]["kernel"], E4), "bias": v["params"]["bias"]}
  ct_q = qdq(ct, E5)
  rx, rv = jax.grad(lambda x, p: jnp.sum(f.apply({"params": p}, x) * ct_q), argnums=(0, 1))(
      qdq(x, E4), p_ref)
  np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(gv["params"]["kernel"], rv["kernel"], rtol=1e-5, atol=1e-4)
  owg = gv[fl.OWG]
  np.testing.assert_allclose(owg["output_grad_amax_history"][0], jnp.max(jnp.abs(ct)), rtol=1e-6)
  np.testing.assert_allclose(owg["input_amax_history"][0], jnp.max(jnp.abs(x)), rtol=1e-6)


def test_dense_general_jit_equals_eager_and_shared_use_takes_max():
  q = fl.QDenseGeneral(features=(2, 3), axis=-1)
  x1 = jax.random.normal(jax.random.key(1), (4, 5))
  x2 = 3.0 * jax.random.normal(jax.random.key(2), (4, 5))
  v = jax.jit(q.init)(jax.random.key(0), x1)

  class Twice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
      layer = fl.QDenseGeneral(features=(2, 3), axis=-1, name="shared")
      return layer(a).sum() + 2.0 * layer(b).sum()

  m = Twice()
  vm = jax.jit(m.init)(jax.random.key(0), x1, x2)
  loss = lambda v: m.apply(v, x1, x2)
  # The eager gradient is this test's point; init is jitted.
  g_eager, g_jit = jax.grad(loss)(vm), jax.jit(jax.grad(loss))(vm)
  for a, b in zip(jax.tree.leaves(g_eager), jax.tree.leaves(g_jit)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  owg = g_jit[fl.OWG]["shared"]
  amax_in = max(float(jnp.max(jnp.abs(x1))), float(jnp.max(jnp.abs(x2))))
  np.testing.assert_allclose(owg["input_amax_history"][0], amax_in, rtol=1e-6)
  np.testing.assert_allclose(owg["output_grad_amax_history"][0], 2.0, rtol=1e-6)  # max, not 3
  np.testing.assert_allclose(owg["kernel_scale"], vm[fl.OWG]["shared"]["kernel_scale"] * 0
                             + jnp.max(jnp.abs(vm["params"]["shared"]["kernel"])) / 448.0,
                             rtol=1e-6)
  del v


def test_dense_general_errors():
  x = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="inputs must be a floating"):
    fl.QDenseGeneral(features=2).init(jax.random.key(0), jnp.ones((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="axis"):
    fl.QDenseGeneral(features=2, axis=5).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="dot_general"):
    fl.QDenseGeneral(features=2, dot_general=jax.lax.dot_general).init(jax.random.key(0), x)


# ----------------------------------------------------------------------------- QEinsum

EIN_CASES = [
    ((3, 4, 5), (5, 6, 7), "abc,cde->abde"),
    ((2, 3, 4), (4, 3, 5), "bti,ijk->btjk"),   # output reorders kernel dims
    ((2, 6, 4), (4, 2, 3), "...d,dhk->...hk"),
    ((2, 3, 4), (2, 4, 5), "bij,bjk->bik"),     # a batch dimension shared with the kernel
]


@pytest.mark.parametrize("xs,ks,eq", EIN_CASES)
def test_einsum_params_and_exact_parity(xs, ks, eq):
  q, f = fl.QEinsum(shape=ks, einsum_str=eq), nn.Einsum(shape=ks, einsum_str=eq)
  x = exact(jax.random.key(1), xs, 0)
  # Jitted, both sides of the exact comparison: op by op, a quantized layer costs seconds.
  vq, vf = jax.jit(q.init)(jax.random.key(0), x), jax.jit(f.init)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, vq["params"]) == jax.tree.map(jnp.shape, vf["params"])
  params = {"kernel": exact(jax.random.key(2), ks, -4), "bias": vf["params"]["bias"] + 1.0}
  np.testing.assert_array_equal(np.asarray(jax.jit(q.apply)(with_params(q, vq, params), x)),
                                np.asarray(jax.jit(f.apply)({"params": params}, x)))


@pytest.mark.parametrize("xs,ks,eq", EIN_CASES[1:3])
def test_einsum_grads_straight_through(xs, ks, eq):
  q = fl.QEinsum(shape=ks, einsum_str=eq, recipe=F32, use_bias=False)
  x = jax.random.normal(jax.random.key(1), xs)
  v = jax.jit(q.init)(jax.random.key(0), x)
  k = v["params"]["kernel"]
  ct = jax.random.normal(jax.random.key(3), jax.eval_shape(q.apply, v, x).shape)
  gx, gv = jax.jit(jax.grad(lambda x, v: jnp.sum(q.apply(v, x) * ct), argnums=(0, 1)))(x, v)
  ct_q = qdq(ct, E5)
  rx, rk = jax.grad(lambda a, b: jnp.sum(jnp.einsum(eq, a, b) * ct_q), argnums=(0, 1))(
      qdq(x, E4), qdq(k, E4))
  np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gv["params"]["kernel"], rk, rtol=1e-5, atol=1e-5)


def test_einsum_call_time_equation_scan_and_remat():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(fl.QEinsum(shape=(4, 4), use_bias=False)(h, "btd,de->bte")), None

  Scanned = nn.scan(nn.remat(Block), variable_axes={"params": 0, fl.OWG: 0},
                    split_rngs={"params": True}, length=3)
  m = Scanned()
  x = jax.random.normal(jax.random.key(1), (2, 3, 4))
  v = jax.jit(lambda k, x: m.init(k, x, None))(jax.random.key(0), x)
  assert v["params"]["QEinsum_0"]["kernel"].shape == (3, 4, 4)
  assert v[fl.OWG]["QEinsum_0"]["input_scale"].shape == (3, 1)
  g = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x, None)[0] ** 2)))(v)
  hist = g[fl.OWG]["QEinsum_0"]["input_amax_history"]
  np.testing.assert_allclose(hist[0, 0], jnp.max(jnp.abs(x)), rtol=1e-6)
  assert bool(jnp.all(hist[:, 0] > 0)) and bool(jnp.all(jnp.isfinite(g["params"]["QEinsum_0"]
                                                                       ["kernel"])))


def test_einsum_errors():
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="QEinsum.shape"):
    fl.QEinsum(shape=(3, 4, 5), einsum_str="bd,dk->bk").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="exactly two operands"):
    fl.QEinsum(shape=(3, 4), einsum_str="bd,dk,kl->bl").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="size 3 in lhs but 4"):
    fl.QEinsum(shape=(4, 4), einsum_str="bd,dk->bk").init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="floating"):
    fl.QEinsum(shape=(3, 4), einsum_str="bd,dk->bk").init(jax.random.key(0), x.astype(int))
