"""Swap the float layers of an NNX model for their quantized twins.

:func:`quantize_model` walks the NNX module graph, matches each ``nnx.Linear``,
``nnx.LinearGeneral``, ``nnx.Einsum`` and ``nnx.Conv`` path
(``'/'.join`` of the attribute path from the root, e.g. ``'blocks/0/mlp/up'``)
against :class:`~fp8_linen.QuantizationRule` s (first match wins, as for the
Linen :func:`~fp8_linen.quantize_model`) and puts the :mod:`fp8_linen.nnx` twin
of every quantized layer in its place. The twin holds the *same* ``nnx.Param``
variables and the same configuration (``dtype``, ``param_dtype``,
``use_bias``, ``precision``, ...), so ``nnx.state(model, nnx.Param)`` keeps its
structure and values (LSQ recipes add their learned steps) and the outputs are
the float model's up to quantization.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
  ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
  >>> qmodel = fl.nnx.quantize_model(model, rules=[
  ...     fl.QuantizationRule(module_path='layers/2', quantize=False),
  ...     fl.QuantizationRule(module_path='.*')])
  >>> [type(m).__module__.split('.')[0] for m in qmodel.layers[::2]]
  ['fp8_linen', 'flax']
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
from flax import nnx
from jax import lax

from fp8_linen.core import mesh
from fp8_linen.nnx import activation, layers, ops
from fp8_linen.nnx.training import Optimizer
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.rules import (QuantizationRule, first_match, normalize_rules,
                                      operand_kinds, report_unmatched)

__all__ = ["quantize_model", "switch_precision"]


def _common(old) -> dict:
  kw = dict(dtype=old.dtype, param_dtype=old.param_dtype, precision=old.precision,
            promote_dtype=old.promote_dtype,
            preferred_element_type=old.preferred_element_type)
  # The twin is built around the float layer's values, not fresh random ones
  # (LSQ weight steps are initialised from this kernel).
  kernel, bias = old.kernel[...], None if old.bias is None else old.bias[...]
  kw["kernel_init"] = lambda *_: kernel
  if bias is not None:
    kw["bias_init"] = lambda *_: bias
  return kw


def _make(float_cls, twin_cls, recipe, *args, **kw):
  """``twin_cls(..., recipe=recipe)``, or ``float_cls(...)`` when ``recipe`` is None."""
  if recipe is None:
    return float_cls(*args, rngs=nnx.Rngs(0), **kw)
  return twin_cls(*args, recipe=recipe, rngs=nnx.Rngs(0), **kw)


def _is_twin(node) -> bool:
  return type(node) in _FLOAT


def _linear(old, recipe):
  if not _is_twin(old) and old.dot_general is not lax.dot_general:
    return "a custom dot_general"
  return _make(nnx.Linear, layers.Linear, recipe, old.in_features, old.out_features,
               use_bias=old.use_bias, **_common(old))


def _linear_general(old, recipe):
  if not _is_twin(old) and (old.dot_general is not None or old.dot_general_cls is not None):
    return "a custom dot_general"
  return _make(nnx.LinearGeneral, layers.LinearGeneral, recipe, old.in_features,
               old.out_features, axis=old.axis, batch_axis=old.batch_axis,
               use_bias=old.use_bias, **_common(old))


def _einsum(old, recipe):
  if not _is_twin(old) and old.einsum_op is not jnp.einsum:
    return "a custom einsum_op"
  return _make(nnx.Einsum, layers.Einsum, recipe, old.einsum_str, old.kernel_shape,
               old.bias_shape, **_common(old))


def _conv(old, recipe):
  if not _is_twin(old) and old.conv_general_dilated is not lax.conv_general_dilated:
    return "a custom conv_general_dilated"
  if old.mask is not None:
    return "a kernel mask"
  return _make(nnx.Conv, layers.Conv, recipe, old.in_features, old.out_features,
               old.kernel_size, old.strides, padding=old.padding,
               input_dilation=old.input_dilation, kernel_dilation=old.kernel_dilation,
               feature_group_count=old.feature_group_count, use_bias=old.use_bias,
               **_common(old))


# Exact float classes (subclasses may change the forward; our twins are
# subclasses too) -> (the rule op kind, the twin builder).
_TWINS = {
    nnx.Linear: ("dot_general", _linear),
    nnx.LinearGeneral: ("dot_general", _linear_general),
    nnx.Einsum: ("einsum", _einsum),
    nnx.Conv: ("conv", _conv),
}

# Twin class -> the flax class it stands in for.
_FLOAT = {layers.Linear: nnx.Linear, layers.LinearGeneral: nnx.LinearGeneral,
          layers.Einsum: nnx.Einsum, layers.Conv: nnx.Conv}


def quantize_model(model: nnx.Module, recipe: Any = None,
                   rules: Sequence[QuantizationRule] | None = None, *, example: Any = None,
                   on_unmatched: str = "warn", on_unquantized: str = "warn") -> nnx.Module:
  """A copy of ``model`` with its products quantized by path rules.

  Two mechanisms, one rule list. **flax's layers** (the fast path): every
  ``nnx.Linear``/``nnx.LinearGeneral`` (rule op ``'dot_general'``),
  ``nnx.Einsum`` (``'einsum'``) and ``nnx.Conv`` (``'conv'``) whose path
  (``'/'.join`` of its attribute path, e.g. ``'blocks/0/attn/query'``;
  ``re.fullmatch``) is quantized by the first matching rule becomes
  :class:`~fp8_linen.nnx.Linear`/:class:`~fp8_linen.nnx.LinearGeneral`/
  :class:`~fp8_linen.nnx.Einsum`/:class:`~fp8_linen.nnx.Conv` with the same
  configuration and the very same ``nnx.Param`` variables. Only those exact
  classes are replaced (subclasses, including the ``fl.nnx`` layers, are left
  as they are); a layer shared by several paths becomes one shared twin.

  **Products in the model's own code** (with ``example``): the
  ``jax.lax.dot_general`` / ``jnp.einsum`` / ``jnp.matmul`` / ``jnp.dot`` /
  ``jax.lax.conv_general_dilated`` / ``jax.lax.ragged_dot`` calls its own
  modules make (MaxText's ``DenseGeneral``, EasyDeL's ``ParallelLinear``, a
  hand-written attention) are found by running ``example`` once, abstractly,
  and each one a rule quantizes gets a :class:`~fp8_linen.nnx.ProductSite`
  holding its state, named after its module and its place in the method
  (``<module path>/dot_general_0``; the rule matches the module path).
  Operand kinds work as in the Linen ``quantize_model``
  (:func:`~fp8_linen.projection_rules`: projections quantized; attention
  math and the logits head, tied or untied, kept). How it works and its
  limits: :mod:`fp8_linen.nnx.ops`. Without ``example`` only flax's layers
  are quantized.

  A new model is returned (``model`` is not modified), built with
  ``nnx.recursive_map``: it shares its variables with ``model``, so use one of
  the two (``model = fl.nnx.quantize_model(model)``) and create the optimizer
  after quantizing.

  Args:
    model: an NNX module (or graph of modules).
    recipe: the default recipe (:class:`~fp8_linen.Fp8Recipe` if ``None``).
    rules: ordered :class:`~fp8_linen.QuantizationRule` list; the first rule
      whose ``module_path`` matches and whose ``ops`` include the layer's op
      decides (default: quantize every layer).
    example: the arguments of one forward call, ``model(*example)`` (arrays or
      ``jax.ShapeDtypeStruct`` s; nothing is computed, except with an LSQ
      recipe: one run of the example arrays then sets the learned steps), or a
      function of the model that runs it (``lambda m: m.decode(tokens)``);
      ``None``: flax's layers only.
    on_unmatched: ``'warn'``, ``'raise'`` or ``'ignore'`` for rules that match
      no layer.
    on_unquantized: ``'warn'``, ``'raise'`` or ``'ignore'`` for products of
      the example run that the interception never sees (``x @ w``); only with
      ``example``.

  Returns:
    The quantized model.

  Raises:
    ValueError: a quantized layer has a custom product function or a kernel
      mask (exclude it with ``quantize=False``); a product of the model's own
      code would learn quantizer parameters (LSQ) from an example of shapes
      only, or inside layers stacked under ``nnx.scan``; or
      (``on_unmatched='raise'``) a rule matched nothing.
    TypeError: ``example`` is neither a tuple nor a function.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> float_model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> model = fl.nnx.quantize_model(float_model, fl.current_scaling())
    >>> type(model).__name__, bool((model.kernel[...] == float_model.kernel[...]).all())
    ('Linear', True)
  """
  for name, value in (("on_unmatched", on_unmatched), ("on_unquantized", on_unquantized)):
    if value not in ("warn", "raise", "ignore"):
      raise ValueError(f"{name}={value!r}: allowed values are 'warn', 'raise', 'ignore'")
  if example is not None and not (callable(example) or isinstance(example, (tuple, list))):
    raise TypeError(f"quantize_model: example must be a tuple of the model's arguments or a "
                    f"function of the model that runs it, got {type(example).__name__}")
  rules = normalize_rules(rules)
  recipe = recipe or Fp8Recipe()
  hits = [0] * len(rules)
  table = _vocabulary(model)

  def swap(path, node):
    entry = _TWINS.get(type(node))
    if entry is None:
      return node
    op, build = entry
    name = "/".join(str(p) for p in path)
    # A layer's product multiplies its own kernel: a weight, and the logits head's
    # when the kernel has the vocabulary table's shape (an untied head).
    shape = node.kernel[...].shape
    i = first_match(rules, op, name, operand_kinds([shape], [shape], table))
    if i is None:
      return node
    hits[i] += 1
    rule = rules[i]
    if not rule.quantize:
      return node
    try:
      twin = build(node, rule.recipe or recipe)
    except (TypeError, ValueError, NotImplementedError) as e:
      raise type(e)(f"quantize_model: layer {name!r}: {e}") from e
    if isinstance(twin, str):
      raise ValueError(f"quantize_model: layer {name!r} ({type(node).__name__}) has "
                       f"{twin}, which the quantized twin replaces; exclude it with "
                       f"QuantizationRule(module_path={name!r}, quantize=False)")
    twin = _same_variables(twin, node)
    setattr(twin, ops.PATH_ATTR, name)
    return twin

  out = nnx.recursive_map(swap, model)
  if example is not None:
    library = tuple(_FLOAT) + (layers.Fp8Einsum, activation.Quantizer, ops.ProductSite)
    more = ops.attach(out, rules, recipe, example, library=library, float_layers=tuple(_TWINS),
                      on_unquantized=on_unquantized)
    hits = [a + b for a, b in zip(hits, more)]
  report_unmatched(rules, hits, on_unmatched, stacklevel=2,
                   what="fp8_linen.nnx.quantize_model: these rules matched no layer (check "
                        "the paths, e.g. with nnx.iter_graph)")
  return out


def _vocabulary(model):
  """The sorted shape of the largest ``nnx.Embed`` table of ``model``, or ``None``."""
  tables = [m.embedding[...].shape for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Embed)]
  return tuple(sorted(max(tables))) if tables else None


def _same_variables(new, old):
  """``new`` holding ``old``'s very ``kernel`` and ``bias`` (values, sharding, identity)."""
  new.kernel = old.kernel
  if old.bias is not None:
    new.bias = old.bias
  return new


