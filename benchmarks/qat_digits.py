"""Integer QAT accuracy on a small model: float vs int8 (LSQ) vs int4 (LSQ+).

An MLP (64-128-64-10) on scikit-learn's 8x8 digits, trained with the same
seed, optimizer and schedule in float and under each integer recipe. Prints
and (with ``--out``) writes the final test accuracies.

  PYTHONPATH=. python benchmarks/qat_digits.py --out benchmarks/results/cpu-qat-digits.json

``train_digits`` is also used by ``tests/test_qat.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8_linen as fl


class MLP(nn.Module):
  recipe: object = None
  hidden: tuple = (128, 64)

  @nn.compact
  def __call__(self, x):
    for i, h in enumerate(self.hidden + (10,)):
      dense = nn.Dense(h) if self.recipe is None else fl.QDense(h, recipe=self.recipe)
      x = dense(x)
      if i < len(self.hidden):
        x = nn.relu(x)
    return x


def load_data(seed: int = 0):
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  d = load_digits()
  x = (d.data / 16.0).astype(np.float32)
  return train_test_split(x, d.target.astype(np.int32), test_size=0.25, random_state=seed,
                          stratify=d.target)


def train_digits(recipe=None, *, epochs: int = 40, batch: int = 64, lr: float = 3e-3,
                 seed: int = 0, data=None) -> float:
  """Trains the MLP and returns the test accuracy (0..1)."""
  xtr, xte, ytr, yte = data if data is not None else load_data(seed)
  model = MLP(recipe)
  variables = model.init(jax.random.key(seed), jnp.asarray(xtr[:256]))
  variables = flax.core.unfreeze(variables)
  if fl.OWG not in variables:
    variables[fl.OWG] = {}
  state = fl.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(lr))

  @jax.jit
  def step(state, xb, yb):
    def loss_fn(v):
      logits = model.apply(v, xb)
      return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    grads = jax.grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads)

  rng = np.random.default_rng(seed)
  n = len(xtr) // batch * batch
  for _ in range(epochs):
    perm = rng.permutation(len(xtr))[:n].reshape(-1, batch)
    for idx in perm:
      state = step(state, xtr[idx], ytr[idx])
  logits = jax.jit(model.apply)(state.params, jnp.asarray(xte))
  return float(np.mean(np.argmax(np.asarray(logits), -1) == yte))


RECIPES = {
    "float": None,
    "int8_lsq": fl.int8_lsq(),
    "int4_lsq_plus": fl.int4_lsq_plus(),
    "int8_ste": fl.IntRecipe(input=fl.IntQuantConfig(bits=8),
                             kernel=fl.IntQuantConfig(bits=8, granularity="channel")),
    "int4_lsq": fl.IntRecipe(input=fl.IntQuantConfig(bits=4, estimator="lsq"),
                             kernel=fl.IntQuantConfig(bits=4, estimator="lsq",
                                                      granularity="channel")),
    # Integer gradient GEMMs too (opt-in): does it still train?
    "int8_lsq_int8_grads": fl.IntRecipe(input=fl.IntQuantConfig(estimator="lsq"),
                                        kernel=fl.IntQuantConfig(estimator="lsq",
                                                                 granularity="channel"),
                                        grad_bits=8),
    "int8_ste_int8_grads": fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"),
                                        grad_bits=8),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--epochs", type=int, default=40)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  results = {}
  for name, recipe in RECIPES.items():
    accs = []
    t0 = time.perf_counter()
    for seed in range(args.seeds):
      accs.append(train_digits(recipe, epochs=args.epochs, seed=seed))
    results[name] = {"test_accuracy": accs, "mean": float(np.mean(accs)),
                     "seconds": time.perf_counter() - t0}
    print(f"{name:>14}: mean {np.mean(accs):.4f}  {['%.4f' % a for a in accs]}")
  if args.out:
    meta = {"device": jax.devices()[0].device_kind, "platform": platform.platform(),
            "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "model": "MLP 64-128-64-10 (QDense), adam 3e-3, batch 64",
            "epochs": args.epochs, "seeds": args.seeds}
    with open(args.out, "w") as f:
      json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
