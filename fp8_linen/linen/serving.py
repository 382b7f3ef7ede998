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
  '_serve_int_dot'
"""

from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from fp8_linen.core import dims, int_product, serve
from fp8_linen.core.owg import OWG, RoleState
from fp8_linen.linen import dispatch
from fp8_linen.linen.integer import int_conv_on, int_dot_general_on
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.integer import IntRecipe

__all__ = ["SERVED", "FOLD", "LIVE", "FROZEN", "layer_path", "served_arrays"]

SERVED = "fp8_linen_served"  # the collection 'convert' writes
# Name prefixes: a folded weight, a live right operand, the frozen input (a
# module's variable names are unique across collections, so none may be bare).
FOLD, LIVE, FROZEN = "fold.", "live.", "frozen."
OK, KERNEL_AT, KERNEL_EQUAL = "check.state", "check.kernel_at", "check.kernel_equal"


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


def _record(module: nn.Module, rhs, fold: dict, live: dict, frozen: dict, state_ok) -> None:
  at, p = _kernel_param(module, rhs)
  out = {OK: jnp.asarray(state_ok), KERNEL_AT: jnp.asarray(-1 if at is None else at)}
  out[KERNEL_EQUAL] = (jnp.asarray(False) if p is None else
                       jnp.array_equal(jnp.asarray(p).astype(rhs.dtype).reshape(rhs.shape), rhs))
  out.update({FOLD + k: v for k, v in fold.items()})
  out.update({LIVE + k: v for k, v in live.items()})
  out.update({FROZEN + k: v for k, v in frozen.items()})
  for name, value in out.items():
    module.put_variable(SERVED, name, value)


def served_arrays(module: nn.Module) -> dict:
  """The arrays of ``module``'s own ``params`` scope (its children excluded)."""
  params = module.variables.get("params", {})
  return {k: v for k, v in params.items() if not isinstance(v, Mapping)}


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


def _fp8_state_ok(recipe: Fp8Recipe, in_state):
  """Whether the frozen input scale comes from trained state (delayed per tensor)."""
  if recipe.granularity == "tensor" and recipe.input.scaling == "delayed":
    return jnp.any(in_state.amax_history > 0)
  return jnp.asarray(True)


def _check_fp8(module, recipe, conv=False):
  why = serve.fp8_servable(recipe, conv)
  if why:
    raise ValueError(f"{layer_path(module)}: recipe={recipe!r} cannot be served: {why}")


def _convert_fp8_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  _check_fp8(module, recipe)
  y = dispatch.fp8_dot_general_on(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key)
  in_state, k_state = _fp8_states(module, recipe)
  dn = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
  rhs = jnp.asarray(rhs)
  _record(module, rhs, serve.fold_fp8_kernel(recipe, rhs, dn[0][1], k_state),
          serve.live_fp8_kernel(recipe, k_state), serve.freeze_fp8_input(recipe, in_state),
          _fp8_state_ok(recipe, in_state))
  return y


def _convert_fp8_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  _check_fp8(module, recipe, conv=True)
  y = dispatch.fp8_conv_on(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)
  in_state, k_state = _fp8_states(module, recipe)
  rhs = jnp.asarray(rhs)
  dn = lax.conv_dimension_numbers(jnp.shape(lhs), rhs.shape, conv_kwargs["dimension_numbers"])
  _, rc = dims.conv_contract(jnp.ndim(lhs), rhs.ndim, dn)
  _record(module, rhs, serve.fold_fp8_kernel(recipe, rhs, rc, k_state), {},
          serve.freeze_fp8_input(recipe, in_state), _fp8_state_ok(recipe, in_state))
  return y


def _missing(module, what: str) -> ValueError:
  return ValueError(f"{layer_path(module)}: the served params hold no {what} for this layer; "
                    "apply the served model to the params fl.convert returned")


def _served(module, lhs, rhs, out_dtype, required, run):
  """Reads ``module``'s served arrays, checks ``required`` are there, runs ``run(arrays, dtype)``."""
  arrays = served_arrays(module)
  for name in required:
    if name not in arrays:
      raise _missing(module, name)
  return run(arrays, jnp.dtype(out_dtype or jnp.result_type(lhs, rhs)))


