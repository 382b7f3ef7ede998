"""The CPU training step's program against a recorded baseline: a guard that is not a timed test.

Tests and the main job run on CPU, so a slower CPU step costs every user who
tries the library. A wall-clock test would be flaky on shared machines; what
makes a step slower is visible in its compiled program instead: a GEMM that
changes operand class (a bf16 product becoming f32) or a new pass over an
operand (more bytes moved by the kernels around the GEMMs). Each arm's
``QDense`` step (forward, dgrad, wgrad; bf16 activations, f32 params) is
compiled for this CPU and compared with what it compiled to when the record
was taken, relative to ``nn.Dense``'s bf16 step in the same run.

When a change makes a step move fewer bytes, lower the record (the failure
message of the drop check says by how much); when one must move more, raise
it in the same commit and say why.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import fp8_linen as fl
from fp8_linen.testing import hlo, hlo_kernels

N = 512  # x (2N, N) @ (N, N): GEMMs large enough that their operands dominate the bytes

ARMS = {
    "bf16": lambda: nn.Dense(N, dtype=jnp.bfloat16),
    "int8_ste": lambda: fl.QDense(N, dtype=jnp.bfloat16, recipe=fl.IntRecipe(
        kernel=fl.IntQuantConfig(granularity="channel"))),
    "int8_lsq": lambda: fl.QDense(N, dtype=jnp.bfloat16, recipe=fl.int8_lsq()),
    "fp8_delayed": lambda: fl.QDense(N, dtype=jnp.bfloat16),
    "fp8_current": lambda: fl.QDense(N, dtype=jnp.bfloat16, recipe=fl.current_scaling()),
}

# Recorded on jax 0.10.2 (x86-64 CPU): the operand classes of the step's three
# GEMMs, and its non-GEMM kernels' bytes as a multiple of the bf16 step's.
RECORD = {
    "bf16": (["f32", "f32", "f32"], 1.0),
    # The observer's min and max are two reductions here, each a pass of its own (1.77 as one
    # variadic reduce, which XLA:CPU runs outside its fast reduction kernels: 2% slower).
    "int8_ste": (["bf16", "bf16", "f32"], 2.20),
    "int8_lsq": (["bf16", "bf16", "f32"], 2.34),
    "fp8_delayed": (["bf16", "bf16", "f32"], 1.93),
    "fp8_current": (["bf16", "bf16", "f32"], 1.68),
}
SLACK = 1.05  # layout choices move a few percent between jax releases


@functools.lru_cache(maxsize=None)
def _step(name):
  """``(GEMM operand classes, non-GEMM bytes)`` of the arm's compiled training step."""
  model = ARMS[name]()
  x = jnp.ones((2 * N, N), jnp.bfloat16)
  v = jax.eval_shape(model.init, jax.random.key(0), x)
  loss = lambda v, x: model.apply(v, x).astype(jnp.float32).sum()
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(v, x).compile().as_text()
  kernels = hlo_kernels.kernels(hlo.parse(text))
  classes = sorted(c for k in kernels if k.is_product for c, _ in k.flops)
  moved = sum((k.bytes_read + k.bytes_written) * k.count for k in kernels if not k.is_product)
  return classes, moved


@pytest.mark.parametrize("name", list(RECORD))
def test_cpu_step_program_matches_the_record(name):
  classes, moved = _step(name)
  want_classes, want_ratio = RECORD[name]
  assert classes == want_classes, f"{name}: GEMM operand classes {classes}, recorded {want_classes}"
  ratio = moved / _step("bf16")[1]
  assert ratio <= want_ratio * SLACK, (
      f"{name}: the step's non-GEMM kernels move {ratio:.2f}x bf16's bytes, recorded "
      f"{want_ratio:.2f}x: a pass came back (see the kernels of the compiled program)")
  assert ratio >= want_ratio / SLACK, (
      f"{name}: the step now moves {ratio:.2f}x bf16's bytes, below the recorded "
      f"{want_ratio:.2f}x: lower RECORD['{name}'] so the gain is kept")
