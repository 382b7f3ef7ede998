"""Pallas kernels of the block formats: an operand read once, both code layouts written.

Each tensor of a block-scaled training step feeds two GEMMs that contract
different axes (the input: the forward along K, wgrad along M), so it is
quantized twice, in blocks along each axis. XLA computes each copy's block
amaxes and codes in passes of their own and reads the tensor for each
(DESIGN.md 3c). The kernels here read each tile of ``t`` (B, P, Q) once and
write both copies:

* :func:`mx_codes_both` (MXFP8): codes blocked along Q in ``t``'s layout,
  codes blocked along P transposed to (B, Q, P), their e8m0 scales, and the
  tile's amax, in one pass;
* :func:`nvfp4_codes_both` (NVFP4): the same two copies in e2m1 with e4m3
  scales, the one along P rotated first (the wgrad operands' random
  Hadamard transform) and either rounded stochastically (the gradient).
  Each copy's per-tensor factor needs its amax before its codes, so
  :func:`nvfp4_amaxes` reads the tile once before (both amaxes: ``t``'s and
  the rotated copy's): two reads in all;
* :func:`nvfp4_tile_codes_both` (NVFP4's weight in 16 x 16 tiles): one set
  of codes, written in both layouts.

Codes and scales are those of :func:`~fp8_linen.core.block_numerics.block_quantize`
on ``t`` and on its (rotated) transpose, bit for bit: the kernels run the
same functions on their tiles (:func:`~fp8_linen.core.block_numerics.block_amax`,
:func:`~fp8_linen.core.block_numerics.mx_scale`,
:func:`~fp8_linen.core.block_numerics.e2m1_block`,
:func:`~fp8_linen.core.randomness.group_sum` for the rotation,
:func:`~fp8_linen.core.randomness.noise_from_index` for the rounding's
bits). One choice is their own: a NaN element makes every block holding it
non-finite (it is read as Inf), where the reference leaves that to the
backend's max-reduction.

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

NVFP4's 4/6 block-scale choice (``four_over_six``) keeps the ``jnp`` path.

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

import numpy as np

from fp8_linen.core import block_numerics, lowering, randomness, settings
from fp8_linen.core.numerics import fp8_max, saturate_measured

__all__ = ["MODES", "pallas_kernels", "switch_mode", "per_device", "kernel_mode", "tile_sizes",
           "mx_codes_both", "nvfp4_amaxes", "nvfp4_codes_both", "nvfp4_tile_codes_both"]

MODES = ("auto", "off", "interpret")
"""The values of :func:`pallas_kernels`."""

_MODE = settings.TraceSetting("pallas_kernels", default="auto")

# Tile edges tried, largest first: a tile is read once and both its layouts
# are written from registers, so bigger tiles mean fewer, longer rows of
# memory traffic. Triton wants powers of two.
_TILES = (128, 64, 32)

# How Triton launches each kernel: the tile (rows, columns) it prefers where
# the tensor is whole tiles of it (else the largest of _TILES that fits) and
# its warps. A tile only changes how the work is cut, never a code or scale.
# Chosen by `benchmarks/bench_kernels_gpu.py --sweep` on an H200 (TE's dense
# layer's operands): short wide tiles with 4 warps were fastest, 26-28% faster
# than 128 x 128 for MX and 19% than 32 x 32 for the NVFP4 weight tiles; the
# rotated NVFP4 kernels were fastest at 32 x 32 (their 16 x 16 products per
# group grow with the tile).
_LAUNCH = {
    "mx_codes_both": {"tile": (32, 128), "num_warps": 4},
    "nvfp4_amaxes": {"tile": (32, 32), "num_warps": 4},
    "nvfp4_codes_both": {"tile": (32, 32), "num_warps": 4},
    "nvfp4_tile_codes_both": {"tile": (32, 64), "num_warps": 4},
}


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


def switch_mode() -> str:
  """The :func:`pallas_kernels` mode in force while tracing."""
  return _MODE.get()


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


def per_device(t) -> bool:
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
  """``'compiled'``, ``'interpret'`` or None: how this module's kernels would run on ``t`` now.

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
  if gemm == "block" and lowering.current_backend() == "gpu" and per_device(t):
    return "compiled"
  return None


