"""How an fp8 product is lowered: which GEMM form a backend gets.

``recipe.gemm`` chooses:

* ``'fp8'``: fp8 operands go straight into ``lax.dot_general`` (the form XLA:GPU
  rewrites to a cuBLASLt fp8 matmul; scalar scales multiply the output);
* ``'bf16'`` / ``'f32'``: the fp8 operands are upcast (exactly) first, for
  backends without fp8 units (XLA:CPU lowers an fp8 dot as convert-then-dot
  anyway);
* ``'block'`` (block recipes): the block-scaled GEMM
  (:func:`block_scaled_matmul`: cuDNN's MXFP8/NVFP4 dot on Blackwell);
* ``'auto'``: ``'fp8'`` when the target backend is a GPU, else ``'bf16'``; for a
  block recipe ``'block'`` when the target has block-scaled GEMMs in its formats
  (:func:`block_scaled_gemms`), else ``'bf16'`` (the emulation).

:func:`gemm` runs a product of fp8 codes in the chosen form, :func:`grad_gemm`
one gradient GEMM of a ``dot_general`` in it (the dimension numbers from
:func:`~fp8_linen.core.dims.grad_dims`), and :func:`relayout` lays per-row
scales out like a product's output.

The target backend is ``jax.default_backend()`` unless :func:`target_backend`
says otherwise: that is how a step is traced for an H100 (or, with
``block_scaled=True``, a B200) on a machine without one (a compile-only
"deviceless" topology).

The lax functions are bound when this module is imported, so the library's own
products never go through a function that :mod:`fp8_linen.interception`
replaced while a model is being quantized.

**Explicit sharding.** On a mesh whose axes are ``Explicit`` (the default of
``jax.make_mesh``) every array's type carries its sharding and a product whose
contracting dimensions are sharded must be told how to shard its output.
:func:`dot_out_sharding` gives the forward product the sharding JAX itself
infers when it can (batch, lhs-free, rhs-free specs; a sharded contraction is
all-reduced) and :func:`like_sharding` gives a gradient product the sharding
of the operand it differentiates, as JAX's own transpose rule does. Both are
``None`` (let XLA decide) on ``Auto`` meshes and inside ``shard_map``.

Example:
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import lowering
  >>> with lowering.target_backend("gpu"):
  ...   lowering.resolve_gemm(fl.Fp8Recipe()), lowering.resolve_gemm(fl.nvfp4())
  ('fp8', 'bf16')
  >>> with lowering.target_backend("gpu", block_scaled=True):
  ...   lowering.resolve_gemm(fl.nvfp4())
  'block'
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jax.lax import conv_general_dilated as lax_conv_general_dilated
from jax.lax import dot_general as lax_dot_general

from fp8_linen.core import dims, mesh, settings

__all__ = [
    "GEMMS",
    "target_backend",
    "current_backend",
    "block_scaled_gemms",
    "block_scaled_format",
    "resolve_gemm",
    "block_scaled_matmul",
    "gemm",
    "grad_gemm",
    "compute_dtype_for",
    "grad_dtype_for",
    "is_code",
    "untracked_axes",
    "scaled",
    "relayout",
    "relayout_like",
    "explicit_spec",
    "reshard_like",
    "unshard_axis",
    "dot_out_sharding",
    "conv_out_sharding",
    "like_sharding",
    "varying_axes",
    "global_max",
    "lax_dot_general",
    "lax_conv_general_dilated",
]

GEMMS = ("fp8", "block", "bf16", "f32")

_TARGET = settings.TraceSetting("target_backend", default=None)


@contextlib.contextmanager
def target_backend(backend: str, *, block_scaled: bool = False):
  """Traces ``gemm='auto'`` products for ``backend`` instead of the default one.

  Args:
    backend: ``'gpu'``, ``'cpu'`` or ``'tpu'``.
    block_scaled: ``backend='gpu'`` only: a GPU with block-scaled GEMMs
      (Blackwell: cuDNN's MXFP8 and NVFP4 dots), where block recipes run as
      such. ``False``: a GPU without them (Hopper), where they are emulated.

  Every choice the library makes per backend while tracing (the GEMM form,
  the fp8 encoder) follows it.

  Example:
    >>> import fp8_linen as fl
    >>> with fl.target_backend('gpu'):
    ...   pass  # jax.jit(step).lower(...) here emits direct fp8 GEMMs
    >>> from fp8_linen.core import lowering
    >>> with fl.target_backend('gpu', block_scaled=True):
    ...   lowering.resolve_gemm(fl.mx_block_scaling())
    'block'
  """
  if backend not in ("gpu", "cpu", "tpu"):
    raise ValueError(f"target_backend: backend={backend!r} must be 'gpu', 'cpu' or 'tpu'")
  if not isinstance(block_scaled, bool):
    raise ValueError(f"target_backend: block_scaled={block_scaled!r} must be True or False")
  if block_scaled and backend != "gpu":
    raise ValueError(f"target_backend: block_scaled=True needs backend='gpu' (block-scaled "
                     f"GEMMs are a Blackwell GPU's), got backend={backend!r}")
  with _TARGET.set((backend, block_scaled)):
    yield


def current_backend() -> str:
  """The backend products are traced for: :func:`target_backend`'s, else JAX's default."""
  target = _TARGET.get()
  return target[0] if target else jax.default_backend()


@functools.lru_cache(maxsize=None)
def _device_has_block_scaled_gemms() -> bool:
  """Whether JAX's first device is a CUDA GPU of compute capability >= 10 (Blackwell)."""
  try:
    device = jax.devices()[0]
    major = int(str(getattr(device, "compute_capability", "")).split(".")[0])
  except (RuntimeError, ValueError):  # no device, or not a CUDA compute capability
    return False
  return device.platform == "gpu" and major >= 10


def block_scaled_gemms() -> bool:
  """Whether the traced-for target has block-scaled GEMMs.

  :func:`target_backend`'s ``block_scaled`` when one is set; otherwise
  whether JAX's default device is a CUDA GPU of compute capability 10 or more
  (XLA hands those dots to cuDNN there; with a cuDNN older than 9.10 XLA
  dequantizes them to a bf16 GEMM instead, which is slower but equal).
  """
  target = _TARGET.get()
  if target:
    return target[1]
  return jax.default_backend() == "gpu" and _device_has_block_scaled_gemms()


def block_scaled_format(recipe) -> str | None:
  """``'mxfp8'`` / ``'nvfp4'`` when a block recipe is in a format Blackwell multiplies, else None.

  MXFP8: e4m3/e5m2 elements, blocks of 32 (e8m0 scales); NVFP4: e2m1
  elements, blocks of 16 (e4m3 scales). Other block sizes and the fnuz
  formats are emulated everywhere.
  """
  if recipe.granularity != "block":
    return None
  names = {getattr(recipe, r).dtype for r in ("input", "kernel", "output_grad")}
  if names <= {"float8_e4m3fn", "float8_e5m2"} and recipe.block_size == 32:
    return "mxfp8"
  if names == {"float4_e2m1fn"} and recipe.block_size == 16:
    return "nvfp4"
  return None


def resolve_gemm(recipe) -> str:
  """Resolves ``recipe.gemm='auto'`` against the target backend."""
  if recipe.gemm != "auto":
    return recipe.gemm
  if recipe.granularity == "block":
    return "block" if block_scaled_gemms() and block_scaled_format(recipe) else "bf16"
  return "fp8" if current_backend() == "gpu" else "bf16"


def block_scaled_matmul(a, b, a_scales, b_scales, out_dtype):
  """The block-scaled GEMM ``(B, M, K) x (B, N, K) -> (B, M, N)``.

  ``a_scales`` (B, M, K / block) and ``b_scales`` (B, N, K / block) scale
  blocks of the contracting (last) axis. On a GPU this is
  ``jax.nn.scaled_matmul``, which XLA makes cuDNN's block-scaled dot on
  Blackwell (MXFP8: fp8 elements, e8m0 scales, blocks of 32; NVFP4: e2m1, e4m3,
  16) and a dequantize + bf16 GEMM elsewhere. ``scaled_matmul`` has no CPU or
  TPU lowering, so there it is ``jax.lax.scaled_dot``, XLA's composite of the
  same product (dequantize in bfloat16, one dot): the form tests compare with
  the emulation. The output is ``out_dtype`` on a GPU (cuDNN writes it from
  its float32 accumulator) and float32 elsewhere (the composite would
  otherwise accumulate in ``out_dtype``); cast it.
  """
  if current_backend() == "gpu":
    return jax.nn.scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=out_dtype)
  return jax.lax.scaled_dot(a, b, lhs_scale=a_scales, rhs_scale=b_scales,
                            dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)


