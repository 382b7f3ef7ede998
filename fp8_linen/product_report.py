"""Which products of a traced program ran quantized, and which did not.

:func:`fp8_linen.quantize_model` sees only the products that go through the
functions it intercepts (``jax.lax.dot_general``, ``jnp.einsum``,
``jnp.matmul``, ``jnp.dot``, ``jax.lax.conv_general_dilated``, looked up when
called). ``x @ w`` does not: the operator calls jax's internal matmul, which
no public attribute reaches. Neither do names bound at import time
(``from jax.numpy import dot``) nor other product functions
(``jnp.tensordot``, ``jnp.inner``, ...). Such products run in the model's own
precision, and this module makes them visible instead of silent.

The interception runs every product it sees under a JAX name scope saying
what it did (:data:`MARKERS`). :func:`product_report` traces a function with
``jax.make_jaxpr`` (nothing is computed) and classifies every product
primitive (``dot_general``, ``conv_general_dilated``) of the program,
including those inside ``jit``, ``remat``, ``scan`` and custom-gradient
sub-programs:

========== ==================================================================
status     meaning
========== ==================================================================
quantized  run by a quantized product (fp8 or integer) on the module's state
excluded   seen, kept in high precision by a rule (``quantize=False``) or
           because its operands are not floating point
skipped    seen, but could not be quantized (a warning said why: an einsum
           with three operands, a scope without the state collection, ...)
unseen     never reached the interception: ``x @ w``, functions bound at
           import time, other product functions, products outside ``apply``
========== ==================================================================

Trace the forward (``apply``), not a training step: backward products come
from the forward ones, and JAX does not keep the name scopes of every
transposed product.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> import fp8_linen as fl
  >>> class M(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     w = self.param('w', nn.initializers.ones, (3, 3))
  ...     return nn.Dense(3)(x) @ w          # the `@` is not intercepted
  >>> qm = fl.quantize_model(M(), on_unquantized='ignore')
  >>> v = qm.init(jax.random.key(0), jnp.ones((2, 3)))
  >>> qm.product_report(v, jnp.ones((2, 3))).counts
  {'quantized': 1, 'unseen': 1}
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.extend as jex
import numpy as np

__all__ = ["MARKERS", "PRODUCT_PRIMITIVES", "STATUSES", "Product", "ProductReport",
           "input_regions", "regions_by_path", "only_product", "product_report"]

# status -> the JAX name scope the interception runs such products under.
MARKERS = {
    "quantized": "fp8_linen_quantized",
    "excluded": "fp8_linen_excluded",
    "skipped": "fp8_linen_skipped",
}
STATUSES = ("quantized", "excluded", "skipped", "unseen")
PRODUCT_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")

# Frames from these packages are never "where the product is written".
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (jax.__file__, __file__))
_STDLIB_DIR = os.path.dirname(os.path.abspath(functools.__file__)) + os.sep


@dataclasses.dataclass(frozen=True, kw_only=True)
class Product:
  """One product primitive of a traced program.

  Attributes:
    status: one of :data:`STATUSES`.
    primitive: ``'dot_general'`` or ``'conv_general_dilated'`` (or
      ``'ragged_dot_general'``).
    shapes: the operand shapes.
    dtypes: the operand dtypes (names).
    scope: the JAX name stack without our markers (Linen adds the module
      path, e.g. ``'Model/attn/query'``).
    location: ``'file.py:123 (function)'`` of the innermost frame outside
      jax, flax, the standard library and fp8_linen, or ``''``.
  """

  status: str
  primitive: str
  shapes: tuple
  dtypes: tuple
  scope: str
  location: str

  def __str__(self):
    ops = " x ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
    where = f" at {self.location}" if self.location else ""
    return f"{self.status:9s} {self.primitive} {ops} in {self.scope or '<top>'}{where}"


@dataclasses.dataclass(frozen=True)
class ProductReport:
  """The :class:`Product` list of a traced program, in program order.

  Example:
    >>> import fp8_linen as fl
    >>> fl.ProductReport(()).counts
    {}
  """

  products: tuple

  @property
  def counts(self) -> dict:
    """``status -> number of products``, statuses in :data:`STATUSES` order, zeros left out."""
    c = collections.Counter(p.status for p in self.products)
    return {s: c[s] for s in STATUSES if c[s]}

  def with_status(self, *statuses: str) -> tuple:
    """The products whose status is one of ``statuses``."""
    bad = [s for s in statuses if s not in STATUSES]
    if bad:
      raise ValueError(f"with_status: statuses {bad} are not among {list(STATUSES)}")
    return tuple(p for p in self.products if p.status in statuses)

  @property
  def unquantized(self) -> tuple:
    """Products that run unquantized without a rule saying so (``skipped`` and ``unseen``)."""
    return self.with_status("skipped", "unseen")

  def __str__(self):
    lines = [", ".join(f"{n} {s}" for s, n in self.counts.items()) or "no products"]
    lines += [f"  {p}" for p in self.products]
    return "\n".join(lines)


def _status(name_stack: str) -> str | None:
  """The innermost marker in a name stack, as a status."""
  found = [(name_stack.rfind(m), s) for s, m in MARKERS.items() if m in name_stack]
  return max(found)[1] if found else None


def _scope(name_stack: str) -> str:
  parts = [p for p in name_stack.split("/") if p not in MARKERS.values()]
  return "/".join(parts)


def _location(source_info) -> str:
  tb = getattr(source_info, "traceback", None)
  for frame in (tb.frames if tb is not None else ()):
    path = os.path.abspath(frame.file_name)
    installed = any(f"{os.sep}{d}{os.sep}" in path for d in ("site-packages", "dist-packages"))
    stdlib = path.startswith(_STDLIB_DIR) and not installed
    if (not path.startswith(_LIBRARY_DIRS) and not stdlib and "<" not in path
        and not any(f"{os.sep}{lib}{os.sep}" in path for lib in ("flax", "jaxlib"))):
      return f"{os.path.basename(path)}:{frame.line_num} ({frame.function_name})"
  return ""


def _walk(jaxpr, inherited: str | None, prefix: str, out: list) -> None:
  for eqn in jaxpr.eqns:
    # Name stacks inside a sub-program (jit, remat, scan, custom_vjp) are
    # relative to the equation that holds it.
    name_stack = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
    status = _status(name_stack) or inherited
    if eqn.primitive.name in PRODUCT_PRIMITIVES:
      avals = [v.aval for v in eqn.invars[:2]]
      out.append(Product(status=status or "unseen", primitive=eqn.primitive.name,
                         shapes=tuple(tuple(a.shape) for a in avals),
                         dtypes=tuple(str(a.dtype) for a in avals),
                         scope=_scope(name_stack), location=_location(eqn.source_info)))
    for sub in jex.core.jaxprs_in_params(eqn.params):
      _walk(sub, status, name_stack, out)


def product_report(fn: Callable, *args, **kwargs) -> ProductReport:
  """Traces ``fn(*args, **kwargs)`` (nothing runs) and classifies its products.

  Args:
    fn: a function that runs a quantized model's forward, e.g.
      ``qmodel.apply`` (:meth:`~fp8_linen.QuantizedModel.product_report` is
      this with ``fn=qmodel.apply``).
    *args: its arguments. Arrays may be given as ``jax.ShapeDtypeStruct``
      (e.g. variables from ``jax.eval_shape(qmodel.init, ...)``: nothing
      is computed); other values (``train=False``, ``None``) stay static.
    **kwargs: its keyword arguments, the same way.

  Returns:
    A :class:`ProductReport`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> fl.product_report(jnp.matmul, jnp.ones((2, 3)), jnp.ones((3, 4))).counts
    {'unseen': 1}
  """
  # Arrays (and ShapeDtypeStructs, so a report needs no real variables) become
  # the traced arguments; everything else stays a static Python value.
  leaves, tree = jax.tree.flatten((args, kwargs))
  dynamic = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]

  def traced(*arrays):
    it = iter(arrays)
    a, kw = jax.tree.unflatten(tree, [next(it) if d else x for x, d in zip(leaves, dynamic)])
    return fn(*a, **kw)

  closed = jax.make_jaxpr(traced)(*[x for x, d in zip(leaves, dynamic) if d])
  out: list = []
  _walk(closed.jaxpr, None, "", out)
  return ProductReport(tuple(out))


# Primitives that only view their one operand (its values, in another dtype or shape).
_VIEWS = frozenset({"convert_element_type", "reshape", "squeeze", "expand_dims", "copy",
                    "copy_p"})
# Higher-order primitives whose sub-program runs other values than the operands.
_LOOPS = frozenset({"scan", "while", "cond", "shard_map", "xla_pmap"})
_OTHER = None


def _region(name_stack: str) -> str | None:
  """The quantized product a name stack is inside: the stack through its marker, or ``None``."""
  marker = MARKERS["quantized"]
  at = name_stack.find(marker)
  return None if at < 0 else name_stack[:at + len(marker)]


def _follow(jaxpr, tracked: dict, prefix: str, regions: list) -> dict:
  """Follows the tracked variables (``var -> input index``) through ``jaxpr``'s equations.

  Adds to ``regions[i]`` the quantized product each use of input ``i`` is
  inside, or ``_OTHER`` for a use that is no view and no quantized product.
  Returns the outputs that are views of an input (``outvar -> index``).
  """
  for eqn in jaxpr.eqns:
    used = [(k, tracked[v]) for k, v in enumerate(eqn.invars)
            if not isinstance(v, jex.core.Literal) and v in tracked]
    if not used:
      continue
    name_stack = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
    region = _region(name_stack)
    name = eqn.primitive.name
    subs = list(jex.core.jaxprs_in_params(eqn.params))
    if region is not None:
      for _, i in used:
        regions[i].add(region)
    elif name in _VIEWS and len(eqn.invars) == 1 and eqn.params.get("dimensions") is None:
      tracked[eqn.outvars[0]] = used[0][1]
    elif (name not in _LOOPS and len(subs) == 1 and len(subs[0].invars) == len(eqn.invars)
          and len(subs[0].outvars) == len(eqn.outvars)):
      # A call (jit, remat, a custom derivative): its sub-program runs the operands.
      out = _follow(subs[0], {subs[0].invars[k]: i for k, i in used}, name_stack, regions)
      for k, v in enumerate(subs[0].outvars):
        if not isinstance(v, jex.core.Literal) and v in out:
          tracked[eqn.outvars[k]] = out[v]
    else:
      for _, i in used:
        regions[i].add(_OTHER)
  return {v: tracked[v] for v in jaxpr.outvars
          if not isinstance(v, jex.core.Literal) and v in tracked}


def input_regions(fn: Callable, *args) -> list:
  """Which quantized products each array argument of ``fn`` reaches, and only them.

  Traces ``fn(*args)`` (nothing runs; arguments are pytrees of arrays or
  ``jax.ShapeDtypeStruct`` s) and follows every leaf through the views of its
  values (casts, reshapes, and calls such as ``jit`` or ``remat`` that pass it
  on) to the quantized products that read it (the name stack through
  :data:`MARKERS` ``['quantized']``: ``'<module path>/fp8_linen_quantized'``).
  A weight whose every use is one product may be stored as that product's
  codes (:func:`fp8_linen.convert`).

  Returns:
    One entry per leaf of ``args`` (``jax.tree.leaves`` order): the
    frozenset of product scopes it reaches, or ``None`` when it is also used
    otherwise (any other operation, a loop body, an output of ``fn``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen.product_report import input_regions
    >>> def f(w, x):
    ...   w = w.astype(jnp.bfloat16).reshape(3, 2)
    ...   with jax.named_scope('proj'), jax.named_scope('fp8_linen_quantized'):
    ...     y = x @ w
    ...   return y, x + 1
    >>> input_regions(f, jnp.ones((6,)), jnp.ones((2, 3), jnp.bfloat16))
    [frozenset({'proj/fp8_linen_quantized'}), None]
  """
  closed = jax.make_jaxpr(fn)(*args)
  regions: list = [set() for _ in closed.jaxpr.invars]
  out = _follow(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars)}, "", regions)
  for i in out.values():
    regions[i].add(_OTHER)
  return [None if _OTHER in r else frozenset(r) for r in regions]


def regions_by_path(fn: Callable, tree, *args) -> dict:
  """:func:`input_regions` of ``fn(tree, *args)``, keyed by each leaf's path in ``tree``.

  A path is the leaf's dict keys and sequence indices (``('params', 'proj',
  'kernel')``; an ``nnx.State`` 's ``('proj', 'kernel')``), attribute keys
  (a variable's ``value``) left out.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  regions = input_regions(fn, tree, *args)[:len(leaves)]
  return {tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path
                if not isinstance(k, jax.tree_util.GetAttrKey)): r
          for (path, _), r in zip(leaves, regions)}


def only_product(regions: frozenset | None, scope: str) -> bool:
  """Whether an :func:`input_regions` entry is exactly the quantized product at ``scope``.

  ``scope`` is the product's path as its name stack ends (``'proj/dot_general_0'``).
  """
  if not regions or len(regions) != 1:
    return False
  (region,) = regions
  suffix = f"{scope}/{MARKERS['quantized']}" if scope else MARKERS["quantized"]
  return region == suffix or region.endswith("/" + suffix)
