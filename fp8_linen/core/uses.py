"""The uses of one quantization state in a step, whatever JAX transforms they run under.

A quantized op returns its state's update as the cotangent of the state
(:mod:`fp8_linen.core.owg`). JAX *adds* the cotangents of a value used several
times, so every way a state can be used more than once in a step needs an
answer that is not a sum:

* **several calls in one trace** (a layer applied twice): the calls are linked
  by a *chain* (:class:`Chains`); only the first returns the state, built from
  the max of all of them.
* **a call in a nested trace** (the layer called inside a raw ``jax.jit`` or
  ``jax.checkpoint`` in a module method, after a call outside it): the nested
  call links to the chain of the enclosing trace, which it may close over.
* **a call inside ``vmap``** with the state not batched (``nn.vmap`` with the
  state broadcast, a raw ``jax.vmap`` over the layer, or a vmapped ``apply``):
  JAX would sum the per-instance updates over the batch; :func:`fold_vmapped`
  max-reduces them instead, so the state sees the amax of the whole batch.
* **a call inside a loop** (``scan``: ``nn.scan``/``nn.RNN`` with the state
  broadcast, ``jax.lax.scan``, ``fori_loop``, ``jax.lax.map``) with the state
  from outside the loop: the loop's iterations are one traced body, which no
  chain can link, and JAX sums their updates. When the state is being
  differentiated this raises :class:`StateUseError`, naming the layer, the
  loop and the fix (a state per iteration, or the call outside the loop).
* **calls in two traces that do not nest** (the layer called inside a raw
  ``jax.checkpoint`` and again outside it): neither chain can reach the
  other; differentiated, this raises :class:`StateUseError` as well.

The transforms between a call and its state are read from JAX's trace
stack (``jax.extend.core.find_top_trace``), walking each trace's parent up to
the trace the state's value belongs to.

Example:
  >>> import jax
  >>> from fp8_linen.core import uses
  >>> def use(s, c):
  ...   print(uses.transforms_between(s), uses.differentiated(s))
  ...   return s * c
  >>> loss = lambda s: jax.lax.scan(lambda c, _: (use(s, c), None), 1.0, None, length=2)[0]
  >>> _ = jax.grad(loss)(2.0)
  ('scan',) True
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.extend.core import find_top_trace

__all__ = ["LOOPS", "StateUseError", "transforms_between", "entering_shard_map", "constant",
           "in_kernel", "differentiated", "under_vmap", "fold_vmapped", "check_use", "Chains",
           "compiled_when_eager"]

# What JAX's tracers call the transforms that run one traced body several times
# per step (their ``traced_for``): their iterations' cotangents are summed.
LOOPS = ("scan", "while_loop", "fori_loop", "map")

# Traces whose values are being differentiated.
_DIFFERENTIATING = ("JVPTrace", "LinearizeTrace")


class StateUseError(ValueError):
  """A quantization state is used in a way whose updates JAX would sum."""


def _trace_of(value):
  """The trace ``value`` belongs to (``None``: a concrete value, the eval trace)."""
  return getattr(value, "_trace", None) if isinstance(value, jax.core.Tracer) else None


def _parent(trace):
  return getattr(trace, "parent_trace", None)


def _kind(trace) -> str:
  """What a trace is for: the transform's name (``'scan'``, ``'jit'``, ``'vmap'``, ...)."""
  name = type(trace).__name__
  if name == "DynamicJaxprTrace":
    frame = getattr(trace, "frame", None)
    info = getattr(frame, "debug_info", None)
    return str(getattr(info, "traced_for", "jit"))
  if name == "BatchTrace":
    return "vmap"
  if name in _DIFFERENTIATING:
    return "grad"
  return name


# The traces ``jax.shard_map`` calls were made from, outermost first, while
# their bodies are traced: a body's trace has no parent, so the transforms
# around the call (a scan over layers) would be out of sight.
_SHARD_MAP_CALLERS: contextvars.ContextVar = contextvars.ContextVar(
    "fp8_linen_shard_map_callers", default=())


