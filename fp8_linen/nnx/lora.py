"""LoRA and QLoRA on a served NNX model: :func:`add_lora`, :class:`LoraParam`, :func:`merge_lora`.

The NNX twin of :mod:`fp8_linen.lora`: the served model of
:func:`~fp8_linen.nnx.ptq` or :func:`~fp8_linen.nnx.convert` keeps its
weights as codes; :func:`add_lora` gives its layers adapters
(:class:`LoraParam` s ``lora_a``, ``lora_b`` and an ``nnx.Param``
``lora_scale``), trained with ``nnx.Optimizer(model, tx, wrt=LoraParam)``
and ``nnx.grad(..., argnums=nnx.DiffState(0, LoraParam))``. The products
run as the Linen ones do (:mod:`fp8_linen.families.lora`); the same seed
gives both APIs the same adapters.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> model = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.relu,
  ...                        nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
  >>> x = jax.random.normal(jax.random.key(0), (16, 8))
  >>> served, _ = fl.nnx.ptq(model, [x], recipe=fl.weight_only(4))
  >>> fl.nnx.add_lora(served, x, rank=2)
  >>> opt = nnx.Optimizer(served, optax.adam(1e-2), wrt=fl.nnx.LoraParam)
  >>> loss = lambda m: jnp.mean((m(x) - 1.0) ** 2)
  >>> grads = nnx.grad(loss, argnums=nnx.DiffState(0, fl.nnx.LoraParam))(served)
  >>> _ = opt.update(served, grads)
  >>> merged = fl.nnx.merge_lora(served, model, x)  # a float model: fl.nnx.ptq it again
  >>> merged.layers[0].kernel[...].dtype
  dtype('float32')
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8_linen.core import lora as core_lora
from fp8_linen.core import serve
from fp8_linen.families import lora
from fp8_linen.nnx.access import weights
from fp8_linen.nnx.conversion import traced_records

__all__ = ["LoraParam", "add_lora", "merge_lora"]


class LoraParam(nnx.Param):
  """A LoRA adapter matrix (``lora_a``, ``lora_b``): the only parameters QLoRA trains."""


def _served_layers(who: str, served: nnx.Module) -> dict:
  if not isinstance(served, nnx.Module):
    raise TypeError(f"{who}: served must be an nnx.Module, got {type(served).__name__} (for a "
                    "Linen model use the fl. function)")
  layers = {"/".join(str(p) for p in path) or "<root>": m
            for path, m in nnx.iter_modules(served)}
  if not any(getattr(m, "serving", None) is not None for m in layers.values()):
    raise TypeError(f"{who}: served is not a served model; make one with fl.nnx.convert or "
                    "fl.nnx.ptq")
  return layers


def add_lora(served: nnx.Module, *args: Any, rank: int = 8, alpha: float | None = None,
             paths: str | None = None, seed: int = 0, **kwargs: Any) -> None:
  """Gives every served layer with a stored weight that ``paths`` matches a LoRA adapter, in place.

  Arguments as :func:`fp8_linen.add_lora` (``served`` is the served NNX
  model). Each adapted layer gets :class:`LoraParam` s ``lora_a`` (drawn
  from ``seed`` and the layer's path) and ``lora_b`` (zeros), and an
  ``nnx.Param`` ``lora_scale`` (``alpha / rank``).

  Raises:
    ValueError: as :func:`fp8_linen.add_lora`.
    TypeError: for arguments of the wrong kind.
  """
  who = "fl.nnx.add_lora"
  layers = _served_layers(who, served)
  lora.check_rank(who, rank)
  alpha = float(rank if alpha is None else alpha)
  if not jnp.isfinite(alpha):
    raise ValueError(f"{who}: alpha must be finite, got {alpha}")
  if any(isinstance(getattr(m, "lora_a", None), LoraParam) for m in layers.values()):
    raise ValueError(f"{who}: the model already holds LoRA adapters; merge them first "
                     "(fl.nnx.merge_lora, then fl.nnx.ptq)")
  plans = traced_records(served, args, kwargs, mode="serve",
                         context=lora.adding(rank=rank, paths=paths))
  if not plans:
    raise ValueError(f"{who}: no served layer with a stored weight matches paths={paths!r}")
  key = jax.random.key(seed)
  for path, plan in plans.items():
    where = path or "<root>"
    layer = layers[where]
    layer.lora_a = LoraParam(core_lora.init_a(core_lora.adapter_key(key, where), plan.a_shape,
                                              plan.fan_in))
    layer.lora_b = LoraParam(jnp.zeros(plan.b_shape, jnp.float32))
    layer.lora_scale = nnx.Param(jnp.asarray(alpha / rank, jnp.float32))
    layer.serving = dataclasses.replace(
        layer.serving, arrays=tuple(sorted(set(layer.serving.arrays) | set(core_lora.NAMES))))


def merge_lora(served: nnx.Module, float_model: nnx.Module, *args: Any,
               **kwargs: Any) -> nnx.Module:
  """A copy of ``float_model`` with each served weight dequantized plus its adapter's update.

  Args:
    served: the served model (with adapters or without).
    float_model: the float model it was made from (``fl.nnx.ptq``'s
      ``model``, or the model ``fl.nnx.quantize_model`` was given): its
      layers are found by the served layers' paths. It is not modified.
    *args: example inputs of the forward.
    **kwargs: keyword arguments of the forward.

  Returns:
    The float model with merged kernels (in their own dtype): quantize it
    again for serving with :func:`~fp8_linen.nnx.ptq` (merge-and-requantize).

  Raises:
    ValueError: naming a layer ``float_model`` lacks or whose kernel does
      not fit, or whose stored weight cannot be dequantized.
    TypeError: for arguments of the wrong kind.
  """
  who = "fl.nnx.merge_lora"
  _served_layers(who, served)
  if not isinstance(float_model, nnx.Module):
    raise TypeError(f"{who}: float_model must be an nnx.Module, got "
                    f"{type(float_model).__name__}")
  merged = traced_records(served, args, kwargs, mode="serve", context=lora.merging())
  if not merged:
    raise serve.no_product_error(who, "a served model of fl.nnx.convert / fl.nnx.ptq")
  out = nnx.clone(float_model)
  layers = {"/".join(str(p) for p in path) or "<root>": m for path, m in nnx.iter_modules(out)}
  for path, rec in merged.items():
    if int(rec.kernel_at) < 0:
      continue  # a live right operand: nothing stored to merge
    where, name = path or "<root>", "kernel"
    if int(rec.kernel_at) >= serve.WEIGHT_AT:  # a product in a module's own code
      where = path.rpartition("/")[0] or "<root>"
      own = weights(layers[where]) if where in layers else []
      i = int(rec.kernel_at) - serve.WEIGHT_AT
      name = own[i][0] if i < len(own) else "?"
    kernel = getattr(layers.get(where), name, None)
    if not isinstance(kernel, nnx.Param) or kernel[...].size != rec.kernel.size:
      raise ValueError(f"{who}: float_model has no layer {where!r} with a {name} of "
                       f"{rec.kernel.size} elements; pass the float model the served model was "
                       "made from")
    old = kernel[...]
    kernel.set_value(jnp.reshape(rec.kernel, old.shape).astype(old.dtype))
  return out
