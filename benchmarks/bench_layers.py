"""Training-step timing of QEinsum and QConv next to the bf16 flax layers.

Arms are timed in one process, interleaved, after warm-up (``common``); each
figure is the median of >= 20 runs of a jitted training step
(``common.make_train_step``: loss ``sum(y * r)`` with a random cotangent ``r``,
returning the new state, the loss and dL/dx, so forward, dgrad and wgrad all
run; SGD update and fp8 state merge), reported as a ratio to the bf16 flax
layer. Scales and histories are jit arguments (in the train state).

Also records, for an MLP block with ``Fp8Activation`` under ``nn.remat``, the
per-block residual bytes (``jax.vjp`` outside jit) and the planned temp memory
of its jitted train step on this device.

On a GPU it also counts the fp8 products (cuBLASLt fp8 GEMMs, cuDNN fp8
convolutions) in the compiled step.

Usage: ``python benchmarks/bench_layers.py [--runs 20] [--quick] [--out-dir DIR]``
"""

from __future__ import annotations

import argparse
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402


def compare(arms, x, runs):
  """Times each (name, model) arm's train step on ``x`` interleaved; ratios to the first arm."""
  built = {name: common.build_train_arm(m, x, seed=1) for name, m in arms}
  times = common.time_arms(built, arms[0][0], reps=runs)
  res = {}
  for name, arm in built.items():
    t = times[name]
    res[name] = {"median_ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"],
                 "runs": t["runs"], "ratio_to_bf16": t["ratio"], "min_ratio": t["min_ratio"],
                 "max_ratio": t["max_ratio"], "memory": arm.memory}
    if arm.products:
      res[name]["gpu_products"] = arm.products
  return res


class MLP(nn.Module):
  """Dense -> gelu -> Dense, with the activations kept at three points.

  Attributes:
    mode: ``'bf16'`` (plain), ``'bf16_named'`` (the three points named
      ``'bf16_act'`` for a remat policy) or ``'fp8'`` (an ``Fp8Activation`` at
      each point).
    d: model width (hidden ``4 * d``).
  """

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


def mlp_block(tokens=512, d=256):
  """Residual bytes and jitted-step temp memory of the MLP block, bf16 vs fp8 remat.

  Residual bytes exclude the block's input and parameters (alive anyway) and
  the fp8 state.
  """
  x = jax.random.normal(jax.random.key(0), (tokens, d), jnp.bfloat16)
  res, temp = {}, {}
  for mode, name in (("bf16", None), ("bf16_named", "bf16_act"),
                     ("fp8", fl.CHECKPOINT_NAME)):
    m = (MLP(mode, d) if name is None else
         nn.remat(MLP, policy=jax.checkpoint_policies.save_only_these_names(name))(mode, d))
    arm = common.build_train_arm(m, x)
    res[mode] = common.residual_bytes(m, arm.variables, x)["activation_bytes"]
    temp[mode] = (arm.memory or {}).get("temp_size_in_bytes")
  out = {"shape": {"tokens": tokens, "d": d, "hidden": 4 * d}, "bytes": res,
         "fp8_over_bf16_remat_same_points": res["fp8"] / res["bf16_named"],
         "fp8_over_bf16_no_remat": res["fp8"] / res["bf16"],
         "jitted_step_temp_bytes": temp}
  if all(temp.values()):
    out["jitted_step_temp_fp8_over_bf16_remat"] = temp["fp8"] / temp["bf16_named"]
  return out


def main(argv=None) -> dict:
  """Runs the benchmark, writes ``<device>-layers.json`` and returns its payload."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument("--quick", action="store_true", help="smaller shapes")
  ap.add_argument("--out-dir", default=None,
                  help="folder for <device>-layers.json (default: benchmarks/results)")
  args = ap.parse_args(argv)
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
  block = mlp_block(*((256, 128) if args.quick else ()))
  print("mlp block", {k: block[k] for k in ("bytes", "jitted_step_temp_bytes")}, flush=True)
  out = {"benchmark": "layers_train_step", "env": common.environment(), "runs": args.runs,
         "step": "jit(loss = sum(y * r) with random r; returns new state, loss and dL/dx: "
                 "fwd + dgrad + wgrad + SGD update + fp8 state merge), donated state",
         "results": results, "mlp_block_residuals": block}
  print("wrote", common.write_json("layers", out, args.out_dir))
  return out


if __name__ == "__main__":
  main()
