"""Post-training quantization quality on a small trained model: every PTQ recipe against float.

An MLP (64-256-256-10, gelu) on scikit-learn's 8x8 digits is trained in float
(Adam, batches of 64), then quantized with :func:`fp8_linen.ptq` from 4
calibration batches of training data, for each arm below (weight-only int8 /
int4 / int3, round to nearest vs GPTQ; w8a8 int8 with each activation-range
method; fp8 delayed), and QAT from PTQ (a short QAT run from the calibrated
variables of two round-to-nearest arms). For every arm: the served model's test loss and
accuracy, and the relative error of its logits against the float model's
(a steadier figure than the loss on 397 test images). Not part of
``run_all.py``; no timing is measured (PTQ's own seconds are printed).

  PYTHONPATH=. python benchmarks/ptq_digits.py --out benchmarks/results/cpu-ptq-digits.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8_linen as fl


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(256)(x))
    x = nn.gelu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


def arms() -> dict:
  """name -> (recipe, PtqConfig)."""
  w8a8 = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
  g16 = fl.weight_only(4, granularity="group", group_size=16)
  gptq = fl.PtqConfig(weights="gptq")
  return {
      "int8 weight-only, channel": (fl.weight_only(8), fl.PtqConfig()),
      "int4 weight-only, channel, RTN": (fl.weight_only(4), fl.PtqConfig()),
      "int4 weight-only, channel, GPTQ": (fl.weight_only(4), gptq),
      "int4 weight-only, group 16, RTN": (g16, fl.PtqConfig()),
      "int4 weight-only, group 16, GPTQ": (g16, gptq),
      "int3 weight-only, channel, RTN": (fl.weight_only(3), fl.PtqConfig()),
      "int3 weight-only, channel, GPTQ": (fl.weight_only(3), gptq),
      "w8a8 int8, minmax": (w8a8, fl.PtqConfig()),
      "w8a8 int8, percentile 99.99": (w8a8, fl.PtqConfig(activation="percentile")),
      "w8a8 int8, mse": (w8a8, fl.PtqConfig(activation="mse")),
      "w8a8 int8 LSQ, mse": (fl.int8_lsq(), fl.PtqConfig(activation="mse")),
      "fp8 delayed (e4m3)": (fl.delayed_scaling(16), fl.PtqConfig()),
  }


def loss_of(logits, labels):
  """Mean softmax cross-entropy."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_float(steps: int, seed: int = 0) -> dict:
  """The float MLP trained on digits (Adam 1e-3, batches of 64), and the data it was trained on.

  Returns:
    ``{'model', 'params', 'xtr', 'ytr', 'xte', 'yte', 'rng'}`` (``rng``: the
    batch generator, after the training draws).
  """
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  d = load_digits()
  x, y = (d.data / 16.0).astype(np.float32), d.target
  rng = np.random.default_rng(seed)
  perm = rng.permutation(len(x))
  x, y = x[perm], y[perm]
  xtr, ytr, xte, yte = x[:1400], y[:1400], x[1400:], y[1400:]
  model = MLP()
  # Jitted: the values of an eager init, without compiling it op by op.
  params = jax.jit(model.init)(jax.random.key(seed), xtr[:8])
  tx = optax.adam(1e-3)
  opt = tx.init(params)

  @jax.jit
  def step(p, o, xb, yb):
    g = jax.grad(lambda p: loss_of(model.apply(p, xb), yb))(p)
    u, o = tx.update(g, o)
    return optax.apply_updates(p, u), o

  for _ in range(steps):
    idx = rng.integers(0, len(xtr), 64)
    params, opt = step(params, opt, xtr[idx], ytr[idx])
  return {"model": model, "params": params, "xtr": xtr, "ytr": ytr, "xte": xte, "yte": yte,
          "rng": rng}


def run(steps: int = 600, seed: int = 0, calibration_batches: int = 4) -> dict:
  f = train_float(steps, seed)
  model, params, rng = f["model"], f["params"], f["rng"]
  xtr, ytr, xte, yte = f["xtr"], f["ytr"], f["xte"], f["yte"]
  ref = jax.jit(model.apply)(params, xte)
  rows = {"float": {"test_loss": float(loss_of(ref, yte)),
                    "test_accuracy": float((ref.argmax(-1) == yte).mean())}}
  batches = [xtr[i * 64:(i + 1) * 64] for i in range(calibration_batches)]
  for name, (recipe, config) in arms().items():
    t = time.perf_counter()
    res = fl.ptq(model, params, batches, recipe=recipe, config=config)
    logits = jax.jit(res.served.apply)(res.served_params, xte)
    rows[name] = {
        "test_loss": float(loss_of(logits, yte)),
        "test_accuracy": float((logits.argmax(-1) == yte).mean()),
        "logits_rel_err": float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref)),
        "ptq_seconds": time.perf_counter() - t,
    }
  # QAT from PTQ: a short QAT run (10% of the float run's steps) starting from
  # the calibrated variables PTQ returns, converted and served as before.
  for name in QAT_FROM_PTQ:
    recipe, config = arms()[name]
    res = fl.ptq(model, params, batches, recipe=recipe, config=config)
    variables = qat(res, loss_of, xtr, ytr, rng, steps // 10)
    served, served_params = fl.convert(res.model, variables, xte[:1])
    logits = jax.jit(served.apply)(served_params, xte)
    rows[f"{name} + QAT {steps // 10} steps"] = {
        "test_loss": float(loss_of(logits, yte)),
        "test_accuracy": float((logits.argmax(-1) == yte).mean()),
        "logits_rel_err": float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref)),
    }
  return rows


QAT_FROM_PTQ = ("int4 weight-only, channel, RTN", "int3 weight-only, channel, RTN")


def qat(res, loss_of, xtr, ytr, rng, steps: int, lr: float = 1e-4) -> dict:
  """``steps`` of QAT (Adam on the params, the state merged) from PTQ's calibrated variables."""
  state = fl.TrainState.create(apply_fn=res.model.apply, params=res.variables,
                               tx=optax.adam(lr))

  @jax.jit
  def step(state, xb, yb):
    g = jax.grad(lambda v: loss_of(res.model.apply(v, xb), yb))(state.params)
    return state.apply_gradients(grads=g)

  for _ in range(steps):
    idx = rng.integers(0, len(xtr), 64)
    state = step(state, xtr[idx], ytr[idx])
  return state.params


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rows = run(args.steps, args.seed)
  base = rows["float"]["test_loss"]
  for name, r in rows.items():
    extra = (f"  logits rel err {100 * r['logits_rel_err']:.2f}%"
             if "logits_rel_err" in r else "")
    print(f"{name:34s} loss {r['test_loss']:.4f} ({100 * (r['test_loss'] / base - 1):+.1f}%) "
          f"acc {100 * r['test_accuracy']:.2f}%{extra}")
  payload = {"env": {"platform": jax.default_backend(), "python": platform.python_version(),
                     "jax": jax.__version__},
             "model": "MLP 64-256-256-10 gelu, sklearn digits, 1400 train / 397 test",
             "steps": args.steps, "seed": args.seed, "calibration": "4 batches of 64",
             "arms": rows}
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(payload, f, indent=1)
  return payload


if __name__ == "__main__":
  main()
