"""Patterns of real model code (MaxText, gemma) reproduced small, quantized with no glue.

Each test re-creates in plain flax one pattern that broke ``fl.quantize_model``
or the layers on Google's model code (the libraries themselves run in
``tests/third_party`` where they are installed).
"""

import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl

X = jax.random.normal(jax.random.key(1), (4, 8))


class OverridesInit(nn.Module):
  """A model whose ``init`` runs one of its own methods before binding (MaxText's
  ``transformer_as_linen`` overrides ``init``)."""

  def describe(self):
    return "model"

  def init(self, *args, **kwargs):  # pylint: disable=arguments-differ
    assert self.describe() == "model"
    return super().init(*args, **kwargs)

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(jax.nn.relu(nn.Dense(8)(x)))


def test_model_overriding_init_quantizes():
  qm = fl.quantize_model(OverridesInit(), fl.delayed_scaling())
  v = qm.init(jax.random.key(0), X)
  assert sorted(v[fl.OWG]) == ["Dense_0", "Dense_1"]
  assert qm.product_report(v, X).counts == {"quantized": 2}


@pytest.mark.parametrize("inside_context", [False, True])
def test_lsq_declares_its_steps_through_a_patched_param(monkeypatch, inside_context):
  """gemma patches ``nn.Module.param`` process-wide: a shape is required and a dtype is
  forwarded to the initializer (positionally, or as ``dtype=bf16`` inside its context)."""
  original = nn.Module.param
  calls = []

  def param_with_shape(self, name, init_fn, shape, dtype=None, **kwargs):
    calls.append((name, tuple(shape)))
    if inside_context:
      return original(self, name, init_fn, shape, **kwargs, dtype=jnp.bfloat16)
    return original(self, name, init_fn, shape, dtype, **kwargs)

  monkeypatch.setattr(nn.Module, "param", param_with_shape)
  for recipe in (fl.int8_lsq(), fl.int4_lsq_plus()):
    calls.clear()
    layer = fl.QDense(4, recipe=recipe)
    v = layer.init(jax.random.key(0), X)
    names = {n for n, _ in calls}
    assert {"input_step", "kernel_step"} <= names
    assert ("kernel_step", v["params"]["kernel_step"].shape) in calls
    assert v["params"]["kernel_step"].dtype == jnp.float32  # a learned step stays float32
    y = layer.apply(v, X)
    assert y.shape == (4, 4) and bool(jnp.all(jnp.isfinite(y)))


def test_quantized_model_trains_under_raw_checkpoint_of_each_layer():
  """MaxText wraps each decoder layer call in a raw ``jax.checkpoint``."""

  class Layer(nn.Module):

    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(8)(jax.nn.gelu(nn.Dense(16)(x)))

  class Decoder(nn.Module):
    checkpointed: bool = True

    @nn.compact
    def __call__(self, x):
      for i in range(2):
        layer = Layer(name=f"layer_{i}")
        x = jax.checkpoint(lambda x: layer(x))(x) if self.checkpointed else layer(x)
      return x

  qm = fl.quantize_model(Decoder(), fl.delayed_scaling(history_length=4))
  # Declared outside the checkpoint (flax's own params leak out of a raw
  # jax.checkpoint at init); trained with it.
  v = fl.quantize_model(Decoder(checkpointed=False), fl.delayed_scaling(history_length=4)).init(
      jax.random.key(0), X)
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-3))

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, X) - X) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(3):
    state = step(state)
  hist = state.params[fl.OWG]["layer_0"]["Dense_1"]["input_amax_history"]  # the first projection
  np.testing.assert_allclose(np.asarray(hist[:3]), float(jnp.max(jnp.abs(X))), rtol=1e-6)
  report = qm.product_report(state.params, X)
  assert report.counts == {"quantized": 4}


class _Einsum(nn.Module):
  """gemma's ``_layers.Einsum``: a named weight and a raw ``jnp.einsum``."""

  shape: tuple
  weight_name: str

  @nn.compact
  def __call__(self, eqn, x):
    w = self.param(self.weight_name, nn.initializers.normal(), self.shape)
    return jnp.einsum(eqn, x, w)


