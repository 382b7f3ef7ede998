"""The passes around a dense layer's GEMMs (compile only): a guard against a pass coming back.

Each arm's training step (x (2048, 1024) bf16 -> 4096, float32 parameters) is
compiled for its target and its non-GEMM kernels' bytes are compared, as a
multiple of the bf16 step's on the same target, with what they were when
recorded. A change that adds a pass (a second read of an operand, a
materialized copy) fails here; one that removes passes fails too, so the
record is lowered and the gain kept. ``benchmarks/bench_passes.py`` prints the
same figures for the large shapes of docs/accelerators.md.
"""

import contextlib
import functools

import flax.linen as nn
import jax.numpy as jnp
import pytest

import fp8_linen as fl
from fp8_linen.testing import compile as compile_lib
from fp8_linen.testing import hlo, passes, train_step

M, K, N = 2048, 1024, 4096
SLACK = 1.05

# Recorded on jax 0.10.2 (compile only): non-GEMM bytes / the bf16 step's, same target.
# (At this shape XLA:GPU lays the codes out as at the TE layer's; at 512 x 256 it does not.)
# The step returns the weight's gradient, so the pass casting the wgrad GEMM's bfloat16
# output to the float32 parameter counts here (an optimizer's update fuses it): fp8 per
# tensor 1.28 -> 1.45 on the H100 and 0.93 -> 1.10 on the B200 with it.
RECORD = {
    ("h100", "fp8_delayed"): 1.45,
    ("h100", "fp8_current"): 1.45,
    ("h100", "fp8_rowwise"): 1.82,
    ("b200", "fp8_delayed"): 1.10,
    # fl.split_first_step's steady branch: every delayed scale the history's, so no cast
    # waits for its amax. On the B200 XLA takes each amax in its cast's pass; on the H100
    # every operand's codes are kept apart from their transposes
    # (numerics.cast_apart_from_transpose), so each cast joins its amax (1.45 without).
    ("h100", "fp8_delayed_steady"): 1.15,
    ("b200", "fp8_delayed_steady"): 0.96,
    # One Pallas kernel per operand; the weight's reads the float32 parameter (1.41 when
    # handed the bfloat16 copy XLA wrote for it).
    ("b200", "mxfp8"): 1.30,
    ("b200", "mxfp8_jnp"): 2.31,    # the same step with the kernels off
    ("b200", "nvfp4"): 1.72,        # two Pallas kernels per operand (1.77 with the copy)
    ("b200", "nvfp4_jnp"): 4.29,
    # bf16's step on the v5e moves only the cotangent's cast (its weight's cast is in the
    # GEMM's operand fusion); the sliced prefetches into the GEMMs' fast memory are not
    # passes (hlo_kernels.kernels). The activation's observer takes its min and max in one
    # pass (2.56 with a pass for each).
    ("tpu-v5e", "int8_ste"): 2.44,
}
RECIPES = {"fp8_delayed": fl.delayed_scaling(), "fp8_current": fl.current_scaling(),
           "fp8_rowwise": fl.rowwise_scaling(), "mxfp8": fl.mx_block_scaling(),
           "mxfp8_jnp": fl.mx_block_scaling(), "nvfp4": fl.nvfp4(), "nvfp4_jnp": fl.nvfp4(),
           "int8_ste": fl.IntRecipe(), "fp8_delayed_steady": fl.delayed_scaling()}
CODES = {"fp8_delayed": "cast to fp8 e4m3", "fp8_delayed_steady": "cast to fp8 e4m3", "fp8_current": "cast to fp8 e4m3",
         "fp8_rowwise": "cast to fp8 e4m3", "mxfp8": "Pallas kernel mx_codes_both",
         "mxfp8_jnp": "cast to fp8 e4m3", "nvfp4": "Pallas kernel nvfp4_codes_both",
         "nvfp4_jnp": "cast to fp4 e2m1", "int8_ste": "cast to int8"}


@functools.lru_cache(maxsize=None)
def _step(target: str, arm: str) -> passes.StepPasses:
  model = (nn.Dense(N, dtype=jnp.bfloat16) if arm == "bf16"
           else fl.QDense(N, dtype=jnp.bfloat16, recipe=RECIPES[arm]))
  steady = train_step.steady_branch() if arm.endswith("_steady") else contextlib.nullcontext()
  with fl.pallas_kernels("off" if arm.endswith("_jnp") else "auto"), steady:
    return passes.step_passes(model, (M, K), target=target)


