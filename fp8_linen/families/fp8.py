"""The fp8 family (``Fp8Recipe``: per tensor, row-wise, MXFP8, NVFP4), on any layer API.

What it keeps on a layer, through its
:class:`~fp8_linen.families.VariableAccess`: for each role (``input``,
``kernel``, ``output_grad``) ``<role>_scale`` (shape ``(1,)``) and
``<role>_amax_history`` (``(history_length,)``), float32, as quantization
state (flax's fp8 names). The ops are :func:`~fp8_linen.fp8_dot_general`
and :func:`~fp8_linen.fp8_conv_general_dilated`; the uses of one layer in a
step are chained, so only the first returns the new state, built from the
max of all of them. :func:`activation` is the quantizer of
``fl.Fp8Activation`` and ``fl.nnx.Quantizer``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> v = fl.QDense(features=4).init(jax.random.key(0), jnp.ones((2, 3)))
  >>> sorted(v[fl.OWG])[:2]
  ['input_amax_history', 'input_scale']
"""

from __future__ import annotations

import jax.numpy as jnp

from fp8_linen.core import fp8_serve, fp8_weight, uses
from fp8_linen.core.conv import fp8_conv_general_dilated
from fp8_linen.core.dot_general import fp8_dot_general
from fp8_linen.core.owg import ROLES, RoleState, name_fp8_residual
from fp8_linen.core.qdq import dequantize, quantize
from fp8_linen.core.ragged_dot import fp8_ragged_dot
from fp8_linen.recipes.fp8 import ActivationRecipe, Fp8Recipe, Fp8WeightOnly, ScalingConfig

__all__ = ["role_state", "declare", "declare_ragged", "dot_general", "dot_general_from_param",
           "conv", "ragged_dot",
           "record", "ragged_record", "activation",
           "weight_only_dot", "weight_only_conv", "weight_only_record",
           "declare_activation"]


def role_state(access, role: str, cfg: ScalingConfig, groups: int | None = None) -> RoleState:
  """Declares (or reads) the state of one role; returns it as a :class:`~fp8_linen.RoleState`.

  ``groups``: one state per group (a grouped GEMM's per-expert weights):
  ``<role>_scale`` ``(groups, 1)``, ``<role>_amax_history`` ``(groups,
  history_length)``.

  Raises:
    ValueError: if stored state does not have the shapes ``cfg`` asks for
      (e.g. a checkpoint written with another history length).
  """
  lead = () if groups is None else (groups,)
  if not cfg.keeps_state:
    # Current scaling without history: the op's state inputs are constants,
    # so nothing is declared, differentiated or carried through a loop.
    return RoleState(uses.constant(lead + (1,), 1.0, jnp.float32),
                     uses.constant(lead + (1,), 0.0, jnp.float32))
  scale = access.state(f"{role}_scale", 1.0, lead + (1,))
  hist = access.state(f"{role}_amax_history", 0.0, lead + (cfg.history_length,))
  per = " (one per expert)" if lead else ""
  if scale.shape != lead + (1,):
    raise ValueError(f"{access.path}: {role}_scale has shape {scale.shape}, expected "
                     f"{lead + (1,)}{per}")
  if hist.shape != lead + (cfg.history_length,):
    raise ValueError(
        f"{access.path}: {role}_amax_history has shape {hist.shape} but the recipe asks for "
        f"{lead + (cfg.history_length,)}{per} (history_length={cfg.history_length}); load a "
        "checkpoint written with the same recipe or resize the histories: "
        "fl.resize_histories(variables, recipe) (or TrainState)")
  return RoleState(scale, hist)


def _states(access, recipe: Fp8Recipe) -> tuple:
  return tuple(role_state(access, r, recipe.role(r)) for r in ROLES)


def declare_ragged(access, recipe: Fp8Recipe, groups: int) -> None:
  """Declares :func:`ragged_dot`'s state (the kernel's per expert) before any data (NNX)."""
  role_state(access, "input", recipe.role("input"))
  role_state(access, "kernel", recipe.role("kernel"), groups=groups)
  role_state(access, "output_grad", recipe.role("output_grad"))


def declare(access, recipe: Fp8Recipe, kernel=None, kernel_contract=None) -> None:
  """Declares the three roles' state (see the module doc)."""
  del kernel, kernel_contract
  _states(access, recipe)


def dot_general(access, lhs, rhs, dimension_numbers, recipe: Fp8Recipe, out_dtype=None,
                key: str = "dot", *, rhs_compute_dtype=None):
  """:func:`~fp8_linen.fp8_dot_general` on the layer's state, chained under ``key``."""
  st = _states(access, recipe)
  return access.chained(key, lambda chain: fp8_dot_general(
      lhs, rhs, dimension_numbers, input_state=st[0], kernel_state=st[1],
      output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype, chain=chain,
      rhs_compute_dtype=rhs_compute_dtype), st[0].scale)


def dot_general_from_param(access, lhs, rhs, param, dimension_numbers, recipe: Fp8Recipe,
                           out_dtype=None, key: str = "dot"):
  """:func:`dot_general` of ``rhs``, the layer's ``param`` cast; block recipes read ``param``.

  A block recipe's kernels quantize the weight from one read: handed the
  parameter and the dtype it was cast to, they round it as they read it,
  and the cast copy is never written (float32 parameters: 4 bytes per
  weight less). The values are those of the cast kernel. Other recipes
  fuse the cast into their own, so they run on ``rhs``.
  """
  rhs = jnp.asarray(rhs)
  if recipe.granularity != "block" or jnp.shape(param) != rhs.shape:
    return dot_general(access, lhs, rhs, dimension_numbers, recipe, out_dtype, key)
  return dot_general(access, lhs, param, dimension_numbers, recipe,
                     out_dtype or jnp.result_type(lhs, rhs), key, rhs_compute_dtype=rhs.dtype)


