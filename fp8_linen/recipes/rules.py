"""Which modules a model-level quantizer quantizes: :class:`QuantizationRule`.

Shared by the Linen :func:`~fp8_linen.quantize_model` (rules matched against
the module running each op) and :func:`fp8_linen.nnx.quantize_model` (rules
matched against each float layer's path in the NNX graph), so it lives here,
below both.

Example:
  >>> from fp8_linen.recipes.rules import QuantizationRule, normalize_rules
  >>> normalize_rules(QuantizationRule(module_path='head', ops='einsum'))[0].ops
  ('einsum',)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["OPS", "QuantizationRule", "normalize_rules"]

OPS = ("dot_general", "einsum", "conv")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationRule:
  """Which modules are quantized, and how.

  Rules are tried in order; the first whose ``module_path`` matches the path of
  the module running an op (``'/'.join(module.path)``, e.g.
  ``'decoder/layers_0/attn/query'``; ``re.fullmatch``) and whose ``ops`` include
  the op decides.

  Attributes:
    module_path: regular expression matched against the whole module path.
    quantize: ``False`` keeps the matched modules in their original precision.
    recipe: the recipe for matched modules (``None``: the one given to
      :func:`quantize_model`).
    ops: which op kinds the rule applies to (a subset of :data:`OPS`).

  Example:
    >>> import fp8_linen as fl
    >>> fl.QuantizationRule(module_path='.*logits', quantize=False).quantize
    False
  """

  module_path: str = ".*"
  quantize: bool = True
  recipe: Any = None
  ops: tuple[str, ...] = OPS

  def __post_init__(self):
    try:
      re.compile(self.module_path)
    except re.error as e:
      raise ValueError(f"QuantizationRule.module_path={self.module_path!r} is not a valid "
                       f"regular expression: {e}") from None
    ops_ = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
    bad = [o for o in ops_ if o not in OPS]
    if bad or not ops_:
      raise ValueError(f"QuantizationRule.ops={self.ops!r}: allowed values are {list(OPS)}")
    object.__setattr__(self, "ops", ops_)
    if not isinstance(self.quantize, bool):
      raise ValueError(f"QuantizationRule.quantize={self.quantize!r} must be True or False")


def normalize_rules(rules) -> tuple[QuantizationRule, ...]:
  """``rules`` as a checked tuple (``None``: quantize everything)."""
  if rules is None:
    return (QuantizationRule(),)
  if isinstance(rules, QuantizationRule):
    rules = (rules,)
  rules = tuple(rules)
  for r in rules:
    if not isinstance(r, QuantizationRule):
      raise TypeError(f"rules must be QuantizationRule values, got {type(r).__name__}")
  return rules