def _as_matmul_operand(x, contract, batch, contract_last: bool):
  """Reshapes ``x`` to ``[B?, rows, cols]`` for a plain (batched) matmul.

  Returns the reshaped operand and whether its contracting block comes last.
  A transpose is made only when neither ``(batch, free, contract)`` nor
  ``(batch, contract, free)`` is already ``x``'s layout.
  """
  free = [d for d in range(x.ndim) if d not in contract and d not in batch]
  options = [(list(batch) + free + list(contract), True),
             (list(batch) + list(contract) + free, False)]
  perm, last = next(((p, l) for p, l in options if p == list(range(x.ndim))),
                    options[0] if contract_last else options[1])
  if perm != list(range(x.ndim)):
    x = jnp.transpose(x, perm)
  b = math.prod(x.shape[:len(batch)])
  k = math.prod(x.shape[d] for d in range(x.ndim) if perm[d] in contract)
  f = math.prod(x.shape[d] for d in range(x.ndim) if perm[d] in free)
  shape = (f, k) if last else (k, f)
  return x.reshape(((b,) if batch else ()) + shape), last


def explicit_spec(x):
  """``(sharding, partitions)`` of ``x``'s type on a mesh with ``Explicit`` axes.

  An array placed on no mesh (e.g. a constant made inside ``jit``) gets the
  current mesh (``jax.set_mesh``) and no partitioning. ``None`` when there is no
  explicit mesh (no mesh, an ``Auto`` mesh, ``shard_map``'s manual axes): XLA
  then chooses every sharding.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import lowering
    >>> lowering.explicit_spec(jnp.ones((2, 3))) is None
    True
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return None
    sharding = NamedSharding(mesh, PartitionSpec())
  if AxisType.Explicit not in tuple(sharding.mesh.axis_types):
    return None
  parts = tuple(sharding.spec) + (None,) * (len(jnp.shape(x)) - len(sharding.spec))
  return sharding, parts


def in_context(x):
  """``x`` typed for the mesh code runs on now (``x`` itself where it already is).

  A state closed over by a ``shard_map`` body (MaxText runs its MoE layers
  in one) keeps the type of the mesh outside, whose axes are not the body's
  manual ones; JAX then refuses any operation that copies its type
  (``ones_like``). Read there, it is resharded as replicated on the body's
  mesh (a no-op on its values, and on its cotangent).

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import lowering
    >>> lowering.in_context(jnp.ones((1,))).shape
    (1,)
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = jax.sharding.get_abstract_mesh()
  if (not isinstance(sharding, NamedSharding) or sharding.mesh.empty or mesh.empty
      or sharding.mesh == mesh or AxisType.Manual not in tuple(mesh.axis_types)):
    return x
  return jax.sharding.reshard(x, PartitionSpec())


