"""Training-step timing of QEinsum and QConv next to the bf16 flax layers.

Standalone (small timing helpers included). Arms are timed in one process,
interleaved, after warm-up; each figure is the median of >= 20 runs of a jitted
forward+backward+state step, reported as a ratio to the bf16 flax layer.
Scales and histories are jit arguments and the cotangent is random. Also
records the residual-byte figure of an MLP block with Fp8Activation.

On a GPU it also counts ``__cublas$lt$matmul$f8`` and cuDNN fp8 convolution
custom calls in the compiled step.

Usage: ``PYTHONPATH=. python benchmarks/bench_layers.py [--runs 20] [--quick]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import fp8_linen as fl

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f8_e4m3fn": 1, "f8_e5m2": 1, "u8": 1, "s32": 4}


def _step_fn(model, x):
  variables = model.init(jax.random.key(0), x)
  ct = jax.random.normal(jax.random.key(1), jax.eval_shape(model.apply, variables, x).shape,
                         x.dtype)

  @jax.jit
  def step(v, x, ct):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x), v, x)
    gv, gx = vjp(ct.astype(y.dtype))
    return gv, gx

  return step, (variables, x, ct)


def _time(fn, args, runs):
  out = fn(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return ts


def _hlo_counts(fn, args):
  txt = fn.lower(*args).compile().as_text()
  return {"cublas_f8_gemm": txt.count("__cublas$lt$matmul$f8"),
          "cudnn_conv_graph": txt.count("__cudnn$convForwardGraph"),
          "f8_in_hlo": len(re.findall(r"f8e4m3fn|f8e5m2", txt)) > 0}


def compare(arms, x, runs):
  """Times each (name, model) arm on ``x`` interleaved; ratios to the first arm."""
  steps = {name: _step_fn(m, x) for name, m in arms}
  times = {name: [] for name in steps}
  for name, (fn, args) in steps.items():
    _time(fn, args, 3)  # warm-up / compile
  for _ in range(runs):
    for name, (fn, args) in steps.items():
      times[name] += _time(fn, args, 1)
  base = float(np.median(times[arms[0][0]]))
  res = {}
  for name, ts in times.items():
    med = float(np.median(ts))
    res[name] = {"median_ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                 "ratio_to_bf16": med / base}
    if jax.default_backend() == "gpu":
      res[name].update(_hlo_counts(*steps[name]))
  return res


def residual_bytes(fn, *args) -> int:
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  total = 0
  for line in buf.getvalue().splitlines():
    if "from the argument" in line or "from a literal" in line:
      continue
    m = re.match(r"(\w+)\[([\d,]*)\]", line)
    total += _BYTES[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d]))
  return total


class MLP(nn.Module):
  mode: str = "bf16"
  d: int = 256

  @nn.compact
  def __call__(self, x):
    kw = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    keep = {"fp8": lambda h: fl.Fp8Activation()(h),
            "bf16_named": lambda h: jax.ad_checkpoint.checkpoint_name(h, "bf16_act")}.get(
                self.mode, lambda h: h)
    h = nn.Dense(4 * self.d, **kw)(keep(x))
    return nn.Dense(self.d, **kw)(keep(nn.gelu(keep(h))))


def mlp_residuals(tokens=512, d=256):
  x = jax.random.normal(jax.random.key(0), (tokens, d), jnp.bfloat16)
  out = {}
  for mode, name in (("bf16", None), ("bf16_named", "bf16_act"),
                     ("fp8", fl.CHECKPOINT_NAME)):
    m = (MLP(mode, d) if name is None else
         nn.remat(MLP, policy=jax.checkpoint_policies.save_only_these_names(name))(mode, d))
    v = m.init(jax.random.key(1), x)
    out[mode] = residual_bytes(lambda v, x: m.apply(v, x), v, x)
  return {"shape": {"tokens": tokens, "d": d, "hidden": 4 * d}, "bytes": out,
          "fp8_over_bf16_remat_same_points": out["fp8"] / out["bf16_named"],
          "fp8_over_bf16_no_remat": out["fp8"] / out["bf16"]}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--quick", action="store_true", help="smaller shapes")
  args = ap.parse_args()
  bf = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  q = 2 if args.quick else 1
  cases = {
      "einsum_attention_proj": (  # (b, t, d) x (d, h, k)
          jax.random.normal(jax.random.key(2), (8 // q, 256, 512), jnp.bfloat16),
          lambda cls, **kw: cls(shape=(512, 8, 64), einsum_str="btd,dhk->bthk", **bf, **kw)),
      "einsum_mlp": (
          jax.random.normal(jax.random.key(3), (8 // q, 256, 512), jnp.bfloat16),
          lambda cls, **kw: cls(shape=(512, 2048), einsum_str="btd,df->btf", **bf, **kw)),
      "conv_resnet_3x3": (  # a ResNet stage-2 like layer, NHWC
          jax.random.normal(jax.random.key(4), (8 // q, 28, 28, 128), jnp.bfloat16),
          lambda cls, **kw: cls(features=128, kernel_size=(3, 3), **bf, **kw)),
  }
  results = {}
  for name, (x, make) in cases.items():
    flax_cls, q_cls = (nn.Einsum, fl.QEinsum) if "einsum" in name else (nn.Conv, fl.QConv)
    arms = [("bf16_flax", make(flax_cls)),
            ("fp8_delayed", make(q_cls, recipe=fl.delayed_scaling())),
            ("fp8_current", make(q_cls, recipe=fl.current_scaling()))]
    results[name] = {"input_shape": list(x.shape), "arms": compare(arms, x, args.runs)}
    print(name, {k: round(v["ratio_to_bf16"], 3) for k, v in results[name]["arms"].items()},
          flush=True)
  residuals = mlp_residuals()
  print("mlp residual bytes", residuals, flush=True)
  dev = jax.devices()[0]
  out = {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
         "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
         "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(
             jax, "lib") else None, "flax": flax.__version__},
         "runs": args.runs, "step": "jit(vjp) forward+backward with random cotangent",
         "results": results, "mlp_block_residuals": residuals}
  path = os.path.join(os.path.dirname(__file__), "results",
                      f"{'gpu' if dev.platform == 'gpu' else 'cpu'}-layers.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=2)
  print("wrote", path)


if __name__ == "__main__":
  main()
