"""fp8_linen: fp8 and integer quantization-aware training layers for Flax Linen and NNX.

The NNX layers are in :mod:`fp8_linen.nnx` (``fl.nnx``, imported on first use).

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> import fp8_linen as fl
  >>> model = fl.QDense(4)
  >>> variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
  >>> state = fl.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-3))
  >>> loss = lambda v: jnp.mean(model.apply(v, jnp.ones((8, 16))) ** 2)
  >>> state = state.apply_gradients(grads=jax.grad(loss)(state.params))
"""

import sys as _sys

from fp8_linen.conversion import ServedModel, ServedModule, convert, weight_bytes
from fp8_linen.core.conv import fp8_conv_general_dilated
from fp8_linen.core.dims import EinsumPlan, einsum_plan
from fp8_linen.core.block_kernels import pallas_kernels
from fp8_linen.core.dot_general import fp8_dot_general
from fp8_linen.core.int_ops import (
    fake_quant_ste,
    lsq_fake_quant,
    lsq_plus_fake_quant,
    observed_fake_quant,
)
from fp8_linen.core.lowering import target_backend
from fp8_linen.core.owg import (
    CHECKPOINT_NAME,
    OWG,
    ROLES,
    RoleState,
    frozen_quantizers,
    name_fp8_residual,
)
from fp8_linen.core.qdq import dequantize, quantize
from fp8_linen.core.ragged_dot import fp8_ragged_dot
from fp8_linen.core.uses import StateUseError
from fp8_linen.linen.activation import Fp8Activation, fp8_activation
from fp8_linen.linen.conv import QConv
from fp8_linen.linen.dense import Fp8DotGeneral, Fp8Einsum, QDense, QDenseGeneral, QEinsum
from fp8_linen.linen.flax_fp8 import FlaxFp8Report, flax_fp8_recipe, from_flax_fp8
from fp8_linen.families import RecipeFamily, register_recipe
from fp8_linen.linen.access import (
    quantized_conv_on,
    quantized_dot_general_on,
    quantized_einsum_on,
    quantized_ragged_dot_on,
)
from fp8_linen.model_quantization import (
    QuantizationRule,
    QuantizedModel,
    projection_rules,
    quantization,
    quantize_model,
)
from fp8_linen.product_report import Product, ProductReport, product_report
from fp8_linen.ptq import PtqResult, ptq
from fp8_linen.lora import add_lora, join_lora, merge_lora, split_lora
from fp8_linen.sensitivity import (LayerSensitivity, PrecisionChoice, SensitivityResult,
                                   sensitivity)
from fp8_linen.recipes.rules import high_precision_layers
from fp8_linen.recipes import (
    FP4_DTYPES,
    FP8_DTYPES,
    ActivationRecipe,
    Fp8Recipe,
    Fp8WeightOnly,
    IntQuantConfig,
    IntRecipe,
    RecipeConfigError,
    PtqConfig,
    ScalingConfig,
    current_scaling,
    delayed_scaling,
    int4_lsq_plus,
    int8_lsq,
    load_recipe,
    mx_block_scaling,
    nvfp4,
    recipe_from_dict,
    recipe_names,
    recipe_to_dict,
    rowwise_scaling,
    weight_only,
)
from fp8_linen.training import (
    TrainState,
    accumulate_gradients,
    accumulate_microbatches,
    all_finite,
    finalize_accumulated,
    histories_ready,
    load_float_state,
    switch_precision,
    merge_owg,
    owg_max,
    reduce_gradients,
    resize_histories,
    split_first_step,
    quantize_once_per_window,
    split_owg,
)

__version__ = "0.1.0"


# fl.nnx imports flax.nnx (about half a second), which Linen users never need: it is
# imported on first use, or now when flax.nnx already is (then it costs nothing more, and
# flax's bridge maps the Linen state collection to fl.nnx.QuantState from the start).
if "flax.nnx" in _sys.modules:
  from fp8_linen import nnx  # noqa: E402


def __getattr__(name: str):
  if name == "nnx":
    import importlib  # pylint: disable=import-outside-toplevel
    return importlib.import_module("fp8_linen.nnx")
  raise AttributeError(f"module 'fp8_linen' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | {"nnx"})


__all__ = [
    "convert",
    "ServedModel",
    "ServedModule",
    "weight_bytes",
    # recipes
    "FP8_DTYPES",
    "FP4_DTYPES",
    "ScalingConfig",
    "Fp8Recipe",
    "Fp8WeightOnly",
    "ActivationRecipe",
    "delayed_scaling",
    "current_scaling",
    "rowwise_scaling",
    "mx_block_scaling",
    "nvfp4",
    "IntQuantConfig",
    "IntRecipe",
    "int8_lsq",
    "int4_lsq_plus",
    "weight_only",
    "PtqConfig",
    "RecipeConfigError",
    "load_recipe",
    "recipe_names",
    "recipe_from_dict",
    "recipe_to_dict",
    # ops
    "OWG",
    "ROLES",
    "CHECKPOINT_NAME",
    "RoleState",
    "name_fp8_residual",
    "quantize",
    "dequantize",
    "fp8_dot_general",
    "fp8_conv_general_dilated",
    "fake_quant_ste",
    "lsq_fake_quant",
    "lsq_plus_fake_quant",
    "observed_fake_quant",
    "EinsumPlan",
    "einsum_plan",
    "StateUseError",
    "fp8_ragged_dot",
    "target_backend",
    "pallas_kernels",
    "frozen_quantizers",
    # Linen layers
    "Fp8DotGeneral",
    "Fp8Einsum",
    "QDense",
    "QDenseGeneral",
    "QEinsum",
    "QConv",
    "Fp8Activation",
    "fp8_activation",
    "RecipeFamily",
    "register_recipe",
    "quantized_dot_general_on",
    "quantized_einsum_on",
    "quantized_ragged_dot_on",
    "quantized_conv_on",
    # whole models
    "QuantizationRule",
    "QuantizedModel",
    "quantization",
    "quantize_model",
    "projection_rules",
    "high_precision_layers",
    "Product",
    "ProductReport",
    "product_report",
    # post-training quantization
    "ptq",
    "add_lora",
    "split_lora",
    "join_lora",
    "merge_lora",
    "PtqResult",
    # precision chosen by measurement
    "sensitivity",
    "SensitivityResult",
    "LayerSensitivity",
    "PrecisionChoice",
    # Flax NNX layers (fl.nnx.Linear, ...)
    "nnx",
    # training
    "TrainState",
    "split_owg",
    "merge_owg",
    "owg_max",
    "accumulate_gradients",
    "accumulate_microbatches",
    "finalize_accumulated",
    "reduce_gradients",
    "all_finite",
    "resize_histories",
    "load_float_state",
    "switch_precision",
    "split_first_step",
    "quantize_once_per_window",
    "histories_ready",
    # coming from flax's own fp8 ops (flax.linen.fp8_ops)
    "from_flax_fp8",
    "flax_fp8_recipe",
    "FlaxFp8Report",
]
