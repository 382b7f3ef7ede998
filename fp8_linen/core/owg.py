"""The state protocol every op shares: new quantization state leaves a step as its "gradient".

OWG stands for *overwrite with gradient*, flax's name for it. A quantized op
takes its state (per role, :class:`RoleState`: a ``scale`` and an
``amax_history``) as ordinary inputs and returns the *new* state as the
cotangent of those inputs, so ``jax.grad`` over a model's variables hands the
train step the updated state in the ``_overwrite_with_gradient`` collection
(:data:`OWG`), to be written over the old values, never optimised.

**Several uses of one state in a step.** Autodiff *sums* the cotangents of a
variable used twice, which would double scales and add amaxes. Every op
therefore also takes and returns a *chain* array: the uses of one state are
linked through it (use ``k`` takes use ``k-1``'s ``chain_out``). In the
backward pass each later use sends its observation back along the chain
(:func:`fold_chain`); only the first use (``chain=None`` at the call site)
returns the new state, built from the max of all observations, and the other
uses return zeros. The sum autodiff forms then has exactly one non-zero term.

Inside ``shard_map`` a cotangent must vary over the same mesh axes as its
primal (:func:`match_varying`): gradients are summed, state is max-reduced (the
global amax, never a mean).

**Frozen quantizers** (:func:`frozen_quantizers`): evaluation as the served
model computes it. Every op traced in the block reads its state and never
folds the current tensor into it: an STE observer quantizes with its recorded
range (not widened by the batch), delayed scaling with its history; under
``jax.grad`` the state comes back unchanged. The ops read the flag when they
are called and keep it as a static argument, so a backward rule traced later
(``jax.grad`` of a ``jax.jit``-ed function) still sees it.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import owg
  >>> st = owg.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
  >>> owg.state_shapes_ok(st, history_length=4)
  True
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8_linen.core import lowering, numerics, settings, uses
from fp8_linen.recipes.fp8 import ScalingConfig

__all__ = [
    "OWG",
    "ROLES",
    "CHECKPOINT_NAME",
    "RoleState",
    "as_state",
    "check_state",
    "check_float",
    "state_shapes_ok",
    "chain_init",
    "new_state",
    "fold_chain",
    "state_cotangents",
    "match_varying",
    "name_fp8_residual",
    "frozen_quantizers",
    "quantizers_frozen",
    "HISTORY_SUFFIX",
    "key_name",
    "history_leaves",
    "all_observed",
]

# The same string as flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT (a test keeps
# them equal); spelled out so this pure-JAX layer never imports flax.
OWG: str = "_overwrite_with_gradient"

# The quantized tensor roles of a two-operand product, in operand order.
ROLES = ("input", "kernel", "output_grad")

# Name given (jax.ad_checkpoint.checkpoint_name) to the fp8 copies saved for the
# backward pass, so a remat policy can keep exactly those.
CHECKPOINT_NAME = "fp8_linen.fp8_residual"


_FROZEN = settings.TraceSetting("frozen_quantizers", default=False)


# The name every role's amax history ends with (``input_amax_history``, ...).
HISTORY_SUFFIX = "_amax_history"


def key_name(key) -> str:
  """A pytree path entry as a plain string (dict key, attribute or index alike)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def history_leaves(tree, under: str | None = None) -> list:
  """The ``<role>_amax_history`` arrays of a pytree (those below an ``under`` path key only).

  A leaf counts when its last path entry, or the one before it (an NNX
  variable's ``.value``), ends with :data:`HISTORY_SUFFIX`.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import owg
    >>> tree = {owg.OWG: {"input_amax_history": jnp.zeros(4)}, "input_amax_history": jnp.ones(4)}
    >>> len(owg.history_leaves(tree)), len(owg.history_leaves(tree, owg.OWG))
    (2, 1)
  """
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [key_name(k) for k in path]
    if (any(n.endswith(HISTORY_SUFFIX) for n in names[-2:])
        and (under is None or under in names) and jnp.ndim(leaf) >= 1):
      out.append(leaf)
  return out


