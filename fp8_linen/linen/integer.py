"""Integer quantization-aware training in every layer (the ``IntRecipe`` products).

:mod:`fp8_linen.linen.dispatch` routes :class:`~fp8_linen.IntRecipe` here, so
every layer (``QDense``, ``QDenseGeneral``, ``QEinsum``, ``QConv``,
``Fp8DotGeneral``) accepts integer recipes. The GEMM runs in float on
fake-quantized operands; gradients stay in float.

What each estimator declares on the layer:

* ``'ste'``, activation (``input``): an observer range ``input_range`` =
  ``[-min, max]`` (float32 ``(2,)``) in the ``_overwrite_with_gradient``
  collection. It is updated in the backward pass and leaves the step as its
  "gradient", like the fp8 state, so :class:`~fp8_linen.TrainState`,
  gradient accumulation and ``reduce_gradients`` (max) handle it; a layer used
  twice in a step folds both observations into one update (widest range).
  Note: the forward pass always folds the current batch into the range, also
  at evaluation time.
* ``'ste'``, weight (``kernel``): nothing; the scale comes from the weight's
  current min/max (per tensor, channel or group).
* ``'lsq'``: a learnable step in ``params``: ``input_step`` (shape ``(1,)``) or
  ``kernel_step`` (one per channel/group, with the kernel's rank).
* ``'lsq+'``: a step and an offset: ``input_step``/``input_offset`` and
  ``kernel_step``/``kernel_offset``.

Learned values ADD parameters compared with the flax twin (``nn.Dense`` has
only ``kernel`` and ``bias``): an ``nn.Dense`` checkpoint needs them added
before it loads into a layer with an LSQ recipe. They are initialised from
the arrays seen by ``init`` (LSQ: ``2 * mean|x| / sqrt(Q_P)``; LSQ+: the
min/max range), so initialise with a representative batch, not ``ones``.
The LSQ gradient scale is ``1 / sqrt(N * Q_P)`` with ``N`` the number of
elements one step covers (the weight size per tensor, per channel or per
group) for weights and the number of features per example (``x.size /
x.shape[0]``) for activations.

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

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from fp8_linen.core import dims, int_numerics, int_ops, int_product, lowering
from fp8_linen.linen.state import chained, owg_value
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["int_dot_general_on", "int_conv_on", "quantize_operand", "operand_params"]


def _lsq_params(module: nn.Module, role: str, view, axes, cfg: IntQuantConfig):
  """Declares ``<role>_step`` (and ``_offset``) and returns them broadcastable to ``view``."""
  shape = (1,) if role == "input" else tuple(1 if i in axes else d
                                              for i, d in enumerate(view.shape))
  red = tuple(range(view.ndim)) if role == "input" else axes

  def _init_step(_, shape, dtype=None):
    del dtype  # a learned step stays float32, whatever dtype a wrapper asks for
    if cfg.estimator == "lsq":
      s = int_numerics.lsq_init_step(view, red, cfg.qmax)
    else:
      s, _b = int_numerics.lsq_plus_init(view, red, cfg.qmin, cfg.qmax)
    return jnp.reshape(s, shape)

  # The shape is passed as flax's initializers take it: code that wraps
  # nn.Module.param (gemma requires a shape) sees an ordinary declaration.
  step = module.param(f"{role}_step", _init_step, shape)
  if step.shape != shape:
    raise ValueError(f"{'/'.join(module.path)}: {role}_step has shape {step.shape}, the "
                     f"recipe ({cfg.granularity}) asks for {shape}")
  as_view = (lambda t: t.reshape(())) if role == "input" else (lambda t: t)
  if cfg.estimator == "lsq":
    return (as_view(step),)
  offset = module.param(
      f"{role}_offset",
      lambda _, shape, dtype=None: jnp.reshape(
          int_numerics.lsq_plus_init(view, red, cfg.qmin, cfg.qmax)[1], shape), shape)
  return as_view(step), as_view(offset)


def _lsq(module: nn.Module, role: str, view, axes, cfg: IntQuantConfig, n: int):
  """LSQ/LSQ+ fake quantization of ``view`` with params ``<role>_step``/``_offset``."""
  params = _lsq_params(module, role, view, axes, cfg)
  g = 1.0 / math.sqrt(n * cfg.qmax)
  if cfg.estimator == "lsq":
    return int_ops.lsq_fake_quant(view, params[0], qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)
  return int_ops.lsq_plus_fake_quant(view, *params, qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)


def _observer_range(module: nn.Module, role: str):
  rng = lowering.in_context(owg_value(module, f"{role}_range", 0.0, (2,)))
  if rng.shape != (2,):
    raise ValueError(f"{'/'.join(module.path)}: {role}_range has shape {rng.shape}, "
                     "expected (2,)")
  return rng


def operand_params(module: nn.Module, role: str, x, contract_axes, cfg: IntQuantConfig):
  """Declares one operand's quantization variables; returns ``(params, grad_scale)``.

  ``params`` as :func:`~fp8_linen.core.int_product.int_dot_general` takes them:
  ``(range,)`` for an observer, ``()`` for a min/max weight, ``(step,)`` or
  ``(step, offset)`` for LSQ/LSQ+.
  """
  return int_product.operand_params(
      role, x, contract_axes, cfg, lsq_params=functools.partial(_lsq_params, module),
      observer_range=lambda: _observer_range(module, role))


def quantize_operand(module: nn.Module, role: str, x, contract_axes, cfg: IntQuantConfig | None,
                     key: str = "dot"):
  """Fake-quantizes one GEMM operand as ``cfg`` says, declaring its state on ``module``.

  Args:
    module: the Linen module that owns the params/state.
    role: ``'input'`` (activation) or ``'kernel'`` (weight); prefixes the names.
    x: the operand.
    contract_axes: its contracting axes in the GEMM.
    cfg: the role's :class:`~fp8_linen.IntQuantConfig`, or ``None`` (no-op).
    key: distinguishes several GEMMs of one module (for the observer chain).

  Returns:
    The fake-quantized operand (same shape and dtype as ``x``).
  """
  if cfg is None:
    return x
  view, axes = int_numerics.int_view(x, contract_axes, cfg)
  if cfg.learned:
    n = int_ops.lsq_elements(x, view, axes, role)
    return _lsq(module, role, view, axes, cfg, n).reshape(x.shape)
  if role == "input":
    rng = _observer_range(module, role)
    return chained(module, f"{key}/{role}_observer",
                   lambda chain: int_ops.observed_fake_quant(x, rng, cfg=cfg, chain=chain), rng)
  return int_ops.minmax_fake_quant(view, axes, cfg).reshape(x.shape)


def _int_product_on(module: nn.Module, lhs, rhs, lc, rc, recipe: IntRecipe, key: str, run):
  """Declares both operands' variables and runs ``run(**params)`` (an integer product)."""
  return int_product.run_product(
      recipe, lhs, rhs, lc, rc, functools.partial(operand_params, module),
      lambda f, leaf: chained(module, f"{key}/input_observer", f, leaf), run)


