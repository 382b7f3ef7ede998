"""Generic views of quantization state: traces and health checks.

Everything here walks the ``_overwrite_with_gradient`` collection by key
names only (``*_scale``, ``*_range`` and ``*_amax_history`` leaves), so it
works for any quantized layer that follows the flax naming, whatever module
holds it.
"""

from __future__ import annotations

from typing import Any, Mapping

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from fp8_linen.core.owg import OWG

SCALE_SUFFIX = '_scale'
RANGE_SUFFIX = '_range'  # Integer observers: [-min, max] of an operand.
HISTORY_SUFFIX = '_amax_history'


def owg_collection(variables: Mapping[str, Any]) -> Mapping[str, Any]:
  """Returns the quantization-state collection of ``variables`` (or ``{}``)."""
  return variables.get(OWG, {}) if hasattr(variables, 'get') else {}


def _flat(tree: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
  if not tree:
    return {}
  return traverse_util.flatten_dict(tree)


def quantized_modules(variables: Mapping[str, Any]) -> list[tuple[str, ...]]:
  """Paths of modules holding any ``*_scale`` leaf, in tree order."""
  paths = []
  for key in _flat(owg_collection(variables)):
    if key[-1].endswith(SCALE_SUFFIX) and key[:-1] not in paths:
      paths.append(key[:-1])
  return paths


def pick_evenly(items: list[Any], count: int) -> list[Any]:
  """Up to ``count`` items spread evenly (first and last included)."""
  if len(items) <= count:
    return list(items)
  idx = np.linspace(0, len(items) - 1, count).round().astype(int)
  return [items[i] for i in sorted(set(idx))]


def trace_values(variables: Mapping[str, Any],
                 modules: list[tuple[str, ...]]) -> dict[str, jax.Array]:
  """Scalars to trace per step for ``modules`` (jit-friendly).

  For each module and each role ``r`` it holds, returns ``<path>/r_scale``
  (the first scale entry) and ``<path>/r_amax`` (the newest amax, history
  index 0).

  Args:
    variables: The full variables dict.
    modules: Module paths from :func:`quantized_modules`.

  Returns:
    A flat dict of float32 scalars.
  """
  flat = _flat(owg_collection(variables))
  out = {}
  for key, value in flat.items():
    if key[:-1] not in modules:
      continue
    name = '/'.join(key[:-1])
    leaf = key[-1]
    value = jnp.ravel(value)
    if leaf.endswith(SCALE_SUFFIX) and value.size:
      out[f'{name}/{leaf}'] = value[0].astype(jnp.float32)
    elif leaf.endswith(HISTORY_SUFFIX) and value.size:
      role = leaf[:-len(HISTORY_SUFFIX)]
      out[f'{name}/{role}_amax'] = value[0].astype(jnp.float32)
  return out


def state_health(variables: Mapping[str, Any],
                 steps_done: int) -> dict[str, int] | None:
  """Counts suspicious entries of the quantization state.

  Args:
    variables: The full variables dict after training.
    steps_done: Optimizer steps taken; history entries beyond this many
      cannot have been filled yet.

  Returns:
    ``None`` if there is no quantization state, else a dict with
    ``scales`` / ``nonfinite_scales`` (entries of ``*_scale`` leaves, and of
    the integer observers' ``*_range`` leaves, and how many are NaN or inf), ``amax_entries`` / ``zero_amax`` (entries of
    ``*_amax_history`` leaves and how many are exactly zero),
    ``skipped_amax`` (zeros among the first ``steps_done`` entries of each
    history: observations that should be there but are not) and
    ``nonfinite_amax``.
  """
  flat = _flat(owg_collection(variables))
  if not flat:
    return None
  health = dict(scales=0, nonfinite_scales=0, amax_entries=0, zero_amax=0,
                skipped_amax=0, nonfinite_amax=0)
  for key, value in flat.items():
    value = np.asarray(jax.device_get(value), dtype=np.float64)
    if key[-1].endswith((SCALE_SUFFIX, RANGE_SUFFIX)):
      health['scales'] += value.size
      health['nonfinite_scales'] += int((~np.isfinite(value)).sum())
    elif key[-1].endswith(HISTORY_SUFFIX):
      history = np.atleast_1d(value)
      history = history.reshape(-1, history.shape[-1])
      health['amax_entries'] += history.size
      health['zero_amax'] += int((history == 0).sum())
      health['skipped_amax'] += int((history[:, :steps_done] == 0).sum())
      health['nonfinite_amax'] += int((~np.isfinite(history)).sum())
  return health
