"""Integer QAT train steps next to qwix and AQT: time and backward residual bytes vs bf16.

For each width n (M = 2n tokens, K = N = n), every arm runs the jitted training step of
``common.make_train_step`` (forward, dgrad, wgrad, SGD update, state merge;
bf16 activations, float32 params) on the same random input, the arms
interleaved round by round in one process; the median of ``--runs`` rounds is
reported as a ratio to the bf16 ``nn.Dense`` baseline. Arms:

* ``bf16_dense``: ``nn.Dense(dtype=bfloat16)``, the baseline;
* ``qwix_int8``: qwix QAT (``QtRule(weight_qtype='int8', act_qtype='int8')``);
* ``aqt_int8``: AQT ``fully_quantized(fwd_bits=8, bwd_bits=None)`` in ``nn.Dense``;
* ``int8_ste`` / ``int8_lsq`` / ``int4_lsq_plus``: ``fl.QDense`` with int8 STE
  (per-channel weights), int8 LSQ and int4 LSQ+, ``compute_dtype='bfloat16'``,
  ``gemm='auto'`` (on CPU: the exact bf16-of-codes GEMM where exact);
* ``int8_ste_s8gemm``: int8 STE forced onto the int8 x int8 -> int32 GEMM.

qwix and AQT come with the ``bench`` extra; an arm whose library is missing is
recorded as such. With ``--h100 N`` every arm's step is also compiled for an
H100 (deviceless, ``fp8_linen.testing.compile``): its s8 GEMMs and planned
temporary memory. Residual bytes: ``print_saved_residuals`` of the layer
(inputs and parameters the backward reads included, fp8/int state excluded);
``temp`` is the planned temporary memory of the jitted step.

  python benchmarks/bench_int_qat.py --h100 2048 --out benchmarks/results/cpu-int-qat.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen.testing import targets  # noqa: E402
from fp8_linen.testing.compile import compile_train_step  # noqa: E402

_BF16 = dict(compute_dtype="bfloat16")
OURS = {
    "int8_ste": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"), **_BF16),
    "int8_lsq": fl.IntRecipe(input=fl.IntQuantConfig(estimator="lsq"),
                             kernel=fl.IntQuantConfig(estimator="lsq", granularity="channel"),
                             **_BF16),
    "int4_lsq_plus": fl.IntRecipe(
        input=fl.IntQuantConfig(bits=4, symmetric=False, estimator="lsq+"),
        kernel=fl.IntQuantConfig(bits=4, symmetric=False, estimator="lsq+",
                                 granularity="channel"), **_BF16),
    "int8_ste_s8gemm": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"),
                                    gemm="int8", **_BF16),
}


def qwix_dense(n: int):
  """A bf16 ``nn.Dense`` under qwix int8 QAT, or None without qwix."""
  try:
    import qwix  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  rule = qwix.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8")
  return qwix.quantize_model(nn.Dense(n, dtype=jnp.bfloat16), qwix.QtProvider([rule]))


def aqt_dense(n: int):
  """A bf16 ``nn.Dense`` with AQT's int8 forward (float backward), or None without AQT."""
  try:
    from aqt.jax.v2 import config as aqt_config  # pylint: disable=import-outside-toplevel
    from aqt.jax.v2.flax import aqt_flax  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  cfg = aqt_config.fully_quantized(fwd_bits=8, bwd_bits=None, use_stochastic_rounding=False)
  return nn.Dense(n, dtype=jnp.bfloat16,
                  dot_general_cls=functools.partial(aqt_flax.AqtDotGeneral, cfg,
                                                    prng_name=None))


def arms_for(n: int) -> tuple[dict, list]:
  """The arms' models for width ``n``, and the names of arms whose library is missing."""
  arms = {"bf16_dense": nn.Dense(n, dtype=jnp.bfloat16),
          "qwix_int8": qwix_dense(n), "aqt_int8": aqt_dense(n)}
  arms.update({k: fl.QDense(n, dtype=jnp.bfloat16, recipe=r) for k, r in OURS.items()})
  missing = [k for k, m in arms.items() if m is None]
  return {k: m for k, m in arms.items() if m is not None}, missing


def h100_rows(n: int) -> dict:
  """Each arm's train step compiled for an H100 (no GPU needed): products and temp memory."""
  available = targets.availability("h100")
  if not available:
    return {"unavailable": available.reason}
  arms, missing = arms_for(n)
  rows = {"device": "H100 (compile only)", "tokens": 2 * n, "width": n,
          **{k: {"missing": True} for k in missing}}
  for k, m in arms.items():
    r = compile_train_step(m, (2 * n, n), jnp.bfloat16, target="h100")
    rows[k] = {"int8_gemms": r.int8_gemms, "fp8_products": r.fp8_products,
               "products": r.products, "temp_bytes": r.temp_bytes}
    print(f"H100 (compile only) n={n} {k:>16}: {r.summary()}", flush=True)
  return rows


def main(argv=None) -> dict:
  """Runs the benchmark, writes ``--out`` (if given) and returns the payload."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--out", default=None, help="the JSON file to write")
  ap.add_argument("--h100", type=int, default=None, metavar="N",
                  help="also compile each arm's step for an H100 (deviceless) at width N")
  args = ap.parse_args(argv)
  if args.h100:
    try:  # before any JAX backend starts
      targets.use_cpu_platform()
    except targets.TargetUnavailable as e:
      print(f"no H100 compile: {e}")
      args.h100 = None
  out = {"meta": {**common.environment(), "device": common.device_name(),
                  "backend": jax.default_backend(),
                  "dtype": "bfloat16 activations, float32 params", "runs": args.runs,
                  "step": "jit(loss = sum(y * r)): fwd + dgrad + wgrad + SGD + state merge"},
         "results": {}}
  for n in args.sizes:
    arms, missing = arms_for(n)
    # 2n tokens: qwix tells weights from activations by shape, and an (n, n)
    # input would look like the (n, n) kernel.
    x = jax.random.normal(jax.random.key(n), (2 * n, n), jnp.bfloat16)
    rows = {k: {"missing": True} for k in missing}
    rows.update(common.compare_train_arms(arms, x, baseline="bf16_dense", reps=args.runs,
                                          warmup=args.warmup, label=f"n={n:5d}"))
    out["results"][str(n)] = rows
  if args.h100:
    out["h100_compile"] = h100_rows(args.h100)
  if args.out:
    print("wrote", common.write_json_to(args.out, out))
  return out


if __name__ == "__main__":
  main()
