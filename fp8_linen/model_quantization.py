"""Run an unmodified Linen model with its matrix products in fp8.

:func:`quantize_model` wraps a model you did not write. Its ``init``/``apply``
run the model with:

* ``flax.linen.intercept_methods``, which tells us which module is running
  (its path is matched against the :class:`QuantizationRule` list), and
* ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated``,
  ``jax.numpy.einsum``, ``jax.numpy.matmul`` and ``jax.numpy.dot``
  intercepted (:mod:`fp8_linen.interception`) for the duration of the call:
  they run the quantized product of :mod:`fp8_linen.linen.access` on that
  module's state.

That covers ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``,
``nn.Embed.attend``, flax's attention (its two ``jnp.einsum`` calls) and raw
``jax.lax.dot_general`` / ``jnp.einsum`` / ``jnp.matmul`` / ``jnp.dot`` /
``jax.lax.conv_general_dilated`` calls inside any module method.

What the default rules quantize: every product seen, i.e. the projections,
the attention math (``q·k`` and ``p·v``) and the logits head.
:func:`projection_rules` is the usual fp8 training choice instead: projections
only, attention math and the logits head in high precision.

Where the state goes: for ``nn.Dense``/``nn.DenseGeneral``/``nn.Einsum``/``nn.Conv``
at the layer's own path (the same place as ``QDense``/``QDenseGeneral``/
``QEinsum``/``QConv``); for raw calls in other modules in a child scope per call
site, ``<module path>/<op>_<i>`` (``einsum_0``, ``dot_general_1``, ``matmul_0``,
``dot_0``, ``conv_0``), numbered in call order within one method call. The
``params`` tree is untouched, so checkpoints of the unmodified model load as
they are.

Nested ``apply`` (a tied output head written
``self.head.apply({'params': {'kernel': emb.T}}, h)``): the nested call runs
on a scope of its own that holds only the variables passed to it, never the
fp8 state. Its products are quantized with their state kept by the outer
model, at the path the nested module would have as a child of the module that
called ``apply`` (``head`` above: the same place as if ``self.head(h)`` were
called), and rules match that path. Only when that is impossible (the nested
call runs inside a transform of its own) does the product run unquantized,
with a warning.

Lifted transforms: ``nn.remat``, ``nn.scan``, ``nn.vmap``, ``nn.jit`` work as
long as the transform carries the ``_overwrite_with_gradient`` collection
(``nn.remat`` does; give ``nn.scan``/``nn.vmap`` ``variable_axes={...,
fl.OWG: 0}`` or ``{True: 0}``). A scanned body without it cannot keep state:
its products run unquantized and a warning names the fix.

Limits (by construction):

* ``x @ w`` (the operator calls jax's internal matmul), other product
  functions (``jnp.tensordot``, ``jnp.inner``, ...) and names bound at import
  time (``from jax.lax import dot_general``) are not seen. ``init`` traces the
  model once more and warns when its forward has such products
  (``on_unquantized``); :func:`~fp8_linen.product_report` lists them;
* einsums that cannot run as one product (three or more operands,
  diagonals), ``out_sharding=`` arguments, and ops called outside any module
  method run unquantized with a warning (once per call site);
* products of non-floating operands are never quantized;
* under ``jax.jit`` the choice is made when tracing; jit the wrapper's
  ``apply`` (or a function calling it), as usual.

The interception is context-local (``contextvars``): two threads may trace at
the same time, one quantized and one not, and each gets its own program.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> import fp8_linen as fl
  >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
  >>> qmodel = fl.quantize_model(model, fl.Fp8Recipe(), rules=[
  ...     fl.QuantizationRule(module_path='layers_2', quantize=False),
  ...     fl.QuantizationRule(module_path='.*')])
  >>> v = qmodel.init(jax.random.key(0), jnp.ones((4, 3)))
  >>> sorted(v[fl.OWG])
  ['layers_0']
  >>> jax.tree.map(jnp.shape, v['params']) == jax.tree.map(
  ...     jnp.shape, model.init(jax.random.key(0), jnp.ones((4, 3)))['params'])
  True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
import string
import threading
import warnings
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp

from fp8_linen import interception
from fp8_linen.core import settings, uses
from fp8_linen.core.dims import einsum_plan
from fp8_linen.core.owg import OWG
from fp8_linen.linen.conv import conv_kwargs_from
from fp8_linen.families.table import family_for
from fp8_linen.linen.access import (quantized_conv_on, quantized_dot_general_on,
                                    quantized_einsum_on, quantized_ragged_dot_on)
from fp8_linen.product_report import MARKERS, ProductReport, product_report
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.rules import (OPERANDS, OPS, QuantizationRule, normalize_rules,
                                     report_unmatched)

__all__ = ["OPS", "OPERANDS", "QuantizationRule", "QuantizedModel", "projection_rules",
           "quantize_model", "quantization"]

_CHOICES = ("warn", "raise", "ignore")

# Layers whose one product keeps its state at the layer's own path.
_OWN_STATE_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv)


def projection_rules(recipe=None, *, head: str | None = None) -> tuple[QuantizationRule, ...]:
  """Projections in fp8; attention math and the logits head in high precision.

  The usual choice for training a language model in fp8: every product with a
  weight operand (``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``
  and raw products against a module's own parameter) is quantized; products
  between two activations (attention scores and the attention-weighted
  values) and products against an embedding table (the logits head: tied,
  through ``Embed.attend`` or a nested ``apply``, or untied with the table's
  shape) keep the model's precision.

  Args:
    recipe: the projections' recipe (``None``: the one given to
      :func:`quantize_model`).
    head: a module-path regular expression for a logits head that is not
      recognised by its shape (e.g. a classifier: ``'.*classifier'``).

  Returns:
    The rules, for ``quantize_model(model, rules=...)``.

  Example:
    >>> import flax.linen as nn
    >>> import fp8_linen as fl
    >>> qm = fl.quantize_model(nn.Dense(4), rules=fl.projection_rules())
    >>> [r.operands for r in qm.rules]
    ['embedding', 'activations', 'weight']
  """
  rules = [] if head is None else [QuantizationRule(module_path=head, quantize=False)]
  return tuple(rules) + (
      QuantizationRule(operands="embedding", quantize=False, optional=True),
      QuantizationRule(operands="activations", quantize=False, optional=True),
      QuantizationRule(operands="weight", recipe=recipe),
  )


# ----------------------------------------------------------------------------
# The running module: its logical path and where its state lives.
# ----------------------------------------------------------------------------


def _trace_state():
  return jax.extend.core.get_opaque_trace_state(convention="flax")


def _holds_state(scope) -> bool:
  """Whether the variables ``scope`` belongs to can have the fp8 state collection."""
  return scope.is_mutable_collection(OWG) or not scope.is_collection_empty(OWG)


class _Frame:
  """One running module method.

  ``kind`` says where the module's state lives: ``'own'`` in its own scope;
  ``'nested'`` in the outer model, under ``anchor`` (the scope of the module
  that called a nested ``apply``) at the relative names ``rel``; ``'none'``
  nowhere (its products run unquantized).
  """

  __slots__ = ("module", "counts", "own_used", "kind", "anchor", "anchor_path", "base",
               "entry", "shared", "trace")

  def __init__(self, module, kind, *, anchor=None, anchor_path=(), base=()):
    self.module = module
    self.counts = {}
    self.own_used = False
    self.kind = kind
    self.anchor, self.anchor_path, self.base = anchor, tuple(anchor_path), tuple(base)
    self.entry = tuple(module.path)
    # nn.share_scope: the module runs on another module's scope (gemma's gated
    # MLP runs two Einsum children on the MLP's). Its products keep their state
    # in a child named after the module, so two modules never share a state.
    path = tuple(module.scope.path)
    name = module.name
    child = isinstance(module.parent, nn.Module)  # not the root of an apply (nested or not)
    self.shared = (name,) if (child and name and (not path or path[-1] != name)) else ()
    self.trace = _trace_state()

  def live(self) -> tuple:
    """Names below the module's path at which its code runs now.

    MaxText's ``ToLinen`` extends the Linen scope's path in place while each
    NNX submodule runs (``decoder/layers_0/mlp/wi_0``): products then keep
    their state, and rules see them, at that submodule's path, not numbered
    in call order at the bridge's.
    """
    now = tuple(self.module.scope.path)
    n = len(self.entry)
    return now[n:] if len(now) > n and now[:n] == self.entry else ()

  @property
  def path(self) -> str:
    rel = self.base + self.entry
    names = self.anchor_path + rel if self.kind == "nested" else self.entry
    return "/".join(names + self.shared + self.live())

  def home(self):
    """The scope that holds this module's own state (at its live sub-path)."""
    below = self.shared + self.live()
    if self.kind == "own":
      scope = self.module.scope
      if not below:
        return scope
      now, scope.path = scope.path, self.entry  # push from the path the variables live at
      try:
        for name in below:
          scope = scope.push(name, reuse=True)
      finally:
        self.module.scope.path = now
      return scope
    scope = self.anchor
    for name in self.base + self.entry + below:
      scope = scope.push(name, reuse=True)
    return scope


