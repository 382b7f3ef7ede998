"""fl.nnx training steps on Explicit meshes (DP, FSDP, TP) match one device.

The NNX twin of ``tests/test_meshes.py``: an ``nnx.jit`` train step of
``fl.nnx.Linear`` layers (delayed, current and row-wise scaling and int8 LSQ,
behind a ``fl.nnx.Quantizer``) on a batch sharded over an Explicit ``data`` axis, with
the kernels replicated (DP), sharded over ``data`` (FSDP) or over a ``model``
axis (TP). The new state is read from the sharded values' gradients and
written back by ``fl.nnx.Optimizer`` onto sharded variables.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fp8_linen as fl
import fp8_linen.nnx as fnnx

# With -n, in one process: the one-device run (_single) is trained once.
pytestmark = pytest.mark.xdist_group("nnx-meshes")


class Mlp(nnx.Module):

  def __init__(self, rngs):
    self.act = fnnx.Quantizer()
    self.hid = fnnx.Linear(16, 32, rngs=rngs)
    self.mid = fnnx.Linear(32, 32, recipe=fl.current_scaling(), rngs=rngs)
    self.lsq = fnnx.Linear(32, 32, recipe=fl.int8_lsq(), rngs=rngs)
    self.out = fnnx.Linear(32, 8, recipe=fl.rowwise_scaling(), rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.hid(self.act(x)))
    h = jax.nn.relu(self.lsq(jax.nn.relu(self.mid(h))))
    return self.out(h)


def _batch():
  x = np.random.default_rng(2).normal(size=(16, 16)).astype(np.float32)
  x[13, 2] = 40.0  # the global max lives on one device's shard only
  return jnp.asarray(x)


def _kernel_spec(parallel):
  """FSDP shards a kernel's contracting axis over data, TP its output features over model."""
  return {"dp": P(), "fsdp": P("data", None), "tp": P(None, "model")}[parallel]


def _loss(model, x):
  return jnp.mean(model(x) ** 2)


@nnx.jit
def _step(model, opt, x):
  loss, grads = fnnx.value_and_grad(_loss)(model, x)
  opt.update(model, grads)
  return loss, grads


def _train(x, mesh=None, parallel="dp", steps=2):
  """Losses, gradients (pure) and the final model after ``steps`` steps on ``x``."""
  model = Mlp(nnx.Rngs(0))
  fnnx.calibrate(model, _batch())  # LSQ's activation step, from data as in real use
  if mesh is not None:
    def put(path, value):
      kernel = path[-1].key == "kernel"
      return jax.device_put(value, NamedSharding(mesh, _kernel_spec(parallel) if kernel else P()))
    nnx.update(model, jax.tree_util.tree_map_with_path(put, nnx.as_pure(nnx.state(model))))
  opt = fnnx.Optimizer(model, optax.adam(1e-2))
  losses, grads = [], []
  for i in range(steps):
    loss, g = _step(model, opt, x * (i + 1))
    losses.append(float(loss))
    grads.append(nnx.as_pure(g))
  return losses, grads, model


@functools.lru_cache(maxsize=None)
def _single():
  return _train(_batch())


def _quant(model):
  return nnx.to_pure_dict(nnx.as_pure(nnx.state(model, fnnx.QuantState)))


PARALLEL = ["dp", "fsdp", "tp"]


@pytest.mark.parametrize("parallel", PARALLEL)
def test_train_step_on_an_explicit_mesh_matches_one_device(parallel):
  assert jax.device_count() == 8
  losses1, grads1, single = _single()
  shape, axes = ((4, 2), ("data", "model")) if parallel == "tp" else ((8,), ("data",))
  mesh = jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(axes))
  with jax.set_mesh(mesh):
    x = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
    losses, grads, model = _train(x, mesh, parallel)
    kernel = model.hid.kernel[...]  # the optimizer kept the layout
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, _kernel_spec(parallel)), 2)
  # Every device scaled by the global max: the outlier on one shard is in the
  # histories, and the state of what sees the data itself is exactly as on one device.
  state, state1 = _quant(model), _quant(single)
  assert float(state["act"]["input_amax_history"][0]) == 2 * 40.0
  assert float(state["act"]["input_amax_history"][1]) == 40.0
  for layer, name in (("act", "input_amax_history"), ("act", "input_scale"),
                      ("hid", "input_amax_history"), ("hid", "kernel_amax_history")):
    np.testing.assert_array_equal(state[layer][name], state1[layer][name], f"{layer}/{name}")
  assert "lsq" not in state  # LSQ's steps are params, compared with the gradients
  # Deeper layers see GEMM outputs: a row-parallel layer's output is a sum in
  # another order (TP), and XLA:CPU may also multiply a 2-row shard with
  # another kernel than the 16-row batch, summing in another order (seen on
  # an AMD EPYC host: the last layer's input amax one ulp apart under DP).
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), state, state1)
  # A sum's order reaches the loss and gradients through fp8/integer rounding
  # (LSQ's step gradients most): TP's row-parallel sums move them by up to a
  # few parts in a thousand, as tests/test_meshes.py allows for Linen.
  np.testing.assert_allclose(losses, losses1, rtol=1e-4)
  tol = 2e-2 if parallel == "tp" else 1e-5
  for g, g1 in zip(grads, grads1):
    jax.tree.map(lambda a, b: np.testing.assert_array_less(
        np.linalg.norm(a - b), tol * np.linalg.norm(b) + 1e-12), g, g1)


def test_weight_only_integer_recipe_contracts_a_sharded_axis():
  # Its float product (no integer GEMM: the input is not quantized) passes the output
  # sharding an Explicit mesh asks for on a sharded contraction, as the Linen layers do.
  layer = fnnx.Linear(16, 8, recipe=fl.IntRecipe(input=None), rngs=nnx.Rngs(0))
  x = _batch()
  y1 = layer(x)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    layer.kernel.set_value(jax.device_put(layer.kernel[...], NamedSharding(mesh, P("data", None))))
    y = nnx.jit(lambda m, x: m(x))(layer, jax.device_put(x, NamedSharding(mesh, P(None, "data"))))
  np.testing.assert_allclose(y, y1, rtol=1e-6, atol=1e-6)
