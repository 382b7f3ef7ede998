"""Drop-in quantized twins of ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``.

Each layer subclasses its flax twin, takes the same constructor arguments
(plus ``recipe``) and has the same ``nnx.Param`` names and shapes, so a float
NNX model's parameters load into it. Flax's own forward runs; its product is
the layer's injection point (``dot_general``, ``einsum_op``,
``conv_general_dilated``), set to a module-level function that runs the
recipe family's product (:mod:`fp8_linen.families`) on the variables of the
layer whose ``__call__`` is running (:class:`~fp8_linen.nnx.access.NnxAccess`).
The layer declares them in its constructor: the state as
:class:`~fp8_linen.nnx.QuantState` variables under the Linen layers' names,
learned quantizer values as ``nnx.Param`` s. A served layer
(:func:`~fp8_linen.nnx.convert`) runs its products in ``'serve'`` mode.

``use_running_average`` (flax's name for BatchNorm's switch to its recorded
statistics, so ``model.eval()`` / ``model.train()`` and ``nnx.view`` set it
on every layer of a model) freezes the layer's quantizers: it computes what
the served model computes (:func:`~fp8_linen.frozen_quantizers`). It is a
static attribute, so ``nnx.jit`` traces the model again when it changes.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> layer = fl.nnx.Einsum('btd,dh->bth', (3, 4), (4,), rngs=nnx.Rngs(0))
  >>> layer(jnp.ones((2, 5, 3))).shape, layer.kernel[...].shape
  ((2, 5, 4), (3, 4))
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from fp8_linen.core.owg import frozen_quantizers
from fp8_linen.families import dispatch, modes
from fp8_linen.families.table import check_recipe
from fp8_linen.nnx.access import NnxAccess, declare
from fp8_linen.product_report import MARKERS
from fp8_linen.recipes.fp8 import Fp8Recipe

__all__ = ["Linear", "LinearGeneral", "Einsum", "Conv", "Fp8Einsum"]

# The layer whose __call__ is running, read by the injected product functions
# (module-level functions keep the layers' static attributes hashable).
_RUNNING: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_nnx_layer", default=None)


@contextlib.contextmanager
def _running(layer):
  """``layer``'s products run on its state (frozen under ``use_running_average``).

  A served layer (its static ``serving`` marker, set by ``fl.nnx.convert``)
  runs them in ``'serve'`` mode.
  """
  token = _RUNNING.set(layer)
  try:
    with contextlib.ExitStack() as stack:
      # False leaves an enclosing fl.frozen_quantizers() block in force.
      if layer.use_running_average:
        stack.enter_context(frozen_quantizers())
      if getattr(layer, "serving", None) is not None:
        stack.enter_context(modes.mode("serve"))
      stack.enter_context(dispatch.kernel_params())
      yield
  finally:
    _RUNNING.reset(token)


def promote_dtype(args, /, *, dtype=None, inexact=True):
  """flax's NNX ``promote_dtype``, remembering the parameter the kernel was cast from.

  The layers' default: the product may then read a float32 kernel itself
  (:func:`~fp8_linen.families.dispatch.kernel_params`); the values are
  flax's.

  Example:
    >>> import jax.numpy as jnp
    >>> x, w, b = promote_dtype((jnp.ones(2), jnp.ones(2), None), dtype=jnp.bfloat16)
    >>> w.dtype, b
    (dtype(bfloat16), None)
  """
  out = nnx_dtypes.promote_dtype(args, dtype=dtype, inexact=inexact)
  if len(args) > 1:
    dispatch.remember_kernel_param(out[1], args[1])
  return out


def _promoting(kwargs: dict) -> dict:
  """``kwargs`` with :func:`promote_dtype` in place of flax's default (or none)."""
  if kwargs.get("promote_dtype", nnx_dtypes.promote_dtype) is nnx_dtypes.promote_dtype:
    kwargs = {**kwargs, "promote_dtype": promote_dtype}
  return kwargs