def _new_frame(stack: list, module) -> _Frame:
  prev = stack[-1] if stack else None
  scope = module.scope
  if prev is None or _holds_state(scope):
    return _Frame(module, "own")
  if scope.root is prev.module.scope.root:  # deeper in the same variables (nested or not)
    return _Frame(module, prev.kind, anchor=prev.anchor, anchor_path=prev.anchor_path,
                  base=prev.base)
  if prev.kind != "none" and _trace_state() == prev.trace:
    # A nested `apply` called by prev's method: keep its state where the outer
    # model would keep this module's, as a child of prev.
    anchor_path = tuple(prev.path.split("/")) if prev.path else ()
    return _Frame(module, "nested", anchor=prev.home(), anchor_path=anchor_path,
                  base=(module.name or type(module).__name__,))
  return _Frame(module, "none")


class _Session:
  def __init__(self, rules, recipe):
    self.rules = rules
    self.recipe = recipe
    self.hits = [0] * len(rules)
    self.seen = 0  # products that reached a handler (0: nothing was traced)
    self.stack: list[_Frame] = []
    self.vocab_table = None  # (rows, sorted shape) of the largest nn.Embed table seen
    self.by_operands = any(r.operands != "any" for r in rules)

  def operand_kinds(self, frame: _Frame, lhs, rhs) -> set:
    """``{'weight', 'embedding'}``, ``{'weight'}`` or ``{'activations'}``."""
    params = frame.module.variables.get("params", {})
    own = {tuple(sorted(jnp.shape(v))) for v in
           (nn.meta.unbox(v) for v in params.values() if not isinstance(v, Mapping))
           if jnp.ndim(v) >= 1}
    weights = [tuple(sorted(jnp.shape(x))) for x in (lhs, rhs)]
    weights = [w for w in weights if w in own]
    if not weights:
      return {"activations"}
    table = self.vocab_table and self.vocab_table[1]
    if isinstance(frame.module, nn.Embed) or any(w == table for w in weights):
      return {"weight", "embedding"}
    return {"weight"}

  def note_tables(self, module, args, kwargs) -> None:
    """Records the vocabulary table if ``module``'s method looked up token ids in it.

    A table is an embedding by what it does, not by its class: an ``nn.Embed``,
    or any module holding a 2-D parameter whose method took integer ids
    (gemma's ``Embedder.encode``, MaxText's ``Embed``). The vocabulary is the
    table with the most rows (position and token-type tables are smaller);
    only its shape marks a logits head that multiplies it.
    """
    params = module.variables.get("params", {})
    if isinstance(module, nn.Embed):
      tables = [params.get("embedding")]
    elif any(jnp.issubdtype(jnp.result_type(a), jnp.integer)
             for a in jax.tree.leaves((args, kwargs)) if hasattr(a, "dtype")):
      tables = [v for v in params.values() if not isinstance(v, Mapping)]
    else:
      return
    for table in tables:
      shape = jnp.shape(nn.meta.unbox(table)) if table is not None else ()
      if len(shape) == 2 and (self.vocab_table is None or shape[0] > self.vocab_table[0]):
        self.vocab_table = (shape[0], tuple(sorted(shape)))

  def recipe_for(self, frame: _Frame, op: str, lhs, rhs):
    kinds = self.operand_kinds(frame, lhs, rhs) if self.by_operands else set()
    for i, rule in enumerate(self.rules):
      if (op in rule.ops and re.fullmatch(rule.module_path, frame.path)
          and (rule.operands == "any" or rule.operands in kinds)):
        self.hits[i] += 1
        return (rule.recipe or self.recipe) if rule.quantize else None
    return None


