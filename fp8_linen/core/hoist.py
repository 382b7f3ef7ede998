"""Work that depends only on a loop's invariant inputs, computed once before the loop.

A gradient-accumulation loop runs one function over micro-batches while the
model's variables stay fixed. Each iteration of a quantized model's step casts
every weight to its low-precision codes (and takes its amax, and transposes
it) although none of that changes within the window, and XLA leaves those
passes in the loop (compiled for an H100: docs/known_limits.md). :func:`split` traces
the function once and splits its program in two: the equations whose inputs
are all invariant (the variables, the closure's constants, or another such
equation's outputs) run once, before the loop, and the rest (the loop body)
reads their results. The values are the same: the same equations run on the
same inputs, once instead of every iteration.

Left in the body: equations with side effects, casts to fp8 on TPU (see
:func:`_stays`), and equations whose outputs are larger than their inputs (a
broadcast of a constant to a batch's shape, an iota): computing those once
would keep a large array alive through the loop to save a cheap pass. What is
hoisted is kept alive for the whole loop (a weight's fp8 codes in both
layouts: about 2 bytes per parameter).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fp8_linen.core import hoist
  >>> f = lambda w, x: jnp.dot(x, jnp.tanh(w))
  >>> s = hoist.split(f, jnp.ones((3, 2)), jnp.ones((4, 3)))
  >>> [str(p) for p in s.hoisted_primitives]
  ['tanh']
  >>> pre = s.prologue(jnp.ones((3, 2)))
  >>> s.body(jnp.ones((3, 2)), pre, jnp.ones((4, 3))).shape
  (4, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.extend import core as jex

from fp8_linen.core import lowering

__all__ = ["Split", "split", "accumulate", "filled", "hoist_by_default", "window_programs",
           "window_call", "WindowClock"]

_SMALL = 1 << 12  # bytes: a result this small may be carried whatever made it


def _nbytes(v) -> int:
  aval = getattr(v, "aval", None)
  shape = getattr(aval, "shape", ())
  try:
    size = np.dtype(aval.dtype).itemsize
  except (TypeError, AttributeError):
    size = 8  # PRNG keys and tokens: small
  return int(np.prod(shape, dtype=np.int64)) * size


def _partition(jaxpr, roots) -> set:
  """Indices of the equations of ``jaxpr`` that read only ``roots`` (invariant variables).

  Every effect-free equation on invariant values is early, unless its result
  would be carried into the loop and is larger than every invariant input it
  derives from (a broadcast or an iota of a scalar; an upcast of a parameter
  the loop reads): such an equation, and what reads it, stays in the loop.
  """
  made_by = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  banned = {i for i, e in enumerate(jaxpr.eqns) if _stays(e)}
  while True:
    source = {v: _nbytes(v) for v in roots}
    early = set()
    for i, eqn in enumerate(jaxpr.eqns):
      ins = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
      if i not in banned and not eqn.effects and all(v in source for v in ins):
        early.add(i)
        source.update({v: max([source[u] for u in ins], default=0) for v in eqn.outvars})
    sink = {made_by[v] for v in _carried(jaxpr, early, made_by)
            if _nbytes(v) > max(source[v], _SMALL)}
    if not sink:
      return early
    banned |= sink


def _narrow_float(dtype) -> bool:
  return jax.numpy.issubdtype(dtype, jax.numpy.floating) and np.dtype(dtype).itemsize == 1


def _stays(eqn) -> bool:
  """Whether ``eqn`` stays in the loop whatever it reads: on TPU, a cast to fp8.

  Compiled for TPU7x, weight codes made before the loop were widened to bf16
  by XLA:TPU, and two of the three GEMMs multiplied bf16 (at half the fp8
  rate); with the cast in the loop (of the scaled, clipped weight made before
  it) XLA fuses it into the GEMM's operand and multiplies fp8. Integer codes
  are not affected (int8 GEMMs stayed s8 on TPU v5e).
  """
  return (lowering.current_backend() == "tpu" and eqn.primitive.name != "bitcast_convert_type"
          and any(_narrow_float(v.aval.dtype) for v in eqn.outvars))


def _rewrite(eqns, roots) -> list:
  """``eqns`` with each partly invariant ``scan`` split in two (:func:`_split_scan`), each
  ``jax.checkpoint`` region's invariant work moved in front of it (:func:`_split_remat`) and
  each plain ``jax.jit`` call inlined (:func:`_inline_jit`)."""
  out, invariant, todo = [], set(roots), list(reversed(eqns))
  while todo:
    eqn = todo.pop()
    ins = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
    if not eqn.effects and all(v in invariant for v in ins):
      invariant.update(eqn.outvars)
      out.append(eqn)
      continue
    if eqn.primitive.name in ("jit", "pjit") and not eqn.effects:
      inlined = _inline_jit(eqn)
      if inlined is not None:
        todo.extend(reversed(inlined))  # (read again: some may be invariant now)
        continue
    split_one = _SPLITTERS.get(eqn.primitive.name)
    parts = split_one(eqn, invariant) if split_one and not eqn.effects else None
    if parts is None:
      out.append(eqn)
    else:
      for e in parts[:-1]:
        invariant.update(e.outvars)
      out += parts
  return out


def _inline_jit(eqn):
  """The equations of a ``jax.jit`` call that reads invariant and varying inputs, inlined.

  XLA inlines such a call anyway; inlined, the work in it that reads only the
  invariant inputs can leave the loop (a ``grad_fn`` wrapped in ``jax.jit``).
  Its variables are renamed, since one traced function can be called twice.
  None for a call that pins shardings or layouts, donates, sets compiler
  options or closes over constants: those stay calls.
  """
  p = eqn.params
  closed = p["jaxpr"]
  pinned = [s for s in (*p.get("in_shardings", ()), *p.get("out_shardings", ()))
            if type(s).__name__ != "UnspecifiedValue"]
  if (closed.consts or pinned or any(p.get("donated_invars", ())) or p.get("compiler_options_kvs")
      or any(l is not None for l in (*p.get("in_layouts", ()), *p.get("out_layouts", ())))):
    return None
  inner = closed.jaxpr
  env = dict(zip(inner.invars, eqn.invars))
  named = {}
  for iv, ov in zip(inner.outvars, eqn.outvars):
    if isinstance(iv, jex.Literal) or iv in env or iv in named:
      return None  # (an output that is an input, a constant or another output)
    named[iv] = ov
  out = []
  for e in inner.eqns:
    ins = [v if isinstance(v, jex.Literal) else env.get(v, v) for v in e.invars]
    outs = []
    for v in e.outvars:
      new = v if isinstance(v, jex.DropVar) else named.get(v) or jex.Var(v.aval)
      env[v] = new
      outs.append(new)
    out.append(e.replace(invars=ins, outvars=outs))
  return out


def _inner(body, roots):
  """``(rewritten body, early indices, carried)`` of a nested jaxpr with invariant ``roots``."""
  inner = _jaxpr(body, body.constvars, body.invars, body.outvars, _rewrite(body.eqns, roots),
                 body.effects)
  early = _partition(inner, roots)
  made_by = {v: i for i, e in enumerate(inner.eqns) for v in e.outvars}
  return inner, early, _carried(inner, early, made_by)


def _split_remat(eqn, invariant: set):
  """The invariant work of a ``jax.checkpoint`` region, moved in front of it.

  ``(*early, region)``: the region's equations that read only invariant
  inputs, now outside it, and the region reading their results as extra
  inputs. A rematerialized layer (``nn.remat``) recomputes its forward in the
  backward pass; its weights' codes need not be recomputed with it. None
  when the region has no such work.
  """
  body = eqn.params["jaxpr"]
  if body.constvars:
    return None
  fixed = [isinstance(v, jex.Literal) or v in invariant for v in eqn.invars]
  roots = {bv for bv, f in zip(body.invars, fixed) if f}
  inner, early, carried = _inner(body, roots)
  if not carried:
    return None
  outer = {bv: v for bv, v in zip(body.invars, eqn.invars)}
  moved = [e.replace(invars=[v if isinstance(v, jex.Literal) else outer.get(v, v)
                             for v in e.invars])
           for i, e in enumerate(inner.eqns) if i in early]
  rest = _jaxpr(body, [], list(body.invars) + carried, body.outvars,
                [e for i, e in enumerate(inner.eqns) if i not in early], body.effects)
  return (*moved, eqn.replace(invars=list(eqn.invars) + carried,
                              params=dict(eqn.params, jaxpr=rest)))


def _linear(params: dict, linear: tuple) -> dict:
  # Versions of JAX whose scan records which inputs are linear need one flag per input.
  return dict(params, linear=linear) if "linear" in params else params


def _split_scan(eqn, invariant: set):
  """``(a, b)``: a scan of the invariant work of ``eqn``'s body, and ``eqn`` reading its results.

  A scan over stacked layers (``nn.scan``) reads each layer's weights as a
  slice of its ``xs``: those slices are invariant in the outer loop although
  they change from layer to layer. ``a`` scans over the invariant consts and
  ``xs`` alone and stacks what the body computes from them (each layer's
  codes); ``b`` is the original scan, reading those as extra ``xs``. None when
  the body has no such work.
  """
  p = eqn.params
  closed = p["jaxpr"]
  body = closed.jaxpr
  nc, ncarry = p["num_consts"], p["num_carry"]
  fixed = [(i < nc or i >= nc + ncarry) and (isinstance(v, jex.Literal) or v in invariant)
           for i, v in enumerate(eqn.invars)]
  roots = set(body.constvars) | {bv for bv, f in zip(body.invars, fixed) if f}
  inner, early, carried = _inner(body, roots)
  if not carried:
    return None
  consts = [i for i in range(nc) if fixed[i]]
  xs = [i for i in range(nc + ncarry, len(fixed)) if fixed[i]]
  a_body = _jaxpr(body, body.constvars, [body.invars[i] for i in consts + xs], carried,
                  [e for i, e in enumerate(inner.eqns) if i in early], jex.no_effects)
  stacked = [jex.Var(v.aval.update(shape=(p["length"], *v.aval.shape))) for v in carried]
  a = jex.new_jaxpr_eqn(
      [eqn.invars[i] for i in consts + xs], stacked, eqn.primitive,
      _linear(dict(p, jaxpr=jex.ClosedJaxpr(a_body, closed.consts), num_consts=len(consts),
                   num_carry=0), (False,) * (len(consts) + len(xs))),
      jex.no_effects, eqn.source_info, eqn.ctx)
  b_body = _jaxpr(body, body.constvars, list(body.invars) + carried, body.outvars,
                  [e for i, e in enumerate(inner.eqns) if i not in early], body.effects)
  b = eqn.replace(invars=list(eqn.invars) + stacked,
                  params=_linear(dict(p, jaxpr=jex.ClosedJaxpr(b_body, closed.consts)),
                                 tuple(p.get("linear", ())) + (False,) * len(carried)))
  return a, b


# Equations with a nested program whose invariant work can be moved out.
_SPLITTERS = {"scan": _split_scan, "checkpoint": _split_remat, "remat2": _split_remat}


def _carried(jaxpr, early: set, made_by: dict) -> list:
  """The early equations' results that late equations or the outputs read, in order."""
  used = [v for i, e in enumerate(jaxpr.eqns) if i not in early for v in e.invars]
  used += list(jaxpr.outvars)
  seen, out = set(), []
  for v in used:
    if not isinstance(v, jex.Literal) and made_by.get(v) in early and v not in seen:
      seen.add(v)
      out.append(v)
  return out


