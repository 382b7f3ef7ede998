"""Pallas grouped GEMMs for a GPU: each routed row multiplied by its own group's weight only.

XLA:GPU lowers ``jax.lax.ragged_dot`` with fp8 (or int8) operands to one dense
GEMM over every group: ``g`` times the FLOPs the routed rows need, the other
groups' rows masked afterwards (``docs/accelerators.md``, grouped GEMMs). XLA:TPU
has a grouped kernel of its own (Mosaic); these are the GPU's, compiled by
Triton, fed the 8-bit codes:

* :func:`grouped_gemm`: ``(m, c) x (g, c, o) -> (m, o)`` (the forward), or with
  ``transpose_rhs`` ``(m, c) x (g, o, c)^T`` (the dgrad, reading the stored
  weight codes in place). The rows are cut in tiles of ``tm``; a tile that
  two groups share runs once per group and stores only its group's rows, so
  the work is the routed rows' plus at most one tile per group boundary.
* :func:`grouped_wgrad`: ``(m, c)^T x (m, o) -> (g, c, o)``, the
  ragged-contracting form: group ``i``'s rows of both operands contracted,
  looping over that group's row tiles only.

Both accumulate in float32 (int32 for int8 codes) and return the raw sums,
or, given one scale per group, the output already multiplied by its group's
scale and cast (the fp8 products' dequantization, so no float32 copy of the
output is written and read again): the same bits as XLA's product followed
by that multiply (:func:`ragged_product` is either path). Rows past
``sum(group_sizes)`` give zero rows (as ``ragged_dot``); an empty group gives a
zero gradient. The row bookkeeping (which tile holds which group's rows) is
computed with ``jnp`` before the call (:func:`row_tiles`).

On a TPU, XLA runs the forward and the dgrad in a grouped Mosaic kernel of
its own but the wgrad as a convolution over every group:
:func:`tpu_grouped_wgrad` runs JAX's megablox ``tgmm`` there instead
(:func:`tpu_wgrad_pays` says where).

When they run follows :func:`~fp8_linen.core.block_kernels.pallas_kernels`
(the one switch for the library's kernels): ``'auto'`` on a GPU for a product
of 8-bit codes (``gemm='fp8'``, integer codes) or of the 16-bit floats it
multiplies (integer experts' float gradients), on one device or
inside ``shard_map``, for operands of whole tiles; ``'interpret'`` anywhere
(Pallas' interpreter: how the tests compare them with ``ragged_dot`` on a
CPU); ``'off'`` never.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import block_kernels, grouped_kernels
  >>> x, w = jnp.ones((32, 32), jnp.float8_e4m3fn), jnp.ones((2, 32, 32), jnp.float8_e4m3fn)
  >>> with block_kernels.pallas_kernels('interpret'):
  ...   y = grouped_kernels.grouped_gemm(x, w, jnp.array([8, 16]))
  >>> float(y[0, 0]), float(y[31, 0])
  (32.0, 0.0)
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Bound at import, before quantize_model can intercept jax.lax.ragged_dot.
from jax.lax import ragged_dot as lax_ragged_dot

from fp8_linen.core import block_kernels, lowering

__all__ = ["WGRAD_DIMENSIONS", "TPU_WGRAD_SCOPE", "tiles", "kernel_mode", "pays", "run",
           "contiguous_contraction", "ragged_product",
           "tpu_wgrad_pays", "tpu_grouped_wgrad", "row_tiles", "kernel_name", "grouped_gemm",
           "grouped_wgrad"]

WGRAD_DIMENSIONS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])
"""The wgrad of a grouped GEMM: ``(m, k)`` and ``(m, n)`` contract their ragged rows, one
``(k, n)`` per group."""

# How each kernel cuts its operands and is launched, per table: the candidate
# tiles of each edge, largest first, and Triton's warps and pipeline stages.
# Triton's dots want powers of two of at least 16 on every edge; every edge ends
# in 16, so which shapes a kernel takes does not depend on the table. The
# choices are the fastest of a sweep on an H200 (the Mixtral-shaped layer of
# benchmarks/results/nvidia-h200-grouped-gpu.json); 16-bit operands keep the
# contracted tile at 64 so three stages fit in shared memory.
_LAUNCH = {
    "grouped_gemm": {"rows": (128, 64, 32, 16), "contracted": (64, 32, 16),
                     "cols": (256, 128, 64, 32, 16), "num_warps": 8, "num_stages": 3},
    "grouped_gemm_8bit": {"rows": (128, 64, 32, 16), "contracted": (128, 64, 32, 16),
                          "cols": (256, 128, 64, 32, 16), "num_warps": 8, "num_stages": 3},
    "grouped_wgrad": {"rows": (64, 32, 16), "contracted": (128, 64, 32, 16),
                      "cols": (128, 64, 32, 16), "num_warps": 4, "num_stages": 3},
    "grouped_wgrad_kmajor": {"rows": (128, 64, 32, 16), "contracted": (128, 64, 32, 16),
                             "cols": (256, 128, 64, 32, 16), "num_warps": 8, "num_stages": 3},
}


def tiles(m: int, c: int, o: int, kind: str = "grouped_gemm",
          groups: int = 1) -> tuple[int, int, int] | None:
  """The tile ``(rows, contracted, output columns)`` of launch table ``kind``, or None.

  Each edge is the largest of its candidates that divides the size. For the
  forward/dgrad a row tile is also at most the rows per group (``m /
  groups``) where a candidate allows: a tile two groups share is computed once
  per group. For ``grouped_wgrad`` ``c`` is the output's rows (its lhs'
  columns), as in :func:`kernel_mode`.
  """
  if min(m, c, o) <= 0:  # an empty batch: XLA's product (nothing for a kernel to tile)
    return None
  launch = _LAUNCH[kind]
  pick = lambda n, options: next((t for t in options if n % t == 0), None)
  rows = [t for t in launch["rows"] if t * max(groups, 1) <= m] or launch["rows"][-1:]
  found = pick(m, rows), pick(c, launch["contracted"]), pick(o, launch["cols"])
  return None if None in found else found


def kernel_mode(lhs, out_cols: int, *, gpu_kernel: bool,
                kind: str = "grouped_gemm") -> str | None:
  """``'compiled'``, ``'interpret'`` or None: how a grouped GEMM of ``lhs`` would run now.

  Args:
    lhs: the rows, ``(m, c)`` (``c`` contracted, or for :func:`grouped_wgrad`
      the output's rows).
    out_cols: the output's columns.
    gpu_kernel: the product's operands are what it multiplies (8-bit codes,
      or 16-bit floats it multiplies as they are), so the compiled kernel
      computes it exactly: the only products it takes on a GPU. float32
      operands never take it (Triton may round them to tf32).
    kind: ``'grouped_gemm'`` or ``'grouped_wgrad'``, whose tiles the shape must fit.
  """
  mode = block_kernels.switch_mode()
  if mode == "off" or lhs.ndim != 2 or tiles(lhs.shape[0], lhs.shape[1], out_cols, kind) is None:
    return None
  if mode == "interpret":
    # The interpreter rejects shard_map's varying values (see block_kernels).
    return None if lowering.varying_axes(lhs) else "interpret"
  if gpu_kernel and jnp.dtype(lhs.dtype).itemsize <= 2 and lowering.current_backend() == "gpu" \
      and block_kernels.per_device(lhs):
    return "compiled"
  return None


def pays(a_dtype, b_dtype, groups: int) -> bool:
  """Whether a compiled kernel beats XLA's one dense GEMM over every group.

  Equal 8-bit operands multiply at their low-precision rate over the routed
  rows only: always. Mixed fp8 (e5m2 gradient x e4m3 codes) multiplies in
  float16 in the kernel (:func:`kernel_name`), at half the fp8 rate, against
  XLA's ``groups`` times the work at the fp8 rate: it pays from three groups on.
  """
  return jnp.dtype(a_dtype) == jnp.dtype(b_dtype) or groups > 2


def run(a, b, group_sizes, *, gpu_kernel: bool, transpose_rhs: bool = False,
        wgrad: bool = False, scales=None, row_scales=None, out_dtype=None):
  """The grouped product in a kernel when one runs here and pays, else None (use XLA's).

  Args:
    a: the rows ``(m, c)``.
    b: ``(g, c, o)`` (``(g, o, c)`` with ``transpose_rhs``), or ``(m, o)``
      with ``wgrad``.
    group_sizes: integer ``(g,)``.
    gpu_kernel: the product may run in the compiled kernel (see :func:`kernel_mode`).
    transpose_rhs: :func:`grouped_gemm`'s.
    wgrad: :func:`grouped_wgrad` instead of :func:`grouped_gemm`.
    scales, row_scales, out_dtype: :func:`grouped_gemm`'s (the output's scales).
  """
  out_cols = b.shape[1] if transpose_rhs else b.shape[-1]
  mode = kernel_mode(a, out_cols, gpu_kernel=gpu_kernel,
                     kind="grouped_wgrad" if wgrad else "grouped_gemm")
  groups = group_sizes.shape[0]
  if mode is None or groups == 0 or (mode == "compiled" and not pays(a.dtype, b.dtype, groups)):
    return None
  kw = {"scales": scales, "out_dtype": out_dtype, "interpret": mode == "interpret"}
  form = "wgrad" if wgrad else "dgrad" if transpose_rhs else "fwd"
  if not wgrad:
    kw["row_scales"] = row_scales
  if wgrad:
    if contiguous_contraction(form, a.dtype, b.dtype):
      return grouped_wgrad(a.T, b.T, group_sizes, transposed=True, **kw)
    return grouped_wgrad(a, b, group_sizes, **kw)
  if contiguous_contraction(form, a.dtype, b.dtype):
    b, transpose_rhs = jnp.swapaxes(b, 1, 2), True
  return grouped_gemm(a, b, group_sizes, transpose_rhs=transpose_rhs, **kw)


# Where a kernel reads an operand whose contracted edge is not contiguous, and
# a copy that makes it contiguous pays: Hopper's 8-bit tensor-core products
# read only such (K-major) tiles, so Triton transposes the others on the way.
# Measured on an H200 (benchmarks/results/nvidia-h200-grouped-gpu.json,
# "3_layouts"), the Mixtral-shaped layer: the int8 forward 20.3 -> 2.25 ms and
# wgrad 12.7 -> 6.3 ms, the e4m3 forward 5.7 -> 4.7 ms, for copies of 0.1-0.4 ms;
# fp8 wgrads ran slower with the copies, and 16-bit products the same. The
# dgrad reads the weight codes (g, k, n) along n, its contracted edge, already.
def contiguous_contraction(form: str, a_dtype, b_dtype) -> bool:
  """Whether :func:`run` gives a kernel of ``form`` (``'fwd'``, ``'dgrad'`` or
  ``'wgrad'``) its operands copied with the contracted edge contiguous: the
  forward's weight codes as ``(g, n, k)``, the wgrad's operands with the
  routed rows last (:func:`grouped_wgrad`'s ``transposed``)."""
  a, b = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
  if a != b or a.itemsize != 1:
    return False
  return form == "fwd" or (form == "wgrad" and jnp.issubdtype(a, jnp.integer))


def ragged_product(a, b, group_sizes, *, gpu_kernel: bool, transpose_rhs: bool = False,
                   wgrad: bool = False, scales=None, row_scales=None, out_dtype=None,
                   upcast=None):
  """A grouped product: :func:`run`'s kernel where it runs and pays, else XLA's ``ragged_dot``.

  Args: as :func:`run`; ``upcast``: the dtype XLA's product multiplies the
  operands in (None: as they are). Accumulates in float32 (int32 for integer
  operands); with ``scales`` (and ``row_scales``) the output is multiplied by
  them and cast to ``out_dtype``, the same bits on either path.
  """
  if wgrad and row_scales is not None:
    raise ValueError("ragged_product: row_scales scale a forward or dgrad's rows; a wgrad "
                     "contracts them")
  out = run(a, b, group_sizes, gpu_kernel=gpu_kernel, transpose_rhs=transpose_rhs,
            wgrad=wgrad, scales=scales, row_scales=row_scales, out_dtype=out_dtype)
  if out is not None:
    return out
  if upcast is not None:
    a, b = a.astype(upcast), b.astype(upcast)
  acc = _acc_dtype(a.dtype)
  if wgrad and tpu_wgrad_pays(a, b, group_sizes.shape[0]):
    y = tpu_grouped_wgrad(a, b, group_sizes)
  elif wgrad:
    y = lax.ragged_dot_general(a, b, group_sizes, WGRAD_DIMENSIONS, preferred_element_type=acc)
  else:
    b = jnp.swapaxes(b, 1, 2) if transpose_rhs else b
    y = lax_ragged_dot(a, b, group_sizes, preferred_element_type=acc)
  if scales is None and row_scales is None:
    return y
  extra, out_dtype = _scaled(scales, row_scales, group_sizes.shape[0], y.shape[-1], out_dtype,
                             acc, y.shape[0] if not wgrad else None)
  y = y.astype(jnp.float32)
  if scales is not None:
    s = extra[0] if extra[0].ndim == 2 else extra[0][:, None]  # (g, o) or (g, 1)
    if wgrad:
      y = y * s[:, None, :]
    else:
      # Each row takes its group's scales (the rows past the groups are zero: any scale).
      rows = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                        total_repeat_length=y.shape[0])
      y = y * s[rows]
  if row_scales is not None:
    y = y * extra[-1][:, None]
  return y.astype(out_dtype)


