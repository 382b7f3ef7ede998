"""The state of flax's own fp8 ops (``flax.linen.fp8_ops``), continued or migrated.

flax's ops (``Fp8DirectDotGeneralOp`` — also exported as ``nn.Fp8DotGeneral`` —,
``Fp8DotGeneralOp``, ``NANOOFp8DotGeneralOp``, ``Fp8Einsum``) keep the same six
variables as fp8_linen (``<role>_scale`` ``(1,)`` and ``<role>_amax_history``
``(L,)`` for ``input``, ``kernel``, ``output_grad``) in the same
``_overwrite_with_gradient`` collection, in the op's own scope, auto-named
after its class: ``Dense_0/Fp8DirectDotGeneralOp_0``. What differs, as
measured on flax 0.12.8 (``tests/linen/test_flax_migration.py`` checks each):

* **history order.** flax advances a history by rolling it one place to the
  *left* and writing index 0, so index 0 is the newest amax, index 1 the
  oldest, and index ``L - 1`` the second newest (a ring read backwards from
  0). fp8_linen keeps its histories newest first. Entry ``k`` of ours is
  entry ``-k mod L`` of flax's (:func:`flax_history_order`); the map is its
  own inverse, and both orders agree on index 0.
* **scale.** Nothing to convert: both store ``s = amax * 2**margin / fp8_max``
  (``q = x / s``, ``x ~ q * s``), taken from the history *before* the step's
  own amax, and store the scale the step used. flax computes it as
  ``1 / (fp8_max / amax)``, which can differ from ``amax / fp8_max`` in the
  last bit. flax's first step (empty history) quantizes with the stored scale
  1 and clips; fp8_linen takes that step's own amax.
* **formats.** ``Fp8DirectDotGeneralOp`` and ``Fp8Einsum`` always use e4m3fn
  (max 448) / e5m2 (57344); ``Fp8DotGeneralOp`` its ``e4m3_dtype`` /
  ``e5m2_dtype`` fields; ``NANOOFp8DotGeneralOp`` e4m3fnuz (max 240) /
  e5m2fnuz (57344). :func:`flax_fp8_recipe` gives the recipe with the same
  formats and history length, hence the same scales.

Two ways to keep a trained flax fp8 state:

* :func:`from_flax_fp8` converts a checkpoint once: the state moves to where
  fp8_linen's layers keep it (``Fp8DotGeneral_<n>`` next to flax's op, or the
  layer's own path for ``fl.QDense``), its histories newest first.
* :class:`~fp8_linen.Fp8DotGeneral` continues it as it is
  (:func:`continue_flax_state`): with no state of its own and a flax op's
  state beside it, it reads that state and writes its new state back there,
  in flax's order. The rule that keeps the order unambiguous: **a history
  stored under a flax dot-general op's name is in flax's order; every other
  history is newest first.** ``Fp8Einsum_<n>`` is both flax's and
  fp8_linen's name, so a flax ``Fp8Einsum`` checkpoint is converted once, in
  place, by :func:`from_flax_fp8`.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.linen.flax_fp8 import flax_history_order
  >>> flax_history_order(jnp.array([6.0, 3.0, 4.0, 5.0])).tolist()  # flax after 6 steps
  [6.0, 5.0, 4.0, 3.0]
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from typing import Any, Mapping

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict, freeze

from fp8_linen.core.dot_general import fp8_dot_general
from fp8_linen.core.owg import OWG, ROLES, RoleState
from fp8_linen.families import modes
from fp8_linen.linen.access import LinenAccess, quantized_dot_general_on
from fp8_linen.recipes.fp8 import Fp8Recipe, ScalingConfig, canonical_fp8_dtype

__all__ = ["FLAX_DOT_OPS", "FLAX_OPS", "flax_history_order", "flax_fp8_recipe", "FlaxFp8Report",
           "from_flax_fp8", "flax_state_beside", "continue_flax_state"]

# flax's dot-general ops -> (e4m3 format, e5m2 format) they quantize to. The
# direct op ignores its dtype fields (its quantizer names e4m3fn/e5m2 itself).
FLAX_DOT_OPS: dict[str, tuple[str, str]] = {
    "Fp8DirectDotGeneralOp": ("float8_e4m3fn", "float8_e5m2"),
    "Fp8DotGeneralOp": ("float8_e4m3fn", "float8_e5m2"),
    "NANOOFp8DotGeneralOp": ("float8_e4m3fnuz", "float8_e5m2fnuz"),
}
# Every flax fp8 op with state (Fp8Einsum's scope name is also fl.Fp8Einsum's).
FLAX_OPS: dict[str, tuple[str, str]] = {**FLAX_DOT_OPS,
                                        "Fp8Einsum": ("float8_e4m3fn", "float8_e5m2")}
# Ops that honour their e4m3_dtype / e5m2_dtype fields.
_DTYPE_FIELDS = ("Fp8DotGeneralOp", "NANOOFp8DotGeneralOp")
_FNUZ = ("float8_e4m3fnuz", "float8_e5m2fnuz")

_STATE_NAMES = tuple(f"{r}_{k}" for r in ROLES for k in ("scale", "amax_history"))
_FLAX_NAME = re.compile(r"^(" + "|".join(FLAX_OPS) + r")_(\d+)$")
_OUR_NAME = re.compile(r"^Fp8DotGeneral_(\d+)$")
_INTO = ("dot_general_cls", "layer")


def flax_history_order(history) -> jnp.ndarray:
  """Reorders an amax history between flax's ring order and newest first.

  flax's history after steps with amaxes ``a1 .. a6`` (length 4) is
  ``[a6, a3, a4, a5]``; newest first it is ``[a6, a5, a4, a3]``. Entry
  ``k`` of one is entry ``-k mod L`` of the other, so the same function
  converts both ways. Written as a flip and a roll (linear, each the other's
  transpose up to direction), so under ``jax.grad`` the cotangent of a
  reordered history is reordered back exactly: a new history computed newest
  first lands at a flax path in flax's order.

  Args:
    history: a 1-D amax history (the last axis is reordered).

  Returns:
    The history in the other order.
  """
  history = jnp.asarray(history)
  return jnp.roll(jnp.flip(history, axis=-1), 1, axis=-1)


def _op_name(op) -> str:
  """The class name of a flax op given as a class, instance, partial or name."""
  if isinstance(op, functools.partial):
    op = op.func
  name = op if isinstance(op, str) else (op.__name__ if isinstance(op, type)
                                         else type(op).__name__)
  if name not in FLAX_OPS:
    raise ValueError(f"flax_fp8_recipe: op={op!r} is not one of flax's fp8 ops "
                     f"({', '.join(FLAX_OPS)})")
  return name


def flax_fp8_recipe(op: Any = "Fp8DirectDotGeneralOp", *,
                    amax_history_length: int | None = None) -> Fp8Recipe:
  """The :class:`~fp8_linen.Fp8Recipe` that chooses the scales ``op`` chooses.

  Delayed per-tensor scaling, the max of the history, no margin, the formats
  the op quantizes to and its history length: from the same history, the
  recipe takes the same scales as the op (up to the last bit, see the module
  doc).

  Args:
    op: the flax op: its class (``nn.NANOOFp8DotGeneralOp``), an instance,
      a ``functools.partial`` of the class (its ``amax_history_length``,
      ``e4m3_dtype`` and ``e5m2_dtype`` keywords are read), or the class
      name.
    amax_history_length: overrides the op's history length (flax's default
      is 1024).

  Returns:
    The recipe.

  Raises:
    ValueError: if ``op`` is not one of flax's fp8 ops, or
      ``amax_history_length`` is not an int >= 1.

  Example:
    >>> import flax.linen as nn
    >>> import fp8_linen as fl
    >>> r = fl.flax_fp8_recipe(nn.NANOOFp8DotGeneralOp, amax_history_length=16)
    >>> r.input.dtype, r.output_grad.dtype, r.input.fp8_max, r.input.history_length
    ('float8_e4m3fnuz', 'float8_e5m2fnuz', 240.0, 16)
  """
  name = _op_name(op)
  fields = {}
  if isinstance(op, functools.partial):
    fields = dict(op.keywords)
  elif not isinstance(op, (str, type)):
    fields = {k: getattr(op, k) for k in ("amax_history_length", "e4m3_dtype", "e5m2_dtype")}
  e4m3, e5m2 = FLAX_OPS[name]
  if name in _DTYPE_FIELDS:
    e4m3 = canonical_fp8_dtype(fields.get("e4m3_dtype", e4m3))
    e5m2 = canonical_fp8_dtype(fields.get("e5m2_dtype", e5m2))
  length = amax_history_length
  if length is None:
    length = fields.get("amax_history_length", 1024)
  if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
    raise ValueError(f"flax_fp8_recipe: amax_history_length={length!r} must be an int >= 1")
  cfg = lambda dtype: ScalingConfig(dtype=dtype, scaling="delayed", history_length=int(length),
                                    amax_compute_algo="max", margin=0)
  if (e4m3 in _FNUZ) != (e5m2 in _FNUZ):
    raise ValueError(f"flax_fp8_recipe: op={op!r} quantizes to {e4m3}/{e5m2}, a mix of fnuz "
                     "and non-fnuz formats that fp8_linen's recipes do not support")
  return Fp8Recipe(input=cfg(e4m3), kernel=cfg(e4m3), output_grad=cfg(e5m2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlaxFp8Report:
  """What :func:`from_flax_fp8` found and did.

  Attributes:
    moved: ``(flax path, fp8_linen path, flax op)`` of every flax fp8 state,
      in the order found (paths in the OWG collection, ``/``-separated; the
      same path twice for an ``Fp8Einsum`` converted in place).
    history_lengths: the histories' length in the checkpoint, per entry.
    resized_to: the recipe's history length per role, or ``None`` (kept).
    notes: things to know (a NANOO state continued with OCP formats, ...).
  """

  moved: tuple[tuple[str, str, str], ...] = ()
  history_lengths: tuple[int, ...] = ()
  resized_to: tuple[tuple[str, int], ...] | None = None
  notes: tuple[str, ...] = ()

  def __len__(self) -> int:
    return len(self.moved)

  def __str__(self) -> str:
    if not self.moved:
      return "from_flax_fp8: no flax fp8 state found"
    lines = [f"from_flax_fp8: converted {len(self.moved)} flax fp8 state(s) (histories "
             "from flax's ring order to newest first; scales kept: same convention)"]
    for (src, dst, op), n in zip(self.moved, self.history_lengths):
      where = "in place" if src == dst else f"-> {dst}"
      lines.append(f"  {src} ({op}, history {n}) {where}")
    if self.resized_to is not None:
      lines.append("  histories resized to " + ", ".join(f"{r} {n}" for r, n in self.resized_to))
    lines += [f"  note: {n}" for n in self.notes]
    return "\n".join(lines)


def _state_like(node) -> bool:
  """Whether ``node`` holds exactly one op's six state variables."""
  return (isinstance(node, Mapping) and set(node) == set(_STATE_NAMES)
          and not any(isinstance(v, Mapping) for v in node.values()))


