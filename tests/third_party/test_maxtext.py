"""quantize_model on MaxText's own models (MaxText 0.2.5, the ``maxtext`` package).

MaxText needs Python 3.12 and declares its dependencies only under its
``cuda12``/``tpu`` extras, so this runs where it is installed by hand (the wheel
with ``--no-deps`` plus the few packages its model code imports), not in CI's
Python 3.11. Tiny random-init configs (nothing downloaded), built by MaxText's
own ``pyconfig`` from its ``base.yml`` and model files, on MaxText's default
mesh (every axis of size 1 on one CPU device):

* Mixtral (``mixtral-8x7b.yml``): each layer's four experts run as
  ``jax.lax.ragged_dot`` (``sparse_matmul=True``, ``megablox=False``) inside
  MaxText's ``jax.shard_map``; the model is MaxText's Linen face,
  ``transformer_as_linen`` (an NNX ``Transformer`` under its ``ToLinen``
  bridge, whose scope path is extended in place while each submodule runs).
* Llama 2 (``llama2-7b.yml``): dense, through the same Linen bridge.
* Llama 2 as MaxText's NNX ``Transformer`` (its NNX ``DenseGeneral``
  projections, ``NNXDecoder``) through ``fl.nnx.quantize_model``.

Layers unscanned (``scan_layers=False``); float32 activations.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import fp8_linen as fl

pytest.importorskip("maxtext", reason="MaxText 0.2.5 (Python 3.12, installed by hand)")
from flax import nnx  # noqa: E402  pylint: disable=g-import-not-at-top
from maxtext.configs import pyconfig  # noqa: E402  pylint: disable=g-import-not-at-top
from maxtext.models import models  # noqa: E402  pylint: disable=g-import-not-at-top
from maxtext.utils import maxtext_utils  # noqa: E402  pylint: disable=g-import-not-at-top

# MaxText's ToLinen warns on every apply that the fp8 state's paths are not its NNX
# module's (it leaves them to the Linen scope, where fp8_linen keeps them).
pytestmark = pytest.mark.filterwarnings("ignore:Found unknown module paths:UserWarning")

B, L, VOCAB = 2, 16, 256  # the vocabulary unlike any projection's shape (64 x 128)
TOKENS = jax.random.randint(jax.random.key(0), (B, L + 1), 1, VOCAB)
INPUTS, TARGETS = TOKENS[:, :-1], TOKENS[:, 1:]
ARGS = (INPUTS, jnp.broadcast_to(jnp.arange(L), (B, L)), jnp.ones((B, L), jnp.int32))
PROJECTIONS = ("query", "key", "value", "out", "wi_0", "wi_1", "wo")


def _projection_paths(suffix=""):
  """The two layers' attention and MLP projections (MaxText's module paths)."""
  return {f"decoder/layers_{i}/{'self_attention' if j < 4 else 'mlp'}/{name}{suffix}"
          for i in range(2) for j, name in enumerate(PROJECTIONS)}


def _config(model_name, out_dir, **overrides):
  """A tiny config of MaxText's model file ``model_name`` and its mesh."""
  base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  config = pyconfig.initialize(
      ["", base], model_name=model_name, override_model_config=True,
      run_name="fp8_linen", base_output_directory=str(out_dir), enable_checkpointing=False,
      jax_cache_dir="",  # base.yml turns on a persistent compilation cache in ~/jax_cache
      hardware="cpu", skip_jax_distributed_system=True, dataset_type="synthetic",
      base_emb_dim=64, base_num_query_heads=2, base_num_kv_heads=1, head_dim=32,
      base_mlp_dim=128, base_num_decoder_layers=2, vocab_size=VOCAB,
      per_device_batch_size=B, max_target_length=L, attention="dot_product",
      dtype="float32", weight_dtype="float32", enable_dropout=False,
      **{"scan_layers": False, **overrides})
  # MaxText's mesh on one device (every axis of size 1), as on a one-device host; the
  # test session has 8 virtual CPU devices (tests/conftest.py).
  return config, maxtext_utils.get_mesh_from_config(config, jax.devices()[:1])


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  return _config("mixtral-8x7b", tmp_path_factory.mktemp("maxtext"), base_moe_mlp_dim=128,
                 num_experts=4, num_experts_per_tok=2, sparse_matmul=True, megablox=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  return _config("llama2-7b", tmp_path_factory.mktemp("maxtext"))


def _loss(logits):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), TARGETS).mean()


def _train(apply, variables, steps):
  """Adam steps with fl.TrainState; the losses and the state after the first step."""
  state = fl.TrainState.create(apply_fn=apply, params=variables, tx=optax.adam(3e-3))

  def step(state):
    loss, g = jax.value_and_grad(
        lambda p: _loss(state.apply_fn(p, *ARGS, enable_dropout=False)))(state.params)
    return state.apply_gradients(grads=g), loss

  # Compiled once: MaxText places the new state on its mesh, which a jitted step would
  # see as new input shardings and compile again.
  step = jax.jit(step).lower(state).compile()
  losses, first = [], None
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
    first = state if first is None else first
  return np.array(losses), first