class GatedMlp(nn.Module):
  """gemma's ``FeedForward``: two Einsum children share the MLP's scope (nn.share_scope)."""

  @nn.compact
  def __call__(self, x):
    gating = _Einsum((8, 16), "gating_einsum")
    nn.share_scope(self, gating)
    linear = _Einsum((16, 8), "linear")
    nn.share_scope(self, linear)
    return linear("...H,HF->...F", jax.nn.gelu(gating("...F,FH->...H", x)))


def test_modules_sharing_a_scope_keep_one_state_each():
  qm = fl.quantize_model(GatedMlp(), fl.delayed_scaling(history_length=4))
  v = qm.init(jax.random.key(0), X)
  assert sorted(v["params"]) == ["gating_einsum", "linear"]  # the params tree is untouched
  assert sorted(v[fl.OWG]) == ["_Einsum_0", "_Einsum_1"]
  grads = jax.grad(lambda p: jnp.sum(qm.apply(p, X) ** 2))(v)[fl.OWG]
  first = grads["_Einsum_0"]["einsum_0"]["input_amax_history"]
  second = grads["_Einsum_1"]["einsum_0"]["input_amax_history"]
  assert float(first[0]) == pytest.approx(float(jnp.max(jnp.abs(X))))
  assert float(second[0]) != pytest.approx(float(first[0]))  # its own tensor: gelu(x @ w)
  paths = {p.scope for p in qm.product_report(v, X).products}
  assert qm.product_report(v, X).counts == {"quantized": 2}, paths


class PathMutatingBridge(nn.Module):
  """MaxText's ``ToLinen``: the scope's path is extended in place while a submodule runs."""

  @nn.compact
  def __call__(self, x):
    outs = []
    for name, width in (("router", 4), ("head", 6)):
      w = self.param(f"{name}_w", nn.initializers.normal(), (8, width))
      old = self.scope.path
      self.scope.path = old + ("decoder", name)
      try:
        outs.append(jnp.einsum("bf,fo->bo", x, w))
      finally:
        self.scope.path = old
    return outs


def test_state_and_rules_follow_a_path_extended_in_place():
  qm = fl.quantize_model(PathMutatingBridge(), fl.delayed_scaling(history_length=4), rules=[
      fl.QuantizationRule(module_path=".*router", quantize=False),
      fl.QuantizationRule(module_path=".*")])
  v = qm.init(jax.random.key(0), X)
  assert list(v[fl.OWG]) == ["decoder"] and list(v[fl.OWG]["decoder"]) == ["head"]
  assert list(v[fl.OWG]["decoder"]["head"]) == ["einsum_0"]
  report = qm.product_report(v, X)
  assert report.counts == {"quantized": 1, "excluded": 1}
  # The report names the path the rules matched, not only the bridge's own scope.
  assert [p.status for p in report.products if "decoder/router" in p.scope] == ["excluded"]
  assert [p.status for p in report.products if "decoder/head" in p.scope] == ["quantized"]


class NestedParamsBridge(nn.Module):
  """MaxText's ``ToLinen`` holds each NNX submodule's weights nested at the path it runs at."""

  @nn.compact
  def __call__(self, x):
    params = self.param("decoder", lambda k: {"mlp": {"kernel": nn.initializers.normal()(
        k, (8, 6))}})
    old = self.scope.path
    self.scope.path = old + ("decoder", "mlp")
    try:
      return jnp.einsum("bf,fo->bo", x, params["mlp"]["kernel"])
    finally:
      self.scope.path = old


def test_projection_rules_find_a_weight_held_at_the_path_a_bridge_runs_at():
  qm = fl.quantize_model(NestedParamsBridge(), rules=fl.projection_rules())
  v = qm.init(jax.random.key(0), X)
  # Read among the bridge's top-level params only, the kernel looked like an activation.
  assert qm.product_report(v, X).counts == {"quantized": 1}
  assert list(v[fl.OWG]["decoder"]["mlp"]) == ["einsum_0"]


def test_an_elementwise_einsum_is_not_quantized():
  """MaxText's RMSNorm applies its scale as jnp.einsum('...k,k->...k'): no axis contracted."""

  class RmsNorm(nn.Module):

    @nn.compact
    def __call__(self, x):
      scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
      y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
      return nn.Dense(4)(jnp.einsum("...k,k->...k", y, scale))

  qm = fl.quantize_model(RmsNorm(), fl.delayed_scaling())
  v = qm.init(jax.random.key(0), X)
  assert qm.product_report(v, X).counts == {"quantized": 1, "excluded": 1}
  assert list(v[fl.OWG]) == ["Dense_0"]


