"""Post-training quantization, written once for both Flax APIs: calibration and what it sets.

``fl.ptq`` and ``fl.nnx.ptq`` run the model on a few calibration batches in
``'calibrate'`` mode (:func:`calibrating`). There every product computes the
*float* product (calibration measures the float model) and records, through
its layer's :class:`~fp8_linen.families.VariableAccess`, a
:class:`CalibrationRecord`: its input's exact min/max, a bounded sample of
its values, its right operand and, for GPTQ, the Hessian ``X^T X`` of its
input. The APIs merge the records of all batches (:func:`merge`) and
:func:`calibrated` turns each product's statistics into the values of the
layer's quantization variables, under the names the recipe families use:

============================ =============================================
recipe role                  set from the calibration
============================ =============================================
int STE activation           ``input_range`` = ``[-lo, hi]`` (observer)
int LSQ / LSQ+ activation    ``input_step`` (``input_offset``) spanning
                             ``[lo, hi]`` on the grid
int LSQ / LSQ+ weight        ``kernel_step`` (``kernel_offset``) from the
                             weight's range per tensor / channel / group;
                             GPTQ (dense products without batch axes;
                             others round to nearest): its scales, and the
                             ``kernel`` becomes GPTQ's rounded weight
                             (codes x scale)
int STE weight               nothing (its own min/max, as in QAT)
fp8 delayed activation       ``input_amax_history`` = ``[max(-lo, hi), 0,
                             ...]`` and ``input_scale``
fp8 delayed weight           ``kernel_amax_history`` / ``kernel_scale``
                             from the weight's amax
fp8 current scaling          nothing (scales from each batch)
``Fp8WeightOnly``            nothing (the weight's own amax)
============================ =============================================

``[lo, hi]`` is the range :func:`~fp8_linen.core.calibration.choose_range`
picks (``PtqConfig.activation``). Each API writes these values into its
variables and calls its ``convert``: a PTQ model is served exactly as a
QAT model is.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.families import calibration
  >>> rec = calibration.record(jnp.array([[-2.0, 1.0]]), jnp.ones((2, 3)), (1,), (0,), (),
  ...                          recipe=fl.IntRecipe(), samples=8, with_hessian=False)
  >>> stats = calibration.merge(None, rec)
  >>> values, kernel = calibration.calibrated(stats, fl.PtqConfig(), where='dense')
  >>> values['input_range'].tolist(), kernel is None
  ([2.0, 1.0], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8_linen.core import calibration as core_calibration
from fp8_linen.core import gptq as core_gptq
from fp8_linen.core import int_numerics, lowering, numerics, settings
from fp8_linen.families import modes
from fp8_linen.recipes.fp8 import Fp8Recipe, Fp8WeightOnly
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe
from fp8_linen.recipes.ptq import PtqConfig

__all__ = ["CalibrationRecord", "ProductStats", "calibrating", "record", "float_dot",
           "float_conv", "merge", "calibrated", "check_recipe", "batch_list", "check_batches",
           "no_product_error"]

# (samples per product and batch, whether products compute their input's Hessian)
_OPTIONS = settings.TraceSetting("ptq_calibration", default=None)


@contextlib.contextmanager
def calibrating(*, samples: int, with_hessian: bool):
  """Runs every product of the block in ``'calibrate'`` mode (see the module doc)."""
  with modes.mode("calibrate"), _OPTIONS.set((int(samples), bool(with_hessian))):
    yield


def options() -> tuple[int, bool]:
  """``(samples, with_hessian)`` of the calibration in force."""
  opts = _OPTIONS.get()
  return (65536, False) if opts is None else opts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationRecord:
  """What one product records of one calibration batch (a pytree a jitted run returns).

  Attributes:
    lo: its input's minimum (float32 scalar).
    hi: its input's maximum.
    sample: at most ``samples`` of its input's values (float32, flat).
    hessian: ``X^T X`` of its input over the contracting axes (``(K, K)``), or
      ``(0, 0)`` where not computed.
    rhs: its right operand as the product sees it.
    kernel_at: where the layer keeps that operand as its ``kernel`` (``0``
      itself, ``1`` its parent, ``-1`` nowhere; as in conversion records).
    kernel_equal: whether the ``kernel`` reaches the product unchanged.
    recipe: the product's recipe (static).
    contract: the right operand's contracting axes (static).
    batch: its batch axes (static).
    conv: whether the product is a convolution (static).
  """

  lo: jax.Array
  hi: jax.Array
  sample: jax.Array
  hessian: jax.Array
  rhs: jax.Array
  kernel_at: jax.Array
  kernel_equal: jax.Array
  recipe: Any = dataclasses.field(metadata=dict(static=True))
  contract: tuple = dataclasses.field(metadata=dict(static=True))
  batch: tuple = dataclasses.field(default=(), metadata=dict(static=True))
  conv: bool = dataclasses.field(default=False, metadata=dict(static=True))


def record(lhs, rhs, lhs_contract, contract, batch, *, recipe, samples: int,
           with_hessian: bool, conv: bool = False, kernel_at=None,
           kernel=None) -> CalibrationRecord:
  """One product's :class:`CalibrationRecord` of this batch.

  ``kernel_at`` / ``kernel``: where the layer keeps the right operand and its
  value (``access.kernel_for(rhs)``), checked as conversion checks them.
  """
  x = jnp.asarray(lhs, jnp.float32)
  rhs = jnp.asarray(rhs)
  with_hessian = with_hessian and not conv and not batch
  hess = (core_gptq.hessian(x, lhs_contract) if with_hessian
          else jnp.zeros((0, 0), jnp.float32))
  equal = (jnp.asarray(False) if kernel is None else
           jnp.array_equal(jnp.asarray(kernel).astype(rhs.dtype).reshape(rhs.shape), rhs))
  return CalibrationRecord(
      lo=jnp.min(x), hi=jnp.max(x), sample=core_calibration.subsample(x, samples),
      hessian=hess, rhs=rhs, kernel_at=jnp.asarray(-1 if kernel_at is None else kernel_at),
      kernel_equal=equal, recipe=recipe, contract=tuple(contract), batch=tuple(batch),
      conv=conv)


def float_dot(lhs, rhs, dimension_numbers, out_dtype=None):
  """The float product calibration runs (float32 accumulation)."""
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  y = lowering.lax_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=jnp.float32,
                               out_sharding=lowering.dot_out_sharding(lhs, rhs,
                                                                      dimension_numbers))
  return y.astype(out_dtype)


def float_conv(lhs, rhs, conv_kwargs: dict, out_dtype=None):
  """The float convolution calibration runs."""
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, conv_kwargs["dimension_numbers"])
  y = lowering.lax_conv_general_dilated(lhs, rhs, **conv_kwargs,
                                        preferred_element_type=jnp.float32,
                                        out_sharding=lowering.conv_out_sharding(lhs, rhs, dn))
  return y.astype(out_dtype)


@dataclasses.dataclass
class ProductStats:
  """One product's statistics over all calibration batches (numpy, host side)."""

  lo: float
  hi: float
  sample: np.ndarray
  hessian: np.ndarray
  rhs: np.ndarray
  kernel_at: int
  kernel_equal: bool
  recipe: Any
  contract: tuple
  batch: tuple
  conv: bool
  rhs_amax: float = 0.0
  batches: int = 1


