"""Training-loop glue: merge the overwritten fp8 state after each optax step.

``jax.grad`` over a model's whole variables dict returns, for the
``_overwrite_with_gradient`` (:data:`~fp8_linen.OWG`) collection, the *new
values* of the scales and amax histories (the layers' backward rules put them
there). They must be written over the old values, never given to the
optimizer. :class:`TrainState` does that, and gets three cases right that naive
merging gets wrong:

* **gradient accumulation** with ``optax.MultiSteps``: the history advances once
  per optimizer step and keeps the max amax over the micro-batches (the state is
  held fixed while micro-batches run, and their updates are max-reduced);
* **data parallel** (``pmap``/``shard_map``): :func:`reduce_gradients` averages
  the parameter gradients but takes the *max* of the fp8 state (a mean of amaxes
  3 and 30 would be 16.5 and clip);
* **hand-written loops**: :func:`merge_owg`, :func:`accumulate_gradients` and
  :func:`finalize_accumulated` are plain functions.

And three that keep a long run alive:

* **skipped steps**: a step whose parameter gradients are not all finite (the
  step ``optax.apply_if_finite`` and ``MultiSteps(should_skip_update_fn=
  skip_not_finite)`` skip) leaves the fp8 state as it was;
* **checkpoints**: :func:`load_float_state` starts an fp8 run from a checkpoint
  of the same model trained without fp8; :func:`resize_histories` loads a
  checkpoint written with another history length;
* **shard_map**: :func:`reduce_gradients` returns the mean with and without
  ``check_vma``.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> import fp8_linen as fl
  >>> model = fl.QDense(2)
  >>> variables = model.init(jax.random.key(0), jnp.ones((4, 3)))
  >>> state = fl.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
  >>> grads = jax.grad(lambda v: model.apply(v, jnp.ones((4, 3))).sum())(state.params)
  >>> state = state.apply_gradients(grads=grads)
  >>> int(state.step)
  1
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state as flax_train_state

from fp8_linen.core import hoist as hoist_lib
from fp8_linen.core import mesh, numerics, owg
from fp8_linen.core.lowering import varying_axes
from fp8_linen.core.owg import OWG

__all__ = [
    "TrainState",
    "split_owg",
    "merge_owg",
    "owg_max",
    "accumulate_gradients",
    "accumulate_microbatches",
    "finalize_accumulated",
    "reduce_gradients",
    "all_finite",
    "resize_histories",
    "load_float_state",
    "switch_precision",
    "histories_ready",
    "split_first_step",
    "quantize_once_per_window",
]

_HISTORY = owg.HISTORY_SUFFIX


def _is_variables(tree: Any) -> bool:
  """Whether ``tree`` is a Linen variables dict (``{'params': ..., OWG: ...}``).

  A dict with only ``params`` counts too (a model without fp8 state, or
  variables loaded from a float checkpoint), and so does one with only the OWG
  collection (a model whose only state is fp8 state, e.g. ``Fp8Activation``).
  """
  return (isinstance(tree, Mapping) and ("params" in tree or OWG in tree)
          and all(isinstance(tree[k], Mapping) for k in ("params", OWG) if k in tree))


_name = owg.key_name


def _path(path) -> str:
  return "/".join(_name(k) for k in path)


def histories_ready(tree: Any, *, under: str | None = OWG) -> jax.Array:
  """Whether every amax history in ``tree`` holds an observation: :func:`split_first_step`'s test.

  True when the most recent entry (index 0 of the last axis) of every
  ``<role>_amax_history`` leaf below an ``under`` key (the OWG collection;
  ``None``: anywhere) is positive. A history whose last observation was 0
  (a zero or non-finite tensor) counts as empty.

  Args:
    tree: any pytree (variables, a ``TrainState``, the step's arguments).
    under: the path key the histories must lie below.

  Returns:
    A boolean scalar.

  Raises:
    ValueError: when ``tree`` holds no history.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> v = fl.QDense(2).init(jax.random.key(0), jnp.ones((4, 3)))
    >>> bool(fl.histories_ready(v))
    False
  """
  where = f" below a {under!r} key" if under else ""
  return owg.all_observed(owg.history_leaves(tree, under), where)


def _graph_nodes(tree: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return False
  is_node = nnx.graph.is_graph_node
  return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))


def split_first_step(step: Callable) -> Callable:
  """Compiles a train step's first steps apart, so that the others' casts wait for nothing.

  Delayed scaling takes a scale from the amax history, except while a
  history holds no observation (the first step), when it uses this step's
  amax so that nothing clips. Inside one program that fallback costs every
  step: each cast waits for its tensor's amax (a second read of the tensor)
  or reads the tensor in a conditional (a copy of it). The wrapped step is
  one ``lax.cond`` over the whole step: while some ``<role>_amax_history`` of
  its arguments (below the OWG collection) has no observation
  (:func:`histories_ready`) it runs ``step`` as traced by default; then a
  second trace of ``step`` in which every delayed scale is its history's
  (:func:`fp8_linen.core.numerics.histories_observed`). Both give the same
  values, so the split changes only the program: the conditional's operands
  are the step's arguments (buffers already), and its steady branch lets XLA
  take each amax in its cast's pass (compile only, TE's dense layer: B200
  0.96x bf16's non-GEMM bytes instead of 1.32x, H100 1.45x instead of
  1.67x; docs/accelerators.md).

  The cost: ``step`` is traced and compiled twice (one program holds both).
  The fp8 state must reach ``step`` through its arguments (a variables dict
  or a ``TrainState``), not a closure. Wrap the step before ``jax.jit``; for
  NNX modules use :func:`fp8_linen.nnx.split_first_step`.

  Args:
    step: the train step, ``step(*args, **kwargs)``.

  Returns:
    The wrapped step, same arguments and results.

  Raises:
    ValueError: (when called) no history in the arguments, or an NNX module
      among them.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import fp8_linen as fl
    >>> m = fl.QDense(2)
    >>> state = fl.TrainState.create(apply_fn=m.apply, tx=optax.sgd(0.1),
    ...                              params=m.init(jax.random.key(0), jnp.ones((4, 3))))
    >>> @jax.jit
    ... @fl.split_first_step
    ... def train_step(state, x):
    ...   grads = jax.grad(lambda v: m.apply(v, x).sum())(state.params)
    ...   return state.apply_gradients(grads=grads)
    >>> state = train_step(train_step(state, jnp.ones((4, 3))), jnp.ones((4, 3)))
    >>> state.params[fl.OWG]['input_amax_history'][:2].tolist()
    [1.0, 1.0]
  """

  @functools.wraps(step)
  def wrapped(*args, **kwargs):
    if _graph_nodes((args, kwargs)):
      raise ValueError("split_first_step: an NNX module is among the step's arguments; use "
                       "fl.nnx.split_first_step, which carries the module's updates out of "
                       "the conditional")
    ready = histories_ready((args, kwargs))
    leaves, treedef = jax.tree.flatten((args, kwargs))
    # Arrays go through the conditional; anything else (a Python number a step
    # may read as static) stays as it is.
    traced = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]

    def call(observed: bool, operands):
      full = list(leaves)
      for i, x in zip(traced, operands):
        full[i] = x
      a, k = jax.tree.unflatten(treedef, full)
      if observed:
        with numerics.histories_observed():
          return step(*a, **k)
      return step(*a, **k)

    return jax.lax.cond(ready, functools.partial(call, True), functools.partial(call, False),
                        [leaves[i] for i in traced])

  return wrapped


def _state_of(out):
  """The :class:`TrainState` a train step returned: ``out`` or ``out[0]``."""
  if isinstance(out, TrainState):
    return out
  if isinstance(out, tuple) and out and isinstance(out[0], TrainState):
    return out[0]
  raise TypeError("quantize_once_per_window: the step must return the new fl.TrainState, or "
                  f"a tuple whose first element is it; got {type(out).__name__}")


def _with_state(out, state):
  return state if isinstance(out, TrainState) else (state, *out[1:])


def quantize_once_per_window(step: Callable, *, every_k: int,
                             donate_state: bool = False) -> Callable:
  """Runs a train step under ``optax.MultiSteps`` with each weight quantized once per window.

  Under ``optax.MultiSteps`` each call of the step is one micro-batch, and the
  parameters (and the fp8 state, which :class:`TrainState` commits at the end
  of a window) stay fixed until the window's last one. A plain step still
  quantizes every weight in every call: its amax, its scale and its codes in
  both layouts (a float layer: its float32 -> bfloat16 cast). The wrapped
  step computes that work, everything the step does with ``state.params``
  alone (:func:`fp8_linen.core.hoist.split`), once at the window's first
  micro-batch, keeps it in ``state.window_cache`` and reads it in the
  window's other calls. The values are those of the plain step.

  Which call starts a window is decided on the host, without waiting for the
  device: the wrapper counts calls, ``every_k`` to a window (the position is
  read from ``state.opt_state.mini_step`` once, when a state without a cache
  arrives). The device checks every call: a cache built for another
  optimizer step (``every_k`` differs from ``MultiSteps``' schedule, a
  micro-batch was skipped, a state from elsewhere) is not read; that call
  quantizes the weights again, giving the same values at the plain step's
  cost. The cache belongs to the parameters it was built from: after
  replacing ``state.params`` yourself, drop it (``state.replace(
  window_cache=None)``); :func:`load_float_state`, :func:`switch_precision`
  and :func:`resize_histories` do.

  Costs: the cache (about 2 bytes per quantized parameter: the codes in both
  layouts) stays in memory and in checkpoints of the state; three programs
  are compiled (the window's first work, and the step with and without the
  cache in one conditional). Estimated for an H100 (compile only; a
  4096 -> 16384 -> 4096 MLP, 4096 tokens a micro-batch, Adam), a call after
  the window's first moves 12% fewer non-GEMM bytes and runs in 0.91 of the
  plain step's time (``benchmarks/bench_accumulate.py``). Arguments after
  ``state`` are pytrees of arrays, as for ``jax.jit``; the wrapper jits the
  step itself (do not wrap it in ``jax.jit`` again).

  Args:
    step: ``step(state, *args, **kwargs)`` returning the new
      :class:`TrainState` (or a tuple whose first element is it), which
      calls ``state.apply_gradients`` once.
    every_k: micro-batches to a window: ``MultiSteps``' ``every_k_schedule``.
    donate_state: donate the state's buffers (but the cache's) to the step.

  Returns:
    The wrapped step, called as ``step``; its ``prologue`` and ``steady``
    attributes are the two jitted programs (``prologue(params, rest, (args,
    kwargs))``, ``steady(params, rest, cache, built_at, (args, kwargs))``,
    ``rest`` the state without params and cache;
    :func:`fp8_linen.core.hoist.window_programs`), for lowering ahead of time.

  Raises:
    ValueError: if ``every_k`` is not a positive int; (when called) if
      ``state`` is not a :class:`TrainState` under ``optax.MultiSteps``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import fp8_linen as fl
    >>> m = fl.QDense(2)
    >>> state = fl.TrainState.create(apply_fn=m.apply, tx=optax.MultiSteps(optax.sgd(0.1), 2),
    ...                              params=m.init(jax.random.key(0), jnp.ones((4, 3))))
    >>> def train_step(state, x):
    ...   grads = jax.grad(lambda v: m.apply(v, x).sum())(state.params)
    ...   return state.apply_gradients(grads=grads)
    >>> train_step = fl.quantize_once_per_window(train_step, every_k=2)
    >>> for _ in range(4):
    ...   state = train_step(state, jnp.ones((4, 3)))
    >>> int(state.opt_state.gradient_step), state.window_cache is not None
    (2, True)
  """
  clock = hoist_lib.WindowClock(every_k, "quantize_once_per_window")

  def run(params, state, extra):
    args, kwargs = extra
    return step(state.replace(params=params), *args, **kwargs)

  prologue, steady = hoist_lib.window_programs(
      run, lambda state: state.opt_state.gradient_step, donate=donate_state)

  @functools.wraps(step)
  def wrapped(state, *args, **kwargs):
    if not isinstance(state, TrainState) or not isinstance(state.opt_state,
                                                           optax.MultiStepsState):
      raise ValueError("quantize_once_per_window: the first argument must be an fl.TrainState "
                       "whose tx is optax.MultiSteps (a window is MultiSteps' micro-batches); "
                       "to accumulate a window in one call use fl.accumulate_microbatches")
    out, cache = hoist_lib.window_call(
        (prologue, steady), clock, state.window_cache, invariant=state.params,
        carried=state.replace(params=None, window_cache=None), extra=(args, kwargs),
        mini_step=state.opt_state.mini_step, step_count=state.opt_state.gradient_step)
    return _with_state(out, _state_of(out).replace(window_cache=cache))

  wrapped.prologue = prologue
  wrapped.steady = steady
  return wrapped


def split_owg(variables: Mapping) -> tuple[dict, dict]:
  """Splits a variables dict into ``(everything but OWG, the OWG collection)``.

  Example:
    >>> import fp8_linen as fl
    >>> rest, owg = fl.split_owg({'params': {'w': 1}, fl.OWG: {'s': 2}})
    >>> rest, owg
    ({'params': {'w': 1}}, {'s': 2})
  """
  rest = {k: v for k, v in variables.items() if k != OWG}
  return rest, variables.get(OWG, {})


def merge_owg(variables: Mapping, grads: Mapping) -> dict:
  """Returns ``variables`` with its OWG collection replaced by ``grads[OWG]``.

  Use it in a hand-written loop after the optimizer updated ``params``.

  Args:
    variables: the model's variables dict.
    grads: gradients of the loss w.r.t. ``variables`` (same structure).

  Returns:
    A new dict; other collections are passed through unchanged.

  Raises:
    ValueError: if the OWG trees differ in structure or in a leaf's shape (e.g.
      a recipe change, or histories of another length: see
      :func:`resize_histories`).
  """
  out = dict(variables)
  if OWG in grads:
    old, new = variables.get(OWG, {}), grads[OWG]
    if jax.tree.structure(old) != jax.tree.structure(new):
      raise ValueError(
          "merge_owg: the gradient's fp8 state tree does not match the variables' "
          f"({jax.tree.structure(new)} vs {jax.tree.structure(old)})")
    for (path, o), n in zip(jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new)):
      if jnp.shape(o) != jnp.shape(n):
        raise ValueError(
            f"merge_owg: fp8 state {_path(path)} has shape {jnp.shape(n)} in grads but "
            f"{jnp.shape(o)} in the variables (a recipe with another history_length?); "
            "resize the histories with fl.resize_histories(variables, history_length)")
    out[OWG] = jax.tree.map(lambda o, n: jnp.asarray(n, o.dtype), old, new)
  return out


def owg_max(a: Any, b: Any) -> Any:
  """Elementwise max of two OWG trees (how fp8 state updates are combined).

  Two updates of one step differ only in the newest amax (index 0) and in
  scales chosen from it; the max of both is the update for the max amax.
  """
  return jax.tree.map(jnp.maximum, a, b)


def _window_max(accum, new, old):
  """:func:`owg_max` of a window's accumulator and one micro-batch's update.

  A micro-batch that observed nothing for a role (an empty batch) returns that
  role's state unrolled; its max with the rolled updates of the other
  micro-batches would mix history positions, so such a role is left out.
  """
  if not isinstance(new, Mapping):
    return jnp.maximum(accum, new)
  out = {}
  for key, n in new.items():
    role = key[:-len("_scale")] if key.endswith("_scale") else (
        key[:-len(_HISTORY)] if key.endswith(_HISTORY) else None)
    hist = f"{role}{_HISTORY}"
    if role is not None and hist in new and not isinstance(n, Mapping):
      unobserved = jnp.all(new[hist] == old[hist])
      out[key] = jnp.where(unobserved, accum[key], jnp.maximum(accum[key], n))
    else:
      out[key] = _window_max(accum[key], n, old[key])
  return out


def accumulate_gradients(acc: Mapping | None, grads: Mapping) -> dict:
  """Adds one micro-batch's gradients into an accumulator.

  Parameters (and any other collection) are summed; the OWG collection is
  max-reduced. Start from ``acc=None``; call :func:`finalize_accumulated` after
  the last micro-batch. Keep the model's variables fixed while accumulating.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> g1 = {'params': {'w': jnp.array(1.0)}, fl.OWG: {'h': jnp.array([3.0, 0.0])}}
    >>> g2 = {'params': {'w': jnp.array(3.0)}, fl.OWG: {'h': jnp.array([30.0, 0.0])}}
    >>> acc = fl.accumulate_gradients(fl.accumulate_gradients(None, g1), g2)
    >>> fin = fl.finalize_accumulated(acc, 2)
    >>> float(fin['params']['w']), fin[fl.OWG]['h'].tolist()
    (2.0, [30.0, 0.0])
  """
  grads = dict(grads)
  if acc is None:
    return grads
  out = {}
  for k, v in grads.items():
    out[k] = owg_max(acc[k], v) if k == OWG else jax.tree.map(jnp.add, acc[k], v)
  return out


def finalize_accumulated(acc: Mapping, num_microbatches: int) -> dict:
  """Divides the summed (non-OWG) gradients by ``num_microbatches``."""
  if num_microbatches < 1:
    raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
  return {k: (v if k == OWG else jax.tree.map(lambda x: x / num_microbatches, v))
          for k, v in acc.items()}


def _axes(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def accumulate_microbatches(grad_fn: Callable, variables: Any, microbatches: Any, *,
                            has_aux: bool = False, hoist: bool | None = None):
  """Accumulates ``grad_fn`` over micro-batches in one ``lax.scan``, quantizing weights once.

  ``grad_fn(variables, batch)`` returns the gradients of one micro-batch
  (``jax.grad`` of a loss over the model's whole variables dict, its OWG
  collection included). This runs it over the leading axis of
  ``microbatches`` while ``variables`` stay fixed, sums the parameter
  gradients, max-reduces the fp8 state and returns
  :func:`finalize_accumulated`'s mean: the gradients of the whole batch, for
  one optimizer step. As in :class:`TrainState`'s ``optax.MultiSteps``
  window, a micro-batch that observed nothing for a role (its state comes
  back unrolled) adds nothing to that role's max, and a role no micro-batch
  observed keeps its state.

  With ``hoist=True`` every computation that reads only ``variables`` (each
  weight's amax, its scale and its low-precision codes in both layouts; a
  float layer's cast of its float32 parameter) runs once before the loop
  instead of once per micro-batch (:mod:`fp8_linen.core.hoist`): a weight is
  quantized once per accumulation window, as TransformerEngine caches its fp8
  weights. The values are those of ``hoist=False``; what is hoisted stays in
  memory through the loop (about 2 bytes per quantized parameter).

  Args:
    grad_fn: ``(variables, batch) -> grads`` (or ``(grads, aux)`` with
      ``has_aux``); ``grads`` has the structure of ``variables``.
    variables: the model's variables (fixed over the window).
    microbatches: a pytree of arrays sharing a leading axis, one entry per
      micro-batch.
    has_aux: ``grad_fn`` also returns an auxiliary pytree; it is returned
      stacked over the micro-batches.
    hoist: compute the work on ``variables`` alone once, before the loop.
      None (the default): on GPU and TPU, not on CPU, where it measured
      1-7% slower (XLA:CPU multiplies the hoisted bf16 weights more slowly
      than it converts float32 ones in the loop).

  Returns:
    The accumulated gradients (and the stacked ``aux`` with ``has_aux``).

  Raises:
    ValueError: if ``microbatches`` has no arrays, or its arrays do not share
      a leading axis of length at least 1, or ``grad_fn`` returns no Mapping.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> model = fl.QDense(4)
    >>> v = model.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> grad_fn = jax.grad(lambda v, x: model.apply(v, x).sum())
    >>> xs = jnp.ones((3, 2, 3))  # three micro-batches of two rows
    >>> g = fl.accumulate_microbatches(grad_fn, v, xs)
    >>> g['params']['kernel'].shape
    (3, 4)
  """
  def init(grads_shape):
    if not isinstance(grads_shape, Mapping):
      raise ValueError("accumulate_microbatches: grad_fn must return the gradients of the "
                       f"variables dict (a Mapping), got {type(grads_shape).__name__}")
    return {k: hoist_lib.filled(v, -jnp.inf if k == OWG else 0) for k, v in grads_shape.items()}

  old = variables.get(OWG) if isinstance(variables, Mapping) else None

  def add(acc, grads):
    if old is None or OWG not in grads:
      return accumulate_gradients(acc, grads)
    out = accumulate_gradients({k: v for k, v in acc.items() if k != OWG},
                               {k: v for k, v in grads.items() if k != OWG})
    out[OWG] = _window_max(acc[OWG], grads[OWG], old)
    return out

  acc, n, aux = hoist_lib.accumulate(grad_fn, variables, microbatches, init=init, add=add,
                                     has_aux=has_aux, hoist=hoist)
  if old is not None and OWG in acc:
    acc = dict(acc, **{OWG: jax.tree.map(
        lambda a, o: jnp.where(jnp.any(a != -jnp.inf), a, o), acc[OWG], old)})
  grads = finalize_accumulated(acc, n)
  return (grads, aux) if has_aux else grads


def reduce_gradients(grads: Mapping, axis_name) -> dict:
  """Cross-device reduction for ``pmap``/``shard_map``: mean grads, max fp8 state.

  Under ``pmap`` and ``shard_map(check_vma=False)`` each device holds its own
  gradients; they are ``pmean``-ed. Under ``shard_map`` with ``check_vma``
  (its default) JAX has already *summed* the gradients of replicated inputs
  (they no longer vary over the axis), so those are divided by the axis size;
  gradients that still vary are ``pmean``-ed. Either way the result is the
  mean over devices. The OWG collection is max-reduced (the ops already did
  so for replicated state under ``check_vma``), so every device holds the
  global amax.

  Args:
    grads: per-device gradients w.r.t. the variables dict.
    axis_name: the mapped axis name (or a tuple of names).

  Returns:
    Gradients averaged over the devices, with the OWG collection max-reduced.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ('d',), devices=jax.devices()[:1])
    >>> f = jax.shard_map(lambda g: fl.reduce_gradients(g, 'd'), mesh=mesh, in_specs=P(),
    ...                   out_specs=P())
    >>> f({'params': jnp.ones(2)})['params'].tolist()
    [1.0, 1.0]
  """
  axes = _axes(axis_name)
  # Whether this trace tracks varying axes (shard_map's check_vma): an axis
  # index varies over its own axis exactly when it does.
  tracked = {a for a in axes if a in varying_axes(jax.lax.axis_index(a))}

  def reduce(x, op, mean: bool):
    varying = varying_axes(x)
    per_device = tuple(a for a in axes if a not in tracked or a in varying)
    summed = tuple(a for a in axes if a in tracked and a not in varying)
    if per_device:
      x = op(x, per_device)
    if summed and mean:  # JAX's sum over the devices, made a mean
      x = x / np.prod([jax.lax.axis_size(a) for a in summed])
    return x

  out = {}
  for k, v in grads.items():
    if k == OWG:
      out[k] = jax.tree.map(lambda x: reduce(x, jax.lax.pmax, False), v)
    else:
      out[k] = jax.tree.map(lambda x: reduce(x, jax.lax.pmean, True), v)
  return out


def all_finite(tree) -> jnp.ndarray:
  """Whether every floating leaf of ``tree`` is finite (a boolean scalar).

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> bool(fl.all_finite({'w': jnp.array([1.0, jnp.inf])}))
    False
  """
  ok = jnp.array(True)
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      ok = ok & jnp.all(jnp.isfinite(leaf))
  return ok


def _history_length(history_length, role: str) -> int:
  if isinstance(history_length, Mapping):
    if role not in history_length:
      raise ValueError(f"resize_histories: history_length has no entry for role {role!r} "
                       f"(has {sorted(history_length)})")
    n = history_length[role]
  elif hasattr(history_length, "role"):  # a recipe: each role's own length
    n = history_length.role(role).history_length
  else:
    n = history_length
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"resize_histories: history_length={n!r} (role {role!r}) must be an "
                     "int >= 1")
  return int(n)


# flax's dot-general fp8 ops (fp8_linen.linen.flax_fp8.FLAX_DOT_OPS; a test keeps
# them equal): fl.Fp8DotGeneral continues their state in place, in flax's
# history order, which cutting from the end would get wrong.
_FLAX_DOT_OPS = ("Fp8DirectDotGeneralOp", "Fp8DotGeneralOp", "NANOOFp8DotGeneralOp")


def _resize(tree, history_length, fill: float):
  def one(path, x):
    key = _name(path[-1]) if path else ""
    if not key.endswith(_HISTORY):
      return x
    if any(_name(k).rpartition("_")[0] in _FLAX_DOT_OPS for k in path[:-1]):
      raise ValueError(
          f"resize_histories: {_path(path)} is a flax fp8 op's state, whose history is in "
          "flax's order (index 1 the oldest); convert and resize it with "
          "fl.from_flax_fp8(variables, recipe)")
    n = _history_length(history_length, key[:-len(_HISTORY)])
    x = jnp.asarray(x)
    # The history is the last axis (a grouped GEMM's per-expert histories are (g, L)).
    if x.shape[-1] >= n:
      return x[..., :n]
    return jnp.concatenate([x, jnp.full(x.shape[:-1] + (n - x.shape[-1],), fill, x.dtype)],
                           axis=-1)
  return jax.tree_util.tree_map_with_path(one, tree)


def resize_histories(tree, history_length):
  """Every fp8 amax history in ``tree`` cut or zero-padded to a new length.

  Use it to load a checkpoint written with another ``history_length``: restore
  the checkpoint as written, resize, then train with the new recipe. The newest
  entries (index 0 first) are kept; new older entries are 0 ("nothing
  observed"). Scales are kept.

  Args:
    tree: a variables dict, its OWG collection, or a :class:`TrainState`
      (whose accumulation window is resized too).
    history_length: the new length: an int for every role, a mapping role ->
      int, or a recipe (each role gets its ``history_length``).

  Returns:
    ``tree`` with the histories resized.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> v = fl.QDense(2, recipe=fl.delayed_scaling(4)).init(jax.random.key(0), jnp.ones((1, 3)))
    >>> v = fl.resize_histories(v, fl.delayed_scaling(16))
    >>> v[fl.OWG]['input_amax_history'].shape
    (16,)
  """
  if isinstance(tree, TrainState):
    accum = (None if tree.owg_accum is None
             else _resize(tree.owg_accum, history_length, -np.inf))
    return tree.replace(params=_resize(tree.params, history_length, 0.0), owg_accum=accum,
                        window_cache=None)
  return _resize(tree, history_length, 0.0)


def _field(tree, name):
  if isinstance(tree, Mapping):
    return tree.get(name)
  return getattr(tree, name, None)


def _by_path(tree, drop: str | None = None) -> dict:
  """Leaves of ``tree`` by path string (dicts, attributes and indices alike)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    names = [_name(k) for k in path]
    if drop is not None and drop in names:
      names.remove(drop)
    out["/".join(names)] = leaf
  return out


def _take(kind: str, target, source: dict):
  """``target``'s structure filled with the leaves of ``source`` at the same paths."""
  leaves, missing = [], []
  for path, t in jax.tree_util.tree_leaves_with_path(target):
    key = _path(path)
    if key not in source:
      missing.append(key)
      continue
    v = source.pop(key)
    if jnp.shape(v) != jnp.shape(t):
      raise ValueError(f"load_float_state: {kind} {key} has shape {jnp.shape(v)} in the float "
                       f"state but {jnp.shape(t)} in the fp8 state (not the same model?)")
    leaves.append(jnp.asarray(v, jnp.result_type(t)))
  if missing or source:
    raise ValueError(
        f"load_float_state: the float state's {kind} does not match the fp8 state's "
        f"(missing: {missing[:4]}, unexpected: {sorted(source)[:4]}); it must come from the "
        "same model and optimizer, without fp8")
  return jax.tree.unflatten(jax.tree.structure(target), leaves)


def load_float_state(state: "TrainState", float_state) -> "TrainState":
  """Starts an fp8 :class:`TrainState` from a checkpoint of the same model without fp8.

  ``state`` is a fresh fp8 state (from ``model.init``'s full variables); the
  float run's parameters, optimizer state and step replace its own, and the
  fp8 state stays fresh (unit scales, empty histories: the first step takes
  its scales from the current batch). ``QDense`` & co. keep ``nn.Dense``'s
  ``params`` tree, so a float checkpoint of the same model fits.

  Args:
    state: the fp8 train state to fill.
    float_state: the float run's train state, restored as written (e.g. with
      orbax into the float run's own structure, or without a target): anything
      with ``params``, ``opt_state`` and ``step`` (attributes or keys). Its
      ``params`` may be the variables dict (``{'params': ...}``) or the
      parameters alone (flax's usual ``params=variables['params']``).

  Returns:
    ``state`` with the float run's parameters, optimizer state and step.

  Raises:
    ValueError: if the float state does not fit (another model or optimizer),
      naming the leaves that differ.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> from flax.training import train_state
    >>> import fp8_linen as fl
    >>> x = jnp.ones((2, 3))
    >>> p = nn.Dense(4).init(jax.random.key(1), x)['params']
    >>> float_run = train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3))
    >>> fp8 = fl.TrainState.create(apply_fn=fl.QDense(4).apply,
    ...                            params=fl.QDense(4).init(jax.random.key(0), x),
    ...                            tx=optax.adam(1e-3))
    >>> state = fl.load_float_state(fp8, float_run)
    >>> bool((state.params['params']['kernel'] == p['kernel']).all())
    True
  """
  if not isinstance(state, TrainState) or not _is_variables(state.params):
    raise TypeError("load_float_state: state must be an fp8_linen TrainState created from "
                    "model.init's variables")
  params, opt_state = _field(float_state, "params"), _field(float_state, "opt_state")
  if params is None:
    raise ValueError("load_float_state: float_state has no params")
  target = {k: v for k, v in state.params.items() if k != OWG}
  # The float run kept the variables dict ({'params': ...}) or the params alone.
  wrapped = (isinstance(params, Mapping) and "params" in params
             and set(_by_path(params["params"])) == set(_by_path(target["params"])))
  source = dict(params) if wrapped else {"params": params}
  source.pop(OWG, None)
  variables = dict(state.params)
  for k in sorted(set(target) | set(source)):
    if k not in target or k not in source:
      raise ValueError(f"load_float_state: collection {k!r} is in only one of the float "
                       f"state ({sorted(source)}) and the fp8 state ({sorted(target)})")
    variables[k] = _take(f"{k!r}", target[k], _by_path(source[k]))
  new_opt = state.opt_state
  if opt_state is not None:
    new_opt = _take("optimizer state", state.opt_state,
                    _by_path(opt_state, drop="params" if wrapped else None))
  step = _field(float_state, "step")
  step = state.step if step is None else jnp.asarray(step, jnp.result_type(state.step))
  return state.replace(step=step, params=variables, opt_state=new_opt, window_cache=None)


def switch_precision(state: "TrainState", *, apply_fn, variables) -> "TrainState":
  """Goes on training ``state`` with another precision: a schedule, not a restart.

  For a precision tail (NVIDIA's NVFP4 recipe ends its run in bf16): the
  parameters, the optimizer state and the step go on; the model's apply
  function becomes ``apply_fn`` and its quantization state (the OWG
  collection) becomes the one ``variables`` holds, fresh for the new recipe
  (the old recipe's scales and histories mean nothing to it, so they are
  dropped). Every other collection (e.g. ``batch_stats``) keeps its trained
  values. ``apply_fn`` and ``variables`` come from the same model with the
  new recipe, or without one (``fl.quantize_model``'s model unwrapped, or
  ``nn.Dense`` for ``fl.QDense``): both keep flax's parameter tree, so the
  parameters must match leaf for leaf.

  Under ``optax.MultiSteps`` switch between windows: a window's accumulated
  fp8 state belongs to the old recipe and starts over.

  Args:
    state: the :class:`TrainState` so far (created from ``model.init``'s
      variables).
    apply_fn: the new model's ``apply``; a jitted step that reads
      ``state.apply_fn`` compiles again for it.
    variables: the new model's ``init`` variables (only their shapes and the
      new quantization state are used).

  Returns:
    ``state`` with the new ``apply_fn`` and quantization state.

  Raises:
    TypeError: if ``state`` is not a :class:`TrainState` of a variables dict.
    ValueError: if the parameters differ (paths or shapes), or the new model
      lacks a collection the state trains, naming them.

  Example:
    >>> import jax, jax.numpy as jnp, optax, flax.linen as nn
    >>> import fp8_linen as fl
    >>> x = jnp.ones((4, 32))
    >>> v = fl.QDense(8, recipe=fl.nvfp4()).init(jax.random.key(0), x)
    >>> state = fl.TrainState.create(apply_fn=fl.QDense(8, recipe=fl.nvfp4()).apply,
    ...                              params=v, tx=optax.adam(1e-3))
    >>> tail = nn.Dense(8)
    >>> state = fl.switch_precision(state, apply_fn=tail.apply,
    ...                             variables=tail.init(jax.random.key(0), x))
    >>> sorted(state.params), state.params['params']['kernel'] is v['params']['kernel']
    (['params'], True)
  """
  if not isinstance(state, TrainState) or not _is_variables(state.params):
    raise TypeError("switch_precision: state must be an fp8_linen TrainState created from "
                    "model.init's variables")
  if not _is_variables(variables) or "params" not in variables:
    raise TypeError("switch_precision: variables must be the new model's init variables "
                    "(a dict with a 'params' collection)")
  old = _by_path(state.params.get("params", {}))
  new = _by_path(variables["params"])
  missing, extra = sorted(set(old) - set(new)), sorted(set(new) - set(old))
  reshaped = sorted(k for k in set(old) & set(new) if jnp.shape(old[k]) != jnp.shape(new[k]))
  if missing or extra or reshaped:
    raise ValueError(
        "switch_precision: the new model's parameters differ from the state's (missing: "
        f"{missing[:4]}, unexpected: {extra[:4]}, other shapes: {reshaped[:4]}), so the "
        "optimizer state cannot follow; build it from the same model with a recipe that "
        "learns no quantizer parameters (LSQ's steps are parameters: use an STE recipe)")
  kept = sorted(k for k in state.params if k not in ("params", OWG) and k not in variables)
  if kept:
    raise ValueError(f"switch_precision: the new model has no collection {kept} that the state "
                     "trains; build it from the same model")
  out = {k: (state.params[k] if k in state.params and k != OWG else v)
         for k, v in variables.items()}
  # On one device, the new recipe's state goes where the trained one lives.
  out = mesh.placed_on(out, mesh.one_device_of(state.params["params"]))
  out["params"] = state.params["params"]
  accum = None
  if isinstance(state.opt_state, optax.MultiStepsState) and OWG in out:
    accum = jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), out[OWG])
  return state.replace(apply_fn=apply_fn, params=out, owg_accum=accum, window_cache=None)