class OwnEmbedder(nn.Module):
  """gemma's ``Embedder``: a raw table param, ``encode`` gathers, ``decode`` is a tied head."""

  @nn.compact
  def __call__(self, tokens):
    table = self.param("input_embedding", nn.initializers.normal(), (32, 8))
    return table[tokens]

  def decode(self, x):
    return jnp.dot(x, self.variables["params"]["input_embedding"].T)


class TiedLm(nn.Module):

  def setup(self):
    self.embedder = OwnEmbedder()
    self.mlp = nn.Dense(8)

  def __call__(self, tokens):
    return self.embedder.decode(self.mlp(self.embedder(tokens)))


def test_projection_rules_find_a_tied_head_by_what_it_computes():
  tokens = jnp.arange(6).reshape(2, 3)
  qm = fl.quantize_model(TiedLm(), fl.delayed_scaling(), rules=fl.projection_rules())
  v = qm.init(jax.random.key(0), tokens)
  assert list(v[fl.OWG]) == ["mlp"]  # the head (a jnp.dot with the table) stays in float
  assert qm.product_report(v, tokens).counts == {"quantized": 1, "excluded": 1}


def test_products_inside_a_pallas_kernel_are_not_quantized():
  """MaxText's megablox grouped GEMM: tile products inside a Pallas kernel (interpreted off TPU)."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

  class Experts(nn.Module):

    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.normal(), (8, 8))
      y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4, 8), x.dtype),
                         interpret=True)(x, w)
      return nn.Dense(8)(y)

  qm = fl.quantize_model(Experts(), fl.delayed_scaling())
  with pytest.warns(UserWarning, match="inside a Pallas kernel"):
    v = qm.init(jax.random.key(0), X)
  assert list(v[fl.OWG]) == ["Dense_0"]
  counts = qm.product_report(v, X).counts
  assert counts["quantized"] == 1 and "skipped" in counts, counts
  assert qm.apply(v, X).shape == (4, 8)


class ScannedLayers(nn.Module):
  """MaxText's ``scan_layers``: stacked weights, ``jax.lax.scan(jax.checkpoint(layer_fn))``."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (3, 8, 8))

    def layer_fn(h, w_l):
      return h + jax.nn.gelu(jnp.einsum("bd,df->bf", h, w_l)), None

    return jax.lax.scan(jax.checkpoint(layer_fn), x, w)[0]


def test_a_models_own_scan_over_layers_runs_a_stateless_recipe():
  # Per-layer state cannot enter a scan the model wrote itself: stateful
  # recipes are refused there, current scaling without history keeps none.
  qm = fl.quantize_model(ScannedLayers(), fl.delayed_scaling(history_length=4))
  v = qm.init(jax.random.key(0), X)
  with pytest.raises(fl.StateUseError, match="scan"):
    jax.grad(lambda p: jnp.sum(qm.apply(p, X)))(v)

  recipe = fl.current_scaling(history_length=0)
  qm = fl.quantize_model(ScannedLayers(), recipe)
  v = qm.init(jax.random.key(0), X)
  assert set(v) == {"params"}  # nothing to checkpoint or merge
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.sgd(0.1))
  float_params = {"params": v["params"]}
  loss = lambda apply, p: jnp.mean((apply(p, X) - X) ** 2)

  @jax.jit
  def step(state):
    grads = jax.grad(lambda p: loss(state.apply_fn, p))(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(2):
    state = step(state)
  assert qm.product_report(state.params, X).counts == {"quantized": 1}
  # Quantized, not float: the layers' products differ from the float model's.
  y_q, y_f = qm.apply(v, X), ScannedLayers().apply(float_params, X)
  assert not np.allclose(np.asarray(y_q), np.asarray(y_f), atol=1e-6)
  np.testing.assert_allclose(np.asarray(y_q), np.asarray(y_f), rtol=0.1, atol=0.1)
  assert float(loss(qm.apply, state.params)) < float(loss(qm.apply, v))


def test_history_length_zero_is_for_current_scaling_only():
  assert not fl.ScalingConfig(scaling="current", history_length=0).keeps_state
  with pytest.raises(ValueError, match="history_length=0"):
    fl.ScalingConfig(scaling="delayed", history_length=0)


class RaggedMoe(nn.Module):
  """MaxText's ``sparse_matmul`` and gemma's ``MoERagged``: experts as ``jax.lax.ragged_dot``."""

  d: int = 8
  f: int = 16

  @nn.compact
  def __call__(self, x, group_sizes):
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (4, self.d, self.f))
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (4, self.f, self.d))
    h = jax.nn.gelu(jax.lax.ragged_dot(x, w_in, group_sizes))
    return jax.lax.ragged_dot(h, w_out, group_sizes)