def _resized(h, n: int):
  """A newest-first history cut to its ``n`` newest entries or zero-padded (nothing observed)."""
  if h.shape[0] >= n:
    return h[:n]
  return jnp.concatenate([h, jnp.zeros((n - h.shape[0],), h.dtype)])


def _convert_state(node: Mapping, recipe: Fp8Recipe | None) -> dict:
  out = {}
  for role in ROLES:
    scale = jnp.asarray(node[f"{role}_scale"], jnp.float32)
    hist = flax_history_order(jnp.asarray(node[f"{role}_amax_history"], jnp.float32))
    if recipe is not None:
      hist = _resized(hist, recipe.role(role).history_length)
    out[f"{role}_scale"], out[f"{role}_amax_history"] = scale, hist
  return out


def from_flax_fp8(variables: Mapping, recipe: Fp8Recipe | None = None, *,
                  into: str = "dot_general_cls") -> tuple[dict, FlaxFp8Report]:
  """Converts a checkpoint's flax fp8 op state to fp8_linen's layout, once.

  Every flax fp8 op state in the OWG collection (an ``Fp8DirectDotGeneralOp_<n>``,
  ``Fp8DotGeneralOp_<n>``, ``NANOOFp8DotGeneralOp_<n>`` or ``Fp8Einsum_<n>``
  scope holding the six state variables) is moved to where the replacement
  layer keeps it, its histories reordered newest first (and resized to
  ``recipe``'s lengths if given: the newest entries are kept). Scales are kept
  as they are (flax's and fp8_linen's are the same quantity). Everything else
  (``params``, other collections, other OWG entries) is passed through.

  Where the state goes (``into``):

  * ``'dot_general_cls'``: for ``nn.Dense(dot_general_cls=fl.Fp8DotGeneral)``
    (and ``nn.DenseGeneral``): ``.../Fp8DirectDotGeneralOp_<n>`` becomes
    ``.../Fp8DotGeneral_<n>``.
  * ``'layer'``: for a layer replaced by ``fl.QDense`` / ``fl.QDenseGeneral``,
    which keep the state at their own path: ``Dense_0/Fp8DirectDotGeneralOp_0/*``
    becomes ``Dense_0/*``. Give the new layer the old one's name
    (``fl.QDense(4, name='Dense_0')``) so its params and state are found.

  ``Fp8Einsum_<n>`` (flax's einsum, e.g. the attention einsums of
  ``nn.MultiHeadDotProductAttention``) stays where it is: ``fl.Fp8Einsum``
  has the same name. Its histories are reordered in place, so convert a
  checkpoint once: a second call would reorder them back.

  Args:
    variables: the model's variables (``{'params': ..., '_overwrite_with_gradient':
      ...}``), e.g. restored from a flax fp8 checkpoint.
    recipe: an :class:`~fp8_linen.Fp8Recipe` whose history lengths the
      histories are resized to (``None``: kept as they are).
    into: ``'dot_general_cls'`` or ``'layer'`` (see above).

  Returns:
    ``(variables, report)``: the converted variables (a new dict) and a
    :class:`FlaxFp8Report` of what was found (``print(report)`` lists it).

  Raises:
    TypeError: if ``variables`` is not a variables dict or ``recipe`` not an
      ``Fp8Recipe``.
    ValueError: if ``into`` is not one of the two layouts, or a target path
      is taken (state of the new layer already there, two flax ops in one
      layer for ``into='layer'``).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import fp8_linen as fl
    >>> flax_model = nn.Dense(4, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    >>> v = flax_model.init(jax.random.key(0), jnp.ones((2, 3)))
    >>> v, report = fl.from_flax_fp8(v)
    >>> report.moved
    (('Fp8DirectDotGeneralOp_0', 'Fp8DotGeneral_0', 'Fp8DirectDotGeneralOp'),)
    >>> y = nn.Dense(4, dot_general_cls=fl.Fp8DotGeneral).apply(v, jnp.ones((2, 3)))
  """
  if isinstance(variables, FrozenDict):
    out, report = from_flax_fp8(variables.unfreeze(), recipe, into=into)
    return freeze(out), report
  if not isinstance(variables, Mapping) or not ("params" in variables or OWG in variables):
    raise TypeError("from_flax_fp8: variables must be a model's variables dict ({'params': "
                    f"..., '{OWG}': ...}}), got {type(variables).__name__}")
  if recipe is not None and not isinstance(recipe, Fp8Recipe):
    raise TypeError(f"from_flax_fp8: recipe={recipe!r} must be an fl.Fp8Recipe (its history "
                    "lengths) or None")
  if into not in _INTO:
    raise ValueError(f"from_flax_fp8: into={into!r} must be one of {_INTO}")
  moved, lengths, notes = [], [], []

  def walk(node: Mapping, path: tuple) -> dict:
    out = {}
    flax_children = [(k, _FLAX_NAME.match(k)) for k in node
                     if _FLAX_NAME.match(k) and _state_like(node[k])]
    for k, v in node.items():
      if not any(k == c for c, _ in flax_children):
        out[k] = walk(v, path + (k,)) if isinstance(v, Mapping) else v
    dot_children = [(k, m) for k, m in flax_children if m.group(1) != "Fp8Einsum"]
    if into == "layer" and len(dot_children) > 1:
      raise ValueError(
          f"from_flax_fp8: {'/'.join(path) or '<root>'} holds {len(dot_children)} flax fp8 "
          f"op states ({', '.join(k for k, _ in dot_children)}); into='layer' keeps one per "
          "layer: use into='dot_general_cls'")
    for k, m in flax_children:
      op, idx = m.group(1), m.group(2)
      state = _convert_state(node[k], recipe)
      src = "/".join(path + (k,))
      if op == "Fp8Einsum":
        dst_key = k
      elif into == "dot_general_cls":
        dst_key = f"Fp8DotGeneral_{idx}"
      else:
        dst_key = None
      if dst_key is None:
        taken = sorted(set(state) & set(out))
        if taken:
          raise ValueError(f"from_flax_fp8: {'/'.join(path) or '<root>'} already holds "
                           f"{taken[0]}; cannot move {src} there (into='layer')")
        out.update(state)
        dst = "/".join(path) or "<root>"
      else:
        if dst_key in out:
          raise ValueError(f"from_flax_fp8: {'/'.join(path + (dst_key,))} already exists; "
                           f"cannot move {src} there (variables of the new model mixed with "
                           "the flax checkpoint?)")
        out[dst_key] = state
        dst = "/".join(path + (dst_key,))
      moved.append((src, dst, op))
      lengths.append(int(jnp.shape(node[k]["input_amax_history"])[0]))
      if recipe is not None:
        want = FLAX_OPS[op]
        have = (recipe.input.dtype, recipe.output_grad.dtype)
        if have != want and not any(op in n for n in notes):
          notes.append(f"{op} quantized to {want[0]}/{want[1]}; the recipe uses "
                       f"{have[0]}/{have[1]}: its scales follow the recipe's formats "
                       "(fl.flax_fp8_recipe gives the op's)")
    return out

  out = dict(variables)
  if OWG in variables:
    out[OWG] = walk(variables[OWG], ())
  resized = (None if recipe is None
             else tuple((r, recipe.role(r).history_length) for r in ROLES))
  return out, FlaxFp8Report(moved=tuple(moved), history_lengths=tuple(lengths),
                            resized_to=resized if moved else None, notes=tuple(notes))


