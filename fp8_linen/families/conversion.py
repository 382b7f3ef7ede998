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

from fp8_linen.families import lora, modes

__all__ = ["TRAINING_ONLY", "is_example_array", "finds_weights", "traced", "trace_once"]

# Learned quantizer values of QAT: replaced by the served arrays.
TRAINING_ONLY = ("input_step", "input_offset", "kernel_step", "kernel_offset")


def finds_weights() -> bool:
  """Whether a product in a module's own code looks for its weight among the module's.

  A conversion does (it then checks the weight's other uses before storing
  it as codes), a calibration too (GPTQ rewrites the weight it found, after
  the same check), and so does a LoRA merge, which writes the merged weight
  back in its place; training leaves the operand as it is.
  """
  return modes.current_mode() in ("convert", "calibrate") or lora.phase() == "merge"


def is_example_array(x) -> bool:
  """Whether an example input is an array (traced) rather than a static argument."""
  return (isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or
          hasattr(x, "__array__"))


def traced(fn: Callable, args: tuple, kwargs: dict) -> tuple:
  """``(run, examples)``: ``run(state, examples)`` is ``fn(state, *args, **kwargs)``.

  Every example array of ``args`` / ``kwargs`` becomes an argument of ``run``
  (``examples`` holds zeros of its shape and dtype; it may be a
  ``jax.ShapeDtypeStruct``); other arguments are passed as they are.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_example_array)
  at = [i for i, leaf in enumerate(leaves) if is_example_array(leaf)]

  def run(state, arrays):
    full = list(leaves)
    for i, a in zip(at, arrays):
      full[i] = a
    a, k = jax.tree.unflatten(treedef, full)
    return fn(state, *a, **k)

  return run, [jnp.zeros(jnp.shape(leaves[i]), leaves[i].dtype) for i in at]


def trace_once(fn: Callable, state: Any, args: tuple, kwargs: dict):
  """``fn(state, *args, **kwargs)`` run once under ``jax.jit``, every example array as zeros.

  Only the example arrays' shapes and dtypes matter (they may be
  ``jax.ShapeDtypeStruct`` s); other arguments are passed as they are.
  ``state`` (the model's variables) is a jit argument.
  """
  run, examples = traced(fn, args, kwargs)
  return jax.jit(run)(state, examples)