ROUTED = jax.random.normal(jax.random.key(3), (12, 8))
GROUPS = jnp.array([3, 0, 5, 4])  # one expert receives no token


def test_moe_experts_as_ragged_dots_are_quantized_and_train():
  qm = fl.quantize_model(RaggedMoe(), fl.delayed_scaling(history_length=4))
  v = qm.init(jax.random.key(0), ROUTED, GROUPS)
  assert qm.product_report(v, ROUTED, GROUPS).counts == {"quantized": 2}
  y_q = qm.apply(v, ROUTED, GROUPS)
  y_f = RaggedMoe().apply({"params": v["params"]}, ROUTED, GROUPS)
  assert not np.allclose(np.asarray(y_q), np.asarray(y_f), atol=1e-6)
  np.testing.assert_allclose(np.asarray(y_q), np.asarray(y_f), atol=0.1)
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-2))
  loss = lambda p: jnp.mean((state.apply_fn(p, ROUTED, GROUPS) - ROUTED) ** 2)

  @jax.jit
  def step(state):
    return state.apply_gradients(grads=jax.grad(loss)(state.params))

  for _ in range(3):
    state = step(state)
  hist = state.params[fl.OWG]["ragged_dot_0"]["input_amax_history"]
  np.testing.assert_allclose(np.asarray(hist[:3]), float(jnp.max(jnp.abs(ROUTED))), rtol=1e-6)
  # The gradient's amax: d loss / d y of the last step, over every routed row.
  p_prev = state.params
  g_out = jax.grad(lambda y: jnp.mean((y - ROUTED) ** 2))(qm.apply(p_prev, ROUTED, GROUPS))
  assert float(state.params[fl.OWG]["ragged_dot_1"]["output_grad_amax_history"][0]) > 0
  assert abs(float(state.params[fl.OWG]["ragged_dot_1"]["output_grad_amax_history"][0])
             - float(jnp.abs(g_out).max())) < 0.5 * float(jnp.abs(g_out).max())
  # One kernel state per expert: each expert's weight measured alone (the expert that
  # received no token too: its weight exists).
  kernel = state.params[fl.OWG]["ragged_dot_0"]
  assert kernel["kernel_scale"].shape == (4, 1) and kernel["kernel_amax_history"].shape == (4, 4)
  w_in = state.params["params"]["w_in"]
  # The history's newest entry is the weight the last step quantized (before its update).
  assert len(set(np.asarray(kernel["kernel_amax_history"][:, 0]).tolist())) == 4
  np.testing.assert_allclose(np.asarray(kernel["kernel_amax_history"][:, 0]),
                             np.abs(np.asarray(w_in)).max(axis=(1, 2)), rtol=0.1)
  # A checkpoint resized to another history length keeps every expert's newest entries.
  resized = fl.resize_histories(state.params, 2)[fl.OWG]["ragged_dot_0"]["kernel_amax_history"]
  chex.assert_trees_all_equal(resized, kernel["kernel_amax_history"][:, :2])


def _int8_fake_quant(x, axis):
  """Symmetric int8 fake quantization in float64: scale max|x| / 127 over ``axis``."""
  x = np.asarray(x, np.float64)
  s = np.abs(x).max(axis=axis, keepdims=True) / 127.0
  return np.clip(np.round(x / s), -128, 127) * s


def _ragged_reference(x, w, group_sizes):
  out, start = np.zeros((x.shape[0], w.shape[2])), 0
  for g, size in enumerate(np.asarray(group_sizes)):
    out[start:start + size] = x[start:start + size] @ w[g]
    start += size
  return out


class _Weight(nn.Module):
  """gemma 4's ``_Weight``: a module that only holds a parameter and returns it."""

  shape: tuple

  @nn.compact
  def __call__(self):
    return self.param("w", nn.initializers.lecun_normal(), self.shape)