@pytest.mark.parametrize("target,arm", list(RECORD))
def test_non_gemm_bytes_match_the_record(target, arm, require_target):
  require_target(target)
  step, bf16 = _step(target, arm), _step(target, "bf16")
  ratio = step.total / bf16.total
  want = RECORD[(target, arm)]
  listing = "\n".join(f"  {p.bytes / 1024:9.1f} KiB  {p.purpose}" for p in step.passes[:8])
  assert ratio <= want * SLACK, (f"{target}/{arm}: non-GEMM kernels move {ratio:.2f}x bf16's "
                                 f"step, recorded {want:.2f}x: a pass came back:\n{listing}")
  assert ratio >= want / SLACK, (f"{target}/{arm}: {ratio:.2f}x bf16's step, below the recorded "
                                 f"{want:.2f}x: lower RECORD[{(target, arm)!r}] to keep the gain")
  # What the passes are for: the arm's codes are written, bf16's step writes none.
  assert any(CODES[arm] in p.purpose for p in step.passes), [p.purpose for p in step.passes]
  # Pallas kernels run where they are meant to and only there.
  kernels = sum("Pallas kernel" in p.purpose for p in step.passes)
  # MXFP8: one per operand. NVFP4: an amax and a codes kernel per operand.
  assert kernels == {"mxfp8": 3, "nvfp4": 6}.get(arm, 0), [p.purpose for p in step.passes]
  assert not any("cast to fp" in p.purpose or "cast to int" in p.purpose for p in bf16.passes)
  # No pass moves less than the minimum: each operand read once, each layout written once.
  assert step.total >= passes.dense_minimum_bytes(M, K, N, low_precision=True) * 0.5


@pytest.mark.xdist_group("b200")
@pytest.mark.parametrize("arm", ["mxfp8", "nvfp4"])
def test_b200_block_kernels_read_the_float32_weight(arm, require_target):
  """No pass writes a bfloat16 copy of the weight for the kernels to read.

  The control is the same layer with flax's own promotion, which casts the
  kernel before the product: there XLA writes the copy (4 + 2 bytes a weight).
  """
  require_target("b200")
  cast = K * N * (4 + 2)
  copies = lambda step: [p for p in step.passes if p.purpose == "cast to bf16" and p.bytes == cast]
  flax_promote = lambda *a, **kw: nn.dtypes.promote_dtype(*a, **kw)
  control = passes.step_passes(fl.QDense(N, dtype=jnp.bfloat16, recipe=RECIPES[arm],
                                         promote_dtype=flax_promote), (M, K), target="b200")
  step = _step("b200", arm)
  assert len(copies(control)) == 1 and not copies(step), [p.purpose for p in step.passes]
  # The copy's 6 bytes a weight, less what reading float32 adds: MX reads the weight once
  # (2 more bytes), NVFP4 twice (its amax, then its tile codes: 4 more).
  saved = {"mxfp8": 4, "nvfp4": 2}[arm]
  assert control.total - step.total == pytest.approx(K * N * saved, rel=0.01)


@pytest.mark.xdist_group("tpu-v5e")
def test_first_step_work_is_counted_apart(require_target):
  """Delayed scaling's first-step branch (its amaxes from the batch) runs once, not every step.

  On TPU the step keeps a ``lax.cond`` per activation and gradient (on one
  GPU their scales wait for their amaxes: no conditional, see below).
  """
  require_target("tpu-v5e")
  step = _step("tpu-v5e", "fp8_delayed")
  first = [p for p in step.passes if not p.every_step]
  assert first and all(p.branch is not None for p in first)
  # What the branch is for: measuring the batch (its scalars aside).
  large = [p for p in first if p.bytes > 1024]
  assert large and all("amax" in p.purpose for p in large), [p.purpose for p in large]
  every = sum(p.bytes for p in step.passes if p.every_step)
  assert step.total == pytest.approx(every)
  # The branch left out is the one with the work: the other runs no pass this large.
  for cond in {p.branch[0] for p in first}:
    kept = sum(p.bytes for p in step.passes if p.branch and p.branch[0] == cond and p.every_step)
    assert kept < sum(p.bytes for p in first if p.branch[0] == cond)


