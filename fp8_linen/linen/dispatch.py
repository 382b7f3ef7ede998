"""THE table: which product a recipe type runs in a Linen module.

Every layer (``QDense``, ``QDenseGeneral``, ``QEinsum``, ``QConv``,
``Fp8DotGeneral``) and :func:`fp8_linen.quantize_model` run their products
through :func:`quantized_dot_general_on`, :func:`quantized_einsum_on` and
:func:`quantized_conv_on`, which look the recipe's type up here. A new recipe
family plugs in with :func:`register_recipe` and then works in all of them.

============== ======================================= ========================
recipe type    dot_general / einsum                    convolution
============== ======================================= ========================
``Fp8Recipe``  :func:`fp8_dot_general_on`              :func:`fp8_conv_on`
``IntRecipe``  :func:`~fp8_linen.linen.integer.        :func:`~fp8_linen.linen.
               int_dot_general_on`                     integer.int_conv_on`
============== ======================================= ========================

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.linen import dispatch
  >>> dispatch.products_for(fl.int8_lsq()).dot_general.__name__
  'int_dot_general_on'
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from fp8_linen.core import settings
from fp8_linen.core.conv import fp8_conv_general_dilated
from fp8_linen.core.dims import einsum_plan
from fp8_linen.core.dot_general import fp8_dot_general
from fp8_linen.linen.integer import int_conv_on, int_dot_general_on
from fp8_linen.linen.state import ROLES, with_role_states
from fp8_linen.recipes.fp8 import ActivationRecipe, Fp8Recipe, ScalingConfig
from fp8_linen.recipes.integer import IntRecipe
from fp8_linen.recipes.yaml import recipe_names

__all__ = ["Products", "register_recipe", "MODES", "mode", "current_mode", "register_mode", "products_for", "check_recipe", "recipe_error",
           "fp8_dot_general_on", "fp8_conv_on",
           "quantized_dot_general_on", "quantized_einsum_on", "quantized_conv_on"]


def fp8_dot_general_on(module: nn.Module, lhs, rhs, dimension_numbers, recipe: Fp8Recipe,
                       out_dtype=None, key: str = "dot"):
  """:func:`~fp8_linen.fp8_dot_general` with ``module``'s OWG state."""
  return with_role_states(module, key, {r: recipe.role(r) for r in ROLES},
                          lambda st, chain: fp8_dot_general(
                              lhs, rhs, dimension_numbers, input_state=st[0], kernel_state=st[1],
                              output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype,
                              chain=chain))


def fp8_conv_on(module: nn.Module, lhs, rhs, conv_kwargs: dict, recipe: Fp8Recipe,
                out_dtype=None, key: str = "conv"):
  """:func:`~fp8_linen.fp8_conv_general_dilated` with ``module``'s OWG state."""
  return with_role_states(module, key, {r: recipe.role(r) for r in ROLES},
                          lambda st, chain: fp8_conv_general_dilated(
                              lhs, rhs, **conv_kwargs, input_state=st[0], kernel_state=st[1],
                              output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype,
                              chain=chain))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Products:
  """The products one recipe family runs in a module.

  Attributes:
    dot_general: ``fn(module, lhs, rhs, dimension_numbers, recipe, out_dtype,
      key) -> out``; declares the state it needs on ``module``.
    conv: ``fn(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key) -> out``
      (``conv_kwargs`` as for ``lax.conv_general_dilated``), or ``None`` when
      the family has no convolution.
  """

  dot_general: Callable
  conv: Callable | None = None


_TABLE: dict[type, Products] = {
    Fp8Recipe: Products(dot_general=fp8_dot_general_on, conv=fp8_conv_on),
    IntRecipe: Products(dot_general=int_dot_general_on, conv=int_conv_on),
}


