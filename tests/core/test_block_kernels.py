"""The Pallas kernel of MX codes (interpret mode on CPU): bit-exact with the jnp reference.

The kernel reads an operand once and writes its codes blocked along each
axis; ``block_numerics.block_quantize`` of the operand and of its transpose
is the reference. The layer tests run a whole MXFP8 training step with the
kernels in Pallas' interpreter and without them: every output, gradient and
new state must be the same bits. Where the kernel compiles (B200) is checked
in tests/targets/test_passes.py.
"""

from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import block_kernels, block_numerics, randomness


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _assert_same_codes(got, want):
  """Equal bits, except that a NaN may be any of its format's NaN patterns (e5m2 has several)."""
  g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
  np.testing.assert_array_equal(np.where(np.isnan(g), 0, _bits(got)),
                                np.where(np.isnan(w), 0, _bits(want)))


def _wide(key, shape):
  """Values spanning 2**-40 .. 2**40, so block scales differ from block to block."""
  k1, k2 = jax.random.split(key)
  mag = jnp.exp2(jax.random.randint(k2, shape, -40, 40).astype(jnp.float32))
  return jax.random.normal(k1, shape, jnp.float32) * mag


@pytest.mark.parametrize("shape,dtype,block", [
    ((1, 32, 64), jnp.float8_e4m3fn, 32),       # one 32 x 64 tile
    ((2, 256, 96), jnp.float8_e4m3fn, 32),      # 128 x 32 tiles, a batch
    ((1, 192, 320), jnp.float8_e5m2, 32),       # 64 x 64 tiles, e5m2 (a gradient)
    ((3, 64, 128), jnp.float8_e4m3fn, 16),      # blocks of 16
])
def test_codes_and_scales_are_block_quantize_bits(shape, dtype, block):
  x = _wide(jax.random.key(0), shape)
  x = x.at[0, :block, -block:].set(0.0)
  x = x.at[0, 1, 2].set(jnp.nan).at[-1, -1, -block - 1].set(-jnp.inf)
  with fl.pallas_kernels("interpret"):
    (q, s), (qt, st), a = block_kernels.mx_codes_both(x, dtype, block)
  # The kernel reads a NaN as Inf (every block holding it becomes NaN codes on
  # every backend); the reference leaves that to the backend's max-reduction.
  ref = jnp.where(jnp.isnan(x), jnp.inf, x)
  rq, rs = block_numerics.block_quantize(ref, block, dtype)
  rqt, rst = block_numerics.block_quantize(jnp.swapaxes(ref, 1, 2), block, dtype)
  chex.assert_shape([q, qt, s, st], [shape, (shape[0], shape[2], shape[1]),
                                     shape[:2] + (shape[2] // block,),
                                     (shape[0], shape[2], shape[1] // block)])
  assert q.dtype == qt.dtype == dtype and s.dtype == st.dtype == jnp.float8_e8m0fnu
  for got, want in [(q, rq), (s, rs), (qt, rqt), (st, rst)]:
    _assert_same_codes(got, want)
  assert float(a) == np.inf  # NaN and Inf: the tensor is non-finite
  # A block holding NaN is all NaN codes, each way; its neighbours are not.
  assert np.isnan(np.asarray(q[0, 1, :block], np.float32)).all()
  assert np.isnan(np.asarray(qt[0, 2, :block], np.float32)).all()
  assert not np.isnan(np.asarray(q[0, 2, :block], np.float32)).any()
  # Elsewhere the reference on x itself agrees: only NaN's blocks differ.
  own, _ = block_numerics.block_quantize(x, block, dtype)
  _assert_same_codes(q[:, 2:], own[:, 2:])
  # The zero block: zero codes, scale 1 (bits 127).
  assert (_bits(q[0, :block, -block:]) == 0).all() and (_bits(s[0, :block, -1]) == 127).all()


def test_amax_is_the_tensors_on_finite_input():
  x = jax.random.normal(jax.random.key(1), (2, 128, 64), jnp.bfloat16) * 3
  with fl.pallas_kernels("interpret"):
    *_, a = block_kernels.mx_codes_both(x, jnp.float8_e4m3fn, 32)
  assert a.dtype == jnp.float32
  assert float(a) == float(np.abs(np.asarray(x, np.float32)).max())


def test_tiles_and_errors():
  assert block_kernels.tile_sizes(256, 96, 32) == (128, 32)
  assert block_kernels.tile_sizes(64, 48, 16) is None     # 48: no power-of-two tile
  assert block_kernels.tile_sizes(64, 64, 24) is None     # a block that is no power of two
  with pytest.raises(ValueError, match=r"\(64, 48\) tensor is not whole tiles"):
    block_kernels.mx_codes_both(jnp.ones((1, 64, 48)), jnp.float8_e4m3fn, 16)
  with pytest.raises(ValueError, match="mode='on' must be one of"):
    with fl.pallas_kernels("on"):
      pass
  # A launch tile is taken only where the tensor is whole tiles of it, each edge whole blocks.
  with mock.patch.dict(block_kernels._LAUNCH, {"mx_codes_both": {"tile": (64, 128), "num_warps": 4}}):
    assert block_kernels._preferred("mx_codes_both", 256, 256, (128, 128), 32) == (64, 128)
    assert block_kernels._preferred("mx_codes_both", 96, 256, (32, 128), 32) == (32, 128)
    assert block_kernels._preferred("mx_codes_both", 256, 256, (128, 128), 128) == (128, 128)


def test_where_the_kernel_runs():
  t = jnp.ones((1, 64, 64))
  assert block_kernels.kernel_mode(t, 32, gemm="block") is None           # CPU: jnp
  one = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
  with fl.target_backend("gpu", block_scaled=True):
    with jax.set_mesh(one):
      assert block_kernels.kernel_mode(t, 32, gemm="block") == "compiled"   # Blackwell
      assert block_kernels.kernel_mode(t, 32, gemm="bf16") is None          # emulated GEMMs
      with fl.pallas_kernels("off"):
        assert block_kernels.kernel_mode(t, 32, gemm="block") is None
    if len(jax.devices()) > 1:
      # jit over several devices: XLA would gather the operand for the kernel.
      with jax.set_mesh(jax.make_mesh((len(jax.devices()),), ("d",))):
        assert block_kernels.kernel_mode(t, 32, gemm="block") is None
  with fl.pallas_kernels("interpret"):
    assert block_kernels.kernel_mode(t, 32, gemm="bf16") == "interpret"
    assert block_kernels.kernel_mode(jnp.ones((1, 64, 48)), 16, gemm="bf16") is None


def test_e2m1_codes_are_the_casts_bits():
  """Round half to even on e2m1's grid, signed zeros and saturation, in integer arithmetic."""
  y = jnp.concatenate([jnp.linspace(-6.0, 6.0, 24001),
                       jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.2, 4.9, 5.1])])
  codes = block_numerics.e2m1_codes(y)
  want = _bits(y.astype(jnp.float4_e2m1fn).astype(jnp.float8_e4m3fn))  # via a byte-wide dtype
  got = _bits(jnp.asarray(block_kernels._unpack(  # pylint: disable=protected-access
      block_kernels._pack(codes.reshape(1, -1)))).reshape(-1)  # pylint: disable=protected-access
              .astype(jnp.float8_e4m3fn))
  np.testing.assert_array_equal(got, want)
  assert codes.dtype == jnp.uint8 and int(codes.max()) <= 15


@pytest.mark.parametrize("shape,hadamard,noise", [
    ((1, 32, 32), 16, True),      # one tile: a gradient (rotated, stochastic rounding)
    ((2, 96, 64), 16, False),     # the input's copies: rotated, round to nearest
    ((1, 64, 128), 0, True),      # no rotation
    ((1, 64, 32), 32, False),     # a rotation as long as the tile
])
def test_nvfp4_codes_are_block_quantize_bits(shape, hadamard, noise):
  x = _wide(jax.random.key(4), shape) * 1e-8
  x = x.at[0, 0, 3].set(jnp.inf).at[-1, -1, -1].set(jnp.nan)
  seed = jnp.uint32(2024)
  keys = (randomness.noise_key(seed, 1), randomness.noise_key(seed, 2)) if noise else None
  g, g_t = jnp.float32(3e-4), jnp.float32(7e-5)
  with fl.pallas_kernels("interpret"):
    a, a_t = block_kernels.nvfp4_amaxes(x, hadamard)
    (q, s), (qt, st) = block_kernels.nvfp4_codes_both(x, g, g_t, hadamard=hadamard, keys=keys)
  ref = jnp.where(jnp.isnan(x), jnp.inf, x)
  rot = jnp.swapaxes(ref, 1, 2)
  rot = randomness.random_hadamard(rot, hadamard) if hadamard else rot
  u = lambda t, salt: randomness.uniform_noise(t.shape, seed, salt) if noise else None
  rq, rs = block_numerics.block_quantize(ref, 16, jnp.float4_e2m1fn, tensor_scale=g,
                                         noise=u(ref, 1))
  rqt, rst = block_numerics.block_quantize(rot, 16, jnp.float4_e2m1fn, tensor_scale=g_t,
                                           noise=u(rot, 2))
  assert q.dtype == qt.dtype == jnp.float4_e2m1fn and s.dtype == st.dtype == jnp.float8_e4m3fn
  chex.assert_shape([q, s, qt, st], [shape, shape[:2] + (shape[2] // 16,),
                                     (shape[0], shape[2], shape[1]),
                                     (shape[0], shape[2], shape[1] // 16)])
  as_f32 = lambda t: np.asarray(t.astype(jnp.float32))
  for got, want in [(q, rq), (qt, rqt)]:
    np.testing.assert_array_equal(as_f32(got), as_f32(want))
    np.testing.assert_array_equal(np.signbit(as_f32(got)), np.signbit(as_f32(want)))
  for got, want in [(s, rs), (st, rst)]:
    _assert_same_codes(got, want)
  assert float(a) == np.inf and float(a_t) == np.inf
  # The two non-finite blocks get NaN scales, the others are finite.
  assert np.isnan(as_f32(s[0, 0, 0])) and np.isnan(as_f32(s)).sum() == 2
  finite = x.at[0, 0, 3].set(1.0).at[-1, -1, -1].set(1.0)
  with fl.pallas_kernels("interpret"):
    a, a_t = block_kernels.nvfp4_amaxes(finite, hadamard)
  rot = jnp.swapaxes(finite, 1, 2)
  rot = randomness.random_hadamard(rot, hadamard) if hadamard else rot
  assert float(a) == float(jnp.max(jnp.abs(finite)))
  # The rotation's float32 sums are a fixed tree of pairwise adds, but XLA may
  # still merge its levels into one reduction, in its own order, in one
  # program and not another (seen on jax 0.10.0 for the whole tensor and not
  # the tile): the rotated amax may differ by a rounding there.
  np.testing.assert_allclose(float(a_t), float(jnp.max(jnp.abs(rot))), rtol=1e-6)


def test_nvfp4_weight_tiles_are_block_quantize_bits():
  """The weight's 16 x 16 tiles: one set of codes, written in both layouts."""
  x = _wide(jax.random.key(6), (2, 64, 96)) * 1e-6
  x = x.at[0, 3, 4].set(jnp.nan)
  with fl.pallas_kernels("interpret"):
    (q, s), (qt, st) = block_kernels.nvfp4_tile_codes_both(x, jnp.float32(1e-3))
  ref = jnp.where(jnp.isnan(x), jnp.inf, x)
  quant = lambda t: block_numerics.block_quantize(t, 16, jnp.float4_e2m1fn,
                                                  tensor_scale=jnp.float32(1e-3), tile=True)
  as_f32 = lambda t: np.asarray(t.astype(jnp.float32))
  for (got_q, got_s), (want_q, want_s) in [((q, s), quant(ref)),
                                           ((qt, st), quant(jnp.swapaxes(ref, 1, 2)))]:
    np.testing.assert_array_equal(as_f32(got_q), as_f32(want_q))
    np.testing.assert_array_equal(as_f32(got_s), as_f32(want_s))
  np.testing.assert_array_equal(as_f32(qt), as_f32(jnp.swapaxes(q, 1, 2)))  # the same codes
  assert np.isnan(as_f32(s[0, :16, 0])).all() and np.isnan(as_f32(s)).sum() == 16


def test_kernels_round_a_float32_operand_as_they_read_it():
  """``round_to``: the codes and amaxes of the rounded tensor, from the unrounded one.

  A bfloat16 layer hands its float32 weight to the kernels uncast; each must
  give the bits it gives the bfloat16 copy the layer would have written.
  """
  x = jax.random.normal(jax.random.key(9), (2, 64, 128), jnp.float32) * 1e-3
  x = x.at[0, 5, 7].set(jnp.nan).at[1, 3, 3].set(3e38)   # 3e38 rounds to Inf in bf16
  r = x.astype(jnp.bfloat16)
  g, g_t = jnp.float32(3e-6), jnp.float32(5e-6)
  runs = {
      "mx": lambda t, **kw: block_kernels.mx_codes_both(t, jnp.float8_e4m3fn, 32, **kw),
      "nv_amaxes": lambda t, **kw: block_kernels.nvfp4_amaxes(t, 16, **kw),
      "nv_codes": lambda t, **kw: block_kernels.nvfp4_codes_both(t, g, g_t, hadamard=16, **kw),
      "nv_tiles": lambda t, **kw: block_kernels.nvfp4_tile_codes_both(t, g, **kw),
  }
  as_f32 = lambda t: jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), t)
  finite = x.at[1, 3, 3].set(0.5 + 2.0**-20).at[0, 5, 7].set(0.25)   # its max is no bf16
  with fl.pallas_kernels("interpret"):
    for name, run in runs.items():
      chex.assert_trees_all_equal(as_f32(run(x, round_to=jnp.bfloat16)), as_f32(run(r)),
                                  custom_message=name)
    # The rounding is real: the float32 tensor's own amax is not the rounded one's.
    *_, a_own = block_kernels.mx_codes_both(finite, jnp.float8_e4m3fn, 32)
    *_, a_rounded = block_kernels.mx_codes_both(finite, jnp.float8_e4m3fn, 32,
                                                round_to=jnp.bfloat16)
  assert float(a_own) == float(jnp.max(jnp.abs(finite)))
  assert float(a_rounded) == float(jnp.max(jnp.abs(finite.astype(jnp.bfloat16))))
  assert float(a_own) != float(a_rounded)


def _step(model, x):
  v = jax.jit(model.init)(jax.random.key(1), x)  # op by op, a block layer's init costs seconds

  def loss(v, x):
    y = model.apply(v, x).astype(jnp.float32)
    return jnp.sum(y * jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

  return v, jax.value_and_grad(loss, argnums=(0, 1))


def _pallas_calls(fn, *args):
  return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


class KernelInLayerTest(chex.TestCase):

  # Jitted only: the kernels' eager (op by op) runs are the kernel tests' above.
  @chex.variants(with_jit=True)
  def test_mxfp8_step_is_the_same_bits_with_and_without_the_kernel(self):
    model = fl.QDense(128, dtype=jnp.bfloat16, recipe=fl.mx_block_scaling())
    x = jax.random.normal(jax.random.key(0), (4, 64, 256), jnp.bfloat16)
    v, fn = _step(model, x)
    step = self.variant(fn)
    with fl.pallas_kernels("off"):
      want = step(v, x)
      assert _pallas_calls(fn, v, x) == 0
    with fl.pallas_kernels("interpret"):
      got = step(v, x)
      # The input, the kernel and the output gradient: one kernel call each.
      assert _pallas_calls(fn, v, x) == 3
    chex.assert_trees_all_equal(got, want)
    # The new state is real: the input's amax history took this batch's amax.
    hist = got[1][0][fl.OWG]["input_amax_history"]
    assert float(hist[0]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))

  def test_nvfp4_steps_are_the_same_bits_with_and_without_the_kernels(self):
    """NVIDIA's recipe and its variants: every output, gradient and new state."""
    x = jax.random.normal(jax.random.key(5), (2, 64, 128), jnp.bfloat16)
    # Two kernels per operand: its amax(es), then its codes.
    for recipe in [fl.nvfp4(), fl.nvfp4(kernel_2d_blocks=False),
                   fl.nvfp4(scaling="delayed", wgrad_hadamard=0, grad_stochastic_rounding=False)]:
      v, fn = _step(fl.QDense(64, dtype=jnp.bfloat16, recipe=recipe), x)
      with fl.pallas_kernels("off"):
        want = jax.jit(fn)(v, x)
      with fl.pallas_kernels("interpret"):
        got = jax.jit(fn)(v, x)
        assert _pallas_calls(fn, v, x) == 6
      chex.assert_trees_all_equal(got, want)

  def test_layouts_the_kernel_cannot_write_keep_the_jnp_path(self):
    """A contraction over a leading axis needs a transpose first; NVFP4's 4/6 choice is jnp's."""
    x = jax.random.normal(jax.random.key(2), (64, 4, 96), jnp.bfloat16)
    for model, calls in [
        (fl.QDenseGeneral(64, axis=0, dtype=jnp.bfloat16, recipe=fl.mx_block_scaling()), 2),
        (fl.QDense(64, dtype=jnp.bfloat16, recipe=fl.nvfp4(four_over_six=True)), 0)]:
      v, fn = _step(model, x)
      with fl.pallas_kernels("off"):
        want = jax.jit(fn)(v, x)
      with fl.pallas_kernels("interpret"):
        got = jax.jit(fn)(v, x)
        # QDenseGeneral(axis=0): the kernel (K, N) and the gradient still qualify.
        assert _pallas_calls(fn, v, x) == calls
      chex.assert_trees_all_equal(got, want)


def test_inside_shard_map_the_b200_step_runs_the_kernel(require_target):
  """Expert or data parallel code quantizes each device's own rows with the kernel.

  Compiled for a B200 (compile only). Pallas' interpreter rejects shard_map's
  varying values, so on a CPU only the weight (replicated) takes the kernel
  there, with the same result as the jnp path.
  """
  require_target("b200")
  from fp8_linen.testing import targets  # pylint: disable=import-outside-toplevel
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel
  model = fl.QDense(256, dtype=jnp.bfloat16, recipe=fl.mx_block_scaling())
  x = jax.random.normal(jax.random.key(3), (256, 128), jnp.bfloat16)
  v, fn = _step(model, x)
  spec = jax.sharding.PartitionSpec

  def sharded(mesh):
    def body(v, x):  # the loss too, or XLA drops the forward GEMM
      loss, grads = fn(v, x)
      return jax.lax.psum(loss, "d"), grads

    return lambda v, x: jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec("d")),
                                      out_specs=(spec(), (spec(), spec("d"))))(v, x)

  report = compile_for("b200", sharded(targets.target_mesh("b200")), v, x)
  assert sum("pallas" in k.name for k in report.kernel_list) == 3, report.kernel_list
  assert report.classes == {"fp8": 3}, report.classes  # cuDNN block-scaled dots
  cpu = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2],
                      axis_types=(jax.sharding.AxisType.Auto,))
  with fl.pallas_kernels("off"):
    want = jax.jit(sharded(cpu))(v, x)
  with fl.pallas_kernels("interpret"):
    got = jax.jit(sharded(cpu))(v, x)
    assert _pallas_calls(sharded(cpu), v, x) == 1  # the weight: the same on every device
  chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("recipe", [fl.mx_block_scaling(), fl.nvfp4()], ids=["mxfp8", "nvfp4"])
