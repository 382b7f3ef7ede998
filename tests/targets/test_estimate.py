"""The step-time estimate (compile only): its arithmetic and its sanity checks on real programs.

The checks where the answer is known: an 8192^3 bf16 GEMM compiled for an
H100 is about 1.1 ms at its 989 TFLOP/s bf16 peak and an fp8 one about half;
on a TPU v5e the bf16 GEMM is about 5.6 ms and an int8 one about half, while
an e4m3 one costs what bf16 does (v5e has no fp8 MXU mode).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from fp8_linen.testing import estimate, hlo_kernels
from fp8_linen.testing.compile import compile_for, compile_train_step

N = 8192


def _k(flops=(), read=0.0, written=0.0, count=1):
  return hlo_kernels.Kernel("k", "fusion", tuple(flops), read, written, count)


def test_a_kernel_costs_the_larger_of_compute_and_memory_plus_the_floor():
  peaks = estimate.Peaks(flops={"bf16": 1e12, "fp8": 2e12}, hbm=1e9, kernel_floor=1e-6,
                         source="test")
  compute = _k([("bf16", 1e9)], read=1e3)              # 1 ms of compute, 1 us of memory
  memory = _k(read=2e6, written=1e6)                   # 3 ms of memory
  e = estimate.estimate([compute, memory], peaks)
  assert [t.bound for t in e.kernels] == ["compute", "memory"]
  assert e.seconds == pytest.approx(1e-3 + 3e-3 + 2e-6)
  assert e.product_seconds == pytest.approx(1e-3 + 1e-6)
  assert e.other_bytes == 3e6 and e.low_precision_seconds == 0


def test_classes_without_a_native_mode_run_at_the_bf16_rate_and_loops_repeat():
  peaks = estimate.Peaks(flops={"bf16": 1e12}, hbm=1e12, kernel_floor=0.0, source="test")
  e = estimate.estimate([_k([("int8", 1e9)], count=3)], peaks)
  assert e.seconds == pytest.approx(3e-3) and e.low_precision_share == pytest.approx(1.0)
  assert e.flops == {"int8": 3e9}


def _gemm(a_dtype, out_dtype):
  def f(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out_dtype)
  spec = jax.ShapeDtypeStruct((N, N), a_dtype)
  return f, (spec, spec)


@pytest.mark.parametrize("target,dtype,out,low,high", [
    ("h100", jnp.bfloat16, jnp.bfloat16, 1.05, 1.20),     # 2 * 8192^3 / 989e12 = 1.11 ms
    ("h100", jnp.float8_e4m3fn, jnp.bfloat16, 0.52, 0.65),  # about half (+ a layout transpose)
    ("tpu-v5e", jnp.bfloat16, jnp.bfloat16, 5.4, 5.8),    # / 197e12 = 5.58 ms
    ("tpu-v5e", jnp.int8, jnp.int32, 2.7, 3.0),            # int8 at twice the rate
    ("tpu-v5e", jnp.float8_e4m3fn, jnp.bfloat16, 5.4, 5.8),  # no fp8 mode: the bf16 rate
])
def test_large_gemm_estimates_match_the_published_peaks(require_target, target, dtype, out, low,
                                                         high):
  require_target(target)
  fn, args = _gemm(dtype, out)
  report = compile_for(target, fn, *args)
  assert len(report.product_list) == 1, report.summary()
  ms = report.estimate().seconds * 1e3
  assert low < ms < high, (ms, [(t.kernel.name, t.seconds) for t in report.estimate().kernels])


def test_a_conditional_counts_its_cheapest_branch():
  peaks = estimate.PEAKS["h100"]
  big = hlo_kernels.Kernel("cast", "fusion", (), 2 ** 30, 2 ** 30, branch=("cond", 0))
  small = hlo_kernels.Kernel("noop", "fusion", (), 1024, 1024, branch=("cond", 1))
  always = hlo_kernels.Kernel("gemm", "custom-call", (("bf16", 2 * 4096 ** 3),), 2 ** 25, 2 ** 25)
  both = estimate.estimate([big, small, always], peaks)
  alone = estimate.estimate([dataclasses.replace(small, branch=None), always], peaks)
  assert both.seconds == alone.seconds
  assert both.other_bytes == 2048 and len(both.kernels) == 3
  # A conditional whose other branch runs no kernel: that empty branch is the cheapest.
  lone = estimate.estimate([big, always], peaks)
  assert lone.seconds == estimate.estimate([always], peaks).seconds


def test_delayed_scaling_first_step_branch_is_not_in_the_estimate(require_target):
  # The delayed recipe's lax.cond (scale from this step's amax while the history is
  # empty) lies in the program; the estimate counts the branch later steps take.
  # (On one GPU delayed scales wait for their amaxes and the step has no cond;
  # XLA:TPU keeps it.)
  require_target("tpu-v5e")
  import flax.linen as nn
  import jax.numpy as jnp
  import fp8_linen as fl
  model = nn.Sequential([fl.QDense(1024), fl.QDense(1024)])
  r = compile_train_step(model, (4096, 1024), jnp.bfloat16, target="tpu-v5e")
  ks = r.kernel_list
  assert any(k.branch is not None for k in ks)
  est = estimate.estimate(ks, estimate.PEAKS["tpu-v5e"])
  everything = estimate.estimate([dataclasses.replace(k, branch=None) for k in ks],
                                 estimate.PEAKS["tpu-v5e"])
  assert est.seconds < everything.seconds
