"""The cases every target is checked on: each a compiled program and what it must multiply.

A :class:`Case` is a training step (:mod:`fp8_linen.testing.train_step`: loss,
``dL/dx`` and all gradients) or a served forward of one layer, a small model
or an unmodified decoder block (:class:`DecoderBlock` through
:func:`fp8_linen.quantize_model`), with the products its compiled program must
have on each platform (by operand class: ``{'fp8': 3}``, ``{'int8': 1,
'bf16': 2}``) and, where one target multiplies differently (the B200's
block-scaled dots), per target. :func:`cases` is the table, in the order the
CLI (``python -m fp8_linen.testing.cli``), the README's accelerator table and
``tests/targets`` use; :func:`compile_case` compiles one case for one target
once per process; :func:`check` says why a report does not show the claim.

Example:
  >>> from fp8_linen.testing import cases
  >>> table = {c.name: c for c in cases.cases()}
  >>> table['qdense-delayed'].what
  'QDense, fp8 delayed scaling'
  >>> table['qdense-mx'].expected_on('h100', 'gpu'), table['qdense-mx'].expected_on('b200', 'gpu')
  ({'bf16': 3}, {'fp8': 3})
  >>> cases.compile_case('qdense-delayed', 'tpu-v6e').classes  # doctest: +SKIP
  {'fp8': 3}
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen.core.lowering import target_backend
from fp8_linen.testing.compile import CompileReport, compile_for
from fp8_linen.testing.targets import get_target, use_cpu_platform
from fp8_linen.testing.train_step import make_train_step, train_step_inputs

__all__ = ["DecoderBlock", "Case", "cases", "compile_case", "check"]


class DecoderBlock(nn.Module):
  """An unmodified pre-LN decoder block: self-attention and a GELU MLP, both residual.

  Attributes:
    num_heads: attention heads.
    qkv_features: width of the query/key/value projections.
    mlp: hidden width of the MLP.
    dtype: compute dtype (None: float32).
  """

  num_heads: int = 8
  qkv_features: int = 128
  mlp: int = 512
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                            qkv_features=self.qkv_features, dtype=self.dtype,
                                            deterministic=True)(h)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.gelu(nn.Dense(self.mlp, dtype=self.dtype)(h))
    return x + nn.Dense(x.shape[-1], dtype=self.dtype)(h)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  """A training step (or served forward) and what its compiled program must multiply.

  Attributes:
    name: the case's name (a row of the CLI's table).
    what: what is compiled, in words.
    build: ``build(platform) -> (fn, args)``: the function to compile and its
      abstract arguments, traced for ``platform`` (built lazily: some cases
      run a model once to make them).
    expected: ``fn(platform) -> {operand class: products}``: the products the
      compiled program must have (see
      :attr:`~fp8_linen.testing.compile.CompileReport.classes`), or
      ``None`` where the case makes no claim on that platform.
    note: ``fn(platform) -> str``: what the row shows, where it needs saying.
    on_target: per-target overrides of ``(expected, note)`` by target name,
      where one target of a platform multiplies differently (the B200's
      block-scaled dots: block recipes are emulated on the H100).
  """

  name: str
  what: str
  build: Callable[[str], tuple]
  expected: Callable[[str], Mapping[str, int] | None]
  note: Callable[[str], str] = lambda platform: ""
  on_target: Mapping[str, tuple[Mapping[str, int] | None, str]] = dataclasses.field(
      default_factory=dict)

  def expected_on(self, target: str, platform: str) -> Mapping[str, int] | None:
    """The products the case claims on ``target`` (of ``platform``)."""
    return self.on_target[target][0] if target in self.on_target else self.expected(platform)

  def note_on(self, target: str, platform: str) -> str:
    """The row's note on ``target`` (of ``platform``)."""
    return self.on_target[target][1] if target in self.on_target else self.note(platform)


def _step_case(name, what, model_fn, x, dtype, expected, note=None, on_target=None) -> Case:
  def build(platform):
    model = model_fn()
    return make_train_step(model), train_step_inputs(model, x, dtype, platform)
  return Case(name=name, what=what, build=build, expected=expected,
              note=note or (lambda platform: ""), on_target=dict(on_target or {}))


