"""Post-training quantization of a Linen model: :func:`ptq`, :class:`PtqResult`.

From a trained float model, a few calibration batches and a recipe to the
served model :func:`~fp8_linen.convert` produces: the model is quantized
(:func:`~fp8_linen.quantize_model` for an unmodified model, by the same
module-path rules; or a model of the library's layers as it is), the float
parameters are loaded into it, the calibration batches run through the
float model in ``'calibrate'`` mode and set every quantizer
(:mod:`fp8_linen.families.calibration`: activation ranges by min/max,
percentile or MSE; weights by round to nearest or GPTQ), and the calibrated
QAT model is converted. The served model is therefore exactly what the
calibrated QAT model computes with frozen quantizers
(:func:`~fp8_linen.frozen_quantizers`), bit for bit; export and serving are
shared with QAT, and the calibrated variables can start a QAT run.

NNX: :func:`fp8_linen.nnx.ptq`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen.conversion import ServedModel, ServedModule, convert, own_weights
from fp8_linen.core import serve
from fp8_linen.core.owg import OWG
from fp8_linen.families import calibration
from fp8_linen.linen import access
from fp8_linen.linen.access import SERVED
from fp8_linen.model_quantization import QuantizedModel, quantize_model
from fp8_linen.recipes.ptq import PtqConfig
from fp8_linen.recipes.rules import QuantizationRule

__all__ = ["ptq", "PtqResult"]

# Parameters quantization adds to a float model's (LSQ steps and offsets):
# calibration sets them, the float checkpoint does not have them.
_QUANTIZER_PARAMS = ("input_step", "input_offset", "kernel_step", "kernel_offset")


class PtqResult(NamedTuple):
  """What :func:`ptq` returns.

  Attributes:
    served: the served model (:class:`~fp8_linen.ServedModule` or
      :class:`~fp8_linen.ServedModel`), as :func:`~fp8_linen.convert` gives.
    served_params: its variables (int8 / int4 / fp8 codes and scales).
    model: the quantized QAT model the calibration ran.
    variables: its calibrated variables (float params, quantizer state):
      ``model`` with them under :func:`~fp8_linen.frozen_quantizers` computes
      what ``served`` computes; a QAT run can start from them.
  """

  served: Any
  served_params: dict
  model: Any
  variables: dict


def _flat(tree, path=()):
  for k, v in tree.items():
    if isinstance(v, Mapping):
      yield from _flat(v, path + (k,))
    else:
      yield path + (k,), v


def _node(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _load_float(who: str, init_vars: dict, float_vars: Mapping) -> dict:
  """``init_vars`` holding every array of the float variables; the quantizers' own stay."""
  out = flax.core.unfreeze(init_vars)
  source = {"/".join((c,) + p): v for c in float_vars if c != OWG
            for p, v in _flat(flax.core.unfreeze(float_vars[c]))}
  used = set()
  for c, tree in out.items():
    if c == OWG:
      continue
    for path, old in _flat(tree):
      key = "/".join((c,) + path)
      if key not in source:
        if c == "params" and path[-1] in _QUANTIZER_PARAMS:
          continue
        raise ValueError(f"{who}: variables has no {key!r}, which the quantized model needs "
                         "(pass the float model's trained variables, {'params': ...})")
      new = jnp.asarray(source[key])
      if new.shape != jnp.shape(old):
        raise ValueError(f"{who}: variables[{key!r}] has shape {new.shape}, the model "
                         f"expects {jnp.shape(old)}")
      _node(out[c], path[:-1])[path[-1]] = new
      used.add(key)
  extra = sorted(set(source) - used)
  if extra:
    raise ValueError(f"{who}: variables holds arrays the model does not have: {extra[:5]}")
  return out


def _apply(who: str, variables: dict, path: tuple, values: dict, kernel,
           name: str = "kernel") -> None:
  """Writes one product's calibrated values (and new weight ``name``) into ``variables``."""
  where = "/".join(path) or "<root>"
  for name, value in values.items():
    for c in (OWG, "params"):
      node = variables.get(c, {})
      try:
        node = _node(node, path)
      except KeyError:
        continue
      if name in node:
        old = jnp.asarray(node[name])
        node[name] = jnp.reshape(jnp.asarray(value), old.shape).astype(old.dtype)
        break
    else:
      raise ValueError(f"{who}: {where} has no variable {name!r} to calibrate (initialise the "
                       "model with its recipe's variables)")
  if kernel is not None:
    node = _node(variables["params"], path)
    old = jnp.asarray(node[name])
    node[name] = jnp.reshape(kernel, old.shape).astype(old.dtype)