@contextlib.contextmanager
def entering_shard_map():
  """Within: a ``shard_map`` called from the current trace is traced; its body sees past it."""
  token = _SHARD_MAP_CALLERS.set(_SHARD_MAP_CALLERS.get() + (find_top_trace(()),))
  try:
    yield
  finally:
    _SHARD_MAP_CALLERS.reset(token)


def _stack_to(value) -> tuple[list, bool]:
  """The traces from the current one up to ``value``'s (exclusive); whether it was reached.

  A ``shard_map`` body's trace has no parent: the walk goes on from the trace
  the ``shard_map`` was called from where :func:`entering_shard_map` said.
  """
  target = _trace_of(value)
  callers = list(_SHARD_MAP_CALLERS.get())
  out = []
  t = find_top_trace(())
  while t is not target:
    if t is None:
      if not callers:
        break
      t = callers.pop()
      continue
    out.append(t)
    t = _parent(t)
  return out, t is target or target is None


def transforms_between(value) -> tuple[str, ...]:
  """The transforms a use of ``value`` runs under that ``value`` itself is outside of.

  Innermost first; ``()`` when ``value`` was created in the current trace
  (e.g. a state passed into the transform as an argument, as flax's lifted
  transforms pass the collections they carry).
  """
  traces, _ = _stack_to(value)
  return tuple(_kind(t) for t in traces if type(t).__name__ not in ("EvalTrace",))


def constant(shape, fill: float, dtype):
  """An array of ``shape`` filled with ``fill`` that is never a tracer.

  A quantization state declared while a transform traces a layer (inside a
  raw ``jax.checkpoint``, ``jax.lax.scan`` or ``jax.shard_map`` in a module
  method) is stored with the variables and must not be a tracer of that
  transform, or it leaks out of it. Outside any transform it is a
  ``jax.Array``; inside one a NumPy array (every JAX operation is traced
  there, even a constant's creation: ``shard_map`` has no outer evaluation
  to escape to), which becomes a ``jax.Array`` wherever a transform returns it.
  """
  if type(find_top_trace(())).__name__ == "EvalTrace":
    return jnp.full(shape, fill, dtype)
  return np.full(shape, fill, np.dtype(dtype))


def in_kernel() -> bool:
  """Whether the code traced now is the body of a Pallas kernel.

  A kernel's products are tile products of a computation someone else owns
  (MaxText's megablox grouped GEMM): they can hold no state and must not be
  quantized.
  """
  t = find_top_trace(())
  while t is not None:
    if _kind(t).startswith(("pallas", "kernel")):
      return True
    t = _parent(t)
  return False


def differentiated(value) -> bool:
  """Whether ``value`` (a state read by an op) is being differentiated.

  True when a JVP or linearize trace holds ``value`` or encloses the trace
  that does (``jax.grad(jax.jit(step))`` as much as ``jax.jit(jax.grad(step))``).
  A concrete value, or one traced only by ``jit`` (an evaluation step), is
  not: its cotangent is never formed.
  """
  t = _trace_of(value)
  while t is not None:
    if type(t).__name__ in _DIFFERENTIATING:
      return True
    t = _parent(t)
  return False


def under_vmap() -> bool:
  """Whether the code traced now runs under ``vmap`` (a batching trace is active)."""
  t = find_top_trace(())
  while t is not None:
    if type(t).__name__ == "BatchTrace":
      return True
    t = _parent(t)
  return False


@custom_vmap
def _fold(observed, like):
  return observed


@_fold.def_vmap
def _fold_rule(axis_size, in_batched, observed, like):
  del axis_size
  batched, like_batched = in_batched
  if batched and not like_batched:
    # The state is shared by every instance of the batch: it observes the
    # max over them (called again so an enclosing vmap folds its axis too).
    return _fold(jnp.max(observed, axis=0), like), False
  return observed, batched


