"""Where a Linen module keeps its quantization state, and how its uses are linked.

The fp8 state of a module lives in the ``_overwrite_with_gradient`` collection
(:data:`OWG`, the same string as ``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``)
under flax's names: ``<role>_scale`` (shape ``(1,)``) and
``<role>_amax_history`` (``(history_length,)``), float32, for the roles
``input``, ``kernel`` and ``output_grad``.

:func:`with_role_states` is the one way a layer runs a stateful op: declare
the roles' state on the module, then run the op with the chain that links
this use to earlier uses of the same state in the step (:func:`chained`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> v = fl.QDense(features=4).init(jax.random.key(0), jnp.ones((2, 3)))
  >>> sorted(v[fl.OWG])[:2]
  ['input_amax_history', 'input_scale']
"""

from __future__ import annotations

import warnings
from typing import Callable, Mapping

import flax.linen as nn
import jax.numpy as jnp

from fp8_linen.core import lowering, uses
from fp8_linen.core.owg import OWG, ROLES, RoleState
from fp8_linen.recipes.fp8 import ScalingConfig

__all__ = ["OWG", "ROLES", "role_state", "owg_value", "chained", "with_role_states"]

_CHAINS_ATTR = "_fp8_linen_chains"
_WARNED_ATTR = "_fp8_linen_warned_no_state"


def role_state(module: nn.Module, role: str, cfg: ScalingConfig) -> RoleState:
  """Declares (or reads) the OWG variables of one role on ``module``.

  Args:
    module: the Linen module that owns the state (inside its ``@compact`` call).
    role: ``'input'``, ``'kernel'`` or ``'output_grad'`` (or any other name).
    cfg: the role's scaling config (gives the history length).

  Returns:
    The :class:`~fp8_linen.RoleState` read from the variables.

  Without the OWG collection (``model.apply({'params': params}, x)``, e.g.
  evaluating a float checkpoint) the state is the initial one (unit scale,
  empty history): every scale then comes from the current batch, and a
  warning says what to pass to keep the state.

  Raises:
    ValueError: if stored variables do not have the shapes ``cfg`` asks for
      (e.g. a checkpoint written with another history length).
  """
  scale = owg_value(module, f"{role}_scale", 1.0, (1,))
  hist = owg_value(module, f"{role}_amax_history", 0.0, (cfg.history_length,))
  where = "/".join(module.path) or "<root>"
  if scale.shape != (1,):
    raise ValueError(f"{where}: {role}_scale has shape {scale.shape}, expected (1,)")
  if hist.shape != (cfg.history_length,):
    raise ValueError(
        f"{where}: {role}_amax_history has shape {hist.shape} but the recipe asks for "
        f"history_length={cfg.history_length}; load a checkpoint written with the same recipe "
        "or resize the histories: fl.resize_histories(variables, recipe) (or TrainState)")
  return RoleState(lowering.in_context(scale), lowering.in_context(hist))


def owg_value(module: nn.Module, name: str, fill: float, shape: tuple) -> jnp.ndarray:
  """The value of OWG variable ``name`` of ``module``, declared filled with ``fill``.

  The initial value is a constant array, never a tracer: a layer first
  called inside a raw ``jax.jit`` / ``jax.checkpoint`` in a module method
  (MaxText wraps its decoder layers so) declares its state inside that trace,
  and a traced initial value would leak out of it with the variables.

  When the variables have no such entry and the collection is not mutable
  (``apply`` with ``{'params': ...}`` only) the initial value is used instead of
  raising flax's ``ScopeCollectionNotFound``, with a warning.

  Raises:
    fp8_linen.core.uses.StateUseError: ``init`` runs the layer inside a lifted
      transform that does not carry the OWG collection (``nn.scan``,
      ``nn.vmap``, ``nn.RNN`` without it among their variable collections).
  """
  def init(shape, dtype):
    return uses.constant(shape, fill, dtype)
  if module.has_variable(OWG, name) or module.is_mutable_collection(OWG):
    return module.variable(OWG, name, init, shape, jnp.float32).value
  if module.is_initializing():
    raise uses.StateUseError(
        f"fp8_linen: {'/'.join(module.path) or '<root>'} is initialised inside a lifted "
        f"transform that does not carry the '{OWG}' collection, so its quantization state "
        "would be lost. Add it to the transform's collections: a state per iteration "
        "nn.scan(..., variable_axes={'params': 0, fl.OWG: 0}) (nn.RNN and nn.vmap take "
        "variable_axes too), or one shared state variable_axes={fl.OWG: None} for nn.vmap.")
  warned = module.scope.root.__dict__.setdefault(_WARNED_ATTR, set())
  if tuple(module.scope.path) not in warned:  # once per module and apply
    warned.add(tuple(module.scope.path))
    warnings.warn(
        f"fp8_linen: {'/'.join(module.path) or '<root>'} found no '{OWG}' collection in the "
        "variables: its quantization state starts fresh in every call (scales from the "
        f"current batch). Pass model.init's full variables ({{'params': ..., '{OWG}': ...}}) "
        "to keep it; to start fp8 training from a float checkpoint use "
        "fl.load_float_state.", stacklevel=3)
  return init(shape, jnp.float32)


def chained(module: nn.Module, key: str, fn, state_leaf=None):
  """Runs ``fn(chain) -> (out, chain_out)``, linking uses of one state in a step.

  The first call for ``(module path, key)`` in an ``apply`` passes ``chain=None``
  (it returns the state update); later calls pass the previous ``chain_out``
  so their observations are folded (by max) into the first use's update
  instead of being summed by autodiff. Uses under ``vmap``, in nested traces
  and inside loops are handled as :mod:`fp8_linen.core.uses` describes.

  Args:
    module: the module that owns the state.
    key: distinguishes several states of one module.
    fn: the op, ``fn(chain) -> (out, chain_out)``.
    state_leaf: one array of the state as the op reads it (tells where the
      state lives relative to this call); ``None`` skips that check.

  Raises:
    fp8_linen.core.uses.StateUseError: the state's updates would be summed
      (a loop over the layer with its state from outside the loop, or calls
      in two traces that do not nest).
  """
  chains = module.scope.root.__dict__.setdefault(_CHAINS_ATTR, uses.Chains())
  where = "/".join(module.path) or "<root>"
  return chains.run((tuple(module.scope.path), key), where, state_leaf, fn,
                    initializing=module.is_initializing())


def with_role_states(module: nn.Module, key: str, cfgs: Mapping[str, ScalingConfig],
                     op: Callable):
  """Declares the roles' state on ``module`` and runs ``op`` on it, chained.

  Args:
    module: the Linen module that owns the state.
    key: the chain key (uses with one key on one module are linked).
    cfgs: role name -> :class:`~fp8_linen.ScalingConfig`, in the op's order.
    op: ``op(states, chain) -> (out, chain_out)`` with ``states`` the tuple of
      :class:`~fp8_linen.RoleState` in ``cfgs``' order.

  Returns:
    ``out``.
  """
  states = tuple(role_state(module, role, cfg) for role, cfg in cfgs.items())
  return chained(module, key, lambda chain: op(states, chain),
                 state_leaf=states[0].scale if states else None)
