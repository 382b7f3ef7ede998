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


def test_a_scalar_unit_instruction_costs_the_scalar_floor_where_the_target_has_one():
  scalar = dataclasses.replace(_k(read=8, written=4), scalar=True)
  tpu = estimate.Peaks(flops={"bf16": 1e12}, hbm=1e12, kernel_floor=1e-6, scalar_floor=1e-8,
                       source="test")
  gpu = dataclasses.replace(tpu, scalar_floor=None)
  assert estimate.estimate([scalar], tpu).seconds == pytest.approx(1e-8 + 12e-12)
  assert estimate.estimate([scalar], gpu).seconds == pytest.approx(1e-6 + 12e-12)
  # A vector kernel keeps the kernel floor on a TPU.
  assert estimate.estimate([_k(read=8, written=4)], tpu).seconds == pytest.approx(1e-6 + 12e-12)


# A buffer prefetched into the TPU's alternate memory (S(1)) in two slices, then read by a
# fusion: the only kernel is the reader, charged its operand's and result's bytes once.
_SLICED_PREFETCH = """
%f (p: bf16[8,128]) -> bf16[8,128] {
  %p = bf16[8,128]{1,0} parameter(0)
  ROOT %n = bf16[8,128]{1,0} negate(%p)
}

ENTRY %main (a: s8[2048]) -> bf16[8,128] {
  %a = s8[2048]{0} parameter(0)
  %slice-start = ((s8[2048]{0}), s8[1024]{0:S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:1024]}
  %slice-start.1 = ((s8[2048]{0}), s8[1024]{0:S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[1024:2048]}
  %slice-done = s8[1024]{0:S(1)} slice-done(%slice-start)
  %slice-done.1 = s8[1024]{0:S(1)} slice-done(%slice-start.1)
  %cc = bf16[8,128]{1,0:S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  ROOT %r = bf16[8,128]{1,0} fusion(%cc), kind=kLoop, calls=%f
}
"""


def test_a_sliced_prefetch_is_no_kernel():
  """XLA:TPU's memory-space assignment prefetches a buffer as asynchronous slices joined by a
  ``ConcatBitcast`` custom call (the slices are contiguous already). Like a ``copy-start``,
  neither is a kernel: each ``slice-start``'s result tuple repeats the whole operand, so
  charging it would count one slice as more than the whole buffer.
  """
  from fp8_linen.testing import hlo  # pylint: disable=import-outside-toplevel
  ks = hlo_kernels.kernels(hlo.parse(_SLICED_PREFETCH))
  assert [(k.name, k.bytes_read, k.bytes_written) for k in ks] == [("r", 2048, 2048)]


@pytest.mark.parametrize("target", ["tpu7x", "h100"])
def test_scalar_unit_instructions_are_a_tpu_programs_one_element_bookkeeping(require_target,
                                                                            target):
  """An fp8 step compiled for TPU7x leaves its scales' arithmetic as unfused
  one-element instructions (XLA writes them no vector-kernel configuration):
  those, and only those, are scalar-unit work; bf16's step has none, and no
  GPU program has any. On the TPU they were most of the fp8 step's kernels.
  """
  require_target(target)
  import flax.linen as nn
  import fp8_linen as fl
  from fp8_linen.testing import hlo  # pylint: disable=import-outside-toplevel
  fp8 = compile_train_step(fl.QDense(1024, dtype=jnp.bfloat16), (2048, 1024), jnp.bfloat16,
                           target=target)
  bf16 = compile_train_step(nn.Dense(1024, dtype=jnp.bfloat16), (2048, 1024), jnp.bfloat16,
                            target=target)
  scalar = [k for k in fp8.kernel_list if k.scalar]
  assert not [k for k in bf16.kernel_list if k.scalar]
  if target == "h100":
    assert not scalar
    return
  assert len(scalar) > len(fp8.kernel_list) / 3, (len(scalar), len(fp8.kernel_list))
  module = hlo.parse(fp8.hlo)
  names = {k.name for k in scalar}
  for comp, insts in module.computations.items():
    for inst in insts:
      if inst.name in names:
        assert all(a.size <= 1 for a in inst.result) and "window_config" not in inst.attrs
  # Every product, and every instruction moving more than a few scalars, is a kernel.
  assert not [k for k in scalar if k.is_product or k.bytes_read + k.bytes_written > 64]
  est = fp8.estimate()
  old = estimate.estimate(fp8.kernel_list, dataclasses.replace(est.peaks, scalar_floor=None))
  assert est.seconds < old.seconds