# ----------------------------------------------------------------------------
# Continuing a flax op's state from fl.Fp8DotGeneral (no conversion needed).


def flax_state_beside(module: nn.Module) -> tuple[str, str] | None:
  """``(scope name, flax op)`` of the flax fp8 state ``module`` continues, or ``None``.

  ``module`` (an ``Fp8DotGeneral_<n>``) continues a flax op's state when it
  holds no state of its own (not initializing) and its parent holds the
  state of exactly one flax dot-general op with the same index
  (``Fp8DirectDotGeneralOp_<n>``, ``Fp8DotGeneralOp_<n>`` or
  ``NANOOFp8DotGeneralOp_<n>``: the names flax's auto-naming gives them).

  Raises:
    ValueError: if the parent holds the state of several flax ops with that
      index.
  """
  scope = module.scope
  if scope is None or scope.parent is None or module.is_initializing():
    return None
  m = _OUR_NAME.match(module.name or "")
  if m is None or any(module.has_variable(OWG, n) for n in _STATE_NAMES):
    return None
  parent = scope.parent
  found = [(f"{op}_{m.group(1)}", op) for op in FLAX_DOT_OPS
           if _state_like(parent.get_variable(OWG, f"{op}_{m.group(1)}"))]
  if len(found) > 1:
    where = "/".join(module.path[:-1]) or "<root>"
    raise ValueError(f"{where} holds the fp8 state of {len(found)} flax ops "
                     f"({', '.join(n for n, _ in found)}) for {module.name}; convert the "
                     "checkpoint with fl.from_flax_fp8(variables) and keep one")
  return found[0] if found else None


