"""LoRA and QLoRA on a served Linen model: :func:`add_lora`, :func:`split_lora`, :func:`merge_lora`.

QLoRA fine-tunes a model whose weights stay quantized: the served model of
:func:`~fp8_linen.ptq` or :func:`~fp8_linen.convert` keeps its weights as
int4 / int8 / fp8 codes, and small adapters beside them are trained with
optax (:mod:`fp8_linen.families.lora` says how the products run). Merging
folds the adapters into the dequantized weights of a float model, which
:func:`~fp8_linen.ptq` quantizes again for serving.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
  >>> import fp8_linen as fl
  >>> model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(4)])
  >>> x = jax.random.normal(jax.random.key(0), (16, 8))
  >>> served, sp, _, _ = fl.ptq(model, model.init(jax.random.key(1), x), [x],
  ...                           recipe=fl.weight_only(4))
  >>> params = fl.add_lora(served, sp, x, rank=2)
  >>> adapters, frozen = fl.split_lora(params)
  >>> loss = lambda a: jnp.mean((served.apply(fl.join_lora(a, frozen), x) - 1.0) ** 2)
  >>> tx = optax.adam(1e-2)
  >>> grads = jax.grad(loss)(adapters)
  >>> updates, _ = tx.update(grads, tx.init(adapters))
  >>> adapters = optax.apply_updates(adapters, updates)
  >>> merged = fl.merge_lora(served, fl.join_lora(adapters, frozen), x)
  >>> merged['params']['layers_0']['kernel'].dtype
  dtype('float32')
"""

from __future__ import annotations

from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp
from flax import traverse_util

from fp8_linen.conversion import ServedModel, ServedModule
from fp8_linen.core import lora as core_lora
from fp8_linen.core import serve
from fp8_linen.families import lora
from fp8_linen.families.conversion import trace_once
from fp8_linen.linen import access
from fp8_linen.linen.access import SERVED

__all__ = ["add_lora", "split_lora", "join_lora", "merge_lora"]


def _check_served(who: str, served, params) -> None:
  if not isinstance(served, (ServedModule, ServedModel)):
    raise TypeError(f"{who}: served must be the served model fl.convert or fl.ptq returned, "
                    f"got {type(served).__name__}")
  if not isinstance(params, Mapping) or "params" not in params:
    raise TypeError(f"{who}: params must be the served params ({{'params': ...}}), got "
                    f"{type(params).__name__}")


def _records(served, params, kind, context, args, kwargs) -> list:
  def run(v, *a, **k):
    with context:
      return served.apply(v, *a, mutable=[SERVED], **k)[1]
  state = trace_once(run, params, args, kwargs)
  return list(access.records(flax.core.unfreeze(state).get(SERVED, {}), kind))


def _node(tree: dict, path) -> dict:
  for p in path:
    tree = tree[p]
  return tree


def add_lora(served, params, *args: Any, rank: int = 8, alpha: float | None = None,
             paths: str | None = None, seed: int = 0, **kwargs: Any) -> dict:
  """Served params with a LoRA adapter beside every stored weight ``paths`` matches.

  Args:
    served: the served model (:func:`~fp8_linen.convert`, :func:`~fp8_linen.ptq`).
    params: its served params.
    *args: example inputs of the forward (arrays or ``jax.ShapeDtypeStruct``:
      the forward is traced once to find each product's layout).
    rank: the adapters' rank.
    alpha: the adapters' output is scaled by ``alpha / rank`` (default
      ``rank``: by one).
    paths: a regular expression searched in each layer's path (``'/'``
      joined, as errors and :func:`~fp8_linen.product_report` name them);
      ``None``: every layer with a stored weight.
    seed: the adapters' ``A`` are drawn from ``jax.random.key(seed)``
      folded with the layer's path; ``B`` starts at zero, so the model's
      output is unchanged until the adapters train.
    **kwargs: keyword arguments of the forward.

  Returns:
    The params with ``lora_a``, ``lora_b`` (float32, trained) and
    ``lora_scale`` (``alpha / rank``) next to each adapted layer's
    ``kernel``. Train ``split_lora(params)[0]``.

  Raises:
    ValueError: for a bad ``rank`` / ``alpha`` / ``paths``, when no layer
      matches, or naming a layer whose product cannot take an adapter (batch
      axes, a grouped convolution).
    TypeError: for arguments of the wrong kind.
  """
  who = "fl.add_lora"
  _check_served(who, served, params)
  lora.check_rank(who, rank)
  alpha = float(rank if alpha is None else alpha)
  if not jnp.isfinite(alpha):
    raise ValueError(f"{who}: alpha must be finite, got {alpha}")
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params["params"]))
  if any(k[-1] in core_lora.NAMES for k in flat):
    raise ValueError(f"{who}: params already hold LoRA adapters; merge them first "
                     "(fl.merge_lora, then fl.ptq)")
  plans = _records(served, params, lora.LoraPlan, lora.adding(rank=rank, paths=paths), args,
                   kwargs)
  if not plans:
    raise ValueError(f"{who}: no served layer with a stored weight matches paths={paths!r}")
  key = jax.random.key(seed)
  new = flax.core.unfreeze(params["params"])
  for path, plan in plans:
    where = "/".join(path) or "<root>"
    node = _node(new, path)
    node["lora_a"] = core_lora.init_a(core_lora.adapter_key(key, where), plan.a_shape, plan.fan_in)
    node["lora_b"] = jnp.zeros(plan.b_shape, jnp.float32)
    node["lora_scale"] = jnp.asarray(alpha / rank, jnp.float32)
  return {**params, "params": new}


