"""Randomness of the recipes: stochastic-rounding noise and the random Hadamard rotation.

Both are reproducible from what a step already holds, so every device of a
mesh and every recompute (remat) draws the same values:

* :func:`uniform_noise` gives the uniform [0, 1) values stochastic rounding
  compares against (NVFP4's gradient,
  :func:`~fp8_linen.core.block_numerics.stochastic_round_e2m1`, and integer
  gradient codes), from a seed that :func:`bits_seed` takes from the bits of
  state the step holds (it changes every step and is the same on every
  device); the bits are a hash of each element's index, fused into the
  rounding that reads them;
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

import jax.numpy as jnp
from jax import lax
import numpy as np

__all__ = ["bits_seed", "noise_key", "noise_from_index", "uniform_noise", "hadamard_signs",
           "hadamard_matrix", "group_sum", "random_hadamard"]


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


_GOLDEN = np.uint32(0x9E3779B9)


def _mix32(x: jnp.ndarray) -> jnp.ndarray:
  """A bijective 32-bit integer hash with full avalanche (xor-shift-multiply rounds)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def noise_key(seed, salt: int) -> jnp.ndarray:
  """The uint32 key :func:`uniform_noise` hashes indices with, from ``seed`` and ``salt``."""
  return _mix32(jnp.asarray(seed, jnp.uint32) ^ _mix32(jnp.uint32(salt) * _GOLDEN))


def noise_from_index(idx: jnp.ndarray, key) -> jnp.ndarray:
  """:func:`uniform_noise`'s value at flat indices ``idx`` (uint32) under ``key`` (:func:`noise_key`).

  What a kernel that quantizes a tile computes for its own elements.
  """
  r = _mix32(idx * _GOLDEN + key)
  return (r >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0 ** -24)


def uniform_noise(shape, seed, salt: int) -> jnp.ndarray:
  """Uniform [0, 1) float32 values of ``shape`` from ``seed`` (uint32 scalar) and ``salt``.

  Counter-based: each element hashes its own flat index with a key made of
  ``seed`` and ``salt``, in elementwise integer ops on an ``iota``. So the
  bits are made where they are used: XLA fuses them into the consumer (the
  rounding), no random tensor is written to memory and no generator kernel
  runs, and the value at an index does not depend on how the array is
  sharded (each device hashes its part of the global index). For a fixed key
  the map from index to bits is a bijection: the values of one tensor (below
  2**32 elements) never repeat. 24 bits per value.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import randomness
    >>> u = randomness.uniform_noise((4, 4), jnp.uint32(7), salt=1)
    >>> bool(((u >= 0) & (u < 1)).all()), len(set(u.ravel().tolist()))
    (True, 16)
  """
  shape = tuple(int(d) for d in shape)
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    idx = idx + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
    stride *= shape[axis]
  return noise_from_index(idx, noise_key(seed, salt))


def hadamard_signs(size: int) -> np.ndarray:
  """The fixed random ±1 signs of the size-``size`` random Hadamard transform."""
  rng = np.random.default_rng(0x5EED + size)
  return np.where(rng.random(size) < 0.5, -1.0, 1.0).astype(np.float32)


def _sylvester(n: int) -> np.ndarray:
  """The ``n`` x ``n`` Sylvester Hadamard matrix (``n`` a power of two), entries ±1."""
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def hadamard_matrix(size: int) -> np.ndarray:
  """``H D / sqrt(size)`` of :func:`random_hadamard`, float32 (``size`` a power of two).

  Row ``i`` holds the signed weights of output ``i`` of a group.
  """
  return (_sylvester(size) * hadamard_signs(size)[None, :] / np.sqrt(size)).astype(np.float32)


def group_sum(t: jnp.ndarray) -> jnp.ndarray:
  """``t`` summed over its last axis (a power of two) as a fixed tree of pairwise adds.

  Each level adds neighbours (one addition per output), so the sum rounds
  alike on XLA:CPU, XLA:GPU and in a Pallas kernel's tile, where one 16-term
  reduction is summed in each backend's own order. Not guaranteed: XLA may
  merge the levels back into one reduction in some programs (seen under
  vmap, and on jax 0.10.0), which can change a sum's last bit.
  """
  while t.shape[-1] > 1:
    t = jnp.sum(t.reshape(*t.shape[:-1], t.shape[-1] // 2, 2), axis=-1)
  return t[..., 0]


def random_hadamard(x: jnp.ndarray, size: int) -> jnp.ndarray:
  """``x`` times a random orthogonal ``H D / sqrt(size)`` per group of ``size`` along its last axis.

  ``D`` flips signs (:func:`hadamard_signs`), ``H`` is the Sylvester Hadamard
  matrix, applied as a sum of signed terms (no GEMM for XLA to count). The
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
  # Each output is a signed sum over its group, added as a fixed pairwise tree
  # (group_sum: the same rounding here and in the NVFP4 Pallas kernel), not
  # a butterfly of slices and concatenations (four passes on XLA:GPU) and not
  # a dot (no GEMM).
  m = jnp.asarray(hadamard_matrix(size))
  g = x[..., :full].reshape(*lead, full // size, 1, size)
  h = group_sum(g * m).reshape(*lead, full)
  return h if full == n else jnp.concatenate([h, x[..., full:]], axis=-1)
