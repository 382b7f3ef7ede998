"""The public entry points: the :func:`quantization` context, the :func:`quantize_model` wrapper.

:func:`quantization` opens a session
(:class:`~fp8_linen.model_quantization.rules.Session`) and installs the
interception (:mod:`~fp8_linen.model_quantization.handlers`) for the
duration of a block, then reports rules that matched nothing.
:func:`quantize_model` returns a :class:`QuantizedModel`, whose ``init`` and
``apply`` run the unmodified model inside that context (``init`` also checks
for products the interception never sees). What they quantize and where the
state goes: :mod:`fp8_linen.model_quantization`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Sequence

import flax.linen as nn

from fp8_linen import interception, product_calls
from fp8_linen.model_quantization.handlers import HANDLERS, QUANTIZING, SESSION, interceptor
from fp8_linen.model_quantization.rules import Session
from fp8_linen.product_report import ProductReport, product_report
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.rules import QuantizationRule, normalize_rules, report_unmatched

__all__ = ["quantization", "QuantizedModel", "quantize_model"]

_CHOICES = ("warn", "raise", "ignore")


def _check_choice(name: str, value: str) -> None:
  if value not in _CHOICES:
    raise ValueError(f"{name}={value!r}: allowed values are 'warn', 'raise', 'ignore'")


@contextlib.contextmanager
def quantization(recipe=None, rules: Sequence[QuantizationRule] | None = None, *,
                 on_unmatched: str = "warn"):
  """Context in which Linen modules' products run quantized (:mod:`fp8_linen.model_quantization`).

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
  sess = Session(rules, recipe or Fp8Recipe())
  token = SESSION.set(sess)
  try:
    with (QUANTIZING.set((sess.recipe, rules)), interception.intercept(HANDLERS),
          nn.intercept_methods(interceptor)):
      yield
  finally:
    SESSION.reset(token)
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
    product_calls.report_unseen(report, self.on_unquantized, who="fp8_linen.quantize_model",
                                what="the model's forward",
                                fix="jnp.matmul / jnp.einsum / a Linen layer", stacklevel=3)

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
