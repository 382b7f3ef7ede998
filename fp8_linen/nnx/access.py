"""The NNX side of :class:`~fp8_linen.families.VariableAccess`.

:class:`NnxAccess` keeps a layer's quantization state as
:class:`~fp8_linen.nnx.QuantState` attributes and its learned quantizer
values as ``nnx.Param`` attributes, under the Linen layers' names. An NNX
layer declares them in its constructor (:func:`declare`), never during a
forward pass: the layers read them, hand them to the functional core ops,
and the ops return the new state as its *gradient*, which
:class:`~fp8_linen.nnx.Optimizer` writes back. Nothing traced is ever stored
in a module.

Several uses of one layer in a step are linked by one
:class:`~fp8_linen.core.uses.Chains` per module: only the first use returns
the state, built from the max of all uses, so autodiff's sum of the
cotangents is that state.

Conversion (:func:`converting`) and serving: a conversion run keeps each
product's record by the layer's path; a served layer (a :class:`Serving`
``serving`` attribute, set by :func:`~fp8_linen.nnx.convert`) runs in
``'serve'`` mode on the arrays it holds.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> from fp8_linen.nnx.access import NnxAccess
  >>> layer = fl.nnx.Linear(3, 4, rngs=nnx.Rngs(0))
  >>> NnxAccess(layer).stored('input_scale').tolist()
  [1.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8_linen.core import lowering, serve, settings, uses
from fp8_linen.core.serve import ServedRecord
from fp8_linen.families import dispatch, modes
from fp8_linen.families.access import VariableAccess
from fp8_linen.families.conversion import finds_weights
from fp8_linen.nnx.state import QuantState

__all__ = ["NnxAccess", "Serving", "declare", "recording", "converting", "calibrating",
           "calibrate", "weights"]

# module -> its chains. Held outside the module (weakly, so it goes with the
# module: NNX transforms run on fresh copies of the module, which disappear
# with their trace) so no chain value ever becomes module state.
_CHAINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_CALIBRATING = settings.TraceSetting("nnx_calibrating", default=False)
_CONVERSION = settings.TraceSetting("nnx_conversion", default=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serving:
  """What makes a layer a served one (a static attribute ``serving`` of the layer).

  Attributes:
    path: the layer's path in the converted model (named in errors).
    arrays: the names of the served arrays the layer holds next to its
      ``kernel`` (``nnx.Param`` s: scales, zero points/offsets, code sums).
  """

  path: str
  arrays: tuple

  def arrays_of(self, module) -> dict:
    """``module``'s served arrays by name."""
    return {name: getattr(module, name)[...] for name in self.arrays}


class _Conversion:
  """The records of one conversion run: ``path -> record``."""

  def __init__(self, paths: dict):
    self.paths = paths  # id(module) -> path, of the module objects this run calls
    self.records: dict = {}


class NnxAccess(VariableAccess):
  """An NNX layer's variables, for the recipe families.

  Args:
    module: the layer.
    declaring: the layer's constructor is declaring its variables (missing
      ones are created); otherwise they are read and a missing one is an
      error.
    weights_of: for a product inside a module's own code (an op-level
      site), the module whose method runs it: a conversion looks for its
      right operand among that module's :func:`weights`.
  """

  def __init__(self, module: nnx.Module, *, declaring: bool = False, weights_of=None):
    self.module = module
    self.declaring = declaring
    self.weights_of = weights_of

  @property
  def path(self) -> str:
    conversion = _CONVERSION.get()
    if conversion is not None and id(self.module) in conversion.paths:
      return conversion.paths[id(self.module)] or "<root>"
    serving = getattr(self.module, "serving", None)
    if serving is not None:
      return serving.path
    return getattr(self.module, "site_path", None) or type(self.module).__name__

  @property
  def owner(self) -> str:
    return type(self.module).__name__

  @property
  def initializing(self) -> bool:
    return self.declaring

  def _variable(self, name: str, kind: type, make):
    var = getattr(self.module, name, None)
    if var is None:
      if not self.declaring:
        raise ValueError(f"{self.path}: has no {kind.__name__} {name!r}; NNX layers declare "
                         "their quantization variables in their constructor "
                         "(fp8_linen.families.declare)")
      var = kind(make())
      setattr(self.module, name, var)
    return var

  def state(self, name: str, fill: float, shape: tuple):
    def make():
      return uses.constant(shape, fill, jnp.float32)
    # Read inside a shard_map body, state from outside is made replicated on the body's mesh.
    return lowering.in_context(self._variable(name, QuantState, make)[...])

  def param(self, name: str, init, shape: tuple, *, from_data: bool = False):
    """The ``nnx.Param`` ``name``; :func:`calibrating` sets a ``from_data`` one from ``init``."""
    var = self._variable(name, nnx.Param, lambda: init(shape))
    if from_data and _CALIBRATING.get():
      var[...] = init(shape)
    return var[...]

  def stored(self, name: str):
    var = getattr(self.module, name, None)
    return None if var is None else var[...]

  def chained(self, key: str, fn, state_leaf=None):
    chains = _CHAINS.get(self.module)
    if chains is None:
      chains = _CHAINS[self.module] = uses.Chains()
    return chains.run(key, self.path, state_leaf, fn)

  def record(self, record: ServedRecord) -> None:
    conversion = _CONVERSION.get()
    if conversion is None:
      raise RuntimeError(f"{self.path}: {modes.current_mode()!r} mode outside fl.nnx.convert "
                         "(fl.nnx.ptq) has nowhere to keep the product's record")
    conversion.records[conversion.paths.get(id(self.module), "")] = record

  def served_arrays(self) -> dict:
    serving = getattr(self.module, "serving", None)
    return {} if serving is None else serving.arrays_of(self.module)

  def kernel_for(self, rhs):
    if self.weights_of is not None:
      if not finds_weights():
        return None, None
      return serve.match_weight([v[...] for _, v in weights(self.weights_of)], rhs)
    var = getattr(self.module, "kernel", None)
    if isinstance(var, nnx.Param) and var[...].size == jnp.size(rhs):
      return 0, var[...]
    return None, None


