"""The Pallas TPU kernel of per-channel int8 weight codes (interpret mode on CPU).

The kernel reads a weight once and writes its codes and per-channel scales;
``int_codes.quantize`` of the rounded weight is the reference, bit for bit.
The layer tests run an integer training step with the kernel in Pallas'
interpreter and without it: every output and gradient must be the same bits,
and the kernel must really have run. Where it compiles (TPU v5e, v6e, 7x) is
checked in tests/targets/test_int_kernels_tpu.py.
"""

from unittest import mock

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import int_codes, int_kernels, lowering

CHANNEL = fl.IntQuantConfig(granularity="channel")


def _weight(key, shape):
  """Normal values with channels of very different ranges, one all zero, one with an Inf."""
  k1, k2 = jax.random.split(key)
  mag = jnp.exp2(jax.random.randint(k2, shape[-1:], -30, 30).astype(jnp.float32))
  w = jax.random.normal(k1, shape, jnp.float32) * mag
  return w.at[..., 0].set(0.0).at[..., 1].set(w[..., 1].at[(0,) * (w.ndim - 1)].set(jnp.inf))


def _reference(w, contract, cfg, round_to):
  op = int_codes.Operand(cfg=cfg, role="kernel", contract=contract)
  c, _, _ = int_codes.quantize(op, w if round_to is None else w.astype(round_to), ())
  return c


@pytest.mark.parametrize("shape,contract,dtype,round_to,cfg", [
    ((64, 256), (0,), jnp.float32, jnp.bfloat16, CHANNEL),        # a Dense's weight
    ((4096, 128), (0,), jnp.float32, jnp.bfloat16, CHANNEL),      # two chunks of rows
    ((96, 384), (0,), jnp.float32, None, CHANNEL),                # float32 codes, 128 lanes
    ((4, 32, 256), (0, 1), jnp.float32, jnp.bfloat16, CHANNEL),   # two contracting axes
    ((64, 256), (0,), jnp.bfloat16, None, CHANNEL),               # a bfloat16 parameter
    ((64, 256), (0,), jnp.float32, jnp.bfloat16,
     fl.IntQuantConfig(granularity="channel", bits=4, narrow_range=True)),
    ((64, 64, 256), (0,), jnp.float32, jnp.bfloat16, CHANNEL),    # attention's (d, heads, hd)
    ((4, 16, 32, 128), (0, 1), jnp.float32, None, CHANNEL),       # and two contracting axes
])
def test_codes_and_scales_are_quantize_bits(shape, contract, dtype, round_to, cfg):
  w = _weight(jax.random.key(0), shape).astype(dtype)
  with fl.pallas_kernels("interpret"):
    assert int_kernels.channel_codes_mode(w, contract, cfg, round_to) == "interpret"
    codes, scale = int_kernels.channel_codes(w, contract, cfg, round_to)
  want = _reference(w, contract, cfg, round_to)
  chex.assert_type([codes, scale], [jnp.int8, jnp.float32])
  chex.assert_shape([codes, scale], [want.codes.shape, want.scale.shape])
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(want.codes))
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(want.scale))
  # The test means something: channels' scales differ, and codes use the grid.
  assert len(np.unique(np.asarray(scale))) > shape[-1] // 2
  assert np.abs(np.asarray(codes)).max() == cfg.qmax


def test_where_the_kernel_runs():
  w = jnp.ones((64, 256))
  mode = lambda *a, **kw: int_kernels.channel_codes_mode(*a, **kw)
  assert mode(w, (0,), CHANNEL) is None                        # 'auto' on a CPU: jnp
  one = jax.make_mesh((1,), ("d",), devices=jax.devices()[:1])
  with lowering.target_backend("tpu"):
    with jax.set_mesh(one):
      assert mode(w, (0,), CHANNEL, jnp.bfloat16) == "compiled"   # traced for a TPU
      with fl.pallas_kernels("off"):
        assert mode(w, (0,), CHANNEL) is None
    if len(jax.devices()) > 1:
      # jit over several devices: XLA would gather the weight for the kernel.
      with jax.set_mesh(jax.make_mesh((len(jax.devices()),), ("d",))):
        assert mode(w, (0,), CHANNEL) is None
  with fl.pallas_kernels("interpret"):
    assert mode(w, (0,), CHANNEL) == "interpret"
    # What the kernel does not serve keeps the jnp path.
    for cfg in (fl.IntQuantConfig(), fl.IntQuantConfig(granularity="channel", symmetric=False),
                fl.IntQuantConfig(granularity="channel", power_of_two=True),
                fl.IntQuantConfig(granularity="channel", estimator="lsq")):
      assert mode(w, (0,), cfg) is None, cfg
    assert mode(w, (1,), CHANNEL) is None                       # contracting axis last
    assert mode(jnp.ones((64, 200)), (0,), CHANNEL) is None     # channels not whole lanes
    assert mode(jnp.ones((64, 32, 128)), (0,), CHANNEL) == "interpret"  # two output axes
    assert mode(jnp.ones((64, 4, 128)), (0,), CHANNEL) is None  # heads not whole int8 tiles
    assert mode(jnp.ones((64, 2, 32, 128)), (0,), CHANNEL) is None  # three output axes
    assert mode(jnp.ones((4, 20, 128)), (0, 1), CHANNEL) is None  # merged rows not whole tiles
    assert mode(jnp.ones((1 << 17, 128)), (0,), CHANNEL) is None  # too tall for VMEM
    with pytest.raises(ValueError, match="not served by the kernel"):
      int_kernels.channel_codes(jnp.ones((64, 200)), (0,), CHANNEL)


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(256, dtype=jnp.bfloat16)(x))
    h = nn.DenseGeneral((32, 128), dtype=jnp.bfloat16)(nn.Dense(128, dtype=jnp.bfloat16)(h))
    return nn.DenseGeneral((2, 128), dtype=jnp.bfloat16)(h[..., 0, :])