class _Holder(nn.Module):
  """A stateless module bound to the flax op's scope: the product's state lives there."""

  @nn.compact
  def __call__(self, fn):
    return fn(self)


_WARNED_ATTR = "_fp8_linen_warned_flax_state"


def _flax_states(holder: nn.Module, recipe: Fp8Recipe, op: str) -> tuple:
  where = "/".join(holder.path)
  states = []
  for role in ROLES:
    scale = holder.get_variable(OWG, f"{role}_scale")
    hist = holder.get_variable(OWG, f"{role}_amax_history")
    want = recipe.role(role).history_length
    if jnp.shape(scale) != (1,) or jnp.ndim(hist) != 1:
      raise ValueError(f"{where}: {role}_scale / {role}_amax_history have shapes "
                       f"{jnp.shape(scale)} / {jnp.shape(hist)}, not flax fp8 state")
    if jnp.shape(hist)[0] != want:
      raise ValueError(
          f"{where}: the flax {op} state has amax_history_length={jnp.shape(hist)[0]} but the "
          f"recipe's {role} asks for history_length={want}; continue it with recipe="
          f"fl.flax_fp8_recipe({op!r}, amax_history_length={jnp.shape(hist)[0]}), or convert "
          "it once with fl.from_flax_fp8(variables, recipe)")
    # Read in flax's ring order, computed newest first; the reorder's transpose
    # writes the new history back in flax's order (flax_history_order).
    states.append(RoleState(jnp.asarray(scale, jnp.float32),
                            flax_history_order(jnp.asarray(hist, jnp.float32))))
  return tuple(states)


