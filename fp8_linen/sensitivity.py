"""Which layers a recipe can take, by measurement: :func:`sensitivity` (Linen).

From a float Linen model (or one trained with QAT), its variables and a few
batches, :func:`sensitivity` quantizes each layer *alone* with a candidate
recipe (by :func:`~fp8_linen.quantize_model` rules: every other module kept
in high precision) and measures what that does: the relative change of the
loss, the relative error of the layer's outputs and of the gradient of the
loss with respect to the layer's parameters. The layers are the modules
whose products the fully quantized model quantizes (found by
:func:`~fp8_linen.product_report`). All layers are measured in one jitted
program per batch. The :class:`~fp8_linen.SensitivityResult` ranks them and
chooses the rules that keep the fewest bytes (or layers) out of the recipe
while the loss stays within a budget, verified by evaluating the model under
those rules (:mod:`fp8_linen.families.sensitivity`, shared with
:func:`fp8_linen.nnx.sensitivity`).

The quantizers start fresh: fp8 and integer STE state from ``init`` (empty
amax histories, so every batch is scaled by its own amax, as current scaling
does and as delayed scaling does on its first step), learned LSQ steps from
the float model's activations on the first batch unless ``variables`` holds
them (a QAT model's). A trained ``_overwrite_with_gradient`` collection in
``variables`` is not used: the measurement asks what the recipe's numbers do
to each layer, not what one history did.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen.core.owg import OWG
from fp8_linen.families import sensitivity as shared
from fp8_linen.families.sensitivity import LayerSensitivity, PrecisionChoice, SensitivityResult
from fp8_linen.model_quantization import QuantizedModel, quantize_model
from fp8_linen.product_report import product_report
from fp8_linen.recipes.rules import QuantizationRule, normalize_rules

__all__ = ["sensitivity", "SensitivityResult", "LayerSensitivity", "PrecisionChoice"]

_INTERMEDIATES = "intermediates"


def _forward(apply, variables, box=None, capture=None) -> Callable:
  """``apply`` bound to ``variables``, as ``loss_fn`` calls it; captures into ``box``."""
  def forward(*args, **kwargs):
    if box is None:
      return apply(variables, *args, **kwargs)
    out, state = apply(variables, *args, capture_intermediates=capture,
                       mutable=[_INTERMEDIATES], **kwargs)
    box.append(flax.core.unfreeze(state).get(_INTERMEDIATES, {}))
    return out
  return forward


def _subtree(tree, path: str):
  for part in (path.split("/") if path else ()):
    if not isinstance(tree, Mapping) or part not in tree:
      return {}
    tree = tree[part]
  return tree


def _own(node) -> dict:
  """A node's own leaves: a module's method outputs or parameters, its children's left out."""
  return {k: v for k, v in node.items() if not isinstance(v, Mapping)} if isinstance(
      node, Mapping) else {}


def _flat(tree) -> dict:
  return flax.traverse_util.flatten_dict(flax.core.unfreeze(tree)) if tree else {}


def _extras(full: Mapping, base: Mapping) -> dict:
  """The variables of ``full`` that ``base`` does not hold (the quantizers' own)."""
  flat_full, flat_base = _flat(full), _flat(base)
  out = {k: v for k, v in flat_full.items() if k not in flat_base and k[0] != _INTERMEDIATES}
  return flax.traverse_util.unflatten_dict(out) if out else {}


def _merge(base: Mapping, extras: Mapping) -> dict:
  flat = _flat(base)
  flat.update(_flat(extras))
  return flax.traverse_util.unflatten_dict(flat)


def _module_paths(intermediates) -> set:
  """Every module path in a ``capture_intermediates=True`` tree."""
  out = set()

  def walk(node, path):
    out.add(path)
    for k, v in node.items():
      if isinstance(v, Mapping):
        walk(v, path + (k,))
  walk(flax.core.unfreeze(intermediates), ())
  return out


def _layer_of(scope: str, modules: set) -> str:
  """The module a product ran in, from its name stack (named scopes and holders skipped)."""
  path = ()
  for part in scope.split("/"):
    if path + (part,) in modules:
      path += (part,)
  return "/".join(path)


