"""Quantized ops called outside ``jit`` run as one compiled program each (``uses.compiled_when_eager``)."""

import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl
from fp8_linen.core import uses


RECIPES = ["fp8_delayed", "mx_block", "int8_lsq"]
# Where each recipe's learned or overwritten quantizer values live.
STATE = {"fp8_delayed": fl.OWG, "mx_block": fl.OWG, "int8_lsq": "params"}


class _Compiles(logging.Handler):
  """Counts the programs JAX lowers and compiles while installed."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.names = []

  def emit(self, record):
    msg = record.getMessage()
    if msg.startswith("Compiling "):
      name = msg.split()[1]
      self.names.append(name[4:-1] if name.startswith("jit(") else name)


def _count_compiles(fn):
  handler, log = _Compiles(), logging.getLogger("jax")
  old = log.level
  log.addHandler(handler)
  log.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles(True):
      out = fn()
  finally:
    log.removeHandler(handler)
    log.setLevel(old)
  return out, handler.names


@pytest.mark.parametrize("recipe", RECIPES)
def test_eager_init_compiles_the_op_once_not_per_primitive(recipe):
  # Shapes no other test uses: every primitive of an op-by-op run would
  # compile anew (the fp8 delayed layer's init compiled ~85 programs so).
  # A kernel every way of running makes alike (flax's random initializers
  # round differently op by op and jitted).
  ramp = lambda key, shape, dtype: jnp.linspace(-1.0, 1.0, np.prod(shape), dtype=dtype).reshape(shape)  # noqa: E731
  layer = fl.QDense(19, recipe=fl.load_recipe(recipe), kernel_init=ramp)
  x = jnp.linspace(-2.0, 3.0, 5 * 37).reshape(5, 37)
  variables, names = _count_compiles(lambda: layer.init(jax.random.key(0), x))
  op_programs = [n for n in names if n.startswith(("fp8_vjp", "_int_product"))]
  assert len(op_programs) == 1, names
  # The rest is flax's parameter init, LSQ's initial steps and the state's
  # constants: at most 29 in a fresh process (op by op: 70 to 200).
  assert len(names) <= 40, names
  # LSQ's initial step (a mean over the kernel, outside the op) may differ in
  # its last bit between op-by-op and fused evaluation.
  chex.assert_trees_all_close(variables, jax.jit(layer.init)(jax.random.key(0), x),
                              rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_eager_step_matches_the_jitted_step(recipe):
  layer = fl.QDense(6, recipe=fl.load_recipe(recipe))
  x = jax.random.normal(jax.random.key(1), (4, 12))
  variables = jax.jit(layer.init)(jax.random.key(0), x)

  def step(v):
    loss = lambda v: jnp.sum(layer.apply(v, x) ** 2)
    return jax.value_and_grad(loss)(v)

  eager, jitted = step(variables), jax.jit(step)(variables)
  chex.assert_trees_all_equal(eager, jitted)
  # The quantizers' update (OWG state, LSQ's steps) is there in both.
  assert any(np.any(np.asarray(v) != 0) for v in jax.tree.leaves(eager[1][STATE[recipe]]))


def test_other_transforms_trace_the_op_as_it_is():
  seen = []
  f = uses.compiled_when_eager(lambda k, x: (seen.append(type(x).__name__), x * k)[1],
                               static_argnums=(0,))
  np.testing.assert_array_equal(f(2.0, jnp.ones(3)), [2.0] * 3)
  np.testing.assert_array_equal(f(2.0, jnp.ones(3)), [2.0] * 3)
  assert seen == ["DynamicJaxprTracer"]  # traced once by its jit, then cached
  # vmap traces the function itself (its rules read the trace stack), not
  # inside a jit of its own.
  jax.vmap(lambda x: f(2.0, x))(jnp.ones((2, 3)))
  assert seen[-1] == "BatchTracer"
  # An unhashable static argument runs op by op rather than failing.
  g = uses.compiled_when_eager(lambda k, x: x * len(k), static_argnums=(0,))
  np.testing.assert_array_equal(g([1, 2], jnp.ones(2)), [2.0, 2.0])