def _init(qm):
  return jax.jit(lambda: qm.init(jax.random.key(1), *ARGS, enable_dropout=False))()


def test_mixtral_experts_quantized_and_training_tracks_float(mixtral):
  config, mesh = mixtral
  model = models.transformer_as_linen(config, mesh, quant=None)
  qm = fl.quantize_model(model, fl.current_scaling(), rules=fl.projection_rules())
  qv = _init(qm)
  assert set(qv) == {"params", fl.OWG}  # the float model's params, and the fp8 state

  report = qm.product_report(qv, *ARGS, enable_dropout=False)
  experts = [p for p in report.products if p.primitive == "ragged_dot_general"]
  # Two layers, each three grouped GEMMs (wi_0, wi_1, wo), every one quantized.
  assert len(experts) == 6 and all(p.status == "quantized" for p in experts), str(report)
  assert not report.unquantized or all(p.status == "excluded" for p in report.unquantized)
  # The attention around the experts: each layer's query, key, value and out
  # projections (MaxText's DenseGeneral) are one product each at their own module
  # path, all quantized; the attention math between them (attention_op's two
  # einsums) is not a projection and stays in float.
  attention = sorted(p for p in _projection_paths() if "/self_attention/" in p)
  # (A float product's scope ends at the module's path, a quantized one's goes on
  # into its call site.)
  projections = {path: [p for p in report.products if f"/{path}/" in p.scope + "/"]
                 for path in attention}
  assert len(attention) == 8 and all(
      [(p.primitive, p.status) for p in ps] == [("dot_general", "quantized")]
      for ps in projections.values()), str(report)
  # Per layer those 4, the router's gate and the 3 grouped GEMMs, and the head; kept:
  # the attention math (2 per layer), the RMSNorm scales (2 per layer and the final
  # one) and the MoE's weighted sum of the experts' outputs (1 per layer).
  assert report.counts == {"quantized": 17, "excluded": 11}, str(report)
  # One state per call site at the MoE block's path inside MaxText's bridge, each
  # expert's weight with a scale of its own.
  flat = traverse_util.flatten_dict(qv[fl.OWG])
  scales = {"/".join(k[:-1]): a.shape for k, a in flat.items()
            if k[-1] == "kernel_scale" and k[-2].startswith("ragged_dot")}
  assert scales == {f"decoder/layers_{i}/MoeBlock_0/ragged_dot_{j}": (4, 1)
                    for i in range(2) for j in range(3)}, scales
  # And one per attention projection, at the projection's own path (as in the Llama
  # tests), its weight with a single scale.
  scales = {"/".join(k[:-1]): a.shape for k, a in flat.items()
            if k[-1] == "kernel_scale" and "self_attention" in k}
  assert scales == {f"{path}/dot_general_0": (1,) for path in attention}, scales

  float_losses, _ = _train(model.apply, {"params": qv["params"]}, steps=3)
  q_losses, first = _train(qm.apply, qv, steps=3)
  assert q_losses[-1] < q_losses[0] - 1.0
  np.testing.assert_allclose(q_losses, float_losses, rtol=0.05)
  assert not np.array_equal(q_losses[1:], float_losses[1:])
  # The experts' state, written inside MaxText's shard_map, reaches the TrainState: the
  # first step recorded each expert's own amax of the weights it multiplied.
  params = qv["params"]["decoder"]
  for i in range(2):
    moe = params[f"layers_{i}"]["MoeBlock_0"]
    for j, name in enumerate(("wi_0", "wi_1", "wo")):
      w = np.asarray(moe[name].unbox() if hasattr(moe[name], "unbox") else moe[name])
      hist = first.params[fl.OWG]["decoder"][f"layers_{i}"]["MoeBlock_0"][f"ragged_dot_{j}"]
      np.testing.assert_allclose(np.asarray(hist["kernel_amax_history"])[:, 0],
                                 np.abs(w).max(axis=(1, 2)), rtol=1e-2)


def _path_rules():
  return (fl.QuantizationRule(module_path=".*/(" + "|".join(PROJECTIONS) + ")"),
          fl.QuantizationRule(module_path=".*", quantize=False))


def test_llama_projections_quantized_and_training_tracks_float(llama):
  config, mesh = llama
  model = models.transformer_as_linen(config, mesh, quant=None)
  qm = fl.quantize_model(model, fl.current_scaling(), rules=_path_rules())
  qv = _init(qm)
  report = qm.product_report(qv, *ARGS, enable_dropout=False)
  # Per layer q, k, v, attention output and the MLP's three; kept: the attention math
  # (2 per layer), the RMSNorm scales (2 per layer and the final one) and the head.
  assert report.counts == {"quantized": 14, "excluded": 10}, str(report)
  sites = {"/".join(k[:-2]) for k in traverse_util.flatten_dict(qv[fl.OWG])}
  assert sites == _projection_paths(), sites

  float_losses, _ = _train(model.apply, {"params": qv["params"]}, steps=3)
  q_losses, _ = _train(qm.apply, qv, steps=3)
  assert q_losses[-1] < q_losses[0] - 1.0
  np.testing.assert_allclose(q_losses, float_losses, rtol=0.05)
  assert not np.array_equal(q_losses[1:], float_losses[1:])


