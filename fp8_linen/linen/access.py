"""The Linen side of :class:`~fp8_linen.families.VariableAccess`, and the Linen entry points.

:class:`LinenAccess` keeps a module's quantization state in the
``_overwrite_with_gradient`` collection (:data:`~fp8_linen.OWG`, the same
string as ``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``) at the module's
path, its learned quantizer values in ``params``, one
:class:`~fp8_linen.core.uses.Chains` per ``apply`` (on the root scope),
conversion records in the :data:`SERVED` collection, and reads served
arrays from the module's own ``params``. Variables are declared at ``init``.

:func:`quantized_dot_general_on`, :func:`quantized_einsum_on` and
:func:`quantized_conv_on` run any registered recipe's product on a Linen
module: every Linen layer and :func:`fp8_linen.quantize_model` call them.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> import fp8_linen as fl
  >>> class Scores(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, q, k):
  ...     return fl.quantized_einsum_on(self, 'bqd,bkd->bqk', q, k, fl.current_scaling())
  >>> y, v = Scores().init_with_output(jax.random.key(0), jnp.ones((1, 3, 4)), jnp.ones((1, 5, 4)))
  >>> y.shape, sorted(v[fl.OWG])[:2]
  ((1, 3, 5), ['input_amax_history', 'input_scale'])
"""

from __future__ import annotations

import warnings
from typing import Mapping

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes

from fp8_linen.core import lowering, serve, uses
from fp8_linen.core.owg import OWG
from fp8_linen.core.serve import ServedRecord
from fp8_linen.families import dispatch
from fp8_linen.families.access import VariableAccess
from fp8_linen.families.conversion import finds_weights

__all__ = ["SERVED", "RECORD", "records", "LinenAccess", "weights", "quantized_dot_general_on",
           "quantized_ragged_dot_on", "quantized_einsum_on", "quantized_conv_on", "promote_dtype"]

SERVED = "fp8_linen_served"  # the collection 'convert' mode writes
RECORD = "conversion_record"  # a product's record in it (names are unique across collections)


def records(tree, kind, path=()):
  """``(path, record)`` of every :data:`RECORD` of type ``kind`` a run wrote in ``tree``."""
  for k, v in tree.items():
    if k == RECORD and isinstance(v, kind):
      yield path, v
    elif isinstance(v, Mapping):
      yield from records(v, kind, path + (k,))

_CHAINS_ATTR = "_fp8_linen_chains"
_WARNED_ATTR = "_fp8_linen_warned_no_state"


