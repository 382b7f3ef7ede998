"""fp8 twins of ``nn.DenseGeneral`` and ``nn.Einsum``.

Both layers keep their flax twin's arguments and ``params`` tree and run their
product through :func:`fp8_linen.layers.quantized_dot_general_on`, so every
recipe type registered with :func:`~fp8_linen.layers.register_dot_general`
works in them. The fp8 state lives in the ``_overwrite_with_gradient``
collection at the layer's own path (like :class:`~fp8_linen.QDense`).

:func:`einsum_plan` lowers a two-operand einsum equation to one
``dot_general`` (plus optional pre-reductions and a final transpose); it is
also what :func:`fp8_linen.quantize_model` uses for raw ``jnp.einsum`` calls.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> layer = fl.QEinsum(shape=(3, 4), einsum_str='btd,dh->bth')
  >>> y, v = layer.init_with_output(jax.random.key(0), jnp.ones((2, 5, 3)))
  >>> y.shape, sorted(v['params'])
  ((2, 5, 4), ['bias', 'kernel'])
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import string
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import module as nn_module

from fp8_linen.layers import quantized_dot_general_on
from fp8_linen.recipes import Fp8Recipe

__all__ = ["EinsumPlan", "einsum_plan", "quantized_einsum_on", "QDenseGeneral", "QEinsum"]


# ----------------------------------------------------------------------------
# Two-operand einsum -> one dot_general.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class EinsumPlan:
  """How a two-operand einsum runs as a single ``dot_general``.

  Attributes:
    lhs_sum_axes: axes of the left operand summed away before the product
      (letters that appear only there and not in the output).
    rhs_sum_axes: the same for the right operand.
    dimension_numbers: ``dot_general`` dimension numbers on the reduced operands.
    out_perm: permutation from the ``dot_general`` output (batch, lhs free,
      rhs free) to the equation's output order.
  """

  lhs_sum_axes: tuple[int, ...]
  rhs_sum_axes: tuple[int, ...]
  dimension_numbers: tuple
  out_perm: tuple[int, ...]


def _expand_ellipsis(term: str, ndim: int, letters: str, name: str) -> str:
  if "..." not in term:
    if len(term) != ndim:
      raise ValueError(f"einsum: operand {name} has {ndim} dimensions but its subscripts "
                       f"{term!r} name {len(term)}")
    return term
  n = ndim - (len(term) - 3)
  if n < 0:
    raise ValueError(f"einsum: operand {name} has {ndim} dimensions, fewer than its "
                     f"subscripts {term!r} name")
  return term.replace("...", letters[len(letters) - n:] if n else "")


def einsum_plan(equation: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> EinsumPlan:
  """Lowers ``jnp.einsum(equation, lhs, rhs)`` to one ``dot_general``.

  Supported: any two-operand equation (explicit ``->`` or implicit output,
  ``...`` for leading dimensions of equal rank and size in both operands),
  batch, contracting and free dimensions in any order. Not supported (raises
  ``NotImplementedError``): repeated letters within one operand (diagonals) and
  ellipses that broadcast (different ranks or size-1 dimensions).

  Args:
    equation: the einsum equation, e.g. ``'...qhd,...khd->...hqk'``.
    lhs_shape: shape of the first operand.
    rhs_shape: shape of the second operand.

  Returns:
    An :class:`EinsumPlan`.

  Raises:
    ValueError: for malformed equations or mismatched sizes (naming them).
    NotImplementedError: for the unsupported forms above.

  Example:
    >>> from fp8_linen.general import einsum_plan
    >>> einsum_plan('bd,df->bf', (2, 3), (3, 4)).dimension_numbers
    (((1,), (0,)), ((), ()))
  """
  eq = equation.replace(" ", "")
  if eq.count(",") != 1:
    raise ValueError(f"einsum: equation {equation!r} must have exactly two operands")
  ins, arrow, out = eq.partition("->")
  lt, rt = ins.split(",")
  used = set(c for c in eq if c.isalpha())
  free_letters = "".join(c for c in string.ascii_letters if c not in used)
  nl = len(lhs_shape) - (len(lt) - 3) if "..." in lt else 0
  nr = len(rhs_shape) - (len(rt) - 3) if "..." in rt else 0
  if "..." in lt and "..." in rt and nl != nr:
    raise NotImplementedError(
        f"einsum: broadcasting ellipses of different ranks in {equation!r} are not supported")
  ell = free_letters[:max(nl, nr, 0)]
  L = _expand_ellipsis(lt, len(lhs_shape), ell, "lhs")
  R = _expand_ellipsis(rt, len(rhs_shape), ell, "rhs")
  if not arrow:  # implicit output: ellipsis first, then letters seen once, sorted
    once = sorted(c for c in set(L + R) if (L + R).count(c) == 1 and c not in ell)
    O = ell + "".join(once)
  else:
    O = _expand_ellipsis(out, max(nl, nr, 0) + len(out.replace("...", "")), ell, "output")
  for name, term in (("lhs", L), ("rhs", R), ("output", O)):
    if len(set(term)) != len(term):
      raise NotImplementedError(
          f"einsum: repeated subscripts in the {name} of {equation!r} (diagonals) are not "
          "supported")
  for c in O:
    if c not in L and c not in R:
      raise ValueError(f"einsum: output subscript {c!r} of {equation!r} is in no operand")
  sizes = {}
  for term, shape, name in ((L, lhs_shape, "lhs"), (R, rhs_shape, "rhs")):
    for c, s in zip(term, shape):
      if c in sizes and sizes[c] != s:
        if c in ell:
          raise NotImplementedError(
              f"einsum: broadcasting ellipsis dimensions in {equation!r} are not supported")
        raise ValueError(f"einsum: subscript {c!r} of {equation!r} has size {sizes[c]} in lhs "
                         f"but {s} in {name}")
      sizes[c] = s
  lsum = tuple(i for i, c in enumerate(L) if c not in R and c not in O)
  rsum = tuple(i for i, c in enumerate(R) if c not in L and c not in O)
  L2 = "".join(c for c in L if c in R or c in O)
  R2 = "".join(c for c in R if c in L or c in O)
  batch = [c for c in L2 if c in R2 and c in O]
  contract = [c for c in L2 if c in R2 and c not in O]
  lfree = [c for c in L2 if c not in R2]
  rfree = [c for c in R2 if c not in L2]
  dn = ((tuple(L2.index(c) for c in contract), tuple(R2.index(c) for c in contract)),
        (tuple(L2.index(c) for c in batch), tuple(R2.index(c) for c in batch)))
  produced = batch + lfree + rfree
  return EinsumPlan(lhs_sum_axes=lsum, rhs_sum_axes=rsum, dimension_numbers=dn,
                    out_perm=tuple(produced.index(c) for c in O))


def quantized_einsum_on(module: nn.Module, equation: str, lhs, rhs, recipe, out_dtype=None,
                        key: str = "dot"):
  """Runs a two-operand einsum as one quantized ``dot_general`` on ``module``'s state.

  Args:
    module: the Linen module that owns the state (inside one of its methods).
    equation: the einsum equation (see :func:`einsum_plan`).
    lhs: first operand (the ``input`` role).
    rhs: second operand (the ``kernel`` role).
    recipe: any registered recipe (e.g. :class:`~fp8_linen.Fp8Recipe`).
    out_dtype: output dtype (default: the result type of the operands).
    key: chain key (uses of one state in a step with one key are linked).

  Returns:
    The einsum result.
  """
  plan = einsum_plan(equation, jnp.shape(lhs), jnp.shape(rhs))
  if plan.lhs_sum_axes:
    lhs = jnp.sum(lhs, axis=plan.lhs_sum_axes)
  if plan.rhs_sum_axes:
    rhs = jnp.sum(rhs, axis=plan.rhs_sum_axes)
  y = quantized_dot_general_on(module, lhs, rhs, plan.dimension_numbers, recipe,
                               out_dtype=out_dtype, key=key)
  if plan.out_perm != tuple(range(len(plan.out_perm))):
    y = jnp.transpose(y, plan.out_perm)
  return y


def _check_inputs(owner: str, inputs) -> jnp.ndarray:
  inputs = jnp.asarray(inputs)
  if not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise TypeError(f"{owner}: inputs must be a floating array, got dtype {inputs.dtype}")
  return inputs


# ----------------------------------------------------------------------------
# QDenseGeneral: nn.DenseGeneral with its dot_general routed to the module.
# ----------------------------------------------------------------------------

# The QDenseGeneral whose __call__ is running (read by _layer_dot_general).
_ACTIVE_DOT: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_active_dot",
                                                             default=None)


@contextlib.contextmanager
def _active(var: contextvars.ContextVar, value):
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def _layer_dot_general(lhs, rhs, dimension_numbers, precision=None,
                       preferred_element_type=None, **unused):
  """The ``dot_general`` a :class:`QDenseGeneral` hands to flax's body."""
  del precision, unused  # fp8 GEMMs run at DEFAULT precision.
  active = _ACTIVE_DOT.get()
  if active is None:
    raise RuntimeError("fp8_linen: this dot_general only runs inside QDenseGeneral.__call__")
  module, recipe = active
  return quantized_dot_general_on(module, lhs, rhs, dimension_numbers, recipe,
                                  out_dtype=preferred_element_type)