def test_llama_projection_rules_find_the_projections(llama):
  """The bridge holds each DenseGeneral's kernel at the sub-path it runs the submodule at.

  The untied head (``logits_dense``) is quantized too: MaxText's ``Embed`` runs
  as NNX inside the bridge, so no vocabulary table is noted to tell it by; a
  rule for its path keeps it in float.
  """
  config, mesh = llama
  model = models.transformer_as_linen(config, mesh, quant=None)
  for rules, counts in (
      (fl.projection_rules(), {"quantized": 15, "excluded": 9}),
      ((fl.QuantizationRule(module_path=".*logits_dense", quantize=False),
        *fl.projection_rules()), {"quantized": 14, "excluded": 10})):
    qm = fl.quantize_model(model, rules=rules)
    qv = jax.eval_shape(lambda qm=qm: qm.init(jax.random.key(1), *ARGS, enable_dropout=False))
    report = qm.product_report(qv, *ARGS, enable_dropout=False)
    assert report.counts == counts, str(report)
    state = {"/".join(k[:-2]) for k in traverse_util.flatten_dict(qv[fl.OWG])}
    want = {f"decoder/layers_{i}/{p}" for i in range(2) for p in (
        "self_attention/query", "self_attention/key", "self_attention/value",
        "self_attention/out", "mlp/wi_0", "mlp/wi_1", "mlp/wo")}
    assert state - {"decoder/logits_dense"} == want, sorted(state)


def test_nnx_llama_projections_quantized_and_trains(llama):
  config, mesh = llama
  model = models.Transformer(config, mesh, quant=None, rngs=nnx.Rngs(params=1, dropout=2))
  param = model.decoder.layers_0.mlp.wi_0.kernel
  kernel = param[...]
  with pytest.warns(UserWarning, match="never reach the interception"):
    # MaxText's AttentionOp binds jnp.einsum when it is built (self.AqtEinsum_0 =
    # jnp.einsum): its attention math is reported, unquantized, as unseen.
    qmodel = fl.nnx.quantize_model(model, fl.current_scaling(), rules=fl.projection_rules(),
                                   example=ARGS)
  report = fl.nnx.product_report(qmodel, *ARGS)
  assert report.counts == {"quantized": 14, "excluded": 6, "unseen": 4}, str(report)
  quantized = {p.scope for p in report.products if p.status == "quantized"}
  assert quantized == _projection_paths("/dot_general_0"), quantized
  assert any(p.status == "excluded" and p.scope == "decoder/logits_dense"
             for p in report.products)
  # The copy runs on the very same parameters.
  assert qmodel.decoder.layers_0.mlp.wi_0.kernel is param

  optimizer = fl.nnx.Optimizer(qmodel, optax.adam(3e-3))
  graphdef, state = nnx.split((qmodel, optimizer))

  def step(state):
    m, opt = nnx.merge(graphdef, state)
    loss, grads = fl.nnx.value_and_grad(lambda m: _loss(m(*ARGS, enable_dropout=False)))(m)
    opt.update(m, grads)
    return nnx.state((m, opt)), loss

  step = jax.jit(step).lower(state).compile()  # once (see _train)
  site = qmodel.decoder.layers_0.mlp.wi_0.dot_general_0
  assert not np.asarray(site.kernel_amax_history[...]).any()
  losses = []
  for _ in range(2):
    state, loss = step(state)
    losses.append(float(loss))
  nnx.update((qmodel, optimizer), state)
  assert losses[1] < losses[0]
  # The product's state, written by fl.nnx.Optimizer: the amax of the kernel each step saw.
  hist = np.asarray(site.kernel_amax_history[...])
  np.testing.assert_allclose(hist[1], np.abs(np.asarray(kernel)).max(), rtol=1e-2)
  assert hist[0] > 0 and hist[0] != hist[1]
  assert not np.array_equal(np.asarray(param[...]), np.asarray(kernel))


def test_nnx_scanned_llama_keeps_a_state_per_layer(tmp_path):
  """MaxText's default scan_layers: parameters stacked on axis 1 (param_scan_axis), the
  rest of the layers' state on axis 0, run by a raw jax.lax.scan."""
  config, mesh = _config("llama2-7b", tmp_path, scan_layers=True, param_scan_axis=1)
  model = models.Transformer(config, mesh, quant=None, rngs=nnx.Rngs(params=1, dropout=2))
  with pytest.warns(UserWarning, match="never reach the interception"):
    qmodel = fl.nnx.quantize_model(model, rules=fl.projection_rules(), example=ARGS)
  report = fl.nnx.product_report(qmodel, *ARGS)
  # The scan body's 7 projections, traced once for both layers.
  assert report.counts == {"quantized": 7, "excluded": 4, "unseen": 2}, str(report)
  sites = [s for _, s in nnx.iter_graph(qmodel) if isinstance(s, fl.nnx.ProductSite)]
  assert len(sites) == 7 and all(s.kernel_amax_history[...].shape[0] == 2 for s in sites)