def conv(access, lhs, rhs, conv_kwargs: dict, recipe: Fp8Recipe, out_dtype=None,
         key: str = "conv"):
  """:func:`~fp8_linen.fp8_conv_general_dilated` on the layer's state, chained under ``key``."""
  st = _states(access, recipe)
  return access.chained(key, lambda chain: fp8_conv_general_dilated(
      lhs, rhs, **conv_kwargs, input_state=st[0], kernel_state=st[1],
      output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype, chain=chain), st[0].scale)


def ragged_dot(access, lhs, rhs, group_sizes, recipe: Fp8Recipe, out_dtype=None,
               key: str = "ragged"):
  """:func:`~fp8_linen.fp8_ragged_dot` on the layer's state, chained under ``key``.

  The experts' weights have one state per expert (``kernel_scale`` ``(g, 1)``,
  ``kernel_amax_history`` ``(g, history_length)``); the routed tokens and the
  output gradient one each, over every routed row.
  """
  st = (role_state(access, "input", recipe.role("input")),
        role_state(access, "kernel", recipe.role("kernel"), groups=jnp.shape(rhs)[0]),
        role_state(access, "output_grad", recipe.role("output_grad")))
  return access.chained(key, lambda chain: fp8_ragged_dot(
      lhs, rhs, group_sizes, input_state=st[0], kernel_state=st[1], output_grad_state=st[2],
      recipe=recipe, out_dtype=out_dtype, chain=chain), st[0].scale)


def _stored_role(access, role: str, cfg: ScalingConfig) -> RoleState:
  """A role's state as stored (the initial one where the layer has none)."""
  scale, hist = access.stored(f"{role}_scale"), access.stored(f"{role}_amax_history")
  return RoleState(jnp.ones((1,), jnp.float32) if scale is None else scale,
                   jnp.zeros((max(cfg.history_length, 1),), jnp.float32) if hist is None
                   else hist)


def record(access, recipe: Fp8Recipe, rhs, contract, *, batch=(), conv: bool = False):
  """The product's conversion record (:func:`~fp8_linen.core.fp8_serve.fp8_record`)."""
  return fp8_serve.fp8_record(recipe, rhs, contract,
                              _stored_role(access, "input", recipe.input),
                              _stored_role(access, "kernel", recipe.kernel), conv=conv,
                              batch=batch)


def ragged_record(access, recipe: Fp8Recipe, rhs):
  """A grouped GEMM's conversion record (:func:`~fp8_linen.core.fp8_serve.ragged_record`)."""
  return fp8_serve.ragged_record(recipe, _stored_role(access, "input", recipe.input),
                                 _stored_role(access, "kernel", recipe.kernel), rhs)


def declare_activation(access, recipe: ActivationRecipe) -> None:
  """Declares the state of :func:`activation` (roles ``input`` and ``output_grad``)."""
  role_state(access, "input", recipe.input)
  role_state(access, "output_grad", recipe.output_grad)


def activation(access, x, recipe: ActivationRecipe, name: str):
  """``x`` through fp8 (e4m3 forward, e5m2 gradient) with the layer's state.

  The quantize/dequantize pair of :mod:`fp8_linen.core.qdq`; each role's
  uses in a step are chained. The fp8 copy is named ``name``
  (``jax.ad_checkpoint.checkpoint_name``) for remat policies.
  """
  st_in = role_state(access, "input", recipe.input)

  def _q(chain):
    xq, s, chain_out = quantize(x, *st_in, cfg=recipe.input, chain=chain)
    return (xq, s), chain_out

  xq, s = access.chained("activation_input", _q, st_in.scale)
  xq = name_fp8_residual(xq, name)
  st_g = role_state(access, "output_grad", recipe.output_grad)
  return access.chained(
      "activation_output_grad",
      # exact: the value goes on to any op, and XLA:GPU would otherwise drop
      # the e4m3 rounding (core.numerics.decode_fp8).
      lambda chain: dequantize(xq, s, *st_g, grad_cfg=recipe.output_grad, dtype=x.dtype,
                               chain=chain, exact=True), st_g.scale)


def weight_only_dot(access, lhs, rhs, dimension_numbers, recipe: Fp8WeightOnly, out_dtype=None,
                    key: str = "dot"):
  """:class:`~fp8_linen.Fp8WeightOnly`'s QAT ``dot_general`` (it keeps no variables)."""
  del access, key
  return fp8_weight.dot(lhs, rhs, dimension_numbers, recipe, out_dtype)


def weight_only_conv(access, lhs, rhs, conv_kwargs: dict, recipe: Fp8WeightOnly, out_dtype=None,
                     key: str = "conv"):
  """:class:`~fp8_linen.Fp8WeightOnly`'s QAT convolution."""
  del access, key
  return fp8_weight.conv(lhs, rhs, conv_kwargs, recipe, out_dtype)


def weight_only_record(access, recipe: Fp8WeightOnly, rhs, contract, *, batch=(),
                       conv: bool = False):
  """What conversion stores of a weight-only fp8 product: codes and scales."""
  del access, batch, conv
  return fp8_weight.weight_record(recipe, rhs, contract)
