"""Frozen configuration of post-training quantization: how ranges and weights are chosen.

Example:
  >>> import fp8_linen as fl
  >>> fl.PtqConfig(activation='percentile', percentile=99.9).percentile
  99.9
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from fp8_linen.recipes._validate import check_choice, check_int

__all__ = ["PtqConfig", "ACTIVATION_METHODS", "WEIGHT_METHODS"]

ACTIVATION_METHODS = ("minmax", "percentile", "mse")
WEIGHT_METHODS = ("rtn", "gptq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PtqConfig:
  """How :func:`fp8_linen.ptq` (and ``fl.nnx.ptq``) calibrates a model.

  Attributes:
    activation: how each quantized activation's range is chosen from the
      calibration batches: ``'minmax'`` (the observed range), ``'percentile'``
      (the ``percentile``-th percentile of ``|x|``; per side on asymmetric
      grids) or ``'mse'`` (the range ``t * [min, max]``, ``t`` on a grid of
      ``mse_grid`` values in ``(0, 1]``, with the smallest quantization MSE
      on the sampled values).
    percentile: for ``activation='percentile'``, in ``(0, 100]``.
    mse_grid: for ``activation='mse'``: how many ranges are tried.
    samples: activation values kept per product for ``'percentile'`` and
      ``'mse'``: all of them, or a random subset of this size drawn evenly
      from every batch; the exact min and max are always kept.
    weights: ``'rtn'`` (round to nearest with the scale the weight's own range
      gives) or ``'gptq'`` (GPTQ, Frantar et al. 2023: rows rounded one by one
      with the error spread by the inverse Hessian of the calibration inputs;
      integer weights with a learned scale (``estimator='lsq'``), as
      :func:`fp8_linen.weight_only` gives; convolutions and products with
      batch axes are rounded to nearest).
    gptq_damping: GPTQ's diagonal damping, a fraction of the mean of the
      Hessian's diagonal.

  Example:
    >>> import fp8_linen as fl
    >>> cfg = fl.PtqConfig(activation='mse', weights='gptq')
    >>> cfg.mse_grid, cfg.gptq_damping
    (100, 0.01)
    >>> try:
    ...   fl.PtqConfig(activation='entropy')
    ... except ValueError as e:
    ...   print(str(e)[:45])
    PtqConfig.activation='entropy' is not allowed
  """

  activation: Literal["minmax", "percentile", "mse"] = "minmax"
  percentile: float = 99.99
  mse_grid: int = 100
  samples: int = 65536
  weights: Literal["rtn", "gptq"] = "rtn"
  gptq_damping: float = 0.01

  def __post_init__(self):
    check_choice("PtqConfig", "activation", self.activation, ACTIVATION_METHODS)
    check_choice("PtqConfig", "weights", self.weights, WEIGHT_METHODS)
    check_int("PtqConfig", "mse_grid", self.mse_grid, 1)
    check_int("PtqConfig", "samples", self.samples, 1)
    for name, lo, hi, open_lo in (("percentile", 0.0, 100.0, True),
                                  ("gptq_damping", 0.0, 1.0, False)):
      v = getattr(self, name)
      ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (
          (lo < v if open_lo else lo <= v) and v <= hi)
      if not ok:
        raise ValueError(f"PtqConfig.{name}={v!r} must be a number in "
                         f"{'(' if open_lo else '['}{lo}, {hi}]")