def _load(x_ref, round_to):
  """A tile as float32, rounded to ``round_to`` first where the caller asks.

  A layer over float32 parameters hands a kernel its weight uncast, with the
  dtype it computes in: rounding here, in registers, gives the codes of the
  rounded weight without a rounded copy written to memory and read back.
  """
  x = x_ref[...]
  if round_to is not None:
    x = x.astype(round_to)
  return x.astype(jnp.float32)


def _mx_tile(x_ref, q_ref, qt_ref, s_ref, st_ref, a_ref, *, bs: int, dtype, round_to=None):
  """One (tp, tq) tile: codes and e8m0 scale bits along each axis, and its amax."""
  # NaN is read as Inf: whether a max-reduction keeps a NaN differs between
  # Triton, XLA:GPU and XLA:CPU, and an Inf always makes its blocks NaN codes.
  x = _load(x_ref, round_to)
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


def mx_codes_both(t: jnp.ndarray, dtype, block_size: int, *, round_to=None):
  """MX codes of ``t`` (B, P, Q) in blocks along Q and along P, from one read.

  Args:
    t: the tensor; P and Q whole tiles (:func:`tile_sizes`).
    dtype: the fp8 element dtype.
    block_size: elements per block (a power of two).
    round_to: a float dtype to round ``t`` to as it is read (a float32
      weight of a bfloat16 layer), or ``None``: the codes are those of
      ``t.astype(round_to)``, which is never written.

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
  tp, tq = _preferred("mx_codes_both", p, q, tiles, block_size)
  bs = block_size
  out = _tiled_call(
      functools.partial(_mx_tile, bs=bs, dtype=dtype, round_to=round_to), t, (tp, tq),
      # The amax partials last: a trailing byte array of a custom call reads
      # as a library's scratch space to the pass counter.
      [((b, p, q), dtype, (tp, tq), False), ((b, q, p), dtype, (tq, tp), True),
       ((b, p, q // bs), jnp.uint8, (tp, tq // bs), False),
       ((b, q, p // bs), jnp.uint8, (tq, tp // bs), True),
       ((b, p // tp, q // tq), jnp.float32, (1, 1), False)], name="mx_codes_both")
  codes, codes_t, bits, bits_t, partial = out
  e8m0 = lambda u: lax.bitcast_convert_type(u, jnp.float8_e8m0fnu)
  return (codes, e8m0(bits)), (codes_t, e8m0(bits_t)), jnp.max(partial)


# --- NVFP4 -------------------------------------------------------------------
#
# Triton has no 4-bit float type, so the kernels write e2m1 codes as bytes
# holding two codes each (the first in the low nibble, as XLA packs
# ``float4_e2m1fn``) and the caller bitcasts them. A copy's per-tensor factor
# needs its amax first, and the wgrad copy is rotated before it is measured:
# :func:`nvfp4_amaxes` reads the tensor once for both amaxes,
# :func:`nvfp4_codes_both` once more for both copies' codes.

def _pack(codes):
  """(R, C) codes -> (R, C / 2) bytes, element 2i in the low nibble."""
  r, c = codes.shape
  pairs = codes.reshape(r, c // 2, 2).astype(jnp.int32)
  shift = lax.broadcasted_iota(jnp.int32, pairs.shape, 2) * 4
  return jnp.sum(pairs << shift, axis=2).astype(jnp.uint8)


def _unpack(packed):
  """Bytes (..., C / 2) from :func:`_pack` -> ``float4_e2m1fn`` (..., C)."""
  f4 = lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
  return f4.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def _hadamard_matrix(size: int) -> jnp.ndarray:
  """:func:`~fp8_linen.core.randomness.random_hadamard`'s matrix, as a kernel input."""
  return jnp.asarray(randomness.hadamard_matrix(size), jnp.float32)


