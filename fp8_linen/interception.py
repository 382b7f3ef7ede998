"""Scoped, context-local replacement of named JAX functions.

:func:`intercept` replaces public JAX functions (``jax.lax.dot_general``,
``jax.numpy.einsum``, ``jax.numpy.matmul``, ... :data:`TARGETS`) by
dispatchers while at least one interception is active anywhere in the
process, and routes each call to the handler of the interception active *in
the calling context* (a ``contextvars`` value: another thread, or code outside
the ``with`` block, gets the original function, at the cost of one
context-variable read per call while any interception is active).

What is never intercepted:

* code inside a handler (it runs with no interception active in its
  context);
* the library's own products: :mod:`fp8_linen.core` binds the original lax
  functions when it is imported, so a custom-gradient rule that JAX traces
  later (the forward of ``jax.checkpoint``/``nn.remat`` during ``jax.grad``,
  the body of ``nn.scan``), outside any handler, still reaches the originals
  (``tests/test_quantize_model.py`` checks that no module of ``core`` or
  ``linen`` names a target);
* names bound before the interception began (``from jax.numpy import dot``)
  and ``x @ w``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fp8_linen import interception
  >>> def twice(orig, a, b, dn, **kw):
  ...   return 2 * orig(a, b, dn, **kw)
  >>> with interception.intercept({'jax.lax.dot_general': twice}):
  ...   float(jax.lax.dot_general(jnp.ones(2), jnp.ones(2), (((0,), (0,)), ((), ()))))
  4.0
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

__all__ = ["TARGETS", "intercept", "original", "is_target"]

# The functions that can be intercepted: name -> (module, attribute). ``x @ w``
# is not among them: ``Array.__matmul__`` calls jax's internal matmul, which no
# public attribute reaches.
TARGETS = {
    "jax.lax.dot_general": (jax.lax, "dot_general"),
    "jax.lax.conv_general_dilated": (jax.lax, "conv_general_dilated"),
    "jax.lax.ragged_dot": (jax.lax, "ragged_dot"),
    "jax.numpy.einsum": (jnp, "einsum"),
    "jax.numpy.matmul": (jnp, "matmul"),
    "jax.numpy.dot": (jnp, "dot"),
    # Not a product: its body's trace has no parent (product_calls.shard_map).
    "jax.shard_map": (jax, "shard_map"),
}

_ORIGINALS: dict[str, Callable] = {name: getattr(mod, attr) for name, (mod, attr)
                                   in TARGETS.items()}
_HANDLERS: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_handlers", default=None)
_LOCK = threading.Lock()
_ACTIVE = [0]


def original(name: str) -> Callable:
  """The function ``name`` refers to when nothing intercepts it."""
  return _ORIGINALS[name]


def is_target(fn, name: str) -> bool:
  """Whether ``fn`` is target ``name`` itself (original or intercepted)."""
  return fn is _ORIGINALS[name] or fn is _DISPATCHERS[name]


def _dispatcher(name: str) -> Callable:
  orig = _ORIGINALS[name]

  @functools.wraps(orig)
  def dispatch(*args, **kwargs):
    handlers = _HANDLERS.get()
    handler = handlers.get(name) if handlers else None
    if handler is None:
      return orig(*args, **kwargs)
    # The handler runs with no interception active: whatever it calls (our
    # own products included) reaches the original functions.
    token = _HANDLERS.set(None)
    try:
      return handler(orig, *args, **kwargs)
    finally:
      _HANDLERS.reset(token)

  return dispatch


_DISPATCHERS = {name: _dispatcher(name) for name in TARGETS}


def _install(on: bool) -> None:
  for name, (mod, attr) in TARGETS.items():
    setattr(mod, attr, _DISPATCHERS[name] if on else _ORIGINALS[name])


@contextlib.contextmanager
def intercept(handlers: Mapping[str, Callable]):
  """Routes calls of the named functions to ``handlers`` within the block.

  Args:
    handlers: target name (a key of :data:`TARGETS`) ->
      ``handler(original_fn, *args, **kwargs)``. A handler calls
      ``original_fn`` for whatever it does not change; while it runs, no
      interception is active in its context.

  Yields:
    Nothing.
  """
  unknown = sorted(set(handlers) - set(TARGETS))
  if unknown:
    raise ValueError(f"intercept: unknown targets {unknown}; known: {sorted(TARGETS)}")
  with _LOCK:
    if _ACTIVE[0] == 0:
      _install(True)
    _ACTIVE[0] += 1
  token = _HANDLERS.set(dict(handlers))
  try:
    yield
  finally:
    _HANDLERS.reset(token)
    with _LOCK:
      _ACTIVE[0] -= 1
      if _ACTIVE[0] == 0:
        _install(False)
