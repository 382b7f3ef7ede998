"""From QAT to a served model: :func:`convert`, :class:`ServedModule`, :class:`ServedModel`.

After quantization-aware training, :func:`convert` turns a model and its
trained variables into a model that computes in low precision:

* every quantized weight is quantized once, with the scale the QAT forward
  used, and stored in place of the float ``kernel`` as ``int8``, ``int4``
  (``jnp.int4``), fp8 or (NVFP4) e2m1 codes, with its scales next to it
  (:mod:`fp8_linen.core.serve` lists the names);
* activation quantization is frozen from the trained state (fp8 delayed: the
  scale the amax history gives, NVFP4 delayed too; LSQ/LSQ+: the learned
  step/offset; STE observers: the recorded range). fp8 current, row-wise,
  MXFP8 and NVFP4 current scaling measure each batch, in serving too;
* training-only state is dropped: the ``_overwrite_with_gradient`` collection
  (amax histories, observer ranges) and the learned quantizer parameters
  become the few arrays serving reads;
* the served products run the QAT forward from those arrays: int8 x int8 ->
  int32 (:func:`~fp8_linen.core.int_gemm.int_gemm`, the very function QAT
  runs) and fp8 x fp8 GEMMs (the "multiply" half of QAT's fp8 product), so
  the served model equals the QAT model evaluated with frozen quantizers
  (:func:`~fp8_linen.frozen_quantizers`) bit for bit, on any batch. (In
  training mode an STE observer folds each batch into its range, so only
  batches inside a ``'minmax'`` range evaluate as served.)

It works for models built from the library's layers (``QDense``,
``QDenseGeneral``, ``QEinsum``, ``QConv``, ``Fp8DotGeneral`` in a flax layer)
and for :func:`~fp8_linen.quantize_model`'d models: the same model code runs
in ``'convert'`` mode, where every product also records the served arrays
through its layer (:mod:`fp8_linen.families`), and in ``'serve'`` mode,
which reads them. NNX models: :func:`fp8_linen.nnx.convert` (the same
records, kept by the NNX layers).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> model = fl.QDense(4, recipe=fl.int8_lsq())
  >>> x = jax.random.normal(jax.random.key(0), (8, 16))
  >>> variables = model.init(jax.random.key(1), x)
  >>> served, params = fl.convert(model, variables, x)
  >>> params['params']['kernel'].dtype
  dtype('int8')
  >>> with fl.frozen_quantizers():
  ...   qat = model.apply(variables, x)
  >>> bool((served.apply(params, x) == qat).all())
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fp8_linen.core import serve
from fp8_linen.core.owg import OWG, frozen_quantizers
from fp8_linen.families import modes
from fp8_linen.families.conversion import TRAINING_ONLY, trace_once, traced
from fp8_linen.linen import access
from fp8_linen.linen.access import SERVED
from fp8_linen.product_report import only_product, regions_by_path

__all__ = ["convert", "ServedModule", "ServedModel", "weight_bytes"]


def _low_precision(dtype) -> bool:
  dtype = jnp.dtype(dtype)
  return not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize == 1


def _as_layer_sees(variables, kernel_dtypes):
  """``variables`` with each stored kernel cast (exactly) to the float dtype QAT's layer saw.

  Flax's ``promote_dtype`` has no implicit promotion for fp8, so the codes are
  handed to the layer as float; the served product casts them back and XLA
  removes the pair (the codes reach the GEMM).
  """
  if not isinstance(variables, Mapping) or "params" not in variables:
    raise TypeError("the served model's apply: variables must be fl.convert's served params "
                    "({'params': ...})")
  params = flax.core.unfreeze(variables["params"])
  for path, dtype, *name in kernel_dtypes:
    name = name[0] if name else "kernel"
    node = params
    for p in path:
      node = node[p]
    k = jnp.asarray(node[name])
    if not _low_precision(k.dtype):
      raise ValueError(f"{'/'.join(path)}: {name} is {k.dtype}, not the low-precision codes "
                       "fl.convert stored; apply the served model to the params fl.convert "
                       "returned")
    node[name] = k.astype(dtype)
  return {**variables, "params": params}


class ServedModule(nn.Module):
  """A converted Linen model: the model itself, run in serving mode.

  Its variables are the served params, at the model's own paths
  (``nn.share_scope``). ``apply(served_params, *args)`` as for the model
  (``method=`` names one of the model's methods).

  Attributes:
    model: the QAT model.
    kernel_dtypes: ``(path, dtype, name)`` of every weight stored as codes
      (``name``: ``'kernel'``, or the module's own parameter a product in its
      code multiplies): the float dtype the layer saw in QAT (see ``apply``).
  """

  model: nn.Module
  kernel_dtypes: tuple = ()

  def setup(self):
    nn.share_scope(self, self.model)

  def __call__(self, *args, **kwargs):
    with modes.mode("serve"):
      return self.model(*args, **kwargs)

  def apply(self, variables, *args, method=None, **kwargs):  # pylint: disable=arguments-differ
    """The served forward; the stored kernels are handed to the layers as QAT's dtype."""
    variables = _as_layer_sees(variables, self.kernel_dtypes)
    if method is not None:
      name = method if isinstance(method, str) else method.__name__

      def method(module, *a, **k):
        with modes.mode("serve"):
          return getattr(module.model, name)(*a, **k)
    return super().apply(variables, *args, method=method, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel:
  """A converted :class:`~fp8_linen.QuantizedModel`: ``apply(served_params, *args)``.

  Attributes:
    model: the QAT :class:`~fp8_linen.QuantizedModel`, run in serving mode.
    kernel_dtypes: as for :class:`ServedModule`.
  """

  model: Any
  kernel_dtypes: tuple = ()

  def apply(self, variables, *args, **kwargs):
    """The served forward (same arguments as the model's ``apply``)."""
    variables = _as_layer_sees(variables, self.kernel_dtypes)
    with modes.mode("serve"):
      return self.model.apply(variables, *args, **kwargs)


def _weight_uses(model, variables, args, kwargs) -> dict:
  """``variable path -> the quantized products it reaches`` (``None``: it is used otherwise).

  Read from the frozen QAT forward (a conversion run also compares each
  product's operand with every weight of its module).
  """
  def run(v, *a, **k):
    with frozen_quantizers():
      return model.apply(v, *a, **k)

  fn, examples = traced(run, args, kwargs)
  return regions_by_path(fn, variables, examples)


def own_weights(model, variables, params: dict, args, kwargs, records) -> dict:
  """``product path -> name`` of the weight each product in a module's own code may rewrite.

  ``records`` are ``(path, record)`` pairs whose ``kernel_at`` says which of
  its module's weights (``params``, unfrozen) a product matched
  (:func:`~fp8_linen.core.serve.match_weight`); a weight qualifies when it
  reaches that product alone, through casts and reshapes (else another use,
  a loop or a stacked layer would see the change).
  """
  wanted = {tuple(p): serve.weight_index(r) for p, r in records}
  wanted = {p: i for p, i in wanted.items() if i is not None}
  if not wanted:
    return {}
  uses = _weight_uses(model, variables, args, kwargs)
  out = {}
  for path, i in wanted.items():
    name = access.weights(_node(params, path[:-1]))[i][0]
    if only_product(uses.get(("params", *path[:-1], name)), "/".join(path)):
      out[path] = name
  return out


def _node(tree: dict, path) -> dict:
  for p in path:
    tree = tree.setdefault(p, {})
  return tree


def convert(model, variables, *args, **kwargs):
  """Turns a QAT model and its trained variables into a served model and params.

  Args:
    model: a Linen module built from the library's layers, or a
      :class:`~fp8_linen.QuantizedModel`.
    variables: its trained variables (``params`` and the
      ``_overwrite_with_gradient`` collection, as training left them).
    *args: example inputs of the model's forward (arrays or
      ``jax.ShapeDtypeStruct``; only their shapes matter): conversion traces
      the forward once to find every quantized product and its layout.
    **kwargs: keyword arguments of the model's forward (``method=`` too).

  Returns:
    ``(served_model, served_params)``: a :class:`ServedModule` (a Linen
    module, for a Linen model) or a :class:`ServedModel` (for a
    ``QuantizedModel``), and the
    variables it reads (``{'params': ...}`` plus any non-quantization
    collection such as ``batch_stats``).

  Raises:
    ValueError: naming the layer, for a layer without trained quantization
      state, a recipe that cannot be served, variables that do not fit the
      model, or a model with no quantized product.
    TypeError: for arguments of the wrong kind.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> model = fl.QDense(3)
    >>> x = jnp.ones((2, 5))
    >>> try:
    ...   fl.convert(model, model.init(jax.random.key(0), x), x)
    ... except ValueError as e:
    ...   print(str(e)[:48])
    <root>: has no trained quantization state: its f
  """
  if isinstance(model, (ServedModel, ServedModule)):
    raise TypeError("fl.convert: model is already served")
  if not hasattr(model, "apply"):
    raise TypeError(f"fl.convert: model must be a Linen module or a QuantizedModel, got "
                    f"{type(model).__name__}")
  if not isinstance(variables, Mapping) or "params" not in variables:
    raise TypeError("fl.convert: variables must be the model's variables ({'params': ..., "
                    f"'{OWG}': ...}}), got {type(variables).__name__}")
  if not args and not {k for k in kwargs if k != "method"}:
    raise TypeError("fl.convert(model, variables, *example_inputs): give example inputs of "
                    "the forward (arrays or jax.ShapeDtypeStruct) so it can be traced once")
  def run(v, *a, **k):
    with modes.mode("convert"):
      return model.apply(v, *a, mutable=[SERVED], **k)[1]

  try:
    state = trace_once(run, variables, args, kwargs)
  except flax.errors.FlaxError as e:
    raise ValueError(f"fl.convert: the variables do not fit the model: {e}") from e
  records = list(access.records(flax.core.unfreeze(state).get(SERVED, {}), serve.ServedRecord))
  if not records:
    raise serve.no_product_error(
        "fl.convert", "fl.QDense/QDenseGeneral/QEinsum/QConv or wrap it with fl.quantize_model")
  params = flax.core.unfreeze(variables["params"])
  own = own_weights(model, variables, params, args, kwargs, records)
  kernel_dtypes = []
  for path, rec in records:
    # A product in a module's own code stores the module weight it matched, if
    # that weight reaches this product alone; else it quantizes it live.
    name = own.get(tuple(path), "kernel")
    if serve.weight_index(rec) is not None and tuple(path) not in own:
      rec = dataclasses.replace(rec, kernel_at=jnp.asarray(-1))
    kernel, arrays = serve.served_from_record("/".join(path) or "<root>", rec)
    node = _node(params, path)
    for key in TRAINING_ONLY:
      node.pop(key, None)
    if kernel is not None:
      # Fp8DotGeneral multiplies its parent's kernel (kernel_at 1), a
      # product in a module's own code one of the module's weights.
      dest_path = path if int(rec.kernel_at) == 0 else path[:-1]
      dest = _node(params, dest_path)
      old = jnp.asarray(dest[name])
      dest[name] = jnp.reshape(kernel, old.shape)
      kernel_dtypes.append((tuple(dest_path), str(old.dtype), name))
    node.update(arrays)
  served = {c: v for c, v in variables.items() if c not in (OWG, SERVED, "params")}
  served["params"] = params
  kernel_dtypes = tuple(kernel_dtypes)
  if isinstance(model, nn.Module):
    return ServedModule(model, kernel_dtypes), served
  return ServedModel(model=model, kernel_dtypes=kernel_dtypes), served


# 4-bit formats: numpy gives them an itemsize of one byte, but they hold half of one.
_FOUR_BIT = tuple(jnp.dtype(t) for t in (jnp.int4, jnp.uint4, jnp.float4_e2m1fn))


def weight_bytes(tree) -> int:
  """Bytes of the arrays in ``tree`` as stored: 4-bit codes counted at half a byte.

  ``jnp.int4``/``uint4`` (int4 recipes) and ``float4_e2m1fn`` (NVFP4) take
  half a byte per element (what the format holds); everything else its
  itemsize.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> fl.weight_bytes({'k': jnp.zeros((4, 4), jnp.int4), 's': jnp.zeros((4,))})
    24
    >>> fl.weight_bytes({'k': jnp.zeros((4, 32), jnp.float4_e2m1fn),
    ...                  's': jnp.zeros((4, 2), jnp.float8_e4m3fn)})
    72
  """
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    dtype = jnp.dtype(leaf.dtype)
    bits = 4 if dtype in _FOUR_BIT else 8 * dtype.itemsize
    total += leaf.size * bits / 8
  return int(np.ceil(total))