def _serve_fp8_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  del key
  frozen = recipe.granularity == "tensor" and recipe.input.scaling == "delayed"
  return _served(module, lhs, rhs, out_dtype, ("input_scale",) if frozen else (),
                 lambda arrays, dt: serve.fp8_dot(
                     lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                     folded="kernel_scale" in arrays, out_dtype=dt))


def _serve_fp8_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  del key
  return _served(module, lhs, rhs, out_dtype, ("kernel_scale",),
                 lambda arrays, dt: serve.fp8_conv(lhs, rhs, conv_kwargs, recipe=recipe,
                                                   arrays=arrays, out_dtype=dt))


# ----------------------------------------------------------------------------
# integer


def _int_params(module: nn.Module, role: str, cfg):
  """``(params, ok)``: the trained quantizer values of one role, read as they are stored."""
  if cfg.learned:
    names = [f"{role}_step"] + ([f"{role}_offset"] if cfg.estimator == "lsq+" else [])
    vals = tuple(module.get_variable("params", n) for n in names)
    if role == "input":
      vals = tuple(jnp.reshape(v, ()) for v in vals)
    return vals, jnp.asarray(True)
  if role == "input":
    rng = module.get_variable(OWG, "input_range")
    if rng is None:
      return (jnp.zeros((2,), jnp.float32),), jnp.asarray(False)
    return (rng,), jnp.any(rng != 0)
  return (), jnp.asarray(True)


def _check_int(module, recipe: IntRecipe):
  if not int_product.dot_supported(recipe):
    role = "input" if recipe.input is None else "kernel"
    raise ValueError(f"{layer_path(module)}: recipe={recipe!r} cannot be served: "
                     f"recipe.{role} is None, so QAT runs a float product of a "
                     "fake-quantized operand; give both roles an IntQuantConfig")


def _convert_int(module, lhs, rhs, lc, rc, recipe, y):
  rhs = jnp.asarray(rhs)
  lp, ok = _int_params(module, "input", recipe.input)
  rp, _ = _int_params(module, "kernel", recipe.kernel)
  _record(module, rhs, serve.fold_int_kernel(recipe.kernel, rhs, rc, rp),
          serve.live_int_kernel(recipe.kernel, rp), serve.freeze_int_input(recipe.input, lp), ok)
  return y


def _convert_int_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  _check_int(module, recipe)
  y = int_dot_general_on(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key)
  (lc, rc), _ = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
  return _convert_int(module, lhs, rhs, lc, rc, recipe, y)


def _convert_int_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  _check_int(module, recipe)
  y = int_conv_on(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key)
  dn = lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs),
                                  conv_kwargs["dimension_numbers"])
  lc, rc = dims.conv_contract(jnp.ndim(lhs), jnp.ndim(rhs), dn)
  return _convert_int(module, lhs, rhs, lc, rc, recipe, y)


def _serve_int_dot(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  del key
  _check_int(module, recipe)
  return _served(module, lhs, rhs, out_dtype, ("input_scale",),
                 lambda arrays, dt: serve.int_dot(
                     lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                     folded="kernel_scale" in arrays, out_dtype=dt))


def _serve_int_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  del key
  _check_int(module, recipe)
  return _served(module, lhs, rhs, out_dtype, ("input_scale", "kernel_scale"),
                 lambda arrays, dt: serve.int_conv(lhs, rhs, conv_kwargs, recipe=recipe,
                                                   arrays=arrays, out_dtype=dt))


dispatch.register_mode("convert", Fp8Recipe,
                       dispatch.Products(dot_general=_convert_fp8_dot, conv=_convert_fp8_conv))
dispatch.register_mode("convert", IntRecipe,
                       dispatch.Products(dot_general=_convert_int_dot, conv=_convert_int_conv))
dispatch.register_mode("serve", Fp8Recipe,
                       dispatch.Products(dot_general=_serve_fp8_dot, conv=_serve_fp8_conv))
dispatch.register_mode("serve", IntRecipe,
                       dispatch.Products(dot_general=_serve_int_dot, conv=_serve_int_conv))
