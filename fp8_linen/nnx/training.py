"""The NNX train step: differentiate for the new state, write it after the optimizer.

The NNX mirror of :class:`fp8_linen.TrainState`. The layers' backward rules
return the new quantization state as the gradient of its
:class:`~fp8_linen.nnx.QuantState` variables, so a train step differentiates
with respect to ``(nnx.Param, QuantState)`` (:data:`DIFF`, or
:func:`value_and_grad`) and :class:`Optimizer` then optimises the ``Param`` s
and *writes* the ``QuantState`` "gradients" over the state (never optimising
them). With ``optax.MultiSteps`` the state is held fixed over the
micro-batches, their updates are max-reduced, and the result is written once
per optimizer step (the history advances once, with the max amax).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> model = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> opt = fl.nnx.Optimizer(model, optax.sgd(0.1))
  >>> loss, grads = fl.nnx.value_and_grad(lambda m: m(jnp.full((4, 3), 2.0)).sum())(model)
  >>> _ = opt.update(model, grads)
  >>> model.input_amax_history[...][0].tolist()
  2.0
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fp8_linen.core import hoist as hoist_lib
from fp8_linen.core import numerics, owg
from fp8_linen.nnx.state import DIFF, QuantState

__all__ = ["DIFF", "Optimizer", "value_and_grad", "grad", "update_state", "split_first_step",
           "accumulate_microbatches", "quantize_once_per_window"]


def value_and_grad(f, argnums: int = 0, *, has_aux: bool = False):
  """``nnx.value_and_grad`` of ``f`` w.r.t. the params and the state of argument ``argnums``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> m = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> _, g = fl.nnx.value_and_grad(lambda m: m(jnp.ones((1, 3))).sum())(m)
    >>> g['input_amax_history'][...][0].tolist()
    1.0
  """
  return nnx.value_and_grad(f, argnums=nnx.DiffState(argnums, DIFF), has_aux=has_aux)


def grad(f, argnums: int = 0, *, has_aux: bool = False):
  """``nnx.grad`` of ``f`` w.r.t. the params and the state of argument ``argnums``."""
  return nnx.grad(f, argnums=nnx.DiffState(argnums, DIFF), has_aux=has_aux)


def _new_state(model, grads) -> nnx.State:
  """The new :class:`QuantState` values carried by ``grads`` (checked against ``model``)."""
  old = nnx.as_pure(nnx.state(model, QuantState))
  new = nnx.as_pure(nnx.state(grads, QuantState))
  if jax.tree.structure(old) != jax.tree.structure(new):
    if not jax.tree.leaves(new) and jax.tree.leaves(old):
      raise ValueError(
          "the gradients carry no QuantState: differentiate with respect to "
          "(nnx.Param, fl.nnx.QuantState) (fl.nnx.value_and_grad, or "
          "nnx.value_and_grad(..., argnums=nnx.DiffState(0, fl.nnx.DIFF)))")
    raise ValueError("the gradients' QuantState tree does not match the model's "
                     f"({jax.tree.structure(new)} vs {jax.tree.structure(old)})")
  return jax.tree.map(lambda o, n: jnp.asarray(n, o.dtype), old, new)


def update_state(model: nnx.Module, grads) -> None:
  """Writes the new quantization state in ``grads`` over ``model``'s (hand-written loops).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> m = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> fl.nnx.update_state(m, fl.nnx.grad(lambda m: m(jnp.ones((1, 3))).sum())(m))
    >>> m.kernel_amax_history[...][0].tolist() > 0
    True
  """
  nnx.update(model, _new_state(model, grads))


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` that also writes the new quantization state.

  ``update(model, grads)`` runs the optax step on the variables ``wrt`` selects
  (``nnx.Param`` by default) and writes the :class:`QuantState` entries of
  ``grads`` over the model's state. ``grads`` must come from differentiating
  with respect to ``(nnx.Param, QuantState)`` (:func:`value_and_grad`). With a
  transformation that accumulates (``optax.MultiSteps``: it has
  ``has_updated``) the state updates of the micro-batches are max-reduced and
  written when the optimizer steps.

  Args:
    model: the NNX model.
    tx: the optax transformation.
    wrt: the variables the optimizer updates (never :class:`QuantState`).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> opt = fl.nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), 2))
    >>> for a in (3.0, 5.0):
    ...   _ = opt.update(model, fl.nnx.grad(lambda m: m(jnp.full((1, 3), a)).sum())(model))
    >>> model.input_amax_history[...][:2].tolist()
    [5.0, 0.0]
  """

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *,
               wrt: Any = nnx.Param, graph: bool | None = None):
    if nnx.filterlib.to_predicate(wrt)(("x",), QuantState(jnp.zeros(()))):
      raise ValueError("Optimizer: wrt must not select QuantState (its gradient is its new "
                       "value; it is written, not optimised)")
    # flax 0.12.3 (EasyDeL pins it) has no `graph` argument: pass it only when asked for.
    super().__init__(model, tx, wrt=wrt, **({} if graph is None else {"graph": graph}))
    if hasattr(tx, "has_updated"):
      # Max over the micro-batches' state updates, written when the optimizer steps.
      self.quant_acc = nnx.data(jax.tree.map(
          lambda a: nnx.OptState(jnp.zeros_like(a)),
          nnx.as_pure(nnx.state(model, QuantState))))
    else:
      self.quant_acc = None

  def update(self, model: nnx.Module, grads, /, **kwargs):  # pylint: disable=arguments-differ
    """Optimises the params and writes the new quantization state (see the class doc)."""
    new = _new_state(model, grads)
    if self.quant_acc is None:
      updates = super().update(model, grads, **kwargs)
      nnx.update(model, new)
      return updates
    first = nnx.as_pure(self.opt_state).mini_step == 0
    acc = nnx.as_pure(self.quant_acc)
    acc = jax.tree.map(lambda a, n: jnp.where(first, n, jnp.maximum(a, n)), acc, new)
    updates = super().update(model, grads, **kwargs)
    stepped = self.tx.has_updated(nnx.as_pure(self.opt_state))
    old = nnx.as_pure(nnx.state(model, QuantState))
    nnx.update(model, jax.tree.map(lambda o, a: jnp.where(stepped, a, o), old, acc))
    nnx.update(self.quant_acc, acc)
    return updates