def fold_vmapped(observed, like):
  """``observed`` max-reduced over every ``vmap`` axis that ``like`` (the state) is not batched on.

  A backward rule calls it on what a use observed before building the state
  update: under ``vmap`` with an unbatched state, the update is then formed
  once from the batch's max instead of once per instance (which JAX would
  sum). Outside ``vmap`` it is the identity and adds nothing to the program.
  """
  if not under_vmap():
    return observed
  return _fold(observed, like)


def _describe(loop: str) -> str:
  if loop == "scan":
    return "a scan (nn.scan, nn.RNN, jax.lax.scan, fori_loop, jax.lax.map)"
  return f"a loop ({loop})"


def _carried_into_loop(value) -> str | None:
  """The loop whose carry ``value`` (an input of the loop body traced now) rides in, or None.

  NNX's ``nnx.scan`` and ``nnx.fori_loop`` pass a module's state into the
  loop body as the loop's *carry* (a broadcast module, or the module itself
  carried): the state comes back unchanged from every iteration, and the
  cotangent of a carry adds every iteration's contribution. A state scanned
  over (stacked layers, ``in_axes=0``) is an ``xs`` input instead, which is
  fine. ``scan`` traces its body with the carry's leaves first, named after
  the body's first parameter; ``fori_loop`` and ``while_loop`` carry every
  input. Without those names (no debug info) nothing is claimed.
  """
  trace = find_top_trace(())
  kind = _kind(trace)
  if kind not in LOOPS or _trace_of(value) is not trace or getattr(value, "parent", 1) is not None:
    return None
  frame = getattr(trace, "frame", None)
  invars = list(getattr(frame, "invars", ()))
  var = getattr(value, "val", None)
  at = next((i for i, v in enumerate(invars) if v is var), None)
  if at is None:
    return None
  if kind != "scan":
    return kind
  names = getattr(getattr(frame, "debug_info", None), "arg_names", None)
  if not names or len(names) != len(invars) or not names[0] or not names[at]:
    return None
  top = lambda name: name.split("[", 1)[0].split(".", 1)[0]  # noqa: E731
  return kind if top(names[at]) == top(names[0]) else None


def check_use(where: str, state_leaf, *, initializing: bool = False) -> None:
  """Raises :class:`StateUseError` if a loop would sum this use's state updates.

  Args:
    where: the layer (path) that owns the state, named in the error.
    state_leaf: one array of the state as the op reads it.
    initializing: ``init`` runs no backward pass: nothing is checked.
  """
  if initializing or not differentiated(state_leaf):
    return
  loops = [k for k in transforms_between(state_leaf) if k in LOOPS]
  if loops:
    raise StateUseError(
        f"fp8_linen: {where} is applied inside {_describe(loops[0])} while its quantization "
        "state comes from outside the loop (e.g. nn.scan(..., variable_broadcast=[..., "
        "'_overwrite_with_gradient'])): every iteration would return a state update and JAX "
        "would add them (the amax times the number of iterations, compounding every step). "
        "Give each iteration its own state — nn.scan(..., variable_axes={fl.OWG: 0}) or "
        "nn.RNN(..., variable_axes={fl.OWG: 0}) — or apply the layer outside the loop. "
        "Where the loop is the model's own (a raw jax.lax.scan over stacked layers, "
        "MaxText's scan_layers), use a recipe that keeps no state: "
        "fl.current_scaling(history_length=0).")
  carried = _carried_into_loop(state_leaf)
  if carried:
    raise StateUseError(
        f"fp8_linen: {where} is applied inside {_describe(carried)} with its quantization "
        "state in the loop's carry (nnx.scan(..., in_axes=None / nnx.Carry) for the layer, "
        "nnx.fori_loop over it, nn.scan(..., variable_carry=...)): the loop would add the "
        "iterations' state updates (the amax times the number of iterations). Give each "
        "iteration its own layer and state — stacked layers scanned with in_axes=0, "
        "nnx.StateAxes({fl.nnx.QuantState: 0, ...}) — or apply the layer outside the loop.")


