"""The convert and serve products of every recipe: one model definition, three modes.

A layer runs its product through :mod:`fp8_linen.linen.dispatch`; under
``dispatch.mode('convert')`` and ``dispatch.mode('serve')`` the table of this
module answers instead of the training one (the AQT/qwix pattern: the same
model code trains, converts and serves).

* ``'convert'`` runs the QAT forward (evaluation) and writes, in the
  :data:`SERVED` collection at the product's path, what serving needs: the
  weight quantized once with the scale the forward used, its scales, the
  frozen input parameters (see :mod:`fp8_linen.core.serve` for the names),
  and checks (is the right operand the layer's ``kernel`` parameter? is there
  trained state?) that :func:`fp8_linen.convert` reads.
* ``'serve'`` reads those arrays from ``params`` and runs the served product:
  the layer's ``kernel`` holds codes, which the layer's ``promote_dtype``
  casts to float exactly and the product casts back exactly (XLA removes the
  pair, so the codes reach the GEMM).

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.linen import dispatch
  >>> dispatch.products_for(fl.int8_lsq(), in_mode='serve').dot_general.__name__
  '_serve_dot'
"""

from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from fp8_linen.core import dims, serve
from fp8_linen.core.owg import OWG, RoleState
from fp8_linen.linen import dispatch
from fp8_linen.linen.integer import int_conv_on, int_dot_general_on
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.integer import IntRecipe

__all__ = ["SERVED", "layer_path", "served_arrays", "records"]

SERVED = "fp8_linen_served"  # the collection 'convert' writes


def layer_path(module: nn.Module) -> str:
  return "/".join(module.path) or "<root>"


def _kernel_param(module: nn.Module, rhs):
  """``(0 | 1, kernel)``: the ``kernel`` parameter of ``module`` (0) or its parent (1).

  :class:`~fp8_linen.Fp8DotGeneral` runs the product of its parent's
  ``kernel``; layers run their own. ``(None, None)`` when neither has a
  ``kernel`` of ``rhs``'s size (the right operand is an activation).
  """
  for at, owner in ((0, module), (1, getattr(module, "parent", None))):
    if isinstance(owner, nn.Module) and owner.scope is not None and \
        owner.has_variable("params", "kernel"):
      p = owner.get_variable("params", "kernel")
      if getattr(p, "size", None) == rhs.size:
        return at, p
  return None, None


def _record(module: nn.Module, rhs, record: dict) -> None:
  """Writes one product's record (:mod:`fp8_linen.core.serve`) in :data:`SERVED`."""
  rhs = jnp.asarray(rhs)
  # A module's variable names are unique across collections: every name is prefixed.
  for name, value in {**record, **serve.kernel_check(*_kernel_param(module, rhs), rhs)}.items():
    module.put_variable(SERVED, name, value)


def records(tree, path=()):
  """``(path, record)`` of every product a conversion run wrote in :data:`SERVED`."""
  if serve.KERNEL_AT in tree:
    yield path, tree
  for k, v in tree.items():
    if isinstance(v, Mapping):
      yield from records(v, path + (k,))


def served_arrays(module: nn.Module) -> dict:
  """The arrays of ``module``'s own ``params`` scope (its children excluded)."""
  params = module.variables.get("params", {})
  return {k: v for k, v in params.items() if not isinstance(v, Mapping)}


def _check(module, recipe, conv=False):
  serve.check_servable(layer_path(module), recipe, conv)


# ----------------------------------------------------------------------------
# fp8


def _fp8_states(module: nn.Module, recipe: Fp8Recipe):
  """The input and kernel :class:`RoleState` as stored (the product declared them)."""
  def read(role, cfg):
    scale = module.get_variable(OWG, f"{role}_scale")
    hist = module.get_variable(OWG, f"{role}_amax_history")
    return RoleState(jnp.ones((1,), jnp.float32) if scale is None else scale,
                     jnp.zeros((cfg.history_length,), jnp.float32) if hist is None else hist)
  return read("input", recipe.input), read("kernel", recipe.kernel)


def _convert_fp8_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  _check(module, recipe)
  y = dispatch.fp8_dot_general_on(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key)
  (_, rc), (_, rb) = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
  _record(module, rhs, serve.fp8_record(recipe, jnp.asarray(rhs), rc,
                                        *_fp8_states(module, recipe), batch=rb))
  return y


def _convert_fp8_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  _check(module, recipe, conv=True)
  y = dispatch.fp8_conv_on(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)
  rhs = jnp.asarray(rhs)
  dn = lax.conv_dimension_numbers(jnp.shape(lhs), rhs.shape, conv_kwargs["dimension_numbers"])
  _, rc = dims.conv_contract(jnp.ndim(lhs), rhs.ndim, dn)
  _record(module, rhs, serve.fp8_record(recipe, rhs, rc, *_fp8_states(module, recipe),
                                        conv=True))
  return y


# ----------------------------------------------------------------------------
# integer


def _int_read(module: nn.Module):
  """``read(name)`` of :func:`~fp8_linen.core.serve.int_record`: the layer's stored values."""
  return lambda name: module.get_variable(OWG if name == "input_range" else "params", name)


def _convert_int_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  _check(module, recipe)
  y = int_dot_general_on(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key)
  (_, rc), _ = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
  _record(module, rhs, serve.int_record(recipe, rhs, rc, _int_read(module)))
  return y


def _convert_int_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  _check(module, recipe)
  y = int_conv_on(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)
  dn = lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs),
                                  conv_kwargs["dimension_numbers"])
  _, rc = dims.conv_contract(jnp.ndim(lhs), jnp.ndim(rhs), dn)
  _record(module, rhs, serve.int_record(recipe, rhs, rc, _int_read(module), conv=True))
  return y


# ----------------------------------------------------------------------------
# serving: every recipe reads its layer's served arrays and runs core/serve.py


def _serve_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  del key
  return serve.served_dot(lhs, rhs, dimension_numbers, recipe=recipe,
                          arrays=served_arrays(module), out_dtype=out_dtype,
                          where=layer_path(module))


def _serve_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  del key
  return serve.served_conv(lhs, rhs, conv_kwargs, recipe=recipe, arrays=served_arrays(module),
                           out_dtype=out_dtype, where=layer_path(module))


dispatch.register_mode("convert", Fp8Recipe,
                       dispatch.Products(dot_general=_convert_fp8_dot, conv=_convert_fp8_conv))
dispatch.register_mode("convert", IntRecipe,
                       dispatch.Products(dot_general=_convert_int_dot, conv=_convert_int_conv))
for _recipe_type in (Fp8Recipe, IntRecipe):
  dispatch.register_mode("serve", _recipe_type,
                         dispatch.Products(dot_general=_serve_dot, conv=_serve_conv))