def reshard_like(t, ref):
  """``t`` with ``ref``'s sharding on an explicit mesh (``t`` itself elsewhere).

  ``t`` has ``ref``'s rank; where ``t`` has size 1 against a larger ``ref``
  dimension (a broadcast scale) that dimension is left unpartitioned.
  """
  ex = explicit_spec(ref)
  if ex is None:
    return t
  parts = tuple(None if t.shape[d] != jnp.shape(ref)[d] else p for d, p in enumerate(ex[1]))
  cur = explicit_spec(t)
  if cur is not None and tuple(cur[1]) == parts:
    return t
  return jax.sharding.reshard(t, ex[0].update(spec=PartitionSpec(*parts)))


def unshard_axis(x, axis: int):
  """``x`` gathered along ``axis`` on an explicit mesh (``x`` itself elsewhere)."""
  ex = explicit_spec(x)
  if ex is None or ex[1][axis] is None:
    return x
  parts = list(ex[1])
  parts[axis] = None
  return jax.sharding.reshard(x, ex[0].update(spec=PartitionSpec(*parts)))


def _axes_of(entry) -> set:
  if entry is None:
    return set()
  return set(entry) if isinstance(entry, tuple) else {entry}


def _sharding(like, parts):
  """A sharding on ``like``'s mesh with ``parts``, no mesh axis used twice."""
  used, clean = set(), []
  for p in parts:
    axes = _axes_of(p)
    # A mesh axis may shard one dimension only: a later dimension that asks for
    # an axis already in use is gathered instead (FSDP's all-gather of a weight).
    clean.append(None if not axes or axes & used else p)
    used |= axes if not axes & used else set()
  return like.update(spec=PartitionSpec(*clean))