def _rotated_t(x, m, size: int):
  """The tile ``x`` (tp, tq) transposed, each group of ``size`` along tp rotated by ``m``.

  The same expression as :func:`~fp8_linen.core.randomness.random_hadamard`
  on the transposed tensor (its groups along the last axis).
  """
  xt = x.T
  if not size:
    return xt
  tq, tp = xt.shape
  return randomness.group_sum(xt.reshape(tq, tp // size, 1, size) * m).reshape(tq, tp)


def _nan_as_inf(x):
  # Whether a max-reduction keeps a NaN differs between Triton, XLA:GPU and
  # XLA:CPU; an Inf always makes its block non-finite.
  return jnp.where(jnp.isnan(x), jnp.inf, x)


def _nv_amax_tile(x_ref, m_ref, a_ref, at_ref, *, size: int, round_to=None):
  x = _nan_as_inf(_load(x_ref, round_to))
  a_ref[...] = jnp.full(a_ref.shape, jnp.max(jnp.abs(x)), jnp.float32)
  at_ref[...] = jnp.full(at_ref.shape, jnp.max(jnp.abs(_rotated_t(x, m_ref[...], size))),
                         jnp.float32)


def _noise(rows, cols, rows_total: int, cols_total: int, batch, key):
  """:func:`~fp8_linen.core.randomness.uniform_noise` at a tile's elements.

  ``rows`` (R,) and ``cols`` (C,): the tile's row and column indices in the
  (batch, rows_total, cols_total) tensor, ``batch`` its batch index (uint32
  arrays): each element's flat index is hashed with ``key`` (uint32 arithmetic
  wraps as the reference's).
  """
  idx = (batch * np.uint32(rows_total * cols_total % 2**32)
         + rows[:, None] * np.uint32(cols_total % 2**32) + cols[None, :])
  return randomness.noise_from_index(idx, key)


def _nv_copy(x, g, *, bs: int, key=None, origin=None):
  """Codes (packed) and e4m3 scales of ``x`` (R, C) in 1 x ``bs`` blocks along C."""
  r, c = x.shape
  xb = x.reshape(r, 1, c // bs, bs)
  a = block_numerics.block_amax(xb, (1, 3))
  stored, _, y = block_numerics.e2m1_block(xb, a, g)
  if key is not None:
    y = block_numerics.stochastic_round_e2m1(y, _noise(*origin, key).reshape(xb.shape))
  return _pack(block_numerics.e2m1_codes(y).reshape(r, c)), stored.reshape(r, c // bs)


def _nv_codes_tile(x_ref, m_ref, f_ref, k_ref, b_ref, p_ref, q_ref_, codes_ref, codes_t_ref,
                   s_ref, st_ref, *, bs: int, size: int, noise: bool, dims, round_to=None):
  # The tile's indices come in as arrays, not from pl.program_id: under vmap
  # Pallas puts the batch axis first in the grid and the ids would shift.
  x = _nan_as_inf(_load(x_ref, round_to))
  p, q = dims
  b, rows, cols = b_ref[0], p_ref[...], q_ref_[...]
  codes_ref[...], s_ref[...] = _nv_copy(
      x, f_ref[0], bs=bs, key=k_ref[0] if noise else None, origin=(rows, cols, p, q, b))
  codes_t_ref[...], st_ref[...] = _nv_copy(
      _rotated_t(x, m_ref[...], size), f_ref[1], bs=bs, key=k_ref[1] if noise else None,
      origin=(cols, rows, q, p, b))


def _tiled_call(kernel, t, tiles, outs, extra_inputs=(), name="", indices=False):
  """A pallas_call over ``t``'s (tp, tq) tiles; ``outs``: (shape, dtype, block, transposed).

  ``extra_inputs`` reach every tile whole; ``indices``: three more inputs,
  the tile's batch index (1,), row indices (tp,) and column indices (tq,).
  """
  b, p, q = t.shape
  tp, tq = tiles
  interpret = _MODE.get() == "interpret"
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    params = {"compiler_params": pl_triton.CompilerParams(
        num_warps=_LAUNCH[name]["num_warps"], num_stages=1)}
  # Inside shard_map the results vary over the mesh axes ``t`` varies over.
  sds = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=getattr(jax.typeof(t), "mat", None))
  spec = lambda block, transposed: pl.BlockSpec(
      (None,) + block, lambda i, j, k: (i,) + ((k, j) if transposed else (j, k)))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, k: (0,) * a.ndim)
  in_specs = [spec((tp, tq), False)] + [whole(a) for a in extra_inputs]
  inputs = list(extra_inputs)
  if indices:
    iota = lambda n: lax.iota(jnp.uint32, n)
    inputs += [iota(b), iota(p), iota(q)]
    in_specs += [pl.BlockSpec((1,), lambda i, j, k: (i,)), pl.BlockSpec((tp,), lambda i, j, k: (j,)),
                 pl.BlockSpec((tq,), lambda i, j, k: (k,))]
  return pl.pallas_call(
      kernel, grid=(b, p // tp, q // tq), in_specs=in_specs,
      out_specs=[spec(block, tr) for _, _, block, tr in outs],
      out_shape=[sds(shape, dtype) for shape, dtype, _, _ in outs],
      interpret=interpret, name=name, **params)(t, *inputs)


# NVFP4's tiles are 32 x 32: its rotation multiplies each 16-group by a 16 x 16
# matrix in registers (Triton has no slices for a butterfly, and its dot would
# round through tf32), an intermediate 16 times the tile.
_NV_TILE = 32


def _preferred(name: str, p: int, q: int, fallback: tuple[int, int], block: int = 16):
  """``name``'s launch tile where a (P, Q) tensor is whole tiles of it (each edge
  whole blocks), else ``fallback``."""
  want = _LAUNCH[name]["tile"]
  fits = want and all(n % e == 0 and e % block == 0 for n, e in zip((p, q), want))
  return tuple(want) if fits else fallback


def _nv_tiles(t, name: str):
  if t.shape[1] % _NV_TILE or t.shape[2] % _NV_TILE:
    raise ValueError(f"NVFP4 kernels: a {t.shape[1:]} tensor is not whole tiles of "
                     f"{_NV_TILE} x {_NV_TILE}")
  return _preferred(name, t.shape[1], t.shape[2], (_NV_TILE, _NV_TILE))


def nvfp4_amaxes(t: jnp.ndarray, hadamard: int, *, round_to=None):
  """``(max|t|, max|H(t^T)|)`` of ``t`` (B, P, Q), from one read (``inf`` if ``t`` holds NaN).

  ``H`` rotates groups of ``hadamard`` along P
  (:func:`~fp8_linen.core.randomness.random_hadamard` of the transpose);
  ``hadamard=0``: no rotation (both amaxes are ``max|t|``). ``round_to``: as
  for :func:`mx_codes_both`.
  """
  b, p, q = t.shape
  tp, tq = _nv_tiles(t, "nvfp4_amaxes")
  size = int(hadamard)
  part = (b, p // tp, q // tq)
  a, at = _tiled_call(
      functools.partial(_nv_amax_tile, size=size, round_to=round_to), t, (tp, tq),
      [(part, jnp.float32, (1, 1), False), (part, jnp.float32, (1, 1), False)],
      (_hadamard_matrix(size or 1),), name="nvfp4_amaxes")
  return jnp.max(a), jnp.max(at)


def nvfp4_codes_both(t: jnp.ndarray, factor, factor_t, *, hadamard: int, keys=None,
                     round_to=None):
  """NVFP4 codes of ``t`` (B, P, Q) along Q, and of its rotated transpose along P, from one read.

  Args:
    t: the tensor; P and Q whole tiles (:func:`tile_sizes` with blocks of 32).
    factor: the per-tensor factor of the copy along Q (float32 scalar).
    factor_t: the factor of the rotated transposed copy.
    hadamard: the rotation's group size along P (0: none).
    keys: ``None`` (round to nearest) or the two uint32 keys of stochastic
      rounding (:func:`~fp8_linen.core.randomness.noise_key` of salts 1 and 2).
    round_to: as for :func:`mx_codes_both`.

  Returns:
    ``((q, s), (qt, st))``: ``q`` (B, P, Q) ``float4_e2m1fn`` with ``s`` (B, P,
    Q / 16) e4m3; ``qt`` (B, Q, P) and ``st`` (B, Q, P / 16) of
    ``random_hadamard(swapaxes(t, 1, 2), hadamard)``. Bit-identical to
    :func:`~fp8_linen.core.block_numerics.block_quantize` of each (with
    ``uniform_noise`` of the same keys), NaN read as Inf.
  """
  b, p, q = t.shape
  tp, tq = _nv_tiles(t, "nvfp4_codes_both")
  bs, size = 16, int(hadamard)
  factors = jnp.stack([jnp.reshape(factor, ()), jnp.reshape(factor_t, ())]).astype(jnp.float32)
  noise = keys is not None
  k = (jnp.stack([jnp.reshape(keys[0], ()), jnp.reshape(keys[1], ())]).astype(jnp.uint32)
       if noise else jnp.zeros((2,), jnp.uint32))
  kernel = functools.partial(_nv_codes_tile, bs=bs, size=size, noise=noise, dims=(p, q),
                             round_to=round_to)
  codes, codes_t, scales, scales_t = _tiled_call(
      kernel, t, (tp, tq),
      # The e4m3 scales last: a trailing byte array of a custom call reads as
      # a library's scratch space to the pass counter.
      [((b, p, q // 2), jnp.uint8, (tp, tq // 2), False),
       ((b, q, p // 2), jnp.uint8, (tq, tp // 2), True),
       ((b, p, q // bs), jnp.float8_e4m3fn, (tp, tq // bs), False),
       ((b, q, p // bs), jnp.float8_e4m3fn, (tq, tp // bs), True)],
      (_hadamard_matrix(size or 1), factors, k), name="nvfp4_codes_both", indices=True)
  return (_unpack(codes), scales), (_unpack(codes_t), scales_t)


def _nv_tile_codes_tile(x_ref, f_ref, q_ref, qt_ref, s_ref, st_ref, *, bs: int, round_to=None):
  x = _nan_as_inf(_load(x_ref, round_to))
  tp, tq = x.shape
  xb = x.reshape(tp // bs, bs, tq // bs, bs)
  a = block_numerics.block_amax(xb, (1, 3))                 # one amax per bs x bs tile
  stored, _, y = block_numerics.e2m1_block(xb, a, f_ref[0])
  codes = block_numerics.e2m1_codes(y.reshape(tp, tq))
  q_ref[...] = _pack(codes)
  qt_ref[...] = _pack(codes.T)
  # Each tile's scale on each of its rows, in each layout (exact through f32).
  sc = stored.astype(jnp.float32)
  s_ref[...] = jnp.broadcast_to(sc, (tp // bs, bs, tq // bs, 1)).reshape(
      tp, tq // bs).astype(jnp.float8_e4m3fn)
  sct = sc.reshape(tp // bs, tq // bs).T
  st_ref[...] = jnp.broadcast_to(sct[:, None, :], (tq // bs, bs, tp // bs)).reshape(
      tq, tp // bs).astype(jnp.float8_e4m3fn)


def nvfp4_tile_codes_both(t: jnp.ndarray, factor, *, round_to=None):
  """NVFP4 codes of ``t`` (B, P, Q) in 16 x 16 tiles, in ``t``'s layout and transposed.

  The weight's 2-D blocks (``kernel_2d_blocks``): one set of codes serves
  both of its GEMMs, each reading it along its own contracting axis.

  Returns:
    ``((q, s), (q_t, s_t))``: ``q`` (B, P, Q) with ``s`` (B, P, Q / 16) and
    ``q_t`` (B, Q, P) with ``s_t`` (B, Q, P / 16), each tile's scale repeated
    on its rows: ``block_quantize(..., tile=True)`` of ``t`` and of its
    transpose, bit for bit (NaN read as Inf). ``round_to``: as for
    :func:`mx_codes_both`.
  """
  b, p, q = t.shape
  tp, tq = _nv_tiles(t, "nvfp4_tile_codes_both")
  bs = 16
  factors = jnp.reshape(jnp.asarray(factor, jnp.float32), (1,))
  codes, codes_t, scales, scales_t = _tiled_call(
      functools.partial(_nv_tile_codes_tile, bs=bs, round_to=round_to), t, (tp, tq),
      [((b, p, q // 2), jnp.uint8, (tp, tq // 2), False),
       ((b, q, p // 2), jnp.uint8, (tq, tp // 2), True),
       ((b, p, q // bs), jnp.float8_e4m3fn, (tp, tq // bs), False),
       ((b, q, p // bs), jnp.float8_e4m3fn, (tq, tp // bs), True)],
      (factors,), name="nvfp4_tile_codes_both")
  return (_unpack(codes), scales), (_unpack(codes_t), scales_t)
