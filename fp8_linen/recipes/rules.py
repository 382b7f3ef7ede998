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
import warnings
from typing import Any

__all__ = ["OPS", "OPERANDS", "QuantizationRule", "high_precision_layers", "normalize_rules",
           "report_unmatched", "operand_kinds", "first_match"]

# Op kinds: the Linen quantize_model intercepts all five; the NNX one matches
# its layers as dot_general (Linear, LinearGeneral), einsum (Einsum) and conv.
OPS = ("dot_general", "einsum", "conv", "matmul", "dot", "ragged_dot")
OPERANDS = ("any", "weight", "activations", "embedding")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationRule:
  """Which products are quantized, and how.

  Rules are tried in order; the first whose ``module_path`` matches the path of
  the module running an op (``'/'.join(module.path)``, e.g.
  ``'decoder/layers_0/attn/query'``; ``re.fullmatch``), whose ``ops`` include
  the op and whose ``operands`` fit the product decides.

  Attributes:
    module_path: regular expression matched against the whole module path.
    quantize: ``False`` keeps the matched products in their original precision.
    recipe: the recipe for matched products (``None``: the one given to
      :func:`quantize_model`).
    ops: which op kinds the rule applies to (a subset of :data:`OPS`).
    operands: which products, by their operands: ``'any'``; ``'weight'`` (one
      operand is a weight: it has the shape, up to the order of its axes, of
      a ``params`` array the running module holds itself: projections,
      convolutions, ``Embed.attend``); ``'activations'`` (no operand is: the
      attention math ``q·k`` and ``p·v``); ``'embedding'`` (the weight is the
      vocabulary table: the product of an ``nn.Embed`` (``attend``), or a
      weight with the shape, up to transposition, of the largest ``nn.Embed``
      table run earlier in the same call: a tied or untied logits head. A
      projection whose weight has exactly that shape, ``(vocab, d)`` or
      ``(d, vocab)``, would count too; real vocabularies make that rare, tiny
      test configs need a vocabulary size unlike their other widths).
    optional: ``True``: never reported when it matches nothing (the rules of
      :func:`projection_rules` are; a model may have no attention).

  Example:
    >>> import fp8_linen as fl
    >>> fl.QuantizationRule(module_path='.*logits', quantize=False).quantize
    False
  """

  module_path: str = ".*"
  quantize: bool = True
  recipe: Any = None
  ops: tuple[str, ...] = OPS
  operands: str = "any"
  optional: bool = False

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
    if self.operands not in OPERANDS:
      raise ValueError(f"QuantizationRule.operands={self.operands!r}: allowed values are "
                       f"{list(OPERANDS)}")
    if not isinstance(self.optional, bool):
      raise ValueError(f"QuantizationRule.optional={self.optional!r} must be True or False")


def operand_kinds(own_shapes, operand_shapes, table=None, is_embedding=False, *,
                  op: str = "dot_general") -> set:
  """What a product's operands are, for :attr:`QuantizationRule.operands`.

  Args:
    own_shapes: the shapes of the parameters the running module holds itself.
    operand_shapes: the product's two operand shapes.
    table: the vocabulary table's shape seen so far (sorted), or ``None``.
    is_embedding: the running module is an embedding layer (its product is
      ``attend``).
    op: the product (one of :data:`OPS`): a ``ragged_dot``'s right operand,
      one matrix per group, is the experts' weights however the model holds
      them (gemma's ``MoERagged`` reads them from child modules and reshapes
      them first).

  Returns:
    ``{'weight', 'embedding'}``, ``{'weight'}`` or ``{'activations'}``: an
    operand is a weight when it has, up to the order of its axes, the shape
    of one of the module's own parameters (or is a grouped GEMM's experts).
  """
  own = {tuple(sorted(s)) for s in own_shapes if len(s) >= 1}
  weights = [w for w in (tuple(sorted(s)) for s in operand_shapes) if w in own]
  if op == "ragged_dot" and len(operand_shapes[1]) == 3:
    weights.append(tuple(sorted(operand_shapes[1])))
  if not weights:
    return {"activations"}
  if is_embedding or any(w == table for w in weights):
    return {"weight", "embedding"}
  return {"weight"}


