"""``QConv``: drop-in fp8 twin of ``nn.Conv``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> conv = fl.QConv(features=4, kernel_size=(3, 3))
  >>> y, v = conv.init_with_output(jax.random.key(0), jnp.ones((1, 8, 8, 3)))
  >>> y.shape, sorted(v['params'])
  ((1, 8, 8, 4), ['bias', 'kernel'])
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fp8_linen.core.conv import conv_kwargs_from
from fp8_linen.families.table import check_recipe
from fp8_linen.linen.access import quantized_conv_on
from fp8_linen.linen.seam import Seam
from fp8_linen.recipes.fp8 import Fp8Recipe

__all__ = ["QConv"]


# The QConv whose __call__ is running (read by _layer_conv).
_CONV = Seam("conv_general_dilated")



def _layer_conv(lhs, rhs, *args, **kwargs):
  """The ``conv_general_dilated`` a :class:`QConv` hands to flax's body."""
  module, recipe, out_dtype = _CONV.current("convolution")
  return quantized_conv_on(module, lhs, rhs, conv_kwargs_from(*args, **kwargs), recipe,
                           out_dtype=out_dtype or jnp.result_type(lhs, rhs))


class QConv(nn.Conv):
  """Drop-in for ``nn.Conv`` whose convolution runs in fp8.

  Same arguments (1D/2D/3D ``kernel_size``, ``strides``, ``padding`` incl.
  ``'SAME'``, ``'VALID'``, ``'CAUSAL'``, ``'CIRCULAR'``, ``'REFLECT'`` and explicit
  pairs, ``input_dilation``, ``kernel_dilation``, ``feature_group_count``) and
  the same ``params`` tree (``kernel``, ``bias``) as ``nn.Conv``; the fp8 state
  is added in the :data:`~fp8_linen.OWG` collection at the same path. Shared
  weights only (``nn.ConvLocal`` has no fp8 twin); ``conv_general_dilated`` and
  ``conv_general_dilated_cls`` must be left at their defaults.

  Attributes:
    recipe: any recipe in :mod:`fp8_linen.families.table` with a
      convolution (:class:`~fp8_linen.Fp8Recipe` by default; fp8 recipes need
      ``granularity='tensor'``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> conv = fl.QConv(features=2, kernel_size=(3,), padding='CAUSAL')
    >>> y, _ = conv.init_with_output(jax.random.key(0), jnp.ones((4, 10, 3)))
    >>> y.shape
    (4, 10, 2)
  """

  conv_general_dilated: Any = _layer_conv
  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs):
    if self.conv_general_dilated is not _layer_conv or self.conv_general_dilated_cls is not None:
      raise ValueError("QConv brings its own fp8 convolution; leave conv_general_dilated and "
                       "conv_general_dilated_cls at their defaults")
    check_recipe("QConv", self.recipe, conv=True)
    if not self.shared_weights:
      raise ValueError("QConv.shared_weights must be True (unshared convolutions have no fp8 "
                       "path)")
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.floating):
      raise TypeError(f"QConv: inputs must be a floating array, got dtype {inputs.dtype}")
    ks = (self.kernel_size,) if isinstance(self.kernel_size, int) else tuple(self.kernel_size)
    if not all(isinstance(k, int) and k >= 1 for k in ks):
      raise ValueError(f"QConv.kernel_size={self.kernel_size!r} must be positive ints")
    if inputs.ndim < len(ks) + 1:
      raise ValueError(f"QConv: inputs of shape {inputs.shape} have fewer dimensions than "
                       f"kernel_size={ks} needs ({len(ks)} spatial + features)")
    groups = self.feature_group_count
    if not isinstance(groups, int) or groups < 1 or inputs.shape[-1] % groups or \
        self.features % groups:
      raise ValueError(f"QConv.feature_group_count={groups!r} must be a positive int that "
                       f"divides both the input features ({inputs.shape[-1]}) and "
                       f"features ({self.features})")
    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    with _CONV.running((self, self.recipe, jnp.dtype(dtype))):
      return super().__call__(inputs)