def split_lora(params) -> tuple[dict, dict]:
  """``(adapters, frozen)``: the trained ``lora_a``/``lora_b`` and everything else.

  Both keep the params' nesting; :func:`join_lora` puts them back together.
  Differentiate and update ``adapters`` only: the frozen part holds integer
  codes, which have no gradient.
  """
  flat = traverse_util.flatten_dict(flax.core.unfreeze(params), sep=None)
  adapters = {k: v for k, v in flat.items() if k[-1] in core_lora.ADAPTERS}
  if not adapters:
    raise ValueError("fl.split_lora: params hold no LoRA adapters (create them with "
                     "fl.add_lora)")
  frozen = {k: v for k, v in flat.items() if k[-1] not in core_lora.ADAPTERS}
  return traverse_util.unflatten_dict(adapters), traverse_util.unflatten_dict(frozen)


def join_lora(adapters, frozen) -> dict:
  """The params :func:`split_lora` split (the adapters may be updated)."""
  flat = traverse_util.flatten_dict(flax.core.unfreeze(frozen))
  flat.update(traverse_util.flatten_dict(flax.core.unfreeze(adapters)))
  return traverse_util.unflatten_dict(flat)


def merge_lora(served, params, *args: Any, **kwargs: Any) -> dict:
  """Float variables of the model, each stored weight dequantized plus its adapter's update.

  Every layer with a stored weight gets ``kernel = dequantized codes +
  lora_scale * A B`` (float, in the dtype the layer's kernel had before
  quantization); its served arrays and adapters are dropped. The result is
  the float model's variables: :func:`~fp8_linen.ptq` of the model
  :func:`~fp8_linen.ptq` was given quantizes them again for serving
  (merge-and-requantize).

  Args:
    served: the served model.
    params: its served params, with adapters (:func:`add_lora`) or without.
    *args: example inputs of the forward.
    **kwargs: keyword arguments of the forward.

  Raises:
    ValueError: naming a layer whose stored weight cannot be dequantized
      (MXFP8 / NVFP4 blocks).
    TypeError: for arguments of the wrong kind.
  """
  who = "fl.merge_lora"
  _check_served(who, served, params)
  merged = _records(served, params, lora.LoraMerge, lora.merging(), args, kwargs)
  if not merged:
    raise serve.no_product_error(who, "a served model of fl.convert / fl.ptq")
  dtypes = {(tuple(p), *(n or ("kernel",))): d for p, d, *n in served.kernel_dtypes}
  new = flax.core.unfreeze(params["params"])
  drop = set(serve.SERVED_NAMES) | set(core_lora.NAMES)
  for path, rec in merged:
    at = int(rec.kernel_at)
    if at >= 0:  # else a live right operand: nothing stored to merge
      dest_path = tuple(path if at == 0 else path[:-1])
      dest = _node(new, dest_path)
      # A product in a module's own code: the module weight it multiplies.
      name = ("kernel" if at < serve.WEIGHT_AT else
              access.weights(dest)[at - serve.WEIGHT_AT][0])
      old = jnp.asarray(dest[name])
      dest[name] = jnp.reshape(rec.kernel, old.shape).astype(
          dtypes.get((dest_path, name), "float32"))
    node = _node(new, path)
    for name in [n for n in node if n in drop and n != "kernel"]:
      node.pop(name)
  return {**params, "params": new}
