"""Dimension-number algebra: canonical forms, gradient products, layouts, einsums.

Pure Python on shapes and axis indices (no arrays are touched), shared by the
fp8 and integer products:

* :func:`canonical_dn` and :func:`free_dims` for ``lax.dot_general`` dimension
  numbers;
* :func:`grad_dims`: the one rule for both gradient products of a
  ``dot_general`` (which operands, which dimension numbers, which transpose);
* :func:`layout` / :func:`relayout`: where per-row scales of the operands land
  in the output (row-wise scaling);
* :func:`einsum_plan`: a two-operand einsum as one ``dot_general``.

Example:
  >>> from fp8_linen.core import dims
  >>> dims.grad_dims((((1,), (0,)), ((), ())), 2, 2, "lhs")
  ((((1,), (1,)), ((), ())), True, (0, 1))
"""

from __future__ import annotations

import dataclasses
import string
from typing import NamedTuple, Sequence

__all__ = [
    "DimensionNumbers",
    "canonical_dn",
    "conv_contract",
    "free_dims",
    "grad_dims",
    "Layout",
    "layout",
    "relayout_axes",
    "flip",
    "EinsumPlan",
    "einsum_plan",
]

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]],
                         tuple[tuple[int, ...], tuple[int, ...]]]


def canonical_dn(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
  """Dimension numbers as tuples of non-negative ints (hashable, static)."""
  (lc, rc), (lb, rb) = dimension_numbers
  norm = lambda dims, n: tuple(int(d) % n if n else int(d) for d in dims)
  dn = ((norm(lc, lhs_ndim), norm(rc, rhs_ndim)), (norm(lb, lhs_ndim), norm(rb, rhs_ndim)))
  if len(dn[0][0]) != len(dn[0][1]) or len(dn[1][0]) != len(dn[1][1]):
    raise ValueError(f"dimension_numbers {dimension_numbers} pair unequal numbers of dimensions")
  return dn


def conv_contract(lhs_ndim: int, rhs_ndim: int, cdn) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The contracting axes of a convolution's operands, as a GEMM would have them.

  Every input axis but the batch axis (features and the window), every kernel
  axis but the output-feature axis; ``cdn`` is a ``ConvDimensionNumbers``.
  """
  return (tuple(d for d in range(lhs_ndim) if d != cdn.lhs_spec[0]),
          tuple(d for d in range(rhs_ndim) if d != cdn.rhs_spec[0]))


def free_dims(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
  """The axes of an operand that are neither contracted nor batch axes."""
  return [d for d in range(ndim) if d not in contract and d not in batch]


def grad_dims(dn: DimensionNumbers, lhs_ndim: int, rhs_ndim: int, wrt: str):
  """How to compute the gradient of ``dot_general(lhs, rhs, dn)`` w.r.t. one operand.

  The gradient ``g`` has the output layout (batch, lhs-free, rhs-free). The
  gradient w.r.t. ``lhs`` is ``dot_general(g, rhs, gdn)`` and w.r.t. ``rhs`` is
  ``dot_general(lhs, g, gdn)``, each followed by a transpose into the operand's
  own axis order.

  Args:
    dn: canonical dimension numbers of the forward product.
    lhs_ndim: rank of ``lhs``.
    rhs_ndim: rank of ``rhs``.
    wrt: ``'lhs'`` or ``'rhs'``.

  Returns:
    ``(gdn, g_first, perm)``: the gradient product's dimension numbers, whether
    ``g`` is its first operand, and the permutation to apply to its output.
  """
  (lc, rc), (lb, rb) = dn
  l_free, r_free = free_dims(lhs_ndim, lc, lb), free_dims(rhs_ndim, rc, rb)
  nb, nl = len(lb), len(l_free)
  batch = tuple(range(nb))
  if wrt == "lhs":
    g_rfree = tuple(range(nb + nl, nb + nl + len(r_free)))
    gdn = ((g_rfree, tuple(r_free)), (batch, tuple(rb)))
    # Output axes: batch, lhs-free, then rhs contracting axes in increasing order.
    src = list(lb) + l_free + [lc[list(rc).index(d)] for d in sorted(rc)]
    ndim, g_first = lhs_ndim, True
  elif wrt == "rhs":
    g_lfree = tuple(range(nb, nb + nl))
    gdn = ((tuple(l_free), g_lfree), (tuple(lb), batch))
    # Output axes: batch, lhs contracting axes in increasing order, then rhs-free.
    src = list(rb) + [rc[list(lc).index(d)] for d in sorted(lc)] + r_free
    ndim, g_first = rhs_ndim, False
  else:
    raise ValueError(f"wrt must be 'lhs' or 'rhs', got {wrt!r}")
  return gdn, g_first, tuple(src.index(i) for i in range(ndim))


class Layout(NamedTuple):
  """Where the axes of lhs, rhs and the output (= gradient) of a GEMM go."""

  lhs_to_out: list
  rhs_to_out: list
  lhs_free_out: tuple  # output axes of lhs's free dims
  rhs_free_out: tuple  # output axes of rhs's free dims
  out_ndim: int


def layout(dn: DimensionNumbers, lhs_ndim: int, rhs_ndim: int) -> Layout:
  """The :class:`Layout` of ``dot_general(lhs, rhs, dn)``."""
  (lc, rc), (lb, rb) = dn
  l_free = free_dims(lhs_ndim, lc, lb)
  r_free = free_dims(rhs_ndim, rc, rb)
  nb, nl = len(lb), len(l_free)
  lhs_to_out = [(a, i) for i, a in enumerate(lb)] + [(a, nb + j) for j, a in enumerate(l_free)]
  rhs_to_out = ([(a, i) for i, a in enumerate(rb)]
                + [(a, nb + nl + j) for j, a in enumerate(r_free)])
  return Layout(lhs_to_out, rhs_to_out, tuple(range(nb, nb + nl)),
                tuple(range(nb + nl, nb + nl + len(r_free))), nb + nl + len(r_free))


def relayout_axes(src_shape: Sequence[int], pairs, dst_ndim: int):
  """Plans moving axes of an array to new positions; every other axis has size 1.

  ``pairs`` lists ``(src_axis, dst_axis)``; the source axes not listed must
  have size 1 and are dropped; the result has size 1 on every destination axis
  not listed.

  Returns:
    ``(squeeze_axes, transpose_perm, dst_shape)`` to apply in that order.
  """
  src = [a for a, _ in pairs]
  squeeze = tuple(a for a in range(len(src_shape)) if a not in src)
  remaining = sorted(src)
  by_dst = sorted(pairs, key=lambda p: p[1])
  perm = tuple(remaining.index(a) for a, _ in by_dst)
  shape = [1] * dst_ndim
  for a, d in by_dst:
    shape[d] = src_shape[a]
  return squeeze, perm, tuple(shape)


def flip(pairs):
  """``(a, b)`` pairs as ``(b, a)``: the inverse mapping."""
  return [(b, a) for a, b in pairs]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EinsumPlan:
  """How a two-operand einsum runs as a single ``dot_general``.

  Attributes:
    lhs_sum_axes: axes of the left operand summed away before the product:
      letters that appear only there and not in the output, and size-1 axes
      that broadcast against the right operand (summing a size-1 axis is a
      squeeze; the letter then lives in the right operand alone).
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
  # Right-aligned, as numpy broadcasts: a shorter ellipsis takes the last letters.
  return term.replace("...", letters[len(letters) - n:] if n else "")


def einsum_plan(equation: str, lhs_shape: Sequence[int], rhs_shape: Sequence[int]) -> EinsumPlan:
  """Lowers ``jnp.einsum(equation, lhs, rhs)`` to one ``dot_general``.

  Supported: any two-operand equation (explicit ``->`` or implicit output),
  batch, contracting and free dimensions in any order, and numpy
  broadcasting: ellipses of different ranks (right-aligned) and size-1 axes
  against larger ones (multi-/grouped-query attention: ``'btnh,bsnh->bnts'``
  with one key head). A broadcast axis is squeezed out of the operand where
  it has size 1, so it becomes a free (or summed) axis of the other operand
  and nothing is materialized: with one key head, all query heads go through
  one GEMM against the single key. Not supported (raises
  ``NotImplementedError``): repeated letters within one operand (diagonals).

  Args:
    equation: the einsum equation, e.g. ``'...qhd,...khd->...hqk'``.
    lhs_shape: shape of the first operand.
    rhs_shape: shape of the second operand.

  Returns:
    An :class:`EinsumPlan`.

  Raises:
    ValueError: for malformed equations or sizes that do not broadcast
      (naming them).
    NotImplementedError: for the unsupported form above.

  Example:
    >>> from fp8_linen.core.dims import einsum_plan
    >>> einsum_plan('bd,df->bf', (2, 3), (3, 4)).dimension_numbers
    (((1,), (0,)), ((), ()))
    >>> p = einsum_plan('btnh,bsnh->bnts', (1, 4, 2, 8), (1, 4, 1, 8))  # one key head
    >>> p.rhs_sum_axes, p.dimension_numbers
    ((2,), (((3,), (2,)), ((0,), (0,))))
  """
  eq = equation.replace(" ", "")
  if eq.count(",") != 1 or eq.count("->") > 1:
    raise ValueError(f"einsum: equation {equation!r} must have exactly two operands and at "
                     "most one '->'")
  ins, arrow, out = eq.partition("->")
  lt, rt = ins.split(",")
  used = set(c for c in eq if c.isalpha())
  free_letters = "".join(c for c in string.ascii_letters if c not in used)
  nl = len(lhs_shape) - (len(lt) - 3) if "..." in lt else 0
  nr = len(rhs_shape) - (len(rt) - 3) if "..." in rt else 0
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
  lsize, rsize = dict(zip(L, lhs_shape)), dict(zip(R, rhs_shape))
  drop_l, drop_r = set(), set()  # size-1 axes that broadcast against the other operand
  for c in L:
    if c in R and lsize[c] != rsize[c]:
      if lsize[c] == 1:
        drop_l.add(c)
      elif rsize[c] == 1:
        drop_r.add(c)
      else:
        raise ValueError(f"einsum: subscript {c!r} of {equation!r} has size {lsize[c]} in lhs "
                         f"but {rsize[c]} in rhs")
  Lk = "".join(c for c in L if c not in drop_l)
  Rk = "".join(c for c in R if c not in drop_r)
  lsum = tuple(i for i, c in enumerate(L) if c in drop_l or (c not in Rk and c not in O))
  rsum = tuple(i for i, c in enumerate(R) if c in drop_r or (c not in Lk and c not in O))
  L2 = "".join(c for c in Lk if c in Rk or c in O)
  R2 = "".join(c for c in Rk if c in Lk or c in O)
  batch = [c for c in L2 if c in R2 and c in O]
  contract = [c for c in L2 if c in R2 and c not in O]
  lfree = [c for c in L2 if c not in R2]
  rfree = [c for c in R2 if c not in L2]
  dn = ((tuple(L2.index(c) for c in contract), tuple(R2.index(c) for c in contract)),
        (tuple(L2.index(c) for c in batch), tuple(R2.index(c) for c in batch)))
  produced = batch + lfree + rfree
  return EinsumPlan(lhs_sum_axes=lsum, rhs_sum_axes=rsum, dimension_numbers=dn,
                    out_perm=tuple(produced.index(c) for c in O))
