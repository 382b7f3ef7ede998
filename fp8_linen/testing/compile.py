"""Compile a function for a target this machine does not have, and report what XLA chose.

:func:`compile_for` compiles any function for a target of
:mod:`fp8_linen.testing.targets` and returns a :class:`CompileReport`: every
product with the dtypes it is fed (:mod:`fp8_linen.testing.hlo_products`), the
low-precision ones by kind (GPU: cuBLASLt fp8 / s8 GEMMs, cuDNN fp8
convolutions, cuDNN block-scaled dots; TPU: convolutions by operand dtypes),
collectives (count and bytes), planned memory, and a step-time estimate
(:mod:`fp8_linen.testing.estimate`, compile only).
:func:`compile_train_step` compiles the step of
:mod:`fp8_linen.testing.train_step` for a model.

**What it proves.** Which kernels XLA selects for the target and what dtypes
feed them (when XLA's fp8 match fails on a GPU it *silently* upcasts the dot;
this is how that is caught), the collectives of a sharded step and the memory
it plans. **What it does not prove**: speed (nothing runs; the estimate is a
roofline over the compiled kernels), numerical results on the device, or that
a library accepts at run time a call XLA emitted at compile time.

Notes:

* Without a device XLA:GPU cannot autotune, so every GEMM would become a
  Triton GEMM fusion; GPU targets compile with Triton GEMMs off
  (:data:`GPU_COMPILER_OPTIONS`) so dots go to the cuBLAS rewriter, whose fp8
  pattern match is what the counts check.
* fp8_linen picks its GEMM lowering for the backend it traces for, which is
  ``'cpu'`` here; :func:`compile_for` traces under
  ``fl.target_backend(target.platform, block_scaled=target.block_scaled_gemms)``,
  exactly the forms a user of that target gets (on the B200, block recipes
  as block-scaled GEMMs).
* JAX's persistent compilation cache cannot serve these programs: it would
  write an entry for a compile-only topology but cannot load it back without
  a device client (jax 0.10: "PjRtCompiler must be constructed with a
  Client"), and a later compile of the same program would warn and compile
  again. :func:`compile_for` keeps them out of it; reuse a report within a
  process instead (:func:`fp8_linen.testing.cases.compile_case`).

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.testing.compile import GPU_COMPILER_OPTIONS, compile_train_step
  >>> GPU_COMPILER_OPTIONS
  {'xla_gpu_enable_triton_gemm': False}
  >>> r = compile_train_step(fl.QDense(256), (128, 256), target='tpu-v6e')  # doctest: +SKIP
  >>> r.classes  # doctest: +SKIP
  {'fp8': 3}
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any, Callable, Mapping

import jax

from fp8_linen.core.lowering import target_backend
from fp8_linen.testing import estimate as estimate_lib
from fp8_linen.testing import hlo, hlo_collectives, hlo_kernels, hlo_products
from fp8_linen.testing.targets import Target, get_target, target_mesh, use_cpu_platform
from fp8_linen.testing.train_step import make_train_step, optimizer_of, train_step_inputs

__all__ = [
    "GPU_COMPILER_OPTIONS",
    "abstract_on",
    "CompileReport",
    "compile_for",
    "compile_train_step",
]

GPU_COMPILER_OPTIONS: Mapping[str, Any] = {"xla_gpu_enable_triton_gemm": False}
"""Send dots to the cuBLAS(Lt) rewriter (no autotuning is possible without a device)."""


def abstract_on(tree, mesh):
  """``tree`` as ``jax.ShapeDtypeStruct`` leaves on ``mesh``.

  A leaf that already carries a ``NamedSharding`` on ``mesh``'s devices keeps
  its partitioning; every other leaf is replicated. Leaves may be arrays,
  ``ShapeDtypeStruct`` or anything with ``shape`` and ``dtype``.
  """
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  def place(a):
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding) and (
        set(sharding.mesh.devices.flat) == set(mesh.devices.flat)):
      return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))

  return jax.tree.map(place, tree)


@dataclasses.dataclass(frozen=True)
class CompileReport(hlo_products.ProductCounts):
  """What XLA compiled for a target.

  The GPU counts of :class:`fp8_linen.testing.hlo_products.ProductCounts`
  (``fp8_gemms``, ``int8_gemms``, ``block_scaled_dots``, ...) plus:

  Attributes:
    target: the target's name.
    platform: ``'gpu'`` or ``'tpu'``.
    product_list: every :class:`~fp8_linen.testing.hlo_products.Product` with the
      dtypes it is fed.
    collective_list: every :class:`~fp8_linen.testing.hlo_collectives.Collective`.
    kernel_list: the top-level :class:`~fp8_linen.testing.hlo_kernels.Kernel` s (the
      estimate's input).
    hlo: the optimized HLO text (``compiled.as_text()``).
    temp_bytes: ``temp_size_in_bytes`` of ``compiled.memory_analysis()``: the
      peak of XLA's temporary buffers for the step.
    argument_bytes, output_bytes, alias_bytes: the other memory figures.
    compile_seconds: wall time of ``lower`` + ``compile``.
    compiler_options: the XLA options it was compiled with.
  """

  target: str = ""
  platform: str = ""
  product_list: tuple[hlo_products.Product, ...] = dataclasses.field(default=(), repr=False)
  collective_list: tuple[hlo_collectives.Collective, ...] = dataclasses.field(default=(),
                                                                      repr=False)
  kernel_list: tuple[hlo_kernels.Kernel, ...] = dataclasses.field(default=(), repr=False)
  hlo: str = dataclasses.field(default="", repr=False)
  temp_bytes: int = 0
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0
  compile_seconds: float = 0.0
  compiler_options: tuple[tuple[str, Any], ...] = ()

  @property
  def classes(self) -> dict[str, int]:
    """Products per operand class: ``{'fp8': 3}``, ``{'int8': 1, 'bf16': 2}``, ..."""
    return dict(sorted(collections.Counter(p.operand_class for p in self.product_list).items()))

  @property
  def operand_pairs(self) -> dict[tuple, int]:
    """Products per ``(lhs dtype, rhs dtype, out dtype)``."""
    return dict(sorted(collections.Counter(
        (*p.operands, p.out) for p in self.product_list).items(), key=str))

  @property
  def low_precision(self) -> int:
    """Products whose two operands are 8-bit (or 4-bit) floats or integers."""
    return sum(p.low_precision for p in self.product_list)

  @property
  def by_kind(self) -> dict[str, int]:
    """Low-precision products by what runs them.

    GPU: ``'cuBLASLt fp8'``, ``'cuBLASLt s8'``, ``'cuDNN fp8 conv'``,
    ``'cuDNN block-scaled'``, ``'Triton fp8'``; TPU: ``'MXU f8'`` /
    ``'MXU s8'`` (convolutions by operand dtypes). A low-precision product
    XLA left to a generic emitter is ``'other'``.
    """
    names = collections.Counter()
    for p in self.product_list:
      if not p.low_precision:
        continue
      cls = p.operand_class
      if self.platform == "tpu":
        names[{"fp8": "MXU f8", "int8": "MXU s8"}.get(cls, f"MXU {cls}")] += 1
      elif p.kind == "block-scaled-dot":
        names["cuDNN block-scaled"] += 1
      elif p.kind in ("cublas", "cudnn-gemm"):
        names["cuBLASLt fp8" if cls == "fp8" else "cuBLASLt s8"] += 1
      elif p.kind in ("cudnn-conv", "convolution"):
        names[f"cuDNN {cls} conv"] += 1
      elif p.kind == "triton-gemm":
        names[f"Triton {cls}"] += 1
      else:
        names["other"] += 1
    return dict(sorted(names.items()))

  def describe(self) -> str:
    """What the program multiplies, in one cell: ``'1/3: 1 MXU s8, 2 bf16'``.

    Low-precision products / all products, then the low-precision ones by
    kernel kind (:attr:`by_kind`) and the others by operand class.
    """
    parts = [f"{n} {k}" for k, n in self.by_kind.items()]
    parts += [f"{n} {c}" for c, n in self.classes.items() if c not in ("fp8", "int8", "fp4")]
    return f"{self.low_precision}/{len(self.product_list)}: " + ", ".join(parts)

  @property
  def collective_totals(self) -> dict[str, tuple[int, float]]:
    """``{kind: (count, bytes)}`` of the collectives."""
    return hlo_collectives.collective_totals(self.collective_list)

  def estimate(self, peaks: estimate_lib.Peaks | None = None) -> estimate_lib.Estimate:
    """The step-time estimate (compile only) with this target's published peaks."""
    return estimate_lib.estimate(self.kernel_list, peaks or get_target(self.target).peaks)

  def summary(self) -> str:
    """One line: low-precision products / products, by kind and class, and temp memory."""
    kinds = ", ".join(f"{k} {n}" for k, n in self.by_kind.items()) or "none"
    classes = ", ".join(f"{k} {n}" for k, n in self.classes.items())
    coll = self.collective_totals
    coll_s = ("; collectives " + ", ".join(f"{k} {n}" for k, (n, _) in coll.items())
              if coll else "")
    return (f"{self.target}: low precision {self.low_precision}/{len(self.product_list)} "
            f"products ({kinds}; by operands: {classes}){coll_s}; "
            f"temp {self.temp_bytes / 2**20:.1f} MiB")


@contextlib.contextmanager
def _kept_out_of_persistent_cache():
  """No compile in this block writes to JAX's persistent compilation cache (it would not load)."""
  name = "jax_persistent_cache_min_compile_time_secs"
  before = getattr(jax.config, name)
  jax.config.update(name, float("inf"))
  try:
    yield
  finally:
    jax.config.update(name, before)


def _traced_for(t: Target):
  """``fl.target_backend`` of what runs on ``t`` (a B200: block-scaled GEMMs)."""
  return target_backend(t.platform, block_scaled=t.block_scaled_gemms)


def compile_for(target: str | Target, fn: Callable, *args,
                compiler_options: Mapping[str, Any] | None = None,
                trace_as_target: bool = True, donate_argnums=()) -> CompileReport:
  """Compiles ``jax.jit(fn)(*args)`` for ``target`` and reads what XLA chose.

  Args:
    target: a target name (see :data:`~fp8_linen.testing.targets.TARGETS`) or
      :class:`~fp8_linen.testing.targets.Target`.
    fn: the function to compile.
    *args: pytrees of arrays or ``ShapeDtypeStruct``. Leaves carrying a
      ``NamedSharding`` on a :func:`~fp8_linen.testing.targets.target_mesh`
      of this target keep it; the others are replicated.
    compiler_options: XLA options (default: :data:`GPU_COMPILER_OPTIONS` on a
      GPU, none on a TPU).
    trace_as_target: trace under ``fl.target_backend(target.platform,
      block_scaled=target.block_scaled_gemms)`` (the forms fp8_linen traces
      on that hardware).
    donate_argnums: arguments whose buffers the program may reuse (``jax.jit``'s),
      as a training loop donates its state.

  Returns:
    A :class:`CompileReport`.

  Raises:
    fp8_linen.testing.targets.TargetUnavailable: when the target cannot
      compile here (the reason says why). Errors of XLA itself (e.g. a
      failed compile) propagate.
  """
  t = get_target(target)
  use_cpu_platform()
  mesh = target_mesh(t)
  default = GPU_COMPILER_OPTIONS if t.platform == "gpu" else {}
  options = dict(default if compiler_options is None else compiler_options)
  t0 = time.perf_counter()
  # A one-device target traces on its mesh, so code that asks how many
  # devices it runs on (the Pallas kernels) sees the target's one, not this
  # machine's CPU devices.
  with (_traced_for(t) if trace_as_target else contextlib.nullcontext()), \
       (jax.set_mesh(mesh) if mesh.size == 1 else contextlib.nullcontext()):
    lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*abstract_on(args, mesh))
  with _kept_out_of_persistent_cache():
    compiled = lowered.compile(compiler_options=options or None)
  seconds = time.perf_counter() - t0
  return _report(t, compiled.as_text(), compiled.memory_analysis(), seconds, options)