def _nnx_step_case(name, what, recipe, expected) -> Case:
  def build(platform):
    from flax import nnx  # pylint: disable=import-outside-toplevel
    import fp8_linen.nnx as fnnx  # pylint: disable=import-outside-toplevel
    model = fnnx.Linear(256, 256, dtype=jnp.bfloat16, recipe=recipe, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x, r):
      model = nnx.merge(graphdef, state)
      loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) * r)
      value, (grads, dx) = nnx.value_and_grad(
          loss, argnums=(nnx.DiffState(0, fnnx.DIFF), 1))(model, x)
      return value, dx, nnx.as_pure(grads)

    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    return step, (nnx.as_pure(state), x, r)
  return Case(name=name, what=what, build=build, expected=expected)


def _served_case(name, what, recipe, expected, note=None, on_target=None) -> Case:
  def build(platform):
    import fp8_linen as fl  # pylint: disable=import-outside-toplevel
    model = nn.Sequential([fl.QDense(256, dtype=jnp.bfloat16, recipe=recipe), nn.relu,
                           fl.QDense(128, dtype=jnp.bfloat16, recipe=recipe)])
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16)
    # Compiled rather than run op by op: eagerly, every primitive of the block
    # recipes' init and gradient compiles on its own (half a minute for NVFP4).
    with target_backend(platform):
      v = jax.jit(model.init)(jax.random.key(1), x)
      v = fl.merge_owg(v, jax.jit(jax.grad(
          lambda v: jnp.sum(model.apply(v, x).astype(jnp.float32) ** 2)))(v))
      served, params = fl.convert(model, v, x)
    return served.apply, (params, jax.ShapeDtypeStruct(x.shape, x.dtype))
  return Case(name=name, what=what, build=build, expected=expected,
              note=note or (lambda platform: ""), on_target=dict(on_target or {}))


def _all(n: int, cls: str = "fp8"):
  return lambda platform: {cls: n}