_SESSION: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_qm_session", default=None)
# The session's configuration, in JAX's jit cache keys: a function jitted
# inside the model (nn.jit, a raw jax.jit) traced as float is traced again
# when the model runs quantized, and the other way round.
_QUANTIZING = settings.TraceSetting("quantize_model", default=None)
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
  sess = _SESSION.get()
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
    sess = _SESSION.get()
    path = sess.stack[-1].path if sess and sess.stack else ""
    _warn_once((op, path, reason), f"fp8_linen.quantize_model: {op} in module "
               f"{path or '<root>'!r} runs unquantized: {reason}")
  with jax.named_scope(MARKERS[kind]):
    return call()


def _run(frame: _Frame, op: str, fn):
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


_HANDLERS = {"jax.lax.dot_general": _dot_general, "jax.numpy.einsum": _einsum,
             "jax.numpy.matmul": _matmul_like("matmul", _matmul_equation),
             "jax.numpy.dot": _matmul_like("dot", _dot_equation),
             "jax.lax.conv_general_dilated": _conv_general_dilated,
             "jax.lax.ragged_dot": _ragged_dot}


def _interceptor(next_fun, args, kwargs, context):
  sess = _SESSION.get()
  module = context.module
  if sess is None or context.method_name == "setup" or module.scope is None:
    # An unbound module's method (a model overriding ``init`` and calling its
    # own helpers before binding) has no path and no state: not a product site.
    return next_fun(*args, **kwargs)
  sess.stack.append(_new_frame(sess.stack, module))
  try:
    out = next_fun(*args, **kwargs)
  finally:
    sess.stack.pop()
  if sess.by_operands:
    sess.note_tables(module, args, kwargs)
  return out


