"""Randomness of the block recipes: stochastic-rounding noise and the random Hadamard rotation.

Both are reproducible from what a step already holds, so every device of a
mesh and every recompute (remat) draws the same values:

* :func:`uniform_noise` gives the uniform [0, 1) values NVFP4's stochastic
  rounding compares against
  (:func:`~fp8_linen.core.block_numerics.stochastic_round_e2m1`), from a seed
  that :func:`bits_seed` takes from the bits of a role's state (it changes
  every step and is the same on every device);
* :func:`random_hadamard` rotates groups of the contracted axis by a fixed
  random orthogonal matrix (its signs from :func:`hadamard_signs`) before
  NVFP4's weight-gradient GEMM quantizes them, spreading outliers.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import randomness
  >>> u = randomness.uniform_noise((2, 3), randomness.bits_seed(jnp.ones((1,))), salt=1)
  >>> u.shape, bool(((u >= 0) & (u < 1)).all())
  ((2, 3), True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

__all__ = ["bits_seed", "uniform_noise", "hadamard_signs", "random_hadamard"]


def bits_seed(*arrays) -> jnp.ndarray:
  """A uint32 seed: the wrapping sum of the arrays' float32 bit patterns.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import randomness
    >>> int(randomness.bits_seed(jnp.ones((1,)), jnp.zeros((3,))))
    1065353216
  """
  total = jnp.zeros((), jnp.uint32)
  for a in arrays:
    bits = lax.bitcast_convert_type(jnp.asarray(a, jnp.float32), jnp.uint32)
    total = total + jnp.sum(bits, dtype=jnp.uint32)
  return total


def uniform_noise(shape, seed, salt: int) -> jnp.ndarray:
  """Uniform [0, 1) float32 values of ``shape`` from ``seed`` (uint32 scalar) and ``salt``.

  The bits come from ``jax.random`` (threefry, partitionable: the value at
  each index does not depend on how the array is sharded).
  """
  key = jax.random.fold_in(jax.random.key(seed), salt)
  r = jax.random.bits(key, tuple(shape), jnp.uint32)
  return (r >> 8).astype(jnp.float32) * (2.0 ** -24)


def hadamard_signs(size: int) -> np.ndarray:
  """The fixed random ±1 signs of the size-``size`` random Hadamard transform."""
  rng = np.random.default_rng(0x5EED + size)
  return np.where(rng.random(size) < 0.5, -1.0, 1.0).astype(np.float32)


def random_hadamard(x: jnp.ndarray, size: int) -> jnp.ndarray:
  """``x`` times a random orthogonal ``H D / sqrt(size)`` per group of ``size`` along its last axis.

  ``D`` flips signs (:func:`hadamard_signs`), ``H`` is the Sylvester Hadamard
  matrix, applied as a butterfly of additions (no GEMM for XLA to count). The
  transform is orthogonal, so transforming both operands of a product along
  the contracted axis leaves the product unchanged while spreading each
  group's outliers over the group (what makes them quantize well). A trailing
  group shorter than ``size`` is left as it is (also orthogonal, and the
  same on both operands). Runs in float32.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import randomness
    >>> y = randomness.random_hadamard(jnp.array([[4.0, 0.0, 0.0, 0.0]]), 4)
    >>> [abs(v) for v in y[0].tolist()], float(jnp.sum(y ** 2))
    ([2.0, 2.0, 2.0, 2.0], 16.0)
  """
  x = jnp.asarray(x, jnp.float32)
  n = x.shape[-1]
  full = n - n % size
  if full == 0:
    return x
  lead = x.shape[:-1]
  h = x[..., :full].reshape(*lead, full // size, size) * jnp.asarray(hadamard_signs(size))
  step = 1
  while step < size:
    h = h.reshape(*lead, full // size, size // (2 * step), 2, step)
    a, b = h[..., 0, :], h[..., 1, :]
    h = jnp.stack([a + b, a - b], axis=-2)
    step *= 2
  h = h.reshape(*lead, full) * np.float32(1.0 / np.sqrt(size))
  return h if full == n else jnp.concatenate([h, x[..., full:]], axis=-1)
