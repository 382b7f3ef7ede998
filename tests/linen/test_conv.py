"""fp8 convolution op and QConv: parity with nn.Conv, straight-through gradients, state."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8_linen as fl
from fp8_linen.core import numerics
from fp8_linen import fp8_conv_general_dilated

E4, E5 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32 = fl.Fp8Recipe(gemm="f32")


def exact(key, shape, k):
  x = jax.random.randint(key, shape, -8, 9).astype(jnp.float32)
  return (x.reshape(-1).at[0].set(448.0).reshape(shape)) * 2.0 ** k


@functools.partial(jax.jit, static_argnums=1)  # op by op, each shape costs its compiles
def qdq(x, dtype):
  return numerics.qdq(x, dtype, numerics.amax(x) / numerics.fp8_max(dtype))


def fresh(n=8):
  return fl.RoleState(jnp.ones((1,)), jnp.zeros((n,)))


CASES = [
    ((2, 8, 8, 3), dict(features=4, kernel_size=(3, 3))),
    ((2, 9, 9, 4), dict(features=4, kernel_size=(3, 3), strides=2, padding="VALID",
                        feature_group_count=2)),
    ((2, 10, 3), dict(features=2, kernel_size=(3,), padding="CAUSAL", kernel_dilation=2)),
    ((1, 4, 4, 4, 2), dict(features=3, kernel_size=(2, 2, 2), padding=((1, 0), (0, 1), (1, 1)),
                           input_dilation=2)),
    ((3, 2, 6, 6, 2), dict(features=3, kernel_size=(3, 3), padding="CIRCULAR")),
]


@pytest.mark.parametrize("shape,kw", CASES)
def test_qconv_params_and_exact_parity(shape, kw):
  q, f = fl.QConv(**kw), nn.Conv(**kw)
  x = exact(jax.random.key(1), shape, -2)
  # Jitted, both sides of the exact comparison: op by op, a quantized layer costs seconds.
  vq, vf = jax.jit(q.init)(jax.random.key(0), x), jax.jit(f.init)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, vq["params"]) == jax.tree.map(jnp.shape, vf["params"])
  assert vq[fl.OWG]["kernel_amax_history"].shape == (1024,)
  params = {"kernel": exact(jax.random.key(2), vf["params"]["kernel"].shape, -5),
            "bias": vf["params"]["bias"] + 0.25}
  y_q = jax.jit(q.apply)({**vq, "params": params}, x)
  y_f = jax.jit(f.apply)({"params": params}, x)
  assert y_q.shape == y_f.shape and y_q.dtype == y_f.dtype
  np.testing.assert_array_equal(np.asarray(y_q), np.asarray(y_f))


@pytest.mark.parametrize("shape,kw", CASES[:3])
@pytest.mark.parametrize("recipe,tol", [(F32, 1e-5), (fl.Fp8Recipe(), 2e-2)])
def test_qconv_grads_straight_through(shape, kw, recipe, tol):
  q, f = fl.QConv(**kw, recipe=recipe), nn.Conv(**kw)
  x = jax.random.normal(jax.random.key(1), shape)
  v = jax.jit(q.init)(jax.random.key(0), x)
  ct = 50.0 * jax.random.normal(jax.random.key(3), jax.eval_shape(q.apply, v, x).shape)
  gx, gv = jax.jit(jax.grad(lambda x, v: jnp.sum(q.apply(v, x) * ct), argnums=(0, 1)))(x, v)
  p_ref = {"kernel": qdq(v["params"]["kernel"], E4), "bias": v["params"]["bias"]}
  ct_q = qdq(ct, E5)
  rx, rp = jax.jit(jax.grad(lambda x, p: jnp.sum(f.apply({"params": p}, x) * ct_q),
                            argnums=(0, 1)))(qdq(x, E4), p_ref)
  scale = lambda r: float(jnp.max(jnp.abs(r)))
  np.testing.assert_allclose(gx, rx, rtol=tol, atol=tol * scale(rx))
  np.testing.assert_allclose(gv["params"]["kernel"], rp["kernel"], rtol=tol,
                             atol=tol * scale(rp["kernel"]))
  # The bias is added after the fp8 convolution: its gradient sees the exact cotangent.
  np.testing.assert_allclose(gv["params"]["bias"], ct.reshape(-1, ct.shape[-1]).sum(0),
                             rtol=1e-5, atol=1e-3)
  owg = gv[fl.OWG]
  np.testing.assert_allclose(owg["output_grad_amax_history"][0], jnp.max(jnp.abs(ct)), rtol=1e-6)
  np.testing.assert_allclose(owg["output_grad_scale"][0], jnp.max(jnp.abs(ct)) / 57344.0,
                             rtol=1e-6)


@pytest.mark.parametrize("shape,kw", CASES)
def test_gpu_lowering_gradients_equal_reference_lowering(shape, kw):
  # The GPU form rewrites the backward (fp8-reversed kernel for dgrad, one fp8
  # GEMM per kernel offset for wgrad); it must compute the same gradients.
  x = jax.random.normal(jax.random.key(1), shape)
  grads = {}
  for gemm in ("fp8", "f32"):
    q = fl.QConv(**kw, recipe=fl.Fp8Recipe(gemm=gemm))
    v = jax.jit(q.init)(jax.random.key(0), x)
    ct = jax.random.normal(jax.random.key(3), jax.eval_shape(q.apply, v, x).shape)
    grads[gemm] = jax.jit(jax.grad(lambda x, v: jnp.sum(q.apply(v, x) * ct),
                                   argnums=(0, 1)))(x, v)
  for a, b in zip(jax.tree.leaves(grads["fp8"]), jax.tree.leaves(grads["f32"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_op_without_jit_matches_jit_and_uses_history_scale():
  """Eager custom_vjp; a stored gradient history is what picks the e5m2 scale."""
  x = jax.random.normal(jax.random.key(1), (2, 3, 9))   # NCW
  w = jax.random.normal(jax.random.key(2), (4, 3, 3))   # OIW
  gh = jnp.zeros((8,)).at[1].set(4.0)   # an earlier step saw |g| = 4

  def f(x, w, gs, gh):
    y, _ = fp8_conv_general_dilated(x, w, (2,), "SAME", input_state=fresh(),
                                    kernel_state=fresh(), output_grad_state=(gs, gh), recipe=F32)
    return y

  ct = 0.5 * jnp.ones(jax.eval_shape(f, x, w, jnp.ones((1,)), gh).shape)  # below the stored amax
  def loss(x, w, gs, gh):
    return jnp.sum(f(x, w, gs, gh) * ct)
  eager = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, jnp.ones((1,)), gh)
  jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, jnp.ones((1,)), gh)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(eager[2], [4.0 / 57344.0], rtol=1e-6)  # scale from the history
  np.testing.assert_allclose(eager[3][:3], [0.5, 0.0, 4.0])          # rolled, newest first
  ref = lambda a, b: lax.conv_general_dilated(a, b, (2,), "SAME")
  s_g = 4.0 / 57344.0
  ct_q = numerics.qdq(ct, E5, jnp.array([s_g]))
  rx, rw = jax.vjp(ref, qdq(x, E4), qdq(w, E4))[1](ct_q)
  np.testing.assert_allclose(eager[0], rx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(eager[1], rw, rtol=1e-5, atol=1e-5)


def test_residuals_are_fp8_only():
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 16), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (3, 3, 16, 16), jnp.bfloat16)
  dn = ("NHWC", "HWIO", "NHWC")
  f = lambda x, w: fp8_conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn,
                                            input_state=fresh(), kernel_state=fresh(),
                                            output_grad_state=fresh())[0]
  _, vjp_fn = jax.vjp(f, x, w)   # the residuals are the leaves of the vjp closure
  big = [r for r in jax.tree.leaves(vjp_fn) if r.size > 64]
  # The fp8 copies, kept as their bytes (see core/fp8_vjp.py's _saved).
  assert sorted((r.shape, str(r.dtype)) for r in big) == [
      ((2, 8, 8, 16), "uint8"), ((3, 3, 16, 16), "uint8")]


def test_qconv_shared_use_records_max():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
      c = fl.QConv(features=2, kernel_size=(3,), name="c")
      return c(a).sum() + 3.0 * c(b).sum()

  a = jax.random.normal(jax.random.key(1), (2, 6, 2))
  b = 5.0 * jax.random.normal(jax.random.key(2), (2, 6, 2))
  m = Twice()
  v = jax.jit(m.init)(jax.random.key(0), a, b)
  g = jax.jit(jax.grad(lambda v: m.apply(v, a, b)))(v)[fl.OWG]["c"]
  np.testing.assert_allclose(g["input_amax_history"][0], jnp.max(jnp.abs(b)), rtol=1e-6)
  np.testing.assert_allclose(g["output_grad_amax_history"][0], 3.0, rtol=1e-6)  # not 4
  k_amax = jnp.max(jnp.abs(v["params"]["c"]["kernel"]))
  np.testing.assert_allclose(g["kernel_amax_history"][0], k_amax, rtol=1e-6)  # not 2x


def test_qconv_remat_and_scan():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return nn.relu(fl.QConv(features=3, kernel_size=(3, 3))(h)), None

  m = nn.scan(nn.remat(Block), variable_axes={"params": 0, fl.OWG: 0},
              split_rngs={"params": True}, length=2)()
  x = jax.random.normal(jax.random.key(1), (2, 5, 5, 3))
  v = jax.jit(lambda k, x: m.init(k, x, None))(jax.random.key(0), x)
  g = jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x, None)[0] ** 2)))(v)
  assert g[fl.OWG]["QConv_0"]["input_amax_history"].shape == (2, 1024)
  np.testing.assert_allclose(g[fl.OWG]["QConv_0"]["input_amax_history"][0, 0],
                             jnp.max(jnp.abs(x)), rtol=1e-6)
  assert bool(jnp.all(jnp.isfinite(g["params"]["QConv_0"]["kernel"])))


def test_errors_name_the_argument():
  x = jnp.ones((2, 6, 6, 4))
  with pytest.raises(ValueError, match="feature_group_count"):
    fl.QConv(features=3, kernel_size=(3, 3), feature_group_count=2).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="floating"):
    fl.QConv(features=3, kernel_size=(3, 3)).init(jax.random.key(0), x.astype(jnp.int32))
  with pytest.raises(ValueError, match="kernel_size"):
    fl.QConv(features=3, kernel_size=(3, 3, 3, 3, 3)).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="window_strides"):
    fp8_conv_general_dilated(jnp.ones((1, 2, 5)), jnp.ones((3, 2, 2)), (1, 1), "VALID",
                             input_state=fresh(), kernel_state=fresh(), output_grad_state=fresh())
  with pytest.raises(ValueError, match="padding"):
    fp8_conv_general_dilated(jnp.ones((1, 2, 5)), jnp.ones((3, 2, 2)), (1,), "FULL",
                             input_state=fresh(), kernel_state=fresh(), output_grad_state=fresh())