def _jaxpr(like, constvars, invars, outvars, eqns, effects):
  """A Jaxpr with ``like``'s debug info, its names dropped (the signature is new)."""
  info = like.debug_info
  if info is not None:
    info = info._replace(arg_names=None, result_paths=None)
  return jex.Jaxpr(constvars, invars, outvars, eqns, effects, info)


@dataclasses.dataclass(frozen=True)
class Split:
  """A function's program split into a prologue and a loop body.

  Attributes:
    prologue: ``prologue(invariant) -> hoisted`` (a tuple of arrays): every
      equation that reads only ``invariant`` and constants.
    body: ``body(invariant, hoisted, x) -> fn(invariant, x)``: the rest.
    hoisted_primitives: the primitives moved into the prologue, in order.
    hoisted_bytes: the bytes of ``hoisted``, kept alive through the loop.
    out_shape: ``fn``'s output as a pytree of ``jax.ShapeDtypeStruct``.
  """

  prologue: Callable[[Any], tuple]
  body: Callable[[Any, tuple, Any], Any]
  hoisted_primitives: tuple
  hoisted_bytes: int
  out_shape: Any


def split(fn: Callable[[Any, Any], Any], invariant: Any, x: Any) -> Split:
  """Splits ``fn(invariant, x)`` into the work on ``invariant`` alone and the rest.

  Args:
    fn: a function of two pytrees of arrays.
    invariant: the inputs that stay fixed over the loop (arrays, tracers or
      ``jax.ShapeDtypeStruct``\\ s).
    x: an example of the inputs that change (one iteration's).

  Returns:
    A :class:`Split`; ``split.body(inv, split.prologue(inv), x)`` equals
    ``fn(inv, x)`` for every ``x`` of ``x``'s structure, shapes and dtypes.
  """
  inv_leaves, inv_tree = jax.tree.flatten(invariant)
  x_leaves, x_tree = jax.tree.flatten(x)
  n = len(inv_leaves)
  out_tree = []

  def flat(*leaves):
    out = fn(inv_tree.unflatten(leaves[:n]), x_tree.unflatten(leaves[n:]))
    out_leaves, tree = jax.tree.flatten(out)
    out_tree.append(tree)
    return out_leaves

  # Traced with each input's type, its sharding included (an Explicit mesh axis shapes the
  # program: traced without it, the split's reductions ran in another order than the step's).
  def abstract(a):
    if isinstance(a, jax.ShapeDtypeStruct):
      return a
    t = jax.typeof(a)  # (a Python number too: weakly typed, as jit would trace it)
    return jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=getattr(t, "sharding", None),
                                weak_type=t.weak_type)

  closed = jax.make_jaxpr(flat)(*map(abstract, inv_leaves), *map(abstract, x_leaves))
  roots = list(closed.jaxpr.constvars) + list(closed.jaxpr.invars[:n])
  jaxpr = _jaxpr(closed.jaxpr, closed.jaxpr.constvars, closed.jaxpr.invars,
                 closed.jaxpr.outvars, _rewrite(closed.jaxpr.eqns, roots), closed.jaxpr.effects)
  early_ids = _partition(jaxpr, roots)
  made_by = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
  carried = _carried(jaxpr, early_ids, made_by)
  early = [e for i, e in enumerate(jaxpr.eqns) if i in early_ids]
  late = [e for i, e in enumerate(jaxpr.eqns) if i not in early_ids]
  head = list(jaxpr.constvars) + list(jaxpr.invars[:n])
  pro = _jaxpr(jaxpr, [], head, carried, early, jex.no_effects)
  rest = _jaxpr(jaxpr, [], head + carried + list(jaxpr.invars[n:]), list(jaxpr.outvars), late,
                jaxpr.effects)
  consts = list(closed.consts)
  run_pro = jex.jaxpr_as_fun(jex.ClosedJaxpr(pro, []))
  run_rest = jex.jaxpr_as_fun(jex.ClosedJaxpr(rest, []))

  def prologue(inv):
    return tuple(run_pro(*consts, *jax.tree.leaves(inv)))

  def body(inv, hoisted, xs):
    out = run_rest(*consts, *jax.tree.leaves(inv), *hoisted, *jax.tree.leaves(xs))
    return out_tree[0].unflatten(out)

  return Split(prologue=prologue, body=body,
               hoisted_primitives=tuple(e.primitive for e in early),
               hoisted_bytes=sum(_nbytes(v) for v in carried),
               out_shape=out_tree[0].unflatten(
                   [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.out_avals]))