def first_match(rules, op: str, path: str, kinds) -> int | None:
  """The index of the first rule that decides ``op`` at ``path`` with operands ``kinds``."""
  for i, rule in enumerate(rules):
    if (op in rule.ops and re.fullmatch(rule.module_path, path)
        and (rule.operands == "any" or rule.operands in kinds)):
      return i
  return None


def high_precision_layers(layer: str, num_layers: int, *, last: int = 1,
                          first: int = 0) -> tuple[QuantizationRule, ...]:
  """A rule keeping the first and last layers of a stack in the model's own precision.

  NVIDIA's NVFP4 pretraining recipe quantizes most linear layers to 4 bits
  but keeps a few numerically sensitive ones in higher precision, mostly
  the last layers of the network (their weight gradients carry the largest
  quantization error); training diverged with every layer in FP4. Put the
  rule before the others: rules are tried in order.

  Args:
    layer: the module path of layer ``i`` as a regular expression with an
      ``{i}`` placeholder, e.g. ``'block{i}'``, ``'decoder/layers_{i}'`` or
      ``'block{i}/mlp'`` (only that part of each layer). It matches the layer
      anywhere in the path and every module under it.
    num_layers: how many layers the stack has.
    last: how many of the last layers to keep in high precision.
    first: how many of the first layers to keep in high precision.

  Returns:
    One :class:`QuantizationRule` with ``quantize=False`` (empty when
    ``first == last == 0``), for ``quantize_model(model, recipe, rules=...)``
    (Linen or NNX).

  Raises:
    ValueError: naming the argument, for a template without ``{i}`` or
      counts outside ``0 <= first + last <= num_layers``.

  Example:
    >>> import fp8_linen as fl
    >>> rules = fl.high_precision_layers('block{i}', 8, last=2) + fl.projection_rules()
    >>> rules[0].module_path
    '(?:.*/)?(?:block6|block7)(?:/.*)?'
  """
  if not isinstance(layer, str) or "{i}" not in layer:
    raise ValueError(f"high_precision_layers: layer={layer!r} must be a string with an '{{i}}' "
                     "placeholder for the layer index, e.g. 'block{i}'")
  for name, value, lo in (("num_layers", num_layers, 1), ("last", last, 0), ("first", first, 0)):
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
      raise ValueError(f"high_precision_layers: {name}={value!r} must be an int >= {lo}")
  if first + last > num_layers:
    raise ValueError(f"high_precision_layers: first={first} + last={last} exceeds "
                     f"num_layers={num_layers}")
  kept = sorted(set(range(first)) | set(range(num_layers - last, num_layers)))
  if not kept:
    return ()
  paths = "|".join(layer.replace("{i}", str(i)) for i in kept)
  return (QuantizationRule(module_path=f"(?:.*/)?(?:{paths})(?:/.*)?", quantize=False),)


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


def report_unmatched(rules, hits, on_unmatched: str, *, what: str, stacklevel: int = 2) -> None:
  """Warns about (``'warn'``) or raises for (``'raise'``) rules that matched nothing.

  Args:
    rules: the rules, in order.
    hits: how many times each rule matched.
    on_unmatched: ``'warn'``, ``'raise'`` or ``'ignore'``.
    what: the message's opening (who found nothing, and how to look for paths).
    stacklevel: for the warning.

  Rules marked ``optional`` are never reported.
  """
  unmatched = [r for r, h in zip(rules, hits) if h == 0 and not r.optional]
  if not unmatched or on_unmatched == "ignore":
    return
  msg = what + ": " + ", ".join(f"module_path={r.module_path!r} ops={r.ops}" for r in unmatched)
  if on_unmatched == "raise":
    raise ValueError(msg)
  warnings.warn(msg, stacklevel=stacklevel + 1)
