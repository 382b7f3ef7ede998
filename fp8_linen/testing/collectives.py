"""The collectives of a sharded training step, read from the compiled program.

A 1024-wide stack of bf16 dense layers (``nn.Dense``, or ``fl.QDense`` with a
recipe), its kernels sharded ``P('fsdp', None)`` over every device of a mesh
and its batch over the same axis (FSDP), compiled as the step that proves a
layer (:func:`~fp8_linen.testing.train_step.make_train_step`: loss, ``dL/dx``
and every gradient) on the 8-device CPU mesh or for a multi-device target
(``'h100x8'``, ``'tpu-v6e-2x2'``). :func:`fsdp_step` reads, per step:

* every collective by kind, count and bytes, and apart the ones that run only
  in a step that takes a ``lax.cond`` branch (delayed scaling's first step);
* the weight gathers (all-gathers) with the bytes they move, against the
  kernels' bytes as float32 parameters;
* the all-reduces that only make the new quantization state
  (:func:`state_all_reduces`), and all the arm adds over the bf16 stack's.

Example:
  >>> from fp8_linen.testing import collectives
  >>> collectives.ARMS
  ('bf16', 'fp8_delayed', 'fp8_current', 'int8')
  >>> r = collectives.fsdp_step('fp8_delayed', depth=4)  # doctest: +SKIP
  >>> r.every_step['all-gather']  # doctest: +SKIP
  (4, 4194304.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from fp8_linen.core.lowering import target_backend
from fp8_linen.testing import hlo, hlo_collectives
from fp8_linen.testing import targets as targets_lib
from fp8_linen.testing.compile import compile_for
from fp8_linen.testing.train_step import make_train_step, train_step_inputs

__all__ = ["ARMS", "CPU_MESH", "DEVICES", "StepCollectives", "recipe", "stack", "fsdp_step",
           "state_all_reduces", "extra_all_reduces"]

ARMS = ("bf16", "fp8_delayed", "fp8_current", "int8")
"""The arms: ``nn.Dense`` bf16, ``fl.QDense`` fp8 delayed / current, int8 STE (channel weights)."""

CPU_MESH = "cpu"
"""The name :func:`fsdp_step` takes for the 8-device CPU mesh (``XLA_FLAGS=
--xla_force_host_platform_device_count=8``)."""

DEVICES = {CPU_MESH: "CPU (8 virtual devices)", "h100x8": "8 x H100 (compile only)",
           "tpu-v6e-2x2": "TPU v6e 2x2 (compile only)"}
"""The device names the results use, by mesh."""

_GATHER_BYTES = ("u8", "s8", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz")


def recipe(arm: str):
  """The recipe of ``arm`` (``None`` for bf16)."""
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  if arm not in ARMS:
    raise ValueError(f"arm={arm!r} is not one of {ARMS}")
  return {"bf16": None, "fp8_delayed": fl.delayed_scaling(), "fp8_current": fl.current_scaling(),
          "int8": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))}[arm]


def stack(arm: str, depth: int, width: int = 1024) -> nn.Module:
  """``depth`` dense layers of ``width`` features in bfloat16 (float32 parameters)."""
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  r = recipe(arm)
  layer = ((lambda: nn.Dense(width, dtype=jnp.bfloat16)) if r is None else
           (lambda: fl.QDense(width, dtype=jnp.bfloat16, recipe=r)))
  return nn.Sequential([layer() for _ in range(depth)])


@dataclasses.dataclass(frozen=True)
class StepCollectives:
  """The collectives of one compiled FSDP step.

  Attributes:
    where: ``'cpu'`` or the target's name.
    device: the machine, in words.
    arm: one of :data:`ARMS`.
    depth: layers.
    width: features per layer.
    axis_type: ``'auto'`` or ``'explicit'`` mesh axes.
    tokens: rows of the batch.
    every_step: ``{kind: (count, bytes)}`` of the collectives every step runs.
    first_step_only: the same for those inside a ``lax.cond`` branch (delayed
      scaling's scale from the current amax, taken while a history is empty).
    gathers: every all-gather of a step
      (:class:`~fp8_linen.testing.hlo_collectives.Collective`).
    kernel_f32_bytes: the kernels' bytes as float32 parameters (the
      baseline a float32 weight gather moves).
    hlo_text: the optimized HLO.
  """

  where: str
  device: str
  arm: str
  depth: int
  width: int
  axis_type: str
  tokens: int
  every_step: dict
  first_step_only: dict
  gathers: tuple
  kernel_f32_bytes: int
  hlo_text: str = dataclasses.field(default="", repr=False)

  @property
  def gather_bytes(self) -> float:
    """Bytes all-gathered per step (weights, and activations where XLA gathers those)."""
    return sum(c.nbytes for c in self.gathers)

  @property
  def weight_gather_bytes(self) -> float:
    """Bytes of the all-gathered arrays that have a kernel's shape (the weight gathers)."""
    kernel = (self.width, self.width)
    return sum(a.nbytes for c in self.gathers for a in c.arrays if tuple(a.shape) == kernel)

  @property
  def gathers_in_codes(self) -> bool:
    """Whether every all-gather moves 1-byte codes (uint8, int8 or fp8)."""
    return all(set(c.dtypes) <= set(_GATHER_BYTES) for c in self.gathers)

  def count(self, kind: str) -> int:
    """Collectives of ``kind`` per step."""
    return self.every_step.get(kind, (0, 0.0))[0]

  def row(self) -> dict:
    """A JSON-able summary."""
    return {"arm": self.arm, "depth": self.depth, "width": self.width, "tokens": self.tokens,
            "axis_type": self.axis_type,
            "every_step": {k: {"count": n, "bytes": b} for k, (n, b) in self.every_step.items()},
            "first_step_only": {k: {"count": n, "bytes": b}
                                for k, (n, b) in self.first_step_only.items()},
            "gather_bytes": self.gather_bytes,
            "weight_gather_bytes": self.weight_gather_bytes,
            "gather_dtypes": sorted({d for c in self.gathers for d in c.dtypes}),
            "kernel_f32_bytes": self.kernel_f32_bytes,
            "weight_gathers_vs_f32_params": self.weight_gather_bytes / self.kernel_f32_bytes}