def dot_out_sharding(a, b, dn):
  """The output sharding of ``dot_general(a, b, dn)`` on an explicit mesh, else ``None``.

  The specs of the batch, lhs-free and rhs-free dimensions, in that order (what
  JAX infers when the contraction is not sharded); a sharded contraction is
  all-reduced, and a mesh axis already used by an earlier output dimension is
  dropped (so a weight sharded like its activation is gathered, as under FSDP).
  """
  ea, eb = explicit_spec(a), explicit_spec(b)
  if ea is None and eb is None:
    return None
  (ac, bc), (ab, bb) = dn
  pa = ea[1] if ea else (None,) * jnp.ndim(a)
  pb = eb[1] if eb else (None,) * jnp.ndim(b)
  parts = ([pa[i] if pa[i] is not None else pb[j] for i, j in zip(ab, bb)]
           + [pa[d] for d in range(len(pa)) if d not in ac and d not in ab]
           + [pb[d] for d in range(len(pb)) if d not in bc and d not in bb])
  return _sharding((ea or eb)[0], parts)


def conv_out_sharding(lhs, rhs, dn):
  """The output sharding of a convolution on an explicit mesh, else ``None``.

  The batch dimension is sharded like ``lhs``'s, the feature dimension like
  ``rhs``'s output features (unless that mesh axis already shards the batch);
  spatial dimensions are not partitioned. ``dn`` is a
  ``lax.ConvDimensionNumbers``.
  """
  el, er = explicit_spec(lhs), explicit_spec(rhs)
  if el is None and er is None:
    return None
  lhs_spec, rhs_spec, out_spec = dn
  batch = el[1][lhs_spec[0]] if el else None
  feature = er[1][rhs_spec[0]] if er else None
  if _axes_of(feature) & _axes_of(batch):
    feature = None
  parts = [None] * len(out_spec)
  parts[out_spec[0]], parts[out_spec[1]] = batch, feature
  return (el or er)[0].update(spec=PartitionSpec(*parts))


def like_sharding(x, perm):
  """The sharding that ``transpose(y, perm)`` must have to be sharded like ``x``.

  A gradient product computes ``y`` and returns ``transpose(y, perm)`` in the
  layout of operand ``x``; giving ``y`` this sharding makes the gradient sharded
  like ``x`` (``None`` when ``x`` has no explicit sharding).
  """
  ex = explicit_spec(x)
  if ex is None:
    return None
  parts = [None] * len(perm)
  for j, src in enumerate(perm):
    parts[src] = ex[1][j]
  return _sharding(ex[0], parts)


