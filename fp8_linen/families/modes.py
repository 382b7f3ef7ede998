"""Training, converting or serving: the one mode every product reads.

The same model definition trains, converts and serves (the AQT/qwix
pattern). :func:`mode` sets, for a block, what every product of both layer
APIs does (:mod:`~fp8_linen.families.dispatch` reads it):

* ``None`` (training): the recipe family's QAT product;
* ``'convert'``: the QAT product, and the product's conversion record
  (:class:`~fp8_linen.core.serve.ServedRecord`) written through the layer's
  :class:`~fp8_linen.families.VariableAccess` (``fl.convert``,
  ``fl.nnx.convert``);
* ``'serve'``: the family's served product on the arrays conversion stored
  (``fl.convert``'s served model; a served ``fl.nnx`` layer);
* ``'calibrate'``: the float product, and the product's calibration record
  (:class:`~fp8_linen.families.calibration.CalibrationRecord`) written
  through the layer's access (post-training quantization: ``fl.ptq``,
  ``fl.nnx.ptq``).

The mode is a :class:`~fp8_linen.core.settings.TraceSetting`: a function
jitted in one mode is traced again in another.

Example:
  >>> from fp8_linen.families import modes
  >>> with modes.mode("serve"):
  ...   modes.current_mode()
  'serve'
  >>> modes.current_mode() is None
  True
"""

from __future__ import annotations

import contextlib

from fp8_linen.core import settings

__all__ = ["MODES", "mode", "current_mode"]

MODES = ("convert", "serve", "calibrate")
_MODE = settings.TraceSetting("mode", default=None)


@contextlib.contextmanager
def mode(name: str | None):
  """Runs every product of the block in mode ``name`` (``None``: training)."""
  if name is not None and name not in MODES:
    raise ValueError(f"mode: name={name!r} must be None or one of {MODES}")
  with _MODE.set(name):
    yield


def current_mode() -> str | None:
  """The mode products run in (``None``: training)."""
  return _MODE.get()
