"""Run an unmodified Linen model with its matrix products in fp8.

:func:`quantize_model` wraps a model you did not write. Its ``init``/``apply``
run the model with:

* ``flax.linen.intercept_methods``, which tells us which module is running
  (its path is matched against the :class:`QuantizationRule` list), and
* ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated`` and
  ``jax.numpy.einsum`` intercepted (:mod:`fp8_linen.interception`) for the
  duration of the call: they run the quantized product of
  :mod:`fp8_linen.linen.dispatch` on that module's state.

That covers ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``, flax's
attention (its two ``jnp.einsum`` calls) and raw ``jax.lax.dot_general`` /
``jnp.einsum`` / ``jax.lax.conv_general_dilated`` calls inside any module method.

Where the state goes: for ``nn.Dense``/``nn.DenseGeneral``/``nn.Einsum``/``nn.Conv``
at the layer's own path (the same place as ``QDense``/``QDenseGeneral``/
``QEinsum``/``QConv``); for raw calls in other modules in a child scope per call
site, ``<module path>/<op>_<i>`` (``einsum_0``, ``dot_general_1``, ``conv_0``),
numbered in call order within one method call. The ``params`` tree is
untouched, so checkpoints of the unmodified model load as they are.

Limits (by construction):

* products written as ``x @ w``, ``jnp.matmul``, ``jnp.dot`` or through names
  bound at import time (``from jax.lax import dot_general``) are not seen;
* einsums with three or more operands, diagonals or broadcasting ellipses run
  unquantized (a warning says so);
* ops called outside any module method (plain functions at the top level of
  ``apply``) run unquantized: there is no module to hold their state;
* the interception is context-local: another thread tracing at the same time
  sees the original functions (and its own quantization, if it has one);
* under ``jax.jit`` the choice is made when tracing; jit the wrapper's
  ``apply`` (or a function calling it), as usual.

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
import warnings
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8_linen import interception
from fp8_linen.core.dims import einsum_plan
from fp8_linen.linen.conv import conv_kwargs_from
from fp8_linen.linen.dispatch import (quantized_conv_on, quantized_dot_general_on,
                                      quantized_einsum_on)
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.rules import OPS, QuantizationRule, normalize_rules

__all__ = ["OPS", "QuantizationRule", "QuantizedModel", "quantize_model", "quantization"]


# Layers whose one product keeps its state at the layer's own path.
_OWN_STATE_LAYERS = (nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv)


class _Frame:
  """One running module method: the module and its per-op call counters."""

  __slots__ = ("module", "counts", "own_used")

  def __init__(self, module):
    self.module = module
    self.counts = {}
    self.own_used = False


class _Session:
  def __init__(self, rules, recipe):
    self.rules = rules
    self.recipe = recipe
    self.hits = [0] * len(rules)
    self.stack: list[_Frame] = []

  def recipe_for(self, module, op: str):
    path = "/".join(module.path)
    for i, rule in enumerate(self.rules):
      if op in rule.ops and re.fullmatch(rule.module_path, path):
        self.hits[i] += 1
        return (rule.recipe or self.recipe) if rule.quantize else None
    return None


_SESSION: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_qm_session", default=None)


def _target(op: str):
  """(session, frame, recipe) when this op call should be quantized, else None."""
  sess = _SESSION.get()
  if sess is None or not sess.stack:
    return None
  frame = sess.stack[-1]
  if op == "conv" and isinstance(frame.module, nn.ConvLocal):
    return None
  recipe = sess.recipe_for(frame.module, op)
  return None if recipe is None else (sess, frame, recipe)


def _run(frame, op: str, fn):
  """Runs ``fn(module)`` on the module's own state or on a per-call-site child."""
  module = frame.module
  if isinstance(module, _OWN_STATE_LAYERS) and not frame.own_used:
    frame.own_used = True
    return fn(module)
  i = frame.counts.get(op, 0)
  frame.counts[op] = i + 1
  child = module.scope.push(f"{op}_{i}", reuse=True)
  return _Holder(parent=child)(fn)


class _Holder(nn.Module):
  """A stateless module bound to a child scope; the op declares state on it."""

  @nn.compact
  def __call__(self, fn):
    return fn(self)