class ChildWeightMoe(nn.Module):
  """gemma 4's ``MoERagged``: the experts' weights live in child modules and are
  transposed and reshaped (gate and up fused) before each ``ragged_dot``."""

  d: int = 8
  h: int = 8

  def setup(self):
    self.gating = _Weight((4, 2, self.h, self.d))
    self.linear = _Weight((4, self.h, self.d))

  def __call__(self, x, group_sizes):
    w = jnp.transpose(self.gating(), (0, 3, 1, 2)).reshape(4, self.d, 2 * self.h)
    gate = jax.lax.ragged_dot(x, w, group_sizes).reshape(-1, 2, self.h)
    return jax.lax.ragged_dot(jax.nn.gelu(gate[:, 0]) * gate[:, 1],
                              jnp.swapaxes(self.linear(), 1, 2), group_sizes)


def test_projection_rules_quantize_experts_whose_weights_live_in_child_modules():
  # The module running the products holds no parameter of the experts' shape: a grouped
  # GEMM's experts are its weights however the model holds them.
  qm = fl.quantize_model(ChildWeightMoe(), rules=fl.projection_rules())
  v = qm.init(jax.random.key(0), ROUTED, GROUPS)
  report = qm.product_report(v, ROUTED, GROUPS)
  assert report.counts == {"quantized": 2}, str(report)
  assert set(v[fl.OWG]) == {"ragged_dot_0", "ragged_dot_1"}
  y_q = qm.apply(v, ROUTED, GROUPS)
  y_f = ChildWeightMoe().apply({"params": v["params"]}, ROUTED, GROUPS)
  assert not np.allclose(np.asarray(y_q), np.asarray(y_f), atol=1e-6)
  np.testing.assert_allclose(np.asarray(y_q), np.asarray(y_f), atol=0.1)


def test_moe_experts_with_an_integer_recipe_are_fake_quantized_per_expert_channel():
  recipe = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
  qm = fl.quantize_model(RaggedMoe(), recipe)
  v = qm.init(jax.random.key(0), ROUTED, GROUPS)
  assert qm.product_report(v, ROUTED, GROUPS).counts == {"quantized": 2}
  # The first grouped GEMM against a float64 reference: the routed rows per tensor
  # (the observer's range is this batch's), each expert's output channels their own scale.
  w_in = np.asarray(v["params"]["w_in"])
  ref = _ragged_reference(_int8_fake_quant(ROUTED, None), _int8_fake_quant(w_in, 1), GROUPS)

  class First(nn.Module):
    @nn.compact
    def __call__(self, x, group_sizes):
      w = self.param("w_in", nn.initializers.lecun_normal(), (4, 8, 16))
      return jax.lax.ragged_dot(x, w, group_sizes)

  first = fl.quantize_model(First(), recipe)
  fv = first.init(jax.random.key(0), ROUTED, GROUPS)
  y = np.asarray(first.apply(fv, ROUTED, GROUPS))
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  per_tensor = _ragged_reference(_int8_fake_quant(ROUTED, None),
                                 _int8_fake_quant(w_in, None), GROUPS)
  assert np.abs(y - per_tensor).max() > 1e-4  # the channel scales are the experts' own
  # It trains: the observer range follows the routed rows, the loss goes down.
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-2))
  loss = lambda p: jnp.mean((state.apply_fn(p, ROUTED, GROUPS) - ROUTED) ** 2)
  step = jax.jit(lambda st: st.apply_gradients(grads=jax.grad(loss)(st.params)))
  before = float(loss(state.params))
  for _ in range(3):
    state = step(state)
  assert float(loss(state.params)) < before
  rng = np.asarray(state.params[fl.OWG]["ragged_dot_0"]["input_range"])
  np.testing.assert_allclose(rng, [-ROUTED.min(), ROUTED.max()], rtol=1e-6)


