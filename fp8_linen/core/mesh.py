"""On a mesh, the operands of a low-precision product move as their 1-byte codes.

A product's operands often live elsewhere than the product needs them: FSDP
shards a weight over the axis that also shards the batch, so each device
gathers the weight before multiplying; a tensor-parallel layer may need a
slice of the other operand. XLA moves an operand at the point where the
product consumes it, and there an fp8 or int8 operand has usually stopped
being codes: it was upcast to bfloat16 for the GEMM (XLA:CPU widens even a
plain fp8 or bf16 collective to 16 or 32 bits), or dequantized with its
per-channel scales (the weight of an integer gradient GEMM). The gather then
moves 2 to 4 bytes an element where the codes hold 1.

:func:`multiply_codes` runs a product of codes so that whatever moves, moves
before the codes become GEMM operands:

* on a mesh with ``Explicit`` axes every operand's sharding is in its type: the
  codes are resharded (as raw bytes) to the layout the product needs
  (:func:`plan`), then turned into operands and multiplied;
* on an ``Auto`` mesh shardings are chosen by XLA after tracing, so the
  product is a ``custom_partitioning`` op (Shardy picks its output sharding
  from the model, as for any dot): at compile time it reads its operands'
  shardings, asks for the codes in the layout :func:`plan` gives (so the
  partitioner gathers or slices the codes, as bytes), and runs the local
  product on each device, reducing partial sums over a sharded contraction
  (a reduce-scatter where the output wants that axis, else an all-reduce);
* elsewhere (one device, inside ``shard_map``, under ``vmap``, GSPMD instead
  of Shardy) it is the plain product.

The weight a layer gathers for its forward product is needed again by its
input-gradient product. Both read the very same bytes (the residual is the
forward's bytes, :func:`sharing_bytes`) and ask for the same layout, so the
partitioner reuses one gather: each weight moves once per step, as codes.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import mesh
  >>> roles = mesh.dot_roles((((1,), (0,)), ((), ())), 2, 2)
  >>> ta, tb, out, partial = mesh.plan(roles, ('data', None), ('data', None))
  >>> ta, tb, out  # FSDP: the weight is gathered, the batch stays sharded
  (('data', None), (None, None), ('data', None))
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

__all__ = ["Roles", "dot_roles", "conv_roles", "plan", "multiply_codes", "sharded_zeros",
           "as_bytes", "from_bytes", "sharing_bytes", "one_device_of", "placed_on", "mesh_of"]


class Roles(NamedTuple):
  """What each dimension of a product's operands and output is.

  Entries: ``('batch', i)`` (a batch dimension pair, in the output),
  ``('contract', i)`` (a contracting pair), ``('free', None)`` (an operand's
  own dimension that reaches the output), ``('spatial', None)`` (a convolution
  window dimension: kept whole on every device). ``out`` lists, per output
  dimension, ``('batch', i)``, ``('lhs', d)``, ``('rhs', d)`` or
  ``('spatial', None)``.
  """

  lhs: tuple
  rhs: tuple
  out: tuple


def dot_roles(dn, lhs_ndim: int, rhs_ndim: int) -> Roles:
  """The :class:`Roles` of ``dot_general(lhs, rhs, dn)``."""
  (lc, rc), (lb, rb) = dn
  def side(ndim, contract, batch):
    return tuple(("contract", contract.index(d)) if d in contract else
                 ("batch", batch.index(d)) if d in batch else ("free", None)
                 for d in range(ndim))
  lhs, rhs = side(lhs_ndim, tuple(lc), tuple(lb)), side(rhs_ndim, tuple(rc), tuple(rb))
  out = ([("batch", i) for i in range(len(lb))]
         + [("lhs", d) for d in range(lhs_ndim) if lhs[d][0] == "free"]
         + [("rhs", d) for d in range(rhs_ndim) if rhs[d][0] == "free"])
  return Roles(lhs, rhs, tuple(out))


def conv_roles(cdn, ndim: int, which: str = "forward") -> Roles:
  """The :class:`Roles` of a convolution with ``lax.ConvDimensionNumbers`` ``cdn``.

  ``which='forward'``: ``conv(x, w)`` (the batch and the output features
  free, the input features contracted, the windows spatial); ``'dgrad'``:
  the input gradient from ``(g, w)`` (in ``x``'s layout, the output features
  contracted); ``'wgrad'``: the kernel gradient from ``(x, g)`` (in ``w``'s
  layout, the batch contracted). Grouped convolutions are not described.
  """
  (x_n, x_c), (w_o, w_i), (y_n, y_o) = cdn.lhs_spec[:2], cdn.rhs_spec[:2], cdn.out_spec[:2]
  spatial = [("spatial", None)] * ndim

  def roles(pairs):
    r = list(spatial)
    for d, role in pairs:
      r[d] = role
    return tuple(r)

  free, k = ("free", None), ("contract", 0)
  if which == "forward":
    return Roles(roles([(x_n, free), (x_c, k)]), roles([(w_o, free), (w_i, k)]),
                 roles([(y_n, ("lhs", x_n)), (y_o, ("rhs", w_o))]))
  if which == "dgrad":
    return Roles(roles([(y_n, free), (y_o, k)]), roles([(w_o, k), (w_i, free)]),
                 roles([(x_n, ("lhs", y_n)), (x_c, ("rhs", w_i))]))
  if which == "wgrad":
    return Roles(roles([(x_n, k), (x_c, free)]), roles([(y_n, k), (y_o, free)]),
                 roles([(w_o, ("rhs", y_o)), (w_i, ("lhs", x_c))]))
  raise ValueError(f"conv_roles: which={which!r} must be 'forward', 'dgrad' or 'wgrad'")


def _axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entries(spec, ndim: int) -> tuple:
  spec = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
  return tuple(None if not _axes(e) else (e if isinstance(e, str) or len(_axes(e)) > 1
                                          else _axes(e)[0]) for e in spec)


def plan(roles: Roles, lhs_spec, rhs_spec, out_spec=None):
  """Where the operands of a product must be, given where they are.

  The choices XLA's partitioner makes for a dot, made on the codes:

  1. a batch pair keeps its axes when both operands agree (or one is
     unsharded there);
  2. a contraction both operands shard alike stays sharded: each device
     multiplies its slice and the partial products are reduced;
  3. every free dimension keeps its axes, those the output asks for
     (``out_spec``) first, then the left operand's, unless an earlier
     dimension took them (a mesh axis shards one dimension of the output):
     FSDP's weight, whose contraction is sharded over the batch's axis, is
     gathered;
  4. a contraction only one operand shards stays sharded when the other does
     not use those axes at all (slicing that one moves nothing);
  5. window dimensions are gathered.

  Args:
    roles: the product's :class:`Roles`.
    lhs_spec: the left operand's partition spec entries (one per dimension).
    rhs_spec: the right operand's.
    out_spec: the output's wanted spec entries, if any (a gradient sharded
      like its operand): where two free dimensions want one axis, the one the
      output keeps it on wins.

  Returns:
    ``(lhs_target, rhs_target, out, partial)``: the operands' specs, the
    output's spec and the mesh axes the output is a partial sum over (the
    sharded contractions).
  """
  sa, sb = _entries(lhs_spec, len(roles.lhs)), _entries(rhs_spec, len(roles.rhs))
  ta, tb = [None] * len(sa), [None] * len(sb)
  used: set = set()

  def take(entry):
    axes = set(_axes(entry))
    if not axes or axes & used:
      return None
    used.update(axes)
    return entry

  def pairs(kind):
    left = {r[1]: d for d, r in enumerate(roles.lhs) if r[0] == kind}
    right = {r[1]: d for d, r in enumerate(roles.rhs) if r[0] == kind}
    return [(left[i], right[i]) for i in sorted(left) if i in right]

  for i, j in pairs("batch"):
    e = sa[i] if sa[i] == sb[j] or sb[j] is None else (sb[j] if sa[i] is None else None)
    ta[i] = tb[j] = take(e)
  for i, j in pairs("contract"):
    if sa[i] is not None and sa[i] == sb[j]:
      ta[i] = tb[j] = take(sa[i])
  if out_spec is not None:
    for want, r in zip(_entries(out_spec, len(roles.out)), roles.out):
      if r[0] == "lhs" and want is not None and sa[r[1]] == want:
        ta[r[1]] = take(want)
      elif r[0] == "rhs" and want is not None and sb[r[1]] == want:
        tb[r[1]] = take(want)
  for d, r in enumerate(roles.lhs):
    if r[0] == "free" and ta[d] is None:
      ta[d] = take(sa[d])
  for d, r in enumerate(roles.rhs):
    if r[0] == "free" and tb[d] is None:
      tb[d] = take(sb[d])
  all_a = {a for e in sa for a in _axes(e)}
  all_b = {a for e in sb for a in _axes(e)}
  for i, j in pairs("contract"):
    if ta[i] is None:
      if sb[j] is None and sa[i] is not None and not set(_axes(sa[i])) & all_b:
        ta[i] = tb[j] = take(sa[i])
      elif sa[i] is None and sb[j] is not None and not set(_axes(sb[j])) & all_a:
        ta[i] = tb[j] = take(sb[j])
  out = []
  for r in roles.out:
    if r[0] == "batch":
      out.append(ta[pairs("batch")[r[1]][0]])
    elif r[0] == "lhs":
      out.append(ta[r[1]])
    elif r[0] == "rhs":
      out.append(tb[r[1]])
    else:
      out.append(None)
  partial = tuple(a for i, _ in pairs("contract") for a in _axes(ta[i]))
  return tuple(ta), tuple(tb), tuple(out), partial


# id(codes) -> (codes, bytes) while one product's forward or backward is traced
# (:func:`sharing_bytes`).
_SHARED: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_shared_bytes", default=None)


@contextlib.contextmanager
def sharing_bytes():
  """Within the block, :func:`as_bytes` of one array is one array, and undoes :func:`from_bytes`.

  A product's forward GEMM gathers its weight's codes and its gradient GEMM
  gathers them again; the partitioner does that once when both read the very
  same value. The forward GEMM, the saved residual and (in the backward
  trace) the gradient GEMM therefore all use the bytes this block hands out
  for an array, instead of a fresh ``bitcast_convert_type`` each.
  """
  token = _SHARED.set({})
  try:
    yield
  finally:
    _SHARED.reset(token)


def sharded_zeros(shape, dtype, sharding=None):
  """Zeros of ``shape`` and ``dtype`` with ``sharding`` (``None``: no sharding asked for).

  The point a gradient product of a convolution is linearized at: those
  products are transposes (``jax.vjp``) of the convolution, which is linear
  in the operand they differentiate, so any point of that operand's type
  serves, and their result takes the point's sharding (on an explicit mesh,
  that of the operand they differentiate).
  """
  z = jnp.zeros(shape, dtype)
  return z if sharding is None else jax.sharding.reshard(z, sharding)


def as_bytes(x):
  """A 1-byte float array as ``uint8`` (XLA:CPU widens float collectives; bytes move as bytes).

  Other arrays are returned as they are.
  """
  shared = _SHARED.get()
  if shared is not None and id(x) in shared and shared[id(x)][0] is x:
    return shared[id(x)][1]
  # 8-bit floats only: a 4-bit float (NVFP4's e2m1) has no same-shape uint8 view.
  if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 8:
    b = lax.bitcast_convert_type(x, jnp.uint8)
  else:
    b = x
  if shared is not None:
    shared[id(x)] = (x, b)
  return b


def from_bytes(b, dtype):
  """Inverse of :func:`as_bytes`: ``b`` read as ``dtype``."""
  x = b if b.dtype == jnp.dtype(dtype) else lax.bitcast_convert_type(b, dtype)
  shared = _SHARED.get()
  if shared is not None:
    shared[id(x)] = (x, b)
  return x


def mesh_of(*xs):
  """The (abstract) mesh of the first operand that has one, else the current mesh (or None)."""
  for x in xs:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty:
      return mesh
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def _spec_of(x):
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  return _entries(spec if spec is not None else (), x.ndim)


def _param_spec(param, codes, target):
  """A parameter broadcast against ``codes`` follows the codes' target where it spans a dimension."""
  return tuple(t if param.shape[d] == codes.shape[d] and param.shape[d] > 1 else None
               for d, t in enumerate(target))


