"""Frozen, keyword-only configuration for *how* tensors are quantized.

Recipes are plain values: validated on construction, hashable (static
arguments of jitted functions) and never mutated. This package imports nothing
else from fp8_linen.

* :mod:`~fp8_linen.recipes.fp8`: :class:`ScalingConfig`, :class:`Fp8Recipe`,
  :class:`ActivationRecipe` and the delayed/current/row-wise/MXFP8/NVFP4 presets;
* :mod:`~fp8_linen.recipes.integer`: :class:`IntQuantConfig`, :class:`IntRecipe`;
* :mod:`~fp8_linen.recipes.ptq`: :class:`PtqConfig` (how post-training quantization calibrates);
* :mod:`~fp8_linen.recipes.yaml`: recipes to and from YAML, and the shipped
  presets (``presets/*.yaml``).

Example:
  >>> import fp8_linen as fl
  >>> recipe = fl.Fp8Recipe(input=fl.ScalingConfig(dtype='float8_e4m3fn',
  ...                                               history_length=16))
  >>> recipe.input.history_length
  16
"""

from fp8_linen.recipes.fp8 import (
    FP4_DTYPES,
    FP8_DTYPES,
    GRANULARITIES,
    ActivationRecipe,
    Fp8Recipe,
    Fp8WeightOnly,
    ScalingConfig,
    canonical_fp8_dtype,
    current_scaling,
    delayed_scaling,
    mx_block_scaling,
    nvfp4,
    rowwise_scaling,
)
from fp8_linen.recipes.integer import (IntQuantConfig, IntRecipe, int4_lsq_plus, int8_lsq,
                                      weight_only)
from fp8_linen.recipes.ptq import PtqConfig
from fp8_linen.recipes.yaml import (
    RecipeConfigError,
    load_recipe,
    recipe_from_dict,
    recipe_names,
    recipe_to_dict,
)

__all__ = [
    "FP4_DTYPES",
    "FP8_DTYPES",
    "GRANULARITIES",
    "ActivationRecipe",
    "Fp8Recipe",
    "Fp8WeightOnly",
    "ScalingConfig",
    "canonical_fp8_dtype",
    "current_scaling",
    "delayed_scaling",
    "mx_block_scaling",
    "nvfp4",
    "rowwise_scaling",
    "IntQuantConfig",
    "IntRecipe",
    "int4_lsq_plus",
    "int8_lsq",
    "weight_only",
    "PtqConfig",
    "RecipeConfigError",
    "load_recipe",
    "recipe_from_dict",
    "recipe_names",
    "recipe_to_dict",
]
