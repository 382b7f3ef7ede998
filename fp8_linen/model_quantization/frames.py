"""The running module of a quantized model: its logical path and where its state lives.

Every module method the interception sees pushes a :class:`Frame` (see
:mod:`fp8_linen.model_quantization.handlers`). A frame says at which path
rules see the module's products and which scope keeps their fp8 state: the
module's own scope, or, for a nested ``apply`` (a tied head run on a scope of
its own), the outer model's scope at the path the nested module would have as
a child of its caller (:func:`new_frame`). ``nn.share_scope`` and scopes a
bridge extends in place (MaxText's ``ToLinen``) are followed too.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.extend.core

from fp8_linen.core.owg import OWG

__all__ = ["Frame", "new_frame"]


def _trace_state():
  return jax.extend.core.get_opaque_trace_state(convention="flax")


def _holds_state(scope) -> bool:
  """Whether the variables ``scope`` belongs to can have the fp8 state collection."""
  return scope.is_mutable_collection(OWG) or not scope.is_collection_empty(OWG)


class Frame:
  """One running module method.

  ``kind`` says where the module's state lives: ``'own'`` in its own scope;
  ``'nested'`` in the outer model, under ``anchor`` (the scope of the module
  that called a nested ``apply``) at the relative names ``rel``; ``'none'``
  nowhere (its products run unquantized).
  """

  __slots__ = ("module", "counts", "own_used", "kind", "anchor", "anchor_path", "base",
               "entry", "shared", "trace")

  def __init__(self, module, kind, *, anchor=None, anchor_path=(), base=()):
    self.module = module
    self.counts = {}
    self.own_used = False
    self.kind = kind
    self.anchor, self.anchor_path, self.base = anchor, tuple(anchor_path), tuple(base)
    self.entry = tuple(module.path)
    # nn.share_scope: the module runs on another module's scope (gemma's gated
    # MLP runs two Einsum children on the MLP's). Its products keep their state
    # in a child named after the module, so two modules never share a state.
    path = tuple(module.scope.path)
    name = module.name
    child = isinstance(module.parent, nn.Module)  # not the root of an apply (nested or not)
    self.shared = (name,) if (child and name and (not path or path[-1] != name)) else ()
    self.trace = _trace_state()

  def live(self) -> tuple:
    """Names below the module's path at which its code runs now.

    MaxText's ``ToLinen`` extends the Linen scope's path in place while each
    NNX submodule runs (``decoder/layers_0/mlp/wi_0``): products then keep
    their state, and rules see them, at that submodule's path, not numbered
    in call order at the bridge's.
    """
    now = tuple(self.module.scope.path)
    n = len(self.entry)
    return now[n:] if len(now) > n and now[:n] == self.entry else ()

  @property
  def path(self) -> str:
    rel = self.base + self.entry
    names = self.anchor_path + rel if self.kind == "nested" else self.entry
    return "/".join(names + self.shared + self.live())

  def home(self):
    """The scope that holds this module's own state (at its live sub-path)."""
    below = self.shared + self.live()
    if self.kind == "own":
      scope = self.module.scope
      if not below:
        return scope
      now, scope.path = scope.path, self.entry  # push from the path the variables live at
      try:
        for name in below:
          scope = scope.push(name, reuse=True)
      finally:
        self.module.scope.path = now
      return scope
    scope = self.anchor
    for name in self.base + self.entry + below:
      scope = scope.push(name, reuse=True)
    return scope


def new_frame(stack: list, module) -> Frame:
  prev = stack[-1] if stack else None
  scope = module.scope
  if prev is None or _holds_state(scope):
    return Frame(module, "own")
  if scope.root is prev.module.scope.root:  # deeper in the same variables (nested or not)
    return Frame(module, prev.kind, anchor=prev.anchor, anchor_path=prev.anchor_path,
                  base=prev.base)
  if prev.kind != "none" and _trace_state() == prev.trace:
    # A nested `apply` called by prev's method: keep its state where the outer
    # model would keep this module's, as a child of prev.
    anchor_path = tuple(prev.path.split("/")) if prev.path else ()
    return Frame(module, "nested", anchor=prev.home(), anchor_path=anchor_path,
                  base=(module.name or type(module).__name__,))
  return Frame(module, "none")