def _factors(roles: Roles, a, b, a_params, b_params) -> str:
  """The Shardy sharding rule of the product (einsum-like factors)."""
  fresh = iter(range(10 ** 6))
  def name(r, side, d):
    if r[0] in ("batch", "contract"):
      return f"{r[0][0]}{r[1]}"
    if r[0] == "free":
      return f"{side}{d}"
    return f"s{next(fresh)}"
  la = [name(r, "l", d) for d, r in enumerate(roles.lhs)]
  lb = [name(r, "r", d) for d, r in enumerate(roles.rhs)]
  def params(ps, codes, names):
    return [" ".join(names[d] if p.shape[d] == codes.shape[d] and p.shape[d] > 1
                     else f"s{next(fresh)}" for d in range(p.ndim)) for p in ps]
  outs = []
  for r in roles.out:
    if r[0] == "batch":
      outs.append(f"b{r[1]}")
    elif r[0] == "lhs":
      outs.append(la[r[1]])
    elif r[0] == "rhs":
      outs.append(lb[r[1]])
    else:
      outs.append(f"s{next(fresh)}")
  operands = [" ".join(la), " ".join(lb)] + params(a_params, a, la) + params(b_params, b, lb)
  return ", ".join(operands) + " -> " + " ".join(outs)


# Platforms whose compilers call back into custom_partitioning. libtpu's
# compile-only topologies do not ("Custom emitter for CustomSPMDPartitioning
# not found"); XLA:TPU moves converts behind its gathers itself, so an fp8
# weight is gathered as fp8 there anyway.
_PARTITIONER_PLATFORMS = ("cpu", "cuda", "rocm", "gpu")