def int_dot_general_on(module: nn.Module, lhs, rhs, dimension_numbers, recipe: IntRecipe,
                       out_dtype=None, key: str = "dot"):
  """``dot_general`` of the fake-quantized operands (the ``IntRecipe`` plug-in).

  ``lhs`` is the activation (role ``input``), ``rhs`` the weight (role
  ``kernel``). See the module docstring for the variables it declares.

  Example:
    >>> import functools, jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> dg = functools.partial(fl.Fp8DotGeneral, recipe=fl.IntRecipe())
    >>> v = nn.Dense(3, dot_general_cls=dg).init(jax.random.key(0), jnp.ones((2, 5)))
    >>> v[fl.OWG]['Fp8DotGeneral_0']['input_range'].shape
    (2,)
  """
  if not isinstance(recipe, IntRecipe):
    raise TypeError(f"int_dot_general_on needs an IntRecipe, got {type(recipe).__name__}")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  (lc, rc), _ = dimension_numbers
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if int_product.dot_supported(recipe):
    return _int_product_on(module, lhs, rhs, lc, rc, recipe, key,
                           lambda **kw: int_product.int_dot_general(
                               lhs, rhs, dimension_numbers, recipe=recipe, out_dtype=out_dtype,
                               **kw))
  xq = quantize_operand(module, "input", lhs, lc, recipe.input, key)
  wq = quantize_operand(module, "kernel", rhs, rc, recipe.kernel, key)
  cd = int_product.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  xq, wq = xq.astype(cd), wq.astype(cd)
  y = lowering.lax_dot_general(xq, wq, dimension_numbers, preferred_element_type=jnp.float32,
                               out_sharding=lowering.dot_out_sharding(xq, wq, dimension_numbers))
  return y.astype(out_dtype)


def int_conv_on(module: nn.Module, lhs, rhs, conv_kwargs: dict, recipe: IntRecipe,
                out_dtype=None, key: str = "conv"):
  """Convolution of the fake-quantized operands (``IntRecipe`` in ``QConv``).

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
  if not isinstance(recipe, IntRecipe):
    raise TypeError(f"int_conv_on needs an IntRecipe, got {type(recipe).__name__}")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, conv_kwargs["dimension_numbers"])
  l_contract, r_contract = dims.conv_contract(lhs.ndim, rhs.ndim, dn)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if int_product.conv_supported(recipe):
    conv = int_product.conv_static(lhs.ndim, conv_kwargs, dn)
    return _int_product_on(module, lhs, rhs, l_contract, r_contract, recipe, key,
                           lambda **kw: int_product.int_conv_general_dilated(
                               lhs, rhs, conv, recipe=recipe, out_dtype=out_dtype, **kw))
  xq = quantize_operand(module, "input", lhs, l_contract, recipe.input, key)
  wq = quantize_operand(module, "kernel", rhs, r_contract, recipe.kernel, key)
  cd = int_product.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  xq, wq = xq.astype(cd), wq.astype(cd)
  y = lowering.lax_conv_general_dilated(xq, wq, **conv_kwargs, preferred_element_type=jnp.float32,
                                        out_sharding=lowering.conv_out_sharding(xq, wq, dn))
  return y.astype(out_dtype)

