"""The served forward (``fl.convert``, ``fl.nnx.convert``) compiled for an H100 without a GPU.

int8 and int4 weights serve as s8 x s8 -> s32 cuBLASLt GEMMs (int4 is unpacked
to int8: there is no int4 GEMM), fp8 weights as cuBLASLt fp8 GEMMs; between
two served layers one fused pass turns the accumulator into the next GEMM's
low-precision input. The Linen int8 and fp8 programs are the ``served-int8``
and ``served-fp8`` cases of ``fp8_linen.testing.cases`` (compiled once per run).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fp8_linen as fl
from fp8_linen.testing import cases
from fp8_linen.testing.compile import compile_for

RECIPES = {"int8": fl.int8_lsq(), "int4": fl.int4_lsq_plus(), "fp8": fl.Fp8Recipe()}
SERVED_CASES = {"int8": "served-int8", "fp8": "served-fp8"}  # int8 LSQ, fp8 delayed

# With -n, in the process that compiles the H100 cases (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("h100")


def _served(recipe):
  model = nn.Sequential([fl.QDense(256, recipe=recipe), nn.relu, fl.QDense(128, recipe=recipe)])
  x = jax.random.normal(jax.random.key(0), (64, 128))
  v = model.init(jax.random.key(1), x)
  v = fl.merge_owg(v, jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v))
  return fl.convert(model, v, x), x


def _gemm_operands(report):
  return [(p.target, *p.operands) for p in report.product_list if p.kind == "cublas"]


def _assert_two_low_precision_gemms(report, name):
  gemms = _gemm_operands(report)
  if name == "fp8":
    assert gemms == [("__cublas$lt$matmul$f8", "f8e4m3fn", "f8e4m3fn")] * 2
  else:
    assert gemms == [("__cublas$lt$matmul", "s8", "s8")] * 2
  assert report.other_dots == 0


@pytest.mark.parametrize("name", list(RECIPES))
def test_served_products_on_h100(h100, name):
  if name in SERVED_CASES:
    report = cases.compile_case(SERVED_CASES[name], h100.name)
  else:
    (served, sp), x = _served(RECIPES[name])
    report = compile_for(h100, served.apply, sp, x)
  _assert_two_low_precision_gemms(report, name)


@pytest.mark.parametrize("name", list(RECIPES))
def test_served_nnx_products_on_h100(h100, name):
  """The served NNX model runs the same products as the Linen one."""
  recipe = RECIPES[name]
  model = nnx.Sequential(fl.nnx.Linear(128, 256, recipe=recipe, rngs=nnx.Rngs(0)), nnx.relu,
                         fl.nnx.Linear(256, 128, recipe=recipe, rngs=nnx.Rngs(1)))
  x = jax.random.normal(jax.random.key(0), (64, 128))
  fl.nnx.calibrate(model, x)
  fl.nnx.update_state(model, fl.nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model))
  graphdef, state = nnx.split(fl.nnx.convert(model, x))
  report = compile_for(h100, lambda s, x: nnx.merge(graphdef, s)(x), nnx.as_pure(state), x)
  _assert_two_low_precision_gemms(report, name)