def _auto_mesh(mesh) -> bool:
  if mesh is None or math.prod(mesh.axis_sizes) <= 1:
    return False
  if not jax.config.jax_use_shardy_partitioner:
    return False
  platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
  if platform not in _PARTITIONER_PLATFORMS:
    return False
  return all(t == AxisType.Auto for t in mesh.axis_types)


def _explicit_mesh(mesh) -> bool:
  return (mesh is not None and math.prod(mesh.axis_sizes) > 1
          and AxisType.Explicit in tuple(mesh.axis_types)
          and AxisType.Manual not in tuple(mesh.axis_types))


def _reshard(x, mesh, target):
  sharding = NamedSharding(mesh, PartitionSpec(*target))
  return jax.sharding.reshard(x, sharding)


def multiply_codes(lhs, rhs, roles: Roles, local: Callable, *, lhs_params: Sequence = (),
                   rhs_params: Sequence = (), out_sharding=None):
  """``local(lhs, rhs, lhs_params, rhs_params, out_sharding)``, the codes moved first.

  See the module doc.

  Args:
    lhs: the left operand's codes (1-byte floats or integers; any other dtype
      is passed through as is).
    rhs: the right operand's codes.
    roles: the product's :class:`Roles` (:func:`dot_roles`, :func:`conv_roles`).
    local: the product of codes that share a layout:
      ``fn(lhs, rhs, lhs_params, rhs_params, out_sharding) -> y``; it turns the
      codes into GEMM operands (upcast, dequantize with the parameters) and
      multiplies them.
    lhs_params: small arrays ``local`` reads with ``lhs`` (per-channel scales),
      broadcastable against it with its rank.
    rhs_params: the same for ``rhs``.
    out_sharding: the output sharding on an explicit mesh (else ``None``).

  Returns:
    The product.
  """
  lhs_params, rhs_params = tuple(lhs_params), tuple(rhs_params)
  mesh = mesh_of(lhs, rhs)
  if _explicit_mesh(mesh):
    want = None if out_sharding is None else tuple(out_sharding.spec)
    ta, tb, _, _ = plan(roles, _spec_of(lhs), _spec_of(rhs), want)
    if ta != _spec_of(lhs):
      lhs = from_bytes(_reshard(as_bytes(lhs), mesh, ta), lhs.dtype)
      lhs_params = tuple(_reshard(p, mesh, _param_spec(p, lhs, ta)) for p in lhs_params)
    if tb != _spec_of(rhs):
      rhs = from_bytes(_reshard(as_bytes(rhs), mesh, tb), rhs.dtype)
      rhs_params = tuple(_reshard(p, mesh, _param_spec(p, rhs, tb)) for p in rhs_params)
    return local(lhs, rhs, lhs_params, rhs_params, out_sharding)
  if _auto_mesh(mesh) and not _in_manual_context(lhs, rhs):
    try:
      return _partitioned(lhs, rhs, roles, local, lhs_params, rhs_params)
    except NotImplementedError:  # vmap: custom_partitioning has no batching rule
      pass
  return local(lhs, rhs, lhs_params, rhs_params, out_sharding)