def test_kernels_under_remat_and_vmap(recipe):
  """A rematerialized forward runs the kernels again; vmap batches them (a grid axis).

  NVFP4 under vmap: the forward and the new state are the same bits, and so
  are the gradients but for a few elements of the weight's: the interpreted,
  batched kernel's rotation sums (float32, 16 terms) come out of XLA:CPU in
  another order than the jnp path's, and a rare block rounds the other way
  (seen: one scale and two codes of 8192 in the input's wgrad copy).
  """
  model = fl.QDense(128, dtype=jnp.bfloat16, recipe=recipe)
  x = jax.random.normal(jax.random.key(7), (3, 64, 128), jnp.bfloat16)
  v = jax.jit(model.init)(jax.random.key(1), x[0])

  def loss(v, x):
    y = model.apply(v, x)
    return jnp.sum(y.astype(jnp.float32) ** 2), y

  grad = jax.grad(loss, has_aux=True)
  per_step = 3 if recipe.input.dtype == "float8_e4m3fn" else 6
  nvfp4 = per_step == 6
  remat = jax.grad(jax.checkpoint(loss), has_aux=True)
  cases = {"remat": (lambda v, x: remat(v, x[0]), per_step + 2 * (per_step // 3)),
           "vmap": (lambda v, x: jax.vmap(lambda xi: grad(v, xi))(x), per_step)}
  for name, (fn, calls) in cases.items():
    with fl.pallas_kernels("off"):
      want = jax.jit(fn)(v, x)
    with fl.pallas_kernels("interpret"):
      got = jax.jit(fn)(v, x)
      assert _pallas_calls(fn, v, x) == calls, name
    if name == "vmap" and nvfp4:
      (g_got, y_got), (g_want, y_want) = got, want
      chex.assert_trees_all_equal(y_got, y_want)
      chex.assert_trees_all_equal(g_got[fl.OWG], g_want[fl.OWG])
      k_got, k_want = (np.asarray(g["params"]["kernel"]) for g in (g_got, g_want))
      assert (k_got != k_want).mean() < 0.01, name
      continue
    chex.assert_trees_all_equal(got, want)
