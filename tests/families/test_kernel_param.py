"""The layers hand a block product their float32 kernel uncast; the product rounds it itself.

A bfloat16 layer over float32 parameters casts its kernel before the product.
Where a Pallas kernel quantizes the weight (MXFP8, NVFP4 on a B200), XLA
writes that bfloat16 copy only for the kernel to read it back; handed the
parameter, the kernel rounds it as it reads it. Checked here: the weight's
kernel call reads float32, every output, gradient and new state is the same
bits as the layer with flax's own promotion (the control, whose kernel reads
bfloat16), the other recipes trace the very same program, and only the very
array the promotion made is swapped. The compiled B200 step's bytes are
tests/targets/test_passes.py's.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import dtypes as linen_dtypes
from flax.nnx.nn import dtypes as nnx_dtypes

import fp8_linen as fl
from fp8_linen.families import dispatch

BLOCK = {"mxfp8": fl.mx_block_scaling(), "nvfp4": fl.nvfp4()}
X_SHAPE = (2, 32, 128)        # 64 rows: the gradient is not the weight's size


def _linen(kind, recipe, promote):
  kw = dict(dtype=jnp.bfloat16, recipe=recipe)
  if promote is not None:
    kw["promote_dtype"] = promote
  if kind == "dense":
    return fl.QDense(96, **kw)
  if kind == "dense_general":
    return fl.QDenseGeneral((2, 48), **kw)
  return fl.QEinsum(shape=(128, 96), einsum_str="btd,dh->bth", **kw)


def _linen_step(kind, recipe, promote):
  model = _linen(kind, recipe, promote)
  x = jax.random.normal(jax.random.key(0), X_SHAPE, jnp.bfloat16)
  v = jax.jit(model.init)(jax.random.key(1), x)

  def loss(v, x):
    y = model.apply(v, x).astype(jnp.float32)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

  return jax.value_and_grad(loss, argnums=(0, 1)), (v, x)


def _nnx(kind, recipe, promote):
  kw = dict(dtype=jnp.bfloat16, recipe=recipe, rngs=nnx.Rngs(1))
  if promote is not None:
    kw["promote_dtype"] = promote
  if kind == "dense":
    return fl.nnx.Linear(128, 96, **kw)
  if kind == "dense_general":
    return fl.nnx.LinearGeneral(128, (2, 48), **kw)
  return fl.nnx.Einsum("btd,dh->bth", (128, 96), (96,), **kw)


def _nnx_step(kind, recipe, promote):
  graphdef, state = nnx.split(_nnx(kind, recipe, promote))
  x = jax.random.normal(jax.random.key(0), X_SHAPE, jnp.bfloat16)

  def loss(state, x):
    y = nnx.merge(graphdef, state)(x).astype(jnp.float32)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

  return jax.value_and_grad(loss, argnums=(0, 1)), (state, x)


# The controls: flax's promotion, wrapped (an NNX twin takes flax's own default for its own,
# as quantize_model hands it over).
STEPS = {"linen": (_linen_step, lambda *a, **kw: linen_dtypes.promote_dtype(*a, **kw)),
         "nnx": (_nnx_step, lambda a, **kw: nnx_dtypes.promote_dtype(a, **kw))}


def _subjaxprs(params):
  for v in params.values():
    for item in v if isinstance(v, (tuple, list)) else (v,):
      if hasattr(item, "jaxpr") and hasattr(item, "consts"):    # a closed jaxpr
        yield item.jaxpr
      elif hasattr(item, "eqns"):
        yield item


def _pallas_operand_dtypes(jaxpr, sizes) -> list:
  """The dtypes of the operands of ``jaxpr``'s Pallas calls whose size is in ``sizes``."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.extend(str(v.aval.dtype) for v in eqn.invars if getattr(v.aval, "size", 0) in sizes)
    for sub in _subjaxprs(eqn.params):
      found.extend(_pallas_operand_dtypes(sub, sizes))
  return found


def _kernel_reads(fn, args):
  """The dtypes of the operands of the jaxpr's Pallas calls shaped as the (128, 96) weight."""
  return _pallas_operand_dtypes(jax.make_jaxpr(fn)(*args).jaxpr, {128 * 96})


@pytest.mark.parametrize("api", sorted(STEPS))
@pytest.mark.parametrize("kind", ["dense", "dense_general", "einsum"])
@pytest.mark.parametrize("name", sorted(BLOCK))
def test_block_layers_hand_their_kernel_the_float32_weight(api, kind, name):
  make, flax_promote = STEPS[api]
  fn, args = make(kind, BLOCK[name], None)
  control, control_args = make(kind, BLOCK[name], flax_promote)
  with fl.pallas_kernels("interpret"):
    # NVFP4 reads the weight twice (its amax, then its tile codes), MX once.
    reads = 2 if name == "nvfp4" else 1
    assert _kernel_reads(fn, args) == ["float32"] * reads
    assert _kernel_reads(control, control_args) == ["bfloat16"] * reads
    got, want = jax.jit(fn)(*args), jax.jit(control)(*control_args)
  chex.assert_trees_all_equal(jax.tree.leaves(got), jax.tree.leaves(want))
  kernel_grads = [g for g in jax.tree.leaves(got[1][0]) if g.size == 128 * 96]
  assert [g.dtype for g in kernel_grads] == [jnp.float32]
  if kind == "dense":
    # The same bits on the jnp path, where the parameter is cast before the product.
    with fl.pallas_kernels("off"):
      assert _kernel_reads(fn, args) == []
      chex.assert_trees_all_equal(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(got))


