"""Precision chosen by measurement (Linen): fl.sensitivity and its choice of rules.

The choice's greedy logic runs on synthetic measurements (an additive loss and
ones that are not); the measurements on a small MLP whose middle layer has a
weight 200 times its others (per-tensor int4 weights then round every other
weight of that layer to zero). The NNX entry point and Linen/NNX parity are in
tests/nnx/test_nnx_sensitivity.py.
"""

import functools
import re

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl
from fp8_linen.families import sensitivity as shared

# Per-tensor int4 weights (STE: the scale from the weight's own range; no state
# to initialise) and float activations.
INT4_TENSOR = fl.IntRecipe(input=None, kernel=fl.IntQuantConfig(bits=4))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i, width in enumerate((32, 32, 32)):
      x = nn.relu(nn.Dense(width, name=f"dense{i}")(x))
    return nn.Dense(8, name="dense3")(x)


def xent(forward, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(forward(x), y).mean()


@functools.lru_cache(maxsize=None)
def _setup():
  """The MLP with an outlier in dense1, and batches labelled by the model itself."""
  model = MLP()
  xs = [jax.random.normal(k, (64, 16)) for k in jax.random.split(jax.random.key(0), 2)]
  params = flax.core.unfreeze(model.init(jax.random.key(1), xs[0]))
  kernel = params["params"]["dense1"]["kernel"]
  params["params"]["dense1"]["kernel"] = kernel.at[0, 0].set(200 * jnp.abs(kernel).max())
  # Sharper logits: a confident teacher, so any error of a layer raises the loss.
  params["params"]["dense3"]["kernel"] *= 4
  apply = jax.jit(model.apply)
  batches = [(x, jnp.argmax(apply(params, x), -1)) for x in xs]
  return model, params, batches


@functools.lru_cache(maxsize=None)
def _result():
  model, params, batches = _setup()
  return fl.sensitivity(model, params, batches, recipe=INT4_TENSOR, loss_fn=xent)


@functools.lru_cache(maxsize=None)
def _float_loss():
  model, params, batches = _setup()
  g = jax.jit(lambda v, b: xent(functools.partial(model.apply, v), b))
  return sum(float(g(params, b)) for b in batches)


def _direct_loss_change(rules, recipe=INT4_TENSOR):
  """The relative loss change under ``rules``, from quantize_model and apply alone."""
  model, params, batches = _setup()
  qmodel = fl.quantize_model(model, recipe, rules=rules, on_unmatched="ignore")
  f = jax.jit(lambda v, b: xent(functools.partial(qmodel.apply, v), b))
  return sum(float(f(params, b)) for b in batches) / _float_loss() - 1


def _alone(path):
  return [fl.QuantizationRule(module_path=re.escape(path)),
          fl.QuantizationRule(module_path=".*", quantize=False)]


def test_the_outlier_layer_ranks_first():
  res = _result()
  assert set(res.paths) == {"dense0", "dense1", "dense2", "dense3"}
  assert res.paths[0] == res.ranking("loss_change")[0] == "dense1", res.table()
  # Its output error is not the largest: the outlier's column dominates the outputs' norm and
  # is exact; what it costs shows in the loss.
  assert res.ranking("output_error")[0] != "dense1"
  worst, rest = res.layers[0], res.layers[1:]
  assert worst.loss_change > 10 * max(s.loss_change for s in rest), res.table()
  assert res.layer("dense0").weights == 16 * 32 and res.layer("dense3").weights == 32 * 8


def test_measurements_equal_a_direct_evaluation():
  """Loss change from quantize_model + apply; the output and gradient errors recomputed."""
  model, params, batches = _setup()
  res = _result()
  for path in ("dense1", "dense3"):
    np.testing.assert_allclose(res.layer(path).loss_change, _direct_loss_change(_alone(path)),
                               rtol=1e-4)
  np.testing.assert_allclose(res.quantized_loss_change, _direct_loss_change(None), rtol=1e-4)
  # dense3's outputs are the logits: its output error is the logits' relative error.
  q3 = fl.quantize_model(model, INT4_TENSOR, rules=_alone("dense3"))
  diff = jax.jit(lambda x: (q3.apply(params, x), model.apply(params, x)))
  pairs = [diff(x) for x, _ in batches]
  err = sum(float(jnp.sum((q - f) ** 2)) for q, f in pairs)
  ref = sum(float(jnp.sum(f ** 2)) for _, f in pairs)
  np.testing.assert_allclose(res.layer("dense3").output_error, np.sqrt(err / ref), rtol=1e-4)
  # dense0's gradient error: d loss / d dense0's kernel and bias, quantized alone vs float.
  q0 = fl.quantize_model(model, INT4_TENSOR, rules=_alone("dense0"))
  grads = jax.jit(lambda b: [jax.grad(lambda p: xent(functools.partial(m.apply, p), b))(params)
                             ["params"]["dense0"] for m in (q0, model)])
  err = ref = 0.0
  for b in batches:
    gq, gf = grads(b)
    err += sum(float(jnp.sum((gq[k] - gf[k]) ** 2)) for k in ("kernel", "bias"))
    ref += sum(float(jnp.sum(gf[k] ** 2)) for k in ("kernel", "bias"))
  np.testing.assert_allclose(res.layer("dense0").grad_error, np.sqrt(err / ref), rtol=1e-4)


def test_choice_keeps_the_outlier_layer_and_meets_the_budget_verified():
  res = _result()
  kept_one = res.evaluate(res.rules_keeping(["dense1"]))
  assert kept_one < res.quantized_loss_change
  budget = max(kept_one, 0.0) + 0.01
  choice = res.choice(budget, cost="layers")
  assert choice.kept == ("dense1",) and choice.met
  # The reported loss is measured: quantize_model with the chosen rules gives it.
  np.testing.assert_allclose(choice.loss_change, _direct_loss_change(choice.rules), rtol=1e-4,
                             atol=1e-6)
  assert choice.loss_change <= budget
  assert res.choose(budget, cost="layers") == choice.rules
  assert choice.rules[0] == fl.QuantizationRule(module_path="(?:dense1)", quantize=False)
  # Bytes: 4-bit weights, the kept layer in 16 bits.
  w = {s.path: s.weights for s in res.layers}
  assert choice.weight_bytes == (sum(w.values()) * 4 + w["dense1"] * 12) / 8


def test_chosen_rules_beat_the_hand_rule_with_as_few_high_precision_layers():
  res = _result()
  hand = fl.high_precision_layers("dense{i}", 4, last=1) + (fl.QuantizationRule(),)
  hand_change = res.evaluate(hand)
  choice = res.choice(hand_change, cost="layers")
  assert choice.met and len(choice.kept) <= 1
  assert choice.loss_change < hand_change - 0.05, (choice, hand_change)


def test_fallback_recipe_for_kept_layers():
  """NVFP4 with the kept layer in MXFP8: the rules run it in MXFP8, the others in NVFP4."""
  model, params, batches = _setup()
  res = fl.sensitivity(model, params, batches[:1], recipe=fl.nvfp4(), loss_fn=xent,
                       fallback=fl.mx_block_scaling(), candidates=["dense[12]"])
  assert set(res.paths) == {"dense1", "dense2"}
  assert all(np.isfinite(s.fallback_loss_change) for s in res.layers)
  x = batches[0][0]

  def forward(rules):  # fresh quantizer state: every scale from x itself
    qmodel = fl.quantize_model(model, fl.nvfp4(), rules=rules)
    return jax.jit(lambda p: qmodel.apply(p, x, mutable=True)[0])(params)
  by_hand = [fl.QuantizationRule(module_path="dense1", recipe=fl.mx_block_scaling()),
             fl.QuantizationRule()]
  chosen = forward(res.rules_keeping(["dense1"]))
  chex.assert_trees_all_equal(chosen, forward(by_hand))
  assert not np.array_equal(chosen, forward([by_hand[1]]))
  # bytes: MXFP8 (8 + 8/32 bits) for the kept layer, NVFP4 (4 + 8/256: 16x16 tiles) for the other
  w = {s.path: s.weights for s in res.layers}
  assert res.weight_bytes(["dense1"]) == (w["dense1"] * 8.25 + w["dense2"] * 4.03125) / 8


def test_fresh_delayed_scaling_measures_what_current_scaling_does():
  """Empty histories: every batch is scaled by its own amax, as current scaling does."""
  model, params, batches = _setup()
  kw = dict(loss_fn=xent, candidates=["dense3"])
  delayed = fl.sensitivity(model, params, batches[:1], recipe=fl.delayed_scaling(16), **kw)
  current = fl.sensitivity(model, params, batches[:1], recipe=fl.current_scaling(), **kw)
  assert delayed.paths == current.paths
  for a, b in zip(delayed.layers, current.layers):
    np.testing.assert_allclose([a.loss_change, a.output_error, a.grad_error],
                               [b.loss_change, b.output_error, b.grad_error], rtol=1e-6)
  assert 0 < delayed.layer("dense3").output_error < 0.1  # e4m3: a few percent


def _synthetic(layers, full, evaluate):
  return shared.SensitivityResult(
      recipe=INT4_TENSOR, fallback=None, rules=(fl.QuantizationRule(),), float_loss=1.0,
      quantized_loss_change=full, layers=tuple(
          shared.LayerSensitivity(path=p, loss_change=c, output_error=0.0, grad_error=0.0,
                                  weights=w) for p, c, w in layers),
      evaluate=evaluate)


def _kept(rules):
  """The paths a keep_rules list keeps (its first rule's alternation)."""
  first = rules[0].module_path
  return set(first[3:-1].split("|")) if not rules[0].quantize else set()


LAYERS = [("a", 0.05, 1000), ("b", 0.04, 10), ("c", 0.04, 10)]


def test_greedy_choice_by_bytes_and_by_layers():
  gains = {p: c for p, c, _ in LAYERS}
  additive = lambda rules: 0.1 - sum(gains[p] for p in _kept(rules))
  res = _synthetic(LAYERS, 0.1, additive)
  by_bytes = res.choice(0.03)
  assert set(by_bytes.kept) == {"b", "c"} and by_bytes.met
  np.testing.assert_allclose(by_bytes.loss_change, 0.02)
  by_layers = res.choice(0.03, cost="layers")
  assert set(by_layers.kept) == {"a", "b"}
  np.testing.assert_allclose(by_layers.loss_change, 0.01)
  by_mapping = res.choice(0.03, cost={"a": 1.0, "b": 100.0, "c": 100.0})
  assert by_mapping.kept[0] == "a"
  assert res.choice(0.2).kept == () and res.choice(0.2).evaluations == 0


def test_greedy_choice_verifies_corrects_and_prunes():
  gains = {p: c for p, c, _ in LAYERS}
  calls = []

  def interacting(rules):  # keeping a layer helps 0.01 less than measured alone
    kept = _kept(rules)
    calls.append(kept)
    return 0.1 - sum(gains[p] - 0.01 for p in kept)
  res = _synthetic(LAYERS, 0.1, interacting)
  choice = res.choice(0.03)
  # predicted b, c (0.02), measured 0.04: a is added (0.0); then c is dropped (0.03)
  assert choice.predicted_loss_change == pytest.approx(0.02)
  assert calls[:2] == [{"b", "c"}, {"a", "b", "c"}]
  assert set(choice.kept) == {"a", "b"} and choice.met
  assert choice.loss_change == pytest.approx(0.03) and choice.evaluations == len(calls)

  def one_suffices(rules):  # keeping c alone is enough: the greedy set is pruned to it
    return 0.0 if "c" in _kept(rules) else 0.1
  pruned = _synthetic(LAYERS, 0.1, one_suffices).choice(0.03)
  assert pruned.kept == ("c",) and pruned.loss_change == 0.0

  never = _synthetic(LAYERS, 0.1, lambda rules: 0.1)
  assert not never.choice(0.03).met
  with pytest.raises(ValueError, match="cannot be met"):
    never.choose(0.03)


@pytest.mark.parametrize("budget", [0, -0.1, float("nan"), "1%"])
def test_bad_budget(budget):
  res = _synthetic(LAYERS, 0.1, lambda rules: 0.0)
  with pytest.raises(ValueError, match="budget="):
    res.choice(budget)


def test_bad_arguments_name_the_argument():
  model, params, batches = _setup()
  kw = dict(recipe=INT4_TENSOR, loss_fn=xent)
  with pytest.raises(ValueError, match="batches is empty"):
    fl.sensitivity(model, params, [], **kw)
  nan_batch = (batches[0][0].at[0, 0].set(jnp.nan), batches[0][1])
  with pytest.raises(ValueError, match=r"batches\[1\] holds NaN"):
    fl.sensitivity(model, params, [batches[0], nan_batch], **kw)
  with pytest.raises(TypeError, match="recipe"):
    fl.sensitivity(model, params, batches, recipe="nvfp4", loss_fn=xent)
  with pytest.raises(TypeError, match="fallback"):
    fl.sensitivity(model, params, batches, fallback="mxfp8", **kw)
  with pytest.raises(TypeError, match="loss_fn"):
    fl.sensitivity(model, params, batches, recipe=INT4_TENSOR, loss_fn=None)
  with pytest.raises(TypeError, match="QuantizedModel"):
    fl.sensitivity(fl.quantize_model(model), params, batches, **kw)
  with pytest.raises(ValueError, match="no layer matched"):
    fl.sensitivity(model, params, batches[:1], rules=[fl.QuantizationRule(quantize=False)],
                   **kw)
  with pytest.raises(ValueError, match=r"candidates='head' matched no quantized layer"):
    fl.sensitivity(model, params, batches[:1], candidates="head", **kw)
  with pytest.raises(ValueError, match="cost="):
    _result().choice(0.1, cost="flops")
  with pytest.raises(ValueError, match="not measured layers"):
    _result().rules_keeping(["head"])


def test_weight_bits_per_recipe():
  bits = functools.partial(shared.weight_bits, high_precision_bits=16)
  assert bits(None) == 16 and bits(fl.delayed_scaling()) == bits(fl.Fp8WeightOnly()) == 8
  assert bits(fl.mx_block_scaling()) == 8.25 and bits(fl.nvfp4(kernel_2d_blocks=False)) == 4.5
  assert bits(fl.int4_lsq_plus()) == 4 and bits(fl.weight_only(8)) == 8
  assert bits(fl.weight_only(4, granularity="group", group_size=32)) == 4.5
  assert bits(fl.IntRecipe(kernel=None)) == 16


def test_keep_and_alone_rules_match_only_their_layers():
  base = fl.projection_rules()
  alone = shared.alone_rules("a/b", base)
  assert not re.fullmatch(alone[0].module_path, "a/b")
  for other in ("a", "a/b/c", "a/bc", "xa/b"):
    assert re.fullmatch(alone[0].module_path, other)
  kept = shared.keep_rules(["a/b", "c"], base, fallback=fl.mx_block_scaling())
  assert len(kept) == 2 * len(base) and all(r.optional for r in kept[:len(base)])
  for r, b in zip(kept, base):
    assert (r.operands, r.quantize) == (b.operands, b.quantize)
    assert r.recipe == (fl.mx_block_scaling() if b.quantize else b.recipe)
    assert re.fullmatch(r.module_path, "a/b") and re.fullmatch(r.module_path, "c")
    assert not re.fullmatch(r.module_path, "a/b/c")
  chex.assert_trees_all_equal(shared.keep_rules([], base), base)
