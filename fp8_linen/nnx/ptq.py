"""Post-training quantization of an NNX model: :func:`ptq`.

The NNX twin of :func:`fp8_linen.ptq`: a copy of the float model is
quantized (:func:`~fp8_linen.nnx.quantize_model`, by path rules) or taken as
it is (a model of ``fl.nnx`` layers), the calibration batches run through
it in ``'calibrate'`` mode, every quantizer is set from them by the code the
Linen entry point uses (:mod:`fp8_linen.families.calibration`), and the
calibrated model is converted (:func:`~fp8_linen.nnx.convert`). The served
model computes exactly what the calibrated model computes with frozen
quantizers (``model.eval()``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8_linen.core import serve
from fp8_linen.families import calibration
from fp8_linen.nnx.access import recording
from fp8_linen.nnx.conversion import convert, site_weights
from fp8_linen.nnx.quantize import quantize_model
from fp8_linen.recipes.ptq import PtqConfig
from fp8_linen.recipes.rules import QuantizationRule

__all__ = ["ptq", "PtqResult"]


class PtqResult(NamedTuple):
  """What :func:`ptq` returns.

  Attributes:
    served: the served NNX model (:func:`~fp8_linen.nnx.convert`'s).
    model: the calibrated quantized QAT model (a copy: the float model is
      left as it was); ``model.eval()`` computes what ``served`` computes,
      and a QAT run can start from it.
  """

  served: Any
  model: Any


def _set(who: str, layer, name: str, where: str, value) -> None:
  var = getattr(layer, name, None)
  if not isinstance(var, nnx.Variable):
    raise ValueError(f"{who}: {where} has no variable {name!r} to calibrate")
  old = var[...]
  var.set_value(jnp.reshape(jnp.asarray(value), old.shape).astype(old.dtype))


def ptq(model: nnx.Module, batches: Sequence, *, recipe=None,
        rules: Sequence[QuantizationRule] | None = None, config: PtqConfig | None = None,
        **kwargs) -> PtqResult:
  """Post-training quantization: a trained float NNX model to a served quantized model.

  Args:
    model: a float NNX model (give ``recipe``; ``rules`` as for
      :func:`~fp8_linen.nnx.quantize_model`, which quantizes its flax layers
      and, found by running the first batch, the products of its own code)
      or a model of ``fl.nnx`` layers (no ``recipe``). It is not modified.
    batches: calibration batches: each an input array or a tuple of the
      forward's positional arguments.
    recipe: the recipe for a float model (see :func:`fp8_linen.ptq`).
    rules: :class:`~fp8_linen.QuantizationRule` list for a float model.
    config: :class:`~fp8_linen.PtqConfig`.
    **kwargs: keyword arguments of the forward.

  Returns:
    A :class:`PtqResult` ``(served, model)``.

  Raises:
    ValueError: naming the argument, as :func:`fp8_linen.ptq`.
    TypeError: for arguments of the wrong kind.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
    >>> x = jax.random.normal(jax.random.key(0), (16, 8))
    >>> served, qmodel = fl.nnx.ptq(model, [x], recipe=fl.weight_only(8))
    >>> served.layers[0].kernel[...].dtype
    dtype('int8')
    >>> bool(jnp.abs(served(x) - model(x)).max() < 0.02)
    True
  """
  who = "fl.nnx.ptq"
  config = PtqConfig() if config is None else config
  if not isinstance(config, PtqConfig):
    raise TypeError(f"{who}: config must be an fl.PtqConfig, got {type(config).__name__}")
  if not isinstance(model, nnx.Module):
    raise TypeError(f"{who}: model must be an nnx.Module, got {type(model).__name__} (for a "
                    "Linen model use fl.ptq)")
  if any(getattr(m, "serving", None) is not None for _, m in nnx.iter_modules(model)):
    raise TypeError(f"{who}: model is already served")
  args = calibration.check_batches(who, batches)
  if recipe is not None:
    calibration.check_recipe(f"{who}: recipe", recipe, config)
  qmodel = nnx.clone(model)
  if recipe is not None:
    # The first batch finds the products of the model's own code too (as
    # fl.ptq's interception does), so none of them silently stays float.
    qmodel = quantize_model(qmodel, recipe, rules,
                            example=lambda m: m(*args[0], **kwargs))
  elif rules is not None:
    raise TypeError(f"{who}: rules= needs a recipe (rules choose where a recipe applies)")
  graphdef, state = nnx.split(qmodel)

  @jax.jit
  def run(state, *a):
    m = nnx.merge(graphdef, state)
    with recording(m, "calibrate") as records, calibration.calibrating(
        samples=config.samples, with_hessian=config.weights == "gptq"):
      m(*a, **kwargs)
    return records

  stats: dict = {}
  for a in args:
    for path, rec in run(state, *a).items():
      stats[path] = calibration.merge(stats.get(path), rec)
  if not stats:
    raise calibration.no_product_error(who)
  layers = {"/".join(str(p) for p in path): m for path, m in nnx.iter_modules(qmodel)}
  # GPTQ rewrites a weight of a module's own code only where that product alone reads it
  # (the check conversion makes before storing it as codes); elsewhere it rounds to nearest.
  own = (site_weights(stats, layers, qmodel, args[0], kwargs)
         if config.weights == "gptq" else {})
  for path, st in stats.items():
    where = path or "<root>"
    rtn = st.kernel_at >= serve.WEIGHT_AT and path not in own
    values, kernel = calibration.calibrated(
        st, dataclasses.replace(config, weights="rtn") if rtn else config, where=where)
    for name, value in values.items():
      _set(who, layers[path], name, where, value)
    if kernel is not None:
      _set(who, *(own[path] if path in own else (layers[path], "kernel")), where, kernel)
  return PtqResult(convert(qmodel, *args[0], **kwargs), qmodel)
