"""THE table: what each recipe type does on a layer, for Linen and NNX, in every mode.

A :class:`RecipeFamily` holds everything one family of recipes does: declare
its variables up front, run its QAT ``dot_general`` and convolution on a
:class:`~fp8_linen.families.VariableAccess`, build its conversion record, and
run its served products. Every layer of both APIs, both ``quantize_model`` s,
``convert`` and the served models look the recipe's type up here (its nearest
registered base class), so :func:`register_recipe` makes a new family work
in all of them.

================= ========================================= ===============================
recipe type       QAT products, declaration, record         served products
================= ========================================= ===============================
``Fp8Recipe``     :mod:`fp8_linen.families.fp8`             ``core.fp8_serve.fp8_served_*``
``IntRecipe``     :mod:`fp8_linen.families.integer`         ``core.int_serve.int_served_*``
``Fp8WeightOnly`` ``families.fp8.weight_only_*``            ``core.fp8_weight.served_*``
================= ========================================= ===============================

The table is written out below; nothing fills it on import.

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.families import table
  >>> table.family_for(fl.int8_lsq()).dot_general.__module__
  'fp8_linen.families.integer'
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fp8_linen.core import fp8_serve, fp8_weight, int_serve
from fp8_linen.families import fp8, integer
from fp8_linen.recipes.fp8 import ActivationRecipe, Fp8Recipe, Fp8WeightOnly, ScalingConfig
from fp8_linen.recipes.integer import IntRecipe
from fp8_linen.recipes.yaml import recipe_names

__all__ = ["RecipeFamily", "register_recipe", "family_for", "unregister_recipe", "registered", "recipe_error",
           "check_recipe"]


def _declares_nothing(access, recipe, kernel, kernel_contract) -> None:
  del access, recipe, kernel, kernel_contract


def _always_servable(recipe, conv: bool) -> None:
  del recipe, conv


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeFamily:
  """What one recipe family does on a layer, written once for Linen and NNX.

  Every function takes the layer's variables as a
  :class:`~fp8_linen.families.VariableAccess` (``access``) where it needs
  them; none sees a Flax module.

  Attributes:
    dot_general: ``fn(access, lhs, rhs, dimension_numbers, recipe, out_dtype,
      key) -> out``: the QAT product (``lhs`` the ``input`` role, ``rhs`` the
      ``kernel`` role); declares or reads its variables through ``access``;
      ``key`` names its use chain.
    conv: ``fn(access, lhs, rhs, conv_kwargs, recipe, out_dtype, key) -> out``
      (``conv_kwargs`` as for ``lax.conv_general_dilated``), or ``None``
      when the family has no convolution.
    declare: ``fn(access, recipe, kernel, kernel_contract)``: declares the
      variables ``dot_general``/``conv`` will read, before any data (NNX
      constructors); ``kernel`` is the layer's initial weight as the product
      sees it and ``kernel_contract`` its contracting axes (both ``None``
      for a layer whose right operand is an activation). Default: nothing.
    servable: ``fn(recipe, conv) -> str | None``: why ``recipe`` cannot be
      served (``None``: it can; the default, for a family with ``record``).
    record: ``fn(access, recipe, rhs, contract, *, batch, conv) ->
      ServedRecord``: what conversion stores of one product (read from the
      variables the product declared), or ``None``: the family is not
      served.
    served_dot: ``fn(lhs, rhs, dimension_numbers, *, recipe, arrays,
      out_dtype, where) -> out``: the served ``dot_general`` from the
      stored ``arrays`` (``where`` names the layer in errors).
    served_conv: ``fn(lhs, rhs, conv_kwargs, *, recipe, arrays, out_dtype,
      where) -> out``, or ``None``.
    ragged_dot: ``fn(access, lhs, rhs, group_sizes, recipe, out_dtype, key)
      -> out``: the QAT grouped GEMM (``jax.lax.ragged_dot``: an MoE's
      experts), or ``None`` when the family has none.
    ragged_record: ``fn(access, recipe, rhs) -> ServedRecord``: what serving
      a trained grouped GEMM needs, or ``None`` (it cannot be converted).
    served_ragged: ``fn(lhs, rhs, group_sizes, *, recipe, arrays, out_dtype)
      -> out``: the served grouped GEMM, or ``None``.
    declare_ragged: ``fn(access, recipe, groups)``: declares the grouped
      GEMM's variables before any data (NNX), where they differ from
      ``declare``'s (fp8: one kernel state per group); ``None``: ``declare``.
    weight_codes: ``fn(rhs, recipe) -> codes``: a served weight's codes in
      their storage dtype (the layer hands them over cast to float).
    served_weight: ``fn(codes, contract, batch, *, recipe, arrays, where)
      -> float32 weight``: the weight a served product multiplies, from its
      codes (a served model's input gradient and LoRA merging), or ``None``.
    dot_general_from_param: ``fn(access, lhs, rhs, param, dimension_numbers,
      recipe, out_dtype, key) -> out``: the QAT product when ``rhs`` is the
      layer's parameter ``param`` cast by its promotion
      (:func:`~fp8_linen.families.dispatch.kernel_params`), with the values
      ``dot_general`` gives; the family may read ``param`` and round it
      itself (fp8's block kernels: no rounded copy is written). ``None``:
      ``dot_general`` always.

  Example:
    >>> import fp8_linen as fl
    >>> fl.RecipeFamily(dot_general=lambda access, lhs, rhs, dn, recipe, out_dtype, key:
    ...                 lhs @ rhs).conv is None
    True
  """

  dot_general: Callable
  conv: Callable | None = None
  declare: Callable = _declares_nothing
  servable: Callable = _always_servable
  record: Callable | None = None
  served_dot: Callable | None = None
  served_conv: Callable | None = None
  ragged_dot: Callable | None = None
  declare_ragged: Callable | None = None
  ragged_record: Callable | None = None
  served_ragged: Callable | None = None
  weight_codes: Callable | None = None
  served_weight: Callable | None = None
  dot_general_from_param: Callable | None = None


_TABLE: dict[type, RecipeFamily] = {
    Fp8Recipe: RecipeFamily(
        declare=fp8.declare, dot_general=fp8.dot_general, conv=fp8.conv,
        servable=fp8_serve.fp8_servable, record=fp8.record, served_dot=fp8_serve.fp8_served_dot,
        served_conv=fp8_serve.fp8_served_conv, ragged_dot=fp8.ragged_dot,
        declare_ragged=fp8.declare_ragged, ragged_record=fp8.ragged_record,
        served_ragged=fp8_serve.served_ragged_dot,
        weight_codes=fp8_serve.weight_codes, served_weight=fp8_serve.served_weight,
        dot_general_from_param=fp8.dot_general_from_param),
    IntRecipe: RecipeFamily(
        declare=integer.declare, dot_general=integer.dot_general, conv=integer.conv,
        servable=int_serve.int_servable, record=integer.record, served_dot=int_serve.int_served_dot,
        served_conv=int_serve.int_served_conv, ragged_dot=integer.ragged_dot,
        ragged_record=integer.ragged_record, served_ragged=int_serve.int_served_ragged_dot,
        weight_codes=int_serve.weight_codes, served_weight=int_serve.served_weight,
        dot_general_from_param=integer.dot_general_from_param),
    Fp8WeightOnly: RecipeFamily(
        dot_general=fp8.weight_only_dot, conv=fp8.weight_only_conv, record=fp8.weight_only_record,
        served_dot=fp8_weight.served_dot, served_conv=fp8_weight.served_conv,
        weight_codes=fp8_weight.weight_codes, served_weight=fp8_weight.served_weight),
}


def register_recipe(recipe_type: type, family: RecipeFamily) -> None:
  """Adds a recipe family to the table: every layer, ``convert`` and serving then run it.

  Args:
    recipe_type: the recipe class (its subclasses use the family too unless
      registered themselves).
    family: what the family does (:class:`RecipeFamily`).

  Example:
    >>> import dataclasses, jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.families import table
    >>> @dataclasses.dataclass(frozen=True)
    ... class Float32Recipe:  # a float product through the table
    ...   pass
    >>> fl.register_recipe(Float32Recipe, fl.RecipeFamily(
    ...     dot_general=lambda access, lhs, rhs, dn, recipe, out_dtype, key:
    ...         jax.lax.dot_general(lhs, rhs, dn)))
    >>> fl.QDense(2, recipe=Float32Recipe()).init_with_output(
    ...     jax.random.key(0), jnp.ones((1, 3)))[0].shape
    (1, 2)
    >>> table.unregister_recipe(Float32Recipe)
  """
  if not isinstance(recipe_type, type) or not isinstance(family, RecipeFamily):
    raise TypeError("register_recipe(recipe_type, family) takes a class and a RecipeFamily")
  _TABLE[recipe_type] = family


def unregister_recipe(recipe_type: type) -> None:
  """Removes a family :func:`register_recipe` added (the built-in ones stay)."""
  if recipe_type in (Fp8Recipe, IntRecipe, Fp8WeightOnly):
    raise ValueError(f"unregister_recipe: {recipe_type.__name__} is built in")
  _TABLE.pop(recipe_type, None)


def registered() -> tuple[type, ...]:
  """The recipe types in the table."""
  return tuple(_TABLE)


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


def family_for(recipe, owner: str = "recipe") -> RecipeFamily:
  """The family of ``recipe``'s type (or of its nearest registered base).

  Raises:
    TypeError: naming ``owner`` (the layer) and the accepted recipe types.
  """
  for klass in type(recipe).__mro__:
    if klass in _TABLE:
      return _TABLE[klass]
  raise recipe_error(owner, recipe, " or ".join(sorted(t.__name__ for t in _TABLE)),
                     "fl.delayed_scaling(), fl.current_scaling(), fl.int8_lsq()")


def check_recipe(owner: str, recipe, conv: bool = False) -> RecipeFamily:
  """``recipe``'s family; raises a :func:`recipe_error` unless ``owner`` can run it.

  Layers call it first thing, so a wrong recipe is reported before any
  variable is created and in the same words everywhere.

  Example:
    >>> from fp8_linen.families import table
    >>> try:
    ...   table.check_recipe('QDense', 'delayed')
    ... except TypeError as e:
    ...   print(str(e)[:60])
    QDense: recipe='delayed' is not a recipe it takes (a name: l
  """
  family = family_for(recipe, owner)
  if conv and family.conv is None:
    raise TypeError(f"{owner}: recipe={_short(recipe)} has no quantized convolution; accepted: "
                    f"{' or '.join(sorted(t.__name__ for t, f in _TABLE.items() if f.conv))}")
  return family
