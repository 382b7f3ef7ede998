"""What an intercepted product call asks for, read once for both ``quantize_model`` s.

The Linen :func:`~fp8_linen.quantize_model` and the NNX one intercept the
same functions (:mod:`fp8_linen.interception`) and read their arguments the
same way: which calls are products at all (an einsum that contracts nothing is
an elementwise multiply), which cannot run as one quantized product (three
operands, ``out_sharding=``, a grouped GEMM's ``group_offset``), and what
quantized product runs in their place (a :mod:`fp8_linen.families.dispatch`
call on a layer's :class:`~fp8_linen.families.VariableAccess`). Where the
state lives and which rule applies is the API's own: a :class:`Backend`.

Example:
  >>> from fp8_linen import product_calls
  >>> product_calls.matmul_equation(3, 2)
  'Amk,kn->Amn'
"""

from __future__ import annotations

import functools
import string
import threading
import warnings

import jax.numpy as jnp

from fp8_linen import interception
from fp8_linen.core import int_product, uses
from fp8_linen.core.conv import conv_kwargs_from
from fp8_linen.core.dims import einsum_plan
from fp8_linen.families import dispatch
from fp8_linen.families.table import family_for

__all__ = ["Backend", "handlers", "matmul_equation", "dot_equation", "common_problem",
           "warn_once", "report_unseen"]

_WARNED: set = set()
_WARNED_LOCK = threading.Lock()


def warn_once(key, message: str, stacklevel: int) -> None:
  """Warns ``message`` the first time ``key`` is seen in this process (once per call site)."""
  with _WARNED_LOCK:
    if key in _WARNED:
      return
    _WARNED.add(key)
  warnings.warn(message, stacklevel=stacklevel + 1)


def report_unseen(report, on_unquantized: str, *, who: str, what: str, fix: str,
                  stacklevel: int) -> None:
  """Warns about (``'warn'``) or raises for (``'raise'``) the report's ``unseen`` products.

  ``who`` opens the message, ``what`` names the run traced, ``fix`` the
  functions to write instead.
  """
  unseen = report.with_status("unseen")
  if not unseen or on_unquantized == "ignore":
    return
  msg = (f"{who}: {len(unseen)} product(s) of {what} never reach the interception and run "
         "unquantized (`x @ w`, functions bound at import time, other product functions; "
         f"write them as {fix} to quantize them):\n" + "\n".join(f"  {p}" for p in unseen[:10])
         + ("\n  ..." if len(unseen) > 10 else ""))
  if on_unquantized == "raise":
    raise ValueError(msg)
  warnings.warn(msg, stacklevel=stacklevel + 1)


class Backend:
  """Where a quantize_model keeps state and how it decides (subclassed by each API).

  ``decide(op, lhs, rhs, problem)`` returns ``(target, None)`` for a product
  to quantize, else ``(None, (status, reason))`` with a
  :data:`~fp8_linen.product_report.MARKERS` status; ``run(target, op,
  product)`` calls ``product(access, recipe)`` on the state ``target``
  names; ``unquantized(op, status, call)`` runs ``call()`` as written (and
  says why, where a reason is given).
  """

  def decide(self, op: str, lhs, rhs, problem: str | None):
    raise NotImplementedError

  def run(self, target, op: str, product):
    raise NotImplementedError

  def unquantized(self, op: str, status, call):
    raise NotImplementedError


