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
import jax.extend.core
import jax.numpy as jnp

from fp8_linen.core.owg import OWG, ROLES, RoleState
from fp8_linen.recipes.fp8 import ScalingConfig

__all__ = ["OWG", "ROLES", "role_state", "chained", "with_role_states"]

_CHAINS_ATTR = "_fp8_linen_chains"


def role_state(module: nn.Module, role: str, cfg: ScalingConfig) -> RoleState:
  """Declares (or reads) the OWG variables of one role on ``module``.

  Args:
    module: the Linen module that owns the state (inside its ``@compact`` call).
    role: ``'input'``, ``'kernel'`` or ``'output_grad'`` (or any other name).
    cfg: the role's scaling config (gives the history length).

  Returns:
    The :class:`~fp8_linen.RoleState` read from the variables.

  Raises:
    ValueError: if stored variables do not have the shapes ``cfg`` asks for
      (e.g. a checkpoint written with another history length).
  """
  scale = module.variable(OWG, f"{role}_scale", jnp.ones, (1,), jnp.float32)
  hist = module.variable(OWG, f"{role}_amax_history", jnp.zeros, (cfg.history_length,),
                         jnp.float32)
  if scale.value.shape != (1,):
    raise ValueError(f"{module.path}: {role}_scale has shape {scale.value.shape}, expected (1,)")
  if hist.value.shape != (cfg.history_length,):
    raise ValueError(
        f"{'/'.join(module.path)}: {role}_amax_history has shape {hist.value.shape} but the "
        f"recipe asks for history_length={cfg.history_length}; load a checkpoint written "
        "with the same recipe or resize the histories")
  return RoleState(scale.value, hist.value)


def _trace_state():
  return jax.extend.core.get_opaque_trace_state(convention="flax")


def chained(module: nn.Module, key: str, fn):
  """Runs ``fn(chain) -> (out, chain_out)``, linking uses of one state in a step.

  The first call for ``(module path, key)`` in an ``apply`` passes ``chain=None``
  (it returns the state update); later calls in the same trace pass the
  previous ``chain_out`` so their observations are folded (by max) into the
  first use's update instead of being summed by autodiff.

  A use in a different JAX trace than the first (e.g. the same module called
  inside and outside ``nn.remat``) cannot be linked; it then also returns a
  state update, autodiff sums the two, and a warning says so.
  """
  store = module.scope.root.__dict__.setdefault(_CHAINS_ATTR, {})
  slot = (tuple(module.scope.path), key)
  trace = _trace_state()
  prev = store.get(slot)
  chain = None
  if prev is not None:
    prev_trace, prev_chain = prev
    if prev_trace == trace:
      chain = prev_chain
    elif not module.is_initializing():
      warnings.warn(
          f"fp8_linen: {'/'.join(slot[0]) or '<root>'} is used in two different JAX traces "
          "in one step (e.g. inside and outside a lifted transform); its fp8 state updates "
          "cannot be linked and will be summed. Call it within one transform.",
          stacklevel=3)
  out, chain_out = fn(chain)
  store[slot] = (trace, chain_out)
  return out


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
  return chained(module, key, lambda chain: op(states, chain))
