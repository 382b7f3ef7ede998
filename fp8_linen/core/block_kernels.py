"""Pallas kernels of the block formats: an operand read once, both code layouts written.

Each tensor of a block-scaled training step feeds two GEMMs that contract
different axes (the input: the forward along K, wgrad along M), so it is
quantized twice, in blocks along each axis. XLA computes each copy's block
amaxes and codes in passes of their own and reads the tensor for each
(DESIGN.md 3c). :func:`mx_codes_both` does it in one Pallas kernel: every
tile of ``t`` (B, P, Q) is read once and yields

* its codes blocked along Q, in ``t``'s layout, with their scales;
* its codes blocked along P, transposed to (B, Q, P), with their scales;
* its amax (one value per tile; their max is the tensor's).

Codes and scales are those of :func:`~fp8_linen.core.block_numerics.block_quantize`
on ``t`` and on its transpose, bit for bit: the kernel runs the same
functions (:func:`~fp8_linen.core.block_numerics.block_amax`,
:func:`~fp8_linen.core.block_numerics.mx_scale`) on its tile. One choice is
its own: a NaN element makes every block holding it NaN codes (it is read as
Inf), where the reference leaves that to the backend's max-reduction.

When the kernels run (:func:`pallas_kernels`, part of every jit key):

* ``'auto'`` (default): on a GPU that multiplies block-scaled GEMMs (the
  traced-for backend: :func:`~fp8_linen.core.lowering.target_backend`),
  compiled by Triton, for tensors of whole tiles, on one device or inside
  ``shard_map`` (a Pallas call has no partitioning rule: under ``jit``
  over a mesh XLA would gather the operand, so there the ``jnp`` path runs);
* ``'off'``: never (the ``jnp`` path, which is also the reference);
* ``'interpret'``: wherever a tensor qualifies, in Pallas' interpreter (any
  backend: how tests check the kernel against the reference on a CPU), except
  on ``shard_map``'s varying values, which the interpreter rejects.

MXFP8 only (fp8 elements, power-of-two scales). NVFP4's per-tensor factor
needs the tensor's amax before its codes, and its wgrad copies are rotated
and stochastically rounded: they keep the ``jnp`` path.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import block_kernels
  >>> with block_kernels.pallas_kernels('interpret'):
  ...   (q, s), (qt, st), a = block_kernels.mx_codes_both(
  ...       jnp.ones((1, 64, 64)), jnp.float8_e4m3fn, 32)
  >>> q.shape, s.shape, qt.shape, st.shape, float(a)
  ((1, 64, 64), (1, 64, 2), (1, 64, 64), (1, 64, 2), 1.0)
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp8_linen.core import block_numerics, lowering, settings
from fp8_linen.core.numerics import fp8_max, saturate_measured

__all__ = ["MODES", "pallas_kernels", "kernel_mode", "tile_sizes", "mx_codes_both"]

MODES = ("auto", "off", "interpret")
"""The values of :func:`pallas_kernels`."""

_MODE = settings.TraceSetting("pallas_kernels", default="auto")

# Tile edges tried, largest first: a tile is read once and both its layouts
# are written from registers, so bigger tiles mean fewer, longer rows of
# memory traffic. Triton wants powers of two.
_TILES = (128, 64, 32)


@contextlib.contextmanager
def pallas_kernels(mode: str):
  """Chooses where the library's Pallas kernels run while tracing (see the module doc).

  Args:
    mode: ``'auto'`` (the default), ``'off'`` or ``'interpret'``.

  Example:
    >>> import fp8_linen as fl
    >>> with fl.pallas_kernels('off'):
    ...   pass  # block recipes quantize with jnp only
  """
  if mode not in MODES:
    raise ValueError(f"pallas_kernels: mode={mode!r} must be one of {MODES}")
  with _MODE.set(mode):
    yield


def tile_sizes(p: int, q: int, block_size: int) -> tuple[int, int] | None:
  """The kernel's tile (rows, columns) for a (P, Q) tensor, or None when none fits.

  Each edge is the largest of 128, 64, 32 that divides it and is a multiple
  of ``block_size`` (a power of two).
  """
  if block_size <= 0 or block_size & (block_size - 1):
    return None
  pick = lambda n: next((t for t in _TILES if n % t == 0 and t % block_size == 0), None)
  tp, tq = pick(p), pick(q)
  return None if tp is None or tq is None else (tp, tq)


def _per_device(t) -> bool:
  """Whether ``t`` is one device's whole array.

  Inside ``shard_map`` (every mesh axis manual, or ``t`` varying over one),
  on a one-device mesh (``jax.set_mesh``), or with no mesh set when JAX has
  one device. Under ``jit`` over several devices XLA chooses the shardings
  after tracing, and a Pallas call has no rule to split by them.
  """
  if lowering.varying_axes(t):
    return True
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return jax.device_count() == 1
  return mesh.size == 1 or all(a == jax.sharding.AxisType.Manual for a in mesh.axis_types)


def kernel_mode(t, block_size: int, *, gemm: str) -> str | None:
  """``'compiled'``, ``'interpret'`` or None: how :func:`mx_codes_both` would run on ``t`` now.

  Args:
    t: the tensor, (B, P, Q).
    block_size: elements per block.
    gemm: the product's resolved GEMM form (``'block'``: block-scaled GEMMs).
  """
  mode = _MODE.get()
  if mode == "off" or t.ndim != 3 or tile_sizes(t.shape[1], t.shape[2], block_size) is None:
    return None
  if mode == "interpret":
    # Pallas' interpreter rejects a kernel on shard_map's varying values
    # (its constants vary over no axis); compiled kernels run there.
    return None if lowering.varying_axes(t) else "interpret"
  if gemm == "block" and lowering.current_backend() == "gpu" and _per_device(t):
    return "compiled"
  return None


def _mx_tile(x_ref, q_ref, qt_ref, s_ref, st_ref, a_ref, *, bs: int, dtype):
  """One (tp, tq) tile: codes and e8m0 scale bits along each axis, and its amax."""
  # NaN is read as Inf: whether a max-reduction keeps a NaN differs between
  # Triton, XLA:GPU and XLA:CPU, and an Inf always makes its blocks NaN codes.
  x = x_ref[...].astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), jnp.inf, x)
  tp, tq = x.shape
  m = fp8_max(dtype)
  rows = x.reshape(tp, tq // bs, bs)
  a_r = block_numerics.block_amax(rows, 2)                 # (tp, tq / bs, 1)
  s_r, e_r = block_numerics.mx_scale(a_r, m)
  q_ref[...] = saturate_measured(rows, s_r, m, a_r).reshape(tp, tq).astype(dtype)
  s_ref[...] = (e_r[:, :, 0] + 127).astype(jnp.uint8)
  cols = x.reshape(tp // bs, bs, tq)
  a_c = block_numerics.block_amax(cols, 1)                 # (tp / bs, 1, tq)
  s_c, e_c = block_numerics.mx_scale(a_c, m)
  qt_ref[...] = saturate_measured(cols, s_c, m, a_c).reshape(tp, tq).T.astype(dtype)
  st_ref[...] = (e_c[:, 0, :] + 127).astype(jnp.uint8).T
  a_ref[...] = jnp.full(a_ref.shape, jnp.max(a_r), jnp.float32)


def mx_codes_both(t: jnp.ndarray, dtype, block_size: int):
  """MX codes of ``t`` (B, P, Q) in blocks along Q and along P, from one read.

  Args:
    t: the tensor; P and Q whole tiles (:func:`tile_sizes`).
    dtype: the fp8 element dtype.
    block_size: elements per block (a power of two).

  Returns:
    ``((q, s), (qt, st), amax)``: ``q`` (B, P, Q) blocked along Q with ``s``
    (B, P, Q / block); ``qt`` (B, Q, P) blocked along P with ``st``
    (B, Q, P / block), scales ``float8_e8m0fnu``; ``amax`` the float32
    ``max(|t|)`` (``inf`` when ``t`` holds NaN or Inf). Bit-identical to
    ``block_quantize(t', ...)`` and ``block_quantize(swapaxes(t', 1, 2), ...)``
    with ``t'`` = ``t`` with its NaNs made Inf.
  """
  b, p, q = t.shape
  tiles = tile_sizes(p, q, block_size)
  if tiles is None:
    raise ValueError(f"mx_codes_both: a ({p}, {q}) tensor is not whole tiles of "
                     f"{_TILES} for blocks of {block_size}")
  tp, tq = tiles
  interpret = kernel_mode(t, block_size, gemm="block") == "interpret"
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    params = {"compiler_params": pl_triton.CompilerParams(num_warps=4, num_stages=1)}
  bs = block_size
  grid = (b, p // tp, q // tq)
  # Inside shard_map the results vary over the mesh axes ``t`` varies over.
  sds = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=getattr(jax.typeof(t), "mat", None))
  spec = lambda shape, order: pl.BlockSpec(
      (None,) + shape, lambda i, j, k: (i,) + ((j, k) if order else (k, j)))
  out = pl.pallas_call(
      functools.partial(_mx_tile, bs=bs, dtype=dtype),
      grid=grid,
      in_specs=[spec((tp, tq), True)],
      out_specs=[spec((tp, tq), True), spec((tq, tp), False),
                 spec((tp, tq // bs), True), spec((tq, tp // bs), False),
                 spec((1, 1), True)],
      # The amax partials last: a trailing byte array of a custom call reads
      # as a library's scratch space to the pass counter.
      out_shape=[sds((b, p, q), dtype), sds((b, q, p), dtype),
                 sds((b, p, q // bs), jnp.uint8), sds((b, q, p // bs), jnp.uint8),
                 sds((b, p // tp, q // tq), jnp.float32)],
      interpret=interpret, name="mx_codes_both", **params)(t)
  codes, codes_t, bits, bits_t, partial = out
  e8m0 = lambda u: lax.bitcast_convert_type(u, jnp.float8_e8m0fnu)
  return (codes, e8m0(bits)), (codes_t, e8m0(bits_t)), jnp.max(partial)