def test_moe_experts_train_with_integer_gradients(jaxpr_eqns):
  recipe = fl.IntRecipe(grad_bits=8, gemm="int8",
                        kernel=fl.IntQuantConfig(granularity="channel"))
  qm = fl.quantize_model(RaggedMoe(), recipe)
  v = jax.jit(qm.init)(jax.random.key(0), ROUTED, GROUPS)
  assert qm.product_report(v, ROUTED, GROUPS).counts == {"quantized": 2}
  loss = lambda p: jnp.mean((qm.apply(p, ROUTED, GROUPS) - ROUTED) ** 2)
  # Each expert layer: forward, dgrad and wgrad all int8 x int8 grouped GEMMs.
  eqns = jaxpr_eqns(jax.make_jaxpr(jax.grad(loss))(v))
  ragged = [e for e in eqns if e.primitive.name.startswith("ragged_dot")]
  assert len(ragged) == 6 and all(str(x.aval.dtype) == "int8" for e in ragged
                                  for x in e.invars[:2]), [e.invars[:2] for e in ragged]
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-2))
  step = jax.jit(lambda st: st.apply_gradients(grads=jax.grad(loss)(st.params)))
  before = float(loss(state.params))
  for _ in range(3):
    state = step(state)
  assert float(loss(state.params)) < before


def test_moe_experts_with_integer_gradients_they_cannot_take_say_they_run_in_float():
  # LSQ experts are fake-quantized (float gradients): grad_bits cannot be honoured.
  qm = fl.quantize_model(RaggedMoe(), dataclasses.replace(fl.int8_lsq(), grad_bits=8))
  with pytest.warns(UserWarning, match="ragged_dot .* runs unquantized: grad_bits=8 needs the "
                                       "integer grouped GEMM"):
    v = qm.init(jax.random.key(0), ROUTED, GROUPS)
    report = qm.product_report(v, ROUTED, GROUPS)
  assert report.counts == {"skipped": 2}


def test_trained_fp8_experts_serve_as_their_frozen_qat_forward():
  qm = fl.quantize_model(RaggedMoe(), fl.delayed_scaling(history_length=4))
  v = qm.init(jax.random.key(0), ROUTED, GROUPS)
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-2))
  loss = lambda p: jnp.mean((state.apply_fn(p, ROUTED, GROUPS) - ROUTED) ** 2)
  step = jax.jit(lambda st: st.apply_gradients(grads=jax.grad(loss)(st.params)))
  for _ in range(2):
    state = step(state)
  served, params = fl.convert(qm, state.params, ROUTED, GROUPS)
  # The experts' weights are stored as e4m3 codes, each expert with its trained scale; the
  # module's own code reads them as the float32 it saw in training.
  site = params["params"]["ragged_dot_0"]
  assert set(site) == {"input_scale", "kernel_scale"} and fl.OWG not in params
  assert site["kernel_scale"].shape == (4, 1)
  assert params["params"]["w_in"].dtype == jnp.float8_e4m3fn
  assert fl.weight_bytes(params) < fl.weight_bytes(state.params["params"]) / 3

  @jax.jit
  def frozen(p, x, g):
    with fl.frozen_quantizers():
      return qm.apply(p, x, g)

  y_served = jax.jit(served.apply)(params, ROUTED, GROUPS)
  chex.assert_trees_all_equal(y_served, frozen(state.params, ROUTED, GROUPS))
  y_float = RaggedMoe().apply({"params": state.params["params"]}, ROUTED, GROUPS)
  assert not np.array_equal(np.asarray(y_served), np.asarray(y_float))  # fp8, not float


def test_trained_int8_experts_serve_as_their_frozen_qat_forward():
  qm = fl.quantize_model(RaggedMoe(), fl.IntRecipe(kernel=fl.IntQuantConfig(
      granularity="channel")))
  v = qm.init(jax.random.key(0), ROUTED, GROUPS)
  state = fl.TrainState.create(apply_fn=qm.apply, params=v, tx=optax.adam(1e-2))
  loss = lambda p: jnp.mean((state.apply_fn(p, ROUTED, GROUPS) - ROUTED) ** 2)
  state = jax.jit(lambda st: st.apply_gradients(grads=jax.grad(loss)(st.params)))(state)
  served, params = fl.convert(qm, state.params, ROUTED, GROUPS)
  # int8 codes per expert and output channel, folded once.
  assert set(params["params"]["ragged_dot_0"]) == {"input_scale", "kernel_scale"}
  assert params["params"]["ragged_dot_0"]["kernel_scale"].shape == (4, 1, 16)
  assert params["params"]["w_in"].dtype == jnp.int8

  @jax.jit
  def frozen(p, x, g):
    with fl.frozen_quantizers():
      return qm.apply(p, x, g)

  chex.assert_trees_all_equal(jax.jit(served.apply)(params, ROUTED, GROUPS),
                              frozen(state.params, ROUTED, GROUPS))
  # Fake-quantized experts (LSQ, asymmetric) cannot be converted: said, naming the product.
  qa = fl.quantize_model(RaggedMoe(), fl.IntRecipe(input=fl.IntQuantConfig(symmetric=False)))
  va = qa.init(jax.random.key(0), ROUTED, GROUPS)
  va = jax.jit(lambda p: fl.merge_owg(p, jax.grad(lambda q: qa.apply(q, ROUTED, GROUPS).sum())(
      p)))(va)
  with pytest.raises(ValueError, match="ragged_dot_0: integer experts .* cannot be converted"):
    fl.convert(qa, va, ROUTED, GROUPS)