class Chains:
  """The chains linking the uses of each state slot, for one ``apply`` (Linen) or one module (NNX).

  A slot is any hashable naming one state (a module path and a key). See the
  module doc for what each kind of repeated use gets.
  """

  def __init__(self):
    self._last: dict = {}  # slot -> (weakref to the trace of the last use, chain_out)

  def run(self, slot: Hashable, where: str, state_leaf, fn: Callable[[Any], tuple],
          *, initializing: bool = False):
    """Runs ``fn(chain) -> (out, chain_out)`` as the next use of ``slot``; returns ``out``.

    ``chain`` is ``None`` for the first use in a step (which returns the
    state), else the ``chain_out`` of the previous use.

    Raises:
      StateUseError: the use cannot be linked to the previous one and the
        state is being differentiated (see the module doc).
    """
    check_use(where, state_leaf, initializing=initializing)
    current = find_top_trace(())
    chain = None
    prev = self._last.get(slot)
    if prev is not None:
      prev_trace, prev_chain = prev[0](), prev[1]
      if prev_trace is not None and _encloses(prev_trace, current):
        chain = prev_chain
      elif not initializing and differentiated(state_leaf):
        raise StateUseError(
            f"fp8_linen: {where} is called in two JAX traces of one step that do not nest "
            f"(a call inside {_kind(prev_trace) if prev_trace is not None else 'a transform'} "
            "that has returned, and another outside it): their state updates cannot be linked "
            "and JAX would add them. Call the layer within one transform (e.g. both calls "
            "inside the same jax.checkpoint / nn.remat), or use two layers.")
    out, chain_out = fn(chain)
    self._last[slot] = (weakref.ref(current), chain_out)
    return out

  def held(self) -> list:
    """The chain values kept for the next use of each slot (to check none is a leaked tracer)."""
    return [chain for _, chain in self._last.values()]


def _encloses(outer, inner) -> bool:
  """Whether trace ``outer`` is ``inner`` or one of its parents."""
  t = inner
  while t is not None:
    if t is outer:
      return True
    t = _parent(t)
  return False


# Traces a compiled op may run under as one program: evaluation and
# differentiation of evaluated values. ``vmap``, loops and ``shard_map`` are
# left to trace the op themselves (their rules read the trace stack).
_COMPILABLE = ("EvalTrace",) + _DIFFERENTIATING


def _eager() -> bool:
  """Whether the code running now is evaluated op by op (no staging transform is active)."""
  t = find_top_trace(())
  while t is not None:
    if type(t).__name__ not in _COMPILABLE:
      return False
    t = _parent(t)
  return True


def compiled_when_eager(fn: Callable, static_argnums: tuple[int, ...] = ()) -> Callable:
  """``fn`` (an op's custom_vjp) run as one compiled program when called eagerly.

  Outside ``jit``, JAX runs an op primitive by primitive and compiles a
  program for each new shape: a quantized layer's unjitted ``init`` or
  ``apply`` compiled hundreds of them (seconds per layer, each call with new
  shapes). Called eagerly (or under an eager ``jax.grad``), ``fn`` runs under
  a cached ``jax.jit`` instead, its ``static_argnums`` (the custom_vjp's
  non-differentiable arguments) part of the key; inside any other transform
  it is traced as it is. The two give the same values: the jitted program is
  the one a jitted step inlines.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen.core import uses
    >>> f = uses.compiled_when_eager(lambda k, x: x * k, static_argnums=(0,))
    >>> float(f(2.0, jnp.ones(())))
    2.0
  """
  jitted = jax.jit(fn, static_argnums=static_argnums)

  @functools.wraps(fn)
  def call(*args):
    if _eager() and all(_hashable(args[i]) for i in static_argnums):
      return jitted(*args)
    return fn(*args)

  return call


def _hashable(value) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True
