"""Weight-only fp8 (:class:`~fp8_linen.Fp8WeightOnly`): the weight as fp8 codes, a float GEMM.

QAT multiplies the float activation by the weight quantized to fp8 and
dequantized (:func:`fake_quant`: its forward is exactly ``codes * scale``,
its gradient passes straight through); conversion stores those codes and
scales (:func:`fold`); serving multiplies by ``codes * scale``
(:func:`served_dot`, :func:`served_conv`), in the dtype QAT's GEMM used, so
serving equals frozen QAT bit for bit. The scale comes from the weight's own
amax (per tensor or per output channel): there is no state.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import fp8_weight
  >>> a = fp8_weight.fold(jnp.array([[0.5, 2.0], [-1.0, 4.0]]), (0,), fl.Fp8WeightOnly())
  >>> a['kernel'].dtype, a['kernel_scale'].shape
  (dtype(float8_e4m3fn), (1, 2))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8_linen.core import dims, int_gemm, lowering, numerics, uses
from fp8_linen.core.serve import ServedRecord, record
from fp8_linen.recipes.fp8 import Fp8WeightOnly

__all__ = ["weight_scale", "fold", "dequantize", "fake_quant", "dot", "conv", "weight_record",
           "served_dot", "served_conv", "weight_codes", "served_weight"]


def weight_scale(w, contract, recipe: Fp8WeightOnly):
  """The weight's scale: one (``(1,)``) or one per output channel (the contracting axes kept, size 1)."""
  cfg = recipe.kernel
  if recipe.granularity == "channel":
    return numerics.row_scale(w, tuple(contract), cfg)
  return numerics.select_scale(cfg, jnp.ones((1,), jnp.float32), jnp.zeros((0,), jnp.float32),
                               lowering.global_max(numerics.amax(w)))


def fold(w, contract, recipe: Fp8WeightOnly) -> dict:
  """``{'kernel': fp8 codes in w's shape, 'kernel_scale': ...}``: what serving stores."""
  w = jnp.asarray(w)
  s = weight_scale(w, contract, recipe)
  return {"kernel": numerics.quantize(w, recipe.kernel.jnp_dtype, s), "kernel_scale": s}


def dequantize(codes, scale, dtype, *, exact: bool = False):
  """``codes * scale`` in ``dtype`` (computed in float32).

  ``exact``: read fresh codes through their bits (``numerics.decode_fp8``):
  XLA:GPU would drop a cast to fp8 followed by a cast back.
  """
  codes = jnp.asarray(codes)
  values = numerics.decode_fp8(codes) if exact else codes.astype(jnp.float32)
  return (values * jnp.asarray(scale, jnp.float32)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quant(w, contract, recipe):
  """The weight quantized to fp8 and dequantized, in ``w``'s dtype; the gradient passes unchanged."""
  a = fold(w, contract, recipe)
  return dequantize(a["kernel"], a["kernel_scale"], jnp.asarray(w).dtype, exact=True)


def _fake_quant_fwd(w, contract, recipe):
  return fake_quant(w, contract, recipe), None


def _fake_quant_bwd(contract, recipe, res, g):
  del contract, recipe, res
  return (g,)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)
fake_quant = uses.compiled_when_eager(fake_quant, static_argnums=(1, 2))


def _compute(recipe: Fp8WeightOnly, lhs):
  return int_gemm.resolve_compute_dtype(recipe.compute_dtype, jnp.asarray(lhs).dtype)


def _float_dot(lhs, w, dimension_numbers, cd, out_dtype):
  x, w = jnp.asarray(lhs).astype(cd), jnp.asarray(w).astype(cd)
  y = lowering.lax_dot_general(x, w, dimension_numbers, preferred_element_type=jnp.float32,
                               out_sharding=lowering.dot_out_sharding(x, w, dimension_numbers))
  return y.astype(out_dtype)


def _float_conv(lhs, w, conv_kwargs, cd, out_dtype):
  x, w = jnp.asarray(lhs).astype(cd), jnp.asarray(w).astype(cd)
  dn = lax.conv_dimension_numbers(x.shape, w.shape, conv_kwargs["dimension_numbers"])
  y = lowering.lax_conv_general_dilated(x, w, **conv_kwargs, preferred_element_type=jnp.float32,
                                        out_sharding=lowering.conv_out_sharding(x, w, dn))
  return y.astype(out_dtype)


def _rhs_contract(lhs, rhs, dimension_numbers):
  (_, rc), _ = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
  return tuple(rc)


def _conv_contract(lhs, rhs, conv_kwargs):
  dn = lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs),
                                  conv_kwargs["dimension_numbers"])
  return tuple(dims.conv_contract(jnp.ndim(lhs), jnp.ndim(rhs), dn)[1])


def dot(lhs, rhs, dimension_numbers, recipe: Fp8WeightOnly, out_dtype=None):
  """The QAT ``dot_general``: ``lhs`` times the fake-quantized ``rhs``, in the compute dtype."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  wq = fake_quant(jnp.asarray(rhs), _rhs_contract(lhs, rhs, dimension_numbers), recipe)
  return _float_dot(lhs, wq, dimension_numbers, _compute(recipe, lhs), out_dtype)


def conv(lhs, rhs, conv_kwargs: dict, recipe: Fp8WeightOnly, out_dtype=None):
  """The QAT convolution with the fake-quantized kernel."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  wq = fake_quant(jnp.asarray(rhs), _conv_contract(lhs, rhs, conv_kwargs), recipe)
  return _float_conv(lhs, wq, conv_kwargs, _compute(recipe, lhs), out_dtype)


def weight_record(recipe: Fp8WeightOnly, rhs, contract) -> ServedRecord:
  """What conversion stores of one product: the codes and scales (a live operand keeps nothing)."""
  return record(fold(rhs, contract, recipe), {}, {}, True)


def _served_weight(lhs, rhs, arrays, contract, recipe):
  if "kernel_scale" in arrays:  # stored codes (cast to float by the layer)
    return dequantize(jnp.asarray(rhs).astype(recipe.kernel.jnp_dtype), arrays["kernel_scale"],
                      jnp.asarray(rhs).dtype)
  return fake_quant(jnp.asarray(rhs), contract, recipe)


def served_dot(lhs, rhs, dimension_numbers, *, recipe: Fp8WeightOnly, arrays: dict, out_dtype,
               where: str):
  """The served ``dot_general``: the activation times ``codes * scale``."""
  del where
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  w = _served_weight(lhs, rhs, arrays, _rhs_contract(lhs, rhs, dimension_numbers), recipe)
  return _float_dot(lhs, w, dimension_numbers, _compute(recipe, lhs), out_dtype)


def served_conv(lhs, rhs, conv_kwargs: dict, *, recipe: Fp8WeightOnly, arrays: dict, out_dtype,
                where: str):
  """The served convolution from the stored codes."""
  del where
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  w = _served_weight(lhs, rhs, arrays, _conv_contract(lhs, rhs, conv_kwargs), recipe)
  return _float_conv(lhs, w, conv_kwargs, _compute(recipe, lhs), out_dtype)


def weight_codes(rhs, recipe: Fp8WeightOnly):
  """The stored codes in their fp8 dtype."""
  return jnp.asarray(rhs).astype(recipe.kernel.jnp_dtype)


def served_weight(codes, contract, batch, *, recipe: Fp8WeightOnly, arrays: dict, where: str):
  """The float32 weight a served product multiplies."""
  del contract, batch, recipe, where
  return dequantize(codes, arrays["kernel_scale"], jnp.float32)
