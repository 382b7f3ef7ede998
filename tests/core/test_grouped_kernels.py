"""The Pallas grouped GEMMs (``core.grouped_kernels``) against ``jax.lax.ragged_dot``.

In Pallas' interpreter on the CPU (unwritten output is NaN there, so a row
the kernel forgets shows). Operands are small integers in their 8-bit
formats, so every float32 sum is exact in any order and the kernel must
match XLA's product bit for bit; int8 codes are exact for any values. What
each target compiles them to is in test_ragged_dot.py / test_int_ragged_dot.py.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import grouped_kernels as gk
from fp8_linen.core import owg

_WGRAD = gk.WGRAD_DIMENSIONS

# Group sizes over m = 96 rows: empty groups, a group inside one tile, all rows in one
# group, fewer rows than m (the rest must be zero) and more (cut at m).
SIZES = [[10, 0, 40, 30], [0, 0, 0, 0], [96, 0, 0, 0], [3, 5, 0, 88], [50, 50, 10, 0]]


def _ints(key, shape, dtype, lo=-4, hi=5):
  return jax.random.randint(key, shape, lo, hi).astype(dtype)


@pytest.mark.parametrize("sizes", SIZES, ids=[str(s) for s in SIZES])
def test_row_tiles_store_every_row_once_for_its_group(sizes):
  m, tm = 96, 16
  gs = np.array(sizes, np.int32)
  rng, tile, lo, hi = map(np.asarray, gk.row_tiles(jnp.asarray(gs), m, tm))
  assert len(rng) == m // tm + len(gs)
  ends = np.minimum(np.cumsum(gs), m)
  owner = np.searchsorted(ends, np.arange(m), side="right")  # len(gs): past the groups
  stored = np.zeros(m, int)
  for r, t, a, b in zip(rng, tile, lo, hi):
    rows = np.arange(t * tm, (t + 1) * tm)
    mine = rows[(rows >= a) & (rows < b)]
    stored[mine] += 1
    assert (owner[mine] == r).all()
  np.testing.assert_array_equal(stored, 1)


class KernelTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_the_three_products_match_ragged_dot_bit_for_bit(self):
    m, k, n = 96, 64, 48
    keys = jax.random.split(jax.random.key(0), 4)
    x = _ints(keys[0], (m, k), jnp.float8_e4m3fn)
    w = _ints(keys[1], (4, k, n), jnp.float8_e4m3fn)
    g = _ints(keys[2], (m, n), jnp.float8_e5m2)
    f32 = lambda a: a.astype(jnp.float32)

    @self.variant
    def kernels(x, w, g, gs):
      with fl.pallas_kernels("interpret"):
        return (gk.grouped_gemm(x, w, gs),
                gk.grouped_gemm(g, w, gs, transpose_rhs=True),  # e5m2 x e4m3: float16 dots
                gk.grouped_wgrad(x, g, gs),
                # The operands stored with the routed rows last.
                gk.grouped_wgrad(x.T, g.T, gs, transposed=True))

    for sizes in SIZES:
      gs = jnp.array(sizes, jnp.int32)
      y, dx, dw, dw_t = kernels(x, w, g, gs)
      want_dw = jax.lax.ragged_dot_general(f32(x), f32(g), gs, _WGRAD)
      chex.assert_trees_all_equal(
          (y, dx, dw, dw_t),
          (jax.lax.ragged_dot(f32(x), f32(w), gs),
           jax.lax.ragged_dot(f32(g), jnp.swapaxes(f32(w), 1, 2), gs), want_dw, want_dw))
      chex.assert_type((y, dx, dw, dw_t), jnp.float32)

  @chex.variants(with_jit=True, without_jit=True)
  def test_int8_codes_accumulate_in_int32_exactly(self):
    m, k, n = 64, 128, 32
    keys = jax.random.split(jax.random.key(1), 3)
    x = _ints(keys[0], (m, k), jnp.int8, -127, 128)
    w = _ints(keys[1], (3, k, n), jnp.int8, -127, 128)
    g = _ints(keys[2], (m, n), jnp.int8, -127, 128)
    gs = jnp.array([20, 0, 40], jnp.int32)

    @self.variant
    def kernels(x, w, g):
      with fl.pallas_kernels("interpret"):
        return (gk.grouped_gemm(x, w, gs), gk.grouped_wgrad(x, g, gs),
                gk.grouped_wgrad(x.T, g.T, gs, transposed=True))

    y, dw, dw_t = kernels(x, w, g)
    chex.assert_type((y, dw, dw_t), jnp.int32)
    want_dw = jax.lax.ragged_dot_general(x, g, gs, _WGRAD, preferred_element_type=jnp.int32)
    chex.assert_trees_all_equal(
        (y, dw, dw_t), (jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.int32),
                        want_dw, want_dw))


def _fp8_step(lhs, rhs, ct, gs):
  st = lambda shape: owg.RoleState(jnp.ones(shape), jnp.zeros(shape[:-1] + (4,)))

  def loss(lhs, rhs, states):
    y, _ = fl.fp8_ragged_dot(lhs, rhs, gs, input_state=states[0], kernel_state=states[1],
                             output_grad_state=states[2], recipe=fl.delayed_scaling(
                                 history_length=4))
    return jnp.sum(y * ct)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
      lhs, rhs, (st((1,)), st((rhs.shape[0], 1)), st((1,))))


def test_fp8_ragged_dot_with_the_kernels_is_the_same_step():
  # Delayed scaling starts at scale 1: small integers are their own codes, so the
  # kernels' step (forward, dgrad, wgrad, new state) must equal XLA's bit for bit.
  keys = jax.random.split(jax.random.key(2), 3)
  lhs = _ints(keys[0], (96, 64), jnp.float32)
  rhs = _ints(keys[1], (4, 64, 48), jnp.float32)
  ct = _ints(keys[2], (96, 48), jnp.float32)
  gs = jnp.array([10, 0, 40, 30], jnp.int32)
  with fl.pallas_kernels("interpret"):
    kernels = _fp8_step(lhs, rhs, ct, gs)
  with fl.pallas_kernels("off"):
    xla = _fp8_step(lhs, rhs, ct, gs)
  chex.assert_trees_all_equal(kernels, xla)
  loss, (d_lhs, d_rhs, _) = kernels
  assert float(loss) != 0 and float(jnp.abs(d_rhs[1]).max()) == 0  # the empty expert
  assert bool(jnp.all(d_lhs[80:] == 0))                          # rows past the groups


def test_int8_grad_bits_experts_with_the_kernels_are_the_same_step():
  from fp8_linen.core import int_product  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(3), 2)
  x = jax.random.normal(keys[0], (64, 64))
  w = jax.random.normal(keys[1], (2, 64, 32))
  gs = jnp.array([24, 30], jnp.int32)
  recipe = fl.IntRecipe(gemm="int8", grad_bits=8,
                        kernel=fl.IntQuantConfig(granularity="channel"))

  def step():
    loss = lambda x, w: jnp.sum(int_product.int_ragged_dot(
        x, w, gs, recipe=recipe, input_params=(jnp.zeros((2,)),))[0] ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  with fl.pallas_kernels("interpret"):
    kernels = step()
  with fl.pallas_kernels("off"):
    xla = step()
  chex.assert_trees_all_equal(kernels, xla)


def test_where_the_kernels_run():
  x = jnp.zeros((64, 32), jnp.float8_e4m3fn)
  assert gk.kernel_mode(x, 16, gpu_kernel=True) is None          # a CPU: XLA's product
  one = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
  with fl.target_backend("gpu"), jax.set_mesh(one):
    assert gk.kernel_mode(x, 16, gpu_kernel=True) == "compiled"
    assert gk.kernel_mode(x, 16, gpu_kernel=False) is None       # a bf16 product
    assert gk.kernel_mode(x, 24, gpu_kernel=True) is None        # not whole tiles
    with fl.pallas_kernels("off"):
      assert gk.kernel_mode(x, 16, gpu_kernel=True) is None
  if len(jax.devices()) > 1:  # jit over several devices: XLA's (a Pallas call has no
    with fl.target_backend("gpu"):  # partitioning rule)
      assert gk.kernel_mode(x, 16, gpu_kernel=True) is None
  with fl.pallas_kernels("interpret"):
    assert gk.kernel_mode(x, 16, gpu_kernel=False) == "interpret"
  assert gk.tiles(0, 32, 32) is None  # an empty batch keeps XLA's product
  with fl.pallas_kernels("interpret"):
    empty = gk.ragged_product(jnp.zeros((0, 32)), jnp.zeros((2, 32, 16)), jnp.array([0, 0]),
                              gpu_kernel=True)
  assert empty.shape == (0, 16)
  # Mixed fp8 multiplies in float16 in the kernel: worth it from three groups on.
  assert gk.pays(jnp.float8_e4m3fn, jnp.float8_e4m3fn, 2)
  assert not gk.pays(jnp.float8_e5m2, jnp.float8_e4m3fn, 2)
  assert gk.pays(jnp.float8_e5m2, jnp.float8_e4m3fn, 3)
  assert gk.kernel_name("grouped_wgrad", jnp.float8_e4m3fn, jnp.float8_e5m2) == \
      "fp8_linen_grouped_wgrad_float16"


def test_launch_tiles_follow_the_operand_width_and_the_rows_per_group():
  # The Mixtral-shaped layer: 16-bit tiles keep the contracted edge at 64 (shared memory),
  # 8-bit ones take 128; with 256 groups a row tile is at most their 64 rows each.
  assert gk.tiles(16384, 4096, 14336, "grouped_gemm", groups=8) == (128, 64, 256)
  assert gk.tiles(16384, 4096, 14336, "grouped_gemm_8bit", groups=8) == (128, 128, 256)
  assert gk.tiles(16384, 4096, 14336, "grouped_gemm", groups=256) == (64, 64, 256)
  assert gk.tiles(96, 64, 48, "grouped_gemm_8bit", groups=4) == (16, 64, 16)
  assert gk.tiles(96, 64, 48, "grouped_gemm_8bit", groups=1000) == (16, 64, 16)


# (form, lhs dtype, rhs dtype, whether run() hands the kernel K-major copies): the 8-bit
# forward and the int8 wgrad (measured faster on an H200), never the dgrad (K-major already),
# mixed fp8, fp8 wgrads or 16-bit products.
_I8, _F8, _F5 = jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2
_LAYOUTS = [("fwd", _I8, _I8, True), ("fwd", _F8, _F8, True), ("fwd", jnp.bfloat16,
                                                                jnp.bfloat16, False),
            ("dgrad", _I8, _I8, False), ("dgrad", _F5, _F8, False), ("wgrad", _I8, _I8, True),
            ("wgrad", _F8, _F8, False), ("wgrad", _F8, _F5, False)]


@pytest.mark.parametrize("form,a_dtype,b_dtype,kmajor", _LAYOUTS,
                         ids=[f"{f}-{jnp.dtype(a).name}-{jnp.dtype(b).name}"
                              for f, a, b, _ in _LAYOUTS])
def test_run_hands_eight_bit_kernels_k_major_copies(form, a_dtype, b_dtype, kmajor):
  assert gk.contiguous_contraction(form, a_dtype, b_dtype) == kmajor
  keys = jax.random.split(jax.random.key(5), 3)
  m, k, n = 96, 64, 48
  a = _ints(keys[0], (m, n) if form == "dgrad" else (m, k), a_dtype)
  b = _ints(keys[1], (m, n) if form == "wgrad" else (4, k, n), b_dtype)
  gs = jnp.array([10, 0, 40, 30], jnp.int32)
  kw = {"transpose_rhs": form == "dgrad", "wgrad": form == "wgrad"}
  with fl.pallas_kernels("interpret"):
    fn = lambda a, b: gk.run(a, b, gs, gpu_kernel=True, **kw)
    eqns = [e.primitive.name for e in jax.make_jaxpr(fn)(a, b).eqns]
    got = fn(a, b)
  # The copy is a transpose ahead of the kernel (none inside the program otherwise).
  assert ("transpose" in eqns[:eqns.index("pallas_call")]) == kmajor, eqns
  with fl.pallas_kernels("off"):
    want = gk.ragged_product(a, b, gs, gpu_kernel=True, **kw)
  chex.assert_trees_all_equal(got, want)


def test_shapes_that_are_not_whole_tiles_are_refused():
  with pytest.raises(ValueError, match=r"grouped_gemm: \(40, 24\)"):
    gk.grouped_gemm(jnp.zeros((40, 24)), jnp.zeros((2, 24, 16)), jnp.array([1, 2]))
  with pytest.raises(ValueError, match="grouped_wgrad"):
    gk.grouped_wgrad(jnp.zeros((32, 32)), jnp.zeros((16, 32)), jnp.array([1, 2]))
  # A wgrad contracts the rows: there is no row to scale.
  with pytest.raises(ValueError, match="row_scales .* a wgrad contracts them"):
    gk.ragged_product(jnp.zeros((32, 32)), jnp.zeros((32, 16)), jnp.array([16, 16]),
                      gpu_kernel=True, wgrad=True, row_scales=jnp.ones((32,)))


def _kernel_and_xla(run):
  """``run()`` with the kernels in Pallas' interpreter, then with XLA's product."""
  with fl.pallas_kernels("interpret"):
    kernel = run()
  with fl.pallas_kernels("off"):
    return kernel, run()


@pytest.mark.parametrize("form", ["forward", "dgrad", "wgrad"])
def test_scaled_outputs_are_xlas_bits(form):
  # Each group's output times its own scale, cast to bf16, in the kernel: the same bits as
  # XLA's product followed by the multiply (ragged_product's other path).
  keys = jax.random.split(jax.random.key(4), 3)
  x = _ints(keys[0], (96, 64), jnp.float8_e4m3fn)
  w = _ints(keys[1], (4, 64, 48), jnp.float8_e4m3fn)
  g = _ints(keys[2], (96, 48), jnp.float8_e4m3fn)
  gs = jnp.array([10, 0, 40, 30], jnp.int32)
  scales = jnp.array([0.37, 3.1, 2.0 ** -9, 1e3], jnp.float32)
  a, b = {"forward": (x, w), "dgrad": (g, w), "wgrad": (x, g)}[form]
  run = lambda: gk.ragged_product(a, b, gs, gpu_kernel=True, transpose_rhs=form == "dgrad",
                                  wgrad=form == "wgrad", scales=scales, out_dtype=jnp.bfloat16)
  kernel, xla = _kernel_and_xla(run)
  chex.assert_type(kernel, jnp.bfloat16)
  chex.assert_trees_all_equal(kernel, xla)
  assert float(jnp.abs(kernel.astype(jnp.float32)).max()) > 0


@pytest.mark.parametrize("form", ["forward", "dgrad", "wgrad"])
def test_int8_sums_scaled_per_column_and_row_are_xlas_bits(form):
  # The integer experts' epilogue: int32 sums times a scale per group and output column
  # (and, in the forward and dgrad, per row), to float32 in the kernel; the same bits as
  # XLA's product followed by the multiplies.
  keys = jax.random.split(jax.random.key(6), 5)
  x = _ints(keys[0], (96, 64), jnp.int8, -127, 128)
  w = _ints(keys[1], (4, 64, 48), jnp.int8, -127, 128)
  g = _ints(keys[2], (96, 48), jnp.int8, -127, 128)
  gs = jnp.array([10, 0, 40, 30], jnp.int32)
  a, b = {"forward": (x, w), "dgrad": (g, w), "wgrad": (x, g)}[form]
  cols = 64 if form == "dgrad" else 48
  scales = jnp.exp2(jax.random.randint(keys[3], (4, cols), -12, 12)) * 0.37
  rows = None if form == "wgrad" else jax.random.uniform(keys[4], (96,), minval=0.01)
  run = lambda: gk.ragged_product(a, b, gs, gpu_kernel=True, transpose_rhs=form == "dgrad",
                                  wgrad=form == "wgrad", scales=scales, row_scales=rows,
                                  out_dtype=jnp.float32)
  kernel, xla = _kernel_and_xla(run)
  chex.assert_type(kernel, jnp.float32)
  chex.assert_trees_all_equal(kernel, xla)
  # And they are the sums scaled: against a float64 reference of the same product.
  f64 = lambda t: np.asarray(t, np.float64)
  if form == "wgrad":
    ends = np.cumsum(gs)
    want = np.stack([f64(x[e - n:e]).T @ f64(g[e - n:e]) for e, n in zip(ends, np.asarray(gs))])
    want = want * f64(scales)[:, None, :]
  else:
    owner = np.searchsorted(np.cumsum(gs), np.arange(96), side="right")
    wt = f64(w) if form == "forward" else np.swapaxes(f64(w), 1, 2)
    want = np.stack([f64(a[r]) @ wt[min(o, 3)] * f64(scales)[min(o, 3)] * f64(rows)[r]
                     if o < 4 else np.zeros(cols) for r, o in enumerate(owner)])
  np.testing.assert_allclose(np.asarray(kernel), want, rtol=1e-6)


def test_the_tpu_wgrad_is_megabloxs_grouped_kernel_bit_for_bit():
  # Pallas' interpreter; the TPU compiles it in test_ragged_dot.py (compile only).
  keys = jax.random.split(jax.random.key(5), 2)
  x = _ints(keys[0], (256, 128), jnp.float8_e4m3fn)
  g = _ints(keys[1], (256, 128), jnp.float8_e5m2)
  gs = jnp.array([100, 0, 130, 10], jnp.int32)  # rows past the groups: in no gradient
  got = gk.tpu_grouped_wgrad(x, g, gs, interpret=True)
  f32 = lambda a: a.astype(jnp.float32)
  chex.assert_trees_all_equal(got, jax.lax.ragged_dot_general(f32(x), f32(g), gs, _WGRAD))
  # Where it runs: a TPU, bf16 always, fp8 codes from three groups on, 128 tiles.
  one = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
  b = jnp.zeros((256, 128), jnp.bfloat16)
  with fl.target_backend("tpu"), jax.set_mesh(one):
    assert gk.tpu_wgrad_pays(b, b, 2) and gk.tpu_wgrad_pays(x, g, 3)
    assert not gk.tpu_wgrad_pays(x, g, 2)
    assert not gk.tpu_wgrad_pays(b[:, :96], b, 4)                # not whole 128 tiles
    assert not gk.tpu_wgrad_pays(b.astype(jnp.int8), b.astype(jnp.int8), 4)  # int8: XLA's
    with fl.pallas_kernels("off"):
      assert not gk.tpu_wgrad_pays(b, b, 4)
  assert not gk.tpu_wgrad_pays(b, b, 4)                          # not traced for a TPU