def _current(what: str):
  layer = _RUNNING.get()
  if layer is None:
    raise RuntimeError(f"fp8_linen: this {what} only runs inside its layer's __call__")
  return layer


@contextlib.contextmanager
def _reported(layer):
  """Runs the layer's product under the name scopes :func:`fp8_linen.product_report` reads.

  ``fl_path`` is the path ``fl.nnx.quantize_model`` matched the layer at.
  """
  with contextlib.ExitStack() as scopes:
    path = getattr(layer, "fl_path", None)
    if path:
      scopes.enter_context(jax.named_scope(path))
    scopes.enter_context(jax.named_scope(MARKERS["quantized"]))
    yield


def _layer_dot_general(lhs, rhs, dimension_numbers, precision=None,
                       preferred_element_type=None, out_sharding=None):
  """The ``dot_general`` a quantized layer hands to flax's forward."""
  del precision, out_sharding  # fp8 GEMMs run at DEFAULT precision; layout left to XLA.
  layer = _current("dot_general")
  with _reported(layer):
    return dispatch.dot_general(NnxAccess(layer), lhs, rhs, dimension_numbers, layer.recipe,
                                out_dtype=preferred_element_type)


def _layer_einsum(equation, lhs, rhs, precision=None, preferred_element_type=None,
                  out_sharding=None):
  """The ``einsum_op`` :class:`Einsum` hands to flax's forward."""
  del precision, out_sharding
  layer = _current("einsum")
  with _reported(layer):
    return dispatch.einsum(NnxAccess(layer), equation.replace(" ", ""), lhs, rhs, layer.recipe,
                           out_dtype=preferred_element_type or jnp.result_type(lhs, rhs))


def _layer_conv(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                precision=None, preferred_element_type=None, **unused):
  """The ``conv_general_dilated`` :class:`Conv` hands to flax's forward."""
  del precision, unused
  if batch_group_count != 1:
    raise NotImplementedError("quantized convolutions do not support batch_group_count != 1")
  layer = _current("convolution")
  kw = dict(window_strides=window_strides, padding=padding, lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
            feature_group_count=feature_group_count)
  with _reported(layer):
    return dispatch.conv(NnxAccess(layer), lhs, rhs, kw, layer.recipe,
                         out_dtype=preferred_element_type or jnp.result_type(lhs, rhs))


def _no_override(owner: str, kwargs: dict, *names: str) -> None:
  for name in names:
    if kwargs.get(name) is not None:
      raise ValueError(f"{owner} brings its own quantized {name}; leave {name} unset")


def _check_floating(owner: str, inputs):
  inputs = jnp.asarray(inputs)
  if not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise TypeError(f"{owner}: inputs must be a floating array, got dtype {inputs.dtype}")
  return inputs


class Linear(nnx.Linear):
  """Drop-in for ``nnx.Linear`` whose matmul is quantized (fp8 by default).

  Same arguments and ``nnx.Param`` s (``kernel``, ``bias``) as ``nnx.Linear``;
  the state is added as :class:`~fp8_linen.nnx.QuantState`. Every recipe works:
  fp8 (delayed, current, row-wise, MX) and integer (STE, LSQ, LSQ+; LSQ adds
  ``input_step``/``kernel_step`` params — :func:`~fp8_linen.nnx.calibrate`
  initialises the activation's from data).

  Args:
    in_features: input features.
    out_features: output features.
    recipe: an :class:`~fp8_linen.Fp8Recipe` (default) or
      :class:`~fp8_linen.IntRecipe`.
    use_running_average: quantize with the recorded state only (frozen
      quantizers, as served; ``model.eval()`` sets it).
    rngs: the ``nnx.Rngs``.
    **kwargs: ``nnx.Linear``'s other arguments (not ``dot_general``).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> layer = fl.nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 5))).shape
    (2, 3)
  """

  def __init__(self, in_features: int, out_features: int, *, recipe: Any = Fp8Recipe(),
               use_running_average: bool = False, rngs: nnx.Rngs, **kwargs):
    _no_override("Linear", kwargs, "dot_general")
    check_recipe("Linear", recipe)
    super().__init__(in_features, out_features, dot_general=_layer_dot_general, rngs=rngs,
                     **_promoting(kwargs))
    self.recipe = recipe
    self.use_running_average = use_running_average
    declare(self, recipe, self.kernel[...], (0,))

  def __call__(self, inputs, *args, **kwargs):
    inputs = _check_floating("Linear", inputs)
    with _running(self):
      return super().__call__(inputs, *args, **kwargs)