def hoist_by_default() -> bool:
  """Whether accumulation windows split out their invariant work by default: not on CPU.

  Timed on a 2-core CPU (an MLP 1024 -> 4096 -> 1024, 4 micro-batches of 512
  tokens) the split window took 1-7% longer: XLA:CPU multiplies bf16 weights
  kept from before the loop more slowly than float32 ones it converts in the
  loop, and the casts it saves are small beside its GEMMs. On GPUs and TPUs
  the compiled programs move less (``benchmarks/bench_accumulate.py``).
  """
  return lowering.current_backend() != "cpu"


def filled(shape_tree: Any, value) -> Any:
  """Arrays shaped as the ``ShapeDtypeStruct`` leaves of ``shape_tree``, all ``value``."""
  return jax.tree.map(lambda s: jax.numpy.full(s.shape, value, s.dtype), shape_tree)


def _one_of(stacked) -> jax.ShapeDtypeStruct:
  """One micro-batch of ``stacked`` (its leading axis dropped), with its sharding type."""
  sharding = getattr(jax.typeof(stacked), "sharding", None)
  spec = getattr(sharding, "spec", None)
  sharding = (None if spec is None else
              jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:])))
  return jax.ShapeDtypeStruct(np.shape(stacked)[1:], stacked.dtype, sharding=sharding)