def _in_manual_context(*xs) -> bool:
  """Inside ``shard_map`` (some mesh axis is manual): each device runs its own product."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and AxisType.Manual in tuple(mesh.axis_types):
    return True
  for x in xs:
    aval = jax.typeof(x)
    if getattr(aval, "vma", None):
      return True
  return False


def _partitioned(lhs, rhs, roles, local, lhs_params, rhs_params):
  """The product as a ``custom_partitioning`` op (Auto meshes; see the module doc)."""
  from jax.experimental.custom_partitioning import custom_partitioning  # pylint: disable=import-outside-toplevel

  dtypes = (lhs.dtype, rhs.dtype)
  na, nb = len(lhs_params), len(rhs_params)

  def unpack(args):
    a, b = from_bytes(args[0], dtypes[0]), from_bytes(args[1], dtypes[1])
    return a, b, tuple(args[2:2 + na]), tuple(args[2 + na:])

  @custom_partitioning
  def op(*args):
    a, b, pa, pb = unpack(args)
    return local(a, b, pa, pb, None)

  def partition(mesh, arg_shapes, result_shape):
    a_s, b_s = arg_shapes[0], arg_shapes[1]
    want = _entries(result_shape.sharding.spec, len(roles.out))
    ta, tb, out, partial = plan(roles, a_s.sharding.spec, b_s.sharding.spec, want)
    out, scatters, sums = list(out), [], []
    for axis in partial:
      dims = [d for d, e in enumerate(want) if e == axis and out[d] is None
              and result_shape.shape[d] % mesh.shape[axis] == 0]
      if dims:
        scatters.append((axis, dims[0]))
        out[dims[0]] = axis
      else:
        sums.append(axis)
    sh = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))
    arg_shardings = ((sh(ta), sh(tb))
                     + tuple(sh(_param_spec(p, a_s, ta)) for p in arg_shapes[2:2 + na])
                     + tuple(sh(_param_spec(p, b_s, tb)) for p in arg_shapes[2 + na:]))

    def lower(*args):
      a, b, pa, pb = unpack(args)
      y = local(a, b, pa, pb, None)
      for axis, d in scatters:
        y = lax.psum_scatter(y, axis, scatter_dimension=d, tiled=True)
      return lax.psum(y, tuple(sums)) if sums else y

    return mesh, lower, sh(out), arg_shardings

  op.def_partition(partition=partition,
                   sharding_rule=_factors(roles, lhs, rhs, lhs_params, rhs_params))
  return op(as_bytes(lhs), as_bytes(rhs), *lhs_params, *rhs_params)


def one_device_of(tree) -> jax.Device | None:
  """The one device every array of ``tree`` is committed to, else None (tracers,
  uncommitted or sharded arrays: their placement is the caller's)."""
  devices = set()
  for a in jax.tree.leaves(tree):
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
      return None
    if not a.committed or len(a.sharding.device_set) != 1:
      return None
    devices |= a.sharding.device_set
  return devices.pop() if len(devices) == 1 else None


def placed_on(tree, device):
  """``tree``'s concrete arrays committed to ``device`` (``None``: ``tree`` as it is).

  A precision switch's fresh quantization state is not committed to a device
  while the trained parameters are; a jitted step fed that mix compiles once
  for it and again for the all-committed state it returns.
  """
  if device is None:
    return tree
  return jax.tree.map(
      lambda a: a if isinstance(a, jax.core.Tracer) else jax.device_put(a, device), tree)