def _dot_general(orig, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
  t = _target("dot_general")
  if t is None or kwargs.get("out_sharding") is not None:
    return orig(lhs, rhs, dimension_numbers, precision=precision,
                preferred_element_type=preferred_element_type, **kwargs)
  _, frame, recipe = t
  return _run(frame, "dot_general", lambda m: quantized_dot_general_on(
      m, lhs, rhs, dimension_numbers, recipe, out_dtype=preferred_element_type))


def _einsum(orig, subscripts, *operands, **kwargs):
  dg = kwargs.get("_dot_general")
  # flax's attention passes jax.lax.dot_general explicitly: still a plain einsum.
  plain = dg is None or interception.is_target(dg, "jax.lax.dot_general")
  t = _target("einsum") if plain else None
  if t is not None and (not isinstance(subscripts, str) or len(operands) != 2
                        or kwargs.get("out") is not None
                        or kwargs.get("out_sharding") is not None):
    warnings.warn(f"fp8_linen.quantize_model: einsum {subscripts!r} with {len(operands)} "
                  "operands is not quantized (only two-operand einsums are)", stacklevel=2)
    t = None
  if t is not None:
    lhs, rhs = jnp.asarray(operands[0]), jnp.asarray(operands[1])
    try:
      einsum_plan(subscripts, lhs.shape, rhs.shape)
    except NotImplementedError as e:
      warnings.warn(f"fp8_linen.quantize_model: {e}; running it unquantized", stacklevel=2)
      t = None
  if t is None:
    return orig(subscripts, *operands, **kwargs)
  _, frame, recipe = t
  out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
  return _run(frame, "einsum", lambda m: quantized_einsum_on(
      m, subscripts, lhs, rhs, recipe, out_dtype=out_dtype))


def _conv_general_dilated(orig, lhs, rhs, *args, **kwargs):
  t = _target("conv")
  if t is not None:
    try:
      conv_kwargs = conv_kwargs_from(*args, **kwargs)
    except (TypeError, NotImplementedError):
      t = None
  if t is None:
    return orig(lhs, rhs, *args, **kwargs)
  _, frame, recipe = t
  out_dtype = kwargs.get("preferred_element_type") or jnp.result_type(lhs, rhs)
  return _run(frame, "conv", lambda m: quantized_conv_on(
      m, lhs, rhs, conv_kwargs, recipe, out_dtype=out_dtype))


_HANDLERS = {"jax.lax.dot_general": _dot_general, "jax.numpy.einsum": _einsum,
             "jax.lax.conv_general_dilated": _conv_general_dilated}


def _interceptor(next_fun, args, kwargs, context):
  sess = _SESSION.get()
  if sess is None or context.method_name == "setup":
    return next_fun(*args, **kwargs)
  sess.stack.append(_Frame(context.module))
  try:
    return next_fun(*args, **kwargs)
  finally:
    sess.stack.pop()


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
  if on_unmatched not in ("warn", "raise", "ignore"):
    raise ValueError(f"on_unmatched={on_unmatched!r}: allowed values are 'warn', 'raise', "
                     "'ignore'")
  rules = normalize_rules(rules)
  sess = _Session(rules, recipe or Fp8Recipe())
  token = _SESSION.set(sess)
  try:
    with interception.intercept(_HANDLERS), nn.intercept_methods(_interceptor):
      yield
  finally:
    _SESSION.reset(token)
  unmatched = [r for r, h in zip(rules, sess.hits) if h == 0]
  if unmatched and on_unmatched != "ignore":
    msg = ("fp8_linen.quantize_model: these rules matched no module op (check the module "
           "paths, e.g. with model.tabulate): " + ", ".join(
               f"module_path={r.module_path!r} ops={r.ops}" for r in unmatched))
    if on_unmatched == "raise":
      raise ValueError(msg)
    warnings.warn(msg, stacklevel=3)


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
  """

  model: nn.Module
  recipe: Any = None
  rules: tuple = (QuantizationRule(),)
  on_unmatched: str = "warn"

  def _ctx(self):
    return quantization(self.recipe, self.rules, on_unmatched=self.on_unmatched)

  def init(self, *args, **kwargs):
    """``model.init`` with quantization (creates the fp8 state)."""
    with self._ctx():
      return self.model.init(*args, **kwargs)

  def init_with_output(self, *args, **kwargs):
    """``model.init_with_output`` with quantization."""
    with self._ctx():
      return self.model.init_with_output(*args, **kwargs)

  def apply(self, *args, **kwargs):
    """``model.apply`` with quantization."""
    with self._ctx():
      return self.model.apply(*args, **kwargs)


def quantize_model(model: nn.Module, recipe=None,
                   rules: Sequence[QuantizationRule] | None = None, *,
                   on_unmatched: str = "warn") -> QuantizedModel:
  """Wraps an unmodified Linen model so its products run quantized.

  Args:
    model: any ``flax.linen`` module.
    recipe: the default recipe (:class:`~fp8_linen.Fp8Recipe` if ``None``).
    rules: ordered :class:`QuantizationRule` list; the first match decides
      (default: quantize every module).
    on_unmatched: ``'warn'``, ``'raise'`` or ``'ignore'`` for rules that match
      nothing.

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
  if on_unmatched not in ("warn", "raise", "ignore"):
    raise ValueError(f"on_unmatched={on_unmatched!r}: allowed values are 'warn', 'raise', "
                     "'ignore'")
  return QuantizedModel(model=model, recipe=recipe or Fp8Recipe(),
                        rules=normalize_rules(rules), on_unmatched=on_unmatched)