def accumulate(fn: Callable, invariant: Any, xs: Any, *, init: Callable, add: Callable,
               has_aux: bool = False, hoist: bool | None = None,
               caller: str = "accumulate_microbatches") -> tuple:
  """Folds ``fn(invariant, x)`` over the leading axis of ``xs`` in one ``lax.scan``.

  The accumulation loop both Flax APIs' ``accumulate_microbatches`` run; they
  differ only in ``init`` and ``add`` (how a gradient tree starts and grows).

  Args:
    fn: ``(invariant, x) -> out`` (or ``(out, aux)`` with ``has_aux``).
    invariant: the inputs fixed over the loop.
    xs: a pytree of arrays sharing a leading axis of length >= 1.
    init: ``init(out_shape) -> acc`` (``out_shape``: ``jax.ShapeDtypeStruct``
      leaves).
    add: ``add(acc, out) -> acc``.
    has_aux: ``fn`` also returns ``aux``, returned stacked.
    hoist: run the work on ``invariant`` alone once, before the loop (:func:`split`);
      None: where the program is traced for a GPU or a TPU, not for a CPU
      (:func:`hoist_by_default`).
    caller: the public name errors name.

  Returns:
    ``(acc, n, aux)``: the accumulator, the number of iterations and the
    stacked ``aux`` (None without ``has_aux``).

  Raises:
    ValueError: if ``xs`` has no arrays or no common leading axis of length >= 1.
  """
  leaves = jax.tree.leaves(xs)
  if not leaves:
    raise ValueError(f"{caller}: microbatches has no arrays")
  if hoist is None:
    hoist = hoist_by_default()
  lengths = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
  if len(lengths) != 1 or None in lengths or 0 in lengths:
    raise ValueError(
        f"{caller}: every array of microbatches needs the same leading (micro-batch) axis "
        f"of length >= 1; got leading sizes {sorted(map(str, lengths))}")
  (n,) = lengths
  one = jax.tree.map(_one_of, xs)
  if hoist:
    parts = split(fn, invariant, one)
    hoisted = parts.prologue(invariant)
    run = lambda x: parts.body(invariant, hoisted, x)
    out_shape = parts.out_shape
  else:
    run = lambda x: fn(invariant, x)
    out_shape = jax.eval_shape(fn, invariant, one)

  def step(acc, x):
    out = run(x)
    out, aux = out if has_aux else (out, None)
    return add(acc, out), aux

  acc, aux = jax.lax.scan(step, init(out_shape[0] if has_aux else out_shape), xs)
  return acc, n, aux


