"""What serving stores of a quantized product, and the conversion records both APIs share.

After quantization-aware training a weight is a constant: it is quantized
once with exactly the scale the QAT forward used and stored as ``int8``,
``int4`` or fp8 codes with its scales, and the activation's quantization
parameters are frozen from the trained state. The served products that read
those arrays are the families' (:mod:`fp8_linen.core.fp8_serve`,
:mod:`fp8_linen.core.int_serve`); this module holds what they share.

Every served array is named as it is stored next to the layer's ``kernel``:

============== ============================================================
name           holds
============== ============================================================
kernel         the weight's codes (``int8``/``int4``/fp8), the weight's shape
kernel_scale   the weight's scale(s): per tensor ``(1,)``, per channel/group
               in the weight's (view) layout; block (MXFP8 ``float8_e8m0fnu``,
               NVFP4 ``float8_e4m3fn``): per block of the forward's
               contracting axes, ``(B, N, ceil(K / block))`` of the weight's
               (batch, free, contracting) view
kernel_tensor_scale  NVFP4: the weight's per-tensor scale ``(1,)`` as its
               role's ScalingConfig chose it (its factor is this over 448)
kernel_centre  integer grids with a zero point: ``zero_point - storage shift``
kernel_offset  LSQ+'s learned offset
kernel_colsum  the codes summed over the contracting axes (int32), for
               activations with a zero point or LSQ+ offset: folded once
input_scale    the frozen activation scale: fp8 delayed per tensor, and
               NVFP4 delayed (its per-tensor factor is this over 448); absent
               where it is computed from each batch (fp8 current, row-wise,
               MXFP8, NVFP4 current)
input_zero_point  STE observers on asymmetric grids
input_offset   LSQ+'s learned activation offset
============== ============================================================

A conversion run (``fl.convert``, ``fl.nnx.convert``) runs each quantized
product once and records, per product, the arrays serving needs and the
checks read after the run (values are traced there, so the record is a
pytree a jitted function returns): a :class:`ServedRecord`. After the run,
:func:`served_from_record` turns a record into what the layer stores in
place of its QAT variables, and the served products check with
:func:`require_arrays` that the stored arrays are there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SERVED_NAMES", "WEIGHT_AT", "ServedRecord", "record", "unservable_error",
           "with_kernel_check", "match_weight", "weight_index", "folds_kernel",
           "untrained_error", "no_product_error", "served_from_record", "require_arrays"]

# Every array a served layer may hold next to its kernel (the table above, and what a right
# operand quantized live keeps: an LSQ step / offset, a delayed fp8 scale).
SERVED_NAMES = ("kernel_scale", "kernel_tensor_scale", "kernel_centre", "kernel_offset",
                "kernel_colsum", "input_scale", "input_zero_point", "input_offset", "kernel_step",
                "kernel_live_scale")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedRecord:
  """What a conversion run records of one product (see :func:`served_from_record`).

  Attributes:
    fold: the arrays of the weight folded to codes (``kernel``,
      ``kernel_scale``, ...), used when the right operand is the layer's
      unchanged ``kernel``.
    live: what a right operand that is not a weight keeps instead (it is
      quantized on the fly in serving).
    frozen: the input's frozen quantization parameters (``input_scale``, ...).
    state_ok: whether the product has trained state (a bool array).
    kernel_at: where the layer keeps the right operand's ``kernel``: ``0``
      itself, ``1`` its parent, ``-1`` nowhere (an int array; the layer's
      conversion run fills it in with :func:`with_kernel_check`).
    kernel_equal: whether that ``kernel`` reaches the product unchanged.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> from fp8_linen.core import int_serve
    >>> rec = jax.jit(lambda w: int_serve.int_record(fl.IntRecipe(), w, (0,), lambda n: None))(
    ...     jnp.ones((3, 2)))
    >>> sorted(rec.fold), bool(rec.state_ok), rec.kernel_at
    (['kernel', 'kernel_scale'], False, None)
  """

  fold: dict
  live: dict
  frozen: dict
  state_ok: jax.Array
  kernel_at: jax.Array | None = None
  kernel_equal: jax.Array | None = None


def unservable_error(where: str, recipe, why: str) -> ValueError:
  """The error (naming the layer ``where``) for a recipe that cannot be served, and why."""
  return ValueError(f"{where}: recipe={recipe!r} cannot be served: {why}")


def record(fold: dict, live: dict, frozen: dict, state_ok) -> ServedRecord:
  return ServedRecord(fold=fold, live=live, frozen=frozen, state_ok=jnp.asarray(state_ok))


def with_kernel_check(record: ServedRecord, at, kernel, rhs) -> ServedRecord:
  """``record`` with its checks of the right operand: is it the layer's ``kernel``, unchanged?

  ``at`` says where the layer keeps ``kernel`` (``0``: itself, ``1``: its
  parent; ``None``: the operand is no weight) and ``kernel`` is its value.
  Only a weight that reaches the product unchanged is folded to codes; any
  other right operand (an activation, a kernel the product sums first) is
  quantized live in serving.
  """
  rhs = jnp.asarray(rhs)
  equal = (jnp.asarray(False) if kernel is None else
           jnp.array_equal(jnp.asarray(kernel).astype(rhs.dtype).reshape(rhs.shape), rhs))
  return dataclasses.replace(record, kernel_at=jnp.asarray(-1 if at is None else at),
                             kernel_equal=equal)


# ``kernel_at`` of a product inside a module's own code whose right operand is
# one of that module's weights: WEIGHT_AT + the weight's index among them.
WEIGHT_AT = 2


def match_weight(weights: list, rhs) -> tuple:
  """``(at, kernel)`` of a product in a module's own code: which of its ``weights`` ``rhs`` is.

  ``weights`` are the module's parameters in a fixed order (conversion lists
  them again the same way). The one whose values, cast to ``rhs``'s dtype
  and reshaped, equal ``rhs`` is the right operand: ``at`` is
  ``WEIGHT_AT + its index``, traced. None or several equal ones (a weight
  the product changes first, tied copies): ``at`` is ``-1`` and the operand
  is quantized live in serving. ``(None, None)`` when no weight has its size.
  """
  rhs = jnp.asarray(rhs)
  fits = [i for i, w in enumerate(weights) if jnp.size(w) == rhs.size]
  if not fits:
    return None, None
  equal = jnp.stack([
      jnp.array_equal(jnp.asarray(weights[i]).astype(rhs.dtype).reshape(rhs.shape), rhs)
      for i in fits])
  at = jnp.where(equal.sum() == 1, WEIGHT_AT + jnp.asarray(fits)[jnp.argmax(equal)], -1)
  return at, rhs


def weight_index(record: ServedRecord) -> int | None:
  """The index :func:`match_weight` found the folded weight at, or ``None`` (a layer's kernel)."""
  at = int(record.kernel_at)
  return at - WEIGHT_AT if at >= WEIGHT_AT else None


def folds_kernel(record: ServedRecord) -> bool:
  """Whether serving reads the weight's codes (else it quantizes the right operand live)."""
  return int(record.kernel_at) >= 0 and bool(record.kernel_equal)


def untrained_error(where: str) -> ValueError:
  return ValueError(
      f"{where}: has no trained quantization state: its frozen input scale would come from "
      "an empty amax history / observer range. Convert a trained (or calibrated) model with "
      "its quantization state (Linen: the '_overwrite_with_gradient' collection; NNX: its "
      "fl.nnx.QuantState variables)")


def no_product_error(who: str, layers: str) -> ValueError:
  return ValueError(f"{who}: the model ran no quantized product, so there is nothing to serve "
                    f"(build it from {layers})")


def served_from_record(where: str, rec: ServedRecord) -> tuple:
  """``(kernel_codes or None, arrays)``: what a layer stores in place of its QAT variables.

  ``kernel_codes`` (the weight folded to codes, to store in place of
  ``kernel``) is ``None`` where the right operand is quantized live. The
  arrays are named as the module doc lists them.

  Raises:
    ValueError: naming ``where``, for a product without trained state.
  """
  if not bool(rec.state_ok):
    raise untrained_error(where)
  if folds_kernel(rec):
    arrays = {k: v for k, v in rec.fold.items() if k != "kernel"}
    kernel = rec.fold["kernel"]
  else:
    arrays, kernel = dict(rec.live), None
  return kernel, {**arrays, **rec.frozen}


def require_arrays(where: str, arrays: dict, names) -> None:
  for name in names:
    if name not in arrays:
      raise ValueError(f"{where}: the served params hold no {name} for this layer; serve "
                       "the arrays fl.convert (fl.nnx.convert) stored for it")
