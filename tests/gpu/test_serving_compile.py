"""The served forward (``fl.convert``) compiled for an H100 without a GPU: what XLA:GPU selects.

int8 and int4 weights serve as s8 x s8 -> s32 cuBLASLt GEMMs (int4 is unpacked
to int8: there is no int4 GEMM), fp8 weights as cuBLASLt fp8 GEMMs; between
two served layers one fused pass turns the accumulator into the next GEMM's
low-precision input.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fp8_linen as fl

RECIPES = {"int8": fl.int8_lsq(), "int4": fl.int4_lsq_plus(), "fp8": fl.Fp8Recipe()}


def _served(recipe):
  model = nn.Sequential([fl.QDense(256, recipe=recipe), nn.relu, fl.QDense(128, recipe=recipe)])
  x = jax.random.normal(jax.random.key(0), (64, 128))
  v = model.init(jax.random.key(1), x)
  v = fl.merge_owg(v, jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(v))
  return fl.convert(model, v, x), x


def _gemm_operands(report):
  return [(p.target, *p.operands) for p in report.product_list if p.kind == "cublas"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_served_products_on_h100(h100, name):
  (served, sp), x = _served(RECIPES[name])
  report = h100.compile_for_h100(served.apply, sp, x)
  gemms = _gemm_operands(report)
  if name == "fp8":
    assert gemms == [("__cublas$lt$matmul$f8", "f8e4m3fn", "f8e4m3fn")] * 2
  else:
    assert gemms == [("__cublas$lt$matmul", "s8", "s8")] * 2
  assert report.other_dots == 0