def all_observed(histories, where: str = "") -> jax.Array:
  """Whether the most recent entry of every history is positive (a boolean scalar).

  The test of :func:`fp8_linen.split_first_step` (and its NNX twin): the
  last axis of each history holds the steps, index 0 the latest; a history
  whose latest observation was 0 (a zero or non-finite tensor) counts as
  holding none.

  Args:
    histories: the ``<role>_amax_history`` arrays found.
    where: where they were looked for, for the error.

  Raises:
    ValueError: when ``histories`` is empty.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import owg
    >>> bool(owg.all_observed([jnp.array([2.0, 0.0]), jnp.array([[1.0], [3.0]])]))
    True
  """
  histories = list(histories)
  if not histories:
    raise ValueError(f"split_first_step: no fp8 amax history (a leaf named '<role>"
                     f"{HISTORY_SUFFIX}'{where}) in the step's arguments: pass the fp8 state "
                     "as an argument, not in a closure; a model without delayed-scaling state "
                     "needs no split_first_step")
  ready = jnp.all(jnp.stack([jnp.all(jnp.asarray(h)[..., 0] > 0) for h in histories]))
  axes = lowering.varying_axes(ready)
  if axes:
    # Per-device histories inside shard_map: every device must take the same branch (a
    # branch holds collectives), so the steady one only where all devices' are observed.
    ready = lax.pmin(ready.astype(jnp.int32), tuple(sorted(axes))) > 0
  return ready


@contextlib.contextmanager
def frozen_quantizers(frozen: bool = True):
  """Runs the block with every quantizer's state frozen: QAT evaluated as it is served.

  Inside the block (``frozen=True``) no quantizer measures a new range where
  the served model (:func:`fp8_linen.convert`) would not: an STE observer
  (``'minmax'`` or ``'moving_average'``) quantizes the activation with the
  range it recorded in training, delayed scaling with the scale its amax
  history gives, LSQ/LSQ+ with the learned step; a batch larger than anything
  seen in training is clipped, as in serving. Current, row-wise and MX fp8
  scaling measure every batch, in serving too. Nothing is written: under
  ``jax.grad`` every state's "gradient" is the state itself (training with
  frozen quantizers keeps them as they are). A state that has observed
  nothing yet (an untrained layer, which :func:`fp8_linen.convert` refuses)
  takes the batch's range, as the first training step does.

  The flag is read while a function is traced: enter the block inside the
  function you ``jax.jit`` (like :func:`~fp8_linen.target_backend`), not
  around a call of an already compiled one. Works for the Linen layers,
  :func:`~fp8_linen.quantize_model`'d models and the NNX layers alike (NNX
  layers are also frozen by ``model.eval()``).

  Args:
    frozen: ``False`` runs the block as in training (e.g.
      ``frozen_quantizers(not train)``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> model = fl.QDense(4, recipe=fl.IntRecipe())
    >>> x = jnp.ones((2, 8))
    >>> v = model.init(jax.random.key(0), x)
    >>> v = fl.merge_owg(v, jax.grad(lambda v: model.apply(v, x).sum())(v))  # range [-0, 1]
    >>> @jax.jit
    ... def evaluate(v, x):
    ...   with fl.frozen_quantizers():
    ...     return model.apply(v, x)
    >>> bool((evaluate(v, 3 * x) == evaluate(v, x)).all())  # clipped at the recorded max
    True
  """
  if not isinstance(frozen, bool):
    raise TypeError(f"frozen_quantizers: frozen={frozen!r} must be a bool")
  with _FROZEN.set(frozen):
    yield


def quantizers_frozen() -> bool:
  """Whether ops traced now run with frozen quantizers (:func:`frozen_quantizers`)."""
  return _FROZEN.get()


class RoleState(NamedTuple):
  """The fp8 state of one tensor role: ``scale`` (1,) and ``amax_history`` (L,)."""

  scale: jnp.ndarray
  amax_history: jnp.ndarray


def as_state(scale, amax_history) -> RoleState:
  """A :class:`RoleState` of float32 arrays."""
  return RoleState(jnp.asarray(scale, jnp.float32), jnp.asarray(amax_history, jnp.float32))


def state_shapes_ok(state: RoleState, history_length: int | None = None) -> bool:
  """Whether ``state`` has a ``(1,)`` scale and a non-empty 1-D history."""
  h = state.amax_history
  return (tuple(state.scale.shape) == (1,) and h.ndim == 1 and h.shape[0] >= 1
          and (history_length is None or h.shape[0] == history_length))


