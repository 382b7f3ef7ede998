"""The training step that proves a layer's products, and its abstract inputs.

A compiled program shows which products run in low precision only if XLA
keeps all three products of every layer (forward, dgrad, wgrad) and cannot
fold the gradient's cast away. :func:`make_train_step` builds that step: it
returns the loss, ``dL/dx`` and the gradients of all variables, its loss is
``sum(y * r)`` with a random cotangent ``r`` passed as an argument (a plain
``sum()`` makes the cotangent all ones, and XLA folds the gradient's fp8 cast
away), and the variables (parameters, fp8 scales, amax histories) are
arguments, never constants. :func:`train_step_inputs` gives its arguments as
``ShapeDtypeStruct`` s, so nothing is run to build them. With ``optimizer``
the step also updates the parameters and merges the new fp8 state, as a
training loop's step does, so a compiled program shows what the update fuses
(the cast of a bfloat16 weight gradient to its float32 parameter, say).

Example:
  >>> import jax
  >>> import fp8_linen as fl
  >>> from fp8_linen.testing import train_step
  >>> model = fl.QDense(16)
  >>> variables, x, r = train_step.train_step_inputs(model, (4, 8))
  >>> x.shape, r.shape, str(r.dtype)
  ((4, 8), (4, 16), 'float32')
  >>> loss, dx, grads = jax.eval_shape(train_step.make_train_step(model), variables, x, r)
  >>> dx.shape, sorted(grads)
  ((4, 8), ['_overwrite_with_gradient', 'params'])
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from fp8_linen.core import numerics
from fp8_linen.core.lowering import target_backend
from fp8_linen.training import merge_owg

__all__ = ["LOSSES", "OPTIMIZERS", "make_train_step", "optimizer_of", "train_step_inputs",
           "steady_branch"]


LOSSES = {
    "linear": lambda y, r: jnp.sum(y * r),
    "mse": lambda y, r: 0.5 * jnp.sum(jnp.square(y - r)),
}
"""The losses :func:`make_train_step` offers, of float32 ``y`` (output) and ``r`` (target)."""

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(1e-3),
    "adam": lambda: optax.adam(1e-3),
}
"""Optimizers :func:`make_train_step` can update the parameters with, by name (factories)."""


def optimizer_of(optimizer) -> optax.GradientTransformation | None:
  """``optimizer`` as an optax transformation: a name in :data:`OPTIMIZERS`, one, or ``None``.

  Raises:
    ValueError: for a name not in :data:`OPTIMIZERS` or anything else that is
      not an optax ``GradientTransformation``.
  """
  if optimizer is None or isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  if isinstance(optimizer, str) and optimizer in OPTIMIZERS:
    return OPTIMIZERS[optimizer]()
  raise ValueError(f"optimizer must be None, one of {sorted(OPTIMIZERS)} or an optax "
                   f"GradientTransformation, got {optimizer!r}")


def steady_branch():
  """Traces a step as :func:`fp8_linen.split_first_step`'s steady branch (a context manager).

  The branch a wrapped step runs once every amax history holds an
  observation, compiled alone: what it moves every step but the first.
  For compile-only measurement only; inside it a history without an
  observation gives the stored scale (the wrapper never runs it then).

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.testing import train_step
    >>> st = fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)))  # an empty history
    >>> with train_step.steady_branch():
    ...   y, _ = fl.fp8_dot_general(jnp.full((1, 2), 900.0), jnp.ones((2, 1)),
    ...                             (((1,), (0,)), ((), ())), input_state=st,
    ...                             kernel_state=st, output_grad_state=st)
    >>> y.tolist()  # the stored scale 1: 900 saturates at e4m3's 448
    [[896.0]]
  """
  return numerics.histories_observed()


def make_train_step(model, *, loss: str = "linear", optimizer=None) -> Callable:
  """The step that proves a model's products: ``step(variables, x, r) -> (loss, dx, grads)``.

  ``loss = sum(y * r)`` over the output leaves with ``r`` a random cotangent
  passed as an argument (not foldable by XLA); ``dx = dL/dx`` keeps the
  forward and dgrad products alive, ``grads`` (all variable collections: the
  params' gradients and the new fp8 state) the wgrad. For a non-floating ``x``
  (e.g. tokens) ``dx`` is None.

  With the linear loss the cotangent is ``r`` itself, so nothing orders the
  forward before the backward, which no real loss allows: a step that also
  updates the weights may then have XLA fuse forward work (a weight's amax)
  into the update. ``loss='mse'`` (``0.5 * sum((y - r)^2)``, cotangent
  ``y - r``) keeps the order a real loss imposes.

  With ``optimizer`` the step is ``step(variables, opt_state, x, r) -> (loss,
  dx, new_variables, new_opt_state)``: the optimizer updates ``params`` from
  their gradients and the fp8 state is merged (:func:`fp8_linen.merge_owg`),
  as ``fl.TrainState.apply_gradients`` does; ``opt_state`` is the optimizer's
  ``init`` of ``variables['params']``.

  Args:
    model: anything with ``apply(variables, x)`` (a Linen module or
      :func:`fp8_linen.quantize_model`'s wrapper).
    loss: ``'linear'`` or ``'mse'`` (:data:`LOSSES`).
    optimizer: ``None`` (the step returns the gradients), a name in
      :data:`OPTIMIZERS` or an optax ``GradientTransformation``.

  Returns:
    The (unjitted) step function.

  Raises:
    ValueError: for an unknown ``loss`` or ``optimizer``.
  """
  if loss not in LOSSES:
    raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
  loss_of = LOSSES[loss]
  tx = optimizer_of(optimizer)

  def loss_fn(variables, x, r):
    y = model.apply(variables, x)
    return sum(loss_of(a.astype(jnp.float32), b.astype(jnp.float32))
               for a, b in zip(jax.tree.leaves(y), jax.tree.leaves(r)))

  def step(variables, x, r):
    if jnp.issubdtype(jnp.result_type(x), jnp.floating):
      loss, (grads, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(variables, x, r)
    else:
      (loss, grads), dx = jax.value_and_grad(loss_fn)(variables, x, r), None
    return loss, dx, grads

  if tx is None:
    return step

  def train(variables, opt_state, x, r):
    loss, dx, grads = step(variables, x, r)
    updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return loss, dx, merge_owg({**variables, "params": params}, grads), opt_state

  return train


def train_step_inputs(model, x, dtype=None, platform: str = "gpu"):
  """Abstract ``(variables, x, r)`` for :func:`make_train_step`'s step.

  Args:
    model: anything with ``init(rng, x)`` and ``apply(variables, x)``.
    x: the input: a shape tuple, an array or a ``ShapeDtypeStruct``.
    dtype: the input dtype when ``x`` is a shape (default bfloat16).
    platform: the backend to trace ``init`` for (the variables do not depend
      on it today; the forms traced do).

  Returns:
    ``(variables, x, r)`` as ``ShapeDtypeStruct`` pytrees; ``r`` has the
    output's shapes, in float32.
  """
  if isinstance(x, (tuple, list)):
    x = jax.ShapeDtypeStruct(tuple(x), dtype or jnp.bfloat16)
  else:
    x = jax.ShapeDtypeStruct(x.shape, x.dtype)
  zeros = lambda s: jnp.zeros(s.shape, s.dtype)
  with target_backend(platform):
    variables = jax.eval_shape(lambda s: model.init(jax.random.key(0), zeros(s)), x)
    y = jax.eval_shape(lambda v, s: model.apply(v, zeros(s)), variables, x)
  r = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), y)
  return variables, x, r

