"""LoRA / QLoRA on served Linen models: fl.add_lora, fl.split_lora, fl.join_lora, fl.merge_lora."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import fp8_linen as fl
from fp8_linen.core import lora as core_lora


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64, name="up")(x))
    return nn.Dense(8, name="down")(h)


class Mixed(nn.Module):
  """A convolution, a two-axis DenseGeneral and an einsum head."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Conv(8, (3, 3), name="conv")(x))
    h = nn.relu(nn.DenseGeneral(16, axis=(-3, -2, -1), name="proj")(h))
    return nn.Einsum((16, 4), "bd,dk->bk", use_bias=False, name="head")(h)


def _batches(shape, n=2):
  return [jax.random.normal(k, shape) for k in jax.random.split(jax.random.key(0), n)]


@functools.lru_cache(maxsize=None)
def _served(recipe_name: str):
  """A PTQ-served MLP (cached per recipe: tests only read it)."""
  recipe = {"int4": fl.weight_only(4), "int4 group": fl.weight_only(4, granularity="group",
                                                                     group_size=16),
            "w8a8": fl.IntRecipe(), "fp8": fl.delayed_scaling(),
            "fp8 row": fl.rowwise_scaling(), "mxfp8": fl.mx_block_scaling(),
            "fp8 weight-only": fl.Fp8WeightOnly()}[recipe_name]
  batches = _batches((32, 32))
  model = MLP()
  params = model.init(jax.random.key(1), batches[0])
  res = fl.ptq(model, params, batches, recipe=recipe)
  return model, params, res.served, res.served_params, batches


