"""fp8 grouped GEMMs (``jax.lax.ragged_dot``): numerics against float64 with ml_dtypes casts,
gradients, state, bad input, and the products an H100 runs (compile only)."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import owg

GS = np.array([4, 0, 5, 3], np.int32)  # one empty group
M, K, N, G = int(GS.sum()), 16, 8, len(GS)
RECIPE = fl.current_scaling(history_length=4)


def _st():
  return owg.RoleState(jnp.ones((1,)), jnp.zeros((4,)))


def _data(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(k[0], (M, K))
  rhs = jax.random.normal(k[1], (G, K, N))
  ct = jax.random.normal(k[2], (M, N))
  return lhs, rhs, ct


def _q64(x, dtype):
  """x in fp8 with a current per-tensor scale (amax / fp8 max), back in float64."""
  x = np.asarray(x, np.float64)
  s = np.abs(x).max() / float(ml_dtypes.finfo(dtype).max)
  return (x / s).astype(np.float32).astype(dtype).astype(np.float64) * s


def _ragged64(a, b, gs):
  out, start = [], 0
  for i, n in enumerate(gs):
    out.append(a[start:start + n] @ b[i])
    start += n
  return np.concatenate(out)


def _wgrad64(a, g, gs):
  out, start = [], 0
  for n in gs:
    out.append(a[start:start + n].T @ g[start:start + n])
    start += n
  return np.stack(out)


def _apply(lhs, rhs, states, gs=GS, recipe=RECIPE):
  return fl.fp8_ragged_dot(lhs, rhs, gs, input_state=states[0], kernel_state=states[1],
                           output_grad_state=states[2], recipe=recipe)[0]


class RaggedNumericsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_and_gradients_match_fp8_products_in_float64(self):
    lhs, rhs, ct = _data()
    loss = lambda l, w, s: jnp.sum(_apply(l, w, s) * ct)
    states = (_st(), _st(), _st())
    y = self.variant(_apply)(lhs, rhs, states)
    e4, e5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    ql, qr, qg = _q64(lhs, e4), _q64(rhs, e4), _q64(ct, e5)
    np.testing.assert_allclose(np.asarray(y), _ragged64(ql, qr, GS), rtol=2e-5, atol=2e-5)
    d_l, d_r, d_s = self.variant(jax.grad(loss, argnums=(0, 1, 2)))(lhs, rhs, states)
    np.testing.assert_allclose(np.asarray(d_l), _ragged64(qg, qr.transpose(0, 2, 1), GS),
                               rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(d_r), _wgrad64(ql, qg, GS), rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(d_r[1]))  # the empty group gets no gradient
    # The new state: each role's history starts with that tensor's amax.
    for st, x in zip(d_s, (lhs, rhs, ct)):
      np.testing.assert_allclose(float(st.amax_history[0]), float(jnp.max(jnp.abs(x))),
                                 rtol=1e-6)


def _grouped_st(history=4):
  return owg.RoleState(jnp.ones((G, 1)), jnp.zeros((G, history)))


def _q64_per_group(w, dtype):
  return np.stack([_q64(w[i], dtype) for i in range(w.shape[0])])


class PerExpertTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_one_kernel_scale_per_expert_matches_float64(self):
    lhs, rhs, ct = _data(1)
    # Experts of very different magnitudes: a shared scale would flush the small ones.
    rhs = rhs * jnp.array([1.0, 3.0, 1e-3, 40.0])[:, None, None]
    states = (_st(), _grouped_st(), _st())
    loss = lambda l, w, s: jnp.sum(_apply(l, w, s) * ct)
    y = self.variant(_apply)(lhs, rhs, states)
    e4, e5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    ql, qr, qg = _q64(lhs, e4), _q64_per_group(rhs, e4), _q64(ct, e5)
    np.testing.assert_allclose(np.asarray(y), _ragged64(ql, qr, GS), rtol=2e-5, atol=1e-6)
    d_l, d_r, d_s = self.variant(jax.grad(loss, argnums=(0, 1, 2)))(lhs, rhs, states)
    np.testing.assert_allclose(np.asarray(d_l), _ragged64(qg, qr.transpose(0, 2, 1), GS),
                               rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d_r), _wgrad64(ql, qg, GS), rtol=2e-5, atol=2e-5)
    # The new kernel state: each expert's own amax and scale (the empty expert's too);
    # the routed rows and the gradient one each.
    amax_e = np.abs(np.asarray(rhs)).max(axis=(1, 2))
    chex.assert_shape((d_s[1].scale, d_s[1].amax_history), ((G, 1), (G, 4)))
    np.testing.assert_allclose(np.asarray(d_s[1].amax_history[:, 0]), amax_e, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(d_s[1].scale[:, 0]), amax_e / 448.0, rtol=1e-6)
    np.testing.assert_allclose(float(d_s[0].amax_history[0]), float(jnp.abs(lhs).max()),
                               rtol=1e-6)
    np.testing.assert_allclose(float(d_s[2].amax_history[0]), float(jnp.abs(ct).max()),
                               rtol=1e-6)

  def test_per_expert_scales_keep_a_small_expert_that_a_shared_scale_flushes(self):
    lhs, rhs, _ = _data(2)
    rhs = rhs * jnp.array([1.0, 1.0, 1e-4, 100.0])[:, None, None]
    ref = _ragged64(np.asarray(lhs, np.float64), np.asarray(rhs, np.float64), GS)
    rows = slice(4, 9)  # the routed rows of the small expert (group 2)
    err = lambda y: np.abs(np.asarray(y)[rows] - ref[rows]).max() / np.abs(ref[rows]).max()
    grouped = _apply(lhs, rhs, (_st(), _grouped_st(), _st()))
    shared = _apply(lhs, rhs, (_st(), _st(), _st()))
    assert err(grouped) < 0.1 < err(shared)

  def test_two_uses_of_one_grouped_state_fold_per_expert(self):
    lhs, rhs, _ = _data(3)
    states = (_st(), _grouped_st(), _st())
    twice = rhs * jnp.array([2.0, 0.5, 2.0, 0.5])[:, None, None]

    def loss(s):
      y1, chain = fl.fp8_ragged_dot(lhs, rhs, GS, input_state=s[0], kernel_state=s[1],
                                    output_grad_state=s[2], recipe=RECIPE)
      y2, _ = fl.fp8_ragged_dot(lhs, twice, GS, input_state=s[0], kernel_state=s[1],
                                output_grad_state=s[2], recipe=RECIPE, chain=chain)
      return jnp.sum(y1) + jnp.sum(y2)

    new = jax.grad(loss)(states)
    expect = np.maximum(np.abs(np.asarray(rhs)).max(axis=(1, 2)),
                        np.abs(np.asarray(twice)).max(axis=(1, 2)))
    np.testing.assert_allclose(np.asarray(new[1].amax_history[:, 0]), expect, rtol=1e-6)

  def test_an_empty_batch_leaves_the_grouped_state_as_it_was(self):
    _, rhs, _ = _data()
    states = (_st(), owg.RoleState(jnp.full((G, 1), 2.0), jnp.full((G, 4), 3.0)), _st())
    new = jax.grad(lambda s: jnp.sum(_apply(jnp.zeros((0, K)), rhs, s, gs=np.zeros(G, np.int32))))(
        states)
    chex.assert_trees_all_equal(new[1], states[1])

  def test_a_grouped_state_of_the_wrong_shape_is_named(self):
    lhs, rhs, _ = _data()
    bad = owg.RoleState(jnp.ones((G + 1, 1)), jnp.zeros((G + 1, 4)))
    with pytest.raises(ValueError, match=r"kernel_scale / kernel_amax_history.*\(4, 1\)"):
      _apply(lhs, rhs, (_st(), bad, _st()))


def test_differs_from_float_and_is_close_to_it():
  lhs, rhs, _ = _data(1)
  y = _apply(lhs, rhs, (_st(), _st(), _st()))
  ref = jax.lax.ragged_dot(lhs, rhs, GS)
  assert not np.allclose(np.asarray(y), np.asarray(ref), atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=0.15 * float(jnp.abs(ref).max()))
  chex.assert_shape(y, (M, N))
  chex.assert_type(y, jnp.float32)


def test_rows_past_the_groups_are_zero_and_get_no_gradient():
  lhs, rhs, ct = _data(2)
  gs = np.array([3, 2, 0, 1], np.int32)  # 6 of 12 rows routed
  y = _apply(lhs, rhs, (_st(), _st(), _st()), gs)
  assert not np.any(np.asarray(y[6:]))
  d_l = jax.grad(lambda l: jnp.sum(_apply(l, rhs, (_st(), _st(), _st()), gs) * ct))(lhs)
  assert not np.any(np.asarray(d_l[6:]))


def test_bad_input_is_named():
  lhs, rhs, _ = _data()
  with pytest.raises(ValueError, match="group_sizes"):
    _apply(lhs, rhs, (_st(), _st(), _st()), np.array([1.0, 2.0, 3.0, 4.0]))
  with pytest.raises(ValueError, match="rhs"):
    _apply(lhs, rhs[:, :3], (_st(), _st(), _st()))
  with pytest.raises(ValueError, match="granularity"):
    _apply(lhs, rhs, (_st(), _st(), _st()), recipe=fl.rowwise_scaling())


_E4M3_GRADS = fl.Fp8Recipe(output_grad=fl.ScalingConfig(dtype="float8_e4m3fn"))
_K8 = ("pallas-grouped-gemm", "f8e4m3fn", "f8e4m3fn")
_K16 = ("pallas-grouped-gemm", "f16", "f16")
_MIXED = ("cublas", "f8e4m3fn", "f8e5m2")

# (target, recipe, groups, pallas kernels, what the step's three grouped GEMMs are fed)
_TARGET_CASES = [
    # The library's Triton grouped GEMMs (each row by its own group's weight): the forward
    # on the e4m3 codes; the two gradients multiply e5m2 by e4m3, which Pallas' Triton
    # lowering takes only as float16 (exact; half the fp8 rate, a quarter of the work here).
    ("h100", fl.Fp8Recipe(), 4, "auto",
     [_K8] + [_K16] * 2),
    # Gradients in e4m3 too: all three are fp8 grouped kernels.
    ("h100", _E4M3_GRADS, 4, "auto", [_K8] * 3),
    # Two groups: XLA's fp8 GEMM over both is cheaper than float16 over the routed rows.
    ("h100", fl.Fp8Recipe(), 2, "auto",
     [_K8] + [_MIXED] * 2),
    # Kernels off: XLA's cuBLASLt fp8 GEMMs, each dense over every group.
    ("h100", fl.Fp8Recipe(), 4, "off", [("cublas", "f8e4m3fn", "f8e4m3fn")] + [_MIXED] * 2),
    ("b200", fl.Fp8Recipe(), 4, "auto", [_K8] + [_K16] * 2),
    # XLA:TPU's Mosaic grouped GEMM for the forward and dgrad (fed the fp8 codes), JAX's
    # megablox tgmm for the wgrad (bf16: it takes no fp8), where XLA would convolve over
    # every group.
    ("tpu7x", fl.Fp8Recipe(gemm="fp8"), 4, "auto", None),
    ("tpu-v6e", fl.Fp8Recipe(), 4, "auto", None),  # no fp8 MXU mode: the codes as bf16
    ("tpu-v6e", fl.Fp8Recipe(), 4, "off", None),   # kernels off: XLA's wgrad convolution
]
_TPU_CLASSES = {"tpu7x": {"fp8": 2, "bf16": 1}, "tpu-v6e": {"bf16": 3}}


def _fed(p):
  """(kind, its two operand types, sorted)."""
  return (p.kind,) + tuple(sorted(p.operands))


@pytest.mark.parametrize(
    "target,recipe,groups,kernels,expected", _TARGET_CASES,
    ids=[f"{c[0]}-{'e4m3grads' if c[1] is _E4M3_GRADS else c[1].gemm}-g{c[2]}-{c[3]}"
         for c in _TARGET_CASES])
def test_each_target_runs_the_three_grouped_gemms(require_target, target, recipe, groups,
                                                  kernels, expected):
  t = require_target(target)
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel

  gs = np.array([128, 0, 256, 128] if groups == 4 else [192, 320], np.int32)
  k = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(k[0], (512, 256), jnp.bfloat16)
  rhs = jax.random.normal(k[1], (groups, 256, 384))
  ct = jax.random.normal(k[2], (512, 384), jnp.bfloat16)

  def step(lhs, rhs, ct, states):
    loss = lambda l, w, s: jnp.sum(_apply(l, w, s, gs=gs, recipe=recipe) * ct)
    # The loss too: without it XLA deletes the forward product.
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(lhs, rhs, states)

  # Per-expert kernel scales, as quantize_model keeps them.
  kernel = owg.RoleState(jnp.ones((groups, 1)), jnp.zeros((groups, 16)))
  with fl.pallas_kernels(kernels):
    report = compile_for(t, step, lhs, rhs, ct, (_st(), kernel, _st()))
  routed = 2 * 512 * 256 * 384
  if t.platform == "tpu":
    assert report.classes == _TPU_CLASSES[target], report.classes
    grouped = [p for p in report.product_list if p.kind == "mosaic-grouped-gemm"]
    assert len(grouped) == (2 if kernels == "off" else 3), report.product_list
    assert all(p.flops == routed for p in grouped), grouped
    if kernels == "off":  # the wgrad: a convolution over all 4 groups
      (conv,) = [p for p in report.product_list if p.kind == "convolution"]
      assert conv.flops == 4 * routed
    return
  assert sorted(map(_fed, report.product_list)) == sorted(expected), report.product_list
  # A kernel multiplies the routed rows once; XLA's GEMMs every row by every group.
  for p in report.product_list:
    assert p.flops == routed * (1 if p.kind == "pallas-grouped-gemm" else groups), p


def test_expert_parallel_experts_run_the_grouped_kernels_on_8_h100s(require_target):
  """Expert parallelism: each of 8 devices holds 4 experts and the rows routed to them.

  Inside ``shard_map`` every device runs the three grouped GEMMs of its own experts in the
  library's kernels (compile only), and the tokens' and gradient's scales come from amaxes
  reduced over the devices.
  """
  require_target("h100x8")
  from fp8_linen.testing import targets  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel
  spec = jax.sharding.PartitionSpec
  mesh = targets.target_mesh("h100x8")
  sizes = np.array([32, 0, 64, 32], np.int32)  # each device's rows for its 4 experts
  k = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(k[0], (8 * 128, 256), jnp.bfloat16)
  rhs = jax.random.normal(k[1], (8 * 4, 256, 128))
  ct = jax.random.normal(k[2], (8 * 128, 128), jnp.bfloat16)
  kernel = owg.RoleState(jnp.ones((32, 1)), jnp.zeros((32, 16)))
  per_expert = owg.RoleState(spec("d"), spec("d"))

  def body(lhs, rhs, ct, states):
    loss = lambda l, w, s: jnp.sum(_apply(l, w, s, gs=sizes, recipe=fl.Fp8Recipe()) * ct)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(lhs, rhs, states)
    return jax.lax.psum(value, "d"), grads

  step = jax.shard_map(
      body, mesh=mesh, in_specs=(spec("d"), spec("d"), spec("d"), (spec(), per_expert, spec())),
      out_specs=(spec(), (spec("d"), spec("d"), (spec(), per_expert, spec()))))
  report = compile_for("h100x8", step, lhs, rhs, ct, (_st(), kernel, _st()))
  assert sorted(map(_fed, report.product_list)) == sorted([_K8] + [_K16] * 2), \
      report.product_list
  # Each device's routed rows only: 128 rows x 256 x 128 per product.
  assert all(p.flops == 2 * 128 * 256 * 128 for p in report.product_list)
  assert report.collective_totals.get("all-reduce", (0,))[0] >= 1  # the amaxes over devices
