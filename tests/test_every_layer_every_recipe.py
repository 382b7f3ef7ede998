"""Issue 4's promise: every layer accepts every recipe (or says clearly why not)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_linen as fl

RECIPES = {
    "fp8_delayed": fl.Fp8Recipe(),
    "fp8_current": fl.current_scaling(),
    "fp8_rowwise": fl.rowwise_scaling(),
    "mx_block": fl.mx_block_scaling(),
    "int8_ste": fl.IntRecipe(),
    "int8_lsq": fl.int8_lsq(),
    "int4_lsq_plus": fl.int4_lsq_plus(),
}

LAYERS = {
    "QDense": (lambda r: fl.QDense(8, recipe=r), lambda: nn.Dense(8), (4, 32)),
    "QDenseGeneral": (lambda r: fl.QDenseGeneral((2, 4), recipe=r),
                      lambda: nn.DenseGeneral((2, 4)), (4, 32)),
    "QEinsum": (lambda r: fl.QEinsum((32, 8), "bk,kn->bn", recipe=r),
                lambda: nn.Einsum((32, 8), "bk,kn->bn"), (4, 32)),
    "QConv": (lambda r: fl.QConv(8, (3, 3), recipe=r), lambda: nn.Conv(8, (3, 3)), (2, 6, 6, 32)),
}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_layer_trains_with_recipe(layer_name, recipe_name):
  make_q, make_ref, shape = LAYERS[layer_name]
  recipe = RECIPES[recipe_name]
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  q, ref = make_q(recipe), make_ref()
  vq = q.init(jax.random.key(0), x)
  vr = ref.init(jax.random.key(0), x)
  # the flax twin's params are all there, with the same shapes (LSQ adds its step sizes)
  flat_q = {k: v.shape for k, v in jax.tree_util.tree_flatten_with_path(vq["params"])[0]}
  for path, leaf in jax.tree_util.tree_flatten_with_path(vr["params"])[0]:
    assert flat_q[path] == leaf.shape
  y = q.apply(vq, x)
  y_ref = ref.apply({"params": vr["params"]}, x)
  err = float(jnp.abs(y - y_ref).max() / jnp.abs(y_ref).max())
  bound = 0.35 if "int4" in recipe_name else 0.12
  assert err < bound, err  # quantized, but close to the float layer
  g = jax.jit(jax.grad(lambda v: jnp.sum(q.apply(v, x) ** 2)))(vq)
  for leaf in jax.tree.leaves(g):
    assert np.all(np.isfinite(np.asarray(leaf)))
  assert float(jnp.abs(g["params"]["kernel"]).max()) > 0