def weights(module: nnx.Module) -> list:
  """``(name, nnx.Param)`` of ``module``'s own parameter attributes, by name."""
  return sorted(((k, v) for k, v in vars(module).items() if isinstance(v, nnx.Param)),
                key=lambda kv: kv[0])


def declare(module: nnx.Module, recipe, kernel=None, kernel_contract=None) -> None:
  """Creates ``recipe``'s state and learned quantization parameters on ``module``.

  Args:
    module: the layer (called from its constructor).
    recipe: any recipe in :mod:`fp8_linen.families.table`.
    kernel: the layer's initial kernel as the product sees it (LSQ weight
      steps start from it), or ``None``.
    kernel_contract: the kernel's contracting axes in the product.
  """
  dispatch.declare(NnxAccess(module, declaring=True), recipe, kernel, kernel_contract)


@contextlib.contextmanager
def recording(model: nnx.Module, mode: str):
  """Runs ``model``'s products in ``mode`` (``'convert'``, ``'calibrate'``); yields their records.

  The records are keyed by each layer's path. Enter it where ``model`` (the
  very objects that are called) is built, e.g. inside the function a
  conversion or a calibration jits.
  """
  conversion = _Conversion({id(m): "/".join(str(p) for p in path)
                            for path, m in nnx.iter_modules(model)})
  with _CONVERSION.set(conversion), modes.mode(mode):
    yield conversion.records


def converting(model: nnx.Module):
  """Runs ``model``'s products in ``'convert'`` mode; yields the records (path -> record)."""
  return recording(model, "convert")


@contextlib.contextmanager
def calibrating():
  """Learned activation quantizers take their values from the data of the run inside
  (what :func:`calibrate` runs under)."""
  with _CALIBRATING.set(True):
    yield


def calibrate(model: nnx.Module, *args, **kwargs) -> None:
  """Initialises the LSQ/LSQ+ activation steps (and offsets) from one batch.

  Runs ``model(*args, **kwargs)`` once (under ``nnx.jit`` when every input is
  an array, eagerly otherwise: a Python flag stays a Python flag); every layer
  with a learned activation quantizer sets ``input_step``/``input_offset`` from
  the activations it sees, as the Linen layers do at ``init``. Other state is
  left as it was.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> layer = fl.nnx.Linear(8, 4, recipe=fl.int8_lsq(), rngs=nnx.Rngs(0))
    >>> fl.nnx.calibrate(layer, jnp.ones((2, 8)))
    >>> round(float(layer.input_step[0]), 4), layer.kernel_step.shape
    (0.1775, (1, 4))
  """
  arrays = all(isinstance(leaf, (jax.Array, np.ndarray))
               for leaf in jax.tree.leaves((args, kwargs)))
  with calibrating():
    # Jitted, one compile replaces an op-by-op forward of every quantized product.
    (_call_jitted if arrays else _call)(model, *args, **kwargs)


def _call(model, *args, **kwargs):
  return model(*args, **kwargs)


_call_jitted = nnx.jit(_call)