class QDenseGeneral(nn.DenseGeneral):
  """Drop-in for ``nn.DenseGeneral`` whose product runs in fp8.

  Same arguments (``features``, ``axis``, ``batch_dims`` as ints or tuples) and
  the same ``params`` tree (``kernel``, ``bias``) as ``nn.DenseGeneral``; the
  fp8 state is added in the :data:`~fp8_linen.OWG` collection at the same path.
  ``dot_general`` and ``dot_general_cls`` must be left at their defaults.

  Attributes:
    recipe: the recipe (:class:`~fp8_linen.Fp8Recipe` by default; any type
      registered with :func:`~fp8_linen.layers.register_dot_general`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> layer = fl.QDenseGeneral(features=(2, 3), axis=-1)
    >>> y, v = layer.init_with_output(jax.random.key(0), jnp.ones((4, 5)))
    >>> y.shape, v['params']['kernel'].shape
    ((4, 2, 3), (5, 2, 3))
  """

  dot_general: Any = _layer_dot_general
  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs):
    if self.dot_general is not _layer_dot_general or self.dot_general_cls is not None:
      raise ValueError("QDenseGeneral brings its own fp8 dot_general; leave dot_general and "
                       "dot_general_cls at their defaults (or use nn.DenseGeneral("
                       "dot_general_cls=Fp8DotGeneral))")
    inputs = _check_inputs("QDenseGeneral", inputs)
    for name in ("features", "axis", "batch_dims"):
      val = getattr(self, name)
      vals = val if isinstance(val, Sequence) else (val,)
      if not all(isinstance(v, int) for v in vals):
        raise ValueError(f"QDenseGeneral.{name} must be an int or a tuple of ints, got {val!r}")
    axes = self.axis if isinstance(self.axis, Sequence) else (self.axis,)
    bdims = self.batch_dims if isinstance(self.batch_dims, Sequence) else (self.batch_dims,)
    for name, dims in (("axis", axes), ("batch_dims", bdims)):
      for d in dims:
        if not -inputs.ndim <= d < inputs.ndim:
          raise ValueError(f"QDenseGeneral.{name}={getattr(self, name)!r} is out of range for "
                           f"inputs of shape {inputs.shape}")
    with _active(_ACTIVE_DOT, (self, self.recipe)):
      return super().__call__(inputs)