class LinearGeneral(nnx.LinearGeneral):
  """Drop-in for ``nnx.LinearGeneral`` whose product is quantized.

  Same arguments (``in_features``, ``out_features``, ``axis``, ``batch_axis``)
  and ``nnx.Param`` s as ``nnx.LinearGeneral``; every recipe works.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> layer = fl.nnx.LinearGeneral(5, (2, 3), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 5))).shape, layer.kernel[...].shape
    ((4, 2, 3), (5, 2, 3))
  """

  def __init__(self, in_features, out_features, *, recipe: Any = Fp8Recipe(),
               use_running_average: bool = False, rngs: nnx.Rngs, **kwargs):
    _no_override("LinearGeneral", kwargs, "dot_general", "dot_general_cls")
    check_recipe("LinearGeneral", recipe)
    super().__init__(in_features, out_features, dot_general=_layer_dot_general, rngs=rngs,
                     **_promoting(kwargs))
    self.recipe = recipe
    self.use_running_average = use_running_average
    n_batch = len(self.batch_axis)
    n_in = len(self.in_features)
    declare(self, recipe, self.kernel[...], tuple(range(n_batch, n_batch + n_in)))

  def __call__(self, inputs, *args, **kwargs):
    inputs = _check_floating("LinearGeneral", inputs)
    with _running(self):
      return super().__call__(inputs, *args, **kwargs)


class Einsum(nnx.Einsum):
  """Drop-in for ``nnx.Einsum`` whose product is quantized.

  Same arguments and ``nnx.Param`` s as ``nnx.Einsum``; the equation is
  lowered to one ``dot_general`` (the input is the ``input`` role, the kernel
  the ``kernel`` role). Every recipe works. A learned (LSQ/LSQ+) weight
  quantizer's ``kernel_step`` has the shape ``fl.QEinsum`` gives it for the
  same equation and kernel: one step per kernel axis that the product does
  not contract (for an input that does not broadcast against the kernel).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> layer = fl.nnx.Einsum('bd,dhk->bhk', (4, 2, 3), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((5, 4))).shape
    (5, 2, 3)
  """

  def __init__(self, einsum_str: str, kernel_shape, bias_shape=None, *,
               recipe: Any = Fp8Recipe(), use_running_average: bool = False,
               rngs: nnx.Rngs, **kwargs):
    _no_override("Einsum", kwargs, "einsum_op")
    check_recipe("Einsum", recipe)
    super().__init__(einsum_str, kernel_shape, bias_shape, einsum_op=_layer_einsum, rngs=rngs,
                     **_promoting(kwargs))
    self.recipe = recipe
    self.use_running_average = use_running_average
    # Declared from the kernel as the lowered product sees it (LSQ weight steps take its shape).
    declare(self, recipe, *dispatch.einsum_kernel(self.einsum_str.replace(" ", ""),
                                                  self.kernel[...]))

  def __call__(self, inputs, *args, **kwargs):
    inputs = _check_floating("Einsum", inputs)
    with _running(self):
      return super().__call__(inputs, *args, **kwargs)


