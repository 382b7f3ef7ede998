"""The per-channel int8 weight kernel on TPUs (compile only): it compiles, and reads once.

Its codes are checked bit for bit against the ``jnp`` path in Pallas'
interpreter (tests/core/test_int_kernels.py); here XLA:TPU compiles it for
every TPU it serves, and in a training step it replaces the weight's two
reads of the float32 parameter (its per-channel range, then its codes) by one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fp8_linen as fl
from fp8_linen.core import int_kernels
from fp8_linen.testing import passes
from fp8_linen.testing.compile import compile_for
from fp8_linen.testing.targets import target_mesh

CHANNEL = fl.IntQuantConfig(granularity="channel")
M, K, N = 512, 2048, 1024


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu7x"])
def test_kernel_compiles_for_every_tpu(require_target, target):
  require_target(target)
  w = jax.ShapeDtypeStruct((K, N), jnp.float32)
  report = compile_for(target, lambda w: int_kernels.channel_codes(w, (0,), CHANNEL,
                                                                   jnp.bfloat16), w)
  (kernel,) = report.kernel_list
  assert "int8_channel_codes" in kernel.name and not kernel.is_product
  assert 'custom_call_target="tpu_custom_call"' in report.hlo
  # One read of the float32 weight; int8 codes and float32 scales written.
  assert kernel.bytes_read == K * N * 4
  assert kernel.bytes_written == K * N + N * 4


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu7x"])
def test_attention_weights_kernel_compiles_for_every_tpu(require_target, target):
  """Attention's (d, heads, head_dim) weight: one kernel, in the weight's own layout."""
  require_target(target)
  shape = (K, 32, 128)
  w = jax.ShapeDtypeStruct(shape, jnp.float32)
  report = compile_for(target, lambda w: int_kernels.channel_codes(w, (0,), CHANNEL,
                                                                   jnp.bfloat16), w)
  (kernel,) = report.kernel_list  # no copy into another layout before or after
  assert "int8_channel_codes" in kernel.name
  assert kernel.bytes_read == K * 32 * 128 * 4
  assert kernel.bytes_written == K * 32 * 128 + 32 * 128 * 4


@pytest.mark.parametrize("target,served", [("tpu-v5e", True), ("tpu-v6e", True),
                                           ("tpu7x", False)])
def test_the_kept_tile_fits_the_chips_vmem(require_target, target, served):
  """At d_model 8192 an attention weight's kept tile (8192 x 32 x 128 bfloat16, 64 MiB)
  fits the 128 MiB of VMEM of TPU v5e and v6e, not TPU7x's 64: there it keeps the jnp path."""
  require_target(target)
  w, dense = jnp.zeros((8192, 64, 128), jnp.float32), jnp.zeros((8192, 8192), jnp.float32)
  with fl.target_backend("tpu"), jax.set_mesh(target_mesh(target)):
    mode = int_kernels.channel_codes_mode(w, (0,), CHANNEL, jnp.bfloat16)
    assert mode == ("compiled" if served else None)
    # A Dense's weight of the same size is served on all three (its tile is 256 lanes wide).
    assert int_kernels.channel_codes_mode(dense, (0,), CHANNEL, jnp.bfloat16) == "compiled"


def _param_readers(step: passes.StepPasses) -> list[str]:
  """The non-GEMM kernels that read the float32 weight: at this shape, those that move
  at least its bytes (the activation and the gradient are a quarter and an eighth of it)."""
  return [p.name for p in step.passes if p.bytes >= K * N * 4]


@pytest.mark.xdist_group("tpu-v5e")
def test_v5e_step_reads_the_weight_once(require_target):
  """With the kernel one pass reads the float32 weight; without it two do.

  The control is the same step with the kernels off: XLA takes the channels'
  range in one pass over the parameter and the codes in another.
  """
  require_target("tpu-v5e")
  model = fl.QDense(N, dtype=jnp.bfloat16,
                    recipe=fl.IntRecipe(kernel=CHANNEL, grad_bits=8))
  step = passes.step_passes(model, (M, K), target="tpu-v5e")
  with fl.pallas_kernels("off"):
    control = passes.step_passes(model, (M, K), target="tpu-v5e")
  assert len(_param_readers(step)) == 1, _param_readers(step)
  assert "int8_channel_codes" in _param_readers(step)[0]
  assert len(_param_readers(control)) == 2, _param_readers(control)
  assert not any("Pallas" in p.purpose for p in control.passes)
  # The read saved: 4 bytes a weight.
  assert control.total - step.total == pytest.approx(K * N * 4, rel=0.02)
  bf16 = passes.step_passes(nn.Dense(N, dtype=jnp.bfloat16), (M, K), target="tpu-v5e")
  assert step.total > bf16.total  # the codes are still written