# ----------------------------------------------------------------------------
# The public entry points.
# ----------------------------------------------------------------------------


def _check_choice(name: str, value: str) -> None:
  if value not in _CHOICES:
    raise ValueError(f"{name}={value!r}: allowed values are 'warn', 'raise', 'ignore'")


@contextlib.contextmanager
def quantization(recipe=None, rules: Sequence[QuantizationRule] | None = None, *,
                 on_unmatched: str = "warn"):
  """Context in which Linen modules' products run quantized (see module doc).

  Everything traced inside (``model.init``, ``model.apply``) is quantized by
  the rules. When the context closes, rules that matched no op are reported:
  a warning (``on_unmatched='warn'``), a ``ValueError`` (``'raise'``), or nothing
  (``'ignore'``).

  Args:
    recipe: the default recipe (:class:`~fp8_linen.Fp8Recipe` if ``None``).
    rules: :class:`QuantizationRule` list (default: quantize everything).
    on_unmatched: ``'warn'``, ``'raise'`` or ``'ignore'``.

  Yields:
    Nothing.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> with fl.quantization(fl.Fp8Recipe()):
    ...   v = nn.Dense(3).init(jax.random.key(0), jnp.ones((2, 4)))
    >>> 'input_scale' in v[fl.OWG]
    True
  """
  _check_choice("on_unmatched", on_unmatched)
  rules = normalize_rules(rules)
  sess = _Session(rules, recipe or Fp8Recipe())
  token = _SESSION.set(sess)
  try:
    with (_QUANTIZING.set((sess.recipe, rules)), interception.intercept(_HANDLERS),
          nn.intercept_methods(_interceptor)):
      yield
  finally:
    _SESSION.reset(token)
  if not sess.seen:
    # Nothing was traced in the block (every jitted part of the model was
    # replayed from JAX's cache): no rule can be said to have matched nothing.
    return
  report_unmatched(rules, sess.hits, on_unmatched, stacklevel=3,
                   what="fp8_linen.quantize_model: these rules matched no module op (check "
                        "the module paths, e.g. with model.tabulate)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizedModel:
  """An unmodified Linen model run under :func:`quantization`.

  ``init``, ``init_with_output`` and ``apply`` take the same arguments as the
  model's; the variables gain the :data:`~fp8_linen.OWG` collection, ``params``
  are unchanged. Pass ``qmodel.apply`` as ``apply_fn`` to
  :class:`~fp8_linen.TrainState`.

  Attributes:
    model: the wrapped module.
    recipe: the default recipe.
    rules: the :class:`QuantizationRule` list.
    on_unmatched: what to do with rules that match nothing (see
      :func:`quantization`).
    on_unquantized: what ``init`` does when the model's forward has products
      the interception never sees (``x @ w`` and the like, see
      :func:`~fp8_linen.product_report`): ``'warn'``, ``'raise'``, or
      ``'ignore'`` (which also skips the extra trace the check costs).
  """

  model: nn.Module
  recipe: Any = None
  rules: tuple = (QuantizationRule(),)
  on_unmatched: str = "warn"
  on_unquantized: str = "warn"

  def _ctx(self, on_unmatched=None):
    return quantization(self.recipe, self.rules, on_unmatched=on_unmatched or self.on_unmatched)

  def _check_init(self, method: str, args, kwargs) -> None:
    if self.on_unquantized == "ignore":
      return
    def traced():
      with self._ctx(on_unmatched="ignore"):
        return getattr(self.model, method)(*args, **kwargs)
    try:
      report = product_report(traced)
    except Exception as e:  # pylint: disable=broad-except
      # The check traces the model abstractly; a model that only runs with
      # concrete values must not fail its init because of it.
      warnings.warn(f"fp8_linen.quantize_model: could not trace the model to check its "
                    f"products ({type(e).__name__}: {e}); pass on_unquantized='ignore' to "
                    "skip the check", stacklevel=3)
      return
    unseen = report.with_status("unseen")
    if not unseen:
      return
    msg = (f"fp8_linen.quantize_model: {len(unseen)} product(s) of the model's forward never "
           "reach the interception and run unquantized (`x @ w`, functions bound at import "
           "time, other product functions; write them as jnp.matmul / jnp.einsum / a Linen "
           "layer to quantize them):\n" + "\n".join(f"  {p}" for p in unseen[:10])
           + ("\n  ..." if len(unseen) > 10 else ""))
    if self.on_unquantized == "raise":
      raise ValueError(msg)
    warnings.warn(msg, stacklevel=3)

  def init(self, *args, **kwargs):
    """``model.init`` with quantization (creates the fp8 state)."""
    with self._ctx():
      out = self.model.init(*args, **kwargs)
    self._check_init("init", args, kwargs)
    return out

  def init_with_output(self, *args, **kwargs):
    """``model.init_with_output`` with quantization."""
    with self._ctx():
      out = self.model.init_with_output(*args, **kwargs)
    self._check_init("init_with_output", args, kwargs)
    return out

  def apply(self, *args, **kwargs):
    """``model.apply`` with quantization."""
    with self._ctx():
      return self.model.apply(*args, **kwargs)

  def product_report(self, *args, **kwargs) -> ProductReport:
    """:func:`~fp8_linen.product_report` of ``apply(*args, **kwargs)`` (nothing runs).

    The variables may be abstract: ``jax.eval_shape(qmodel.init, rng, x)``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import fp8_linen as fl
      >>> qm = fl.quantize_model(nn.Dense(2))
      >>> v = qm.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> qm.product_report(v, jnp.ones((1, 3))).counts
      {'quantized': 1}
    """
    return product_report(self.apply, *args, **kwargs)


def quantize_model(model: nn.Module, recipe=None,
                   rules: Sequence[QuantizationRule] | None = None, *,
                   on_unmatched: str = "warn", on_unquantized: str = "warn") -> QuantizedModel:
  """Wraps an unmodified Linen model so its products run quantized.

  Args:
    model: any ``flax.linen`` module.
    recipe: the default recipe (:class:`~fp8_linen.Fp8Recipe` if ``None``).
    rules: ordered :class:`QuantizationRule` list; the first match decides
      (default: quantize every product; :func:`projection_rules` for
      projections only).
    on_unmatched: ``'warn'``, ``'raise'`` or ``'ignore'`` for rules that match
      nothing.
    on_unquantized: ``'warn'``, ``'raise'`` or ``'ignore'`` for products the
      interception never sees (checked at ``init``, see
      :class:`QuantizedModel`).

  Returns:
    A :class:`QuantizedModel` with ``init``/``init_with_output``/``apply``.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> qm = fl.quantize_model(nn.Dense(2))
    >>> v = qm.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> qm.apply(v, jnp.ones((1, 3))).shape
    (1, 2)
  """
  if not isinstance(model, nn.Module):
    raise TypeError(f"quantize_model: model must be a flax.linen Module, got "
                    f"{type(model).__name__}")
  _check_choice("on_unmatched", on_unmatched)
  _check_choice("on_unquantized", on_unquantized)
  return QuantizedModel(model=model, recipe=recipe or Fp8Recipe(),
                        rules=normalize_rules(rules), on_unmatched=on_unmatched,
                        on_unquantized=on_unquantized)
