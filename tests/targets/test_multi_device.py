"""Sharded steps compiled for 8 x H100 and a 2x2 TPU v6e slice: collectives by kind and bytes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8_linen as fl
from fp8_linen.testing import targets
from fp8_linen.testing.compile import compile_for
from fp8_linen.testing.train_step import make_train_step, train_step_inputs

D = 1024


def _fsdp_step(target, split=False):
  """Two QDense layers, kernels sharded P('fsdp', None), the batch over 'fsdp'
  (``split``: the step wrapped in ``fl.split_first_step``)."""
  t = targets.get_target(target)
  mesh = targets.target_mesh(t, axis_names=("fsdp",))
  model = nn.Sequential([fl.QDense(D, dtype=jnp.bfloat16), fl.QDense(D, dtype=jnp.bfloat16)])
  v, x, r = train_step_inputs(model, (t.devices * 128, D), platform=t.platform)

  def place(path, a):
    spec = P("fsdp", None) if jax.tree_util.keystr(path).endswith("['kernel']") else P()
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

  v = jax.tree_util.tree_map_with_path(place, v)
  x, r = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P("fsdp")))
          for a in (x, r))
  step = make_train_step(model)
  return compile_for(t, fl.split_first_step(step) if split else step, v, x, r)


@pytest.mark.parametrize("target", ["h100x8", "tpu-v6e-2x2"])
def test_sharded_step_reports_its_collectives(require_target, target):
  require_target(target)
  report = _fsdp_step(target)
  totals = report.collective_totals
  assert report.classes == {"fp8": 6}, report.summary()
  # The kernels are gathered for the forward (in some form) and their gradients reduced.
  kernel_bytes = D * D  # one layer's kernel in 1-byte codes
  assert sum(n for n, _ in totals.values()) >= 2, totals
  assert max(b for _, b in totals.values()) >= kernel_bytes, totals
  assert all(c.nbytes > 0 and c.dtypes for c in report.collective_list)
  assert "collectives" in report.summary()


@pytest.mark.parametrize("target", ["h100x8", "tpu-v6e-2x2"])
def test_split_first_step_on_a_mesh_multiplies_in_fp8(require_target, target):
  """Both branches of a sharded ``fl.split_first_step`` step: 6 fp8 products each."""
  require_target(target)
  report = _fsdp_step(target, split=True)
  assert report.classes == {"fp8": 12}, report.summary()