def sensitivity(model: nn.Module, variables: Mapping, batches: Sequence, *, recipe,
                loss_fn: Callable, candidates=None,
                rules: Sequence[QuantizationRule] | None = None, fallback=None,
                high_precision_bits: float = 16, seed: int = 0) -> SensitivityResult:
  """Measures each layer's quantization sensitivity for ``recipe`` on a few batches.

  Args:
    model: an unmodified Linen model (quantized here by
      :func:`~fp8_linen.quantize_model` rules, as :func:`~fp8_linen.ptq`
      takes it).
    variables: its trained variables (``{'params': ...}``, plus e.g.
      ``batch_stats``; a QAT run's LSQ steps are used, its fp8 / observer
      state is not).
    batches: a few batches, each what ``loss_fn`` takes.
    recipe: the candidate recipe (``fl.nvfp4()``, ``fl.mx_block_scaling()``,
      ``fl.delayed_scaling()``, ``fl.int8_lsq()``, ``fl.int4_lsq_plus()``, ...).
    loss_fn: ``loss_fn(forward, batch) -> scalar``, where ``forward(*args,
      **kwargs)`` runs the model (float or quantized) on its variables, e.g.
      ``lambda f, b: xent(f(b['x']), b['y'])``. Deterministic (no dropout).
    candidates: regular expressions (``re.fullmatch``) selecting which of
      the quantized layers to measure (default: all of them).
    rules: the :class:`~fp8_linen.QuantizationRule` list the model is
      quantized by (default: every product; e.g.
      :func:`~fp8_linen.projection_rules`). The layers are the modules in
      which these rules quantize a product.
    fallback: the recipe a kept layer gets (e.g. ``fl.mx_block_scaling()``
      next to NVFP4); ``None`` keeps it in the model's own precision. With a
      fallback every layer is measured in it too.
    high_precision_bits: bits per weight element of a layer kept in the
      model's precision, for the byte counts (16: bfloat16).
    seed: the key that initialises the quantizers' learned parameters.

  Returns:
    A :class:`~fp8_linen.SensitivityResult`: per layer a
    :class:`~fp8_linen.LayerSensitivity`, the most sensitive first;
    ``result.choose(budget)`` returns the rules meeting a relative loss
    budget with the fewest bytes kept out of the recipe.

  Raises:
    ValueError: naming the argument: empty ``batches``, a batch with NaN or
      infinite values, no quantized layer (``rules``) or none selected
      (``candidates``), a float loss that is not positive.
    TypeError: an unknown recipe, a ``loss_fn`` that is not callable, a
      model that is not an unmodified Linen module.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
    >>> import fp8_linen as fl
    >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(32), nn.relu, nn.Dense(4)])
    >>> x = jax.random.normal(jax.random.key(0), (64, 8))
    >>> y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    >>> params = model.init(jax.random.key(2), x)          # ... trained in float
    >>> xent = lambda f, b: optax.softmax_cross_entropy_with_integer_labels(f(b[0]), b[1]).mean()
    >>> res = fl.sensitivity(model, params, [(x, y)], recipe=fl.int4_lsq_plus(), loss_fn=xent)
    >>> sorted(res.paths)
    ['layers_0', 'layers_2', 'layers_4']
    >>> choice = res.choice(budget=0.01)                  # at most 1% above the float loss
    >>> choice.met, choice.loss_change <= 0.01
    (True, True)
    >>> qmodel = fl.quantize_model(model, fl.int4_lsq_plus(), rules=choice.rules)
  """
  who = "fl.sensitivity"
  if isinstance(model, QuantizedModel):
    raise TypeError(f"{who}: model is a QuantizedModel; pass the unmodified model and give "
                    "its recipe and rules (recipe=, rules=)")
  if not isinstance(model, nn.Module):
    raise TypeError(f"{who}: model must be a flax.linen Module, got {type(model).__name__} "
                    "(for an NNX model use fl.nnx.sensitivity)")
  if not isinstance(variables, Mapping) or "params" not in variables:
    raise TypeError(f"{who}: variables must be the model's variables ({{'params': ...}}), got "
                    f"{type(variables).__name__}")
  batches = shared.check_arguments(who, batches, recipe, fallback, loss_fn)
  base_rules = normalize_rules(rules)
  # A trained OWG collection is left out: every quantizer starts fresh (the module doc says why).
  fvars = {c: v for c, v in flax.core.unfreeze(variables).items() if c != OWG}
  key = jax.random.key(seed)

  def quantized(r, rec=recipe):
    return quantize_model(model, rec, r, on_unmatched="ignore", on_unquantized="ignore")

  def init_extras(qm, fv, batch):
    """The quantizers' variables, created from the float model's activations on ``batch``."""
    box = []

    def forward(*args, **kwargs):
      out, new = qm.apply(fv, *args, rngs={"params": key}, mutable=True, **kwargs)
      if not box:
        box.append(new)
      return out
    loss_fn(forward, batch)
    return _extras(box[0], fv)

  # The layers: modules whose products the fully quantized model quantizes.
  full = quantized(base_rules)
  full_extras = jax.eval_shape(functools.partial(init_extras, full), fvars, batches[0])
  report = product_report(lambda v, b: loss_fn(_forward(full.apply, v), b),
                          _merge(fvars, full_extras), batches[0])

  def capture_all(fv, b):
    box = []
    loss_fn(_forward(model.apply, fv, box, True), b)
    return box
  modules = set()
  for tree in jax.eval_shape(capture_all, fvars, batches[0]):
    modules |= _module_paths(tree)
  found = []
  for product in report.with_status("quantized"):
    path = _layer_of(product.scope, modules)
    if path not in found:
      found.append(path)
  paths = shared.select_paths(who, found, candidates)
  flat_params = _flat(fvars["params"])
  weights = {}
  for p in paths:  # the layer's weights: its own parameters (not its children's) of rank >= 2
    prefix = tuple(p.split("/")) if p else ()
    weights[p] = sum(v.size for k, v in flat_params.items()
                     if k[:-1] == prefix and jnp.ndim(v) >= 2)

  alone = {p: quantized(shared.alone_rules(p, base_rules)) for p in paths}
  fb_alone = ({} if fallback is None else
              {p: quantized(shared.alone_rules(p, base_rules, fallback), fallback)
               for p in paths})

  @jax.jit
  def init_all(fv, batch):
    return {"full": init_extras(full, fv, batch),
            "alone": {p: init_extras(qm, fv, batch) for p, qm in alone.items()},
            "fallback": {p: init_extras(qm, fv, batch) for p, qm in fb_alone.items()}}

  extras = init_all(fvars, batches[0])
  wanted = set(paths)

  @jax.jit
  def measure(fv, extras, batch):
    def float_loss(params):
      box = []
      loss = loss_fn(_forward(model.apply, dict(fv, params=params), box,
                              lambda m, _: "/".join(m.path) in wanted), batch)
      return jnp.asarray(loss, jnp.float32), box
    (lf, fbox), gf = jax.value_and_grad(float_loss, has_aux=True)(fv["params"])
    out = {"float": lf, "batches": 1, "layers": {},
           "quantized": jnp.asarray(loss_fn(_forward(full.apply, _merge(fv, extras["full"])),
                                             batch), jnp.float32)}
    for p, qm in alone.items():
      v = _merge(fv, extras["alone"][p])

      def q_loss(params, qm=qm, v=v, p=p):
        box = []
        loss = loss_fn(_forward(qm.apply, dict(v, params=params), box,
                                lambda m, _: "/".join(m.path) == p), batch)
        return jnp.asarray(loss, jnp.float32), box
      (lq, qbox), gq = jax.value_and_grad(q_loss, has_aux=True)(v["params"])
      # The layer's own float parameters (kernel, bias; not the quantizers' steps, nor a
      # child module's: the rules quantize the products of the module itself).
      g_float = _own(_subtree(gf, p))
      g_quant = _own(_subtree(gq, p))
      row = {"loss": lq,
             "out": shared.squared_error([_own(_subtree(b, p)) for b in qbox],
                                         [_own(_subtree(b, p)) for b in fbox]),
             "grad": shared.squared_error([g_quant[k] for k in g_float], list(g_float.values()))}
      if fallback is not None:
        row["fallback"] = loss_fn(_forward(fb_alone[p].apply,
                                           _merge(fv, extras["fallback"][p])), batch)
      out["layers"][p] = row
    return out

  sums = None
  for batch in batches:
    sums = shared.add(sums, measure(fvars, extras, batch))

  float_total = float(sums["float"])

  def evaluate(eval_rules) -> float:
    qm = quantized(normalize_rules(eval_rules))
    ex = jax.jit(functools.partial(init_extras, qm))(fvars, batches[0])
    loss = jax.jit(lambda fv, ex, b: jnp.asarray(
        loss_fn(_forward(qm.apply, _merge(fv, ex)), b), jnp.float32))
    total = sum(float(loss(fvars, ex, b)) for b in batches)
    return total / float_total - 1

  return shared.build_result(recipe=recipe, fallback=fallback, rules=base_rules, sums=sums,
                             paths=paths, weights=weights,
                             high_precision_bits=high_precision_bits, evaluate=evaluate)
