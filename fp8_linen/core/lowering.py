"""How an fp8 product is lowered: which GEMM form a backend gets.

``recipe.gemm`` chooses:

* ``'fp8'``: fp8 operands go straight into ``lax.dot_general`` (the form XLA:GPU
  rewrites to a cuBLASLt fp8 matmul; scalar scales multiply the output);
* ``'bf16'`` / ``'f32'``: the fp8 operands are upcast (exactly) first, for
  backends without fp8 units (XLA:CPU lowers an fp8 dot as convert-then-dot
  anyway);
* ``'auto'``: ``'fp8'`` when the target backend is a GPU, else ``'bf16'``.

The target backend is ``jax.default_backend()`` unless :func:`target_backend`
says otherwise: that is how a step is traced for an H100 on a machine without
one (a compile-only "deviceless" topology).

The lax functions are bound when this module is imported, so the library's own
products never go through a function that :mod:`fp8_linen.interception`
replaced while a model is being quantized.

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import lowering
  >>> with lowering.target_backend("gpu"):
  ...   lowering.resolve_gemm(fl.Fp8Recipe())
  'fp8'
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax.lax import conv_general_dilated as lax_conv_general_dilated
from jax.lax import dot_general as lax_dot_general

__all__ = [
    "GEMMS",
    "target_backend",
    "current_backend",
    "resolve_gemm",
    "gemm",
    "scaled",
    "lax_dot_general",
    "lax_conv_general_dilated",
]

GEMMS = ("fp8", "bf16", "f32")

_TARGET: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_target_backend",
                                                         default=None)


@contextlib.contextmanager
def target_backend(backend: str):
  """Traces ``gemm='auto'`` products for ``backend`` instead of the default one.

  Args:
    backend: ``'gpu'``, ``'cpu'`` or ``'tpu'``.

  Every choice the library makes per backend while tracing (the GEMM form,
  the fp8 encoder) follows it.

  Example:
    >>> import fp8_linen as fl
    >>> with fl.target_backend('gpu'):
    ...   pass  # jax.jit(step).lower(...) here emits direct fp8 GEMMs
  """
  if backend not in ("gpu", "cpu", "tpu"):
    raise ValueError(f"target_backend: backend={backend!r} must be 'gpu', 'cpu' or 'tpu'")
  token = _TARGET.set(backend)
  try:
    yield
  finally:
    _TARGET.reset(token)


def current_backend() -> str:
  """The backend products are traced for: :func:`target_backend`'s, else JAX's default."""
  return _TARGET.get() or jax.default_backend()


def resolve_gemm(recipe) -> str:
  """Resolves ``recipe.gemm='auto'`` against the target backend."""
  if recipe.gemm != "auto":
    return recipe.gemm
  return "fp8" if current_backend() == "gpu" else "bf16"


def _as_matmul_operand(x, contract, batch, contract_last: bool):
  """Reshapes ``x`` to ``[B?, rows, cols]`` for a plain (batched) matmul.

  Returns the reshaped operand and whether its contracting block comes last.
  A transpose is made only when neither ``(batch, free, contract)`` nor
  ``(batch, contract, free)`` is already ``x``'s layout.
  """
  free = [d for d in range(x.ndim) if d not in contract and d not in batch]
  options = [(list(batch) + free + list(contract), True),
             (list(batch) + list(contract) + free, False)]
  perm, last = next(((p, l) for p, l in options if p == list(range(x.ndim))),
                    options[0] if contract_last else options[1])
  if perm != list(range(x.ndim)):
    x = jnp.transpose(x, perm)
  b = math.prod(x.shape[:len(batch)])
  k = math.prod(x.shape[d] for d in range(x.ndim) if perm[d] in contract)
  f = math.prod(x.shape[d] for d in range(x.ndim) if perm[d] in free)
  shape = (f, k) if last else (k, f)
  return x.reshape(((b,) if batch else ()) + shape), last


def gemm(a, b, dn, how: str, out_dtype):
  """``dot_general`` of two fp8 operands under the lowering ``how``."""
  if how == "fp8":
    return lax_dot_general(a, b, dn, preferred_element_type=out_dtype)
  up = jnp.bfloat16 if how == "bf16" else jnp.float32  # fp8 -> bf16 is exact
  a, b = a.astype(up), b.astype(up)
  if up == jnp.float32:
    return lax_dot_general(a, b, dn, preferred_element_type=jnp.float32)
  # XLA:CPU has a bf16 x bf16 -> f32 kernel only for plain (batched) matmul
  # layouts; express every product as one, then restore dot_general's output
  # layout (batch, lhs free, rhs free).
  (ac, bc), (ab, bb) = dn
  out_shape = ([a.shape[d] for d in ab]
               + [a.shape[d] for d in range(a.ndim) if d not in ac and d not in ab]
               + [b.shape[d] for d in range(b.ndim) if d not in bc and d not in bb])
  a3, a_last = _as_matmul_operand(a, ac, ab, contract_last=True)
  b3, b_last = _as_matmul_operand(b, bc, bb, contract_last=False)
  nb = 1 if ab else 0
  dn3 = (((nb + (1 if a_last else 0),), (nb + (1 if b_last else 0),)),
         (((0,), (0,)) if ab else ((), ())))
  y = lax_dot_general(a3, b3, dn3, preferred_element_type=jnp.float32)
  return y.reshape(out_shape)


def scaled(y, scale, out_dtype):
  """Applies a scalar scale to a GEMM output and casts it."""
  return (y * jnp.reshape(scale, ()).astype(y.dtype)).astype(out_dtype)