def _report(t: Target, text: str, mem, seconds: float, options) -> CompileReport:
  module = hlo.parse(text)
  prods = hlo_products.products(module)
  counts = hlo_products.counts_of(prods, module)
  get = lambda field: int(getattr(mem, field, 0) or 0) if mem is not None else 0
  return CompileReport(
      **{f.name: getattr(counts, f.name) for f in dataclasses.fields(counts)},
      target=t.name, platform=t.platform, product_list=tuple(prods),
      collective_list=tuple(hlo_collectives.collectives(module)),
      kernel_list=tuple(hlo_kernels.kernels(module)),
      hlo=text, temp_bytes=get("temp_size_in_bytes"),
      argument_bytes=get("argument_size_in_bytes"), output_bytes=get("output_size_in_bytes"),
      alias_bytes=get("alias_size_in_bytes"), compile_seconds=seconds,
      compiler_options=tuple(sorted(options.items())))


def compile_train_step(model, x, dtype=None, *, target: str | Target = "h100",
                       loss: str = "linear", optimizer=None, **kwargs) -> CompileReport:
  """:func:`compile_for` of the step that proves ``model`` (:mod:`.train_step`).

  Args:
    model: a Linen module (or :func:`fp8_linen.quantize_model` wrapper).
    x: the input (shape tuple, array or ``ShapeDtypeStruct``).
    dtype: the input dtype when ``x`` is a shape (default bfloat16).
    target: the target name or :class:`~fp8_linen.testing.targets.Target`.
    loss: the step's loss (:data:`fp8_linen.testing.train_step.LOSSES`).
    optimizer: ``None`` (the step returns its gradients) or the optimizer whose
      update follows them in the step (a name in
      :data:`~fp8_linen.testing.train_step.OPTIMIZERS` or an optax
      transformation); the variables and the optimizer's state are donated.
    **kwargs: passed to :func:`compile_for` (``compiler_options``).

  Returns:
    The step's :class:`CompileReport`.

  Raises:
    ValueError: for an unknown ``loss`` or ``optimizer``.
  """
  t = get_target(target)
  use_cpu_platform()
  tx = optimizer_of(optimizer)
  variables, x, r = train_step_inputs(model, x, dtype, t.platform)
  step = make_train_step(model, loss=loss, optimizer=tx)
  if tx is None:
    return compile_for(t, step, variables, x, r, **kwargs)
  opt_state = jax.eval_shape(tx.init, variables["params"])
  return compile_for(t, step, variables, opt_state, x, r, donate_argnums=(0, 1), **kwargs)