def _randomize(params, seed=5, scale=0.3):
  """The adapters of ``params`` set to random values (B too, so the update is not zero)."""
  adapters, frozen = fl.split_lora(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
  return fl.join_lora(jax.tree.unflatten(tree, leaves), frozen)


def _dequantized(served, sp, x):
  """The served model's float kernels (fl.merge_lora of the params without adapters)."""
  return fl.merge_lora(served, sp, x)["params"]


def test_fresh_adapters_leave_the_output_unchanged_and_sit_beside_every_kernel():
  _, _, served, sp, batches = _served("int4")
  params = fl.add_lora(served, sp, batches[0], rank=4, alpha=8.0)
  for layer, (k, n) in {"up": (32, 64), "down": (64, 8)}.items():
    node = params["params"][layer]
    chex.assert_shape(node["lora_a"], (k, 4))
    chex.assert_shape(node["lora_b"], (4, n))
    assert not np.any(node["lora_b"]) and np.any(node["lora_a"])
    assert float(node["lora_scale"]) == 2.0
    assert node["kernel"].dtype == jnp.int4
  apply = jax.jit(served.apply)
  chex.assert_trees_all_equal(apply(params, batches[1]), apply(sp, batches[1]))
  # The adapters are drawn from the seed and the layer path: reproducible, distinct per layer.
  again = fl.add_lora(served, sp, batches[0], rank=4, alpha=8.0)
  chex.assert_trees_all_equal(again, params)
  assert not np.allclose(params["params"]["up"]["lora_a"][:8],
                         fl.add_lora(served, sp, batches[0], rank=4, seed=1)["params"]["up"][
                             "lora_a"][:8])


def test_paths_pick_the_layers():
  _, _, served, sp, batches = _served("int4")
  params = fl.add_lora(served, sp, batches[0], rank=2, paths="down")
  assert "lora_a" in params["params"]["down"] and "lora_a" not in params["params"]["up"]
  with pytest.raises(ValueError, match="no served layer .* matches paths='nothing'"):
    fl.add_lora(served, sp, batches[0], paths="nothing")


def test_adapter_output_against_a_float64_reference():
  """served(x) + s (x A) B, the second term against numpy float64."""
  _, _, served, sp, batches = _served("int4")
  params = _randomize(fl.add_lora(served, sp, batches[0], rank=3, alpha=6.0, paths="down"))
  x = batches[1]
  # The hidden activation the last layer sees, from the served model itself.
  hidden = jax.jit(lambda p, x: served.apply(p, x, capture_intermediates=True,
                                             mutable=["intermediates"])[1])(sp, x)
  h = np.asarray(hidden["intermediates"]["up"]["__call__"][0], np.float64)
  h = np.maximum(h, 0.0)
  node = params["params"]["down"]
  want = 2.0 * (h @ np.asarray(node["lora_a"], np.float64)) @ np.asarray(node["lora_b"],
                                                                          np.float64)
  got = np.asarray(jax.jit(served.apply)(params, x) - jax.jit(served.apply)(sp, x), np.float64)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("recipe_name", ["int4", "int4 group", "fp8 row", "fp8 weight-only"])
def test_adapter_gradients_equal_the_float_models(recipe_name):
  """For a weight-only / fp8 base, d loss / d adapters equals the float model's, kernels merged.

  The reference is the float MLP whose kernels are the dequantized codes plus s A B, written
  with A and B as its inputs: plain autodiff, no served product.
  """
  model, _, served, sp, batches = _served(recipe_name)
  params = _randomize(fl.add_lora(served, sp, batches[0], rank=2, alpha=4.0), scale=0.1)
  adapters, frozen = fl.split_lora(params)
  x, y = batches[1], jnp.ones((32, 8))
  deq = _dequantized(served, sp, x)

  def lora_loss(a):
    return jnp.mean((served.apply(fl.join_lora(a, frozen), x) - y) ** 2)

  def float_loss(a):
    p = {name: {"kernel": deq[name]["kernel"] + 2.0 * a["params"][name]["lora_a"] @
                a["params"][name]["lora_b"], "bias": deq[name]["bias"]}
         for name in ("up", "down")}
    return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

  if recipe_name == "fp8 row":
    # The served fp8 forward quantizes the inputs too, so the float model is no reference:
    # the chain rule written out in float64 at the served forward's activations is, with the
    # straight-through rule (the float product's gradient, weights dequantized).
    _, inter = jax.jit(lambda p: served.apply(p, x, capture_intermediates=True,
                                              mutable=["intermediates"]))(params)
    f64 = lambda t: np.asarray(t, np.float64)
    h_pre = f64(inter["intermediates"]["up"]["__call__"][0])
    out = f64(inter["intermediates"]["__call__"][0])
    h = np.maximum(h_pre, 0.0)
    gy = 2.0 * (out - f64(y)) / out.size
    a_up, b_up = (f64(adapters["params"]["up"][n]) for n in ("lora_a", "lora_b"))
    a_dn, b_dn = (f64(adapters["params"]["down"][n]) for n in ("lora_a", "lora_b"))
    gh = gy @ f64(deq["down"]["kernel"]).T + 2.0 * (gy @ b_dn.T) @ a_dn.T
    gpre = gh * (h_pre > 0)
    want = {"down": {"lora_a": 2.0 * h.T @ (gy @ b_dn.T), "lora_b": 2.0 * (h @ a_dn).T @ gy},
            "up": {"lora_a": 2.0 * f64(x).T @ (gpre @ b_up.T),
                   "lora_b": 2.0 * (f64(x) @ a_up).T @ gpre}}
    g = jax.jit(jax.grad(lora_loss))(adapters)
    chex.assert_trees_all_close(jax.tree.map(f64, g["params"]), want, rtol=2e-3, atol=2e-6)
    return
  chex.assert_trees_all_close(jax.jit(lora_loss)(adapters), jax.jit(float_loss)(adapters),
                              rtol=1e-5)
  chex.assert_trees_all_close(jax.jit(jax.grad(lora_loss))(adapters),
                              jax.jit(jax.grad(float_loss))(adapters), rtol=2e-4, atol=1e-6)


def test_w8a8_base_passes_gradients_to_earlier_adapters():
  _, _, served, sp, batches = _served("w8a8")
  params = _randomize(fl.add_lora(served, sp, batches[0], rank=2), scale=0.1)
  adapters, frozen = fl.split_lora(params)
  g = jax.jit(jax.grad(lambda a: jnp.sum(served.apply(fl.join_lora(a, frozen), batches[1]))))(
      adapters)
  # "up"'s adapters sit before the int8 x int8 product of "down": they train only through its
  # straight-through gradient.
  assert np.any(g["params"]["up"]["lora_a"]) and np.all(np.isfinite(g["params"]["up"]["lora_a"]))


def _train(served, params, x, y, steps=25, lr=3e-2):
  adapters, frozen = fl.split_lora(params)
  tx = optax.adam(lr)

  @jax.jit
  def step(a, opt):
    loss, g = jax.value_and_grad(
        lambda a: jnp.mean((served.apply(fl.join_lora(a, frozen), x) - y) ** 2))(a)
    upd, opt = tx.update(g, opt, a)
    return optax.apply_updates(a, upd), opt, loss

  opt, losses = tx.init(adapters), []
  for _ in range(steps):
    adapters, opt, loss = step(adapters, opt)
    losses.append(float(loss))
  return fl.join_lora(adapters, frozen), losses


def test_qlora_trains_the_adapters_and_leaves_the_codes():
  _, _, served, sp, batches = _served("int4")
  x = batches[1]
  y = jnp.tanh(x[:, :8] * 2.0)
  params, losses = _train(served, fl.add_lora(served, sp, x, rank=4), x, y)
  assert losses[-1] < 0.5 * losses[0]
  _, frozen = fl.split_lora(params)
  flat = traverse_util.flatten_dict(frozen)
  for k, v in traverse_util.flatten_dict(sp).items():
    chex.assert_trees_all_equal(flat[k], v)  # codes, scales and biases: untouched


def test_the_backward_pass_keeps_codes_not_float_weights():
  """The residuals of the adapters' gradient: the int4 codes, no float copy of a weight."""
  _, _, served, sp, batches = _served("int4")
  adapters, frozen = fl.split_lora(fl.add_lora(served, sp, batches[0], rank=2))
  x = batches[1][:3]  # a batch whose activations cannot be mistaken for a weight

  def loss(a):
    return jnp.sum(served.apply(fl.join_lora(a, frozen), x))

  _, pull = jax.vjp(loss, adapters)
  residuals = jax.tree.leaves(pull)
  sizes = {32 * 64, 64 * 8}
  floats = [r for r in residuals if jnp.issubdtype(r.dtype, jnp.floating) and r.size in sizes]
  assert not floats, [(r.shape, r.dtype) for r in floats]
  # "down" multiplies an input the adapters change: its backward reads its int4 codes.
  assert any(r.dtype == jnp.int4 and r.shape == (64, 8) for r in residuals)


def test_planned_memory_of_the_frozen_base():
  """QLoRA's claim, from the compiled step (CPU): the frozen base is held at <= 0.3x its bf16 bytes."""
  d = 1024
  model = nn.Sequential([nn.Dense(d, use_bias=False), nn.relu, nn.Dense(d, use_bias=False)])
  x = jnp.ones((4, d), jnp.bfloat16)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, jnp.bfloat16), params)
  res = fl.ptq(model, params, [x], recipe=fl.weight_only(4))
  adapters, frozen = fl.split_lora(fl.add_lora(res.served, res.served_params, x, rank=8))

  def step(a, frozen, x):
    return jax.grad(lambda a: jnp.sum(res.served.apply(fl.join_lora(a, frozen), x)))(a)

  mem = jax.jit(step).lower(adapters, frozen, x).compile().memory_analysis()
  bf16_base = 2 * d * d * 2
  base = fl.weight_bytes(frozen)
  assert base <= 0.3 * bf16_base, base / bf16_base
  args = mem.argument_size_in_bytes
  other = fl.weight_bytes(adapters) + x.size * 2
  assert args - other <= 0.3 * bf16_base, (args - other) / bf16_base
  # The step's scratch holds no float copy of both weights at once.
  assert mem.temp_size_in_bytes < 2 * d * d * 4