def ptq(model, variables: Mapping, batches: Sequence, *, recipe=None,
        rules: Sequence[QuantizationRule] | None = None, config: PtqConfig | None = None,
        seed: int = 0, **kwargs) -> PtqResult:
  """Post-training quantization: a trained float Linen model to a served quantized model.

  Args:
    model: an unmodified Linen model (give ``recipe``; ``rules`` as for
      :func:`~fp8_linen.quantize_model`), or a model of the library's layers
      (``QDense`` & co.) or a :class:`~fp8_linen.QuantizedModel` (no
      ``recipe``: theirs are used).
    variables: the model's trained float variables (``{'params': ...}``
      plus any other collection, such as ``batch_stats``).
    batches: calibration batches: each an input array, or a tuple of the
      forward's positional arguments. A few representative batches suffice.
    recipe: the recipe for a float model: e.g. :func:`~fp8_linen.weight_only`
      (int8 / int4 weights, per channel or group), ``fl.IntRecipe()`` (w8a8
      int8, observed activation range), ``fl.int8_lsq()``,
      ``fl.delayed_scaling()`` (fp8 weights and activations).
    rules: :class:`~fp8_linen.QuantizationRule` list for a float model.
    config: :class:`~fp8_linen.PtqConfig` (activation range method, GPTQ).
    seed: the key of the quantized model's ``init`` (its values are then
      replaced by the float ones and the calibration's).
    **kwargs: keyword arguments of the forward (e.g. ``train=False``).

  Returns:
    A :class:`PtqResult` ``(served, served_params, model, variables)``.

  Raises:
    ValueError: naming the argument: no batches, a batch with NaN or
      infinite values, variables that do not fit the model, an unknown
      method (in :class:`~fp8_linen.PtqConfig`), a model with no quantized
      product, a recipe PTQ cannot calibrate or serve.
    TypeError: for arguments of the wrong kind.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
    >>> x = jax.random.normal(jax.random.key(0), (16, 8))
    >>> params = model.init(jax.random.key(1), x)              # ... trained in float
    >>> res = fl.ptq(model, params, [x], recipe=fl.weight_only(8))
    >>> res.served_params['params']['layers_0']['kernel'].dtype
    dtype('int8')
    >>> y = res.served.apply(res.served_params, x)
    >>> bool(jnp.abs(y - model.apply(params, x)).max() < 0.02)
    True
  """
  who = "fl.ptq"
  config = PtqConfig() if config is None else config
  if not isinstance(config, PtqConfig):
    raise TypeError(f"{who}: config must be an fl.PtqConfig, got {type(config).__name__}")
  if isinstance(model, (ServedModel, ServedModule)):
    raise TypeError(f"{who}: model is already served")
  if not isinstance(variables, Mapping) or "params" not in variables:
    raise TypeError(f"{who}: variables must be the float model's variables ({{'params': "
                    f"...}}), got {type(variables).__name__}")
  args = calibration.check_batches(who, batches)
  if recipe is not None:
    calibration.check_recipe(f"{who}: recipe", recipe, config)
  if recipe is not None:
    if not isinstance(model, nn.Module) or isinstance(model, QuantizedModel):
      raise TypeError(f"{who}: recipe= quantizes an unmodified Linen model; model is "
                      f"{type(model).__name__} (leave recipe out for a QuantizedModel)")
    qmodel = quantize_model(model, recipe, rules)
  else:
    if rules is not None:
      raise TypeError(f"{who}: rules= needs a recipe (rules choose where a recipe applies)")
    if not isinstance(model, (nn.Module, QuantizedModel)):
      raise TypeError(f"{who}: model must be a Linen module or a QuantizedModel, got "
                      f"{type(model).__name__}")
    qmodel = model
  # Jitted: an eager init dispatches every op of the quantized model one by one.
  init_vars = jax.jit(lambda key, *a: qmodel.init(key, *a, **kwargs))(jax.random.key(seed),
                                                                       *args[0])
  qvars = _load_float(who, init_vars, variables)

  def run(v, *a):
    with calibration.calibrating(samples=config.samples,
                                 with_hessian=config.weights == "gptq"):
      _, state = qmodel.apply(v, *a, mutable=[SERVED], **kwargs)
    return flax.core.unfreeze(state).get(SERVED, {})

  run = jax.jit(run)
  stats: dict = {}
  for a in args:
    for path, rec in access.records(run(qvars, *a), calibration.CalibrationRecord):
      stats[path] = calibration.merge(stats.get(path), rec)
  if not stats:
    raise calibration.no_product_error(who)
  # GPTQ rewrites a weight of a module's own code only where that product alone reads it.
  own = (own_weights(qmodel, qvars, qvars["params"], args[0], kwargs, stats.items())
         if config.weights == "gptq" else {})
  for path, st in stats.items():
    rtn = st.kernel_at >= serve.WEIGHT_AT and path not in own
    values, kernel = calibration.calibrated(
        st, dataclasses.replace(config, weights="rtn") if rtn else config,
        where="/".join(path) or "<root>")
    _apply(who, qvars, path, values, None)
    if kernel is not None:  # Fp8DotGeneral in a flax layer multiplies its parent's kernel
      _apply(who, qvars, path if st.kernel_at == 0 else path[:-1], {}, kernel,
             own.get(path, "kernel"))
  served, served_params = convert(qmodel, qvars, *args[0], **kwargs)
  return PtqResult(served, served_params, qmodel, qvars)
