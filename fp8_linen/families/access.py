"""How a recipe family reaches a layer's variables, in either Flax API: :class:`VariableAccess`.

Every recipe family (:mod:`~fp8_linen.families.fp8`,
:mod:`~fp8_linen.families.integer`, and any family
:func:`~fp8_linen.families.register_recipe` adds) is written once, against
this interface; each layer API implements it once
(``fp8_linen.linen.access.LinenAccess``, ``fp8_linen.nnx.access.NnxAccess``),
as qwix's one ``flax_util`` serves every qwix provider.

================== ================================= =================================
what               Linen                             NNX
================== ================================= =================================
:meth:`state`      a variable of the                 a :class:`fl.nnx.QuantState`
                   ``_overwrite_with_gradient``      attribute (created by the
                   collection (created by ``init``)  layer's constructor)
:meth:`param`      a ``params`` variable             an ``nnx.Param`` attribute;
                   (initialised from ``init``'s      :func:`fl.nnx.calibrate` sets
                   data)                             ``from_data`` ones from a batch
:meth:`chained`    one :class:`~fp8_linen.core.uses. one per module
                   Chains` per ``apply``
:meth:`record`     the ``fp8_linen_served``          the records of
                   collection                        ``fl.nnx.convert``'s run
================== ================================= =================================

Example:
  >>> from fp8_linen.families.access import VariableAccess
  >>> sorted(VariableAccess.__abstractmethods__)[:4]
  ['chained', 'initializing', 'kernel_for', 'owner']
"""

from __future__ import annotations

import abc
from typing import Any, Callable

import jax

from fp8_linen.core.serve import ServedRecord

__all__ = ["VariableAccess"]


class VariableAccess(abc.ABC):
  """One layer's variables, as a recipe family reads and declares them.

  A family never learns which Flax API runs it: everything it keeps lives
  behind these methods. Variables are *declared or read*: the first call
  for a name declares it (Linen at ``init``, NNX in the layer's constructor
  through :func:`~fp8_linen.families.declare`), later calls read it.
  """

  @property
  @abc.abstractmethod
  def path(self) -> str:
    """The layer's path in the model, named in errors (``'<root>'`` for the root)."""

  @property
  @abc.abstractmethod
  def owner(self) -> str:
    """The layer's class name, named in recipe errors (``'QDense'``, ``'Linear'``)."""

  @property
  @abc.abstractmethod
  def initializing(self) -> bool:
    """Whether variables are being created (no backward pass follows)."""

  @abc.abstractmethod
  def state(self, name: str, fill: float, shape: tuple) -> jax.Array:
    """Declares or reads quantization state ``name`` (float32, first filled with ``fill``).

    Its gradient is its new value (the state protocol of
    :mod:`fp8_linen.core.owg`).
    """

  @abc.abstractmethod
  def param(self, name: str, init: Callable[[tuple], jax.Array], shape: tuple, *,
            from_data: bool = False) -> jax.Array:
    """Declares or reads a learned parameter ``name`` (an LSQ step or offset).

    Args:
      name: the parameter's name.
      init: ``init(shape) -> value``, its initial value.
      shape: its shape.
      from_data: ``init`` reads the data the layer sees (an activation's
        step): NNX, which declares before any data, re-initialises it in
        :func:`fl.nnx.calibrate`.
    """

  @abc.abstractmethod
  def stored(self, name: str) -> jax.Array | None:
    """The value of an already declared state or parameter ``name``, or ``None``."""

  @abc.abstractmethod
  def chained(self, key: str, fn: Callable[[Any], tuple], state_leaf=None) -> Any:
    """Runs ``fn(chain) -> (out, chain_out)`` as the next use of the state ``key``; returns ``out``.

    Uses of one state in a step are linked (see
    :class:`~fp8_linen.core.uses.Chains`): the first gets ``chain=None``,
    later ones the previous ``chain_out``. ``state_leaf`` (one array of the
    state as the op reads it) lets the loop checks see where the state lives.
    """

  @abc.abstractmethod
  def record(self, record: ServedRecord) -> None:
    """Keeps the conversion record of this layer's product (``'convert'`` mode)."""

  @abc.abstractmethod
  def served_arrays(self) -> dict:
    """The arrays conversion stored for this layer (``'serve'`` mode), by name."""

  @abc.abstractmethod
  def kernel_for(self, rhs) -> tuple[int | None, jax.Array | None]:
    """``(at, kernel)``: the layer's ``kernel`` parameter of ``rhs``'s size, and where it lives.

    ``at`` is ``0`` (the layer's own) or ``1`` (its parent's, for a product
    module inside a flax layer); ``(None, None)`` when the right operand is
    no weight of the layer.
    """