def test_merge_adds_the_update_and_ptq_serves_it_again():
  model, _, served, sp, batches = _served("int4 group")
  params = _randomize(fl.add_lora(served, sp, batches[0], rank=2, alpha=2.0), scale=0.05)
  merged = jax.tree.map(np.asarray, fl.merge_lora(served, params, batches[0]))
  deq = _dequantized(served, sp, batches[0])
  for name in ("up", "down"):
    node = params["params"][name]
    want = (np.asarray(deq[name]["kernel"], np.float64) +
            np.asarray(node["lora_a"], np.float64) @ np.asarray(node["lora_b"], np.float64))
    np.testing.assert_allclose(merged["params"][name]["kernel"], want, rtol=1e-5, atol=1e-6)
    assert sorted(merged["params"][name]) == ["bias", "kernel"]
  # The merged float model computes what the LoRA model computes (weight-only: a float GEMM).
  x = batches[1]
  lora_y = jax.jit(served.apply)(params, x)
  chex.assert_trees_all_close(jax.jit(model.apply)(merged, x), lora_y, rtol=1e-4, atol=1e-4)
  # Requantized by PTQ: a served model again, within int4's error of the LoRA model.
  again = fl.ptq(model, merged, batches, recipe=fl.weight_only(4, granularity="group",
                                                                group_size=16))
  assert again.served_params["params"]["up"]["kernel"].dtype == jnp.int4
  y = jax.jit(again.served.apply)(again.served_params, x)
  err = float(jnp.linalg.norm(y - lora_y) / jnp.linalg.norm(lora_y))
  assert err < 0.1, err


