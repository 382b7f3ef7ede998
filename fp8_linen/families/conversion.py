"""What ``fl.convert`` (Linen) and ``fl.nnx.convert`` share.

Both run the model once, traced, in ``'convert'`` mode
(:mod:`~fp8_linen.families.modes`): every product records a
:class:`~fp8_linen.core.serve.ServedRecord` through its layer's
:class:`~fp8_linen.families.VariableAccess`, and each API puts the served
arrays (:func:`~fp8_linen.core.serve.served_from_record`) in place of the
layer's QAT variables.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fp8_linen.families import conversion
  >>> conversion.trace_once(lambda s, x, n=1: (s * x).sum() * n, 2.0,
  ...                       (jax.ShapeDtypeStruct((3,), jnp.float32),), {'n': 4})
  Array(0., dtype=float32)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TRAINING_ONLY", "is_example_array", "trace_once"]

# Learned quantizer values of QAT: replaced by the served arrays.
TRAINING_ONLY = ("input_step", "input_offset", "kernel_step", "kernel_offset")


def is_example_array(x) -> bool:
  """Whether an example input is an array (traced) rather than a static argument."""
  return (isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or
          hasattr(x, "__array__"))


def trace_once(fn: Callable, state: Any, args: tuple, kwargs: dict):
  """``fn(state, *args, **kwargs)`` run once under ``jax.jit``, every example array as zeros.

  Only the example arrays' shapes and dtypes matter (they may be
  ``jax.ShapeDtypeStruct`` s); other arguments are passed as they are.
  ``state`` (the model's variables) is a jit argument.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_example_array)
  traced = [i for i, leaf in enumerate(leaves) if is_example_array(leaf)]

  def run(state, arrays):
    full = list(leaves)
    for i, a in zip(traced, arrays):
      full[i] = a
    a, k = jax.tree.unflatten(treedef, full)
    return fn(state, *a, **k)

  examples = [jnp.zeros(jnp.shape(leaves[i]), leaves[i].dtype) for i in traced]
  return jax.jit(run)(state, examples)
