"""What runs in place of the intercepted product functions and around every module method.

Inside :func:`~fp8_linen.quantization` (the session :data:`SESSION` holds),
``jax.lax.dot_general``, ``jax.numpy.einsum``, ``jax.numpy.matmul``,
``jax.numpy.dot`` and ``jax.lax.conv_general_dilated`` run the handlers of
:data:`HANDLERS` (:mod:`fp8_linen.interception`), and every Linen module
method runs under :func:`interceptor`, which keeps the stack of running
modules (:mod:`~fp8_linen.model_quantization.frames`). A handler decides
whether its product is quantized (the rules, the operands' dtypes, the
frame's state) and runs it through :mod:`fp8_linen.linen.access` on the
module's state or on a per-call-site child, under the name scopes
:mod:`fp8_linen.product_report` reads; a product it leaves alone runs as
written, with a warning (once per call site) saying why.
"""

from __future__ import annotations

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes as linen_dtypes

from fp8_linen import product_calls
from fp8_linen.core import settings
from fp8_linen.core.owg import OWG
from fp8_linen.families import dispatch
from fp8_linen.linen.access import LinenAccess
from fp8_linen.model_quantization.frames import new_frame
from fp8_linen.product_report import MARKERS

__all__ = ["SESSION", "QUANTIZING", "HANDLERS", "interceptor"]

# Layers whose one product keeps its state at the layer's own path.
_OWN_STATE_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv)

# The session of the innermost open quantization context (None: products run as written).
SESSION: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_qm_session", default=None)
# The session's configuration, in JAX's jit cache keys: a function jitted
# inside the model (nn.jit, a raw jax.jit) traced as float is traced again
# when the model runs quantized, and the other way round.
QUANTIZING = settings.TraceSetting("quantize_model", default=None)


# Flax's own layers whose body casts the kernel parameter and hands the result straight
# to the product function (the intercepted op).
_CASTING_BODIES = {nn.Dense: "dot_general", nn.DenseGeneral: "dot_general", nn.Einsum: "einsum"}


def _cast_parameter(module, op: str, rhs):
  """The ``kernel`` parameter that ``rhs`` is flax's promotion of, or ``None``.

  Only where flax's own code guarantees it: an ``nn.Dense``,
  ``nn.DenseGeneral`` or ``nn.Einsum`` itself (a subclass may change its
  kernel first) with flax's ``promote_dtype`` and no ``dot_general`` of its
  own, whose body casts the parameter and hands the result straight to
  ``lax.dot_general`` / ``jnp.einsum``. A block product may then read the
  parameter and round it itself, as the library's own layers let it
  (:func:`~fp8_linen.families.dispatch.kernel_params`).
  """
  if (_CASTING_BODIES.get(type(module)) != op
      or module.promote_dtype is not linen_dtypes.promote_dtype
      or getattr(module, "dot_general", None) is not None
      or getattr(module, "dot_general_cls", None) is not None
      or not module.has_variable("params", "kernel")):
    return None
  param = nn.meta.unbox(module.get_variable("params", "kernel"))
  if (jnp.shape(param) != jnp.shape(rhs) or jnp.result_type(param) == jnp.result_type(rhs)
      or not jnp.issubdtype(jnp.result_type(param), jnp.floating)):
    return None
  return param


def _warn_once(key, message: str) -> None:
  product_calls.warn_once(key, message, stacklevel=4)


# ----------------------------------------------------------------------------
# The handlers: product_calls reads the calls; this backend keeps the state.
# ----------------------------------------------------------------------------


class _LinenBackend(product_calls.Backend):
  """State in the running Linen module's scope (or a per-call-site child)."""

  def decide(self, op, lhs, rhs, problem):
    """``(frame, recipe)`` for a quantized product, else ``(None, (status, reason))``."""
    sess = SESSION.get()
    if sess is None:
      return None, ("skipped", None)
    sess.seen += 1
    if not sess.stack:
      return None, ("skipped", "it is called outside any module method, where no module can "
                    "hold its state")
    frame = sess.stack[-1]
    common = product_calls.common_problem(lhs, rhs)
    if common is not None:
      return None, common
    if op == "conv" and isinstance(frame.module, nn.ConvLocal):
      return None, ("skipped", "nn.ConvLocal has no quantized form")
    recipe = sess.recipe_for(frame, op, lhs, rhs)
    if recipe is None:
      return None, ("excluded", None)
    if problem is not None:
      return None, ("skipped", problem)
    if frame.kind == "none":
      return None, ("skipped", f"its variables have no {OWG!r} collection to hold the fp8 "
                    "state (a lifted transform such as nn.scan or nn.vmap that does not carry "
                    f"it: add {OWG!r} to its variable_axes, e.g. variable_axes={{True: 0}})")
    return (frame, recipe, rhs), None

  def unquantized(self, op, status, call):
    kind, reason = status
    sess = SESSION.get()
    frame = sess.stack[-1] if sess and sess.stack else None
    if kind == "skipped" and reason:
      path = frame.path if frame is not None else ""
      _warn_once((op, path, reason), f"fp8_linen.quantize_model: {op} in module "
                 f"{path or '<root>'!r} runs unquantized: {reason}")
    with _named(frame.shared + frame.live() if frame is not None else (), MARKERS[kind]):
      return call()

  def run(self, target, op, product):
    """Runs ``product`` on the module's own state or on a per-call-site child."""
    frame, recipe, rhs = target
    module = frame.module
    below = frame.shared + frame.live()
    if isinstance(module, _OWN_STATE_LAYERS) and not frame.own_used and not below:
      frame.own_used = True
      fn = lambda m: product(LinenAccess(m), recipe)
      with jax.named_scope(MARKERS["quantized"]), dispatch.kernel_params():
        param = _cast_parameter(module, op, rhs)
        if param is not None:
          dispatch.remember_kernel_param(rhs, param)
        return fn(module) if frame.kind == "own" else _Holder(parent=frame.home())(fn)
    i = frame.counts.get((below, op), 0)
    frame.counts[(below, op)] = i + 1
    home = frame.home()
    # The call site's name before the marker: a weight's only product is told
    # from the module's other products by it (fl.convert stores it as codes).
    # Below a bridge's own scope the sub-path (MaxText's decoder/layers_0/mlp/wi_0)
    # is named too, so the report shows the path the rules and the state use.
    with _named(below, f"{op}_{i}", MARKERS["quantized"]):
      child = home.push(f"{op}_{i}", reuse=True)
      return _Holder(parent=child)(lambda m: product(LinenAccess(m, weights_of=home), recipe))


@contextlib.contextmanager
def _named(below, *names):
  """Name scopes for a bridge's sub-path ``below`` (the path rules and state use), then ``names``."""
  with contextlib.ExitStack() as scopes:
    for name in (*below, *names):
      scopes.enter_context(jax.named_scope(name))
    yield


class _Holder(nn.Module):
  """A stateless module bound to a child scope; the op declares state on it."""

  @nn.compact
  def __call__(self, fn):
    return fn(self)


HANDLERS = product_calls.handlers(_LinenBackend())


def interceptor(next_fun, args, kwargs, context):
  sess = SESSION.get()
  module = context.module
  if sess is None or context.method_name == "setup" or module.scope is None:
    # An unbound module's method (a model overriding ``init`` and calling its
    # own helpers before binding) has no path and no state: not a product site.
    return next_fun(*args, **kwargs)
  sess.stack.append(new_frame(sess.stack, module))
  try:
    out = next_fun(*args, **kwargs)
  finally:
    sess.stack.pop()
  if sess.by_operands:
    sess.note_tables(module, args, kwargs)
  return out