def test_convolution_general_dense_and_einsum_adapters():
  """Adapters on a convolution, a two-axis DenseGeneral and an einsum, against the merged model."""
  xs = _batches((4, 6, 6, 3))
  model = Mixed()
  params = model.init(jax.random.key(0), xs[0])
  res = fl.ptq(model, params, xs, recipe=fl.weight_only(8))
  lp = _randomize(fl.add_lora(res.served, res.served_params, xs[0], rank=2), scale=0.1)
  node = lp["params"]
  chex.assert_shape([node["conv"]["lora_a"], node["conv"]["lora_b"]], [(3, 3, 3, 2), (2, 8)])
  chex.assert_shape([node["proj"]["lora_a"], node["proj"]["lora_b"]], [(6, 6, 8, 2), (2, 16)])
  merged = fl.merge_lora(res.served, lp, xs[0])
  assert merged["params"]["head"]["kernel"].dtype == jnp.float32
  chex.assert_trees_all_close(jax.jit(res.served.apply)(lp, xs[1]),
                              jax.jit(model.apply)(merged, xs[1]), rtol=2e-4, atol=2e-4)


def test_block_scaled_base_refuses_gradients_by_name():
  _, _, served, sp, batches = _served("mxfp8")
  # "up"'s adapters train through "down"'s served product, whose weight is MXFP8 blocks.
  adapters, frozen = fl.split_lora(fl.add_lora(served, sp, batches[0], rank=2, paths="up"))
  with pytest.raises(ValueError, match="down: .*block-scaled weight"):
    jax.grad(lambda a: jnp.sum(served.apply(fl.join_lora(a, frozen), batches[1])))(adapters)


def test_bad_arguments_are_named():
  _, params, served, sp, batches = _served("int4")
  x = batches[0]
  with pytest.raises(ValueError, match="rank must be a positive int, got 0"):
    fl.add_lora(served, sp, x, rank=0)
  with pytest.raises(ValueError, match="alpha must be finite"):
    fl.add_lora(served, sp, x, alpha=float("nan"))
  with pytest.raises(TypeError, match="served must be the served model"):
    fl.add_lora(MLP(), params, x)
  with pytest.raises(ValueError, match="hold no LoRA adapters"):
    fl.split_lora(sp)
  with pytest.raises(ValueError, match="already hold LoRA adapters"):
    fl.add_lora(served, fl.add_lora(served, sp, x), x)


def test_grouped_convolutions_are_refused_by_name():
  model = nn.Conv(8, (3, 3), feature_group_count=2, name="dw")
  xs = _batches((2, 5, 5, 4))
  res = fl.ptq(model, model.init(jax.random.key(0), xs[0]), xs, recipe=fl.weight_only(8))
  with pytest.raises(ValueError, match="without feature groups"):
    fl.add_lora(res.served, res.served_params, xs[0])


def test_dot_delta_kernel_lays_out_the_update_as_the_weight():
  a = jax.random.normal(jax.random.key(0), (4, 3, 2))   # contracting axes (2, 0) of (3, 5, 4)
  b = jax.random.normal(jax.random.key(1), (2, 5))
  d = core_lora.dot_delta_kernel(a, b, (3, 5, 4), (2, 0), 1.5)
  want = 1.5 * np.einsum("kir,rn->ink", np.asarray(a, np.float64), np.asarray(b, np.float64))
  np.testing.assert_allclose(d, want, rtol=1e-5)