def check_grouped_state(name: str, state: RoleState, groups: int) -> RoleState:
  """Validates one role's state with one scale per group: ``(groups, 1)``, ``(groups, L)``."""
  state = as_state(*state)
  h = state.amax_history
  if state.scale.shape != (groups, 1) or h.ndim != 2 or h.shape[0] != groups or h.shape[1] < 1:
    raise ValueError(f"{name}_scale / {name}_amax_history must have shapes ({groups}, 1) and "
                     f"({groups}, history_length) (one per group), got {state.scale.shape} and "
                     f"{h.shape}")
  return state


def check_state(name: str, state: RoleState) -> RoleState:
  """Validates one role's state; errors name the role."""
  state = as_state(*state)
  if state.scale.shape != (1,):
    raise ValueError(f"{name}_scale must have shape (1,), got {state.scale.shape}")
  if state.amax_history.ndim != 1 or state.amax_history.shape[0] < 1:
    raise ValueError(
        f"{name}_amax_history must have shape (history_length,), got {state.amax_history.shape}")
  return state


def check_float(name: str, x) -> None:
  """Raises ``TypeError`` naming ``name`` unless ``x`` is a floating array."""
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a floating array, got dtype {jnp.result_type(x)}")


def chain_init(n: int) -> jnp.ndarray:
  """The chain value a first use starts from (ignored by the ops)."""
  return jnp.zeros((n,), jnp.float32)


# Jitted: traced once per config and shape, not once per use (see numerics.encode_fp8).
@functools.partial(jax.jit, static_argnums=(0,))
def new_state(cfg: ScalingConfig, state: RoleState, observed_amax) -> RoleState:
  """The state after a step that observed ``observed_amax`` (non-finite -> 0)."""
  a = numerics.finite_or_zero(observed_amax)
  scale = numerics.select_scale(cfg, state.scale, state.amax_history, a)
  return RoleState(scale, numerics.roll_history(state.amax_history, a))


def _new_role_state(cfg, state: RoleState, observed) -> RoleState:
  if jnp.ndim(observed) == 0:
    return new_state(cfg, state, observed)
  return jax.vmap(lambda s, h, a: new_state(cfg, RoleState(s, h), a))(
      state.scale, state.amax_history, observed)


def fold_chain(observed, ct_chain, first: bool, like=None):
  """Folds this use's observation into the chain (see module doc).

  Under ``vmap`` with a state that is not batched, the observations of the
  batch's instances are max-reduced first (:func:`~fp8_linen.core.uses.fold_vmapped`):
  one state observes the whole batch.

  Args:
    observed: this use's observation (any array the chain carries).
    ct_chain: cotangent of ``chain_out``: the max observation of later uses.
    first: whether this use is the first (the one that returns the state).
    like: an array of the state the observation updates (tells whether the
      state is batched under ``vmap``); ``None``: never batched.

  Returns:
    ``(combined, chain_ct)``: the elementwise max of all uses' observations
    (``None`` for a later use, which returns no state) and the cotangent of
    this use's chain input.
  """
  combined = jnp.maximum(observed, ct_chain)
  if like is not None:
    combined = uses.fold_vmapped(combined, like)
  if first:
    return combined, jnp.zeros_like(ct_chain)
  return None, combined


def _state_for_untracked_axes(ct):
  """A state cotangent where JAX does not track variance: global, and on the first device only.

  Under ``shard_map(check_vma=False)`` differentiated from outside, JAX sums
  the cotangent of a value the body closes over (the fp8 state) over the
  mesh axes; every device holding the new state would record it N times.
  The state is max-reduced over those axes and handed to the first device
  along them, zeros elsewhere, so that sum gives it back once, exactly; and
  where the gradient is taken inside (``pmap``, or a per-device step with
  :func:`fp8_linen.reduce_gradients`) the max over devices does too.
  """
  axes = lowering.untracked_axes()
  if not axes:
    return ct
  ct = lax.pmax(ct, axes)
  first = functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in axes])
  return jnp.where(first, ct, jnp.zeros_like(ct))


def match_varying(ct, like, *, state: bool = False):
  """Makes cotangent ``ct`` vary over exactly the mesh axes its primal ``like`` does.

  Inside ``shard_map`` a replicated input's cotangent must be reduced over the
  axes the cotangent varies on: a gradient (``state=False``) is summed
  (``lax.psum``, what JAX's own autodiff does); quantization state
  (``state=True``: an amax history, a scale, a chain) is max-reduced
  (``lax.pmax``), and on axes where JAX does not track variance it is handed
  to one device (:func:`_state_for_untracked_axes`).
  """
  reduce = lax.pmax if state else lax.psum
  if state:
    ct = _state_for_untracked_axes(ct)
  want, have = lowering.varying_axes(like), lowering.varying_axes(ct)
  extra = tuple(sorted(have - want))
  if extra:
    ct = reduce(ct, extra)
  missing = tuple(sorted(want - have))
  if missing:
    ct = lax.pcast(ct, missing, to="varying")
  return ct