def merge(stats: ProductStats | None, rec: CalibrationRecord) -> ProductStats:
  """``stats`` with one more batch's record folded in (``None``: the first batch)."""
  sample = np.asarray(rec.sample)
  hess = np.asarray(rec.hessian, np.float64)
  if stats is None:
    return ProductStats(lo=float(rec.lo), hi=float(rec.hi), sample=sample, hessian=hess,
                        rhs=np.asarray(rec.rhs), kernel_at=int(rec.kernel_at),
                        kernel_equal=bool(rec.kernel_equal), recipe=rec.recipe,
                        contract=rec.contract, batch=rec.batch, conv=rec.conv,
                        rhs_amax=_amax(rec.rhs))
  both = np.concatenate([stats.sample, sample])
  cap = max(stats.sample.size, sample.size)
  if both.size > cap:
    # A uniform subset of everything seen so far: the batches merged before this one
    # (batches each) are worth that many of this one.
    w = np.concatenate([np.full(stats.sample.size, stats.batches / stats.sample.size),
                        np.full(sample.size, 1.0 / sample.size)])
    idx = np.random.default_rng(stats.batches).choice(both.size, cap, replace=False,
                                                      p=w / w.sum())
    both = both[idx]
  return dataclasses.replace(
      stats, lo=min(stats.lo, float(rec.lo)), hi=max(stats.hi, float(rec.hi)),
      sample=both,
      hessian=stats.hessian + hess if hess.size else stats.hessian,
      rhs_amax=max(stats.rhs_amax, _amax(rec.rhs)), batches=stats.batches + 1)