@pytest.mark.xdist_group("tpu-v5e")
def test_first_step_branch_is_found_by_cost_on_tpu_too(require_target):
  """XLA:TPU prints a conditional as an indexed list (the first step is branch 0 there)."""
  require_target("tpu-v5e")
  step = _step("tpu-v5e", "fp8_delayed")
  first = [p for p in step.passes if not p.every_step]
  assert first and all(p.branch[1] == 0 for p in first), [(p.name, p.branch) for p in first]


@pytest.mark.xdist_group("h100")
def test_h100_delayed_step_has_none_of_the_known_extra_passes(require_target):
  """The passes DESIGN.md 3c lists, each gone from the H100 fp8 delayed step.

  No copy of a tensor for the first-step branch (a conditional's operand
  is a buffer); no finite check as a pass of its own; the gradient's amax in
  the bias gradient's pass.
  """
  require_target("h100")
  step = _step("h100", "fp8_delayed")
  module = hlo.parse(step.report.hlo)
  entry = module.entry
  # No conditional at all on one GPU: every scale waits for its amax, so no
  # tensor is copied for a first-step branch to read.
  conds = [i.name for i in module.computations[entry] if i.opcode == "conditional"]
  assert not conds, conds
  assert all(p.every_step for p in step.passes)
  every = [p for p in step.passes if p.every_step and p.bytes > 1 << 16]
  assert not [p for p in every if p.purpose in ("finite check", "finite check + transpose")]
  assert any("amax" in p.purpose and "sum" in p.purpose for p in every), \
      [p.purpose for p in every]


@pytest.mark.xdist_group("h100")
def test_h100_steady_casts_join_their_amaxes_and_transpose_codes(require_target):
  """The H100 steady branch casts each operand (input, weight, output gradient)
  in one pass with its amax (the gradient's also with the bias gradient's
  sum) and makes each other layout by transposing the 1-byte codes.

  The default step (its scales wait for the amaxes) casts with transposes:
  the control that this is the barriers' doing, not XLA's by itself.
  """
  require_target("h100")
  steady, default = _step("h100", "fp8_delayed_steady"), _step("h100", "fp8_delayed")
  casts = lambda step: [p.purpose for p in step.passes if "cast to fp8" in p.purpose]
  assert len(casts(steady)) == 3, casts(steady)
  assert all("transpose" not in p and "amax" in p for p in casts(steady)), casts(steady)
  assert any("sum" in p for p in casts(steady) if "e5m2" in p), casts(steady)
  assert any("transpose" in p for p in casts(default)), casts(default)
  # No amax of its own (the weight's was one): every amax is in a cast's pass.
  assert not [p for p in steady.passes if "amax" in p.purpose and "cast to fp8" not in p.purpose
              and p.bytes > 1 << 16], [(p.purpose, p.bytes) for p in steady.passes]
  # The other layouts: each operand's codes (one byte each) read and written once.
  moved = sorted(p.bytes for p in steady.passes if p.purpose == "transpose")
  assert moved == sorted([2 * M * K, 2 * K * N, 2 * M * N]), moved
  # Both steps multiply in fp8, the same three GEMMs.
  assert steady.report.classes == default.report.classes == {"fp8": 3}


@pytest.mark.parametrize("target", ["h100", "b200"])
@pytest.mark.parametrize("barrier", [True, False], ids=["barrier", "control"])
def test_steady_weight_amax_stays_out_of_the_optimizer_update(target, barrier, monkeypatch,
                                                              require_target):
  """The steady branch with Adam's update in the step: the weight's amax passes
  the barrier with its codes, so XLA takes it in the cast's pass.

  The control (the barrier made a no-op) shows why: XLA takes a free amax in
  Adam's update, a reduction whose output cannot overwrite the donated
  weight, and copies the weight (a pass moving it twice in float32).
  """
  from fp8_linen.core import numerics  # pylint: disable=import-outside-toplevel
  require_target(target)
  if not barrier:
    monkeypatch.setattr(numerics, "cast_apart_from_transpose", lambda q, a, flat=False: (q, a))
  with train_step.steady_branch():
    step = passes.step_passes(fl.QDense(N, dtype=jnp.bfloat16, recipe=fl.delayed_scaling()),
                              (M, K), target=target, loss="mse", optimizer="adam")
  copies = [p for p in step.passes if p.name.startswith("copy") and p.bytes == 2 * K * N * 4]
  # Adam's update reads the weight, its gradient and both moments and writes three.
  in_update = [p for p in step.passes if "amax" in p.purpose and "cast to fp8" not in p.purpose
               and p.bytes >= 6 * K * N * 4]
  assert bool(copies) == bool(in_update) == (not barrier), \
      [(p.name, p.purpose, p.bytes) for p in step.passes[:8]]
  assert step.report.classes == {"fp8": 3}


