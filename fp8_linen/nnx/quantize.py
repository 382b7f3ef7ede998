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

import re
from typing import Any, Sequence

import jax.numpy as jnp
from flax import nnx
from jax import lax

from fp8_linen.nnx import layers
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.rules import QuantizationRule, normalize_rules, report_unmatched

__all__ = ["quantize_model"]


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


def _linear(old, recipe):
  if old.dot_general is not lax.dot_general:
    return "a custom dot_general"
  return layers.Linear(old.in_features, old.out_features, use_bias=old.use_bias,
                       recipe=recipe, rngs=nnx.Rngs(0), **_common(old))


def _linear_general(old, recipe):
  if old.dot_general is not None or old.dot_general_cls is not None:
    return "a custom dot_general"
  return layers.LinearGeneral(old.in_features, old.out_features, axis=old.axis,
                              batch_axis=old.batch_axis, use_bias=old.use_bias,
                              recipe=recipe, rngs=nnx.Rngs(0), **_common(old))


def _einsum(old, recipe):
  if old.einsum_op is not jnp.einsum:
    return "a custom einsum_op"
  return layers.Einsum(old.einsum_str, old.kernel_shape, old.bias_shape, recipe=recipe,
                       rngs=nnx.Rngs(0), **_common(old))


def _conv(old, recipe):
  if old.conv_general_dilated is not lax.conv_general_dilated:
    return "a custom conv_general_dilated"
  if old.mask is not None:
    return "a kernel mask"
  return layers.Conv(old.in_features, old.out_features, old.kernel_size, old.strides,
                     padding=old.padding, input_dilation=old.input_dilation,
                     kernel_dilation=old.kernel_dilation,
                     feature_group_count=old.feature_group_count, use_bias=old.use_bias,
                     recipe=recipe, rngs=nnx.Rngs(0), **_common(old))


# Exact float classes (subclasses may change the forward; our twins are
# subclasses too) -> (the rule op kind, the twin builder).
_TWINS = {
    nnx.Linear: ("dot_general", _linear),
    nnx.LinearGeneral: ("dot_general", _linear_general),
    nnx.Einsum: ("einsum", _einsum),
    nnx.Conv: ("conv", _conv),
}


def quantize_model(model: nnx.Module, recipe: Any = None,
                   rules: Sequence[QuantizationRule] | None = None, *,
                   on_unmatched: str = "warn") -> nnx.Module:
  """A copy of ``model`` with its matched float layers replaced by quantized twins.

  Every ``nnx.Linear``/``nnx.LinearGeneral`` (rule op ``'dot_general'``),
  ``nnx.Einsum`` (``'einsum'``) and ``nnx.Conv`` (``'conv'``) whose path
  (``'/'.join`` of its attribute path, e.g. ``'blocks/0/attn/query'``;
  ``re.fullmatch``) is quantized by the first matching rule becomes
  :class:`~fp8_linen.nnx.Linear`/:class:`~fp8_linen.nnx.LinearGeneral`/
  :class:`~fp8_linen.nnx.Einsum`/:class:`~fp8_linen.nnx.Conv` with the same
  configuration and the very same ``nnx.Param`` variables. Only those exact
  classes are replaced (subclasses, including the ``fl.nnx`` layers, are left
  as they are); a layer shared by several paths becomes one shared twin.

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
    on_unmatched: ``'warn'``, ``'raise'`` or ``'ignore'`` for rules that match
      no layer.

  Returns:
    The quantized model.

  Raises:
    ValueError: a quantized layer has a custom product function or a kernel
      mask (exclude it with ``quantize=False``), or (``on_unmatched='raise'``)
      a rule matched nothing.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> float_model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> model = fl.nnx.quantize_model(float_model, fl.current_scaling())
    >>> type(model).__name__, bool((model.kernel[...] == float_model.kernel[...]).all())
    ('Linear', True)
  """
  if on_unmatched not in ("warn", "raise", "ignore"):
    raise ValueError(f"on_unmatched={on_unmatched!r}: allowed values are 'warn', 'raise', "
                     "'ignore'")
  rules = normalize_rules(rules)
  recipe = recipe or Fp8Recipe()
  hits = [0] * len(rules)

  def swap(path, node):
    entry = _TWINS.get(type(node))
    if entry is None:
      return node
    op, build = entry
    name = "/".join(str(p) for p in path)
    for i, rule in enumerate(rules):
      if op in rule.ops and re.fullmatch(rule.module_path, name):
        hits[i] += 1
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
        # The very same variables (values, sharding metadata, identity).
        twin.kernel = node.kernel
        if node.bias is not None:
          twin.bias = node.bias
        return twin
    return node

  out = nnx.recursive_map(swap, model)
  report_unmatched(rules, hits, on_unmatched, stacklevel=2,
                   what="fp8_linen.nnx.quantize_model: these rules matched no layer (check "
                        "the paths, e.g. with nnx.iter_graph)")
  return out
