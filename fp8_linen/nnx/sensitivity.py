"""Which layers a recipe can take, by measurement: :func:`sensitivity` (NNX).

The NNX twin of :func:`fp8_linen.sensitivity`: each layer of a float NNX
model is quantized alone (:func:`~fp8_linen.nnx.quantize_model` with a rule
keeping every other layer in float), and the change of the loss, the error
of the layer's outputs and the error of the gradient with respect to its
parameters are measured on a few batches, all layers in one jitted program.
The ranking, the rules and their choice are shared with Linen
(:mod:`fp8_linen.families.sensitivity`); twin Linen and NNX models give the
same measurements.

The quantizers start fresh, as in Linen: empty amax histories (each batch
scaled by its own amax), LSQ steps from the model's activations on the first
batch (:func:`~fp8_linen.nnx.calibrate`). The model must be a float one (its
layers plain ``nnx.Linear`` & co.; after QAT by
:func:`~fp8_linen.nnx.quantize_model` the float model shares the trained
parameters): a layer that is already a quantized twin cannot be measured
alone.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8_linen.families import sensitivity as shared
from fp8_linen.families.sensitivity import SensitivityResult
# The flag fl.nnx.calibrate sets: with it several models (and a loss_fn that may call more
# than __call__) set their LSQ steps in one jitted call.
from fp8_linen.nnx.access import calibrating
from fp8_linen.nnx.layers import Conv, Einsum, Fp8Einsum, Linear, LinearGeneral
from fp8_linen.nnx.quantize import quantize_model
from fp8_linen.recipes.integer import IntRecipe
from fp8_linen.recipes.rules import QuantizationRule, normalize_rules

__all__ = ["sensitivity"]

_TWINS = (Linear, LinearGeneral, Einsum, Conv, Fp8Einsum)


def _name(path) -> str:
  return "/".join(str(p) for p in path)


def _under(path: tuple, prefix: tuple) -> bool:
  return tuple(path[:len(prefix)]) == prefix


def _loss_capture_grads(model, loss_fn, batch):
  """The loss, every module's method outputs and the gradient w.r.t. the ``nnx.Param`` s."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def f(p):
    m = nnx.merge(graphdef, p, rest)
    loss, inter = nnx.capture(lambda mod: loss_fn(mod, batch), nnx.Intermediate,
                              method_outputs=nnx.Intermediate)(m)
    return jnp.asarray(loss, jnp.float32), inter
  (loss, inter), grads = jax.value_and_grad(f, has_aux=True)(params)
  outputs = {tuple(k): v.get_value() for k, v in nnx.to_flat_state(inter)}
  grads = {tuple(k): v.get_value() for k, v in nnx.to_flat_state(grads)}
  return loss, outputs, grads


def _pick(flat: dict, prefix: tuple, depth: int | None = None) -> list:
  """The values of ``flat`` under ``prefix`` (exactly ``depth`` deeper when given), by key."""
  return [flat[k] for k in sorted(flat, key=str)
          if _under(k, prefix) and (depth is None or len(k) == len(prefix) + depth)]


