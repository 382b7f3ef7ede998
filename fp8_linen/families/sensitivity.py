"""Precision chosen by measurement, written once for both Flax APIs.

``fl.sensitivity`` (Linen) and ``fl.nnx.sensitivity`` (NNX) measure, on a
few batches, what quantizing each layer *alone* with a candidate recipe does
to a float model, and return a :class:`SensitivityResult`. Everything that
does not depend on the Flax API lives here: the checks of the arguments, the
rules that quantize one layer alone (:func:`alone_rules`) or keep a set of
layers in higher precision (:func:`keep_rules`), the metric sums
(:func:`squared_error`), the bytes a recipe stores per weight element
(:func:`weight_bits`) and the choice of the layers to keep
(:meth:`SensitivityResult.choice`): the fewest bytes (or layers) whose
measured loss meets a relative budget.

The front ends give the result a function that evaluates the model under any
rule list on the measured batches (``evaluate``): the choice predicts from
the per-layer measurements, then verifies its prediction with that function
and corrects it, so the loss a :class:`PrecisionChoice` reports is measured,
not estimated.

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.families import sensitivity
  >>> [r.module_path for r in sensitivity.alone_rules('mlp/fc2', fl.projection_rules())][:2]
  ['(?!mlp/fc2\\\\Z).*', '.*']
  >>> sensitivity.weight_bits(fl.nvfp4(), 16)
  4.03125
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8_linen.families import calibration
from fp8_linen.families.table import check_recipe
from fp8_linen.recipes.fp8 import Fp8Recipe, Fp8WeightOnly
from fp8_linen.recipes.integer import IntRecipe
from fp8_linen.recipes.rules import QuantizationRule, normalize_rules

__all__ = ["LayerSensitivity", "PrecisionChoice", "SensitivityResult", "alone_rules",
           "keep_rules", "check_arguments", "check_budget", "select_paths", "squared_error",
           "relative", "weight_bits", "build_result", "add", "METRICS", "COSTS"]

METRICS = ("loss_change", "output_error", "grad_error")
COSTS = ("bytes", "layers")


# ---------------------------------------------------------------------------------------------
# Rules


def _alternation(paths: Sequence[str]) -> str:
  return "(?:" + "|".join(re.escape(p) for p in paths) + ")"


def alone_rules(path: str, rules: Sequence[QuantizationRule], recipe=None) -> tuple:
  """Rules that quantize the module at ``path`` as ``rules`` would, and nothing else.

  The first rule keeps every other module in high precision (a negative
  look-ahead on the whole path); the user's rules then decide, for ``path``
  alone, which of its products are quantized and with which recipe, so
  operand filters (``operands='weight'``) and per-rule recipes still apply.

  Args:
    path: the module path (``'/'.join``), as rules match it.
    rules: the rules of the fully quantized model.
    recipe: if given, every quantizing rule uses it (the fallback's
      measurement) instead of its own.
  """
  rules = normalize_rules(rules)
  if recipe is not None:
    rules = tuple(dataclasses.replace(r, recipe=recipe) if r.quantize else r for r in rules)
  return (QuantizationRule(module_path=f"(?!{re.escape(path)}\\Z).*", quantize=False),) + rules


def keep_rules(paths: Sequence[str], rules: Sequence[QuantizationRule],
               fallback=None) -> tuple:
  """``rules`` with the modules at ``paths`` kept out of the candidate recipe.

  Without a fallback one rule, first, keeps every product of those modules
  in the model's own precision. With one, each of the user's rules is
  repeated first, restricted to those modules (a look-ahead on the whole
  path) and with the fallback recipe where it quantizes: the kept modules
  quantize exactly the products the rules quantize, in the fallback recipe.
  The restricted copies are ``optional`` (a copy that matches nothing is
  not reported).
  """
  rules = normalize_rules(rules)
  paths = tuple(paths)
  if not paths:
    return rules
  if fallback is None:
    return (QuantizationRule(module_path=_alternation(paths), quantize=False),) + rules
  only = f"(?={_alternation(paths)}\\Z)"
  restricted = tuple(
      dataclasses.replace(r, module_path=f"{only}(?:{r.module_path})",
                          recipe=fallback if r.quantize else r.recipe, optional=True)
      for r in rules)
  return restricted + rules


# ---------------------------------------------------------------------------------------------
# Checks


def check_arguments(who: str, batches, recipe, fallback, loss_fn) -> list:
  """The batches as a list; errors name the argument at fault.

  Raises:
    ValueError: ``batches`` is empty or a batch holds NaN or infinite values.
    TypeError: ``batches`` is not a sequence, ``loss_fn`` is not callable,
      ``recipe`` / ``fallback`` is not a recipe.
  """
  check_recipe(f"{who}: recipe", recipe)
  if fallback is not None:
    check_recipe(f"{who}: fallback", fallback)
  if not callable(loss_fn):
    raise TypeError(f"{who}: loss_fn must be callable as loss_fn(model, batch) -> scalar loss, "
                    f"got {type(loss_fn).__name__}")
  return calibration.batch_list(who, batches, needs="the measurement",
                                each="each what loss_fn takes", nan_harm="")


def select_paths(who: str, found: Sequence[str], candidates) -> tuple:
  """The found layer paths that ``candidates`` (regexes, ``re.fullmatch``) select.

  Raises:
    ValueError: nothing is quantized at all, or ``candidates`` selects none.
  """
  if not found:
    raise ValueError(f"{who}: no layer matched: the recipe and rules quantize no product of "
                     "the model (check rules=, e.g. with fl.product_report)")
  if candidates is None:
    return tuple(found)
  patterns = (candidates,) if isinstance(candidates, str) else tuple(candidates)
  for p in patterns:
    if not isinstance(p, str):
      raise TypeError(f"{who}: candidates must be regular expressions (str), got "
                      f"{type(p).__name__}")
  chosen = tuple(f for f in found if any(re.fullmatch(p, f) for p in patterns))
  if not chosen:
    raise ValueError(f"{who}: candidates={candidates!r} matched no quantized layer; the "
                     f"quantized layers are {list(found)}")
  return chosen


def check_budget(budget) -> float:
  if isinstance(budget, bool) or not isinstance(budget, (int, float)) or \
      not math.isfinite(budget) or budget <= 0:
    raise ValueError(f"choose: budget={budget!r} must be a relative loss increase > 0 "
                     "(e.g. 0.01: at most 1% above the float model's loss)")
  return float(budget)


# ---------------------------------------------------------------------------------------------
# Metric math


def squared_error(approx, exact) -> tuple[jax.Array, jax.Array]:
  """``(sum |approx - exact|^2, sum |exact|^2)`` over two pytrees of the same structure, in f32.

  Sums (not ratios) so batches add up before the one division at the end.
  """
  err = jnp.zeros((), jnp.float32)
  ref = jnp.zeros((), jnp.float32)
  for a, e in zip(jax.tree.leaves(approx), jax.tree.leaves(exact)):
    a, e = jnp.asarray(a, jnp.float32), jnp.asarray(e, jnp.float32)
    err += jnp.sum((a - e) ** 2)
    ref += jnp.sum(e ** 2)
  return err, ref


def relative(err: float, ref: float) -> float:
  """``sqrt(err / ref)``: 0 when both are 0, inf when only ``ref`` is."""
  if ref > 0:
    return math.sqrt(err / ref)
  return 0.0 if err == 0 else math.inf


def weight_bits(recipe, high_precision_bits: float) -> float | None:
  """Bits a served weight element takes under ``recipe`` (block and group scales included).

  ``None`` (no recipe: high precision) gives ``high_precision_bits``. Per
  tensor and per channel scales are left out (a few bytes per layer). Returns
  ``None`` for a recipe type this table does not know (a registered family).
  """
  if recipe is None:
    return float(high_precision_bits)
  if isinstance(recipe, Fp8Recipe):
    element = 4.0 if recipe.kernel.dtype.startswith("float4") else 8.0
    if recipe.granularity != "block":
      return element
    per_scale = recipe.block_size ** 2 if recipe.kernel_2d_blocks else recipe.block_size
    return element + 8.0 / per_scale
  if isinstance(recipe, Fp8WeightOnly):
    return 8.0
  if isinstance(recipe, IntRecipe):
    k = recipe.kernel
    if k is None:
      return float(high_precision_bits)
    extra = 0.0
    if k.granularity == "group" and k.group_size:
      extra = (32.0 if k.estimator == "lsq+" or not k.symmetric else 16.0) / k.group_size
    return float(k.bits) + extra
  return None


# ---------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSensitivity:
  """What quantizing one layer alone does, measured on the batches.

  Attributes:
    path: the layer's module path (``'/'.join``, as rules match it).
    loss_change: relative change of the mean loss when only this layer is
      quantized: ``loss / float_loss - 1`` (0.01 = 1% worse).
    output_error: relative error ``||y_q - y|| / ||y||`` of the layer's own
      outputs (its methods' return values) with only it quantized; its
      inputs are the float model's.
    grad_error: relative error of the gradient of the loss with respect to
      the layer's float parameters (kernel, bias) with only it quantized.
    weights: weight elements of the layer (its parameters of rank >= 2).
    fallback_loss_change: ``loss_change`` with the fallback recipe (``None``
      without a fallback).
  """

  path: str
  loss_change: float
  output_error: float
  grad_error: float
  weights: int
  fallback_loss_change: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionChoice:
  """The layers kept out of the candidate recipe, and what that measured.

  Attributes:
    rules: the rule list to quantize the model with (``quantize_model(model,
      recipe, rules=choice.rules)``): the kept layers' rules first, then the
      rules the measurement ran under.
    kept: the kept layers' paths, most valuable first.
    loss_change: the measured relative loss change of the model under
      ``rules`` on the measured batches (not an estimate).
    predicted_loss_change: what the per-layer measurements predicted for the
      first set tried (the quantized model's change minus each kept layer's).
    budget: the relative loss budget.
    met: ``loss_change <= budget``.
    weight_bytes: bytes of the candidate layers' weights under ``rules``
      (:func:`weight_bits`; ``nan`` where a recipe's size is unknown).
    evaluations: how many rule lists were evaluated to verify the choice.
  """

  rules: tuple
  kept: tuple
  loss_change: float
  predicted_loss_change: float
  budget: float
  met: bool
  weight_bytes: float
  evaluations: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class SensitivityResult:
  """Per-layer quantization sensitivity of a model, and the precision it supports.

  Returned by :func:`fp8_linen.sensitivity` and :func:`fp8_linen.nnx.sensitivity`.

  Attributes:
    recipe: the candidate recipe.
    fallback: the recipe kept layers get (``None``: the model's own precision).
    rules: the rules the model was quantized by (the default: every product).
    float_loss: the float model's mean loss on the batches.
    quantized_loss_change: relative loss change with every candidate layer
      quantized (measured).
    layers: a :class:`LayerSensitivity` per candidate layer, the largest
      ``loss_change`` first.
    high_precision_bits: bits per weight element of a layer kept in the
      model's precision (for ``weight_bytes``; 16: bfloat16).
    evaluate: ``rules -> relative loss change`` of the model quantized by
      ``rules`` (with ``recipe``) on the same batches; what
      :meth:`choice` verifies with.
  """

  recipe: Any
  fallback: Any
  rules: tuple
  float_loss: float
  quantized_loss_change: float
  layers: tuple
  high_precision_bits: float = 16
  evaluate: Callable = dataclasses.field(repr=False, compare=False)

  @property
  def paths(self) -> tuple:
    """The candidate layers' paths, most sensitive (largest ``loss_change``) first."""
    return tuple(layer.path for layer in self.layers)

  def ranking(self, metric: str = "loss_change") -> tuple:
    """The paths sorted by ``metric`` (one of :data:`METRICS`), largest first."""
    if metric not in METRICS:
      raise ValueError(f"ranking: metric={metric!r}: allowed values are {list(METRICS)}")
    return tuple(layer.path for layer in sorted(self.layers, key=lambda s: -getattr(s, metric)))

  def layer(self, path: str) -> LayerSensitivity:
    """The :class:`LayerSensitivity` of ``path``."""
    for layer in self.layers:
      if layer.path == path:
        return layer
    raise KeyError(f"layer: {path!r} is not a measured layer; they are {list(self.paths)}")

  def rules_keeping(self, paths: Sequence[str]) -> tuple:
    """The rule list keeping ``paths`` out of the recipe (in ``fallback``, or unquantized)."""
    paths = (paths,) if isinstance(paths, str) else tuple(paths)
    unknown = [p for p in paths if p not in self.paths]
    if unknown:
      raise ValueError(f"rules_keeping: paths {unknown} are not measured layers; they are "
                       f"{list(self.paths)}")
    return keep_rules(paths, self.rules, self.fallback)

  def weight_bytes(self, kept: Sequence[str] = ()) -> float:
    """Bytes of the candidate layers' weights with ``kept`` out of the recipe."""
    q = weight_bits(self.recipe, self.high_precision_bits)
    k = weight_bits(self.fallback, self.high_precision_bits)
    if q is None or k is None:
      return math.nan
    kept = set(kept)
    return sum(s.weights * (k if s.path in kept else q) for s in self.layers) / 8

  def _costs(self, cost) -> dict:
    if isinstance(cost, Mapping):
      missing = [p for p in self.paths if p not in cost]
      if missing:
        raise ValueError(f"choose: cost has no entry for layers {missing}")
      return {p: float(cost[p]) for p in self.paths}
    if cost not in COSTS:
      raise ValueError(f"choose: cost={cost!r}: allowed values are {list(COSTS)} or a mapping "
                       "path -> cost of keeping that layer (e.g. estimated step time)")
    if cost == "layers":
      return {p: 1.0 for p in self.paths}
    q = weight_bits(self.recipe, self.high_precision_bits)
    k = weight_bits(self.fallback, self.high_precision_bits)
    if q is None or k is None:
      raise ValueError(f"choose: cost='bytes' does not know how many bits "
                       f"{type(self.recipe if q is None else self.fallback).__name__} stores; "
                       "pass cost='layers' or a mapping")
    return {s.path: s.weights * (k - q) / 8 for s in self.layers}

  def choice(self, budget: float, *, cost="bytes", prune: bool = True) -> PrecisionChoice:
    """The cheapest set of layers to keep out of the recipe so the loss meets ``budget``.

    Greedy by value for cost: each layer's gain (its ``loss_change``, less
    its ``fallback_loss_change`` with a fallback) per unit of cost of keeping
    it. Layers are added in that order until the measured changes predict
    the budget is met; the rules are then *evaluated* on the batches, and
    further layers added (evaluating each time) while the measured loss is
    over budget. With ``prune``, kept layers whose removal still meets the
    budget are then dropped, the least valuable first (one evaluation each).

    Args:
      budget: the largest relative loss increase allowed over the float
        model (0.01: 1%).
      cost: ``'bytes'`` (weight bytes kept out of the recipe), ``'layers'``
        (their number), or a mapping path -> cost (e.g. the estimated step
        time a layer adds when kept: ``fl.testing.estimate``).
      prune: drop kept layers that turn out not to be needed.

    Returns:
      A :class:`PrecisionChoice` (``met=False`` when even every candidate
      kept does not meet the budget).

    Raises:
      ValueError: ``budget`` is not > 0, or ``cost`` is unknown.
    """
    budget = check_budget(budget)
    costs = self._costs(cost)
    gain = {s.path: s.loss_change - (s.fallback_loss_change or 0.0) for s in self.layers}

    def value(p):
      if costs[p] <= 0:
        return math.inf if gain[p] > 0 else -math.inf
      return gain[p] / costs[p]
    order = sorted(self.paths, key=lambda p: (-value(p), -gain[p]))
    cache = {(): self.quantized_loss_change}

    def measured(kept) -> float:
      key = tuple(sorted(kept))
      if key not in cache:
        cache[key] = float(self.evaluate(keep_rules(kept, self.rules, self.fallback)))
      return cache[key]

    kept, predicted = [], self.quantized_loss_change
    for p in order:
      if predicted <= budget:
        break
      kept.append(p)
      predicted -= gain[p]
    first_prediction = predicted
    loss = measured(kept)
    for p in order[len(kept):]:
      if loss <= budget:
        break
      kept.append(p)
      loss = measured(kept)
    if prune and loss <= budget:
      for p in reversed(list(kept)):
        trial = [k for k in kept if k != p]
        trial_loss = measured(trial)
        if trial_loss <= budget:
          kept, loss = trial, trial_loss
    return PrecisionChoice(
        rules=keep_rules(kept, self.rules, self.fallback), kept=tuple(kept), loss_change=loss,
        predicted_loss_change=first_prediction, budget=budget, met=loss <= budget,
        weight_bytes=self.weight_bytes(kept), evaluations=len(cache) - 1)

  def choose(self, budget: float, *, cost="bytes", prune: bool = True) -> tuple:
    """The rules of :meth:`choice` (layers kept first, then :attr:`rules`).

    Raises:
      ValueError: the budget cannot be met even with every candidate kept
        (or ``budget`` / ``cost`` is invalid).
    """
    c = self.choice(budget, cost=cost, prune=prune)
    if not c.met:
      raise ValueError(f"choose: budget={budget!r} cannot be met: with every candidate layer "
                       f"kept the loss changes by {c.loss_change:+.4%}")
    return c.rules

  def table(self) -> str:
    """The measurements as a Markdown table, most sensitive layer first."""
    fb = self.fallback is not None
    head = "| layer | loss change | output error | gradient error | weights |"
    head += " loss change (fallback) |" if fb else ""
    lines = [head, "| --- |" + " ---: |" * (5 if fb else 4)]
    for s in self.layers:
      row = (f"| `{s.path or '<root>'}` | {s.loss_change:+.3%} | {s.output_error:.4f} | "
             f"{s.grad_error:.4f} | {s.weights:,} |")
      if fb:
        row += f" {s.fallback_loss_change:+.3%} |"
      lines.append(row)
    return "\n".join(lines)


def build_result(*, recipe, fallback, rules, sums: Mapping, paths: Sequence[str],
                 weights: Mapping, high_precision_bits: float,
                 evaluate: Callable) -> SensitivityResult:
  """The result from the batch sums of a front end's measuring program.

  ``sums``: ``'float'`` and ``'quantized'`` (summed losses), and per path
  ``'loss'``, ``'out'`` and ``'grad'`` (``(err, ref)`` pairs) and, with a
  fallback, ``'fallback'`` (summed losses).

  Raises:
    ValueError: the float loss is not a positive finite number (a relative
      budget needs one).
  """
  float_loss = float(sums["float"])
  if not math.isfinite(float_loss) or float_loss <= 0:
    raise ValueError(f"loss_fn: the float model's loss on the batches is {float_loss}; a "
                     "relative loss budget needs a positive, finite loss")
  layers = []
  for p in paths:
    s = sums["layers"][p]
    layers.append(LayerSensitivity(
        path=p, loss_change=float(s["loss"]) / float_loss - 1,
        output_error=relative(*map(float, s["out"])), grad_error=relative(*map(float, s["grad"])),
        weights=int(weights[p]),
        fallback_loss_change=(None if fallback is None
                              else float(s["fallback"]) / float_loss - 1)))
  layers.sort(key=lambda s: -s.loss_change)
  n = sums["batches"]
  return SensitivityResult(
      recipe=recipe, fallback=fallback, rules=normalize_rules(rules),
      float_loss=float_loss / n,
      quantized_loss_change=float(sums["quantized"]) / float_loss - 1, layers=tuple(layers),
      high_precision_bits=high_precision_bits, evaluate=evaluate)


def add(total, new):
  """``total + new`` leaf by leaf (``total`` may be ``None``), as NumPy float64."""
  new = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(new))
  return new if total is None else jax.tree.map(np.add, total, new)