# ----------------------------------------------------------------------------
# QEinsum.
# ----------------------------------------------------------------------------


class QEinsum(nn.Einsum):
  """Drop-in for ``nn.Einsum`` whose product runs in fp8.

  Same arguments (``shape``, ``einsum_str`` in the constructor or the call,
  batch dimensions and ``...`` allowed) and the same ``params`` tree as
  ``nn.Einsum``; the fp8 state is added in the :data:`~fp8_linen.OWG`
  collection at the same path. The equation is lowered to one ``dot_general``
  by :func:`einsum_plan` (the input is the ``input`` role, the kernel the
  ``kernel`` role).

  Attributes:
    recipe: the recipe (:class:`~fp8_linen.Fp8Recipe` by default).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> layer = fl.QEinsum(shape=(4, 2, 3), einsum_str='bd,dhk->bhk', use_bias=False)
    >>> y, _ = layer.init_with_output(jax.random.key(0), jnp.ones((5, 4)))
    >>> y.shape
    (5, 2, 3)
  """

  recipe: Any = Fp8Recipe()

  @nn.compact
  def __call__(self, inputs, einsum_str: str | None = None):
    einsum_str = nn_module.merge_param("einsum_str", self.einsum_str, einsum_str)
    if not isinstance(einsum_str, str):
      raise ValueError(f"QEinsum.einsum_str must be a string, got {einsum_str!r}")
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str:
      raise ValueError(f"QEinsum.einsum_str={einsum_str!r} must be explicit and include '->'")
    if einsum_str.count(",") != 1:
      raise ValueError(f"QEinsum.einsum_str={einsum_str!r} must have exactly two operands "
                       "(the input and the kernel)")
    inputs = _check_inputs("QEinsum", inputs)
    shape = tuple(self.shape)
    rhs_term = einsum_str.split("->")[0].split(",")[1]
    if "..." not in rhs_term and len(rhs_term) != len(shape):
      raise ValueError(f"QEinsum.shape={shape} has {len(shape)} dimensions but the kernel "
                       f"subscripts {rhs_term!r} of einsum_str name {len(rhs_term)}")
    kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
    # Validate the equation against the shapes before creating the bias.
    einsum_plan(einsum_str, inputs.shape, shape)
    bias = None
    if self.use_bias:
      bias_shape, bias_bshape = self._get_bias_shape(einsum_str, inputs, kernel)
      bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    y = quantized_einsum_on(self, einsum_str, inputs, kernel, self.recipe,
                            out_dtype=self.preferred_element_type or inputs.dtype)
    if bias is not None:
      y += jnp.reshape(bias, bias_bshape)
    return y