def _amax(x) -> float:
  return float(np.max(np.abs(np.asarray(x, np.float32)), initial=0.0))


# The host-side steps run as small jitted programs: run op by op, each of their jnp calls
# would be compiled on its own, for every layer.
_choose_range = jax.jit(core_calibration.choose_range,
                        static_argnames=("method", "percentile", "symmetric", "qdq", "grid"))


def _range(stats: ProductStats, config: PtqConfig, symmetric: bool, qdq):
  lo, hi = _choose_range(
      stats.sample, np.float32(stats.lo), np.float32(stats.hi), method=config.activation,
      percentile=config.percentile, symmetric=symmetric, qdq=qdq, grid=config.mse_grid)
  return float(lo), float(hi)


@functools.partial(jax.jit, static_argnums=(1,))
def _input_values(lo_hi, cfg: IntQuantConfig) -> dict:
  """An integer activation quantizer's variables spanning ``[lo, hi]``."""
  lo, hi = lo_hi[0], lo_hi[1]
  if cfg.estimator == "ste":
    return {"input_range": jnp.stack([-lo, hi])}
  if cfg.estimator == "lsq":
    s, _ = int_numerics.int_params_from_range(lo, hi, cfg)
    return {"input_step": jnp.reshape(s, (1,))}
  s, b = int_numerics.lsq_plus_init(lo_hi, (0,), cfg.qmin, cfg.qmax)
  return {"input_step": jnp.reshape(s, (1,)), "input_offset": jnp.reshape(b, (1,))}


def _int_input(stats: ProductStats, cfg: IntQuantConfig, config: PtqConfig) -> dict:
  lo, hi = _range(stats, config, cfg.symmetric, core_calibration.int_qdq(cfg))
  return _input_values(np.array([lo, hi], np.float32), cfg)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _rtn_steps(rhs, contract: tuple, cfg: IntQuantConfig) -> dict:
  """An LSQ / LSQ+ weight quantizer's variables spanning the weight's own range."""
  view, axes = int_numerics.int_view(rhs.astype(jnp.float32), contract, cfg)
  if cfg.estimator == "lsq":
    s, _ = int_numerics.int_params_from_range(jnp.min(view, axis=axes, keepdims=True),
                                              jnp.max(view, axis=axes, keepdims=True), cfg)
    return {"kernel_step": s}
  s, b = int_numerics.lsq_plus_init(view, axes, cfg.qmin, cfg.qmax)
  return {"kernel_step": s, "kernel_offset": b}