def _module_histories(tree) -> list:
  """The ``<role>_amax_history`` QuantState values of every NNX object in ``tree``."""
  is_node = nnx.graph.is_graph_node
  return owg.history_leaves([nnx.state(n, QuantState)
                             for n in jax.tree.leaves(tree, is_leaf=is_node) if is_node(n)])


def split_first_step(step: Callable) -> Callable:
  """:func:`fp8_linen.split_first_step` for NNX steps: modules among the arguments.

  The step's first steps (while some ``<role>_amax_history``
  :class:`~fp8_linen.nnx.QuantState` of its module arguments has no
  observation) run ``step`` as traced by default, the others a trace in
  which every delayed scale is its history's, so that no cast waits for its
  tensor's amax. One ``nnx.cond`` holds both, so the modules' updates
  (parameters, optimizer, fp8 state) come out of whichever branch ran. Wrap
  the step before ``nnx.jit``.

  Args:
    step: ``step(*args, **kwargs)``, modules (and optimizers) among ``args``.

  Returns:
    The wrapped step.

  Raises:
    ValueError: (when called) no module argument holds an amax history.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> opt = fl.nnx.Optimizer(model, optax.sgd(0.1))
    >>> @nnx.jit
    ... @fl.nnx.split_first_step
    ... def train_step(model, opt, x):
    ...   loss, grads = fl.nnx.value_and_grad(lambda m: m(x).sum())(model)
    ...   opt.update(model, grads)
    ...   return loss
    >>> _ = train_step(model, opt, jnp.ones((4, 3)))
    >>> _ = train_step(model, opt, jnp.ones((4, 3)))
    >>> model.input_amax_history[...][:2].tolist()
    [1.0, 1.0]
  """

  @functools.wraps(step)
  def wrapped(*args, **kwargs):
    ready = owg.all_observed(_module_histories((args, kwargs)), " in a module's QuantState")

    def steady(a, k):
      with numerics.histories_observed():
        return step(*a, **k)

    return nnx.cond(ready, steady, lambda a, k: step(*a, **k), args, kwargs)

  return wrapped


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def accumulate_microbatches(grad_fn: Callable, model: nnx.Module, microbatches: Any, *,
                            has_aux: bool = False, hoist: bool | None = None):
  """:func:`fp8_linen.accumulate_microbatches` for NNX: a window's gradients, weights cast once.

  ``grad_fn(model, batch)`` returns one micro-batch's gradients with respect
  to ``(nnx.Param, QuantState)`` (:func:`grad`). This runs it over the leading
  axis of ``microbatches`` in one ``lax.scan`` with the model fixed, averages
  the ``Param`` gradients and max-reduces the ``QuantState`` updates, and
  returns the window's gradients for :meth:`Optimizer.update` (one optimizer
  step, the history advancing once with the window's max amax). With
  ``hoist=True`` the work on the model's variables alone (each weight's
  amax, scale and codes) runs once before the loop. The model's other state
  (an ``nnx.Rngs`` counter, batch statistics) is read, not updated, by the
  window: every micro-batch sees the same.

  Args:
    grad_fn: ``(model, batch) -> grads`` (or ``(grads, aux)`` with ``has_aux``).
    model: the NNX model.
    microbatches: a pytree of arrays sharing a leading axis, one entry per
      micro-batch.
    has_aux: ``grad_fn`` also returns an auxiliary pytree, returned stacked.
    hoist: compute the work on the model's variables once, before the loop
      (None: on GPU and TPU, not on CPU; see :func:`fp8_linen.accumulate_microbatches`).

  Returns:
    The window's gradients (an ``nnx.State``), and the stacked ``aux`` with
    ``has_aux``.

  Raises:
    ValueError: if ``microbatches`` has no arrays or no common leading axis of
      length >= 1, or ``grad_fn`` returns no ``nnx.State``.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> opt = fl.nnx.Optimizer(model, optax.sgd(0.1))
    >>> grad_fn = fl.nnx.grad(lambda m, x: m(x).sum())
    >>> xs = jnp.stack([jnp.full((4, 3), 2.0), jnp.full((4, 3), 5.0)])
    >>> grads = fl.nnx.accumulate_microbatches(grad_fn, model, xs)
    >>> _ = opt.update(model, grads)
    >>> model.input_amax_history[...][:2].tolist()
    [5.0, 0.0]
  """
  graphdef, state = nnx.split(model)

  def pure(state, batch):
    # Variables rebuilt in the trace that runs the loop body (NNX refuses
    # variables of an outer trace).
    return grad_fn(nnx.merge(graphdef, jax.tree.map(lambda a: a, state)), batch)

  def init(grads_shape):
    if not isinstance(grads_shape, nnx.State):
      raise ValueError("accumulate_microbatches: grad_fn must return the gradients of the "
                       "model (an nnx.State, e.g. from fl.nnx.grad), got "
                       f"{type(grads_shape).__name__}")
    return jax.tree.map(
        lambda v: hoist_lib.filled(v, -jnp.inf if isinstance(v, QuantState) else 0),
        grads_shape, is_leaf=_is_variable)

  def add(acc, grads):
    return jax.tree.map(
        lambda a, g: jax.tree.map(jnp.maximum if isinstance(a, QuantState) else jnp.add, a, g),
        acc, grads, is_leaf=_is_variable)

  acc, n, aux = hoist_lib.accumulate(pure, state, microbatches, init=init, add=add,
                                     has_aux=has_aux, hoist=hoist)
  grads = jax.tree.map(
      lambda v: v if isinstance(v, QuantState) else jax.tree.map(lambda a: a / n, v),
      acc, is_leaf=_is_variable)
  return (grads, aux) if has_aux else grads