class Conv(nnx.Conv):
  """Drop-in for ``nnx.Conv`` whose convolution is quantized.

  Same arguments (kernel sizes, strides, paddings incl. ``'CAUSAL'``,
  dilations, ``feature_group_count``) and ``nnx.Param`` s as ``nnx.Conv``.
  fp8 recipes need ``granularity='tensor'``; integer recipes (STE, LSQ, LSQ+)
  work.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> conv = fl.nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
    >>> conv(jnp.ones((1, 8, 8, 3))).shape
    (1, 8, 8, 4)
  """

  def __init__(self, in_features: int, out_features: int, kernel_size, strides=1, *,
               recipe: Any = Fp8Recipe(), use_running_average: bool = False,
               rngs: nnx.Rngs, **kwargs):
    _no_override("Conv", kwargs, "conv_general_dilated")
    check_recipe("Conv", recipe, conv=True)
    if kwargs.get("mask") is not None:
      raise NotImplementedError("Conv: masked kernels have no quantized path")
    super().__init__(in_features, out_features, kernel_size, strides,
                     conv_general_dilated=_layer_conv, rngs=rngs, **kwargs)
    self.recipe = recipe
    self.use_running_average = use_running_average
    kernel = self.kernel[...]
    # The kernel's output-feature axis is its last; every other axis is contracted.
    declare(self, recipe, kernel, tuple(range(kernel.ndim - 1)))

  def __call__(self, inputs, *args, **kwargs):
    inputs = _check_floating("Conv", inputs)
    with _running(self):
      return super().__call__(inputs, *args, **kwargs)


class Fp8Einsum(nnx.Module):
  """A quantized two-operand einsum of two activations: the NNX twin of :class:`fp8_linen.Fp8Einsum`.

  Called as flax's ``nn.Fp8Einsum`` is, ``(eqn, lhs, rhs, precision=None,
  preferred_element_type=None)``, e.g. as the ``qk_attn_weights_einsum`` /
  ``attn_weights_value_einsum`` of ``flax.linen.dot_product_attention``
  inside an NNX module's ``__call__``. ``lhs`` is the ``input`` role and
  ``rhs`` the ``kernel`` role; ``lhs`` is cast to ``rhs``'s dtype, as flax
  does. The state is :class:`~fp8_linen.nnx.QuantState` under the Linen
  names (``input_scale``, ``input_amax_history``, ...), declared here, so
  it trains with :class:`~fp8_linen.nnx.Optimizer` like every NNX layer.

  Every recipe whose state can be declared before the first call works: fp8
  (delayed, current, row-wise, MX) and integer with an STE kernel quantizer
  (an LSQ/LSQ+ *input* step is a ``(1,)`` placeholder that
  :func:`~fp8_linen.nnx.calibrate` initialises). A learned (LSQ/LSQ+)
  *kernel* quantizer's step has the shape of ``rhs``, unknown until the first
  call, and is refused with a ``ValueError``.

  Args:
    recipe: an :class:`~fp8_linen.Fp8Recipe` (default) or
      :class:`~fp8_linen.IntRecipe`.
    use_running_average: quantize with the recorded state only (frozen
      quantizers; ``model.eval()`` sets it).

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> qk = fl.nnx.Fp8Einsum()
    >>> qk('bqhd,bkhd->bhqk', jnp.ones((1, 3, 2, 4)), jnp.ones((1, 5, 2, 4))).shape
    (1, 2, 3, 5)
  """

  def __init__(self, *, recipe: Any = Fp8Recipe(), use_running_average: bool = False):
    check_recipe("Fp8Einsum", recipe)
    self.recipe = recipe
    self.use_running_average = use_running_average
    declare(self, recipe, None, None)

  def __call__(self, eqn: str, lhs, rhs, precision=None, preferred_element_type=None):
    del precision  # fp8 GEMMs run at DEFAULT precision (fast accumulation).
    if not isinstance(eqn, str):
      raise TypeError(f"Fp8Einsum: eqn={eqn!r} must be an einsum equation string")
    rhs = _check_floating("Fp8Einsum (rhs)", rhs)
    lhs = _check_floating("Fp8Einsum (lhs)", lhs).astype(rhs.dtype)
    with _running(self):
      return dispatch.einsum(NnxAccess(self), eqn.replace(" ", ""), lhs, rhs, self.recipe,
                             out_dtype=preferred_element_type or rhs.dtype)