# XLA:TPU multiplies the forward and the dgrad in a grouped Mosaic kernel of its own, but
# the wgrad as a convolution over every group. JAX's megablox `tgmm` (a Mosaic kernel that
# contracts each group's rows only) takes bfloat16 and float32 operands, in 128 tiles.
_TPU_TILE = 128
TPU_WGRAD_SCOPE = "fp8_linen_tpu_grouped_wgrad"
"""The name scope of :func:`tpu_grouped_wgrad`'s kernel (in its compiled ``op_name``)."""
_TPU_TAKES = (jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)


def tpu_wgrad_pays(a, b, groups: int) -> bool:
  """Whether a TPU wgrad goes to :func:`tpu_grouped_wgrad` instead of XLA's convolution.

  On a TPU traced for (``'auto'`` kernels), on one device outside ``shard_map``,
  for bfloat16 or fp8 operands (fp8 codes are widened to bfloat16, exact) in
  whole 128 tiles. bfloat16 always pays (the routed rows' work, not ``groups``
  times it); fp8 codes, which XLA would multiply at TPU7x's fp8 rate, from
  three groups on.
  """
  if (block_kernels.switch_mode() != "auto" or lowering.current_backend() != "tpu"
      or groups == 0 or lowering.varying_axes(a) or not block_kernels.per_device(a)):
    return False
  if any(jnp.dtype(t.dtype) not in map(jnp.dtype, _TPU_TAKES) for t in (a, b)):
    return False
  if any(d % _TPU_TILE for d in (*a.shape, b.shape[1])) or not a.shape[0]:
    return False
  return a.dtype == b.dtype == jnp.bfloat16 or groups > 2


