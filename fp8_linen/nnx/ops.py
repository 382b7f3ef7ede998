"""Quantized products inside any NNX module, found by running it once.

:func:`fp8_linen.nnx.quantize_model` with an ``example`` quantizes the
``jax.lax.dot_general``, ``jnp.einsum``, ``jnp.matmul``, ``jnp.dot``,
``jax.lax.conv_general_dilated`` and ``jax.lax.ragged_dot`` calls that a
model's own modules make (MaxText's NNX ``DenseGeneral``, EasyDeL's
``ParallelLinear``, a hand-written attention), not only flax's layers:

1. **Finding the products** (:func:`attach`): every module of the model runs
   as an instance of a subclass of its class whose public methods (and
   ``__call__``) push the module on a stack while they run and intercept the
   product functions (:mod:`fp8_linen.interception`, read by
   :mod:`fp8_linen.product_calls`). The example runs once, abstractly
   (``jax.eval_shape``: nothing is computed). Each product is named after
   the module whose method runs it and its place in that method call:
   ``<op>_<i>`` in ``__call__`` (``dot_general_0``, ``einsum_1``) and
   ``<method>_<op>_<i>`` in another method (``attend_dot_0``), and decided
   by the rules at the module's path, as the Linen ``quantize_model`` does.
2. **The state**: a quantized product's state lives in a
   :class:`ProductSite` attribute of that name on its module (so
   ``nnx.state(model, fl.nnx.QuantState)`` holds it at
   ``<module path>/<name>/input_scale``, checkpoints save it, and
   :class:`~fp8_linen.nnx.Optimizer` writes it back); it is declared then,
   before any training step, as the ``fl.nnx`` layers declare theirs.
3. **Running**: the modules keep the subclass. Whenever one of their
   methods runs (eagerly, under ``nnx.jit``, ``nnx.grad``,
   ``nnx.remat`` ...), the products it calls run quantized on their sites.
   A product the example did not reach has no site: it runs in float, with
   a warning naming it.

Stacked layers: a product of a module run inside ``nnx.scan`` / ``nnx.vmap``
over layers whose parameters are stacked on a leading axis (the module's
copy in the body holds one layer's slice) gets its state stacked the same
way, one state per layer, so the transform slices it as it slices the
parameters (give the transform the module's whole state on that axis, e.g.
``in_axes=(nnx.Carry, 0)``, as ``fl.nnx`` layers built under ``nnx.vmap``
need too).

Serving: :func:`fl.nnx.convert <fp8_linen.nnx.convert>` turns each site into
a served one (its training state gone, the frozen input parameters and
weight scales it reads as ``nnx.Param`` s): it computes the frozen QAT
forward bit for bit. A module weight that is the site's right operand
(equal to it after the module's casts and reshapes) and that no other
operation reads is stored as the site's codes; the module reads it as the
float dtype it saw in training. Other weights stay float, quantized at each
call.

Recipes that learn quantizer parameters (LSQ, LSQ+) start their steps from
values the abstract run does not have: after it, one concrete run of the
example declares them, each weight step from the weight its product
multiplies and each activation step from the example's activations (as
:func:`fl.nnx.calibrate <fp8_linen.nnx.calibrate>` sets them). The example
must then hold arrays, and such products cannot sit in layers stacked under
``nnx.scan`` (an error says so).

Limits: products of modules inside a transform whose
copies hold other parameters run in float with a warning
(``switch_precision`` drops the sites with :func:`detach` and, for a new
recipe, attaches new ones from an example run). :func:`fl.nnx.ptq
<fp8_linen.nnx.ptq>` calibrates the sites as it calibrates the flax layers
(grouped GEMMs excepted, as in Linen). A model
with op-level sites cannot be pickled (its classes are made at run time;
checkpoints save its state, which is what they should).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> class Proj(nnx.Module):
  ...   def __init__(self):
  ...     self.w = nnx.Param(jnp.ones((4, 3)))
  ...   def __call__(self, x):
  ...     return jax.lax.dot_general(x, self.w[...], (((1,), (0,)), ((), ())))
  >>> model = fl.nnx.quantize_model(Proj(), example=(jnp.ones((2, 4)),))
  >>> sorted(nnx.to_flat_state(nnx.state(model, fl.nnx.QuantState)))[0][0]
  ('dot_general_0', 'input_amax_history')
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import types

import jax
import jax.numpy as jnp
from flax import nnx

from fp8_linen import interception, product_calls
from fp8_linen.families import dispatch, modes
from fp8_linen.nnx.access import NnxAccess, calibrate, calibrating, declare
from fp8_linen.nnx.state import QuantState
from fp8_linen.product_report import MARKERS, product_report
from fp8_linen.recipes.rules import first_match, operand_kinds

__all__ = ["ProductSite", "attach", "detach", "has_sites", "model_report"]

# The static attributes a module with products carries: its path, and its
# products that run unquantized, ``(name, status, reason)``.
PATH_ATTR = "fl_path"
UNQUANTIZED_ATTR = "fl_unquantized_products"

_STACK: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_nnx_stack", default=())
_DISCOVERY: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_nnx_discovery",
                                                            default=None)
# The run that declares the sites' learned quantizers (attach).
_DECLARING: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_nnx_declaring",
                                                            default=False)


def _warn_once(key, message: str) -> None:
  product_calls.warn_once(key, message, stacklevel=5)


class ProductSite(nnx.Module):
  """The quantization state of one product call in a module's method.

  Attributes:
    recipe: the product's recipe.
    op: its op kind (``'dot_general'``, ``'einsum'``, ``'matmul'``, ``'dot'``,
      ``'conv'``, ``'ragged_dot'``).
    site_path: its path (``<module path>/<name>``), named in errors.
    groups: a grouped GEMM's number of groups (experts): fp8 keeps one
      kernel state per expert.
    learned: the recipe learns quantizer parameters (LSQ): nothing is
      declared here; the first concrete run of the example declares them
      (:func:`attach`).

  Example:
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> from fp8_linen.nnx.ops import ProductSite
    >>> site = ProductSite(fl.Fp8Recipe(), op='einsum', path='attn/einsum_0')
    >>> sorted(nnx.to_flat_state(nnx.state(site, fl.nnx.QuantState)))[0][0]
    ('input_amax_history',)
  """

  def __init__(self, recipe, *, op: str, path: str, groups: int | None = None,
               learned: bool = False):
    self.recipe = recipe
    self.op = op
    self.site_path = path
    if learned:
      # LSQ steps start from the weight's values and the activations: the example's
      # concrete run declares them (attach).
      return
    try:
      if op == "ragged_dot":
        dispatch.declare_ragged(NnxAccess(self, declaring=True), recipe, groups)
      else:
        declare(self, recipe)
    except (TypeError, ValueError) as e:
      raise type(e)(f"fl.nnx.quantize_model: product {path!r} ({op}): {e}") from e


def _learns(recipe, op: str) -> bool:
  """Whether a site of ``recipe`` learns quantizer parameters from data (LSQ, LSQ+).

  Grouped GEMMs keep their own declaration (their learned experts run fake-quantized).
  """
  return op != "ragged_dot" and any(
      getattr(getattr(recipe, role, None), "learned", False) for role in ("input", "kernel"))


def _declare_learned(model, example, args, sites: dict) -> None:
  """Declares the learned quantizers of ``sites`` (path -> site) by one concrete run.

  Each LSQ weight step starts from the weight the product multiplies, each
  activation step from the example's activations (as ``fl.nnx.calibrate``
  sets them; the swapped flax layers' activation steps are set alike).
  """
  names = sorted(sites)
  if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(args)):
    raise ValueError(
        f"fl.nnx.quantize_model: products {names} learn their quantizers (LSQ): their steps "
        "start from the weights and the example's activations, so the example must hold "
        "arrays, not shapes")
  token = _DECLARING.set(True)
  try:
    if callable(example):
      with calibrating():
        example(model)
    else:
      calibrate(model, *args)  # jitted as fl.nnx.calibrate is: the same steps, bit for bit
  finally:
    _DECLARING.reset(token)
  missing = [p for p in names if not len(nnx.to_flat_state(nnx.state(sites[p], nnx.Param)))]
  if missing:
    raise ValueError(
        f"fl.nnx.quantize_model: products {missing} learn their quantizers (LSQ), whose steps "
        "are created by a run of the example; they run inside an NNX transform whose copies "
        "do not keep new variables. Use an STE recipe for them (a QuantizationRule with "
        "another recipe), or build those layers from fl.nnx layers")


class _Frame:
  """One running method of a module: how many products of each op it has called."""

  __slots__ = ("module", "method", "counts")

  def __init__(self, module, method: str):
    self.module, self.method, self.counts = module, method, {}

  def next_name(self, op: str) -> str:
    i = self.counts.get(op, 0)
    self.counts[op] = i + 1
    return f"{op}_{i}" if self.method == "__call__" else f"{self.method}_{op}_{i}"


def _module_path(module) -> str:
  return getattr(module, PATH_ATTR, None) or type(module).__name__


class _Discovery:
  """One abstract run of the example: every product call and what the rules say of it."""

  def __init__(self, rules, recipe, modules: dict):
    self.rules, self.recipe, self.modules = rules, recipe, modules  # path -> module
    self.hits = [0] * len(rules)
    self.sites: dict = {}  # (module path, name) -> (op, recipe or None, status)
    self.stacked: dict = {}  # (module path, name) -> layers stacked on axis 0 (0: none)
    self.groups: dict = {}  # (module path, name) -> a grouped GEMM's groups
    self.vocab_table = None  # (rows, sorted shape) of the largest table looked up in

  def decide(self, frame: _Frame, name: str, op: str, lhs, rhs, problem):
    path = getattr(frame.module, PATH_ATTR, "")
    own = [v[...].shape for v in vars(frame.module).values() if isinstance(v, nnx.Param)]
    kinds = operand_kinds(own, (jnp.shape(lhs), jnp.shape(rhs)),
                          self.vocab_table and self.vocab_table[1],
                          isinstance(frame.module, nnx.Embed), op=op)
    i = first_match(self.rules, op, path, kinds)
    recipe = None
    if i is not None:
      self.hits[i] += 1
      rule = self.rules[i]
      recipe = (rule.recipe or self.recipe) if rule.quantize else None
    if recipe is None:
      status = ("excluded", None)
    elif problem is not None:
      status = ("skipped", problem)
    elif (stacked := _stacked(frame.module, self.modules.get(path))) is None:
      status = ("skipped", "it runs inside an NNX transform over modules whose parameters are "
                "not the model's, nor the model's stacked on a leading axis; build those "
                "layers from fl.nnx layers (they declare their state inside the transform)")
    else:
      why = product_calls.ragged_problem(recipe) if op == "ragged_dot" else None
      status = ("skipped", why) if why else ("quantized", None)
      self.stacked[(path, name)] = stacked
    self.sites[(path, name)] = (op, recipe, status)
    self.groups[(path, name)] = jnp.shape(rhs)[0] if op == "ragged_dot" else None
    return None, status

  def note_tables(self, module, args, kwargs) -> None:
    """Records the vocabulary table: a 2-D parameter of a module that took integer ids."""
    if not (isinstance(module, nnx.Embed) or any(
        jnp.issubdtype(jnp.result_type(a), jnp.integer)
        for a in jax.tree.leaves((args, kwargs)) if hasattr(a, "dtype"))):
      return
    for v in vars(module).values():
      shape = v[...].shape if isinstance(v, nnx.Param) else ()
      if len(shape) == 2 and (self.vocab_table is None or shape[0] > self.vocab_table[0]):
        self.vocab_table = (shape[0], tuple(sorted(shape)))


def _stacked(module, original) -> int | None:
  """How ``module`` relates to the model's module ``original`` at its path.

  ``0``: it is ``original`` (or a copy a transform made: ``nnx.jit``,
  ``nnx.remat``); ``n``: a slice of ``original``'s parameters stacked on an
  axis of ``n`` (the body of ``nnx.scan`` / ``nnx.vmap`` over layers; MaxText
  stacks its layers' parameters on axis 1, ``param_scan_axis``, and scans the
  rest of their state on axis 0, as :func:`_stack_state` stacks it);
  ``None``: neither.
  """
  if original is None:
    return None
  if module is original:
    return 0
  shapes = lambda m: [(k, v.shape) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))]
  mine, theirs = shapes(module), shapes(original)
  if mine == theirs:
    return 0
  if not mine or [k for k, _ in mine] != [k for k, _ in theirs]:
    return None
  # The sizes n for which each parameter is its original with an axis of n removed.
  common = None
  for (_, s), (_, t) in zip(mine, theirs):
    sizes = {t[a] for a in range(len(t)) if t[:a] + t[a + 1:] == s}
    common = sizes if common is None else common & sizes
  return common.pop() if common is not None and len(common) == 1 else None


def _stack_state(site, n: int) -> None:
  """Stacks every :class:`~fp8_linen.nnx.QuantState` of ``site`` ``n`` times on axis 0."""
  for _, var in nnx.to_flat_state(nnx.state(site, QuantState)):
    var.set_value(jnp.broadcast_to(var[...], (n, *var[...].shape)))


class _NnxBackend(product_calls.Backend):
  """State in a :class:`ProductSite` attribute of the running module."""

  def decide(self, op, lhs, rhs, problem):
    stack = _STACK.get()
    if not stack:
      return None, ("skipped", None)
    common = product_calls.common_problem(lhs, rhs)
    if common is not None:
      return None, common
    frame = stack[-1]
    name = frame.next_name(op)
    discovery = _DISCOVERY.get()
    if discovery is not None:
      return discovery.decide(frame, name, op, lhs, rhs, problem)
    site = getattr(frame.module, name, None)
    if isinstance(site, ProductSite) and site.op == op:
      return (site, site.recipe), None
    for kept, status, reason in getattr(frame.module, UNQUANTIZED_ATTR, ()):
      if kept == name:
        return None, (status, reason or None)
    return None, ("skipped", f"fl.nnx.quantize_model's example never reached this call "
                  f"({name!r}), so it has no quantization state; quantize the float model "
                  "again with an example that does")

  def unquantized(self, op, status, call):
    kind, reason = status
    stack = _STACK.get()
    path = _module_path(stack[-1].module) if stack else ""
    # kind 'quantized' here is the example run: float now, quantized from then on.
    if kind == "skipped" and reason:
      _warn_once((op, path, reason), f"fp8_linen.nnx.quantize_model: {op} in module "
                 f"{path or '<root>'!r} runs unquantized: {reason}")
    with contextlib.ExitStack() as scopes:
      if path:
        scopes.enter_context(jax.named_scope(path))
      scopes.enter_context(jax.named_scope(MARKERS[kind]))
      return call()

  def run(self, target, op, product):
    site, recipe = target
    with contextlib.ExitStack() as stack:
      stack.enter_context(jax.named_scope(site.site_path))
      stack.enter_context(jax.named_scope(MARKERS["quantized"]))
      # A served site (fl.nnx.convert) runs its product from the arrays it holds.
      if getattr(site, "serving", None) is not None:
        stack.enter_context(modes.mode("serve"))
      return product(NnxAccess(site, declaring=_DECLARING.get(),
                               weights_of=_STACK.get()[-1].module), recipe)


HANDLERS = product_calls.handlers(_NnxBackend())


@contextlib.contextmanager
def _entered(module, method: str):
  stack = _STACK.get()
  token = _STACK.set(stack + (_Frame(module, method),))
  try:
    if stack:
      yield  # the outermost method of this context intercepts already
    else:
      with interception.intercept(HANDLERS):
        yield
  finally:
    _STACK.reset(token)


def _wrap(fn, name: str):
  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    discovery = _DISCOVERY.get()
    if discovery is not None:
      # Before the method runs: a module that looks ids up may also be the head.
      discovery.note_tables(self, args, kwargs)
    with _entered(self, name):
      return fn(self, *args, **kwargs)

  return method


def _excluded_layer_call(fn):
  """A float flax layer a rule kept: its product (bound when flax was imported) is marked."""
  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    with jax.named_scope(MARKERS["excluded"]):
      return fn(self, *args, **kwargs)

  return method


_BASES = frozenset(nnx.Module.__mro__)
_CLASSES: dict = {}
_CLASSES_LOCK = threading.Lock()


def _method_names(cls) -> list:
  names = set()
  for klass in cls.__mro__:
    if klass in _BASES:
      continue
    for name, attr in vars(klass).items():
      if inspect.isfunction(attr) and (name == "__call__" or not name.startswith("_")):
        names.add(name)
  return sorted(names)


def _run_class(cls, excluded_layer: bool = False):
  """The subclass of ``cls`` whose methods run under the interception (cached)."""
  base = getattr(cls, "_fl_original", cls)
  key = (base, excluded_layer)
  with _CLASSES_LOCK:
    sub = _CLASSES.get(key)
    if sub is None:
      def body(ns):
        ns["_fl_original"] = base
        ns["__module__"] = base.__module__
        ns["__qualname__"] = base.__qualname__
        if excluded_layer:
          ns["__call__"] = _excluded_layer_call(base.__call__)
        else:
          for name in _method_names(base):
            ns[name] = _wrap(getattr(base, name), name)
      sub = _CLASSES[key] = types.new_class(base.__name__, (base,), exec_body=body)
  return sub


def has_sites(model) -> bool:
  """Whether ``model`` has products quantized by :func:`attach` (op-level sites)."""
  return any(isinstance(m, ProductSite) for _, m in nnx.iter_graph(model))


def detach(model):
  """A copy of ``model`` without its op-level sites, holding the same variables.

  Every module of the copy is of its own class again (the running subclass
  :func:`attach` gave it is gone), and the :class:`ProductSite` attributes
  with their state, the path and the unquantized-call marks are dropped; the
  parameters are ``model``'s very ``nnx.Variable`` s. ``model`` is left as it is.
  """
  out = nnx.recursive_map(lambda path, node: node, model)
  nodes = [node for _, node in nnx.iter_graph(out) if isinstance(node, nnx.Module)]
  for node in nodes:
    original = getattr(type(node), "_fl_original", None)
    if original is None:
      continue
    for name in [k for k, v in vars(node).items() if isinstance(v, ProductSite)]:
      delattr(node, name)
    for attr in (PATH_ATTR, UNQUANTIZED_ATTR):
      if attr in vars(node):
        delattr(node, attr)
    node.__class__ = original
  return out


def attach(model, rules, recipe, example, *, library, float_layers, on_unquantized: str):
  """Finds the products of ``model``'s own modules and gives the quantized ones state.

  ``model`` is modified in place (the caller passes a fresh graph).

  Args:
    model: the NNX model (its flax layers already swapped where the rules say).
    rules: the normalized rules.
    recipe: the default recipe.
    example: the arguments of ``model(*example)``, or a function of the model
      that runs it.
    library: the library's layer classes (their products are quantized by
      the layer itself, never intercepted).
    float_layers: exact flax layer classes whose product flax binds at import;
      those left in float are marked excluded for the report.
    on_unquantized: ``'warn'``, ``'raise'`` or ``'ignore'`` for products the
      interception never sees.

  Returns:
    The rule hits (one count per rule).
  """
  modules, ids = {}, set()
  for path, node in nnx.iter_graph(model):
    if not isinstance(node, nnx.Module) or isinstance(node, library) or id(node) in ids:
      continue
    ids.add(id(node))
    modules["/".join(str(p) for p in path)] = node
  originals = {}
  for name, node in modules.items():
    originals[name] = type(node)
    setattr(node, PATH_ATTR, name)
    node.__class__ = _run_class(type(node), excluded_layer=type(node) in float_layers)
  discovery = _Discovery(rules, recipe, modules)
  graphdef, state = nnx.split(model)
  args = () if callable(example) else tuple(example)

  def traced(state, args):
    token = _DISCOVERY.set(discovery)
    try:
      m = nnx.merge(graphdef, state)
      out = example(m) if callable(example) else m(*args)
    finally:
      _DISCOVERY.reset(token)
    return [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]

  try:
    report = product_report(traced, state, args)
  except Exception:
    for name, node in modules.items():
      node.__class__ = originals[name]
      delattr(node, PATH_ATTR)
    raise
  kept: dict = {}
  to_learn: dict = {}
  for (path, name), (op, rule_recipe, status) in discovery.sites.items():
    if status[0] != "quantized":
      kept.setdefault(path, []).append((name, status[0], status[1] or ""))
    else:
      module = modules[path]
      if name in vars(module):
        raise ValueError(f"fl.nnx.quantize_model: module {path or '<root>'!r} already has an "
                         f"attribute {name!r}, where the state of its product {name!r} would go")
      site_path = f"{path}/{name}" if path else name
      learned = _learns(rule_recipe, op)
      if learned and discovery.stacked[(path, name)]:
        raise ValueError(
            f"fl.nnx.quantize_model: product {site_path!r} ({op}): {type(rule_recipe).__name__} "
            "learns quantizer parameters (LSQ), one set per layer, which a product of layers "
            "stacked under nnx.scan / nnx.vmap cannot declare; use an STE recipe for it (a "
            "QuantizationRule with another recipe)")
      site = ProductSite(rule_recipe, op=op, path=site_path,
                         groups=discovery.groups[(path, name)], learned=learned)
      if learned:
        to_learn[site_path] = site
      if discovery.stacked[(path, name)]:
        _stack_state(site, discovery.stacked[(path, name)])
      setattr(module, name, site)
  # Every module keeps its running class: a product the example did not reach
  # is then said, not silently run in float.
  for name, node in modules.items():
    if name in kept:
      setattr(node, UNQUANTIZED_ATTR, tuple(sorted(kept[name])))
  if to_learn:
    _declare_learned(model, example, args, to_learn)
  product_calls.report_unseen(report, on_unquantized, who="fp8_linen.nnx.quantize_model",
                              what="the example run",
                              fix="jnp.matmul / jnp.einsum / jax.lax.dot_general", stacklevel=3)
  return discovery.hits


def model_report(model, *args, **kwargs):
  """:func:`fp8_linen.product_report` of ``model(*args, **kwargs)`` (nothing runs).

  The model is split into its graph and state and merged again inside the
  trace, as NNX transforms do, so a model whose methods use NNX transforms
  (``nnx.remat``, ``nnx.scan``) can be traced. Arrays may be given as
  ``jax.ShapeDtypeStruct``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> model = fl.nnx.quantize_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    >>> fl.nnx.product_report(model, jnp.ones((1, 3))).counts
    {'quantized': 1}
  """
  graphdef, state = nnx.split(model)

  def traced(state, args, kwargs):
    out = nnx.merge(graphdef, state)(*args, **kwargs)
    return [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]

  return product_report(traced, state, args, kwargs)