@pytest.mark.parametrize("target,recipe,expected", [
    ("h100", fl.delayed_scaling(history_length=4), {"fp8": 2}),
    ("tpu-v6e", fl.IntRecipe(gemm="int8"), {"int8": 2}),
], ids=["h100-fp8", "tpu-v6e-int8"])
def test_served_experts_multiply_low_precision_codes(require_target, target, recipe, expected):
  t = require_target(target)
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel
  qm = fl.quantize_model(RaggedMoe(), recipe)
  v = qm.init(jax.random.key(0), ROUTED, GROUPS)
  v = fl.merge_owg(v, jax.grad(lambda p: qm.apply(p, ROUTED, GROUPS).sum())(v))  # trained state
  served, params = fl.convert(qm, v, ROUTED, GROUPS)
  report = compile_for(t, served.apply, params, ROUTED.astype(jnp.bfloat16), GROUPS)
  assert report.classes == expected, report.classes


def _h100_moe_step(moe):
  """An expert layer's training step through quantize_model, compiled for an H100."""
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel
  qm = fl.quantize_model(moe, fl.delayed_scaling(history_length=4))
  x = jax.random.normal(jax.random.key(4), (64, 32), jnp.bfloat16)
  gs = np.array([16, 0, 32, 16], np.int32)
  v = qm.init(jax.random.key(0), x, gs)
  step = lambda v, x: jax.value_and_grad(
      lambda v: jnp.sum(jnp.square(qm.apply(v, x, gs).astype(jnp.float32))))(v)
  return compile_for("h100", step, v, x)


def test_a_quantized_moe_trains_in_the_gpu_grouped_kernels(require_target):
  """quantize_model's experts on an H100 (compile only): every grouped GEMM of the step in
  the library's kernels, each routed row multiplied by its own expert only."""
  require_target("h100")
  report = _h100_moe_step(RaggedMoe(d=32, f=64))
  kinds = sorted((p.kind, p.operands[0]) for p in report.product_list)
  # Two forwards on e4m3 codes; two wgrads and the second expert layer's dgrad (e5m2 x
  # e4m3, float16 in the kernel); the input needs no gradient.
  assert kinds == sorted([("pallas-grouped-gemm", "f8e4m3fn")] * 2
                         + [("pallas-grouped-gemm", "f16")] * 3), kinds


class BfloatRaggedMoe(nn.Module):
  """RaggedMoe computing in bfloat16 over float32 weights, as MaxText's MoE casts them."""

  @nn.compact
  def __call__(self, x, group_sizes):
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (4, 32, 64))
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (4, 64, 32))
    h = jax.nn.gelu(jax.lax.ragged_dot(x, w_in.astype(jnp.bfloat16), group_sizes))
    return jax.lax.ragged_dot(h, w_out.astype(jnp.bfloat16), group_sizes)


