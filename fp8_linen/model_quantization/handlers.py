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

import contextvars
import string
import threading
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen import interception
from fp8_linen.core import settings, uses
from fp8_linen.core.dims import einsum_plan
from fp8_linen.core.owg import OWG
from fp8_linen.families.table import family_for
from fp8_linen.linen.access import (quantized_conv_on, quantized_dot_general_on,
                                    quantized_einsum_on, quantized_ragged_dot_on)
from fp8_linen.linen.conv import conv_kwargs_from
from fp8_linen.model_quantization.frames import Frame, new_frame
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
_WARNED: set = set()
_WARNED_LOCK = threading.Lock()


def _warn_once(key, message: str) -> None:
  with _WARNED_LOCK:
    if key in _WARNED:
      return
    _WARNED.add(key)
  warnings.warn(message, stacklevel=4)


# ----------------------------------------------------------------------------
# The handlers.
# ----------------------------------------------------------------------------


def _floating(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _decide(op: str, lhs, rhs, problem: str | None = None):
  """``(frame, recipe)`` for a quantized product, else ``(None, (status, reason))``."""
  sess = SESSION.get()
  if sess is None:
    return None, ("skipped", None)
  sess.seen += 1
  if not sess.stack:
    return None, ("skipped", "it is called outside any module method, where no module can "
                  "hold its state")
  frame = sess.stack[-1]
  if not (_floating(lhs) and _floating(rhs)):
    return None, ("excluded", None)
  if uses.in_kernel():
    return None, ("skipped", "it is a tile product inside a Pallas kernel (the kernel's own "
                  "computation, which holds no quantization state)")
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
  return (frame, recipe), None


def _unquantized(op: str, status, call):
  kind, reason = status
  if kind == "skipped" and reason:
    sess = SESSION.get()
    path = sess.stack[-1].path if sess and sess.stack else ""
    _warn_once((op, path, reason), f"fp8_linen.quantize_model: {op} in module "
               f"{path or '<root>'!r} runs unquantized: {reason}")
  with jax.named_scope(MARKERS[kind]):
    return call()


def _run(frame: Frame, op: str, fn):
  """Runs ``fn(module)`` on the module's own state or on a per-call-site child."""
  with jax.named_scope(MARKERS["quantized"]):
    module = frame.module
    below = frame.shared + frame.live()
    if isinstance(module, _OWN_STATE_LAYERS) and not frame.own_used and not below:
      frame.own_used = True
      return fn(module) if frame.kind == "own" else _Holder(parent=frame.home())(fn)
    i = frame.counts.get((below, op), 0)
    frame.counts[(below, op)] = i + 1
    child = frame.home().push(f"{op}_{i}", reuse=True)
    return _Holder(parent=child)(fn)


class _Holder(nn.Module):
  """A stateless module bound to a child scope; the op declares state on it."""

  @nn.compact
  def __call__(self, fn):
    return fn(self)


def _dot_general(orig, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
  call = lambda: orig(lhs, rhs, dimension_numbers, precision=precision,
                      preferred_element_type=preferred_element_type, **kwargs)
  problem = ("it passes out_sharding (explicit sharding is not supported by the quantized "
             "product)" if kwargs.get("out_sharding") is not None else None)
  if not _contracts(dimension_numbers):
    return _unquantized("dot_general", ("excluded", None), call)
  target, status = _decide("dot_general", lhs, rhs, problem)
  if target is None:
    return _unquantized("dot_general", status, call)
  frame, recipe = target
  return _run(frame, "dot_general", lambda m: quantized_dot_general_on(
      m, lhs, rhs, dimension_numbers, recipe, out_dtype=preferred_element_type))


def _einsum_problem(subscripts, operands, kwargs) -> str | None:
  """Why this einsum cannot run as one quantized product, or None."""
  dg = kwargs.get("_dot_general")
  # flax's attention passes jax.lax.dot_general explicitly: still a plain einsum.
  if dg is not None and not interception.is_target(dg, "jax.lax.dot_general"):
    return "it passes its own _dot_general"
  if not isinstance(subscripts, str) or len(operands) != 2:
    return f"it has {len(operands)} operands (only two-operand einsums are quantized)"
  if kwargs.get("out") is not None or kwargs.get("out_sharding") is not None:
    return "it passes out= or out_sharding="
  try:
    einsum_plan(subscripts, jnp.shape(operands[0]), jnp.shape(operands[1]))
  except (ValueError, NotImplementedError) as e:
    return str(e)
  return None


def _contracts(dimension_numbers) -> bool:
  """Whether a product contracts any axis (one that does not is a broadcast multiply)."""
  (lc, _), _ = dimension_numbers
  return bool(tuple(lc))


def _einsum_product(op: str, equation: str, lhs, rhs, kwargs, call, problem=None):
  if problem is None and not _contracts(
      einsum_plan(equation, jnp.shape(lhs), jnp.shape(rhs)).dimension_numbers):
    # '...k,k->...k' (MaxText's RMSNorm scale): an elementwise multiply, not a GEMM.
    return _unquantized(op, ("excluded", None), call)
  target, status = _decide(op, lhs, rhs, problem)
  if target is None:
    return _unquantized(op, status, call)
  frame, recipe = target
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
  return _run(frame, op, lambda m: quantized_einsum_on(m, equation, lhs, rhs, recipe,
                                                       out_dtype=out_dtype))


def _einsum(orig, subscripts, *operands, **kwargs):
  call = lambda: orig(subscripts, *operands, **kwargs)
  if len(operands) < 2:
    return call()  # a reduction or transpose: no product
  problem = _einsum_problem(subscripts, operands, kwargs)
  return _einsum_product("einsum", subscripts, operands[0], operands[1], kwargs, call, problem)


def _matmul_equation(a_ndim: int, b_ndim: int) -> str:
  """``jnp.matmul``'s contraction as an einsum equation (numpy broadcasting included)."""
  batch = string.ascii_uppercase[:max(a_ndim - 2, b_ndim - 2, 0)]
  a = batch[len(batch) - max(a_ndim - 2, 0):] + ("m" if a_ndim >= 2 else "") + "k"
  b = batch[len(batch) - max(b_ndim - 2, 0):] + "k" + ("n" if b_ndim >= 2 else "")
  return f"{a},{b}->{batch}{'m' if a_ndim >= 2 else ''}{'n' if b_ndim >= 2 else ''}"


def _dot_equation(a_ndim: int, b_ndim: int) -> str:
  """``jnp.dot``'s contraction (last axis of a, second-to-last of b) as an einsum equation."""
  a = string.ascii_lowercase[:a_ndim]
  k = a[-1]
  b = k if b_ndim == 1 else string.ascii_uppercase[:b_ndim - 2] + k + "Z"
  return f"{a},{b}->{a[:-1]}{b.replace(k, '')}"


def _matmul_like(op: str, equation_fn):
  def handler(orig, a, b, *args, **kwargs):
    call = lambda: orig(a, b, *args, **kwargs)
    a_ndim, b_ndim = jnp.ndim(a), jnp.ndim(b)
    if args or a_ndim == 0 or b_ndim == 0:
      return call()  # a scalar product is a multiply; bad arguments raise in jax
    problem = ("it passes out_sharding (explicit sharding is not supported by the quantized "
               "product)" if kwargs.get("out_sharding") is not None else None)
    return _einsum_product(op, equation_fn(a_ndim, b_ndim), a, b, kwargs, call, problem)

  return handler


def _conv_general_dilated(orig, lhs, rhs, *args, **kwargs):
  call = lambda: orig(lhs, rhs, *args, **kwargs)
  problem, conv_kwargs = None, None
  try:
    conv_kwargs = conv_kwargs_from(*args, **kwargs)
  except (TypeError, NotImplementedError) as e:
    problem = str(e)
  target, status = _decide("conv", lhs, rhs, problem)
  if target is None:
    return _unquantized("conv", status, call)
  frame, recipe = target
  out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
  return _run(frame, "conv", lambda m: quantized_conv_on(
      m, lhs, rhs, conv_kwargs, recipe, out_dtype=out_dtype))


def _ragged_dot(orig, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                **kwargs):
  call = lambda: orig(lhs, rhs, group_sizes, precision=precision,
                      preferred_element_type=preferred_element_type, **kwargs)
  problem = None
  if kwargs.get("group_offset") is not None:
    problem = "it passes group_offset (a shard of the groups), which is not supported yet"
  elif jnp.ndim(lhs) != 2 or jnp.ndim(rhs) != 3:
    problem = f"its operands are {jnp.ndim(lhs)}-D and {jnp.ndim(rhs)}-D, not (m, k) x (g, k, n)"
  target, status = _decide("ragged_dot", lhs, rhs, problem)
  if target is None:
    return _unquantized("ragged_dot", status, call)
  frame, recipe = target
  why = _ragged_problem(recipe)
  if why is not None:
    return _unquantized("ragged_dot", ("skipped", why), call)
  return _run(frame, "ragged_dot", lambda m: quantized_ragged_dot_on(
      m, lhs, rhs, group_sizes, recipe, out_dtype=preferred_element_type))


def _ragged_problem(recipe) -> str | None:
  """Why ``recipe`` cannot quantize a grouped GEMM, or ``None``."""
  if family_for(recipe, "quantize_model").ragged_dot is None:
    return (f"{type(recipe).__name__} has no quantized grouped GEMM yet (use an fp8 per-tensor "
            "recipe for the experts)")
  if getattr(recipe, "granularity", "tensor") != "tensor":
    return (f"granularity={recipe.granularity!r} has no grouped GEMM yet (use an fp8 "
            "per-tensor recipe for the experts)")
  return None


HANDLERS = {"jax.lax.dot_general": _dot_general, "jax.numpy.einsum": _einsum,
            "jax.numpy.matmul": _matmul_like("matmul", _matmul_equation),
            "jax.numpy.dot": _matmul_like("dot", _dot_equation),
            "jax.lax.conv_general_dilated": _conv_general_dilated,
            "jax.lax.ragged_dot": _ragged_dot}


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