class TrainState(flax_train_state.TrainState):
  """``flax.training.train_state.TrainState`` that overwrites the fp8 state.

  ``params`` holds the whole variables dict (``{'params': ..., OWG: ...}``, and
  any other collection); the optimizer sees only ``params['params']``. After
  each :meth:`apply_gradients` the OWG collection is replaced by the new state
  found in ``grads[OWG]``. With ``optax.MultiSteps`` the new state is committed
  only when the optimizer really steps, as the max over the micro-batches.

  A step whose parameter gradients are not all finite leaves the fp8 state
  (and the accumulation window) unchanged: those are the steps
  ``optax.apply_if_finite`` and ``MultiSteps(should_skip_update_fn=
  skip_not_finite)`` skip, and a step any ``MultiSteps`` skip function skipped
  (it did not advance) is treated the same way.

  If ``grads`` has no OWG entry (e.g. you differentiated ``params`` only) the
  fp8 state is left unchanged.

  Attributes:
    owg_accum: the max-accumulated fp8 state of the current accumulation window
      (only used with ``optax.MultiSteps``).
    window_cache: ``(optimizer step, arrays)``: the work on the parameters
      alone that :func:`quantize_once_per_window` keeps for the current
      window (None otherwise).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import fp8_linen as fl
    >>> m = fl.QDense(2)
    >>> v = m.init(jax.random.key(0), jnp.ones((4, 3)))
    >>> state = fl.TrainState.create(apply_fn=m.apply, params=v,
    ...                              tx=optax.apply_if_finite(optax.sgd(0.1), 10))
    >>> x = jnp.ones((4, 3)).at[0, 0].set(jnp.nan)
    >>> grads = jax.grad(lambda v: m.apply(v, x).sum())(state.params)
    >>> new = state.apply_gradients(grads=grads)  # skipped: nothing moves
    >>> bool((new.params[fl.OWG]['input_amax_history'] == v[fl.OWG]['input_amax_history']).all())
    True
  """

  owg_accum: Any = struct.field(pytree_node=True, default=None)
  window_cache: Any = struct.field(pytree_node=True, default=None)

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs):
    """Creates the state; ``params`` may be the full variables dict."""
    if _is_variables(params):
      opt_state = tx.init(params.get("params", {}))
      accum = (jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), params[OWG])
               if isinstance(opt_state, optax.MultiStepsState) and OWG in params else None)
    else:
      opt_state, accum = tx.init(params), None
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state,
               owg_accum=accum, **kwargs)

  def apply_gradients(self, *, grads, **kwargs):
    """One optimizer step on ``params['params']``, then the fp8 state merge."""
    if not _is_variables(self.params):
      return super().apply_gradients(grads=grads, **kwargs)
    if "params" in self.params and "params" not in grads:
      raise ValueError("apply_gradients: grads must be taken w.r.t. the whole variables dict "
                       f"(keys {sorted(self.params)}); got keys {sorted(grads)}")
    variables = dict(self.params)
    new_opt_state = self.opt_state
    if "params" in self.params:
      updates, new_opt_state = self.tx.update(grads["params"], self.opt_state,
                                              self.params["params"])
      variables["params"] = optax.apply_updates(self.params["params"], updates)
    accum = self.owg_accum
    if OWG in grads and OWG in self.params:
      old = self.params[OWG]
      new_owg = merge_owg(self.params, grads)[OWG]
      # A step the optimizer skips must not move the fp8 state either: its
      # amaxes are finite (non-finite ones never enter the state) but belong to
      # a batch the run is discarding.
      skipped = ~all_finite(grads.get("params", {}))
      if isinstance(new_opt_state, optax.MultiStepsState):
        old_ms = self.opt_state
        # A micro-batch a skip function rejected advances no counter.
        skipped = skipped | ((new_opt_state.mini_step == old_ms.mini_step)
                             & (new_opt_state.gradient_step == old_ms.gradient_step))
        # The accumulator holds the max over the window so far (-inf right
        # after a commit, so the next window starts from its first micro-batch).
        accum = jax.tree.map(lambda a, n: jnp.where(skipped, a, n),
                             self.owg_accum, _window_max(self.owg_accum, new_owg, old))
        # Committed exactly when the inner optimizer stepped (has_updated
        # would also be true on a skipped step right after a commit); a role no
        # micro-batch observed keeps its state.
        committed = new_opt_state.gradient_step != old_ms.gradient_step
        new_owg = jax.tree.map(
            lambda a, o: jnp.where(committed & jnp.any(a != -jnp.inf), a, o), accum, old)
        accum = jax.tree.map(lambda a: jnp.where(committed, -jnp.inf, a), accum)
      else:
        new_owg = jax.tree.map(lambda n, o: jnp.where(skipped, o, n), new_owg, old)
      variables[OWG] = new_owg
    return self.replace(step=self.step + 1, params=variables, opt_state=new_opt_state,
                        owg_accum=accum, **kwargs)
