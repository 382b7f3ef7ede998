"""Which rule a product of the running module matches: its path, its operands, the head.

:class:`Session` is one :func:`~fp8_linen.quantization` context's state: the
rules and how often each matched, the stack of running modules
(:class:`~fp8_linen.model_quantization.frames.Frame`), and what tells a
product's operands apart (``'weight'``: a parameter of the running module;
``'embedding'``: the vocabulary table, recognised by what a module did with
it, so a tied or untied logits head is seen by its shape; ``'activations'``).
:func:`projection_rules` is the usual rule list built on those kinds:
projections quantized, attention math and the logits head in high precision.

Example:
  >>> from fp8_linen.model_quantization import rules
  >>> [r.operands for r in rules.projection_rules(head='.*classifier')]
  ['any', 'embedding', 'activations', 'weight']
"""

from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen.model_quantization.frames import Frame
from fp8_linen.recipes.rules import QuantizationRule, first_match, operand_kinds

__all__ = ["projection_rules", "Session"]


def projection_rules(recipe=None, *, head: str | None = None) -> tuple[QuantizationRule, ...]:
  """Projections in fp8; attention math and the logits head in high precision.

  The usual choice for training a language model in fp8: every product with a
  weight operand (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``
  and raw products against a module's own parameter) is quantized; products
  between two activations (attention scores and the attention-weighted
  values) and products against an embedding table (the logits head: tied,
  through ``Embed.attend`` or a nested ``apply``, or untied with the table's
  shape) keep the model's precision.

  Args:
    recipe: the projections' recipe (``None``: the one given to
      :func:`~fp8_linen.quantize_model`).
    head: a module-path regular expression for a logits head that is not
      recognised by its shape (e.g. a classifier: ``'.*classifier'``).

  Returns:
    The rules, for ``quantize_model(model, rules=...)``.

  Example:
    >>> import flax.linen as nn
    >>> import fp8_linen as fl
    >>> qm = fl.quantize_model(nn.Dense(4), rules=fl.projection_rules())
    >>> [r.operands for r in qm.rules]
    ['embedding', 'activations', 'weight']
  """
  rules = [] if head is None else [QuantizationRule(module_path=head, quantize=False)]
  return tuple(rules) + (
      QuantizationRule(operands="embedding", quantize=False, optional=True),
      QuantizationRule(operands="activations", quantize=False, optional=True),
      QuantizationRule(operands="weight", recipe=recipe),
  )


class Session:
  """One :func:`~fp8_linen.quantization` context: its rules and their hits, the running
  modules, the vocabulary table seen so far."""

  def __init__(self, rules, recipe):
    self.rules = rules
    self.recipe = recipe
    self.hits = [0] * len(rules)
    self.seen = 0  # products that reached a handler (0: nothing was traced)
    self.stack: list[Frame] = []
    self.vocab_table = None  # (rows, sorted shape) of the largest nn.Embed table seen
    self.by_operands = any(r.operands != "any" for r in rules)

  def operand_kinds(self, frame: Frame, op: str, lhs, rhs) -> set:
    """``{'weight', 'embedding'}``, ``{'weight'}`` or ``{'activations'}``."""
    params = frame.module.variables.get("params", {})
    # A bridge running an NNX submodule (MaxText's ToLinen) holds its weights
    # at the sub-path it runs at, not among its own top-level params.
    for name in frame.live():
      params = params.get(name, {}) if isinstance(params, Mapping) else {}
    own = [jnp.shape(v) for v in (nn.meta.unbox(v) for v in params.values()
                                  if not isinstance(v, Mapping))]
    return operand_kinds(own, (jnp.shape(lhs), jnp.shape(rhs)),
                         self.vocab_table and self.vocab_table[1],
                         isinstance(frame.module, nn.Embed), op=op)

  def note_tables(self, module, args, kwargs) -> None:
    """Records the vocabulary table if ``module``'s method looked up token ids in it.

    A table is an embedding by what it does, not by its class: an ``nn.Embed``,
    or any module holding a 2-D parameter whose method took integer ids
    (gemma's ``Embedder.encode``, MaxText's ``Embed``). The vocabulary is the
    table with the most rows (position and token-type tables are smaller);
    only its shape marks a logits head that multiplies it.
    """
    params = module.variables.get("params", {})
    if isinstance(module, nn.Embed):
      tables = [params.get("embedding")]
    elif any(jnp.issubdtype(jnp.result_type(a), jnp.integer)
             for a in jax.tree.leaves((args, kwargs)) if hasattr(a, "dtype")):
      tables = [v for v in params.values() if not isinstance(v, Mapping)]
    else:
      return
    for table in tables:
      shape = jnp.shape(nn.meta.unbox(table)) if table is not None else ()
      if len(shape) == 2 and (self.vocab_table is None or shape[0] > self.vocab_table[0]):
        self.vocab_table = (shape[0], tuple(sorted(shape)))

  def recipe_for(self, frame: Frame, op: str, lhs, rhs):
    kinds = self.operand_kinds(frame, op, lhs, rhs) if self.by_operands else set()
    i = first_match(self.rules, op, frame.path, kinds)
    if i is None:
      return None
    self.hits[i] += 1
    rule = self.rules[i]
    return (rule.recipe or self.recipe) if rule.quantize else None
