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

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state as flax_train_state

from fp8_linen.core.owg import OWG

__all__ = [
    "TrainState",
    "split_owg",
    "merge_owg",
    "owg_max",
    "accumulate_gradients",
    "finalize_accumulated",
    "reduce_gradients",
]


def _is_variables(tree: Any) -> bool:
  return isinstance(tree, Mapping) and "params" in tree and OWG in tree


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
    ValueError: if the OWG trees differ in structure (e.g. a recipe change).
  """
  out = dict(variables)
  if OWG in grads:
    old, new = variables.get(OWG, {}), grads[OWG]
    if jax.tree.structure(old) != jax.tree.structure(new):
      raise ValueError(
          "merge_owg: the gradient's fp8 state tree does not match the variables' "
          f"({jax.tree.structure(new)} vs {jax.tree.structure(old)})")
    out[OWG] = jax.tree.map(lambda o, n: jnp.asarray(n, o.dtype), old, new)
  return out


def owg_max(a: Any, b: Any) -> Any:
  """Elementwise max of two OWG trees (how fp8 state updates are combined).

  Two updates of one step differ only in the newest amax (index 0) and in
  scales chosen from it; the max of both is the update for the max amax.
  """
  return jax.tree.map(jnp.maximum, a, b)


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


def reduce_gradients(grads: Mapping, axis_name: str) -> dict:
  """Cross-device reduction for ``pmap``/``shard_map``: mean grads, max fp8 state.

  Args:
    grads: per-device gradients w.r.t. the variables dict.
    axis_name: the mapped axis name.

  Returns:
    Gradients where non-OWG collections are ``pmean``-ed and the OWG
    collection is ``pmax``-ed, so every device holds the global amax.
  """
  return {k: (jax.lax.pmax(v, axis_name) if k == OWG else jax.lax.pmean(v, axis_name))
          for k, v in grads.items()}


class TrainState(flax_train_state.TrainState):
  """``flax.training.train_state.TrainState`` that overwrites the fp8 state.

  ``params`` holds the whole variables dict (``{'params': ..., OWG: ...}``, and
  any other collection); the optimizer sees only ``params['params']``. After
  each :meth:`apply_gradients` the OWG collection is replaced by the new state
  found in ``grads[OWG]``. With ``optax.MultiSteps`` the new state is committed
  only when the optimizer really steps, as the max over the micro-batches.

  If ``grads`` has no OWG entry (e.g. you differentiated ``params`` only) the
  fp8 state is left unchanged.

  Attributes:
    owg_accum: the max-accumulated fp8 state of the current accumulation window
      (only used with ``optax.MultiSteps``).
  """

  owg_accum: Any = struct.field(pytree_node=True, default=None)

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs):
    """Creates the state; ``params`` may be the full variables dict."""
    if _is_variables(params):
      opt_params = params["params"]
      opt_state = tx.init(opt_params)
      accum = (jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), params[OWG])
               if isinstance(opt_state, optax.MultiStepsState) else None)
    else:
      opt_state, accum = tx.init(params), None
    return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state,
               owg_accum=accum, **kwargs)

  def apply_gradients(self, *, grads, **kwargs):
    """One optimizer step on ``params['params']``, then the fp8 state merge."""
    if not _is_variables(self.params):
      return super().apply_gradients(grads=grads, **kwargs)
    if "params" not in grads:
      raise ValueError("apply_gradients: grads must be taken w.r.t. the whole variables dict "
                       f"(keys {sorted(self.params)}); got keys {sorted(grads)}")
    updates, new_opt_state = self.tx.update(grads["params"], self.opt_state,
                                            self.params["params"])
    new_params = optax.apply_updates(self.params["params"], updates)
    variables = dict(self.params)
    variables["params"] = new_params
    accum = self.owg_accum
    if OWG in grads:
      new_owg = merge_owg(self.params, grads)[OWG]
      if isinstance(new_opt_state, optax.MultiStepsState):
        # The accumulator holds the max over the window so far (-inf right
        # after a commit, so the next window starts from its first micro-batch).
        accum = owg_max(self.owg_accum, new_owg)
        committed = optax.MultiSteps.has_updated(self.tx, new_opt_state)
        new_owg = jax.tree.map(lambda a, o: jnp.where(committed, a, o), accum, self.params[OWG])
        accum = jax.tree.map(lambda a: jnp.where(committed, -jnp.inf, a), accum)
      variables[OWG] = new_owg
    return self.replace(step=self.step + 1, params=variables, opt_state=new_opt_state,
                        owg_accum=accum, **kwargs)
