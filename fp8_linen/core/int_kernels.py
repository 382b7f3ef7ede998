"""A Pallas TPU kernel of integer QAT: a weight's per-channel int8 codes from one read.

An STE weight quantized per output channel needs each channel's range
(its min and max over the contracting axes) before its codes. XLA:TPU
computes the range in one pass over the weight and the codes in another,
each reading the float32 parameter (DESIGN.md 3c). :func:`channel_codes`
reads each column tile of the weight once: the tile's rows arrive in chunks,
each rounded to the compute dtype and kept in VMEM while the channels'
ranges accumulate; the codes are then written from the kept tile.

The codes and scales are those of
:func:`~fp8_linen.core.int_ops.minmax_qparams` and
:func:`~fp8_linen.core.int_codes.encode` on the rounded weight, bit for bit:
the kernel runs the same functions on its tiles
(:func:`~fp8_linen.core.int_numerics.int_params_from_range`,
:func:`~fp8_linen.core.int_numerics.int_levels`), and a maximum of maxima is
the maximum.

It runs (the one switch: :func:`~fp8_linen.core.block_kernels.pallas_kernels`):

* ``'auto'``: where products are traced for a TPU, on one device or inside
  ``shard_map``, for a weight whose contracting axes lead its one or two
  output axes (a Dense's ``(in, out)``, attention's ``(d, heads, head_dim)``),
  whose last axis is whole lane tiles (a multiple of 128), whose heads are
  whole int8 row tiles (a multiple of 32), and whose kept tile fits in the
  chip's VMEM;
* ``'interpret'``: for such a weight on any backend, in Pallas' interpreter
  (how tests compare it with the ``jnp`` path on a CPU);
* ``'off'``: never.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import int_kernels
  >>> cfg = fl.IntQuantConfig(granularity='channel')
  >>> with fl.pallas_kernels('interpret'):
  ...   codes, scale = int_kernels.channel_codes(jnp.ones((64, 128)), (0,), cfg, jnp.bfloat16)
  >>> codes.shape, str(codes.dtype), scale.shape, int(codes[0, 0])
  ((64, 128), 'int8', (1, 128), 127)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fp8_linen.core import block_kernels, int_numerics, lowering
from fp8_linen.recipes.integer import IntQuantConfig

__all__ = ["channel_codes_mode", "channel_codes"]

_LANES = 128
_ROW_TILE = 32  # rows of a TPU memory tile, for every dtype up to 4 bytes
# Rows per chunk, largest first: a chunk is a multiple of int8's 32-row tile,
# and long chunks keep the grid short (each step costs a fixed overhead).
_CHUNKS = (2048, 1024, 512, 256, 128, 64, 32)
_CHUNKS_3D = (128, 64, 32, 16, 8)
# What one call may ask of VMEM where the chip is not known: TPU7x's budget
# (3/4 of its 64 MiB per TensorCore), the smallest of the TPUs served.
_VMEM_CAP = 48 * 2**20


def _plan(k: int, m: int, n: int, in_bytes: int, keep_bytes: int):
  """``(tk, tm, tn, vmem bytes)`` for a (K, N) weight (``m == 0``) or a (K, M, N) one.

  A (K, M, N) weight's column tile spans whole row tiles of its second-minor
  axis (int8's 32 rows), so its chunks are short along K. None where no plan
  fits.
  """
  tn = (256 if n % 256 == 0 and not m else _LANES) if n % _LANES == 0 else None
  if tn is None or (m and m % _ROW_TILE):
    return None
  tm = _ROW_TILE if m else 1
  # A (K, M, N) chunk of 128 rows is as many elements as the longest (K, N)
  # one (2048 x 256); its rows (of K) are not a tiled axis, so any count fits.
  tk = next((c for c in (_CHUNKS if not m else _CHUNKS_3D) if k % c == 0), None)
  if tk is None:
    return None
  # The kept tile, two buffers of the input and output chunks, and the chunk's
  # float32 intermediates.
  chunk = tk * tm * tn
  need = k * tm * tn * keep_bytes + 2 * chunk * (in_bytes + 1) + 3 * chunk * 4 + (1 << 20)
  return None if need > _vmem_cap() else (tk, tm, tn, need)


def _vmem_cap() -> int:
  """What one call may ask of VMEM: 3/4 of the traced-for TPU's, the rest left to XLA.

  The chip is the one-device mesh's (``jax.set_mesh``, how a program is
  compiled for a TPU this machine lacks) or JAX's default device's: 96 MiB on
  TPU v5e and v6e, 48 MiB on TPU7x. Where it is not a TPU (Pallas'
  interpreter) the smallest of those.
  """
  try:
    return pltpu.get_tpu_info().vmem_capacity_bytes * 3 // 4
  except ValueError:  # not a TPU, or one Pallas does not know
    return _VMEM_CAP


def _qualifies(w, contract, cfg: IntQuantConfig, round_to) -> tuple | None:
  """``(view shape, plan)`` where the kernel serves ``w``, else None."""
  contract = tuple(a % w.ndim for a in contract)
  free = w.ndim - len(contract)
  # The contracting axes lead, then one or two output axes: then the (K, N)
  # or (K, M, N) view is the weight's own tiled layout (merging leading axes
  # whose last is whole row tiles, or that the tiles do not span). With two,
  # a column tile spans 32 of the M axis (an int8 tile's rows), so it keeps
  # K x 32 x 128 values: 64 MiB in bfloat16 at K = 8192, which TPU v5e's and
  # v6e's VMEM hold and TPU7x's does not.
  if (cfg.granularity != "channel" or not cfg.symmetric or cfg.learned or cfg.power_of_two
      or cfg.qmax > 127 or contract != tuple(range(len(contract))) or not contract
      or free not in (1, 2)
      or (free == 1 and len(contract) > 1 and w.shape[-2] % _ROW_TILE)
      or not jnp.issubdtype(w.dtype, jnp.floating)):
    return None
  k = math.prod(w.shape[:len(contract)])
  view = (k,) + tuple(w.shape[len(contract):])
  keep = jnp.dtype(round_to or w.dtype).itemsize
  plan = _plan(k, view[1] if free == 2 else 0, view[-1], jnp.dtype(w.dtype).itemsize, keep)
  return None if plan is None else (view,) + plan


def channel_codes_mode(w, contract, cfg: IntQuantConfig, round_to=None) -> str | None:
  """``'compiled'``, ``'interpret'`` or None: how :func:`channel_codes` would run on ``w`` now.

  Args:
    w: the weight.
    contract: its contracting axes.
    cfg: its :class:`~fp8_linen.IntQuantConfig`.
    round_to: the dtype the weight is rounded to as it is read, or None.
  """
  mode = block_kernels.switch_mode()
  if mode == "interpret":
    # Pallas' interpreter rejects a kernel on shard_map's varying values.
    ok = not lowering.varying_axes(w)
  else:
    ok = mode != "off" and lowering.current_backend() == "tpu" and block_kernels.per_device(w)
  # The plan last: it asks the chip's VMEM, which only a TPU (or the interpreter's default) has.
  if not ok or _qualifies(w, contract, cfg, round_to) is None:
    return None
  return "interpret" if mode == "interpret" else "compiled"


def _codes_kernel(w_ref, q_ref, s_ref, keep_ref, nlo_ref, hi_ref, scale_ref, *, cfg, round_to,
                  steps: int):
  """Grid (column tiles..., 2 * chunks): the first half reads, the second writes codes."""
  t = pl.program_id(len(w_ref.shape) - 1)
  tk = w_ref.shape[0]

  @pl.when(t == 0)
  def _start():
    nlo_ref[...] = jnp.full(nlo_ref.shape, -jnp.inf, jnp.float32)
    hi_ref[...] = jnp.full(hi_ref.shape, -jnp.inf, jnp.float32)

  @pl.when(t < steps)
  def _read():
    w = w_ref[...]
    if round_to is not None:
      w = w.astype(round_to)
    keep_ref[pl.ds(pl.multiple_of(t * tk, tk), tk), ...] = w
    # The range as minmax_qparams takes it: lo = -max(-w), hi = max(w).
    nlo_ref[...] = jnp.maximum(nlo_ref[...],
                               jnp.max(-w, axis=0, keepdims=True).astype(jnp.float32))
    hi_ref[...] = jnp.maximum(hi_ref[...], jnp.max(w, axis=0, keepdims=True).astype(jnp.float32))

  @pl.when(t == steps - 1)
  def _scale():
    s, _ = int_numerics.int_params_from_range(-nlo_ref[...], hi_ref[...], cfg)
    scale_ref[...] = s

  @pl.when(t >= steps)
  def _write():
    j = t - steps
    x = keep_ref[pl.ds(pl.multiple_of(j * tk, tk), tk), ...].astype(jnp.float32)
    s = scale_ref[...]
    q = int_numerics.int_levels(x, s, jnp.zeros_like(s), cfg.qmin, cfg.qmax)
    q_ref[...] = q.astype(jnp.int8)
    s_ref[...] = s


def channel_codes(w, contract, cfg: IntQuantConfig, round_to=None):
  """Per-channel int8 codes of ``w`` and their scales, from one read of ``w``.

  Args:
    w: the weight, its contracting axes first (see :func:`channel_codes_mode`).
    contract: its contracting axes.
    cfg: a symmetric, per-channel, STE :class:`~fp8_linen.IntQuantConfig`
      of at most 8 bits.
    round_to: a float dtype to round ``w`` to as it is read (a float32
      parameter of a bfloat16 layer), or None: the codes are those of
      ``w.astype(round_to)``, which is never written.

  Returns:
    ``(codes, scale)``: int8 codes in ``w``'s shape, and float32 scales in
    the shape of the view's (size 1 along the contracting axes), equal bit for
    bit to :func:`~fp8_linen.core.int_codes.quantize`'s on the rounded weight.

  Raises:
    ValueError: for a weight or config the kernel does not serve.
  """
  plan = _qualifies(w, contract, cfg, round_to)
  if plan is None:
    raise ValueError(f"channel_codes: a {w.dtype} weight of shape {w.shape} contracted over "
                     f"{tuple(contract)} under {cfg} is not served by the kernel")
  view, tk, tm, tn, need = plan
  k = view[0]
  steps = k // tk
  keep = jnp.dtype(round_to or w.dtype)
  interpret = channel_codes_mode(w, contract, cfg, round_to) == "interpret"
  blk = (tk, tn) if len(view) == 2 else (tk, tm, tn)
  # The grid: the column tiles, then 2 * steps (read the chunks, then write them).
  grid = tuple(d // b for d, b in zip(view[1:], blk[1:])) + (2 * steps,)
  rd = lambda *g: (jnp.minimum(g[-1], steps - 1),) + g[:-1]
  wr = lambda *g: (jnp.maximum(g[-1] - steps, 0),) + g[:-1]
  one = (1,) + blk[1:]
  codes, scale = pl.pallas_call(
      functools.partial(_codes_kernel, cfg=cfg, round_to=round_to, steps=steps),
      grid=grid,
      in_specs=[pl.BlockSpec(blk, rd)],
      out_specs=[pl.BlockSpec(blk, wr), pl.BlockSpec(one, lambda *g: (0,) + g[:-1])],
      out_shape=[jax.ShapeDtypeStruct(view, jnp.int8),
                 jax.ShapeDtypeStruct((1,) + view[1:], jnp.float32)],
      scratch_shapes=[pltpu.VMEM((k,) + blk[1:], keep), pltpu.VMEM(one, jnp.float32),
                      pltpu.VMEM(one, jnp.float32), pltpu.VMEM(one, jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",) * (len(grid) - 1) + ("arbitrary",),
          vmem_limit_bytes=int(need * 1.25)),
      interpret=interpret, name="int8_channel_codes")(w.reshape(view))
  nc = len(tuple(contract))
  return codes.reshape(w.shape), scale.reshape((1,) * nc + w.shape[nc:])
