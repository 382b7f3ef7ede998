"""Recipe families: the quantized products of every recipe, written once for Linen and NNX.

This layer sits between :mod:`fp8_linen.core` (pure JAX ops) and the two Flax
APIs (:mod:`fp8_linen.linen`, :mod:`fp8_linen.nnx`), and never imports flax.
A family says what one kind of recipe does on a layer; the layer's
variables reach it through a :class:`VariableAccess`, which each API
implements once.

* :mod:`~fp8_linen.families.access`: :class:`VariableAccess`, the interface
  to a layer's variables (state, learned parameters, use chains, conversion
  records, served arrays);
* :mod:`~fp8_linen.families.table`: :class:`RecipeFamily` and THE table of
  recipe types (:func:`register_recipe`), with the recipe errors;
* :mod:`~fp8_linen.families.fp8`, :mod:`~fp8_linen.families.integer`: the
  built-in families (fp8: per tensor, row-wise, MX, NVFP4; integer: STE,
  LSQ, LSQ+), and the fp8 activation quantizer;
* :mod:`~fp8_linen.families.modes`: training, ``'convert'`` or ``'serve'``;
* :mod:`~fp8_linen.families.dispatch`: a product on a layer in the current
  mode; the einsum lowering;
* :mod:`~fp8_linen.families.conversion`: what both ``convert`` s share;
* :mod:`~fp8_linen.families.calibration`: what both ``ptq`` s share (the
  ``'calibrate'`` mode's records, the quantizer values they give).

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen import families
  >>> families.family_for(fl.current_scaling()).conv.__module__
  'fp8_linen.families.fp8'
"""

from fp8_linen.families.access import VariableAccess
from fp8_linen.families.dispatch import conv, declare, dot_general, einsum, einsum_kernel
from fp8_linen.families.modes import MODES, current_mode, mode
from fp8_linen.families.table import (RecipeFamily, check_recipe, family_for, recipe_error,
                                      register_recipe, registered, unregister_recipe)

__all__ = ["VariableAccess", "RecipeFamily", "register_recipe", "unregister_recipe",
           "registered", "family_for", "check_recipe", "recipe_error", "MODES", "mode",
           "current_mode", "declare", "dot_general", "conv", "einsum", "einsum_kernel"]