def varying_axes(x) -> frozenset:
  """Mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere, and
  inside ``shard_map(check_vma=False)``, which does not track them)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()) or ())
  return frozenset(getattr(aval, "vma", ()) or ())


def untracked_axes() -> tuple:
  """Manual mesh axes (more than one device) over which JAX does not track what varies.

  Inside ``shard_map(check_vma=False)`` (and ``pmap``, which runs on it) a
  value's type does not say which axes it varies over, so an amax may be one
  device's own, and the gradient of a value the body closes over (the fp8
  state) is summed over these axes when the ``shard_map`` is differentiated
  from outside. Empty elsewhere, and under ``check_vma=True``.
  """
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.empty:
    return ()
  # An axis index varies over its own axis exactly when variance is tracked.
  return tuple(sorted(a for a in getattr(abstract, "manual_axes", ())
                      if abstract.shape[a] > 1
                      and a not in varying_axes(jax.lax.axis_index(a))))


def global_max(a):
  """``a`` max-reduced over the ``shard_map`` axes it varies on (``a`` elsewhere).

  Under ``jit`` an amax over a sharded array is already the global one; inside
  ``shard_map`` each device sees its own shard, and the scale it picks from
  that amax must be the one a single device would pick. Where JAX does not
  track variance (:func:`untracked_axes`) it is max-reduced over those axes
  too: the state is one for every device.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import lowering
    >>> float(lowering.global_max(jnp.float32(3.0)))
    3.0
  """
  axes = varying_axes(a) | set(untracked_axes())
  return jax.lax.pmax(a, tuple(sorted(axes))) if axes else a


def is_code(x) -> bool:
  """Whether ``x`` holds 1-byte codes (fp8, int8, uint8): what a mesh should move of it."""
  return jnp.dtype(jnp.result_type(x)).itemsize == 1


def gemm(a, b, dn, how: str, out_dtype, out_sharding=None):
  """``dot_general`` of two fp8 operands under the lowering ``how``.

  ``out_sharding`` (see :func:`dot_out_sharding`) is passed to the product on
  explicit meshes. On a mesh, operands that are 1-byte codes are gathered or
  sliced as codes before they are upcast
  (:func:`fp8_linen.core.mesh.multiply_codes`).
  """
  if is_code(a) or is_code(b):
    local = lambda a, b, _pa, _pb, sharding: _gemm(a, b, dn, how, out_dtype, sharding)
    return mesh.multiply_codes(a, b, mesh.dot_roles(dn, a.ndim, b.ndim), local,
                               out_sharding=out_sharding)
  return _gemm(a, b, dn, how, out_dtype, out_sharding)


def _gemm(a, b, dn, how: str, out_dtype, out_sharding=None):
  if how == "fp8":
    return lax_dot_general(a, b, dn, preferred_element_type=out_dtype,
                           out_sharding=out_sharding)
  up = jnp.bfloat16 if how == "bf16" else jnp.float32  # fp8 -> bf16 is exact
  a, b = a.astype(up), b.astype(up)
  if up == jnp.float32 or out_sharding is not None:
    # Explicitly sharded operands keep their layout: a reshape that merged a
    # sharded dimension would need its own resharding.
    return lax_dot_general(a, b, dn, preferred_element_type=jnp.float32,
                           out_sharding=out_sharding)
  # XLA:CPU has a bf16 x bf16 -> f32 kernel only for plain (batched) matmul
  # layouts; express every product as one, then restore dot_general's output
  # layout (batch, lhs free, rhs free).
  (ac, bc), (ab, bb) = dn
  out_shape = ([a.shape[d] for d in ab]
               + [a.shape[d] for d in range(a.ndim) if d not in ac and d not in ab]
               + [b.shape[d] for d in range(b.ndim) if d not in bc and d not in bb])
  a3, a_last = _as_matmul_operand(a, ac, ab, contract_last=True)
  b3, b_last = _as_matmul_operand(b, bc, bb, contract_last=False)
  nb = 1 if ab else 0
  dn3 = (((nb + (1 if a_last else 0),), (nb + (1 if b_last else 0),)),
         (((0,), (0,)) if ab else ((), ())))
  y = lax_dot_general(a3, b3, dn3, preferred_element_type=jnp.float32)
  return y.reshape(out_shape)


def scaled(y, scale, out_dtype):
  """Applies a scalar scale to a GEMM output and casts it."""
  return (y * jnp.reshape(scale, ()).astype(y.dtype)).astype(out_dtype)


def grad_gemm(g, other, dn, lhs_ndim: int, rhs_ndim: int, wrt: str, how: str, out_dtype,
              scale, like=None):
  """One gradient GEMM of ``dot_general(lhs, rhs, dn)``: w.r.t. ``wrt``, given ``g``.

  ``other`` is the operand that is not differentiated; ``scale`` (scalar)
  multiplies the GEMM's output before the cast to ``out_dtype``. ``like`` is
  the differentiated operand (or its fp8 copy): on an explicit mesh the
  gradient is sharded like it.
  """
  gdn, g_first, perm = dims.grad_dims(dn, lhs_ndim, rhs_ndim, wrt)
  a, b = (g, other) if g_first else (other, g)
  out_sharding = None if like is None else like_sharding(like, perm)
  y = scaled(gemm(a, b, gdn, how, out_dtype, out_sharding), scale, out_dtype)
  return jnp.transpose(y, perm)


def relayout(t, pairs, dst_ndim: int):
  """``t`` (size 1 off the listed axes) moved along ``(src, dst)`` pairs into ``dst_ndim`` axes."""
  squeeze, perm, shape = dims.relayout_axes(t.shape, pairs, dst_ndim)
  return jnp.transpose(jnp.squeeze(t, axis=squeeze), perm).reshape(shape)


def relayout_like(t, pairs, ref):
  """:func:`relayout` into ``ref``'s layout, sharded to broadcast against ``ref``."""
  return reshard_like(relayout(t, pairs, ref.ndim), ref)