def tpu_grouped_wgrad(a, b, group_sizes, *, interpret: bool = False):
  """``out[i] = a[rows_i]^T @ b[rows_i]`` by megablox's ``tgmm`` (float32, ``(g, k, n)``).

  The operands go in as bfloat16 (exact for bfloat16 and fp8 values).
  """
  megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  bf16 = lambda t: t.astype(jnp.bfloat16)
  # The scope names the kernel in the compiled program, for the product counter.
  with jax.named_scope(TPU_WGRAD_SCOPE):
    return megablox.tgmm(bf16(a).T, bf16(b), group_sizes.astype(jnp.int32),
                         preferred_element_type=jnp.float32,
                         tiling=(_TPU_TILE, _TPU_TILE, _TPU_TILE), interpret=interpret)


def row_tiles(group_sizes, m: int, tm: int):
  """Which row tile each program of :func:`grouped_gemm` computes, and for which group.

  The ranges are the ``g`` groups' rows and one more, the rows past them
  (whose output is zero). Each range covers the row tiles it touches; a
  tile two ranges share is listed once for each. ``m / tm + g`` slots cover
  every case; the unused ones store nothing.

  Returns:
    int32 ``(group, tile, lo, hi)``, one entry per slot: the range's index
    (``g``: the rows past the groups), the row tile, and the range's rows
    ``[lo, hi)`` (empty for an unused slot).
  """
  g = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  cum = jnp.cumsum(sizes)
  ends, starts = jnp.minimum(cum, m), jnp.minimum(cum - sizes, m)
  starts = jnp.concatenate([starts, ends[-1:]])
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first = starts // tm
  count = jnp.where(ends > starts, (ends + tm - 1) // tm - first, 0)
  last = jnp.cumsum(count)                       # exclusive end of each range's slots
  slot = jnp.arange(m // tm + g, dtype=jnp.int32)
  rng = jnp.sum(last[None, :] <= slot[:, None], axis=1).astype(jnp.int32)
  used = rng <= g
  rng = jnp.minimum(rng, g)
  tile = jnp.clip(first[rng] + slot - (last[rng] - count[rng]), 0, m // tm - 1)
  lo = jnp.where(used, starts[rng], 0)
  hi = jnp.where(used, ends[rng], 0)
  return rng, tile, lo, hi


def _acc_dtype(dtype):
  return jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32


def _mixed(a_dtype, b_dtype) -> bool:
  """Two different 8-bit floats (e5m2 gradient codes x e4m3 codes): Pallas' Triton
  lowering multiplies only equal types, so the tiles go to float16 in registers
  (exact for both formats) and the dot runs at float16's rate."""
  return jnp.dtype(a_dtype) != jnp.dtype(b_dtype)


def _dot(a, b, acc):
  if _mixed(a.dtype, b.dtype):
    a, b = a.astype(jnp.float16), b.astype(jnp.float16)
  # Bound at import: quantize_model must not take the kernel's own tile product for a
  # product of the model.
  return lowering.lax_dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=acc)


def kernel_name(kind: str, a_dtype, b_dtype) -> str:
  """The kernel's name in the compiled program: what it multiplies, for the product counter.

  ``fp8_linen_<kind>_<operand dtype>`` with ``kind`` ``grouped_gemm`` or
  ``grouped_wgrad``, the dtype the dot is fed (``float16`` for mixed fp8).
  """
  fed = jnp.float16 if _mixed(a_dtype, b_dtype) else a_dtype
  return f"fp8_linen_{kind}_{jnp.dtype(fed).name}"


def _out(shape, dtype, inputs):
  """The kernel's result type: inside ``shard_map`` it varies over every axis an input does."""
  mats = [m for m in (getattr(jax.typeof(a), "mat", None) for a in inputs) if m is not None]
  if not mats:
    return jax.ShapeDtypeStruct(shape, dtype)
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


def _call(kernel, grid, out_shape, out_specs, args, in_specs, *, kind: str, name: str,
          interpret: bool):
  out_shape = _out(out_shape.shape, out_shape.dtype, args)
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
    launch = _LAUNCH[kind]
    params = {"compiler_params": pl_triton.CompilerParams(num_warps=launch["num_warps"],
                                                          num_stages=launch["num_stages"])}
  specs = {k: v for k, v in (("in_specs", in_specs), ("out_specs", out_specs)) if v is not None}
  return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                        **specs, **params)(*args)


def _gmm_kernel(lhs_ref, rhs_ref, rng_ref, tile_ref, lo_ref, hi_ref, *refs, sizes,
                groups: int, transpose_rhs: bool, acc, scaled):
  from jax.experimental.pallas import triton as pl_triton  # pylint: disable=import-outside-toplevel
  tm, tc, to, c = sizes
  s, j = pl.program_id(0), pl.program_id(1)
  rng, tile, lo, hi = rng_ref[s], tile_ref[s], lo_ref[s], hi_ref[s]
  w = jnp.minimum(rng, groups - 1)    # the rows past the groups read any weight: zeroed below
  rows = pl.ds(tile * tm, tm)

  def step(i, total):
    a = lhs_ref[rows, pl.ds(i * tc, tc)]
    if transpose_rhs:
      b = rhs_ref[w, pl.ds(j * to, to), pl.ds(i * tc, tc)].T
    else:
      b = rhs_ref[w, pl.ds(i * tc, tc), pl.ds(j * to, to)]
    return total + _dot(a, b, acc)

  total = lax.fori_loop(0, c // tc, step, jnp.zeros((tm, to), acc))
  out_ref = refs[-1]
  # The output's scales, and the cast to the output dtype.
  total = _apply_scales(total, refs[:-1], scaled, w, pl.ds(j * to, to), rows)
  total = total.astype(out_ref.dtype)
  total = jnp.where(rng == groups, jnp.zeros_like(total), total)
  row = tile * tm + lax.broadcasted_iota(jnp.int32, (tm, to), 0)
  pl_triton.store(out_ref.at[rows, pl.ds(j * to, to)], total, mask=(row >= lo) & (row < hi))


def grouped_gemm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, scales=None,
                 row_scales=None, out_dtype=None, interpret=None):
  """``ragged_dot(lhs, rhs, group_sizes)`` in a Pallas kernel.

  Args:
    lhs: ``(m, c)``: rows sorted by group (8-bit codes, or any float).
    rhs: ``(g, c, o)``, or ``(g, o, c)`` with ``transpose_rhs``.
    group_sizes: integer ``(g,)``.
    transpose_rhs: read ``rhs[i]`` transposed (the dgrad's ``g x W^T``).
    scales: float32 ``(g,)`` or ``(g, o)``: each group's rows are multiplied
      by its scale (per output column with ``(g, o)``) and cast to
      ``out_dtype`` in the kernel (``(sum * scale).astype(out_dtype)``, as XLA's
      product followed by that multiply); None: the raw sums.
    row_scales: float32 ``(m,)``: each row's scale, multiplied after
      ``scales`` (an integer dgrad's per-row gradient scales).
    out_dtype: the output dtype with ``scales`` (default float32).
    interpret: run in Pallas' interpreter (default: as :func:`kernel_mode` says).

  Returns:
    ``(m, o)``: float32 sums (int32 for integer operands), or the scaled output.
  """
  m, c = lhs.shape
  g = rhs.shape[0]
  o = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  table = "grouped_gemm_8bit" if jnp.dtype(lhs.dtype).itemsize == 1 else "grouped_gemm"
  found = tiles(m, c, o, table, groups=g)
  if found is None:
    raise ValueError(f"grouped_gemm: ({m}, {c}) x {rhs.shape} is not whole tiles of "
                     f"{_LAUNCH[table]}")
  tm, tc, to = found
  if interpret is None:
    interpret = block_kernels.switch_mode() == "interpret"
  meta = row_tiles(group_sizes, m, tm)
  acc = _acc_dtype(lhs.dtype)
  extra, out = _scaled(scales, row_scales, g, o, out_dtype, acc, m)
  kernel = functools.partial(_gmm_kernel, sizes=(tm, tc, to, c), groups=g,
                             transpose_rhs=transpose_rhs, acc=acc,
                             scaled=(scales is not None, row_scales is not None))
  return _call(kernel, (meta[0].shape[0], o // to), jax.ShapeDtypeStruct((m, o), out), None,
               (lhs, rhs) + meta + extra, None,
               kind=table, name=kernel_name("grouped_gemm", lhs.dtype, rhs.dtype),
               interpret=interpret)


def _scaled(scales, row_scales, groups: int, cols: int, out_dtype, acc, rows):
  """The kernel's extra inputs (the groups' scales, ``(g,)`` or ``(g, o)``, then the
  rows' ``(m,)``) and its output dtype."""
  extra = []
  if scales is not None:
    scales = jnp.asarray(scales, jnp.float32)
    shape = (groups, cols) if scales.ndim == 2 else (groups,)
    extra.append(jnp.broadcast_to(scales, shape))
  if row_scales is not None:
    extra.append(jnp.broadcast_to(jnp.asarray(row_scales, jnp.float32).reshape(-1), (rows,)))
  if not extra:
    return (), acc
  return tuple(extra), jnp.dtype(out_dtype or jnp.float32)


def _apply_scales(total, refs, scaled, group, cols, rows):
  """``total`` times the kernel's scales (``scaled``: which of the two it has), in float32."""
  has_group, has_row = scaled
  refs = iter(refs)
  if has_group or has_row:
    total = total.astype(jnp.float32)
  if has_group:
    ref = next(refs)
    total = total * (ref[group, cols][None, :] if len(ref.shape) == 2 else ref[group])
  if has_row:
    total = total * next(refs)[rows][:, None]
  return total


def _wgrad_kernel(lhs_ref, rhs_ref, lo_ref, hi_ref, *refs, sizes, acc, transposed: bool,
                  scaled):
  tm, tc, to = sizes
  gi, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lo, hi = lo_ref[gi], hi_ref[gi]

  def step(t, total):
    rows = pl.ds(t * tm, tm)
    if transposed:  # (c, m) and (o, m): the routed rows are each tile's contiguous edge
      row = t * tm + lax.broadcasted_iota(jnp.int32, (1, tm), 1)
      a, b = lhs_ref[pl.ds(i * tc, tc), rows], rhs_ref[pl.ds(j * to, to), rows]
    else:
      row = t * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
      a, b = lhs_ref[rows, pl.ds(i * tc, tc)], rhs_ref[rows, pl.ds(j * to, to)]
    keep = (row >= lo) & (row < hi)
    a = jnp.where(keep, a, jnp.zeros_like(a))
    b = jnp.where(keep, b, jnp.zeros_like(b))
    return total + (_dot(a, b.T, acc) if transposed else _dot(a.T, b, acc))

  # Only this group's row tiles (none for an empty group).
  total = lax.fori_loop(lo // tm, jnp.where(hi > lo, (hi + tm - 1) // tm, lo // tm), step,
                        jnp.zeros((tc, to), acc))
  out_ref = refs[-1]
  out_ref[...] = _apply_scales(total, refs[:-1], scaled, gi, pl.ds(j * to, to),
                               None).astype(out_ref.dtype)


def grouped_wgrad(lhs, rhs, group_sizes, *, transposed: bool = False, scales=None,
                  out_dtype=None, interpret=None):
  """The ragged-contracting grouped GEMM: ``out[i] = lhs[rows_i]^T @ rhs[rows_i]``.

  Args:
    lhs: ``(m, c)`` (the forward's input codes), or ``(c, m)`` with ``transposed``.
    rhs: ``(m, o)`` (the output gradient's codes), or ``(o, m)`` with ``transposed``.
    group_sizes: integer ``(g,)``.
    transposed: the operands are stored with the routed rows last: the
      layout Hopper's 8-bit tensor-core products read without a transpose
      (both operands contiguous along the contracted rows).
    scales, out_dtype: as :func:`grouped_gemm` (group ``i``'s output times
      ``scales[i]``, a ``(g, o)`` scale per output column).
    interpret: run in Pallas' interpreter (default: as :func:`kernel_mode` says).

  Returns:
    ``(g, c, o)``: float32 sums (int32 for integer operands), or the scaled
    output; zero for an empty group.
  """
  (c, m), o = (lhs.shape, rhs.shape[0]) if transposed else (lhs.shape[::-1], rhs.shape[1])
  table = "grouped_wgrad_kmajor" if transposed else "grouped_wgrad"
  found = tiles(m, c, o, table)
  if found is None or rhs.shape[1 if transposed else 0] != m:
    raise ValueError(f"grouped_wgrad: {lhs.shape} and {rhs.shape} are not whole tiles of "
                     f"{_LAUNCH[table]} with the same rows")
  tm, tc, to = found
  if interpret is None:
    interpret = block_kernels.switch_mode() == "interpret"
  g = group_sizes.shape[0]
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  acc = _acc_dtype(lhs.dtype)
  extra, out = _scaled(scales, None, g, o, out_dtype, acc, None)
  kernel = functools.partial(_wgrad_kernel, sizes=(tm, tc, to), acc=acc, transposed=transposed,
                             scaled=(scales is not None, False))
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  args = (lhs, rhs, starts, ends) + extra
  return _call(kernel, (g, c // tc, o // to), jax.ShapeDtypeStruct((g, c, o), out),
               pl.BlockSpec((None, tc, to), lambda gi, i, j: (gi, i, j)), args,
               [whole(a) for a in args], kind=table,
               name=kernel_name("grouped_wgrad", lhs.dtype, rhs.dtype),
               interpret=interpret)