class LinenAccess(VariableAccess):
  """A Linen module's variables (inside one of its methods), for the recipe families.

  Args:
    module: the bound Linen module that owns the variables.
    weights_of: for a product inside a module's own code (``quantize_model``'s
      per-call-site state), the scope of the module whose method runs it: a
      conversion looks for its right operand among that scope's own
      ``params`` (:func:`weights`).
  """

  def __init__(self, module: nn.Module, weights_of=None):
    self.module = module
    self.weights_of = weights_of

  @property
  def path(self) -> str:
    return "/".join(self.module.path) or "<root>"

  @property
  def owner(self) -> str:
    return type(self.module).__name__

  @property
  def initializing(self) -> bool:
    return self.module.is_initializing()

  def state(self, name: str, fill: float, shape: tuple):
    """The OWG variable ``name``, declared filled with ``fill``.

    The initial value is a constant array, never a tracer: a layer first
    called inside a raw ``jax.jit`` / ``jax.checkpoint`` in a module method
    (MaxText wraps its decoder layers so) declares its state inside that
    trace, and a traced initial value would leak out of it with the
    variables.

    Without the OWG collection (``model.apply({'params': params}, x)``, e.g.
    evaluating a float checkpoint) the initial value is used instead of
    raising flax's ``ScopeCollectionNotFound``: every scale then comes from
    the current batch, and a warning (once per module and apply) says what
    to pass to keep the state.

    Raises:
      fp8_linen.core.uses.StateUseError: ``init`` runs the layer inside a
        lifted transform that does not carry the OWG collection
        (``nn.scan``, ``nn.vmap``, ``nn.RNN`` without it among their
        variable collections).
    """
    module = self.module

    def init(shape, dtype):
      return uses.constant(shape, fill, dtype)
    if module.has_variable(OWG, name) or module.is_mutable_collection(OWG):
      # Read inside a shard_map body, state closed over from outside is made
      # replicated on the body's mesh (JAX refuses the outer mesh's type there).
      return lowering.in_context(module.variable(OWG, name, init, shape, jnp.float32).value)
    if module.is_initializing():
      raise uses.StateUseError(
          f"fp8_linen: {self.path} is initialised inside a lifted "
          f"transform that does not carry the '{OWG}' collection, so its quantization state "
          "would be lost. Add it to the transform's collections: a state per iteration "
          "nn.scan(..., variable_axes={'params': 0, fl.OWG: 0}) (nn.RNN and nn.vmap take "
          "variable_axes too), or one shared state variable_axes={fl.OWG: None} for nn.vmap.")
    warned = module.scope.root.__dict__.setdefault(_WARNED_ATTR, set())
    if tuple(module.scope.path) not in warned:
      warned.add(tuple(module.scope.path))
      warnings.warn(
          f"fp8_linen: {self.path} found no '{OWG}' collection in the "
          "variables: its quantization state starts fresh in every call (scales from the "
          f"current batch). Pass model.init's full variables ({{'params': ..., '{OWG}': ...}}) "
          "to keep it; to start fp8 training from a float checkpoint use "
          "fl.load_float_state.", stacklevel=3)
    return init(shape, jnp.float32)

  def param(self, name: str, init, shape: tuple, *, from_data: bool = False):
    """The ``params`` variable ``name``, initialised at ``init`` (from its data)."""
    del from_data  # init sees the data
    # The shape is passed as flax's initializers take it: code that wraps
    # nn.Module.param (gemma requires a shape) sees an ordinary declaration.
    # A wrapper may forward a dtype; a learned step stays float32 whatever it asks.
    return self.module.param(name, lambda _, shape, dtype=None: init(shape), shape)

  def stored(self, name: str):
    value = self.module.get_variable(OWG, name)
    return self.module.get_variable("params", name) if value is None else value

  def chained(self, key: str, fn, state_leaf=None):
    """Runs ``fn(chain)`` as the next use of ``(module path, key)`` in this ``apply``.

    Uses under ``vmap``, in nested traces and inside loops are handled as
    :mod:`fp8_linen.core.uses` describes.

    Raises:
      fp8_linen.core.uses.StateUseError: the state's updates would be summed
        (a loop over the layer with its state from outside the loop, or calls
        in two traces that do not nest).
    """
    module = self.module
    chains = module.scope.root.__dict__.setdefault(_CHAINS_ATTR, uses.Chains())
    return chains.run((tuple(module.scope.path), key), self.path, state_leaf, fn,
                      initializing=module.is_initializing())

  def record(self, record: ServedRecord) -> None:
    self.module.put_variable(SERVED, RECORD, record)

  def served_arrays(self) -> dict:
    """The arrays of the module's own ``params`` scope (its children excluded)."""
    params = self.module.variables.get("params", {})
    return {k: v for k, v in params.items() if not isinstance(v, Mapping)}

  def _kernels(self):
    """``(at, kernel)`` of the module (0) and its parent (1), those that hold a ``kernel``."""
    for at, owner in ((0, self.module), (1, getattr(self.module, "parent", None))):
      if isinstance(owner, nn.Module) and owner.scope is not None and \
          owner.has_variable("params", "kernel"):
        yield at, owner.get_variable("params", "kernel")

  def kernel_for(self, rhs):
    """The ``kernel`` parameter of the module (0) or its parent (1) of ``rhs``'s size.

    :class:`~fp8_linen.Fp8DotGeneral` runs the product of its parent's
    ``kernel``; layers run their own. A product in a module's own code is
    matched, in a conversion, against that module's weights
    (:func:`~fp8_linen.core.serve.match_weight`).
    """
    if self.weights_of is not None:
      if not finds_weights():
        return None, None
      return serve.match_weight(
          [v for _, v in weights(self.weights_of.variables().get("params", {}))], rhs)
    size = jnp.size(rhs)
    for at, p in self._kernels():
      if getattr(p, "size", None) == size:
        return at, p
    return None, None