def compute_dtype_for(rhs, rhs_compute_dtype, owner: str):
  """The dtype a weight ``rhs`` is quantized in: ``rhs_compute_dtype``, else its own.

  ``rhs_compute_dtype`` other than ``rhs.dtype``: ``rhs`` is a layer's
  parameter handed uncast, and the product's values are those of
  ``rhs.astype(rhs_compute_dtype)``.

  Raises:
    TypeError: (naming ``owner``) if ``rhs_compute_dtype`` is not a floating dtype.
  """
  compute = jnp.dtype(rhs.dtype if rhs_compute_dtype is None else rhs_compute_dtype)
  if not jnp.issubdtype(compute, jnp.floating):
    raise TypeError(f"{owner}: rhs_compute_dtype must be a floating dtype, got "
                    f"{rhs_compute_dtype!r}")
  return compute


def grad_dtype_for(rhs, rhs_grad_dtype):
  """``rhs_grad_dtype`` as a spec holds it: a floating dtype other than ``rhs``'s, or ``None``.

  Only where a GPU is traced for: XLA:GPU drops the cast pair the wider GEMM
  output makes (its excess precision); XLA:CPU keeps it (a wider output to
  round, measured a few percent slower), and XLA:TPU already fuses the cast
  into the GEMM's output. And only for a weight on one device: on a mesh
  XLA reduces the weight's gradient across devices in the dtype the GEMM
  writes, and a float32 reduction moves twice the bytes of the bfloat16 one
  the unquantized model's step makes (8 x H100, compile only).

  Raises:
    TypeError: if ``rhs_grad_dtype`` is not a floating dtype.
  """
  if rhs_grad_dtype is None:
    return None
  dt = jnp.dtype(rhs_grad_dtype)
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"rhs_grad_dtype must be a floating dtype, got {dt}")
  if dt == jnp.dtype(rhs.dtype) or current_backend() != "gpu" or on_mesh(rhs):
    return None
  return dt


def on_mesh(x) -> bool:
  """Whether ``x`` is traced over more than one device (``jit`` over a mesh, ``shard_map``).

  Read from ``x``'s type (its sharding's mesh), else from the mesh in
  context (``mesh.mesh_of``), so that a value traced on one device is told
  apart from a sharded one at trace time, before XLA partitions the program.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import lowering
    >>> lowering.on_mesh(jnp.ones(3))
    False
  """
  m = mesh.mesh_of(x)
  return m is not None and math.prod(m.axis_sizes) > 1
