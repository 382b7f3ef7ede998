"""The quantization state of an arm: which layers to trace, traces, health.

fp8 layers keep a scale and an amax history per tensor role in the
``_overwrite_with_gradient`` collection; :mod:`fp8_linen.monitor` reads
those. Integer layers keep different state, which this module adds:

* an observer's range ``<role>_range = [-min, max]`` in the same collection
  (straight-through estimator with ``minmax``/``moving_average`` observers);
* learned step sizes ``<role>_step`` (and LSQ+ offsets ``<role>_offset``) in
  ``params`` (LSQ/LSQ+).

A step size means what an fp8 scale means: ``x ~= q * step`` for the integer
``q``, as ``x ~= f * scale`` for the fp8 value ``f``.
"""

from __future__ import annotations

from typing import Any, Mapping

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from fp8_linen import monitor

INT_ROLES = ('input', 'kernel')
"""Roles an integer recipe quantizes (gradients stay in float)."""

STEP_LEAVES = frozenset(f'{role}_step' for role in INT_ROLES)
OFFSET_LEAVES = frozenset(f'{role}_offset' for role in INT_ROLES)
RANGE_LEAVES = frozenset(f'{role}{monitor.RANGE_SUFFIX}' for role in INT_ROLES)


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
  if not isinstance(tree, Mapping) or not tree:
    return {}
  return traverse_util.flatten_dict(tree)


def _int_leaves(variables: Mapping[str, Any]):
  """Yields ``(module_path, leaf_name, value)`` of integer-QAT state."""
  for key, value in _flat(variables.get('params', {})).items():
    if key[-1] in STEP_LEAVES | OFFSET_LEAVES:
      yield key[:-1], key[-1], value
  for key, value in _flat(monitor.owg_collection(variables)).items():
    if key[-1] in RANGE_LEAVES:
      yield key[:-1], key[-1], value


def quantized_modules(variables: Mapping[str, Any]) -> list[tuple[str, ...]]:
  """Paths of modules holding fp8 scales or integer steps/ranges.

  Example:
    >>> import numpy as np
    >>> quantized_modules({'params': {'fc': {'kernel': np.ones(2),
    ...                                      'input_step': np.ones(1)}}})
    [('fc',)]
  """
  paths = list(monitor.quantized_modules(variables))
  for path, _, _ in _int_leaves(variables):
    if path not in paths:
      paths.append(path)
  return paths


def trace_values(variables: Mapping[str, Any],
                 modules: list[tuple[str, ...]]) -> dict[str, jax.Array]:
  """Scalars to record per step for ``modules`` (jit-friendly).

  Keys are ``<path>/<role>_<what>``:

  * ``scale``, ``amax``: an fp8 role's scale and newest amax
    (:func:`fp8_linen.monitor.trace_values`);
  * ``step``: an integer role's learned step size (mean over channels for
    per-channel or per-group weights);
  * ``range``: an integer observer's ``max(-min, max)``, the largest
    magnitude it has seen (or its moving average).

  Args:
    variables: The full variables dict.
    modules: Module paths from :func:`quantized_modules`.

  Returns:
    A flat dict of float32 scalars.
  """
  out = dict(monitor.trace_values(variables, modules))
  for path, leaf, value in _int_leaves(variables):
    if path not in modules or leaf in OFFSET_LEAVES:
      continue  # Offsets may be negative or zero: not for a log axis.
    name = '/'.join(path)
    value = jnp.ravel(value).astype(jnp.float32)
    if leaf in STEP_LEAVES:
      out[f'{name}/{leaf}'] = jnp.mean(jnp.abs(value))
    else:
      out[f'{name}/{leaf}'] = jnp.max(value)
  return out


def health(variables: Mapping[str, Any],
           steps_done: int) -> dict[str, int] | None:
  """Counts the entries of the quantization state that signal trouble.

  Args:
    variables: The full variables dict after training.
    steps_done: Optimizer steps taken.

  Returns:
    ``None`` without quantization state. Otherwise the counts of
    :func:`fp8_linen.monitor.state_health` (zeros where there is no fp8
    state) plus ``int_values`` / ``nonfinite_int_values``: entries of the
    learned integer steps and offsets and how many are NaN or inf (observer
    ranges are in ``scales``/``nonfinite_scales``, as the monitor counts
    them).

  Example:
    >>> import numpy as np
    >>> h = health({'params': {'fc': {'input_step': np.array([np.nan])}}}, 1)
    >>> h['int_values'], h['nonfinite_int_values']
    (1, 1)
  """
  counts = monitor.state_health(variables, steps_done)
  int_values = nonfinite = 0
  for _, leaf, value in _int_leaves(variables):
    if leaf in RANGE_LEAVES:
      continue  # The monitor counts observer ranges with the scales.
    value = np.asarray(jax.device_get(value), dtype=np.float64)
    int_values += value.size
    nonfinite += int((~np.isfinite(value)).sum())
  if counts is None and not int_values:
    return None
  counts = dict(counts or dict(scales=0, nonfinite_scales=0, amax_entries=0,
                               zero_amax=0, skipped_amax=0, nonfinite_amax=0))
  counts.update(int_values=int_values, nonfinite_int_values=nonfinite)
  return counts


def summarize_health(h: Mapping[str, int]) -> dict[str, int | None]:
  """The three numbers the results table shows.

  Returns:
    ``values``: state entries checked (scales, amax histories, integer steps
    and ranges); ``nonfinite``: how many of them are NaN or inf;
    ``skipped``: amax observations missing among the steps trained (a batch
    with a NaN/inf amax is recorded as 0), ``None`` without amax histories.
    A zero in an amax history beyond the steps trained is not counted: it is
    just not filled yet.
  """
  values = h['scales'] + h['amax_entries'] + h.get('int_values', 0)
  return {'values': values,
          'nonfinite': (h['nonfinite_scales'] + h['nonfinite_amax']
                        + h.get('nonfinite_int_values', 0)),
          'skipped': h['skipped_amax'] if h['amax_entries'] else None}
