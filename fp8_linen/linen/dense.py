"""Drop-in fp8 twins of ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum``.

Each layer keeps its flax twin's arguments and ``params`` tree and runs its
product through :mod:`fp8_linen.linen.access` (the recipe families), so every
recipe works in it.
The fp8 state lives in the ``_overwrite_with_gradient`` collection at the
layer's own path. :class:`Fp8DotGeneral` serves flax's ``dot_general_cls``
injection point instead (state in a child scope), and :class:`Fp8Einsum` the
einsum hooks of flax's attention (``qk_attn_weights_einsum_cls``, ...).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> layer = fl.QEinsum(shape=(3, 4), einsum_str='btd,dh->bth')
  >>> y, v = layer.init_with_output(jax.random.key(0), jnp.ones((2, 5, 3)))
  >>> y.shape, sorted(v['params'])
  ((2, 5, 4), ['bias', 'kernel'])
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import module as nn_module

from fp8_linen.core.dims import einsum_plan
from fp8_linen.families import dispatch
from fp8_linen.families.table import check_recipe
from fp8_linen.linen.access import promote_dtype, quantized_dot_general_on, quantized_einsum_on
from fp8_linen.linen.flax_fp8 import continue_flax_state, flax_state_beside
from fp8_linen.linen.seam import Seam
from fp8_linen.recipes.fp8 import Fp8Recipe

__all__ = ["Fp8DotGeneral", "Fp8Einsum", "QDense", "QDenseGeneral", "QEinsum"]


def _check_inputs(owner: str, inputs) -> jnp.ndarray:
  inputs = jnp.asarray(inputs)
  if not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise TypeError(f"{owner}: inputs must be a floating array, got dtype {inputs.dtype}")
  return inputs


# The QDense/QDenseGeneral whose __call__ is running (read by _layer_dot_general).
_DOT = Seam("dot_general")


def _layer_dot_general(lhs, rhs, dimension_numbers, precision=None,
                       preferred_element_type=None, **unused):
  """The ``dot_general`` a :class:`QDense` / :class:`QDenseGeneral` hands to flax's body."""
  del precision, unused  # fp8 GEMMs run at DEFAULT precision.
  module, recipe = _DOT.current("dot_general")
  return quantized_dot_general_on(module, lhs, rhs, dimension_numbers, recipe,
                                  out_dtype=preferred_element_type)