@pytest.mark.parametrize("grad_bits", [None, 8])
def test_a_training_step_is_the_same_bits_with_the_kernel(grad_bits):
  recipe = fl.IntRecipe(kernel=CHANNEL, grad_bits=grad_bits)
  model = fl.quantize_model(_Mlp(), recipe)
  x = jax.random.normal(jax.random.key(1), (64, 128), jnp.bfloat16)
  v = model.init(jax.random.key(0), x)

  def loss(v, x):
    return jnp.sum(model.apply(v, x).astype(jnp.float32) ** 2)

  step = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(v, x)
  with fl.pallas_kernels("off"):
    want = step()
  calls = []
  real = int_kernels.channel_codes
  with fl.pallas_kernels("interpret"), mock.patch.object(
      int_kernels, "channel_codes", side_effect=lambda *a, **kw: calls.append(a) or real(*a, **kw)):
    got = step()
  # Both Dense weights (one output axis) and the (in, 32, 128) DenseGeneral's; the
  # (in, 2, 128) one, whose heads are not whole int8 tiles, keeps the jnp path.
  assert [a[0].shape for a in calls] == [(128, 256), (256, 128), (128, 32, 128)]
  assert all(a[0].dtype == jnp.float32 for a in calls)
  chex.assert_trees_all_equal(got, want)
  grads = got[1][0]["params"]
  chex.assert_trees_all_equal_dtypes(grads, v["params"])
  assert float(jnp.abs(grads["Dense_0"]["kernel"]).max()) > 0


@pytest.mark.parametrize("recipe", [fl.IntRecipe(kernel=CHANNEL),
                                    fl.IntRecipe(kernel=CHANNEL, grad_bits=8), fl.int8_lsq()],
                         ids=["ste", "grad_bits8", "lsq"])
@pytest.mark.parametrize("mode", ["off", "interpret"])
def test_a_parameter_handed_uncast_is_the_cast_one(recipe, mode):
  """``rhs_compute_dtype``: the float32 parameter gives the cast weight's product and gradients.

  With the kernel off the parameter is cast inside; in the interpreter the
  kernel rounds it as it reads it (STE); LSQ's learned weight is never the
  kernel's and keeps its rounded copy for its backward.
  """
  from fp8_linen.core import int_product  # pylint: disable=import-outside-toplevel
  x = jax.random.normal(jax.random.key(0), (32, 64), jnp.bfloat16)
  w = _weight(jax.random.key(1), (64, 128)).at[..., 1].set(1.0) * 1e-3
  dn = (((1,), (0,)), ((), ()))
  step = jnp.full((1, 128), 1e-5, jnp.float32) if recipe.kernel.learned else None
  kp = (step,) if step is not None else ()
  ip = (jnp.full((), 0.05, jnp.float32),) if recipe.input.learned else (jnp.zeros(2),)

  def loss(w, x, cast):
    y, _ = int_product.int_dot_general(
        x, w.astype(jnp.bfloat16) if cast else w, dn, recipe=recipe, input_params=ip,
        kernel_params=kp, rhs_compute_dtype=None if cast else jnp.bfloat16)
    return jnp.sum(y.astype(jnp.float32) ** 2), y

  with fl.pallas_kernels(mode):
    got = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x, False)
    want = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x, True)
  chex.assert_trees_all_equal(got, want)
  chex.assert_type(got[1][0], jnp.float32)


def test_a_compute_dtype_that_is_not_floating_is_refused():
  from fp8_linen.core import int_product  # pylint: disable=import-outside-toplevel
  with pytest.raises(TypeError, match="int_dot_general: rhs_compute_dtype must be a floating"):
    int_product.int_dot_general(jnp.ones((2, 3)), jnp.ones((3, 128)), (((1,), (0,)), ((), ())),
                                recipe=fl.IntRecipe(kernel=CHANNEL), input_params=(jnp.zeros(2),),
                                rhs_compute_dtype=jnp.int8)
