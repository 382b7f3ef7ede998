"""The quantization state of an NNX layer: :class:`QuantState`.

The state of a layer (fp8: ``<role>_scale`` ``(1,)`` and
``<role>_amax_history`` ``(history_length,)`` for the roles ``input``,
``kernel``, ``output_grad``; integer STE: ``input_range`` ``(2,)``) is held in
:class:`QuantState` variables, under the same names as the Linen layers' OWG
collection. A :class:`QuantState` is never written during a forward pass: the
layers read it, hand it to the functional core ops, and the ops return the new
state as its *gradient*. Differentiating with respect to
``(nnx.Param, QuantState)`` (:data:`DIFF`) therefore yields the new state,
which :class:`fp8_linen.nnx.Optimizer` writes over the old one after the
optimizer step. (How a layer declares and reads it:
:mod:`fp8_linen.nnx.access`.)

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> layer = fl.nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  >>> sorted(nnx.state(layer, fl.nnx.QuantState))[:2]
  ['input_amax_history', 'input_scale']
"""

from __future__ import annotations

from flax import nnx

from fp8_linen.core.owg import OWG

__all__ = ["QuantState", "DIFF", "register_owg_collection"]


class QuantState(nnx.Variable):
  """Quantization state (scales, amax histories, observer ranges) of an NNX layer.

  Its own variable type, so ``nnx.state(model, QuantState)`` selects it, an
  ``nnx.Optimizer(..., wrt=nnx.Param)`` never optimises it, and checkpoints
  save it with the parameters. Its "gradient" is its new value.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> fl.nnx.QuantState(jnp.ones((1,)))[...].tolist()
    [1.0]
  """


# What to differentiate with respect to: the parameters, and the state whose
# gradient is its new value.
DIFF = (nnx.Param, QuantState)


def register_owg_collection() -> None:
  """Maps the Linen OWG collection to :class:`QuantState` in ``flax.nnx.bridge``.

  Both hold the same thing under the same protocol (the gradient is the new
  value), so a Linen fp8 layer wrapped in ``nnx.bridge.ToNNX`` exposes its state
  as :class:`QuantState` and trains with :func:`~fp8_linen.nnx.value_and_grad`
  and :class:`~fp8_linen.nnx.Optimizer` unchanged (and an ``fl.nnx`` layer
  wrapped in ``ToLinen`` puts its state in the OWG collection). Without this,
  the bridge invents a plain ``Variable`` subclass named after the collection,
  which no NNX optimizer would write back. A type the bridge already invented
  is replaced; a type someone registered on purpose is left alone.
  """
  cache = nnx.variablelib.VariableTypeCache
  current = cache.get(OWG)
  if current is None or (current is not QuantState and current.__name__ == OWG):
    nnx.register_variable_name(OWG, QuantState, overwrite=True)

