"""Where an NNX layer keeps its quantization state, and how its uses are linked.

The state of a layer (fp8: ``<role>_scale`` ``(1,)`` and
``<role>_amax_history`` ``(history_length,)`` for the roles ``input``,
``kernel``, ``output_grad``; integer STE: ``input_range`` ``(2,)``) is held in
:class:`QuantState` variables, under the same names as the Linen layers' OWG
collection. A :class:`QuantState` is never written during a forward pass: the
layers read it, hand it to the functional core ops, and the ops return the new
state as its *gradient*. Differentiating with respect to
``(nnx.Param, QuantState)`` therefore yields the new state, which
:class:`fp8_linen.nnx.Optimizer` writes over the old one after the optimizer
step. Nothing traced is ever stored in a module.

Several uses of one layer in a step are linked with :func:`chained` (the core
ops' chain arrays): only the first returns the state, built from the max of
all uses, so autodiff's sum of the cotangents is that state.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> layer = fl.nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  >>> sorted(nnx.state(layer, fl.nnx.QuantState))[:2]
  ['input_amax_history', 'input_scale']
"""

from __future__ import annotations

import weakref

import jax.numpy as jnp
from flax import nnx

from fp8_linen.core import lowering, uses
from fp8_linen.core.owg import OWG, ROLES, RoleState
from fp8_linen.recipes.fp8 import ScalingConfig

__all__ = ["QuantState", "DIFF", "ROLES", "declare_role", "read_role", "chained"]


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


def _register_owg_collection() -> None:
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


_register_owg_collection()


def declare_role(module: nnx.Module, role: str, cfg: ScalingConfig) -> None:
  """Creates the ``<role>_scale``/``<role>_amax_history`` variables on ``module``."""
  setattr(module, f"{role}_scale", QuantState(jnp.ones((1,), jnp.float32)))
  setattr(module, f"{role}_amax_history",
          QuantState(jnp.zeros((cfg.history_length,), jnp.float32)))


def read_role(module: nnx.Module, role: str, cfg: ScalingConfig) -> RoleState:
  """The :class:`~fp8_linen.RoleState` of ``role`` on ``module`` (shapes checked).

  Raises:
    ValueError: if the stored state does not have the shapes ``cfg`` asks for
      (e.g. loaded from a checkpoint written with another history length).
  """
  scale = getattr(module, f"{role}_scale")[...]
  hist = getattr(module, f"{role}_amax_history")[...]
  if scale.shape != (1,):
    raise ValueError(f"{type(module).__name__}: {role}_scale has shape {scale.shape}, "
                     "expected (1,)")
  if hist.shape != (cfg.history_length,):
    raise ValueError(
        f"{type(module).__name__}: {role}_amax_history has shape {hist.shape} but the recipe "
        f"asks for history_length={cfg.history_length}; load state written with the same "
        "recipe or resize the histories")
  return RoleState(lowering.in_context(scale), lowering.in_context(hist))


# module -> its chains. Held outside the module (weakly, so it goes with the
# module: NNX transforms run on fresh copies of the module, which disappear
# with their trace) so no chain value ever becomes module state.
_CHAINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def chained(module: nnx.Module, key: str, fn, state_leaf=None):
  """Runs ``fn(chain) -> (out, chain_out)``, linking uses of one state in a step.

  The first call for ``(module, key)`` passes ``chain=None`` (it returns the
  state update); later calls pass the previous ``chain_out``, so their
  observations are folded (by max) into the first use's update instead of
  being summed by autodiff. Uses under ``vmap``, in nested traces and inside
  loops are handled as :mod:`fp8_linen.core.uses` describes.

  Args:
    module: the layer that owns the state.
    key: distinguishes several states of one layer.
    fn: the op, ``fn(chain) -> (out, chain_out)``.
    state_leaf: one array of the state as the op reads it; ``None`` skips
      the loop check.

  Raises:
    fp8_linen.core.uses.StateUseError: the state's updates would be summed.
  """
  chains = _CHAINS.get(module)
  if chains is None:
    chains = _CHAINS[module] = uses.Chains()
  return chains.run(key, type(module).__name__, state_leaf, fn)
