"""The integer grouped GEMM (``int_ragged_dot``): int8 codes per expert, STE gradients,
the observer's state, and what the accelerators multiply (compile only)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import int_product

GS = np.array([5, 0, 4, 3], np.int32)  # one expert receives no token
M, K, N, G = int(GS.sum()), 32, 8, len(GS)
TENSOR = fl.IntRecipe()
CHANNEL = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))


def _data(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(k[0], (M, K))
  # Experts of different magnitudes: per-channel scales are each expert's own.
  w = jax.random.normal(k[1], (G, K, N)) * jnp.array([0.3, 1.0, 0.01, 3.0])[:, None, None]
  return x, w, jax.random.normal(k[2], (M, N))


def _fq64(x, axis):
  """Symmetric int8 fake quantization in float64, scale max|x| / 127 over ``axis``."""
  x = np.asarray(x, np.float64)
  s = np.abs(x).max(axis=axis, keepdims=True) / 127.0
  return np.clip(np.round(x / s), -128, 127) * s


def _ragged64(a, b, gs=GS):
  out, start = np.zeros((a.shape[0], b.shape[2])), 0
  for i, n in enumerate(gs):
    out[start:start + n] = a[start:start + n] @ b[i]
    start += n
  return out


def _wgrad64(a, g, gs=GS):
  out, start = np.zeros((len(gs), a.shape[1], g.shape[1])), 0
  for i, n in enumerate(gs):
    out[i] = a[start:start + n].T @ g[start:start + n]
    start += n
  return out


def _apply(x, w, rng, recipe, gs=GS):
  return int_product.int_ragged_dot(x, w, gs, recipe=recipe, input_params=(rng,))[0]


class IntRaggedTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_and_ste_gradients_are_the_float64_fake_quant_products(self):
    for name, recipe, axis in (("tensor", TENSOR, None), ("channel", CHANNEL, 1)):
      x, w, ct = _data()
      rng = jnp.zeros((2,))
      y = self.variant(lambda x, w, r: _apply(x, w, r, recipe))(x, w, rng)
      xh, wh = _fq64(x, None), _fq64(w, axis)
      np.testing.assert_allclose(np.asarray(y), _ragged64(xh, wh), rtol=1e-5, atol=1e-5,
                                 err_msg=name)
      loss = lambda x, w, r: jnp.sum(_apply(x, w, r, recipe) * ct)
      d_x, d_w, d_r = self.variant(jax.grad(loss, argnums=(0, 1, 2)))(x, w, rng)
      ct64 = np.asarray(ct, np.float64)
      np.testing.assert_allclose(np.asarray(d_x), _ragged64(ct64, wh.transpose(0, 2, 1)),
                                 rtol=1e-5, atol=1e-5, err_msg=name)
      np.testing.assert_allclose(np.asarray(d_w), _wgrad64(xh, ct64), rtol=1e-5, atol=1e-5,
                                 err_msg=name)
      assert not np.any(np.asarray(d_w[1]))  # the expert without tokens gets no gradient
      # The observer's new range is the cotangent of its range: the batch's [-min, max].
      np.testing.assert_allclose(np.asarray(d_r), [-float(x.min()), float(x.max())],
                                 rtol=1e-6)

  def test_per_channel_scales_keep_a_small_expert(self):
    x, w, _ = _data(1)
    ref = _ragged64(np.asarray(x, np.float64), np.asarray(w, np.float64))
    rows = slice(9, 12)  # the routed rows of the largest expert (group 3)
    small = slice(5, 9)  # ... and of the smallest (group 2)
    err = lambda y, r: np.abs(np.asarray(y)[r] - ref[r]).max() / np.abs(ref[r]).max()
    tensor, channel = (_apply(x, w, jnp.zeros((2,)), r) for r in (TENSOR, CHANNEL))
    assert err(channel, small) < 0.05 < err(tensor, small)
    assert err(channel, rows) < 0.05


def _fq_rows64(t, scale_rows, qmax=127):
  """Symmetric fake quantization of ``t`` with the scales ``scale_rows`` (broadcast), float64."""
  return np.clip(np.round(t / scale_rows), -qmax, qmax) * scale_rows


def test_integer_gradients_are_per_row_and_per_expert_int8_products(jaxpr_eqns):
  # Rows 9..11 (expert 3) get gradients 1000x smaller, and two rows past the
  # groups' total belong to no expert.
  x, w, ct = _data(3)
  x = jnp.concatenate([x, jnp.ones((2, K))])
  ct = jnp.concatenate([ct.at[9:].multiply(1e-3), 5.0 * jnp.ones((2, N))])
  recipe = dataclasses.replace(CHANNEL, grad_bits=8)
  loss = lambda x, w: jnp.sum(_apply(x, w, jnp.zeros((2,)), recipe) * ct)
  d_x, d_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  # float64: dgrad quantizes ct * (the row's expert's weight scales) per row;
  # wgrad quantizes ct per expert and column; each multiplies the other
  # operand's fake-quantized values.
  x64, ct64 = np.asarray(x, np.float64)[:M], np.asarray(ct, np.float64)[:M]
  wh = _fq64(w, 1)
  s_w = np.abs(np.asarray(w, np.float64)).max(axis=1, keepdims=True) / 127.0  # (g, 1, n)
  rows = np.repeat(np.arange(G), GS)
  g1 = ct64 * s_w[rows, 0]
  q1 = _fq_rows64(g1, np.abs(g1).max(axis=1, keepdims=True) / 127.0)
  dx_ref = _ragged64(q1, wh.transpose(0, 2, 1) / s_w.transpose(0, 2, 1))
  s2 = np.ones((G, N))
  for i in range(G):
    if GS[i]:
      s2[i] = np.abs(ct64[rows == i]).max(axis=0) / 127.0
  dw_ref = _wgrad64(_fq64(x64, None), _fq_rows64(ct64, s2[rows]))
  np.testing.assert_allclose(np.asarray(d_x)[:M], dx_ref, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(d_w), dw_ref, rtol=1e-4, atol=1e-9)
  # The small expert keeps its resolution (its own scales), the empty one gets
  # nothing, and rows of no expert get no input gradient.
  float_dw = _wgrad64(_fq64(x64, None), ct64)
  assert np.abs(np.asarray(d_w[3]) - float_dw[3]).max() < 0.02 * np.abs(float_dw[3]).max()
  assert not np.any(np.asarray(d_w[1])) and not np.any(np.asarray(d_x[M:]))
  # Three int8 x int8 grouped GEMMs: forward (int8 lowering; the CPU's default
  # multiplies the codes in bfloat16), dgrad, wgrad.
  int8 = dataclasses.replace(recipe, gemm="int8")
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(_apply(x, w, jnp.zeros((2,)), int8) * ct),
                                  argnums=(0, 1)))(x, w)
  ragged = [e for e in jaxpr_eqns(jaxpr) if e.primitive.name.startswith("ragged_dot")]
  assert sorted(str(v.aval.dtype) for e in ragged for v in e.invars[:2]) == ["int8"] * 6


def test_stochastically_rounded_integer_gradients_are_unbiased():
  x, w, ct = _data(4)
  recipe = dataclasses.replace(CHANNEL, grad_bits=4, grad_stochastic_rounding=True)
  exact = jax.grad(lambda w: jnp.sum(_apply(x, w, jnp.zeros((2,)), CHANNEL) * ct))(w)
  # The noise is seeded by the operands' scales: other weights, other draws.
  grads = [jax.jit(jax.grad(lambda w: jnp.sum(_apply(x, w, jnp.zeros((2,)), recipe) * ct)))(
      w * (1.0 + 1e-3 * i))[0] for i in range(24)]
  mean_err = np.abs(np.mean(grads, axis=0) - np.asarray(exact[0])).mean()
  one_err = np.abs(np.asarray(grads[0]) - np.asarray(exact[0])).mean()
  assert mean_err < 0.4 * one_err  # errors average out: no bias


def test_int8_and_bf16_lowerings_agree_bit_for_bit():
  x, w, _ = _data(2)
  ys = [_apply(x, w, jnp.zeros((2,)), fl.IntRecipe(gemm=g,
                                                   kernel=fl.IntQuantConfig(granularity="channel")))
        for g in ("int8", "bf16")]
  chex.assert_trees_all_equal(*ys)


def test_unsupported_recipes_are_named_and_fake_quantized_by_the_layers():
  assert int_product.ragged_supported(CHANNEL) is None
  asym = fl.IntRecipe(input=fl.IntQuantConfig(symmetric=False))
  assert "asymmetric" in int_product.ragged_supported(asym)
  assert "LSQ" in int_product.ragged_supported(fl.int8_lsq())
  assert int_product.ragged_supported(dataclasses.replace(CHANNEL, grad_bits=8)) is None
  x, w, _ = _data()
  with pytest.raises(ValueError, match="asymmetric"):
    _apply(x, w, jnp.zeros((2,)), asym)
  with pytest.raises(ValueError, match=r"rhs \(g, k, n\)"):
    _apply(x, w[0], jnp.zeros((2,)), CHANNEL)


# (target, the kind of grouped GEMM that multiplies int8 codes): XLA:TPU's Mosaic kernel;
# on a GPU the library's Triton kernel (each row by its own group's weight only).
_TARGETS = [("tpu-v5e", "mosaic-grouped-gemm"), ("tpu-v6e", "mosaic-grouped-gemm"),
            ("h100", "pallas-grouped-gemm")]


@pytest.mark.parametrize("grad_bits", [None, 8])
@pytest.mark.parametrize("target,kind", _TARGETS, ids=[t for t, _ in _TARGETS])
def test_the_forward_is_an_int8_grouped_gemm(require_target, target, kind, grad_bits):
  t = require_target(target)
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel

  gs = np.array([128, 0, 256, 128], np.int32)
  x = jnp.ones((512, 256), jnp.bfloat16)
  w = jnp.ones((4, 256, 384), jnp.float32)

  def step(x, w, rng):
    loss = lambda x, w, r: jnp.sum(int_product.int_ragged_dot(
        x, w, gs, recipe=fl.IntRecipe(gemm="int8", grad_bits=grad_bits),
        input_params=(r,))[0])
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w, rng)

  report = compile_for(t, step, x, w, jnp.zeros((2,)))
  ints = [p for p in report.product_list if p.operand_class == "int8"]
  # int32 sums; the library's GPU kernels multiply them by their scales in the epilogue
  # and write float32.
  out = "f32" if kind == "pallas-grouped-gemm" else "s32"
  assert kind in [p.kind for p in ints] and all(p.out == out for p in ints), \
      report.product_list
  if kind == "pallas-grouped-gemm":  # the routed rows' work, not 4 groups' worth
    assert all(p.kind == kind and p.flops == 2 * 512 * 256 * 384 for p in ints), ints
  if grad_bits is None:
    # The two gradient products stay in the activations' dtype (bf16): on a GPU in the
    # same grouped kernels, each row by its own expert.
    assert len(ints) == 1 and report.classes.get("bf16") == 2, report.classes
    if kind == "pallas-grouped-gemm":
      assert {p.kind for p in report.product_list} == {kind}, report.product_list
  else:
    # grad_bits: dgrad and wgrad multiply int8 codes as well.
    assert len(ints) == 3 and report.classes == {"int8": 3}, report.classes