def _warn_once(module: nn.Module, message: str) -> None:
  warned = module.scope.root.__dict__.setdefault(_WARNED_ATTR, set())
  if tuple(module.scope.path) not in warned:  # once per module and apply
    warned.add(tuple(module.scope.path))
    warnings.warn(message, stacklevel=4)


def continue_flax_state(module: nn.Module, found: tuple[str, str], lhs, rhs, dimension_numbers,
                        recipe, out_dtype=None, key: str = "dot"):
  """Runs ``module``'s product on the flax op state beside it (:func:`flax_state_beside`).

  The state is read at the flax op's path with its histories reordered from
  flax's ring order to newest first, and the product's new state (its
  "gradient") lands at that same path in flax's order, so
  :class:`~fp8_linen.TrainState` writes it there and every later step reads
  flax's order again: the path says the order, nothing else is stored. The
  first step uses the trained scales (the history's max).

  Raises:
    ValueError: if the history length differs from ``recipe``'s, or in the
      ``'convert'``/``'serve'`` modes (convert the checkpoint first).
  """
  name, op = found
  path = "/".join(module.path[:-1] + (name,))
  if modes.current_mode() is not None:
    raise ValueError(f"{path}: flax fp8 state cannot be converted for serving as it is; "
                     "convert the checkpoint first with fl.from_flax_fp8(variables)")
  if not isinstance(recipe, Fp8Recipe):
    _warn_once(module, f"fp8_linen: {'/'.join(module.path)} runs "
               f"{type(recipe).__name__}, which does not use the flax fp8 state found at "
               f"{path}; that state is left as it is")
    return quantized_dot_general_on(module, lhs, rhs, dimension_numbers, recipe,
                                    out_dtype=out_dtype, key=key)
  want = FLAX_DOT_OPS[op]
  have = (recipe.input.dtype, recipe.output_grad.dtype)
  formats = ("" if have == want else
             f"; flax's op quantized to {want[0]}/{want[1]}, this recipe to {have[0]}/"
             f"{have[1]}: scales follow the recipe (fl.flax_fp8_recipe({op!r}) keeps the op's)")
  _warn_once(module, f"fp8_linen: {'/'.join(module.path)} has no state of its own: continuing "
             f"the flax fp8 state found at {path} ({op}; history converted from flax's ring "
             f"order on read and written back in it, scales kept){formats}. To move it to "
             "fp8_linen's layout once: fl.from_flax_fp8(variables).")
  holder = _Holder(parent=module.scope.parent.push(name, reuse=True))

  def run(h):
    st = _flax_states(h, recipe, op)
    return LinenAccess(h).chained(key, lambda chain: fp8_dot_general(
        lhs, rhs, dimension_numbers, input_state=st[0], kernel_state=st[1],
        output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype, chain=chain),
        state_leaf=st[0].scale)

  return holder(run)