class _OpDense(nn.Module):
  """A bfloat16 product over a float32 weight through ``fl.fp8_dot_general`` itself."""
  rhs_grad_dtype: object = None

  @nn.compact
  def __call__(self, x):
    w = self.param("kernel", nn.initializers.lecun_normal(), (K, N), jnp.float32)
    st = fl.RoleState(jnp.ones((1,)), jnp.zeros((16,)))
    y, _ = fl.fp8_dot_general(x, w.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                              input_state=st, kernel_state=st, output_grad_state=st,
                              rhs_grad_dtype=self.rhs_grad_dtype)
    return y


@pytest.mark.xdist_group("h100")
@pytest.mark.parametrize("wgrad", ["layer", "layer_sgd", "op_f32"])
def test_where_the_weight_gradient_is_cast(wgrad, require_target):
  """Who casts the weight's gradient to its float32 parameter.

  The layers' wgrad GEMM writes bfloat16, as bf16's own step (flax's
  ``nn.Dense``) does: a step that returns the gradient casts it in a pass of
  its own, and a step that updates the weight (SGD here) fuses the cast into
  the update. ``fp8_dot_general(..., rhs_grad_dtype=jnp.float32)`` has the
  GEMM write float32 and no pass casts it: what a step that returns its
  gradients saves.
  """
  require_target("h100")
  if wgrad == "layer":
    step = _step("h100", "fp8_delayed")
  elif wgrad == "layer_sgd":
    step = passes.step_passes(fl.QDense(N, dtype=jnp.bfloat16), (M, K), target="h100",
                              optimizer="sgd")
  else:
    step = passes.step_passes(_OpDense(jnp.float32), (M, K), target="h100")
  want = {"layer": "bf16", "layer_sgd": "bf16", "op_f32": "f32"}[wgrad]
  assert sorted(p.out for p in step.report.product_list) == sorted(["bf16", "bf16", want])
  casts = [p for p in step.passes if p.purpose == "cast to f32" and p.bytes >= K * N * 2]
  assert bool(casts) == (wgrad == "layer"), [(p.purpose, p.bytes) for p in step.passes]
  assert any(p.purpose == "cast to f32" for p in _step("h100", "bf16").passes)


@pytest.mark.xdist_group("b200")
def test_split_first_step_runs_the_steady_program_every_step(require_target):
  """``fl.split_first_step``'s program: both traces under one conditional, the cheap one every step.

  Compiled for the B200, the wrapped step's every-step kernels (the
  conditional's cheaper branch) move what the steady trace alone moves, and
  the other branch is the default step, whose casts wait for their amaxes.
  """
  require_target("b200")
  model = fl.QDense(N, dtype=jnp.bfloat16, recipe=fl.delayed_scaling())
  variables, x, r = train_step.train_step_inputs(model, (M, K))
  report = compile_lib.compile_for("b200", fl.split_first_step(train_step.make_train_step(model)),
                                   variables, x, r)
  ps = passes.passes(report)
  by_branch = {}
  for p in ps:
    by_branch.setdefault(p.branch, 0.0)
    by_branch[p.branch] += p.bytes
  conds = {b[0] for b in by_branch if b is not None}
  assert len(conds) == 1, by_branch
  every = sum(p.bytes for p in ps if p.every_step)
  first = sum(p.bytes for p in ps if not p.every_step)
  steady, default = _step("b200", "fp8_delayed_steady"), _step("b200", "fp8_delayed")
  assert every == pytest.approx(steady.total, rel=0.02)
  assert first == pytest.approx(default.total, rel=0.02)
  assert every < 0.92 * first
  # Both branches multiply in fp8: three GEMMs each, all low precision.
  assert len(report.product_list) == 6, report.product_list
  assert all(p.low_precision for p in report.product_list), report.product_list
