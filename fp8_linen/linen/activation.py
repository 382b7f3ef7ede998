"""An fp8 activation quantizer: keep activations in fp8 for the backward pass.

:class:`Fp8Activation` passes a tensor through the quantize/dequantize
pair: forward ``x -> x_fp8`` (e4m3, scale from the module's ``input`` state)
``-> x_fp8 * s``; backward: the incoming gradient is quantized to e5m2 (scale
from the ``output_grad`` state), its scale travels back through the dummy
``scale_out`` cotangent and the gradient is dequantized with exactly that scale.

The fp8 copy is named :data:`fp8_linen.CHECKPOINT_NAME` with
``jax.ad_checkpoint.checkpoint_name``. Under ``nn.remat`` with
``jax.checkpoint_policies.save_only_these_names(fp8_linen.CHECKPOINT_NAME)``
only the fp8 copies (1 byte per element, half of bfloat16) are kept between
the forward and the backward pass; everything after the quantizer is
recomputed from them.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> q = fl.Fp8Activation()
  >>> y, v = q.init_with_output(jax.random.key(0), jnp.array([1.0, -2.0, 448.0]))
  >>> y.tolist(), sorted(v[fl.OWG])[:2]
  ([1.0, -2.0, 448.0], ['input_amax_history', 'input_scale'])
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from fp8_linen.core.owg import CHECKPOINT_NAME
from fp8_linen.families import fp8
from fp8_linen.families.table import recipe_error
from fp8_linen.linen.access import LinenAccess
from fp8_linen.recipes.fp8 import ActivationRecipe

__all__ = ["Fp8Activation", "fp8_activation"]


def fp8_activation(module: nn.Module, x, recipe: ActivationRecipe | None = None,
                   name: str = CHECKPOINT_NAME):
  """Quantizes ``x`` through fp8 with ``module``'s ``input``/``output_grad`` state.

  Uses of one module in a step are linked per role
  (:func:`fp8_linen.families.fp8.activation`), so the recorded amax is the max
  over them.

  Args:
    module: the Linen module that owns the state.
    x: floating array.
    recipe: an :class:`ActivationRecipe` (default e4m3 / e5m2, delayed).
    name: the ``checkpoint_name`` given to the fp8 copy.

  Returns:
    ``x`` after the fp8 round trip, in ``x``'s dtype.
  """
  recipe = ActivationRecipe() if recipe is None else recipe
  if not isinstance(recipe, ActivationRecipe):
    raise recipe_error(type(module).__name__, recipe, "ActivationRecipe",
                       "fl.ActivationRecipe()", for_activation=True)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"Fp8Activation: x must be a floating array, got dtype {x.dtype}")
  return fp8.activation(LinenAccess(module), x, recipe, name)


class Fp8Activation(nn.Module):
  """Stores an activation in fp8: e4m3 forward, e5m2 gradient.

  Put it where an activation is kept for the backward pass (before a layer,
  at the boundary of an ``nn.remat`` block) and use
  ``jax.checkpoint_policies.save_only_these_names(fp8_linen.CHECKPOINT_NAME)``
  as the remat policy: the saved residual is the fp8 copy, half the bytes of
  bfloat16. The state (``input_*``, ``output_grad_*``) lives in the
  :data:`~fp8_linen.OWG` collection.

  Attributes:
    recipe: an :class:`ActivationRecipe`.
    checkpoint_name: the name given to the fp8 copy.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> q = fl.Fp8Activation()
    >>> v = q.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> g = jax.grad(lambda v, x: (1000.0 * q.apply(v, x)).sum(), argnums=(0, 1))(
    ...     v, jnp.ones((2, 3)))
    >>> g[1].tolist()[0]
    [1000.0, 1000.0, 1000.0]
  """

  recipe: ActivationRecipe = ActivationRecipe()
  checkpoint_name: str = CHECKPOINT_NAME

  @nn.compact
  def __call__(self, x):
    return fp8_activation(self, x, self.recipe, self.checkpoint_name)
