"""fp8_linen: fp8 and integer quantization-aware training layers for Flax Linen.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> import fp8_linen as fl
  >>> model = fl.QDense(4)
  >>> variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
  >>> state = fl.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))
  >>> loss = lambda v: jnp.mean(model.apply(v, jnp.ones((8, 16))) ** 2)
  >>> state = state.apply_gradients(grads=jax.grad(loss)(state.params))
"""

from fp8_linen import numerics, ops, recipes
from fp8_linen.layers import OWG, ROLES, Fp8DotGeneral, QDense
from fp8_linen.ops import RoleState, dequantize, fp8_dot_general, quantize
from fp8_linen.recipes import (
    FP8_DTYPES,
    Fp8Recipe,
    ScalingConfig,
    current_scaling,
    delayed_scaling,
)
from fp8_linen import qat  # registers IntRecipe with the layers
from fp8_linen.config import (RecipeConfigError, load_recipe, recipe_from_dict, recipe_names,
                              recipe_to_dict)
from fp8_linen.ops import (
    fake_quant_ste,
    lsq_fake_quant,
    lsq_plus_fake_quant,
    observed_fake_quant,
)
from fp8_linen.recipes import (
    IntQuantConfig,
    IntRecipe,
    int4_lsq_plus,
    int8_lsq,
    mx_block_scaling,
    rowwise_scaling,
)
from fp8_linen.train_state import (
    TrainState,
    accumulate_gradients,
    finalize_accumulated,
    merge_owg,
    owg_max,
    reduce_gradients,
    split_owg,
)
from fp8_linen import activation, conv, general, quantize_model as quantize_model_lib
from fp8_linen.activation import ActivationRecipe, Fp8Activation, fp8_activation
from fp8_linen.conv import QConv, fp8_conv_general_dilated, quantized_conv_on, register_conv
from fp8_linen.general import QDenseGeneral, QEinsum, einsum_plan, quantized_einsum_on
from fp8_linen.quantize_model import (
    QuantizationRule,
    QuantizedModel,
    quantization,
    quantize_model,
)

__version__ = "0.1.0"

__all__ = [
    "OWG",
    "ROLES",
    "FP8_DTYPES",
    "Fp8Recipe",
    "ScalingConfig",
    "delayed_scaling",
    "current_scaling",
    "RoleState",
    "quantize",
    "dequantize",
    "fp8_dot_general",
    "Fp8DotGeneral",
    "QDense",
    "TrainState",
    "split_owg",
    "merge_owg",
    "owg_max",
    "accumulate_gradients",
    "finalize_accumulated",
    "reduce_gradients",
    "numerics",
    "ops",
    "recipes",
    # issue 4: granularity, integer QAT, YAML recipes
    "rowwise_scaling",
    "mx_block_scaling",
    "IntQuantConfig",
    "IntRecipe",
    "int8_lsq",
    "int4_lsq_plus",
    "fake_quant_ste",
    "lsq_fake_quant",
    "lsq_plus_fake_quant",
    "observed_fake_quant",
    "RecipeConfigError",
    "recipe_from_dict",
    "load_recipe",
    "recipe_names",
    "recipe_to_dict",
    "qat",
    # issue 3: layer collection, activation quantizer, quantize_model
    "QDenseGeneral",
    "QEinsum",
    "einsum_plan",
    "quantized_einsum_on",
    "QConv",
    "fp8_conv_general_dilated",
    "register_conv",
    "quantized_conv_on",
    "ActivationRecipe",
    "Fp8Activation",
    "fp8_activation",
    "QuantizationRule",
    "QuantizedModel",
    "quantization",
    "quantize_model",
    "activation",
    "conv",
    "general",
    "quantize_model_lib",
]
