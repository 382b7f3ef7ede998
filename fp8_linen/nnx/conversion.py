"""From NNX QAT to a served NNX model: :func:`convert`.

The NNX twin of :func:`fp8_linen.convert`. A trained NNX model (built from
``fl.nnx.Linear``/``LinearGeneral``/``Einsum``/``Conv``, or
:func:`~fp8_linen.nnx.quantize_model`'d) becomes a copy in which every
quantized layer is *served*:

* its ``kernel`` ``nnx.Param`` holds the weight quantized once, with the scale
  the QAT forward used, as ``int8``, ``int4`` or fp8 codes (same shape), and
  the arrays serving reads sit next to it as ``nnx.Param`` s, under the names
  the Linen served params use (``kernel_scale``, ``kernel_centre``,
  ``kernel_offset``, ``kernel_colsum``, ``input_scale``, ``input_zero_point``,
  ``input_offset``; :mod:`fp8_linen.core.serve`);
* its training-only state is gone: the :class:`~fp8_linen.nnx.QuantState`
  variables (amax histories, observer ranges) and the learned LSQ steps and
  offsets;
* its products run in ``'serve'`` mode: the recipe family's served products
  (:mod:`fp8_linen.core.serve`), the functions the Linen served model runs,
  which run the QAT forward from those arrays: the served
  model equals the QAT model evaluated with frozen quantizers
  (``model.eval()`` or :func:`~fp8_linen.frozen_quantizers`) bit for bit.

The model is run once to find its products (traced, under ``jax.jit``), in
``'convert'`` mode: each product records what serving needs through the
layer's :class:`~fp8_linen.nnx.access.NnxAccess`, as the Linen layers do
through theirs; the checks and errors are the Linen conversion's.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> model = fl.nnx.Linear(16, 4, recipe=fl.int8_lsq(), rngs=nnx.Rngs(0))
  >>> x = jax.random.normal(jax.random.key(0), (8, 16))
  >>> fl.nnx.calibrate(model, x)
  >>> served = fl.nnx.convert(model, x)
  >>> served.kernel[...].dtype
  dtype('int8')
  >>> model.eval()  # frozen quantizers: the QAT model as it is served
  >>> bool((served(x) == model(x)).all())
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

from fp8_linen.core import serve
from fp8_linen.core.owg import frozen_quantizers
from fp8_linen.families.conversion import TRAINING_ONLY, trace_once, traced
from fp8_linen.nnx.access import Serving, recording, weights
from fp8_linen.nnx.state import QuantState
from fp8_linen.product_report import only_product, regions_by_path

__all__ = ["convert", "traced_records"]


@dataclasses.dataclass(frozen=True)
class _CodesAsFloat:
  """A served layer's ``promote_dtype``: the stored codes as the float dtype QAT's layer saw.

  Flax's promotion has no implicit path from ``int4`` or fp8 to float, so
  the codes are cast (exactly) first and the layer's own promotion follows;
  the served product casts them back and XLA removes the pair (the codes
  reach the GEMM). Static and hashable, like the function it wraps.
  """

  kernel_dtype: str
  promote: Callable

  def __call__(self, args, /, **kwargs):
    inputs, kernel, *rest = args
    return self.promote((inputs, jnp.asarray(kernel).astype(self.kernel_dtype), *rest),
                        **kwargs)


@dataclasses.dataclass(frozen=True)
class _ReadAs:
  """An ``on_get_value`` hook: a weight stored as codes, read as the float dtype QAT's module saw.

  The module's own code then runs as in QAT (its casts and reshapes see the
  dtype they saw), and the served product casts the codes back exactly.
  """

  dtype: str

  def __call__(self, variable, value):
    del variable
    return value.astype(self.dtype) if hasattr(value, "astype") else value


def traced_records(model: nnx.Module, args, kwargs, *, mode: str, context=None) -> dict:
  """``path -> record`` of every product ``model(*args, **kwargs)`` runs in ``mode``, in one trace.

  ``context`` (a context manager, entered inside the trace) sets anything
  else the run needs.
  """
  graphdef, state = nnx.split(model)

  def run(state, *a, **k):
    m = nnx.merge(graphdef, state)
    with recording(m, mode) as records, (context or contextlib.nullcontext()):
      m(*a, **k)
    return records

  return trace_once(run, state, args, kwargs)


def _weights_used_once(model: nnx.Module, args, kwargs) -> dict:
  """``variable path -> the quantized products it reaches``, ``None`` where it is used otherwise.

  Read from the frozen QAT forward (a conversion run also compares each
  product's operand with every weight of its module).
  """
  graphdef, state = nnx.split(model)

  def run(state, *a, **k):
    with frozen_quantizers():
      return nnx.merge(graphdef, state)(*a, **k)

  fn, examples = traced(run, args, kwargs)
  return regions_by_path(fn, state, examples)


def site_weights(records: dict, layers: dict, model, args, kwargs) -> dict:
  """``site path -> (module, name)`` of the weight each op-level product folds to codes.

  A product in a module's own code folds the module weight its conversion
  run matched (:func:`~fp8_linen.core.serve.match_weight`) when that weight
  reaches only this product, through casts and reshapes; otherwise (another
  use, a loop, a stacked layer) the product quantizes it live.
  """
  wanted = {p: serve.weight_index(r) for p, r in records.items()}
  wanted = {p: i for p, i in wanted.items() if i is not None}
  if not wanted:
    return {}
  uses = _weights_used_once(model, args, kwargs)
  keys = {"/".join(str(p) for p in path): path for path, _ in nnx.iter_modules(model)}
  out = {}
  for path, i in wanted.items():
    owner_path = path.rpartition("/")[0]
    name, _ = weights(layers[owner_path])[i]
    if only_product(uses.get((*keys[owner_path], name)), path):
      out[path] = (layers[owner_path], name)
  return out


def _serve_layer(layer: nnx.Module, path: str, record, weight=None) -> None:
  """Turns one converted layer into a served one, in place (see the module doc).

  ``weight`` is ``(module, name)`` of an op-level product's folded weight.
  """
  if weight is None and serve.weight_index(record) is not None:
    record = dataclasses.replace(record, kernel_at=jnp.asarray(-1))
  kernel, arrays = serve.served_from_record(path or "<root>", record)
  for name, value in list(vars(layer).items()):
    if isinstance(value, QuantState) or name in TRAINING_ONLY:
      delattr(layer, name)
  if kernel is not None and weight is not None:
    var = getattr(*weight)
    old = var[...]
    hooks = var.get_metadata().get("on_get_value", ())
    var.set_value(jnp.reshape(kernel, old.shape))
    var.set_metadata(on_get_value=(_ReadAs(str(old.dtype)),
                                   *(hooks if isinstance(hooks, tuple) else (hooks,))))
  elif kernel is not None:
    old = layer.kernel[...]
    layer.kernel.set_value(jnp.reshape(kernel, old.shape))
    layer.promote_dtype = _CodesAsFloat(str(old.dtype), layer.promote_dtype)
  for name, value in arrays.items():
    setattr(layer, name, nnx.Param(jnp.asarray(value)))
  layer.serving = Serving(path=path or "<root>", arrays=tuple(sorted(arrays)))


def convert(model: nnx.Module, *args: Any, **kwargs: Any) -> nnx.Module:
  """Turns a trained NNX QAT model into a served NNX model (``model`` is left as it is).

  Args:
    model: an NNX model whose quantized layers are ``fl.nnx.Linear``,
      ``LinearGeneral``, ``Einsum`` or ``Conv`` (own or
      :func:`~fp8_linen.nnx.quantize_model`'d), with its trained
      parameters and :class:`~fp8_linen.nnx.QuantState`.
    *args: example inputs of ``model(...)`` (arrays or
      ``jax.ShapeDtypeStruct``; only their shapes matter): the forward is
      traced once to find every quantized product and its layout.
    **kwargs: keyword arguments of ``model(...)``.

  Returns:
    The served model: a copy of ``model`` whose quantized layers hold codes
    and their scales (see the module doc). Call it, ``nnx.jit`` it, save
    ``nnx.state(served)`` with orbax, or ``jax.export`` the function of
    ``nnx.split(served)``; :func:`fp8_linen.weight_bytes` gives its size.

  Raises:
    ValueError: naming the layer, for a layer without trained quantization
      state or a recipe that cannot be served, or for a model that runs no
      quantized product.
    TypeError: for arguments of the wrong kind.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import fp8_linen as fl
    >>> try:
    ...   fl.nnx.convert(fl.nnx.Linear(5, 3, rngs=nnx.Rngs(0)), jnp.ones((2, 5)))
    ... except ValueError as e:
    ...   print(str(e)[:48])
    <root>: has no trained quantization state: its f
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"fl.nnx.convert: model must be an nnx.Module, got {type(model).__name__} "
                    "(for a Linen model use fl.convert)")
  if any(getattr(m, "serving", None) is not None for _, m in nnx.iter_modules(model)):
    raise TypeError("fl.nnx.convert: model is already served")
  if not args and not kwargs:
    raise TypeError("fl.nnx.convert(model, *example_inputs): give example inputs of the "
                    "forward (arrays or jax.ShapeDtypeStruct) so it can be traced once")
  # Frozen: the forward conversion traces is the one the served model computes.
  records = traced_records(model, args, kwargs, mode="convert", context=frozen_quantizers())
  if not records:
    raise serve.no_product_error(
        "fl.nnx.convert", "fl.nnx.Linear/LinearGeneral/Einsum/Conv or wrap it with "
        "fl.nnx.quantize_model")
  served = nnx.clone(model)
  layers = {"/".join(str(p) for p in path): m for path, m in nnx.iter_modules(served)}
  folded = site_weights(records, layers, model, args, kwargs)
  for path, record in records.items():
    _serve_layer(layers[path], path, record, folded.get(path))
  return served
