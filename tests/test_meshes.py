"""Every op under Explicit and Auto meshes (DP, FSDP, TP) matches one device.

``jax.make_mesh`` makes ``Explicit`` axes by default: every array's type then
carries its sharding, and a product whose contraction is sharded (the weight
gradient of data parallelism, a row-parallel layer) must say how to shard its
output. The models below chain every product kind (dense, einsum, row-wise,
MX, NVFP4, integer STE and LSQ, fp8 activation; convolutions with both lowerings and
integer) so one compile per mesh checks them all.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fp8_linen as fl


class DenseChain(nn.Module):
  """Each dot-like product kind once, fed by the previous one."""

  @nn.compact
  def __call__(self, x):
    x = fl.QDense(32, name="tensor")(x)
    x = fl.Fp8Activation(name="act")(x)
    x = fl.QDense(32, recipe=fl.Fp8Recipe(gemm="fp8"), name="tensor_fp8_gemm")(x)
    x = fl.QDense(32, recipe=fl.rowwise_scaling(), name="row")(x)
    x = fl.QDense(32, recipe=fl.mx_block_scaling(block_size=8), name="mx")(x)
    x = fl.QDense(32, recipe=dataclasses.replace(fl.nvfp4(), block_size=8, wgrad_hadamard=8),
                  name="nvfp4")(x)
    x = fl.QDense(32, recipe=fl.IntRecipe(), name="int_ste")(x)
    x = fl.QDense(32, recipe=fl.int8_lsq(), name="int_lsq")(x)
    x = nn.Dense(32, dot_general_cls=fl.Fp8DotGeneral, name="injected")(x)
    return fl.QEinsum(shape=(32, 16), einsum_str="btd,dh->bth", name="einsum")(x)


class ConvChain(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = fl.QConv(8, (3, 3), recipe=fl.Fp8Recipe(gemm="f32"), name="conv")(x)
    x = fl.QConv(8, (3, 3), recipe=fl.Fp8Recipe(gemm="fp8"), name="conv_fp8_gemm")(x)
    return fl.QConv(8, (3, 3), recipe=fl.IntRecipe(), name="conv_int")(x)


def _rand(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


MODELS = {"dense": (DenseChain, _rand((8, 4, 32), 0)),
          "conv": (ConvChain, _rand((8, 6, 6, 4), 1))}


def _kernel_spec(parallel, ndim):
  """FSDP shards a weight over the data axis, TP over the model axis."""
  if parallel == "dp" or ndim < 2:
    return P()
  axis = "data" if parallel == "fsdp" else "model"
  if ndim == 2:  # FSDP: the contracting (input) axis; TP: the output features
    return P(axis, None) if parallel == "fsdp" else P(None, axis)
  return P(*([None] * (ndim - 1) + [axis]))  # convolutions: output features


def _loss(model, v, x):
  return jnp.mean(model.apply(v, x) ** 2)


@functools.lru_cache(maxsize=None)
def _reference(name):
  cls, x = MODELS[name]
  model = cls()
  v = model.init(jax.random.key(0), x)
  return model, v, x, jax.jit(jax.value_and_grad(functools.partial(_loss, model)))(v, x)


# Auto meshes leave every sharding to XLA; the 2-D mesh of TP is the hardest case.
MESHES = [("dp", AxisType.Explicit), ("fsdp", AxisType.Explicit), ("tp", AxisType.Explicit),
          ("tp", AxisType.Auto)]


@pytest.mark.parametrize("parallel,axis_type", MESHES,
                         ids=[f"{p}-{t.name.lower()}" for p, t in MESHES])
# With -n, a model's meshes run in one process: its one-device reference (_reference) runs once.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"meshes-{n}"))
                                  for n in sorted(MODELS)])
def test_every_op_on_a_mesh_matches_one_device(name, parallel, axis_type):
  assert jax.device_count() == 8
  model, v, x, (loss1, g1) = _reference(name)
  shape, axes = ((4, 2), ("data", "model")) if parallel == "tp" else ((8,), ("data",))
  mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    vs = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, NamedSharding(
            mesh, _kernel_spec(parallel, a.ndim) if path[-1].key == "kernel" else P())), v)
    loss, g = jax.jit(jax.value_and_grad(functools.partial(_loss, model)))(vs, xs)
  np.testing.assert_allclose(loss, loss1, rtol=1e-4)
  # Amaxes are maxima (exact under any sharding); the products' sums only
  # change their order, which fp8 rounding downstream can raise from float
  # noise to a few percent in single elements.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2), g[fl.OWG], g1[fl.OWG])
  jax.tree.map(lambda a, b: np.testing.assert_array_less(
      np.linalg.norm(a - b), 2e-2 * np.linalg.norm(b) + 1e-12), g["params"], g1["params"])


class Small(nn.Module):
  @nn.compact
  def __call__(self, x):
    return fl.QDense(8, name="out")(fl.Fp8Activation(name="act")(fl.QDense(16, name="hid")(x)))


def test_train_step_on_an_explicit_mesh_matches_one_device():
  # The whole step: TrainState's merge, MultiSteps' max accumulator, the
  # optimizer, all on explicitly sharded values.
  model, x = Small(), _rand((16, 12), 2)
  v = model.init(jax.random.key(0), x)
  tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)

  @jax.jit
  def step(state, x):
    grads = jax.grad(functools.partial(_loss, model))(state.params, x)
    return state.apply_gradients(grads=grads)

  def run(state, xs):
    for i in range(4):
      state = step(state, xs * (i + 1))
    return state

  single = run(fl.TrainState.create(apply_fn=model.apply, params=v, tx=tx), x)
  mesh = jax.make_mesh((8,), ("data",))  # Explicit, jax.make_mesh's default
  with jax.set_mesh(mesh):
    state = jax.device_put(fl.TrainState.create(apply_fn=model.apply, params=v, tx=tx),
                           NamedSharding(mesh, P()))
    sharded = run(state, jax.device_put(x, NamedSharding(mesh, P("data"))))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2),
               sharded.params[fl.OWG], single.params[fl.OWG])
  jax.tree.map(lambda a, b: np.testing.assert_array_less(
      np.linalg.norm(a - b), 2e-2 * np.linalg.norm(b)), sharded.params["params"],
      single.params["params"])


class Parallel(nn.Module):
  """A column-parallel then row-parallel pair (TP), each kernel also FSDP-sharded."""

  recipe: object

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(fl.QDense(64, recipe=self.recipe, name="up")(x))
    return fl.QDense(32, recipe=self.recipe, name="down")(h)


_DP_FSDP_TP = {"up": P("fsdp", "model"), "down": P("model", "fsdp")}
_SCALE_RECIPES = {"delayed": fl.delayed_scaling(), "current": fl.current_scaling(),
                  "rowwise": fl.rowwise_scaling(),
                  "int8": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))}


def _outlier_batch():
  x = np.random.default_rng(3).normal(size=(32, 32)).astype(np.float32)
  x[27, 5] = 64.0  # on one device's rows only (the batch is split 4 ways)
  return jnp.asarray(x)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
@pytest.mark.parametrize("name", sorted(_SCALE_RECIPES))
def test_dp_fsdp_tp_step_matches_one_device(name, axis_type):
  # 2 (data) x 2 (fsdp) x 2 (model): the batch over data and fsdp, kernels over
  # fsdp and model (replicated over data), the state replicated.
  model, x = Parallel(_SCALE_RECIPES[name]), _outlier_batch()
  v = model.init(jax.random.key(0), x)
  loss_grad = jax.jit(jax.value_and_grad(functools.partial(_loss, model)))
  loss1, g1 = loss_grad(v, x)
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types=(axis_type,) * 3)

  def spec(path, a):
    names = [getattr(k, "key", None) for k in path]
    return _DP_FSDP_TP[names[-2]] if names[-1] == "kernel" else P()

  with jax.set_mesh(mesh):
    vs = jax.tree_util.tree_map_with_path(
        lambda p, a: jax.device_put(a, NamedSharding(mesh, spec(p, a))), v)
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    loss, g = loss_grad(vs, xs)
  np.testing.assert_allclose(loss, loss1, rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_array_less(
      np.linalg.norm(a - b), 2e-2 * np.linalg.norm(b) + 1e-12), g["params"], g1["params"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2), g[fl.OWG], g1[fl.OWG])
  # The outlier on one device's rows is in every device's copy of the state.
  state = g[fl.OWG]["up"]
  seen = state["input_range"][1] if name == "int8" else state["input_amax_history"][0]
  assert seen.sharding.is_fully_replicated
  for shard in seen.addressable_shards:
    assert float(shard.data) == 64.0
