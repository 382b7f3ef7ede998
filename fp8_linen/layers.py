"""Flax Linen layers on top of :mod:`fp8_linen.ops`.

The fp8 state of a layer lives in the ``_overwrite_with_gradient`` collection
(:data:`OWG`, the same string as ``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``)
under flax's names: ``input_scale``, ``input_amax_history``, ``kernel_scale``,
``kernel_amax_history``, ``output_grad_scale``, ``output_grad_amax_history``.
Scales have shape ``(1,)``, histories ``(history_length,)``, both float32.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> layer = fl.QDense(features=4)
  >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> sorted(variables)
  ['_overwrite_with_gradient', 'params']
  >>> sorted(variables['params'])
  ['bias', 'kernel']
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
from flax.linen import fp8_ops

from fp8_linen import ops
from fp8_linen.recipes import Fp8Recipe, ScalingConfig

__all__ = ["OWG", "ROLES", "role_state", "chained", "register_dot_general",
           "quantized_dot_general_on", "Fp8DotGeneral", "QDense"]

OWG: str = fp8_ops.OVERWRITE_WITH_GRADIENT
ROLES = ("input", "kernel", "output_grad")

_CHAINS_ATTR = "_fp8_linen_chains"


def role_state(module: nn.Module, role: str, cfg: ScalingConfig) -> ops.RoleState:
  """Declares (or reads) the OWG variables of one role on ``module``.

  Args:
    module: the Linen module that owns the state (inside its ``@compact`` call).
    role: ``'input'``, ``'kernel'`` or ``'output_grad'`` (or any other name).
    cfg: the role's scaling config (gives the history length).

  Returns:
    The :class:`~fp8_linen.ops.RoleState` read from the variables.

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
  return ops.RoleState(scale.value, hist.value)


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


def fp8_dot_general_on(module: nn.Module, lhs, rhs, dimension_numbers, recipe: Fp8Recipe,
                       out_dtype=None, key: str = "dot"):
  """Applies :func:`~fp8_linen.ops.fp8_dot_general` with ``module``'s OWG state."""
  states = [role_state(module, r, recipe.role(r)) for r in ROLES]
  return chained(module, key, lambda chain: ops.fp8_dot_general(
      lhs, rhs, dimension_numbers, input_state=states[0], kernel_state=states[1],
      output_grad_state=states[2], recipe=recipe, out_dtype=out_dtype, chain=chain))


# recipe type -> fn(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key) -> out
_DOT_GENERAL_IMPLS: dict[type, Callable] = {}


def register_dot_general(recipe_type: type, impl: Callable) -> None:
  """Registers how layers run a ``dot_general`` for recipes of ``recipe_type``.

  ``impl(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key)`` declares
  whatever state it needs on ``module`` and returns the product. Every layer
  (``QDense``, ``Fp8DotGeneral``, ...) goes through this table, so a new recipe
  family works in all of them.
  """
  _DOT_GENERAL_IMPLS[recipe_type] = impl


def quantized_dot_general_on(module: nn.Module, lhs, rhs, dimension_numbers, recipe,
                             out_dtype=None, key: str = "dot"):
  """Runs the quantized ``dot_general`` that ``recipe``'s type registered."""
  for klass in type(recipe).__mro__:
    if klass in _DOT_GENERAL_IMPLS:
      return _DOT_GENERAL_IMPLS[klass](module, lhs, rhs, dimension_numbers, recipe,
                                       out_dtype, key)
  raise TypeError(f"{type(recipe).__name__} is not a recipe; known recipe types: "
                  f"{sorted(t.__name__ for t in _DOT_GENERAL_IMPLS)}")


register_dot_general(Fp8Recipe, fp8_dot_general_on)


class Fp8DotGeneral(nn.Module):
  """A ``dot_general`` with fp8 state, for flax's injection points.

  Pass it as ``dot_general_cls`` to ``nn.Dense``/``nn.DenseGeneral``/``nn.Einsum``
  (``functools.partial(Fp8DotGeneral, recipe=...)`` to choose a recipe). The
  state lives in this submodule's scope (``Dense_0/Fp8DotGeneral_0/...``).

  Attributes:
    recipe: the :class:`~fp8_linen.Fp8Recipe`.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> layer = nn.Dense(4, dot_general_cls=fl.Fp8DotGeneral)
    >>> v = layer.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> 'kernel_scale' in v[fl.OWG]['Fp8DotGeneral_0']
    True
  """

  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision  # fp8 GEMMs run at DEFAULT precision (fast accumulation).
    return quantized_dot_general_on(self, lhs, rhs, dimension_numbers, self.recipe,
                                    out_dtype=preferred_element_type)


class QDense(nn.Dense):
  """Drop-in for ``nn.Dense`` whose matmul runs in fp8.

  Same arguments and the same ``params`` tree (``kernel``, ``bias``) as
  ``nn.Dense``, so an ``nn.Dense`` checkpoint loads as is; the fp8 state is added
  in the :data:`OWG` collection of the same path. ``precision`` is accepted for
  compatibility; fp8 GEMMs always use DEFAULT precision. ``dot_general`` and
  ``dot_general_cls`` must stay ``None`` (the layer brings its own).

  Attributes:
    recipe: the :class:`~fp8_linen.Fp8Recipe` (delayed scaling by default).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> y, _ = fl.QDense(3).init_with_output(jax.random.key(0), jnp.ones((2, 5)))
    >>> y.shape
    (2, 3)
  """

  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs: Any) -> Any:
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError("QDense brings its own fp8 dot_general; leave dot_general and "
                       "dot_general_cls as None (or use nn.Dense(dot_general_cls=Fp8DotGeneral))")
    if not isinstance(self.features, int) or self.features < 1:
      raise ValueError(f"QDense.features must be a positive int, got {self.features!r}")
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.floating):
      raise TypeError(f"QDense inputs must be floating, got dtype {inputs.dtype}")
    if inputs.ndim < 1:
      raise ValueError("QDense inputs must have at least one dimension")
    kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features),
                        self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = quantized_dot_general_on(self, inputs, kernel,
                                 (((inputs.ndim - 1,), (0,)), ((), ())), self.recipe,
                                 out_dtype=inputs.dtype)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y