def _float_layer(path, node):
  """The flax layer a twin stands in for, with the twin's ``kernel`` and ``bias``."""
  if isinstance(node, layers.Fp8Einsum):
    raise ValueError(f"switch_precision: layer {'/'.join(map(str, path))!r} is an "
                     "fl.nnx.Fp8Einsum (flax's Fp8Einsum call): it has no float twin here; "
                     "build the model with the float einsum and quantize it with "
                     "fl.nnx.quantize_model")
  float_cls = _FLOAT.get(type(node))
  if float_cls is None:
    return node
  learned = sorted(k for k, _ in nnx.to_flat_state(nnx.state(node, nnx.Param))
                   if k[0] not in ("kernel", "bias"))
  if learned:
    raise ValueError(
        f"switch_precision: layer {'/'.join(map(str, path))!r} learns quantizer parameters "
        f"({['/'.join(map(str, k)) for k in learned]}, an LSQ recipe); the optimizer's state "
        "holds them, so this layer cannot change precision mid-run: train it with an STE "
        "recipe, or convert the finished model (fl.nnx.convert)")
  return _same_variables(_TWINS[float_cls][1](node, None), node)


def switch_precision(model: nnx.Module, optimizer: nnx.Optimizer, recipe: Any = None,
                     rules: Sequence[QuantizationRule] | None = None, *,
                     example: Any = None, on_unmatched: str = "warn"):
  """Goes on training ``model`` in another precision: a schedule, not a restart.

  The NNX form of :func:`fp8_linen.switch_precision` (a precision tail:
  NVIDIA's NVFP4 recipe ends its run in bf16). Every quantized twin
  (``fl.nnx.Linear``, ``LinearGeneral``, ``Einsum``, ``Conv``) becomes the
  flax layer it stands in for, holding the very same ``nnx.Param`` s; with a
  ``recipe`` the result is quantized again by :func:`quantize_model` (fresh
  quantization state for the new recipe: the old recipe's scales mean
  nothing to it). The optimizer comes back with the same step and optimizer
  state, attached to the new model.

  Products quantized inside the model's own code (:func:`quantize_model`'s
  ``example``) switch the same way: their modules run in float again, their
  :class:`~fp8_linen.nnx.ProductSite` s and state dropped, and with a
  ``recipe`` the model is quantized again, which finds those products by
  running ``example`` once more (required then).

  Args:
    model: the NNX model so far.
    optimizer: its ``nnx.Optimizer`` (or :class:`~fp8_linen.nnx.Optimizer`).
    recipe: the new recipe, or ``None``: float from now on.
    rules: :func:`quantize_model`'s rules for the new recipe (``None``: every
      layer); only with a ``recipe``.
    example: :func:`quantize_model`'s ``example`` for the new recipe; needed
      when ``model`` has products quantized inside its own modules' code.
    on_unmatched: :func:`quantize_model`'s handling of unmatched rules.

  Returns:
    ``(model, optimizer)``: use these from now on (jitted steps compile again
    for the new model). The optimizer is an :class:`~fp8_linen.nnx.Optimizer`,
    whatever the new precision.

  Raises:
    ValueError: ``rules`` without a ``recipe``; a ``recipe`` for a model with
      products quantized in its own code but no ``example``; a layer learns
      quantizer parameters (LSQ), or is an ``fl.nnx.Fp8Einsum``, naming it.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = fl.nnx.Linear(32, 8, recipe=fl.nvfp4(), rngs=nnx.Rngs(0))
    >>> opt = fl.nnx.Optimizer(model, optax.adam(1e-3))
    >>> model, opt = fl.nnx.switch_precision(model, opt)   # the bf16 tail
    >>> type(model).__module__, int(opt.step[...])
    ('flax.nnx.nn.linear', 0)
  """
  if rules is not None and recipe is None:
    raise ValueError("switch_precision: rules need a recipe (recipe=None trains every layer "
                     "in float)")
  if not isinstance(optimizer, nnx.Optimizer):
    raise TypeError("switch_precision: optimizer must be the model's nnx.Optimizer, got "
                    f"{type(optimizer).__name__}")
  new = model
  if ops.has_sites(model):
    if recipe is not None and example is None:
      raise ValueError("switch_precision: the model has products quantized inside its own "
                       "modules' code (fl.nnx.quantize_model's example=), which the new "
                       "recipe finds by running the model once: pass example= (the "
                       "arguments of one forward call, as to quantize_model)")
    new = ops.detach(model)
  new = nnx.recursive_map(_float_layer, new)
  if recipe is not None:
    new = quantize_model(new, recipe, rules, example=example, on_unmatched=on_unmatched)
  before = nnx.to_flat_state(nnx.state(model, optimizer.wrt))
  after = nnx.to_flat_state(nnx.state(new, optimizer.wrt))
  if [k for k, _ in before] != [k for k, _ in after]:
    gone = sorted(set(k for k, _ in before) - set(k for k, _ in after))
    added = sorted(set(k for k, _ in after) - set(k for k, _ in before))
    raise ValueError(
        "switch_precision: the new model's optimized variables differ from the old model's "
        f"(missing: {['/'.join(map(str, k)) for k in gone][:4]}, added: "
        f"{['/'.join(map(str, k)) for k in added][:4]}: a recipe that learns quantizer "
        "parameters, LSQ, adds some), so the optimizer state cannot follow; switch to a "
        "recipe without learned parameters (STE)")
  # On one device, the new recipe's state goes where the trained variables live.
  nnx.update(new, mesh.placed_on(nnx.state(new), mesh.one_device_of(nnx.state(model, optimizer.wrt))))
  opt = Optimizer(new, optimizer.tx, wrt=optimizer.wrt)
  opt.step = optimizer.step
  opt.opt_state = optimizer.opt_state
  return new, opt