def _mesh(where: str, axis_type: str):
  types = (AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,)
  if where == CPU_MESH:
    devices = jax.devices("cpu")
    if len(devices) < 8:
      raise RuntimeError(f"the CPU mesh needs 8 devices, JAX has {len(devices)}: set XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8 before JAX starts")
    return jax.sharding.Mesh(np.asarray(devices[:8]), ("fsdp",), axis_types=types), "cpu"
  t = targets_lib.get_target(where)
  m = targets_lib.target_mesh(t, axis_names=("fsdp",))
  return jax.sharding.Mesh(m.devices, m.axis_names, axis_types=types), t.platform


@functools.lru_cache(maxsize=None)
def fsdp_step(arm: str, depth: int, where: str = CPU_MESH, *, width: int = 1024,
              tokens: int = 1024, axis_type: str = "auto",
              with_state: bool = True) -> StepCollectives:
  """Compiles the FSDP step of :func:`stack` and reads its collectives (cached per arguments).

  Args:
    arm: one of :data:`ARMS`.
    depth: layers.
    where: :data:`CPU_MESH` or a multi-device target (``'h100x8'``,
      ``'tpu-v6e-2x2'``; compile only, see :mod:`fp8_linen.testing.targets`).
    width: features per layer.
    tokens: rows of the batch (split over the devices). With fewer rows than
      a layer's width XLA may gather activations for the weight gradients
      instead of reducing them (``weight_gather_bytes`` counts weights only).
    axis_type: ``'auto'`` (XLA places every sharding) or ``'explicit'``
      (shardings in the arrays' types; ``jax.make_mesh``'s default).
    with_state: the step returns the new quantization state (the
      ``_overwrite_with_gradient`` gradients) with the parameters' gradients.
      Without it XLA drops every reduction that only feeds that state (see
      :func:`state_all_reduces`).

  Returns:
    A :class:`StepCollectives`.
  """
  if axis_type not in ("auto", "explicit"):
    raise ValueError(f"axis_type={axis_type!r} must be 'auto' or 'explicit'")
  mesh, platform = _mesh(where, axis_type)
  model = stack(arm, depth, width)
  v, x, r = train_step_inputs(model, (tokens, width), platform=platform)

  def place(path, a):
    kernel = jax.tree_util.keystr(path).endswith("['kernel']")
    return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                sharding=NamedSharding(mesh, P("fsdp", None) if kernel else P()))

  v = jax.tree_util.tree_map_with_path(place, v)
  x, r = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P("fsdp")))
          for a in (x, r))
  step = make_train_step(model)
  if not with_state:
    full = step
    step = lambda v, x, r: (lambda out: (out[0], out[1], out[2]["params"]))(full(v, x, r))
  with jax.set_mesh(mesh) if axis_type == "explicit" else contextlib.nullcontext():
    if where == CPU_MESH:
      with target_backend("cpu"):
        text = jax.jit(step).lower(v, x, r).compile().as_text()
      device = DEVICES[CPU_MESH]
    else:
      report = compile_for(where, step, v, x, r)
      text, device = report.hlo, DEVICES.get(where, targets_lib.get_target(where).description)
  found = hlo_collectives.collectives(hlo.parse(text))
  every = [c for c in found if not c.conditional]
  return StepCollectives(
      where=where, device=device, arm=arm, depth=depth, width=width, axis_type=axis_type,
      tokens=tokens,
      every_step=hlo_collectives.collective_totals(every),
      first_step_only=hlo_collectives.collective_totals([c for c in found if c.conditional]),
      gathers=tuple(c for c in every if c.kind == "all-gather"),
      kernel_f32_bytes=4 * depth * width * width, hlo_text=text)


def state_all_reduces(result: StepCollectives) -> int:
  """The all-reduces per step that only make ``result``'s new quantization state.

  The same step compiled without returning that state (``with_state=False``)
  has the same program but for what feeds only the state: the difference in
  all-reduces is the cost of keeping the state (delayed scaling's amaxes of
  the step). Reductions a cast needs (current scaling's amax, an integer
  weight's range) are in both. Counting this way is immune to how XLA splits
  or merges the gradients' reductions.
  """
  if not result.arm.startswith("fp8"):
    return 0
  bare = fsdp_step(result.arm, result.depth, result.where, width=result.width,
                   tokens=result.tokens, axis_type=result.axis_type, with_state=False)
  return result.count("all-reduce") - bare.count("all-reduce")


def extra_all_reduces(result: StepCollectives, bf16: StepCollectives) -> int:
  """All-reduces per step ``result`` runs beyond the bf16 stack's (a count; XLA may split the
  gradients' reduction differently in the two programs)."""
  return result.count("all-reduce") - bf16.count("all-reduce")
