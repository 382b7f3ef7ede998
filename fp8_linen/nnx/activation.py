"""An fp8 activation quantizer for NNX: keep activations in fp8 for the backward pass.

:class:`Quantizer` runs the core ``quantize``/``dequantize`` pair (the very
quantizer of the Linen ``fl.Fp8Activation``,
:func:`fp8_linen.families.fp8.activation`): forward
``x -> x_fp8`` (e4m3, scale from ``input_*``) ``-> x_fp8 * s``; backward: the
incoming gradient is quantized to e5m2 (scale from ``output_grad_*``) and
dequantized with exactly the scale it was quantized with. The new state of
both roles leaves the step as the gradient of its :class:`QuantState`
variables (nothing is written during the step). The fp8 copy is named
:data:`fp8_linen.CHECKPOINT_NAME`, so under ``nnx.remat`` with
``jax.checkpoint_policies.save_only_these_names(fp8_linen.CHECKPOINT_NAME)``
only the fp8 copies are saved.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> q = fl.nnx.Quantizer()
  >>> q(jnp.array([1.0, -2.0, 448.0])).tolist()
  [1.0, -2.0, 448.0]
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
from flax import nnx

from fp8_linen.core.owg import CHECKPOINT_NAME, frozen_quantizers
from fp8_linen.families import fp8
from fp8_linen.nnx.access import NnxAccess
from fp8_linen.recipes.fp8 import ActivationRecipe

__all__ = ["Quantizer"]


class Quantizer(nnx.Module):
  """Stores an activation in fp8: e4m3 forward, e5m2 gradient.

  Args:
    recipe: an :class:`~fp8_linen.ActivationRecipe` (default e4m3 / e5m2,
      delayed scaling).
    checkpoint_name: the ``checkpoint_name`` of the fp8 copy.
    use_running_average: quantize with the recorded state only and leave it
      unchanged (:func:`~fp8_linen.frozen_quantizers`; ``model.eval()`` sets
      it).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> q = fl.nnx.Quantizer()
    >>> grads, dx = nnx.grad(lambda q, x: (1000.0 * q(x)).sum(), argnums=(
    ...     nnx.DiffState(0, fl.nnx.QuantState), 1))(q, jnp.array([5.0]))
    >>> dx.tolist(), grads['output_grad_amax_history'][...][0].tolist()
    ([1000.0], 1000.0)
  """

  def __init__(self, recipe: ActivationRecipe | None = None, *,
               checkpoint_name: str = CHECKPOINT_NAME, use_running_average: bool = False):
    recipe = ActivationRecipe() if recipe is None else recipe
    if not isinstance(recipe, ActivationRecipe):
      hint = " (call it: the function returns the recipe)" if callable(recipe) else ""
      raise TypeError(f"Quantizer: recipe must be an ActivationRecipe, got {recipe!r}{hint}")
    self.recipe = recipe
    self.checkpoint_name = checkpoint_name
    self.use_running_average = use_running_average
    fp8.declare_activation(NnxAccess(self, declaring=True), recipe)

  def __call__(self, x):
    with frozen_quantizers() if self.use_running_average else contextlib.nullcontext():
      return self._quantize(x)

  def _quantize(self, x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"Quantizer: x must be a floating array, got dtype {x.dtype}")
    return fp8.activation(NnxAccess(self), x, self.recipe, self.checkpoint_name)