# Other modes than training: the same model definition runs other products
# (``'convert'`` writes a layer's served arrays, ``'serve'`` reads them; see
# :mod:`fp8_linen.linen.serving`, which fills these tables).
MODES = ("convert", "serve")
_MODE_TABLES: dict[str, dict[type, Products]] = {m: {} for m in MODES}
_MODE = settings.TraceSetting("mode", default=None)


@contextlib.contextmanager
def mode(name: str | None):
  """Runs every product of the block in mode ``name`` (``None``: training)."""
  if name is not None and name not in MODES:
    raise ValueError(f"dispatch.mode: name={name!r} must be None or one of {MODES}")
  with _MODE.set(name):
    yield


def current_mode() -> str | None:
  """The mode products run in (``None``: training)."""
  return _MODE.get()


def register_mode(name: str, recipe_type: type, products: Products) -> None:
  """The products ``recipe_type`` runs in mode ``name`` (see :func:`mode`)."""
  if name not in MODES or not isinstance(products, Products):
    raise TypeError(f"register_mode(name, recipe_type, products): name in {MODES}, a Products")
  _MODE_TABLES[name][recipe_type] = products


def register_recipe(recipe_type: type, products: Products) -> None:
  """Adds a recipe family to the table (see the module doc)."""
  if not isinstance(recipe_type, type) or not isinstance(products, Products):
    raise TypeError("register_recipe(recipe_type, products) takes a class and a Products")
  _TABLE[recipe_type] = products


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def recipe_error(owner: str, recipe, accepted: str, example: str,
                 for_activation: bool = False) -> TypeError:
  """The one error every layer raises for a value that is not a recipe it takes.

  It names the ``recipe`` argument, says what was given and what is accepted,
  and for the usual mistakes what to write instead.
  """
  if isinstance(recipe, str) and for_activation:
    hint = " (a name, not a recipe value)"
  elif isinstance(recipe, str):
    hint = (f" (a name: load a shipped recipe with fl.load_recipe(name), names: "
            f"{', '.join(recipe_names())})")
  elif for_activation and recipe is ActivationRecipe:
    hint = " (the class: call it)"
  elif isinstance(recipe, type) or callable(recipe):
    hint = (" (a function or class, not a recipe value: call it)" if not for_activation
            else " (a function or class, not an ActivationRecipe value)")
  elif isinstance(recipe, ScalingConfig):
    wrap = ("ActivationRecipe(input=..., output_grad=...)" if for_activation
            else "Fp8Recipe(input=..., kernel=..., output_grad=...)")
    hint = f" (a ScalingConfig configures one role: put it in a {wrap})"
  elif isinstance(recipe, ActivationRecipe):
    hint = " (an ActivationRecipe is for Fp8Activation; products take an Fp8Recipe)"
  elif for_activation and isinstance(recipe, Fp8Recipe):
    hint = (" (an Fp8Recipe is for products; for an activation use "
            "fl.ActivationRecipe(input=r.input, output_grad=r.output_grad))")
  elif for_activation and isinstance(recipe, IntRecipe):
    hint = " (integer recipes quantize products, not activations)"
  elif recipe is None:
    hint = " (leave the argument out for the default)"
  else:
    hint = ""
  return TypeError(f"{owner}: recipe={_short(recipe)} is not a recipe it takes{hint}; "
                   f"accepted: {accepted} (e.g. {example})")


def products_for(recipe, owner: str = "recipe", in_mode: str | None = None) -> Products:
  """The table entry of ``recipe``'s type (or of its nearest registered base).

  ``in_mode`` picks the table of a mode other than training (:func:`mode`).

  Raises:
    TypeError: naming ``owner`` (the layer) and the accepted recipe types.
  """
  table = _TABLE if in_mode is None else _MODE_TABLES[in_mode]
  for klass in type(recipe).__mro__:
    if klass in table:
      return table[klass]
  if in_mode is not None:
    raise TypeError(f"{owner}: recipe={_short(recipe)} cannot run in mode {in_mode!r}: no "
                    f"{in_mode} products are registered for {type(recipe).__name__}")
  raise recipe_error(owner, recipe, " or ".join(sorted(t.__name__ for t in _TABLE)),
                     "fl.delayed_scaling(), fl.current_scaling(), fl.int8_lsq()")


