"""fp8 and integer quantization-aware training for Flax NNX.

A thin layer over :mod:`fp8_linen.families` (the recipes' products, written
once for both APIs): :mod:`.access` is the NNX side of their
:class:`~fp8_linen.families.VariableAccess`.

Layers (drop-ins for their ``flax.nnx`` twins): :class:`Linear`,
:class:`LinearGeneral`, :class:`Einsum`, :class:`Conv`; :class:`Fp8Einsum` (an einsum of
two activations, flax's ``Fp8Einsum`` call); the activation
:class:`Quantizer`. Their state is :class:`QuantState`; it leaves a step as
its gradient and :class:`Optimizer` writes it back (see :mod:`.training`).
:func:`quantize_model` swaps a float NNX model's layers for these;
:func:`convert` turns a trained model into a served one (int8/int4/fp8 codes),
which equals the model evaluated with frozen quantizers (``model.eval()``);
:func:`ptq` does the same for a trained float model, calibrated on a few batches;
:func:`add_lora` gives a served model trainable adapters (:class:`LoraParam`: QLoRA) and
:func:`merge_lora` folds them into a float model to quantize again.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> model = fl.nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  >>> opt = fl.nnx.Optimizer(model, optax.adam(1e-3))
  >>> loss, grads = fl.nnx.value_and_grad(lambda m: (m(jnp.ones((8, 16))) ** 2).mean())(model)
  >>> _ = opt.update(model, grads)
"""

from fp8_linen.core.owg import frozen_quantizers
from fp8_linen.nnx.access import calibrate
from fp8_linen.nnx.activation import Quantizer
from fp8_linen.nnx.conversion import convert
from fp8_linen.nnx.layers import Conv, Einsum, Fp8Einsum, Linear, LinearGeneral
from fp8_linen.nnx.lora import LoraParam, add_lora, merge_lora
from fp8_linen.nnx.ops import ProductSite
from fp8_linen.nnx.ops import model_report as product_report
from fp8_linen.nnx.ptq import PtqResult, ptq
from fp8_linen.nnx.quantize import quantize_model, switch_precision
from fp8_linen.nnx.sensitivity import sensitivity
from fp8_linen.nnx.state import DIFF, QuantState, register_owg_collection
from fp8_linen.nnx.training import (Optimizer, accumulate_microbatches, grad,
                                    quantize_once_per_window, split_first_step, update_state,
                                    value_and_grad)

# flax's bridge looks the OWG collection's variable type up when it wraps a
# Linen layer, before any fl.nnx object exists: map it to QuantState now.
register_owg_collection()

__all__ = [
    "Linear",
    "LinearGeneral",
    "Einsum",
    "Conv",
    "Fp8Einsum",
    "Quantizer",
    "QuantState",
    "DIFF",
    "Optimizer",
    "value_and_grad",
    "grad",
    "update_state",
    "split_first_step",
    "quantize_once_per_window",
    "accumulate_microbatches",
    "calibrate",
    "quantize_model",
    "product_report",
    "ProductSite",
    "switch_precision",
    "frozen_quantizers",
    "convert",
    "ptq",
    "PtqResult",
    "add_lora",
    "merge_lora",
    "LoraParam",
    "sensitivity",
]