def weights(params: Mapping) -> list:
  """``(name, array)`` of a scope's own parameters (its children's left out), by name."""
  return sorted(((k, v) for k, v in params.items() if not isinstance(v, Mapping)),
                key=lambda kv: kv[0])


def promote_dtype(*args, dtype=None, inexact=True) -> list:
  """flax's ``promote_dtype``, remembering the parameter the kernel (second) was cast from.

  The default of the library's dense layers: their product may then read a
  float32 kernel itself (:func:`~fp8_linen.families.dispatch.kernel_params`).
  The values are flax's.

  Example:
    >>> import jax.numpy as jnp
    >>> x, w = promote_dtype(jnp.ones(2), jnp.ones(2, jnp.float32), dtype=jnp.bfloat16)
    >>> w.dtype
    dtype(bfloat16)
  """
  out = linen_dtypes.promote_dtype(*args, dtype=dtype, inexact=inexact)
  if len(args) > 1:
    dispatch.remember_kernel_param(out[1], args[1])
  return out


def quantized_dot_general_on(module: nn.Module, lhs, rhs, dimension_numbers, recipe,
                             out_dtype=None, key: str = "dot"):
  """Runs ``recipe``'s quantized ``dot_general`` on ``module``'s state.

  Args:
    module: the Linen module that owns the state (inside one of its methods).
    lhs: the ``input`` operand.
    rhs: the ``kernel`` operand.
    dimension_numbers: as for ``lax.dot_general``.
    recipe: any recipe in :mod:`fp8_linen.families.table`.
    out_dtype: output dtype (default: the result type of the operands).
    key: chain key (uses of one state in a step with one key are linked).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> class Proj(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     w = self.param('kernel', nn.initializers.lecun_normal(), (x.shape[-1], 3))
    ...     return fl.quantized_dot_general_on(self, x, w, (((1,), (0,)), ((), ())),
    ...                                        fl.int8_lsq())
    >>> v = Proj().init(jax.random.key(0), jax.random.normal(jax.random.key(1), (4, 5)))
    >>> sorted(v['params'])
    ['input_step', 'kernel', 'kernel_step']
  """
  return dispatch.dot_general(LinenAccess(module), lhs, rhs, dimension_numbers, recipe,
                              out_dtype, key)


def quantized_ragged_dot_on(module: nn.Module, lhs, rhs, group_sizes, recipe, out_dtype=None,
                            key: str = "ragged"):
  """Runs ``recipe``'s quantized grouped GEMM (``jax.lax.ragged_dot``) on ``module``'s state.

  See :func:`fp8_linen.families.dispatch.ragged_dot`.
  """
  return dispatch.ragged_dot(LinenAccess(module), lhs, rhs, group_sizes, recipe, out_dtype, key)


def quantized_einsum_on(module: nn.Module, equation: str, lhs, rhs, recipe, out_dtype=None,
                        key: str = "dot"):
  """Runs a two-operand einsum as one quantized ``dot_general`` on ``module``'s state.

  See :func:`fp8_linen.families.einsum` (broadcast size-1 axes, such as the
  single key head of multi-query attention, become free GEMM dimensions).
  """
  return dispatch.einsum(LinenAccess(module), equation, lhs, rhs, recipe, out_dtype, key)


def quantized_conv_on(module: nn.Module, lhs, rhs, conv_kwargs: dict, recipe, out_dtype=None,
                      key: str = "conv"):
  """Runs ``recipe``'s quantized convolution on ``module``'s state.

  ``conv_kwargs`` as for ``lax.conv_general_dilated``; raises a ``TypeError``
  for a recipe without a convolution.
  """
  return dispatch.conv(LinenAccess(module), lhs, rhs, conv_kwargs, recipe, out_dtype, key)