def test_bfloat16_experts_write_their_weight_gradients_in_bfloat16(require_target):
  """The experts' wgrad kernels write the model's bfloat16, as its dense layers' GEMMs do
  (H100, compile only): an optimizer's update fuses the cast to the float32 parameters.
  ``rhs_grad_dtype`` of ``fl.fp8_ragged_dot`` is what writes float32 there."""
  require_target("h100")
  report = _h100_moe_step(BfloatRaggedMoe())
  outs = sorted((p.kind, p.out) for p in report.product_list)
  # Two forwards, one dgrad and the two experts' wgrads, all five in the library's kernels.
  assert outs == [("pallas-grouped-gemm", "bf16")] * 5, outs
  # Told the parameters' dtype, the op's wgrad kernel writes it and no pass casts.
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel
  st = lambda shape: fl.RoleState(jnp.ones(shape), jnp.zeros(shape[:-1] + (4,)))
  x = jax.random.normal(jax.random.key(4), (64, 32), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(5), (4, 32, 64), jnp.float32)
  gs = np.array([16, 0, 32, 16], np.int32)

  def loss(w, x):
    y, _ = fl.fp8_ragged_dot(x, w.astype(jnp.bfloat16), gs, input_state=st((1,)),
                             kernel_state=st((4, 1)), output_grad_state=st((1,)),
                             rhs_grad_dtype=jnp.float32)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))

  report = compile_for("h100", jax.value_and_grad(loss, argnums=(0, 1)), w, x)
  outs = sorted(p.out for p in report.product_list)
  assert outs == ["bf16", "bf16", "f32"], outs


class OwnWeights(nn.Module):
  """Weights of a module's own code that a served product may, or may not, store as codes."""

  @nn.compact
  def __call__(self, x):
    dn = (((1,), (0,)), ((), ()))
    w = {n: self.param(n, nn.initializers.normal(0.2), (8, 8))
         for n in ("shared", "wq", "wk", "wt")}
    w3 = self.param("w3", nn.initializers.normal(0.2), (2, 4, 8))
    h = jax.lax.dot_general(x, w["shared"], dn)                           # read twice
    h = h + jax.lax.dot_general(h, w["shared"].astype(jnp.bfloat16), dn).astype(h.dtype)
    h = h + jax.lax.dot_general(h, w["wq"].astype(jnp.bfloat16), dn).astype(h.dtype)
    h = h + jax.lax.dot_general(h, w["wk"].astype(jnp.bfloat16).astype(jnp.float32), dn)
    h = h + jax.lax.dot_general(h, w["wt"].T, dn)                         # transposed
    return h + jnp.einsum("bk,kn->bn", h, w3.reshape(8, 8))               # reshaped


@pytest.mark.parametrize("recipe", [fl.IntRecipe(), fl.Fp8Recipe()], ids=["int8", "fp8"])
def test_convert_stores_a_weight_one_product_reads_through_casts_and_reshapes_as_codes(recipe):
  qm = fl.quantize_model(OwnWeights(), recipe)
  x = jax.random.normal(jax.random.key(1), (16, 8))
  v = qm.init(jax.random.key(0), x)
  v = fl.merge_owg(v, jax.grad(lambda p: qm.apply(p, x).sum())(v))  # trained state
  # Each call site's state and name scope are its own: the report names them.
  sites = [p.scope.split("/")[-2] for p in qm.product_report(v, x).products]
  assert sites == [f"dot_general_{i}" for i in range(5)] + ["einsum_0"], sites
  served, params = fl.convert(qm, v, x)
  codes = jnp.int8 if isinstance(recipe, fl.IntRecipe) else jnp.float8_e4m3fn
  stored = {k: a.dtype for k, a in params["params"].items() if not isinstance(a, dict)}
  # A weight read by two products, one the module rounds first (bf16 then f32: no longer
  # the weight) and a transposed one stay float, quantized at each call.
  assert stored == {"shared": jnp.float32, "wq": codes, "wk": jnp.float32,
                    "wt": jnp.float32, "w3": codes}, stored
  assert set(params["params"]["dot_general_2"]) == {"input_scale", "kernel_scale"}

  @jax.jit
  def frozen(p, x):
    with fl.frozen_quantizers():
      return qm.apply(p, x)

  y_served = jax.jit(served.apply)(params, x)
  chex.assert_trees_all_equal(y_served, frozen(v, x))
  # QLoRA: adapters beside the weights stored as codes; the merge writes each one back as
  # float in its own place (zero adapters: the dequantized codes, which the QAT model
  # computes exactly as served).
  adapters, rest = fl.split_lora(fl.add_lora(served, params, x, rank=2))
  assert sorted(adapters["params"]) == ["dot_general_2", "einsum_0"]
  merged = fl.merge_lora(served, fl.join_lora(adapters, rest), x)["params"]
  assert {merged[k].dtype for k in stored} == {jnp.dtype(jnp.float32)}
  chex.assert_trees_all_equal(frozen({**v, "params": {**v["params"], **{
      k: merged[k] for k in stored}}}, x), y_served)