class Fp8DotGeneral(nn.Module):
  """A quantized ``dot_general`` with its own state, for flax's injection points.

  Pass it as ``dot_general_cls`` to ``nn.Dense`` or ``nn.DenseGeneral``
  (``functools.partial(Fp8DotGeneral, recipe=...)`` to choose a recipe). The
  state lives in this submodule's scope (``Dense_0/Fp8DotGeneral_0/...``).
  flax 0.12's ``nn.Einsum`` has no ``dot_general_cls``: use
  :class:`QEinsum` in its place, and :class:`Fp8Einsum` for the einsum hooks
  of ``nn.MultiHeadDotProductAttention``.

  **Continuing flax's fp8 state.** In place of flax's
  ``Fp8DirectDotGeneralOp`` / ``Fp8DotGeneralOp`` / ``NANOOFp8DotGeneralOp``
  it continues a checkpoint they wrote: with no state of its own
  (``Fp8DotGeneral_<n>``) and the op's state beside it
  (``Fp8DirectDotGeneralOp_<n>``, ...), it reads and writes that state, in
  flax's history order, and warns once saying so; the first step quantizes
  with the trained scales. :func:`~fp8_linen.from_flax_fp8` moves such a
  state to this module's own path once (see :mod:`fp8_linen.linen.flax_fp8`).

  Attributes:
    recipe: any recipe in :mod:`fp8_linen.families.table`
      (:class:`~fp8_linen.Fp8Recipe` by default, which is flax's
      ``Fp8DirectDotGeneralOp`` recipe: delayed, max of a 1024-long history).

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
    check_recipe("Fp8DotGeneral", self.recipe)
    found = flax_state_beside(self)
    if found is not None:
      return continue_flax_state(self, found, lhs, rhs, dimension_numbers, self.recipe,
                                 out_dtype=preferred_element_type)
    return quantized_dot_general_on(self, lhs, rhs, dimension_numbers, self.recipe,
                                    out_dtype=preferred_element_type)


class Fp8Einsum(nn.Module):
  """A quantized two-operand einsum with its own state: flax's ``Fp8Einsum``, every recipe.

  Called as flax's ``nn.Fp8Einsum`` is, ``(eqn, lhs, rhs, precision=None,
  preferred_element_type=None)``, so it is the module to pass as
  ``qk_attn_weights_einsum_cls`` / ``attn_weights_value_einsum_cls`` to
  ``nn.MultiHeadDotProductAttention``. ``lhs`` is the ``input`` role and
  ``rhs`` the ``kernel`` role (in attention both are activations: they are
  quantized and differentiated alike); ``lhs`` is cast to ``rhs``'s dtype,
  as flax does. The equation runs as one quantized ``dot_general``
  (:func:`~fp8_linen.quantized_einsum_on`; ellipses and broadcast size-1
  axes allowed). The state keeps flax's names in this module's scope
  (``Fp8Einsum_<n>/<role>_scale``, ``<role>_amax_history``); a flax
  ``Fp8Einsum`` checkpoint is converted once with
  :func:`~fp8_linen.from_flax_fp8` (histories newest first).

  Attributes:
    recipe: any recipe in :mod:`fp8_linen.families.table` (fp8
      delayed, current, row-wise, MX, NVFP4; integer STE, LSQ).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8,
    ...     qk_attn_weights_einsum_cls=fl.Fp8Einsum, attn_weights_value_einsum_cls=fl.Fp8Einsum)
    >>> v = attn.init(jax.random.key(0), jnp.ones((1, 5, 8)))
    >>> sorted(v[fl.OWG])
    ['Fp8Einsum_0', 'Fp8Einsum_1']
  """

  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, eqn: str, lhs, rhs, precision=None, preferred_element_type=None):
    del precision  # fp8 GEMMs run at DEFAULT precision (fast accumulation).
    check_recipe("Fp8Einsum", self.recipe)
    if not isinstance(eqn, str):
      raise TypeError(f"Fp8Einsum: eqn={eqn!r} must be an einsum equation string")
    rhs = _check_inputs("Fp8Einsum (rhs)", rhs)
    # flax's Fp8Einsum computes in the right operand's dtype (its "weight").
    lhs = _check_inputs("Fp8Einsum (lhs)", lhs).astype(rhs.dtype)
    return quantized_einsum_on(self, eqn.replace(" ", ""), lhs, rhs, self.recipe,
                               out_dtype=preferred_element_type or rhs.dtype)


class QDense(nn.Dense):
  """Drop-in for ``nn.Dense`` whose matmul runs in fp8.

  Same arguments and the same ``params`` tree (``kernel``, ``bias``) as
  ``nn.Dense``, so an ``nn.Dense`` checkpoint loads as is; the fp8 state is added
  in the :data:`~fp8_linen.OWG` collection of the same path. ``precision`` is
  accepted for compatibility; fp8 GEMMs always use DEFAULT precision.
  ``dot_general`` and ``dot_general_cls`` must be left at their defaults (the
  layer brings its own through flax's ``dot_general`` field).

  Attributes:
    recipe: any recipe in :mod:`fp8_linen.families.table` (delayed
      fp8 scaling by default).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> y, _ = fl.QDense(3).init_with_output(jax.random.key(0), jnp.ones((2, 5)))
    >>> y.shape
    (2, 3)
  """

  dot_general: Any = _layer_dot_general
  promote_dtype: Any = promote_dtype
  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs: Any) -> Any:
    if self.dot_general is not _layer_dot_general or self.dot_general_cls is not None:
      raise ValueError("QDense brings its own fp8 dot_general; leave dot_general and "
                       "dot_general_cls at their defaults (or use nn.Dense(dot_general_cls="
                       "Fp8DotGeneral))")
    check_recipe("QDense", self.recipe)
    if not isinstance(self.features, int) or self.features < 1:
      raise ValueError(f"QDense.features must be a positive int, got {self.features!r}")
    inputs = _check_inputs("QDense", inputs)
    if inputs.ndim < 1:
      raise ValueError("QDense inputs must have at least one dimension")
    with _DOT.running((self, self.recipe)), dispatch.kernel_params():
      return super().__call__(inputs)


class QDenseGeneral(nn.DenseGeneral):
  """Drop-in for ``nn.DenseGeneral`` whose product runs in fp8.

  Same arguments (``features``, ``axis``, ``batch_dims`` as ints or tuples) and
  the same ``params`` tree (``kernel``, ``bias``) as ``nn.DenseGeneral``; the
  fp8 state is added in the :data:`~fp8_linen.OWG` collection at the same path.
  ``dot_general`` and ``dot_general_cls`` must be left at their defaults.

  Attributes:
    recipe: any recipe in :mod:`fp8_linen.families.table`
      (:class:`~fp8_linen.Fp8Recipe` by default).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> layer = fl.QDenseGeneral(features=(2, 3), axis=-1)
    >>> y, v = layer.init_with_output(jax.random.key(0), jnp.ones((4, 5)))
    >>> y.shape, v['params']['kernel'].shape
    ((4, 2, 3), (5, 2, 3))
  """

  dot_general: Any = _layer_dot_general
  promote_dtype: Any = promote_dtype
  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs):
    if self.dot_general is not _layer_dot_general or self.dot_general_cls is not None:
      raise ValueError("QDenseGeneral brings its own fp8 dot_general; leave dot_general and "
                       "dot_general_cls at their defaults (or use nn.DenseGeneral("
                       "dot_general_cls=Fp8DotGeneral))")
    check_recipe("QDenseGeneral", self.recipe)
    inputs = _check_inputs("QDenseGeneral", inputs)
    for name in ("features", "axis", "batch_dims"):
      val = getattr(self, name)
      vals = val if isinstance(val, Sequence) else (val,)
      if not all(isinstance(v, int) for v in vals):
        raise ValueError(f"QDenseGeneral.{name} must be an int or a tuple of ints, got {val!r}")
    axes = self.axis if isinstance(self.axis, Sequence) else (self.axis,)
    bdims = self.batch_dims if isinstance(self.batch_dims, Sequence) else (self.batch_dims,)
    for name, dims in (("axis", axes), ("batch_dims", bdims)):
      for d in dims:
        if not -inputs.ndim <= d < inputs.ndim:
          raise ValueError(f"QDenseGeneral.{name}={getattr(self, name)!r} is out of range for "
                           f"inputs of shape {inputs.shape}")
    with _DOT.running((self, self.recipe)), dispatch.kernel_params():
      return super().__call__(inputs)


class QEinsum(nn.Einsum):
  """Drop-in for ``nn.Einsum`` whose product runs in fp8.

  Same arguments (``shape``, ``einsum_str`` in the constructor or the call,
  batch dimensions and ``...`` allowed) and the same ``params`` tree as
  ``nn.Einsum``; the fp8 state is added in the :data:`~fp8_linen.OWG`
  collection at the same path. The equation is lowered to one ``dot_general``
  by :func:`einsum_plan` (the input is the ``input`` role, the kernel the
  ``kernel`` role).

  Attributes:
    recipe: the recipe (:class:`~fp8_linen.Fp8Recipe` by default).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> layer = fl.QEinsum(shape=(4, 2, 3), einsum_str='bd,dhk->bhk', use_bias=False)
    >>> y, _ = layer.init_with_output(jax.random.key(0), jnp.ones((5, 4)))
    >>> y.shape
    (5, 2, 3)
  """

  promote_dtype: Any = promote_dtype
  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs, einsum_str: str | None = None):
    check_recipe("QEinsum", self.recipe)
    einsum_str = nn_module.merge_param("einsum_str", self.einsum_str, einsum_str)
    if not isinstance(einsum_str, str):
      raise ValueError(f"QEinsum.einsum_str must be a string, got {einsum_str!r}")
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str:
      raise ValueError(f"QEinsum.einsum_str={einsum_str!r} must be explicit and include '->'")
    if einsum_str.count(",") != 1:
      raise ValueError(f"QEinsum.einsum_str={einsum_str!r} must have exactly two operands "
                       "(the input and the kernel)")
    inputs = _check_inputs("QEinsum", inputs)
    shape = tuple(self.shape)
    rhs_term = einsum_str.split("->")[0].split(",")[1]
    if "..." not in rhs_term and len(rhs_term) != len(shape):
      raise ValueError(f"QEinsum.shape={shape} has {len(shape)} dimensions but the kernel "
                       f"subscripts {rhs_term!r} of einsum_str name {len(rhs_term)}")
    kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
    # Validate the equation against the shapes before creating the bias.
    einsum_plan(einsum_str, inputs.shape, shape)
    bias = None
    if self.use_bias:
      bias_shape, bias_bshape = self._get_bias_shape(einsum_str, inputs, kernel)
      bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
    with dispatch.kernel_params():
      inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
      y = quantized_einsum_on(self, einsum_str, inputs, kernel, self.recipe,
                              out_dtype=self.preferred_element_type or inputs.dtype)
    if bias is not None:
      y += jnp.reshape(bias, bias_bshape)
    return y
