"""The collectives of sharded training steps, read from their compiled programs.

The issue's stack (``fp8_linen.testing.collectives``: 1024-wide bf16 dense
layers, kernels ``P('fsdp', None)``, the batch over ``'fsdp'``, a step that
returns the loss, dL/dx and every gradient) on the 8-device CPU mesh and
compiled for 8 x H100:

* delayed scaling reduces its state in at most 2 collectives per step, at any
  depth (the amaxes only feed the new state, and XLA merges their
  all-reduces); a first step takes its scales from the current amaxes inside
  a ``lax.cond`` branch, so those reductions run in that step only;
* current scaling reduces at most once per quantized tensor, before its cast;
* fp8 and int8 weights are gathered once per step as 1-byte codes: a quarter
  of the float32 parameters' bytes (half of bf16 weights').

Then every layer kind on Auto and Explicit meshes (QDenseGeneral, QEinsum,
QConv, a quantize_model'd decoder block, the NNX Linear, logically
partitioned parameters) gathers codes, never floats. Programs are compiled
once per session (``collectives.fsdp_step`` and the caches below).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fp8_linen as fl
import fp8_linen.nnx as fnnx
from fp8_linen.testing import collectives as col
from fp8_linen.testing import hlo, hlo_collectives, hlo_products
from fp8_linen.testing.cases import DecoderBlock
from fp8_linen.testing.train_step import make_train_step, train_step_inputs

# With -n, in one process: each step is compiled once (col.fsdp_step, _shard_map_reduces).
pytestmark = pytest.mark.xdist_group("collectives")

# Two depths, twice apart: the state collectives must not grow with the layers.
DEPTHS = (4, 8)
CODES = {"u8", "s8", "f8e4m3fn", "f8e5m2"}


def _gradient_reduction(r):
  """The step's largest all-reduce: the parameters' gradients."""
  reduces = [c for c in hlo_collectives.collectives(hlo.parse(r.hlo_text))
             if c.kind == "all-reduce" and not c.conditional]
  return max(reduces, key=lambda c: c.nbytes)


@pytest.mark.parametrize("depth", DEPTHS)
def test_delayed_scaling_reduces_its_state_in_at_most_two_collectives(depth):
  bf16, fp8 = col.fsdp_step("bf16", depth), col.fsdp_step("fp8_delayed", depth)
  assert 1 <= col.state_all_reduces(fp8) <= 2, fp8.every_step
  assert col.extra_all_reduces(fp8, bf16) <= 2, (fp8.every_step, bf16.every_step)
  # The first-step rule is still there: a scale from this step's amax while a
  # history is empty, one reduction per tensor, in a branch the later steps skip.
  n, _ = fp8.first_step_only["all-reduce"]
  assert depth <= n <= 3 * depth


def test_delayed_state_collectives_do_not_grow_with_depth():
  counts = {d: col.state_all_reduces(col.fsdp_step("fp8_delayed", d)) for d in DEPTHS}
  assert len(set(counts.values())) == 1, counts


@functools.lru_cache(maxsize=None)
def _shard_map_reduces(arm, depth):
  """All-reduces (every step, first step only) of a data-parallel shard_map step."""
  model = col.stack(arm, depth, 256)
  mesh = jax.make_mesh((8,), ("d",))
  x = jax.ShapeDtypeStruct((64, 256), BF16, sharding=NamedSharding(mesh, P("d")))
  v = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
  v = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                  sharding=NamedSharding(mesh, P())), v)

  def per_device(v, x):
    g = jax.grad(lambda v: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2))(v)
    return fl.reduce_gradients(g, "d")

  with jax.set_mesh(mesh), fl.target_backend("cpu"):
    f = jax.jit(jax.shard_map(per_device, in_specs=(P(), P("d")), out_specs=P()))
    found = hlo_collectives.collectives(hlo.parse(f.lower(v, x).compile().as_text()))
  reduces = [c for c in found if c.kind == "all-reduce"]
  return (sum(not c.conditional for c in reduces), sum(c.conditional for c in reduces))


@pytest.mark.parametrize("depth", DEPTHS)
def test_delayed_state_under_shard_map_in_at_most_two_collectives(depth):
  every, first = _shard_map_reduces("fp8_delayed", depth)
  assert every - _shard_map_reduces("bf16", depth)[0] <= 2
  assert first >= depth


@pytest.mark.parametrize("depth", DEPTHS)
def test_current_scaling_reduces_each_tensor_at_most_once(depth):
  bf16, cur = col.fsdp_step("bf16", depth), col.fsdp_step("fp8_current", depth)
  assert 1 <= col.extra_all_reduces(cur, bf16) <= 3 * depth, cur.every_step
  assert col.state_all_reduces(cur) == 0  # the new state reuses the amaxes the casts reduced
  assert not cur.first_step_only


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("arm", ["fp8_delayed", "fp8_current", "int8"])
def test_weights_are_gathered_once_as_codes_on_the_cpu_mesh(arm, axis_type):
  bf16 = col.fsdp_step("bf16", 4, axis_type=axis_type)
  r = col.fsdp_step(arm, 4, axis_type=axis_type)
  assert r.gathers and r.gathers_in_codes, r.gathers
  assert r.count("all-gather") == 4  # one per layer: the gradient GEMMs reuse it
  assert r.gather_bytes <= 0.25 * r.kernel_f32_bytes
  # XLA:CPU moves a bf16 weight as float32: the baseline gathers 4 bytes a weight.
  assert r.gather_bytes <= 0.25 * bf16.gather_bytes
  # The gradients' reduction keeps the precision the bf16 stack's has.
  assert _gradient_reduction(r).dtypes == _gradient_reduction(bf16).dtypes
  assert _gradient_reduction(r).nbytes >= r.kernel_f32_bytes


@pytest.mark.parametrize("depth", DEPTHS)
def test_h100_delayed_state_in_at_most_two_collectives(require_target, depth):
  require_target("h100x8")
  bf16 = col.fsdp_step("bf16", depth, "h100x8")
  fp8 = col.fsdp_step("fp8_delayed", depth, "h100x8")
  assert 1 <= col.state_all_reduces(fp8) <= 2, fp8.every_step
  assert col.extra_all_reduces(fp8, bf16) <= 2, (fp8.every_step, bf16.every_step)
  assert fp8.first_step_only.get("all-reduce", (0, 0))[0] >= depth
  assert fp8.gathers_in_codes and fp8.gather_bytes <= 0.25 * fp8.kernel_f32_bytes
  # On a mesh the weight-gradient GEMM keeps bf16's output dtype, so the gradients are
  # reduced across the devices in the bf16 step's dtype (float32 would move twice the bytes).
  assert _gradient_reduction(fp8).dtypes == _gradient_reduction(bf16).dtypes
  assert _gradient_reduction(fp8).nbytes <= _gradient_reduction(bf16).nbytes


@pytest.mark.parametrize("arm", ["fp8_current", "int8"])
def test_h100_weights_are_gathered_as_codes(require_target, arm):
  require_target("h100x8")
  bf16, r = col.fsdp_step("bf16", 4, "h100x8"), col.fsdp_step(arm, 4, "h100x8")
  assert r.gathers and r.gathers_in_codes, r.gathers
  assert r.gather_bytes <= 0.25 * r.kernel_f32_bytes
  assert r.gather_bytes <= 0.5 * bf16.gather_bytes  # XLA:GPU gathers the bf16 weights as bf16
  counts = hlo_products.count_products(r.hlo_text)
  if arm == "fp8_current":  # still fp8 GEMMs: forward, dgrad, wgrad of every layer
    assert counts.fp8_gemms == 12, counts


# ----------------------------------------------------------------------------
# Every layer kind, Auto and Explicit meshes.
# ----------------------------------------------------------------------------

BF16 = jnp.bfloat16
_RECIPES = {"fp8": fl.delayed_scaling(), "int8": fl.IntRecipe(
    kernel=fl.IntQuantConfig(granularity="channel"))}


def _mesh(axis_type):
  return jax.make_mesh((8,), ("fsdp",), axis_types=(axis_type,))


def _fsdp_spec(path, a):
  """FSDP: a kernel's input features (its first dimension, a conv's third) over 'fsdp'
  (else its first dimension that 8 devices divide)."""
  if not jax.tree_util.keystr(path).endswith("['kernel']"):
    return P()
  first = 2 if a.ndim == 4 else 0
  axis = next(d for d in [first, *range(a.ndim)] if a.shape[d] % 8 == 0)
  return P(*[("fsdp" if d == axis else None) for d in range(a.ndim)])


def _kernel_gathers(text, kernel_shapes):
  """The gathered arrays shaped like a kernel: ``[(dtype, shape)]``."""
  return [(a.dtype, a.shape) for c in hlo_collectives.collectives(hlo.parse(text))
          if c.kind == "all-gather" for a in c.arrays if tuple(a.shape) in kernel_shapes]


def _kernel_shapes(tree):
  return {tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(tree)
          if jax.tree_util.keystr(p).endswith("['kernel']")}


def _linen_gathers(model, x_shape, axis_type):
  """The kernel-shaped arrays the model's FSDP step gathers."""
  mesh = _mesh(axis_type)
  v, x, r = train_step_inputs(model, x_shape, platform="cpu")
  shapes = _kernel_shapes(v)
  put = lambda spec, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  v = jax.tree_util.tree_map_with_path(lambda p, a: put(_fsdp_spec(p, a), a), v)
  x = put(P("fsdp"), x)
  r = jax.tree.map(lambda a: put(P("fsdp"), a), r)
  with jax.set_mesh(mesh), fl.target_backend("cpu"):
    text = jax.jit(make_train_step(model)).lower(v, x, r).compile().as_text()
  return _kernel_gathers(text, shapes)