@pytest.mark.parametrize("api", sorted(STEPS))
@pytest.mark.parametrize("recipe", [fl.delayed_scaling(), fl.rowwise_scaling(), fl.IntRecipe()],
                         ids=["delayed", "rowwise", "int8"])
def test_other_recipes_trace_the_program_of_flaxs_promotion(api, recipe):
  """Their casts fuse the rounding already: the parameter is not used, nothing changes."""
  make, flax_promote = STEPS[api]
  fn, args = make("dense", recipe, None)
  control, control_args = make("dense", recipe, flax_promote)
  assert str(jax.make_jaxpr(fn)(*args)) == str(jax.make_jaxpr(control)(*control_args))


def test_only_the_array_the_promotion_made_is_swapped():
  w = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4)
  cast = w.astype(jnp.bfloat16)
  with dispatch.kernel_params():
    dispatch.remember_kernel_param(cast, w)
    dispatch.remember_kernel_param(w, w)          # no cast: nothing to remember
    assert dispatch._param_of(cast) is w
    assert dispatch._param_of(cast * 1) is None   # an equal array, made after the promotion
    assert dispatch._param_of(w) is None
  assert dispatch._param_of(cast) is None         # the scope is the layer call's


class DirectOpTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_rhs_compute_dtype_gives_the_product_of_the_cast_weight(self):
    x = jax.random.normal(jax.random.key(3), (64, 128), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(4), (128, 64), jnp.float32) * 0.1
    dn = (((1,), (0,)), ((), ()))
    for recipe in [fl.delayed_scaling(), fl.rowwise_scaling(), fl.mx_block_scaling()]:
      st = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((recipe.input.history_length,)))

      def run(x, w, compute):
        def f(x, w):
          y, _ = fl.fp8_dot_general(x, w, dn, input_state=st(), kernel_state=st(),
                                    output_grad_state=st(), recipe=recipe,
                                    rhs_compute_dtype=compute)
          return jnp.sum(y.astype(jnp.float32) ** 2), y
        (_, y), g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(x, w)
        return y, g

      y, (gx, gw) = self.variant(run, static_argnums=2)(x, w, jnp.bfloat16)
      y_ref, (gx_ref, gw_ref) = self.variant(
          lambda x, w: run(x, w.astype(jnp.bfloat16), None))(x, w)
      assert y.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
      chex.assert_trees_all_equal((y, gx), (y_ref, gx_ref))
      np.testing.assert_array_equal(np.asarray(gw), np.asarray(gw_ref.astype(jnp.float32)))


class _OwnDense(nn.Dense):
  """A subclass: its body could change the kernel, so its product gets flax's cast one."""


class _OwnDenseGeneral(nn.DenseGeneral):
  """As :class:`_OwnDense`."""


class _OwnEinsum(nn.Einsum):
  """As :class:`_OwnDense`."""


class _Mlp(nn.Module):
  own: bool = False

  @nn.compact
  def __call__(self, x):
    dense, general, einsum = ((_OwnDense, _OwnDenseGeneral, _OwnEinsum) if self.own
                              else (nn.Dense, nn.DenseGeneral, nn.Einsum))
    h = dense(96, dtype=jnp.bfloat16, name="Dense_0")(x)
    h = einsum((96, 96), "btd,dh->bth", dtype=jnp.bfloat16, name="Einsum_0")(h)
    return general((2, 48), dtype=jnp.bfloat16, name="DenseGeneral_0")(h)


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_quantize_model_hands_flaxs_own_dense_layers_float32_kernels(name):
  """An unmodified nn.Dense / DenseGeneral / Einsum: flax's body casts the parameter it passes."""
  x = jax.random.normal(jax.random.key(0), (2, 32, 96), jnp.bfloat16)
  steps = {}
  for own in (False, True):
    model = fl.quantize_model(_Mlp(own), BLOCK[name])
    v = jax.jit(model.init)(jax.random.key(1), x)

    def loss(v, x, model=model):
      y = model.apply(v, x).astype(jnp.float32)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)))

    steps[own] = jax.value_and_grad(loss, argnums=(0, 1)), v
  with fl.pallas_kernels("interpret"):
    reads = {d: [] for d in steps}
    for d, (fn, v) in steps.items():
      jaxpr = jax.make_jaxpr(fn)(v, x)
      reads[d] = _pallas_operand_dtypes(jaxpr.jaxpr, {96 * 96})
    per_weight = 2 if name == "nvfp4" else 1
    assert reads[False] == ["float32"] * 3 * per_weight
    assert reads[True] == ["bfloat16"] * 3 * per_weight
    got = jax.jit(steps[False][0])(steps[False][1], x)
    want = jax.jit(steps[True][0])(steps[True][1], x)
  # The same parameters (the layers are named alike), the same bits.
  chex.assert_trees_all_equal(jax.tree.leaves(got), jax.tree.leaves(want))
