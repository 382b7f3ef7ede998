"""The integer QAT family (``IntRecipe``: STE, LSQ, LSQ+), on any layer API.

Every layer of both APIs accepts integer recipes through this family. Where
the recipe has an integer product (both roles quantized:
:func:`~fp8_linen.core.int_product.int_dot_general`) it runs on codes;
otherwise the GEMM runs in float on the fake-quantized operands. Gradients
stay in float.

What each estimator keeps on the layer, through its
:class:`~fp8_linen.families.VariableAccess`:

* ``'ste'``, activation (``input``): an observer range ``input_range`` =
  ``[-min, max]`` (float32 ``(2,)``) as quantization state. It is updated in
  the backward pass and leaves the step as its "gradient", like the fp8
  state, so the train states, gradient accumulation and cross-device
  reduction (max) handle it; a layer used twice in a step folds both
  observations into one update (widest range). Note: the forward pass
  always folds the current batch into the range, also at evaluation time.
* ``'ste'``, weight (``kernel``): nothing; the scale comes from the weight's
  current min/max (per tensor, channel or group).
* ``'lsq'``: a learned step: ``input_step`` (shape ``(1,)``) or
  ``kernel_step`` (one per channel/group, with the kernel's rank).
* ``'lsq+'``: a step and an offset: ``input_step``/``input_offset`` and
  ``kernel_step``/``kernel_offset``.

Learned values ADD parameters compared with the flax twin (``nn.Dense`` has
only ``kernel`` and ``bias``): a float checkpoint needs them added before it
loads into a layer with an LSQ recipe. They are initialised from the data
(LSQ: ``2 * mean|x| / sqrt(Q_P)``; LSQ+: the min/max range): Linen at
``init`` (initialise with a representative batch, not ``ones``), NNX from
the initial kernel and, for activations, :func:`fl.nnx.calibrate`. The LSQ
gradient scale is ``1 / sqrt(N * Q_P)`` with ``N`` the number of elements
one step covers (the weight size per tensor, per channel or per group) for
weights and the number of features per example (``x.size / x.shape[0]``)
for activations.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> layer = fl.QDense(4, recipe=fl.int8_lsq())
  >>> v = layer.init(jax.random.key(0), jax.random.normal(jax.random.key(1), (8, 16)))
  >>> sorted(v['params'])
  ['bias', 'input_step', 'kernel', 'kernel_step']
  >>> v['params']['kernel_step'].shape
  (1, 4)
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax

from fp8_linen.core import (dims, int_gemm, int_kernels, int_numerics, int_ops, int_product,
                            int_serve, lowering)
from fp8_linen.core.grouped_kernels import lax_ragged_dot
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["declare", "dot_general", "dot_general_from_param", "ragged_dot", "ragged_record",
           "conv", "record", "quantize_operand", "operand_params"]


def _step_shape(role: str, view, axes) -> tuple:
  if role == "input":
    return (1,)
  return tuple(1 if i in axes else d for i, d in enumerate(view.shape))


def _lsq_params(access, role: str, view, axes, cfg: IntQuantConfig):
  """Declares or reads ``<role>_step`` (and ``_offset``), broadcastable to ``view``."""
  shape = _step_shape(role, view, axes)
  red = tuple(range(view.ndim)) if role == "input" else axes

  def init_step(shape):
    if cfg.estimator == "lsq":
      s = int_numerics.lsq_init_step(view, red, cfg.qmax)
    else:
      s, _b = int_numerics.lsq_plus_init(view, red, cfg.qmin, cfg.qmax)
    return jnp.reshape(s, shape)

  def init_offset(shape):
    return jnp.reshape(int_numerics.lsq_plus_init(view, red, cfg.qmin, cfg.qmax)[1], shape)

  data = role == "input"  # an activation's step is set from the activations seen
  step = access.param(f"{role}_step", init_step, shape, from_data=data)
  if step.shape != shape:
    raise ValueError(f"{access.path}: {role}_step has shape {step.shape}, the "
                     f"recipe ({cfg.granularity}) asks for {shape}")
  as_view = (lambda t: t.reshape(())) if role == "input" else (lambda t: t)
  if cfg.estimator == "lsq":
    return (as_view(step),)
  offset = access.param(f"{role}_offset", init_offset, shape, from_data=data)
  return as_view(step), as_view(offset)


def _lsq(access, role: str, view, axes, cfg: IntQuantConfig, n: int):
  """LSQ/LSQ+ fake quantization of ``view`` with the learned ``<role>_step``/``_offset``."""
  params = _lsq_params(access, role, view, axes, cfg)
  g = 1.0 / math.sqrt(n * cfg.qmax)
  if cfg.estimator == "lsq":
    return int_ops.lsq_fake_quant(view, params[0], qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)
  return int_ops.lsq_plus_fake_quant(view, *params, qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)


def _observer_range(access, role: str):
  rng = access.state(f"{role}_range", 0.0, (2,))
  if rng.shape != (2,):
    raise ValueError(f"{access.path}: {role}_range has shape {rng.shape}, expected (2,)")
  return rng


def _declare_role(access, role: str, cfg: IntQuantConfig | None, kernel, kernel_contract):
  if cfg is None:
    return
  if not cfg.learned:
    if role == "input":  # the observer range; weights take their range from themselves
      _observer_range(access, role)
    return
  if role == "input":
    # No data yet: placeholders, which the first data seen replaces (NNX: calibrate).
    access.param("input_step", lambda shape: jnp.ones(shape, jnp.float32), (1,))
    if cfg.estimator == "lsq+":
      access.param("input_offset", lambda shape: jnp.zeros(shape, jnp.float32), (1,))
    return
  if kernel is None:
    raise ValueError(
        f"{access.owner}: recipe's kernel quantizer is learned ({cfg.estimator}); its step has "
        "the shape of the right operand, which the layer declares before its first call and "
        "an einsum of two activations does not know; use an STE kernel quantizer "
        "(kernel=fl.IntQuantConfig(estimator='ste')), or a layer with a weight "
        "(fl.nnx.Einsum)")
  view, axes = int_numerics.int_view(kernel, kernel_contract, cfg)
  _lsq_params(access, role, view, axes, cfg)


def declare(access, recipe: IntRecipe, kernel=None, kernel_contract=None) -> None:
  """Declares the recipe's state and learned parameters before any data (see the module doc).

  The weight's LSQ step (and offset) start from ``kernel``, the activation's
  are placeholders until data is seen.
  """
  _declare_role(access, "input", recipe.input, None, None)
  _declare_role(access, "kernel", recipe.kernel, kernel, kernel_contract)


def operand_params(access, role: str, x, contract_axes, cfg: IntQuantConfig):
  """Declares one operand's quantization variables; returns ``(params, grad_scale)``.

  ``params`` as :func:`~fp8_linen.core.int_product.int_dot_general` takes them:
  ``(range,)`` for an observer, ``()`` for a min/max weight, ``(step,)`` or
  ``(step, offset)`` for LSQ/LSQ+.
  """
  return int_product.operand_params(
      role, x, contract_axes, cfg, lsq_params=functools.partial(_lsq_params, access),
      observer_range=lambda: _observer_range(access, role))


def quantize_operand(access, role: str, x, contract_axes, cfg: IntQuantConfig | None,
                     key: str = "dot"):
  """Fake-quantizes one GEMM operand as ``cfg`` says, declaring its variables on the layer.

  Args:
    access: the layer's variables.
    role: ``'input'`` (activation) or ``'kernel'`` (weight); prefixes the names.
    x: the operand.
    contract_axes: its contracting axes in the GEMM.
    cfg: the role's :class:`~fp8_linen.IntQuantConfig`, or ``None`` (no-op).
    key: distinguishes several GEMMs of one layer (for the observer chain).

  Returns:
    The fake-quantized operand (same shape and dtype as ``x``).
  """
  if cfg is None:
    return x
  view, axes = int_numerics.int_view(x, contract_axes, cfg)
  if cfg.learned:
    n = int_ops.lsq_elements(x, view, axes, role)
    return _lsq(access, role, view, axes, cfg, n).reshape(x.shape)
  if role == "input":
    rng = _observer_range(access, role)
    return access.chained(f"{key}/{role}_observer",
                          lambda chain: int_ops.observed_fake_quant(x, rng, cfg=cfg, chain=chain),
                          rng)
  return int_ops.minmax_fake_quant(view, axes, cfg).reshape(x.shape)


def _int_product(access, lhs, rhs, lc, rc, recipe: IntRecipe, key: str, run):
  """Declares both operands' variables and runs ``run(**params)`` (an integer product)."""
  return int_product.run_product(
      recipe, lhs, rhs, lc, rc, functools.partial(operand_params, access),
      lambda f, leaf: access.chained(f"{key}/input_observer", f, leaf), run)