def sensitivity(model: nnx.Module, batches: Sequence, *, recipe, loss_fn: Callable,
                candidates=None, rules: Sequence[QuantizationRule] | None = None,
                fallback=None, high_precision_bits: float = 16) -> SensitivityResult:
  """Measures each layer's quantization sensitivity for ``recipe`` on a few batches (NNX).

  Args:
    model: a float NNX model (not modified).
    batches: a few batches, each what ``loss_fn`` takes.
    recipe: the candidate recipe (see :func:`fp8_linen.sensitivity`).
    loss_fn: ``loss_fn(model, batch) -> scalar`` (deterministic).
    candidates: regular expressions (``re.fullmatch``) selecting which of
      the quantized layers to measure (default: all).
    rules: the :class:`~fp8_linen.QuantizationRule` list the model is
      quantized by (:func:`~fp8_linen.nnx.quantize_model`'s; default: every
      layer). The layers are the ones these rules quantize, by path
      (``'blocks/0/mlp/up'``).
    fallback: the recipe a kept layer gets (``None``: float).
    high_precision_bits: bits per weight element of a kept float layer.

  Returns:
    A :class:`~fp8_linen.SensitivityResult` (the same as Linen's).

  Raises:
    ValueError: naming the argument, as :func:`fp8_linen.sensitivity`.
    TypeError: an unknown recipe, a model that is not an ``nnx.Module``.

  Example:
    >>> import jax, optax
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(32, 4, rngs=nnx.Rngs(1)))
    >>> x = jax.random.normal(jax.random.key(0), (64, 8))
    >>> y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    >>> xent = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b[0]), b[1]).mean()
    >>> res = fl.nnx.sensitivity(model, [(x, y)], recipe=fl.int4_lsq_plus(), loss_fn=xent)
    >>> sorted(res.paths)
    ['layers/0', 'layers/2']
    >>> rules = res.choose(budget=0.01)
    >>> qmodel = fl.nnx.quantize_model(model, fl.int4_lsq_plus(), rules=rules)
  """
  who = "fl.nnx.sensitivity"
  if not isinstance(model, nnx.Module):
    raise TypeError(f"{who}: model must be an nnx.Module, got {type(model).__name__} (for a "
                    "Linen model use fl.sensitivity)")
  quantized_layers = [_name(p) for p, m in nnx.iter_modules(model) if isinstance(m, _TWINS)]
  if quantized_layers:
    raise TypeError(f"{who}: model already holds quantized layers {quantized_layers[:3]}, which "
                    "cannot be measured alone; pass the float model (after QAT by "
                    "fl.nnx.quantize_model the float model shares the trained parameters)")
  batches = shared.check_arguments(who, batches, recipe, fallback, loss_fn)
  base_rules = normalize_rules(rules)
  float_model = nnx.clone(model)
  recipes = [recipe, fallback] + [r.recipe for r in base_rules]
  # LSQ activation steps start from the data the layer sees (fl.nnx.calibrate).
  needs_calibration = any(isinstance(r, IntRecipe) for r in recipes)

  def calibrate(*models):
    """Sets the models' LSQ steps from the first batch, all in one jitted call."""
    if needs_calibration:
      with calibrating():
        nnx.jit(lambda ms, b: [loss_fn(m, b) for m in ms])(models, batches[0])
    return models

  def quantized(r, rec=recipe):
    return quantize_model(float_model, rec, r, on_unmatched="ignore")

  full, = calibrate(quantized(base_rules))
  floats = {_name(p): m for p, m in nnx.iter_modules(float_model)}
  # path string -> attribute path (integers stay integers: keys of captures and grads)
  attr_paths = {_name(p): tuple(p) for p, _ in nnx.iter_modules(float_model)}
  found = sorted(_name(p) for p, m in nnx.iter_modules(full)
                 if type(m) is not type(floats.get(_name(p))))
  paths = shared.select_paths(who, found, candidates)
  weights = {}
  for p in paths:  # the layer's own parameters (not a child module's) of rank >= 2
    params = nnx.state(floats[p], nnx.Param)
    weights[p] = sum(v.get_value().size for k, v in nnx.to_flat_state(params)
                     if len(k) == 1 and jnp.ndim(v.get_value()) >= 2)

  alone = calibrate(*(quantized(shared.alone_rules(p, base_rules)) for p in paths))
  fb_alone = (() if fallback is None else
              calibrate(*(quantized(shared.alone_rules(p, base_rules, fallback), fallback)
                          for p in paths)))
  graphdef, state = nnx.split((float_model, full, alone, fb_alone))

  @jax.jit
  def measure(state, batch):
    fm, fq, als, fbs = nnx.merge(graphdef, state)
    lf, f_out, f_grads = _loss_capture_grads(fm, loss_fn, batch)
    out = {"float": lf, "batches": 1, "layers": {},
           "quantized": jnp.asarray(loss_fn(fq, batch), jnp.float32)}
    for i, p in enumerate(paths):
      lq, q_out, q_grads = _loss_capture_grads(als[i], loss_fn, batch)
      prefix = attr_paths[p]
      # The layer's own float parameters (kernel, bias; not LSQ steps) and outputs.
      keys = [k for k in f_grads if _under(k, prefix) and len(k) == len(prefix) + 1]
      row = {"loss": lq,
             "out": shared.squared_error(_pick(q_out, prefix, 1), _pick(f_out, prefix, 1)),
             "grad": shared.squared_error([q_grads[k] for k in keys],
                                          [f_grads[k] for k in keys])}
      if fallback is not None:
        row["fallback"] = jnp.asarray(loss_fn(fbs[i], batch), jnp.float32)
      out["layers"][p] = row
    return out

  sums = None
  for batch in batches:
    sums = shared.add(sums, measure(state, batch))
  float_total = float(sums["float"])

  def evaluate(eval_rules) -> float:
    q, = calibrate(quantized(normalize_rules(eval_rules)))
    gd, st = nnx.split(q)
    loss = jax.jit(lambda st, b: jnp.asarray(loss_fn(nnx.merge(gd, st), b), jnp.float32))
    total = sum(float(loss(st, b)) for b in batches)
    return total / float_total - 1

  return shared.build_result(recipe=recipe, fallback=fallback, rules=base_rules, sums=sums,
                             paths=paths, weights=weights,
                             high_precision_bits=high_precision_bits, evaluate=evaluate)