def cases() -> list[Case]:
  """Every case, in the order of the CLI's table (each builds its program lazily)."""
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel

  bf16, d, tokens = jnp.bfloat16, 256, (128, 256)
  delayed = fl.Fp8Recipe()
  ste = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
  lsq = fl.int8_lsq()
  ste8 = dataclasses.replace(ste, grad_bits=8)
  int_fwd = lambda platform: {"int8": 1, "bf16": 2}
  dense = lambda r: (lambda: fl.QDense(d, dtype=bf16, recipe=r))
  mlp = lambda: nn.Sequential([fl.QDense(d, dtype=bf16), nn.gelu, fl.QDense(d, dtype=bf16),
                               nn.gelu, fl.QDense(d, dtype=bf16)])
  mx, nv = fl.mx_block_scaling(), fl.nvfp4()
  block_note = lambda fmt: (lambda p: f"bf16 emulation of the {fmt} blocks: no block-scaled "
                                      "GEMM on this target")
  # Blackwell multiplies the blocks itself: cuDNN block-scaled dots for the
  # forward, dgrad and wgrad.
  on_b200 = lambda cls: {"b200": ({cls: 3}, "cuDNN block-scaled dots (forward, dgrad, wgrad)")}
  # A served model runs the forward only: one block-scaled dot per layer, fed
  # the stored weight codes and the input quantized in the same blocks.
  served_b200 = lambda cls: {"b200": ({cls: 2}, "cuDNN block-scaled dots fed the stored codes")}
  general = lambda r: (lambda: fl.QDenseGeneral(features=(8, 32), dtype=bf16, recipe=r))
  einsum = lambda r: (lambda: fl.QEinsum(shape=(d, 8, 32), einsum_str="btd,dhk->bthk",
                                         dtype=bf16, recipe=r))
  tpu_fp8_note = lambda p: ("e4m3 products: MXU at the bf16 rate on v5e/v6e, fp8 rate on 7x"
                            if p == "tpu" else "")
  return [
      _step_case("qdense-delayed", "QDense, fp8 delayed scaling", dense(delayed), tokens, bf16,
                 _all(3), tpu_fp8_note),
      _step_case("qdense-current", "QDense, fp8 current scaling",
                 dense(fl.current_scaling()), tokens, bf16, _all(3), tpu_fp8_note),
      _step_case("qdense-rowwise", "QDense, fp8 row-wise scaling",
                 dense(fl.rowwise_scaling()), tokens, bf16, _all(3),
                 lambda p: "plain fp8 GEMM, row/column scales on its output"),
      _step_case("qdense-mx", "QDense, MXFP8 block scaling", dense(mx), tokens, bf16,
                 _all(3, "bf16"), block_note("MXFP8"), on_b200("fp8")),
      _step_case("qdensegeneral-mx", "QDenseGeneral (256, 8, 32), MXFP8", general(mx),
                 (4, 32, d), bf16, _all(3, "bf16"), block_note("MXFP8"), on_b200("fp8")),
      _step_case("qeinsum-mx", "QEinsum 'btd,dhk->bthk', MXFP8", einsum(mx), (4, 32, d), bf16,
                 _all(3, "bf16"), block_note("MXFP8"), on_b200("fp8")),
      _step_case("qdense-nvfp4", "QDense, NVFP4 (2-D weight tiles, Hadamard, SR)", dense(nv),
                 tokens, bf16, _all(3, "bf16"), block_note("NVFP4"), on_b200("fp4")),
      _step_case("qdensegeneral-nvfp4", "QDenseGeneral (256, 8, 32), NVFP4", general(nv),
                 (4, 32, d), bf16, _all(3, "bf16"), block_note("NVFP4"), on_b200("fp4")),
      _step_case("qeinsum-nvfp4", "QEinsum 'btd,dhk->bthk', NVFP4", einsum(nv), (4, 32, d),
                 bf16, _all(3, "bf16"), block_note("NVFP4"), on_b200("fp4")),
      _step_case("qdense-int8-ste", "QDense, int8 STE (channel weights)", dense(ste), tokens,
                 bf16, int_fwd, lambda p: "forward s8 x s8 -> s32; gradients bf16"),
      _step_case("qdense-int8-lsq", "QDense, int8 LSQ", dense(lsq), tokens, bf16, int_fwd,
                 lambda p: "forward s8 x s8 -> s32; gradients bf16"),
      _step_case("qdense-int8-grad8", "QDense, int8 STE, grad_bits=8", dense(ste8), tokens,
                 bf16, _all(3, "int8")),
      _step_case("qdensegeneral", "QDenseGeneral, kernel (256, 8, 32)", lambda: fl.QDenseGeneral(
          features=(8, 32), dtype=bf16, recipe=delayed), (4, 32, d), bf16, _all(3)),
      _step_case("qeinsum", "QEinsum 'btd,dhk->bthk'", lambda: fl.QEinsum(
          shape=(d, 8, 32), einsum_str="btd,dhk->bthk", dtype=bf16, recipe=delayed),
          (4, 32, d), bf16, _all(3)),
      _step_case("qeinsum-int8-lsq", "QEinsum 'td,dhk->thk', int8 LSQ", lambda: fl.QEinsum(
          shape=(d, 4, d // 4), einsum_str="td,dhk->thk", dtype=bf16, recipe=lsq),
          tokens, bf16, int_fwd),
      _step_case("qconv", "QConv 3x3, 64->64, fp8 delayed", lambda: fl.QConv(
          64, (3, 3), dtype=bf16, recipe=delayed), (8, 16, 16, 64), bf16, _all(3),
          lambda p: ("forward and dgrad cuDNN fp8 convolutions, wgrad one fp8 GEMM"
                     if p == "gpu" else "")),
      _step_case("qconv-int8-ste", "QConv 3x3, 64->64, int8 STE", lambda: fl.QConv(
          64, (3, 3), dtype=bf16, recipe=ste), (8, 16, 16, 64), bf16, int_fwd,
          lambda p: "forward s8 x s8 -> s32 convolution; gradients bf16"),
      _step_case("fp8activation+qdense", "Fp8Activation -> QDense", lambda: nn.Sequential(
          [fl.Fp8Activation(), fl.QDense(d, dtype=bf16, recipe=delayed)]), tokens, bf16,
          _all(3)),
      _step_case("fp8activation+dense", "Fp8Activation -> nn.Dense (bf16 GEMM)",
                 lambda: nn.Sequential([fl.Fp8Activation(), nn.Dense(d, dtype=bf16)]), tokens,
                 bf16, _all(3, "bf16"), lambda p: "the activation is stored in fp8; the GEMM "
                                                  "after it is the float layer's"),
      _step_case("mlp-3", "3 x QDense MLP", mlp, tokens, bf16, _all(9)),
      _nnx_step_case("nnx-linear", "fl.nnx.Linear, fp8 delayed", delayed, _all(3)),
      _nnx_step_case("nnx-linear-int8-lsq", "fl.nnx.Linear, int8 LSQ", lsq, int_fwd),
      _step_case("block-fp8", "bf16 pre-LN decoder block, quantize_model fp8 delayed", lambda: (
          fl.quantize_model(DecoderBlock(dtype=bf16), delayed)), (2, 64, 128), bf16, _all(24)),
      _step_case("block-int8", "the same block, int8 STE on every product", lambda: (
          fl.quantize_model(DecoderBlock(dtype=bf16), ste)), (2, 64, 128), bf16,
          lambda p: {"int8": 8, "bf16": 16}),
      _served_case("served-int8", "fl.convert of 2 x QDense, int8 LSQ: served forward", lsq,
                   _all(2, "int8")),
      _served_case("served-fp8", "fl.convert of 2 x QDense, fp8 delayed: served forward",
                   delayed, _all(2)),
      _served_case("served-mx", "fl.convert of 2 x QDense, MXFP8: served forward", mx,
                   _all(2, "bf16"), block_note("MXFP8"), served_b200("fp8")),
      _served_case("served-nvfp4", "fl.convert of 2 x QDense, NVFP4: served forward", nv,
                   _all(2, "bf16"), block_note("NVFP4"), served_b200("fp4")),
      _step_case("bf16-dense", "nn.Dense bf16 (control)", lambda: nn.Dense(d, dtype=bf16),
                 tokens, bf16, _all(3, "bf16")),
  ]


@functools.lru_cache(maxsize=None)
def _built(case_name: str, platform: str) -> tuple:
  """``(fn, args)`` of a case for a platform, built once per process.

  The targets of one platform (the H100 and the B200) compile the same
  function: a served case trains and converts its model only once for them.
  """
  return {c.name: c for c in cases()}[case_name].build(platform)


@functools.lru_cache(maxsize=None)
def compile_case(case_name: str, target: str) -> CompileReport:
  """The :class:`~fp8_linen.testing.compile.CompileReport` of one case on one target.

  Compiled once per process and kept: the CLI, the README table and the tests
  that check a case read the same program.

  Args:
    case_name: a :class:`Case` name (see :func:`cases`).
    target: a target name (see :data:`fp8_linen.testing.targets.TARGETS`).

  Raises:
    fp8_linen.testing.targets.TargetUnavailable: when the target cannot
      compile here.
  """
  t = get_target(target)
  use_cpu_platform()
  fn, args = _built(case_name, t.platform)
  return compile_for(t, fn, *args)


def check(case: Case, report: CompileReport) -> str | None:
  """Why ``report`` does not show what ``case`` claims on its target, or None.

  On a GPU the claim also needs every product in a library kernel (none left
  to a generic emitter).
  """
  want = case.expected_on(report.target, report.platform)
  if want is None:
    return None
  if report.classes != dict(want):
    return f"expected products {dict(want)}, compiled {report.classes}"
  if report.platform == "gpu" and report.other_dots:
    return f"{report.other_dots} product(s) left to a generic emitter"
  return None

