"""Routing flax's own injection points back to the layer that is running.

``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Conv`` call a ``dot_general`` /
``conv_general_dilated`` function field from their bodies. Our twins set that
field to a module-level function (so the dataclass stays hashable and
picklable) which asks a :class:`Seam` for the layer whose ``__call__`` is
running and runs the quantized product on that layer's state, at the layer's
own path.

Example:
  >>> from fp8_linen.linen.seam import Seam
  >>> seam = Seam("demo")
  >>> with seam.running("layer"):
  ...   seam.current("demo op")
  'layer'
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

__all__ = ["Seam"]


class Seam:
  """A context-local slot holding the layer (and its settings) that is running."""

  def __init__(self, name: str):
    self._var: contextvars.ContextVar = contextvars.ContextVar(f"fp8_linen_{name}", default=None)

  @contextlib.contextmanager
  def running(self, value: Any):
    """Makes ``value`` the current layer for the duration of the block."""
    token = self._var.set(value)
    try:
      yield
    finally:
      self._var.reset(token)

  def current(self, what: str) -> Any:
    """The current layer; raises if ``what`` was called outside one."""
    value = self._var.get()
    if value is None:
      raise RuntimeError(f"fp8_linen: this {what} only runs inside its layer's __call__")
    return value