def _floating(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def common_problem(lhs, rhs):
  """``(status, reason)`` when no API can quantize this product, else ``None``."""
  if not (_floating(lhs) and _floating(rhs)):
    return ("excluded", None)
  if uses.in_kernel():
    return ("skipped", "it is a tile product inside a Pallas kernel (the kernel's own "
            "computation, which holds no quantization state)")
  return None


def _contracts(dimension_numbers) -> bool:
  """Whether a product contracts any axis (one that does not is a broadcast multiply)."""
  (lc, _), _ = dimension_numbers
  return bool(tuple(lc))


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


def matmul_equation(a_ndim: int, b_ndim: int) -> str:
  """``jnp.matmul``'s contraction as an einsum equation (numpy broadcasting included)."""
  batch = string.ascii_uppercase[:max(a_ndim - 2, b_ndim - 2, 0)]
  a = batch[len(batch) - max(a_ndim - 2, 0):] + ("m" if a_ndim >= 2 else "") + "k"
  b = batch[len(batch) - max(b_ndim - 2, 0):] + "k" + ("n" if b_ndim >= 2 else "")
  return f"{a},{b}->{batch}{'m' if a_ndim >= 2 else ''}{'n' if b_ndim >= 2 else ''}"


def dot_equation(a_ndim: int, b_ndim: int) -> str:
  """``jnp.dot``'s contraction (last axis of a, second-to-last of b) as an einsum equation."""
  a = string.ascii_lowercase[:a_ndim]
  k = a[-1]
  b = k if b_ndim == 1 else string.ascii_uppercase[:b_ndim - 2] + k + "Z"
  return f"{a},{b}->{a[:-1]}{b.replace(k, '')}"


def _sharding_problem(kwargs) -> str | None:
  return ("it passes out_sharding (explicit sharding is not supported by the quantized "
          "product)" if kwargs.get("out_sharding") is not None else None)


def ragged_problem(recipe) -> str | None:
  """Why ``recipe`` cannot quantize a grouped GEMM, or ``None``."""
  if family_for(recipe, "quantize_model").ragged_dot is None:
    return (f"{type(recipe).__name__} has no quantized grouped GEMM yet (use an fp8 per-tensor "
            "recipe for the experts)")
  if getattr(recipe, "grad_bits", None) is not None and \
      int_product.ragged_supported(recipe) is not None:
    return (f"grad_bits={recipe.grad_bits} needs the integer grouped GEMM, which "
            f"{int_product.ragged_supported(recipe)} does not have (use a symmetric STE recipe "
            "or grad_bits=None for the experts)")
  if getattr(recipe, "granularity", "tensor") != "tensor":
    return (f"granularity={recipe.granularity!r} has no grouped GEMM yet (use an fp8 "
            "per-tensor recipe for the experts)")
  return None


def handlers(backend: Backend) -> dict:
  """The interception handlers (:data:`fp8_linen.interception.TARGETS` names) on ``backend``."""

  def run(op, lhs, rhs, problem, call, product, extra=None):
    target, status = backend.decide(op, lhs, rhs, problem)
    if target is None:
      return backend.unquantized(op, status, call)
    if extra is not None:
      why = extra(target)
      if why is not None:
        return backend.unquantized(op, ("skipped", why), call)
    return backend.run(target, op, product)

  def dot_general(orig, lhs, rhs, dimension_numbers, precision=None,
                  preferred_element_type=None, **kwargs):
    call = lambda: orig(lhs, rhs, dimension_numbers, precision=precision,
                        preferred_element_type=preferred_element_type, **kwargs)
    if not _contracts(dimension_numbers):
      return backend.unquantized("dot_general", ("excluded", None), call)
    return run("dot_general", lhs, rhs, _sharding_problem(kwargs), call,
               lambda access, recipe: dispatch.dot_general(
                   access, lhs, rhs, dimension_numbers, recipe,
                   out_dtype=preferred_element_type))

  def einsum_product(op, equation, lhs, rhs, kwargs, call, problem=None):
    if problem is None and not _contracts(
        einsum_plan(equation, jnp.shape(lhs), jnp.shape(rhs)).dimension_numbers):
      # '...k,k->...k' (MaxText's RMSNorm scale): an elementwise multiply, not a GEMM.
      return backend.unquantized(op, ("excluded", None), call)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
    return run(op, lhs, rhs, problem, call, lambda access, recipe: dispatch.einsum(
        access, equation, lhs, rhs, recipe, out_dtype=out_dtype))

  def einsum(orig, subscripts, *operands, **kwargs):
    call = lambda: orig(subscripts, *operands, **kwargs)
    if len(operands) < 2:
      return call()  # a reduction or transpose: no product
    problem = _einsum_problem(subscripts, operands, kwargs)
    return einsum_product("einsum", subscripts, operands[0], operands[1], kwargs, call,
                          problem)

  def matmul_like(op, equation_fn):
    def handler(orig, a, b, *args, **kwargs):
      call = lambda: orig(a, b, *args, **kwargs)
      a_ndim, b_ndim = jnp.ndim(a), jnp.ndim(b)
      if args or a_ndim == 0 or b_ndim == 0:
        return call()  # a scalar product is a multiply; bad arguments raise in jax
      return einsum_product(op, equation_fn(a_ndim, b_ndim), a, b, kwargs, call,
                            _sharding_problem(kwargs))
    return handler

  def conv(orig, lhs, rhs, *args, **kwargs):
    call = lambda: orig(lhs, rhs, *args, **kwargs)
    problem, conv_kwargs = None, None
    try:
      conv_kwargs = conv_kwargs_from(*args, **kwargs)
    except (TypeError, NotImplementedError) as e:
      problem = str(e)
    out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
    return run("conv", lhs, rhs, problem, call, lambda access, recipe: dispatch.conv(
        access, lhs, rhs, conv_kwargs, recipe, out_dtype=out_dtype))

  def ragged_dot(orig, lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
                 **kwargs):
    call = lambda: orig(lhs, rhs, group_sizes, precision=precision,
                        preferred_element_type=preferred_element_type, **kwargs)
    problem = None
    if kwargs.get("group_offset") is not None:
      problem = "it passes group_offset (a shard of the groups), which is not supported yet"
    elif jnp.ndim(lhs) != 2 or jnp.ndim(rhs) != 3:
      problem = (f"its operands are {jnp.ndim(lhs)}-D and {jnp.ndim(rhs)}-D, not (m, k) x "
                 "(g, k, n)")
    return run("ragged_dot", lhs, rhs, problem, call,
               lambda access, recipe: dispatch.ragged_dot(
                   access, lhs, rhs, group_sizes, recipe, out_dtype=preferred_element_type),
               extra=lambda target: ragged_problem(target[1]))

  return {"jax.lax.dot_general": dot_general, "jax.numpy.einsum": einsum,
          "jax.numpy.matmul": matmul_like("matmul", matmul_equation),
          "jax.numpy.dot": matmul_like("dot", dot_equation),
          "jax.lax.conv_general_dilated": conv, "jax.lax.ragged_dot": ragged_dot,
          "jax.shard_map": shard_map}


def shard_map(orig, f=None, /, **kwargs):
  """``jax.shard_map`` (no product): its body traced where the state-use checks see past it.

  A body's trace has no parent, so a scan around the call (MaxText's
  ``scan_layers`` over an MoE in a ``shard_map``) was out of sight of
  :func:`fp8_linen.core.uses.check_use`, and the iterations' state updates
  were summed. Calls made with the function alone return a decorator.
  """
  if f is None:
    return lambda g: shard_map(orig, g, **kwargs)
  mapped = orig(f, **kwargs)

  @functools.wraps(f)
  def call(*args, **kw):
    with uses.entering_shard_map():
      return mapped(*args, **kw)

  return call