def _step_layout(scales: np.ndarray, rhs_shape, contract, cfg: IntQuantConfig) -> np.ndarray:
  """GPTQ's ``(G, N)`` scales in the layout of the LSQ ``kernel_step`` of ``rhs``."""
  free = [a for a in range(len(rhs_shape)) if a not in contract]
  free_shape = [rhs_shape[a] for a in free]
  if cfg.granularity == "tensor":
    return np.reshape(scales[0, :1], (1,) * len(rhs_shape))
  if cfg.granularity == "channel":
    out = [1] * len(rhs_shape)
    for a, d in zip(free, free_shape):
      out[a] = d
    return np.reshape(scales, out)
  (a,) = contract
  t = np.reshape(scales, [scales.shape[0]] + free_shape)  # (G, free...)
  t = np.moveaxis(t, 0, a)                                # G at the contracting axis
  return np.expand_dims(t, a + 1)                         # the group_size axis, reduced


@functools.partial(jax.jit, static_argnums=(2, 3))
def _gptq_rounded(w2, hessian, cfg: IntQuantConfig, damping: float):
  """GPTQ's scales and its rounded weight (codes x scale), ``(K, N)``; one program per shape."""
  codes, scales = core_gptq.gptq(w2, hessian, cfg, damping=damping)
  gs = cfg.group_size if cfg.granularity == "group" else w2.shape[0]
  return scales, codes.astype(jnp.float32) * jnp.repeat(scales, gs, axis=0)


def _gptq_kernel(stats: ProductStats, cfg: IntQuantConfig, config: PtqConfig, where: str):
  """``(kernel_step, rounded rhs)`` of GPTQ for one product (layouts moved on the host)."""
  rhs = np.asarray(stats.rhs)
  rc = tuple(a % rhs.ndim for a in stats.contract)
  free = tuple(a for a in range(rhs.ndim) if a not in rc)
  k = math.prod(rhs.shape[a] for a in rc)
  if stats.hessian.shape != (k, k):
    raise ValueError(f"{where}: the Hessian has shape {stats.hessian.shape}, the weight's "
                     f"{k} inputs need {(k, k)}")
  w2 = np.transpose(rhs, rc + free).reshape(k, -1).astype(np.float32)
  scales, deq = _gptq_rounded(w2, stats.hessian.astype(np.float32), cfg, config.gptq_damping)
  scales, deq = np.asarray(scales), np.asarray(deq)
  back = np.transpose(deq.reshape([rhs.shape[a] for a in rc + free]), np.argsort(rc + free))
  return _step_layout(scales, rhs.shape, rc, cfg), back.astype(rhs.dtype)


def check_recipe(where: str, recipe, config: PtqConfig) -> None:
  """Raises (naming ``where``) where PTQ cannot calibrate ``recipe`` as ``config`` asks.

  Both entry points call it on the default recipe before calibrating, and
  :func:`calibrated` on each product's.
  """
  if config.weights != "gptq":
    return
  if isinstance(recipe, (Fp8Recipe, Fp8WeightOnly)):
    raise ValueError(f"{where}: PtqConfig(weights='gptq') rounds to an integer grid; "
                     "for an fp8 recipe use weights='rtn'")
  if isinstance(recipe, IntRecipe) and recipe.kernel is not None and \
      recipe.kernel.estimator != "lsq":
    raise ValueError(
        f"{where}: PtqConfig(weights='gptq') needs a weight quantizer whose scale is a "
        f"parameter on a symmetric grid (estimator='lsq', as fl.weight_only gives), got "
        f"estimator={recipe.kernel.estimator!r}")


def _int_kernel(stats: ProductStats, cfg: IntQuantConfig, config: PtqConfig, where: str):
  if config.weights == "gptq":
    step, kernel = _gptq_kernel(stats, cfg, config, where)
    return {"kernel_step": step}, kernel
  if not cfg.learned:
    return {}, None
  return _rtn_steps(stats.rhs, tuple(stats.contract), cfg), None


@functools.partial(jax.jit, static_argnums=(1,))
def _fp8_state(amax, cfg) -> tuple:
  hist = jnp.zeros((cfg.history_length,), jnp.float32).at[0].set(amax)
  return hist, numerics.scale_from_amax(jnp.reshape(amax, (1,)), jnp.ones((1,), jnp.float32),
                                        cfg)