def _fake_quantized(access, lhs, rhs, lc, rc, recipe: IntRecipe, key: str):
  """Both operands fake-quantized (a role without a config passes), in the compute dtype."""
  xq = quantize_operand(access, "input", lhs, lc, recipe.input, key)
  wq = quantize_operand(access, "kernel", rhs, rc, recipe.kernel, key)
  cd = int_gemm.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  return xq.astype(cd), wq.astype(cd)


def dot_general(access, lhs, rhs, dimension_numbers, recipe: IntRecipe, out_dtype=None,
                key: str = "dot", *, rhs_compute_dtype=None):
  """``dot_general`` of the quantized operands (``lhs`` the activation, ``rhs`` the weight).

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> dg = functools.partial(fl.Fp8DotGeneral, recipe=fl.IntRecipe())
    >>> v = nn.Dense(3, dot_general_cls=dg).init(jax.random.key(0), jnp.ones((2, 5)))
    >>> v[fl.OWG]['Fp8DotGeneral_0']['input_range'].shape
    (2,)
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  (lc, rc), _ = dimension_numbers
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if int_gemm.dot_supported(recipe):
    return _int_product(access, lhs, rhs, lc, rc, recipe, key,
                        lambda **kw: int_product.int_dot_general(
                            lhs, rhs, dimension_numbers, recipe=recipe, out_dtype=out_dtype,
                            rhs_compute_dtype=rhs_compute_dtype, **kw))
  xq, wq = _fake_quantized(access, lhs, rhs, lc, rc, recipe, key)
  y = lowering.lax_dot_general(xq, wq, dimension_numbers, preferred_element_type=jnp.float32,
                               out_sharding=lowering.dot_out_sharding(xq, wq, dimension_numbers))
  return y.astype(out_dtype)


def dot_general_from_param(access, lhs, rhs, param, dimension_numbers, recipe: IntRecipe,
                           out_dtype=None, key: str = "dot"):
  """:func:`dot_general` of ``rhs``, the layer's ``param`` cast; a TPU kernel reads ``param``.

  Where :mod:`~fp8_linen.core.int_kernels` quantizes the weight (an STE
  weight per channel, traced for a TPU), it is handed the parameter and the
  dtype it was cast to: it rounds the weight as it reads it, once, and the
  cast copy is never written. The values are those of the cast kernel.
  Elsewhere the cast fuses into the quantization, so the product runs on ``rhs``.
  """
  rhs, param = jnp.asarray(rhs), jnp.asarray(param)
  (_, rc), _ = dimension_numbers
  if (not int_gemm.dot_supported(recipe) or param.shape != rhs.shape
      or not int_kernels.channel_codes_mode(param, rc, recipe.kernel, rhs.dtype)):
    return dot_general(access, lhs, rhs, dimension_numbers, recipe, out_dtype, key)
  return dot_general(access, lhs, param, dimension_numbers, recipe,
                     out_dtype or jnp.result_type(lhs, rhs), key, rhs_compute_dtype=rhs.dtype)


def ragged_dot(access, lhs, rhs, group_sizes, recipe: IntRecipe, out_dtype=None,
               key: str = "ragged"):
  """A grouped GEMM (``jax.lax.ragged_dot``: an MoE's experts) of the fake-quantized operands.

  ``lhs`` ``(m, k)`` is quantized as an activation (one observer over every
  routed row: keep padding rows zero), ``rhs`` ``(g, k, n)`` as a weight
  whose contracting axis is ``k``: ``granularity='channel'`` gives each
  expert's output channels their own scale, ``'tensor'`` one scale for all
  experts. Symmetric STE recipes multiply int8 codes in one grouped GEMM
  (:func:`~fp8_linen.core.int_product.int_ragged_dot`), and with
  ``grad_bits`` their two gradient grouped GEMMs on integer codes too; others
  (asymmetric grids, LSQ) multiply the fake-quantized values in the compute
  dtype, with float gradients through the estimators (``grad_bits`` is
  refused for them).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> class Experts(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x, group_sizes):
    ...     w = self.param('w', nn.initializers.ones, (2, 3, 4))
    ...     return jax.lax.ragged_dot(x, w, group_sizes)
    >>> qm = fl.quantize_model(Experts(), fl.IntRecipe())
    >>> v = qm.init(jax.random.key(0), jnp.ones((5, 3)), jnp.array([2, 3]))
    >>> v[fl.OWG]['ragged_dot_0']['input_range'].shape
    (2,)
  """
  why = int_product.ragged_supported(recipe)
  if recipe.grad_bits is not None and why is not None:
    # Fake-quantized experts have float gradients: grad_bits would be ignored.
    raise ValueError(f"{access.path}: IntRecipe(grad_bits={recipe.grad_bits}) needs the integer "
                     f"grouped GEMM, which {why} does not have; use a symmetric STE recipe for "
                     "the experts, or grad_bits=None")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if why is None:
    return _int_product(access, lhs, rhs, (1,), (1,), recipe, key,
                        lambda **kw: int_product.int_ragged_dot(
                            lhs, rhs, group_sizes, recipe=recipe, out_dtype=out_dtype,
                            input_params=kw["input_params"], kernel_params=kw["kernel_params"],
                            chain=kw.get("chain")))
  xq, wq = _fake_quantized(access, lhs, rhs, (1,), (1,), recipe, key)
  y = lax_ragged_dot(xq, wq, group_sizes, preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


def ragged_record(access, recipe: IntRecipe, rhs):
  """A grouped GEMM's conversion record (:func:`~fp8_linen.core.int_serve.int_ragged_record`).

  Raises:
    ValueError: naming the product, for a recipe whose experts are
      fake-quantized (no integer grouped GEMM to serve them with).
  """
  why = int_product.ragged_supported(recipe)
  if why is not None:
    raise ValueError(f"{access.path}: integer experts under {recipe!r} cannot be converted: "
                     f"{why} has no integer grouped GEMM (use a symmetric STE recipe)")
  return int_serve.int_ragged_record(recipe, rhs, access.stored)


def conv(access, lhs, rhs, conv_kwargs: dict, recipe: IntRecipe, out_dtype=None,
         key: str = "conv"):
  """Convolution of the quantized operands.

  The input is quantized like a GEMM activation; the kernel's contracting axes
  are all but its output-feature axis, so ``granularity='channel'`` gives one
  scale per output feature.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> conv = fl.QConv(4, (3, 3), recipe=fl.IntRecipe())
    >>> y, v = conv.init_with_output(jax.random.key(0), jnp.ones((1, 8, 8, 2)))
    >>> y.shape, v[fl.OWG]['input_range'].shape
    ((1, 8, 8, 4), (2,))
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, conv_kwargs["dimension_numbers"])
  l_contract, r_contract = dims.conv_contract(lhs.ndim, rhs.ndim, dn)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if int_gemm.conv_supported(recipe):
    static = int_gemm.conv_static(lhs.ndim, conv_kwargs, dn)
    return _int_product(access, lhs, rhs, l_contract, r_contract, recipe, key,
                        lambda **kw: int_product.int_conv_general_dilated(
                            lhs, rhs, static, recipe=recipe, out_dtype=out_dtype, **kw))
  xq, wq = _fake_quantized(access, lhs, rhs, l_contract, r_contract, recipe, key)
  y = lowering.lax_conv_general_dilated(xq, wq, **conv_kwargs, preferred_element_type=jnp.float32,
                                        out_sharding=lowering.conv_out_sharding(xq, wq, dn))
  return y.astype(out_dtype)


def record(access, recipe: IntRecipe, rhs, contract, *, batch=(), conv: bool = False):
  """The product's conversion record (:func:`~fp8_linen.core.int_serve.int_record`)."""
  del batch
  return int_serve.int_record(recipe, rhs, contract, access.stored, conv=conv)