def window_programs(fn: Callable[[Any, Any, Any], Any], now: Callable[[Any], Any], *,
                    donate: bool = False) -> tuple[Callable, Callable]:
  """The two jitted programs of a window whose invariant work is kept from call to call.

  A loop that calls a jitted step once per micro-batch (``optax.MultiSteps``)
  has no loop inside one program to split: the work on the invariant inputs
  must be kept by the caller between calls.

  Args:
    fn: ``fn(invariant, carried, extra) -> out``, a step: ``carried`` the
      state it updates besides ``invariant``, ``extra`` its other inputs.
    now: ``now(carried)``: an integer array that changes whenever
      ``invariant`` may have (an optimizer's step count).
    donate: donate ``invariant``'s and ``carried``'s buffers to the step.

  Returns:
    ``(prologue, steady)``: ``prologue(invariant, carried, extra) -> hoisted``
    (the work on ``invariant`` alone, :func:`split`), and ``steady(invariant,
    carried, hoisted, built_at, extra) -> out``, which reads ``hoisted`` only
    if ``built_at == now(carried)`` and otherwise does that work again. The
    step is held twice, in one conditional: a branch that returned the cache
    as it came would make XLA copy it every call.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import hoist
    >>> fn = lambda w, count, x: (x @ jnp.tanh(w), count + 1)
    >>> prologue, steady = hoist.window_programs(fn, lambda count: count)
    >>> w, count, x = jnp.ones((3, 2)), jnp.int32(0), jnp.ones((4, 3))
    >>> kept = prologue(w, count, x)  # tanh(w), once per window
    >>> y, count = steady(w, count, kept, jnp.int32(0), x)
    >>> y.shape, int(count)
    ((4, 2), 1)
  """
  two = lambda invariant, rest: fn(invariant, *rest)

  @jax.jit
  def prologue(invariant, carried, extra):
    return split(two, invariant, (carried, extra)).prologue(invariant)

  def steady(invariant, carried, hoisted, built_at, extra):
    parts = split(two, invariant, (carried, extra))
    return jax.lax.cond(built_at == now(carried),
                        lambda i, h, r: parts.body(i, h, r),
                        lambda i, h, r: parts.body(i, parts.prologue(i), r),
                        invariant, hoisted, (carried, extra))

  return prologue, jax.jit(steady, donate_argnums=(0, 1) if donate else ())


