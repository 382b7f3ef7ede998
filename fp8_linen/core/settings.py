"""Settings read while a function is traced, and part of every jit cache key.

The library decides several things when a product is *traced*: whether a
model's products are quantized at all (:func:`fp8_linen.quantize_model`), with
which rules and recipe, whether the quantizers are frozen
(:func:`fp8_linen.frozen_quantizers`), which GEMM form a backend gets
(:func:`fp8_linen.target_backend`), and whether a product trains, converts or
serves. Each is a context-local :class:`TraceSetting`.

JAX caches traces: a jitted function (``jax.jit``, ``nn.jit``, ``nnx.jit``)
traced once is not traced again for arguments of the same shapes. If a
setting were only a context variable, a function traced as float would be
replayed inside a quantized model (and the other way round). So every
setting in force is also written into one JAX *user context*
(``jax.make_user_context``), which JAX includes in the key of every jit
cache: a function traced under other settings is traced again.

Values must be hashable and should compare equal when they produce the same
program (a recipe and its rules, not the object that holds them), so that a
training loop's calls hit the cache.

Example:
  >>> from fp8_linen.core.settings import TraceSetting
  >>> color = TraceSetting("color", default="red")
  >>> with color.set("blue"):
  ...   color.get()
  'blue'
  >>> color.get()
  'red'
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Hashable

import jax

__all__ = ["TraceSetting", "jit_key"]

# Every setting that is not at its default, as ((name, value), ...), sorted by
# name: the part of JAX's jit cache keys that belongs to this library.
_JIT_KEY = jax.make_user_context(())
_SETTINGS: dict[str, "TraceSetting"] = {}


def jit_key() -> tuple:
  """The settings in force (those not at their default), as JAX's jit keys see them."""
  return tuple(sorted((name, s.get()) for name, s in _SETTINGS.items()
                      if s.get() is not s.default))


class TraceSetting:
  """A context-local value that tracing reads; changing it makes jitted functions retrace.

  Args:
    name: a unique name (the context variable's, and the key's).
    default: the value outside any :meth:`set` block (compared by identity).
  """

  def __init__(self, name: str, default: Any = None):
    if name in _SETTINGS:
      raise ValueError(f"TraceSetting: a setting named {name!r} already exists")
    self.name = name
    self.default = default
    self._var: contextvars.ContextVar = contextvars.ContextVar(f"fp8_linen_{name}",
                                                               default=default)
    _SETTINGS[name] = self

  def get(self) -> Any:
    """The value in force in this context."""
    return self._var.get()

  @contextlib.contextmanager
  def set(self, value: Hashable):
    """Makes ``value`` the setting for the block (and part of the jit key)."""
    hash(value)  # a TypeError here, not a confusing one from JAX's cache
    token = self._var.set(value)
    try:
      with _JIT_KEY(jit_key()):
        yield
    finally:
      self._var.reset(token)