def check_recipe(owner: str, recipe, conv: bool = False) -> None:
  """Raises a :func:`recipe_error` unless ``owner`` can run ``recipe``.

  Layers call it first thing, so a wrong recipe is reported before any
  variable is created and in the same words everywhere.

  Example:
    >>> import fp8_linen as fl
    >>> from fp8_linen.linen import dispatch
    >>> try:
    ...   dispatch.check_recipe('QDense', 'delayed')
    ... except TypeError as e:
    ...   print(str(e)[:60])
    QDense: recipe='delayed' is not a recipe it takes (a name: l
  """
  products = products_for(recipe, owner)
  if conv and products.conv is None:
    raise TypeError(f"{owner}: recipe={_short(recipe)} has no quantized convolution; accepted: "
                    f"{' or '.join(sorted(t.__name__ for t, p in _TABLE.items() if p.conv))}")


def quantized_dot_general_on(module: nn.Module, lhs, rhs, dimension_numbers, recipe,
                             out_dtype=None, key: str = "dot"):
  """Runs ``recipe``'s quantized ``dot_general`` on ``module``'s state."""
  owner = type(module).__name__
  products_for(recipe, owner)
  return products_for(recipe, owner, _MODE.get()).dot_general(
      module, lhs, rhs, dimension_numbers, recipe, out_dtype, key)


def quantized_conv_on(module: nn.Module, lhs, rhs, conv_kwargs: dict, recipe, out_dtype=None,
                      key: str = "conv"):
  """Runs ``recipe``'s quantized convolution on ``module``'s state."""
  check_recipe(type(module).__name__, recipe, conv=True)
  return products_for(recipe, type(module).__name__, _MODE.get()).conv(
      module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)


def _reduce(x, axes):
  """Sums ``axes`` away; size-1 axes (broadcast ones) are squeezed, not reduced."""
  if not axes:
    return x
  ones = tuple(a for a in axes if x.shape[a] == 1)
  if len(ones) < len(axes):
    x = jnp.sum(x, axis=tuple(a for a in axes if a not in ones), keepdims=True)
  return jnp.squeeze(x, axis=axes)


def quantized_einsum_on(module: nn.Module, equation: str, lhs, rhs, recipe, out_dtype=None,
                        key: str = "dot"):
  """Runs a two-operand einsum as one quantized ``dot_general`` on ``module``'s state.

  Broadcasting equations (ellipses of different ranks, size-1 axes such as
  the single key head of multi-query attention) run as one GEMM too: the
  size-1 axis is squeezed out of its operand (see
  :func:`~fp8_linen.core.dims.einsum_plan`), so the other operand's axis
  becomes a free dimension of the GEMM and nothing is broadcast in memory.

  Args:
    module: the Linen module that owns the state (inside one of its methods).
    equation: the einsum equation (see :func:`~fp8_linen.core.dims.einsum_plan`).
    lhs: first operand (the ``input`` role).
    rhs: second operand (the ``kernel`` role).
    recipe: any recipe in the table.
    out_dtype: output dtype (default: the result type of the operands).
    key: chain key (uses of one state in a step with one key are linked).

  Returns:
    The einsum result.
  """
  plan = einsum_plan(equation, jnp.shape(lhs), jnp.shape(rhs))
  lhs, rhs = _reduce(lhs, plan.lhs_sum_axes), _reduce(rhs, plan.rhs_sum_axes)
  y = quantized_dot_general_on(module, lhs, rhs, plan.dimension_numbers, recipe,
                               out_dtype=out_dtype, key=key)
  if plan.out_perm != tuple(range(len(plan.out_perm))):
    y = jnp.transpose(y, plan.out_perm)
  return y