def window_call(programs: tuple[Callable, Callable], clock: "WindowClock", cache, *,
                invariant, carried, extra, mini_step, step_count) -> tuple[Any, tuple]:
  """One call of a window: the cache built if ``clock`` says the window starts, then the step.

  Args:
    programs: ``(prologue, steady)`` of :func:`window_programs`.
    clock: the caller's :class:`WindowClock`.
    cache: ``(built_at, hoisted)`` from the previous call, or None.
    invariant, carried, extra: the step's inputs (see :func:`window_programs`).
    mini_step: the call's index in its window, read once when ``cache`` is None.
    step_count: ``now(carried)``: the optimizer step the cache is built for.

  Returns:
    ``(out, cache)``: the step's output and the cache to pass to the next call.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen.core import hoist
    >>> programs = hoist.window_programs(lambda w, n, x: (x @ jnp.tanh(w), n), lambda n: n)
    >>> clock, cache = hoist.WindowClock(2, "example"), None
    >>> for _ in range(3):
    ...   (y, n), cache = hoist.window_call(programs, clock, cache, invariant=jnp.ones((3, 2)),
    ...                                     carried=jnp.int32(0), extra=jnp.ones((4, 3)),
    ...                                     mini_step=0, step_count=jnp.int32(0))
    >>> y.shape, int(cache[0])
    ((4, 2), 0)
  """
  prologue, steady = programs
  if clock.starts(cache is not None, mini_step):
    # (A copy: the caller's own counter may be donated to the step.)
    cache = (jax.numpy.array(step_count, copy=True), prologue(invariant, carried, extra))
  return steady(invariant, carried, cache[1], cache[0], extra), cache


class WindowClock:
  """Where a window starts, counted on the host: no call waits for the device.

  The position is read from the device once, when a caller has no cache
  (``mini_step``, the call's index in its window); afterwards every
  ``every_k``-th call starts a window. A wrong guess costs time, never
  values: :func:`window_programs`' step does not read a stale cache.

  Args:
    every_k: calls to a window.
    caller: the public name errors name.

  Raises:
    ValueError: if ``every_k`` is not a positive int.

  Example:
    >>> from fp8_linen.core import hoist
    >>> clock = hoist.WindowClock(3, "example")
    >>> [clock.starts(i > 0, 1) for i in range(5)]  # first call: 2nd of its window
    [True, False, True, False, False]
  """

  def __init__(self, every_k: int, caller: str):
    if isinstance(every_k, bool) or not isinstance(every_k, (int, np.integer)) or every_k < 1:
      raise ValueError(f"{caller}: every_k must be a positive int (the micro-batches of one "
                       f"optax.MultiSteps window), got {every_k!r}")
    self.every_k = int(every_k)
    self._position = 0

  def starts(self, has_cache: bool, mini_step) -> bool:
    """Whether this call starts a window (and the cache is to be built); counts the call."""
    if not has_cache:
      self._position = int(mini_step)  # (the one wait for the device)
    start = not has_cache or self._position % self.every_k == 0
    self._position += 1
    return start
