"""What each TPU generation's MXU does with each operand dtype, by XLA's own cost model.

XLA:TPU writes its estimate of every kernel's cycles into the compiled
program (``estimated_cycles``; :attr:`fp8_linen.testing.hlo_kernels.Kernel.xla_cycles`).
For one square GEMM per operand dtype it shows what the published peaks say
(JAX's Pallas TPU hardware table): v5e and v6e run int8 at twice the bf16
rate but have no e4m3 mode (an e4m3 x e4m3 GEMM costs what a bf16 one does;
e5m2 x e5m2 is native); TPU7x runs fp8 at twice the bf16 rate and has no int8
mode. This is the evidence behind the README's advice: int8 QAT on v5e/v6e,
fp8 on TPU7x.
"""

import jax
import jax.numpy as jnp
import pytest

from fp8_linen.testing.compile import compile_for

# The smallest square GEMM at which each MXU's rate shows (at 2048^3 v6e's e5m2 and int8
# products still pay 0.81x bf16's cycles in fixed cost; 4096^3 costs twice the compile).
N = {"tpu-v5e": 2048, "tpu-v6e": 4096, "tpu7x": 2048}
DTYPES = {"bf16": jnp.bfloat16, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2,
          "int8": jnp.int8}


def _cycles(target, name):
  dt = DTYPES[name]
  out = jnp.int32 if name == "int8" else jnp.float32

  def gemm(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out)

  spec = jax.ShapeDtypeStruct((N[target], N[target]), dt)
  report = compile_for(target, gemm, spec, spec)
  (k,) = [k for k in report.kernel_list if k.is_product]
  return k.xla_cycles


@pytest.mark.parametrize("target,fast,slow", [
    ("tpu-v5e", ["int8", "e5m2"], ["e4m3"]),
    ("tpu-v6e", ["int8", "e5m2"], ["e4m3"]),
    ("tpu7x", ["e4m3", "e5m2"], ["int8"]),
])
def test_mxu_rate_per_operand_dtype(require_target, target, fast, slow):
  require_target(target)
  bf16 = _cycles(target, "bf16")
  for name in fast:   # about twice the bf16 rate
    assert _cycles(target, name) < 0.8 * bf16, name
  for name in slow:   # no native mode: the bf16 rate (or a little slower)
    assert 0.9 * bf16 < _cycles(target, name) < 1.25 * bf16, name