def _multisteps_state(opt: nnx.Optimizer):
  state = nnx.as_pure(opt.opt_state)
  return state if isinstance(state, optax.MultiStepsState) else None


def quantize_once_per_window(step: Callable, *, every_k: int, donate: bool = False) -> Callable:
  """:func:`fp8_linen.quantize_once_per_window` for NNX steps: modules among the arguments.

  ``step(*args, **kwargs)`` updates its module arguments in place (an
  :class:`Optimizer` over ``optax.MultiSteps`` among them) and returns
  arrays. The work on the modules' ``nnx.Param`` and :class:`QuantState`
  variables alone (fixed within a window) runs once at the window's first
  call; the window's other calls read it. The values are those of the plain
  step. The cache is held by the wrapper, one per optimizer: after changing
  the parameters yourself (``nnx.update``, a restored checkpoint) in the
  middle of a window, call ``wrapped.reset()``. The wrapper jits the step
  itself (do not wrap it in ``nnx.jit``).

  Args:
    step: the train step.
    every_k: micro-batches to a window: ``MultiSteps``' ``every_k_schedule``.
    donate: donate the modules' buffers to the step.

  Returns:
    The wrapped step, with ``reset()`` (drops every cache).

  Raises:
    ValueError: if ``every_k`` is not a positive int; (when called) if no
      argument is an ``nnx.Optimizer`` over ``optax.MultiSteps``, or the step
      returns a module.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = fl.nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> opt = fl.nnx.Optimizer(model, optax.MultiSteps(optax.sgd(0.1), 2))
    >>> def train_step(model, opt, x):
    ...   loss, grads = fl.nnx.value_and_grad(lambda m: m(x).sum())(model)
    ...   opt.update(model, grads)
    ...   return loss
    >>> train_step = fl.nnx.quantize_once_per_window(train_step, every_k=2)
    >>> for a in (3.0, 5.0, 1.0, 2.0):
    ...   _ = train_step(model, opt, jnp.full((4, 3), a))
    >>> model.input_amax_history[...][:2].tolist()
    [2.0, 5.0]
  """
  name = "fl.nnx.quantize_once_per_window"
  hoist_lib.WindowClock(every_k, name)  # (checks every_k now)
  fixed = (nnx.Param, QuantState)
  is_node = nnx.graph.is_graph_node
  # Per optimizer: where its windows start and its cache; per module structure: the programs.
  windows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
  programs = {}

  def programs_for(graphdef, treedef, where, opt_index):
    def run(invariant, carried, extra):
      nodes = nnx.merge(graphdef, invariant, carried)
      others = iter(extra)
      leaves = [nodes[where.index(i)] if i in where else next(others)
                for i in range(treedef.num_leaves)]
      a, k = jax.tree.unflatten(treedef, leaves)
      out = step(*a, **k)
      if any(is_node(x) for x in jax.tree.leaves(out, is_leaf=is_node)):
        raise ValueError(f"{name}: the step must return arrays, not modules (it updates its "
                         "module arguments in place)")
      _, new_invariant, new_carried = nnx.split(nodes, fixed, ...)
      return out, new_invariant, new_carried

    key = (graphdef, treedef, where, opt_index)
    if key not in programs:
      programs[key] = hoist_lib.window_programs(
          run, functools.partial(_gradient_step, opt_index), donate=donate)
    return programs[key]

  @functools.wraps(step)
  def wrapped(*args, **kwargs):
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    where = tuple(i for i, x in enumerate(leaves) if is_node(x))
    nodes = tuple(leaves[i] for i in where)
    opts = [n for n in nodes if isinstance(n, nnx.Optimizer) and _multisteps_state(n)]
    if len(opts) != 1:
      raise ValueError(f"{name}: one argument must be an nnx.Optimizer over optax.MultiSteps "
                       f"(a window is MultiSteps' micro-batches), got {len(opts)}; to "
                       "accumulate a window in one call use fl.nnx.accumulate_microbatches")
    (opt,) = opts
    graphdef, invariant, carried = nnx.split(nodes, fixed, ...)
    ms = _multisteps_state(opt)
    window = windows.setdefault(opt, {"clock": hoist_lib.WindowClock(every_k, name)})
    (out, new_invariant, new_carried), window["cache"] = hoist_lib.window_call(
        programs_for(graphdef, treedef, where, nodes.index(opt)), window["clock"],
        window.get("cache"), invariant=invariant, carried=carried,
        extra=[x for i, x in enumerate(leaves) if i not in where], mini_step=ms.mini_step,
        step_count=ms.gradient_step)
    nnx.update(nodes, new_invariant, new_carried)
    return out

  wrapped.reset = windows.clear
  return wrapped


def _gradient_step(opt_index: int, carried):
  """``optax.MultiSteps``' count of optimizer steps: the ``gradient_step`` leaf under the
  optimizer's entry (``opt_index``) of the split modules' state."""
  name = lambda k: getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
  (count,) = [v for path, v in jax.tree_util.tree_leaves_with_path(carried)
              if name(path[0]) == opt_index and "gradient_step" in map(name, path)]
  return count