def state_cotangents(cfgs, states, observed, ct_chain, first: bool, empty: bool = False):
  """Cotangents for the state inputs and the chain input of one op use.

  Args:
    cfgs: scaling config per role.
    states: :class:`RoleState` per role (the values read at the start of the step).
    observed: this use's amax per role (float32 scalars).
    ct_chain: cotangent of ``chain_out`` (one entry per role).
    first: whether this use is the first.
    empty: whether this use saw no elements (an empty batch). It observes
      nothing; as the first use it returns the state unchanged unless a later
      use of the step observed something.

  Returns:
    ``(state_cts, chain_ct)``: a tuple of :class:`RoleState` (the new state, or
    zeros for a later use) and the chain cotangent, each varying over the same
    ``shard_map`` axes as its primal.
  """
  sizes = [jnp.size(o) for o in observed]
  flat = (jnp.stack(observed) if all(jnp.ndim(o) == 0 for o in observed) else
          jnp.concatenate([jnp.ravel(o) for o in observed]))
  combined, chain_ct = fold_chain(numerics.finite_or_zero(flat), ct_chain, first,
                                  like=states[0].scale)
  if combined is None:
    cts = tuple(RoleState(jnp.zeros_like(s.scale), jnp.zeros_like(s.amax_history))
                for s in states)
  else:
    offsets = np.cumsum([0] + sizes)
    # A role observed per group (a grouped GEMM's per-expert weights) has one
    # state per group: its scale (g, 1), its history (g, L).
    parts = [combined[offsets[i]] if jnp.ndim(o) == 0 else combined[offsets[i]:offsets[i + 1]]
             for i, o in enumerate(observed)]
    cts = tuple(_new_role_state(c, s, a) for c, s, a in zip(cfgs, states, parts))
    if empty:
      # Later uses report through the chain; 0 from all of them means nothing
      # was observed in this step, and an unobserved step must not roll the
      # history.
      cts = tuple(RoleState(*(jnp.where((a if jnp.ndim(a) == 0 else a[:, None]) > 0, n, o)
                              for n, o in zip(ct, st)))
                  for ct, st, a in zip(cts, states, parts))
  cts = tuple(RoleState(*(match_varying(c, l, state=True) for c, l in zip(ct, like)))
              for ct, like in zip(cts, states))
  return cts, match_varying(chain_ct, ct_chain, state=True)


def _bits_named(q, name):
  # A 4-bit float (NVFP4's e2m1 codes) is named as uint4, an 8-bit one as uint8.
  unsigned = jnp.uint4 if jnp.finfo(q.dtype).bits == 4 else jnp.uint8
  bits = jax.ad_checkpoint.checkpoint_name(lax.bitcast_convert_type(q, unsigned), name)
  return lax.bitcast_convert_type(bits, q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _named_fp8(q, name):
  return _bits_named(q, name)


def _named_fp8_fwd(q, name):
  return _bits_named(q, name), None


def _named_fp8_bwd(name, _, g):
  del name
  return (g,)


_named_fp8.defvjp(_named_fp8_fwd, _named_fp8_bwd)


def name_fp8_residual(q, name: str = CHECKPOINT_NAME):
  """``checkpoint_name(q, name)`` for an fp8 (or fp4) array, safe under ``jax.checkpoint``.

  jax 0.10's remat inserts ``reduce_precision(exponent_bits, mantissa_bits)`` on
  every floating residual it saves; for ``float8_e4m3fn`` that is IEEE e4m3
  (largest finite 240), so saved values of magnitude >= 256 come back as
  inf/NaN. The fp8 bits are therefore named as ``uint8`` (``uint4`` for e2m1
  codes: same bit count, never rounded) and bitcast back; the gradient passes
  straight through.
  """
  if jnp.issubdtype(q.dtype, jnp.floating) and jnp.dtype(q.dtype).itemsize == 1:
    return _named_fp8(q, name)
  return jax.ad_checkpoint.checkpoint_name(q, name)
