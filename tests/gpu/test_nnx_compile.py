"""An fl.nnx.Linear train step compiled for an H100 runs its three GEMMs in fp8.

The step is the NNX one users write: differentiate w.r.t. the params and the
QuantState (``fl.nnx.DIFF``) and return the loss, dL/dx and the gradients
(which carry the new fp8 state). Compiled without a GPU by
``gpu_compile.compile_for_h100``.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fp8_linen.nnx as fnnx
from fp8_linen.testing import gpu_compile

D = 256


@pytest.fixture(autouse=True)
def _needs_h100(h100):
  del h100


def test_nnx_linear_three_fp8_gemms():
  gpu_compile.use_cpu_platform()
  model = fnnx.Linear(D, D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def step(state, x, r):
    model = nnx.merge(graphdef, state)

    def loss(m, x):
      return jnp.sum(m(x).astype(jnp.float32) * r)

    value, (grads, dx) = nnx.value_and_grad(
        loss, argnums=(nnx.DiffState(0, fnnx.DIFF), 1))(model, x)
    return value, dx, nnx.as_pure(grads)

  x = jax.ShapeDtypeStruct((128, D), jnp.bfloat16)
  r = jax.ShapeDtypeStruct((128, D), jnp.float32)
  report = gpu_compile.compile_for_h100(step, nnx.as_pure(state), x, r)
  assert report.hlo.count("__cublas$lt$matmul$f8") == 3, report.summary()
  assert (report.fp8_gemms, report.gemms) == (3, 3), report.summary()
  assert report.other_dots == 0, report.summary()