def _fp8_role(role: str, cfg, amax: float) -> dict:
  if cfg.scaling != "delayed" or not cfg.keeps_state:
    return {}
  hist, scale = _fp8_state(np.float32(amax), cfg)
  return {f"{role}_amax_history": hist, f"{role}_scale": scale}


def calibrated(stats: ProductStats, config: PtqConfig, *, where: str):
  """``(values, kernel)``: the product's quantization variables by name, and its new weight.

  ``kernel`` is the right operand as the product sees it (GPTQ's rounded
  weight) or ``None`` where the weight stays as it is.

  Raises:
    ValueError: naming ``where``, for a recipe or combination PTQ cannot
      calibrate.
  """
  recipe = stats.recipe
  weight = stats.kernel_at >= 0 and stats.kernel_equal
  check_recipe(where, recipe, config)
  if config.weights == "gptq" and (not weight or not stats.hessian.size):
    # An activation has nothing to round once; a convolution's or a batched product's
    # input has no Hessian recorded: both are rounded to nearest.
    config = dataclasses.replace(config, weights="rtn")
  if isinstance(recipe, IntRecipe):
    values = {} if recipe.input is None else _int_input(stats, recipe.input, config)
    kernel = None
    if recipe.kernel is not None:
      kv, kernel = _int_kernel(stats, recipe.kernel, config, where)
      values.update(kv)
    return values, kernel
  if isinstance(recipe, Fp8Recipe):
    lo, hi = _range(stats, config, True, core_calibration.fp8_qdq(recipe.input))
    values = _fp8_role("input", recipe.input, max(-lo, hi))
    # A weight's own amax; a right operand that is an activation: over all batches.
    values.update(_fp8_role("kernel", recipe.kernel, stats.rhs_amax))
    return values, None
  if isinstance(recipe, Fp8WeightOnly):
    return {}, None  # the scale comes from the weight itself: nothing to calibrate
  raise ValueError(f"{where}: post-training quantization knows IntRecipe, Fp8Recipe and "
                   f"Fp8WeightOnly, not "
                   f"{type(recipe).__name__}")


def batch_list(who: str, batches, *, needs: str, each: str, nan_harm: str) -> list:
  """``batches`` as a list, checked: a sequence, not empty, no NaN or infinite values.

  What both post-training quantization and the sensitivity measurement
  refuse; the errors name ``batches`` (``needs``: who needs a batch,
  ``each``: what a batch is, ``nan_harm``: what a NaN batch would do).
  """
  if isinstance(batches, (jax.Array, np.ndarray)):
    raise TypeError(f"{who}: batches must be a sequence of batches ({each}), got one array; "
                    "wrap it: batches=[x]")
  try:
    batches = list(batches)
  except TypeError:
    raise TypeError(f"{who}: batches must be a sequence of batches, got "
                    f"{type(batches).__name__}") from None
  if not batches:
    raise ValueError(f"{who}: batches is empty; {needs} needs at least one batch")
  for i, b in enumerate(batches):
    for leaf in jax.tree.leaves(b):
      a = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
      if jnp.issubdtype(a.dtype, jnp.floating) and not bool(jnp.all(jnp.isfinite(a))):
        raise ValueError(f"{who}: batches[{i}] holds NaN or infinite values{nan_harm}")
  return batches


def check_batches(who: str, batches) -> list[tuple]:
  """The calibration batches as argument tuples; errors name ``batches``.

  A batch is an array (the forward's one argument) or a tuple of arguments.
  """
  batches = batch_list(who, batches, needs="calibration (representative inputs)",
                       each="a list of arrays or of argument tuples",
                       nan_harm="; calibrating on it would set every range it reaches to NaN")
  return [tuple(b) if isinstance(b, (tuple, list)) else (b,) for b in batches]


def no_product_error(who: str) -> ValueError:
  return ValueError(f"{who}: the model ran no quantized product on the calibration batches, "
                    "so there is nothing to quantize (check recipe/rules: a float model "
                    "needs a recipe and rules that match its layers)")