LAYERS = {
    "qdensegeneral": (lambda r: fl.QDenseGeneral(features=(4, 64), dtype=BF16, recipe=r),
                      (64, 256)),
    "qeinsum": (lambda r: fl.QEinsum(shape=(256, 128), einsum_str="btd,dh->bth", dtype=BF16,
                                     recipe=r), (16, 4, 256)),
    "qconv": (lambda r: fl.QConv(64, (3, 3), dtype=BF16, recipe=r), (16, 8, 8, 64)),
    "decoder-block": (lambda r: fl.quantize_model(
        DecoderBlock(num_heads=4, qkv_features=128, mlp=256, dtype=BF16), r,
        rules=fl.projection_rules()), (8, 16, 128)),
}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
@pytest.mark.parametrize("recipe", sorted(_RECIPES))
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_layer_gathers_codes(layer, recipe, axis_type):
  build, shape = LAYERS[layer]
  # Activations may move too (a small batch over 8 devices); weights move as codes.
  gathers = _linen_gathers(build(_RECIPES[recipe]), shape, axis_type)
  assert gathers, "the FSDP step gathers no weight"
  assert all(dtype in CODES for dtype, _ in gathers), gathers


def test_logically_partitioned_parameters_are_gathered_as_codes():
  # nn.with_logical_partitioning and logical axis rules, as flax documents
  # FSDP: the library sees no sharding; the compiled program still gathers codes.
  init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
  model = nn.Sequential([fl.QDense(256, dtype=BF16, kernel_init=init) for _ in range(2)])
  rules = (("embed", "fsdp"), ("mlp", None))
  mesh = _mesh(AxisType.Auto)
  x = jax.ShapeDtypeStruct((64, 256), BF16)
  with nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype)))
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    v = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                     nn.unbox(boxed), shardings)
    assert v["params"]["layers_0"]["kernel"].sharding.spec == P("fsdp", None)
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("fsdp")))
    r = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    with jax.set_mesh(mesh), fl.target_backend("cpu"):
      text = jax.jit(make_train_step(model)).lower(v, xs, r).compile().as_text()
  gathers = _kernel_gathers(text, {(256, 256)})
  assert len(gathers) == 2 and all(dtype in CODES for dtype, _ in gathers), gathers


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
@pytest.mark.parametrize("recipe", sorted(_RECIPES))
def test_nnx_linear_gathers_codes(recipe, axis_type):
  mesh = _mesh(axis_type)
  model = nnx.Sequential(*[fnnx.Linear(256, 256, dtype=BF16, recipe=_RECIPES[recipe],
                                       rngs=nnx.Rngs(i)) for i in range(2)])
  graphdef, state = nnx.split(model)
  pure = nnx.as_pure(state)

  def step(state, x, r):
    m = nnx.merge(graphdef, state)
    loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) * r)
    value, (grads, dx) = nnx.value_and_grad(loss, argnums=(nnx.DiffState(0, fnnx.DIFF), 1))(m, x)
    return value, dx, nnx.as_pure(grads)

  put = lambda spec, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
  pure = jax.tree_util.tree_map_with_path(lambda p, a: put(_fsdp_spec(p, a), a), pure)
  x, r = put(P("fsdp"), jnp.zeros((64, 256), BF16)), put(P("fsdp"), jnp.zeros((64, 256)))
  with jax.set_mesh(mesh), fl.target_backend("cpu"):
    text = jax.jit(step).lower(pure, x, r).compile().as_text()
  gathers = _kernel_gathers(text, {(256, 256)})
  assert len(gathers) == 2 and all(dtype in CODES for dtype, _ in gathers), gathers
