"""quantize_model on unmodified Linen models written by other teams.

Models come from two libraries we do not control, in tiny configs with random
init (nothing is downloaded): transformers' Flax GPT-2 (tied head through a
nested ``apply``), BERT (built-in gradient checkpointing, tied MLM decoder) and
Llama (grouped-query attention, untied head), plus transformers' own GPT-2 block
scanned and rematerialized by user code; and jax-resnet's ResNet (BatchNorm,
convolutions, its blocks wrapped in ``nn.remat`` here).

For each model, written as a user would: the params tree is the unmodified
model's, every product is accounted for (quantized, excluded by a rule, or a
documented warning: nothing silently unquantized), the forward is close to the
float model's, and a few optax steps with ``fl.TrainState`` lower the loss like
float's.
"""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_resnet import ResNet, ResNetBlock
from transformers import (BertConfig, FlaxBertForMaskedLM, FlaxGPT2LMHeadModel,
                          FlaxLlamaForCausalLM, GPT2Config, LlamaConfig)
from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Block

import fp8_linen as fl

# Unlike every other width below: projection_rules() finds the logits head by
# the vocabulary table's shape.
VOCAB = 100
SEQ = 12
STEPS = 6
RECIPE = fl.Fp8Recipe()   # delayed scaling, what a user gets by default
# e4m3 keeps 3 mantissa bits: each quantized operand is off by up to 2**-4
# (about 2% rms), and a forward chains several quantized products.
PARITY = 0.08


def tokens_with_structure(key, batch=8, length=SEQ + 1):
  """Random tokens where every odd position is the previous token + 1 (learnable)."""
  t = jax.random.randint(key, (batch, length), 0, VOCAB)
  return t.at[:, 1::2].set((t[:, 0::2][:, :length // 2] + 1) % VOCAB)


def rel_err(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def train(apply_fn, variables, loss_of, steps=STEPS, lr=3e-3, mutable=()):
  """``steps`` adam steps with fl.TrainState; returns the losses.

  ``mutable``: collections the forward updates (BatchNorm's ``batch_stats``),
  written back after each step as in any flax training loop.
  """
  def loss_fn(v):
    if mutable:
      out, updates = apply_fn(v, mutable=list(mutable))
      return loss_of(out), updates
    return loss_of(apply_fn(v)), {}

  @jax.jit
  def step(state):
    (loss, updates), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=g)
    return state.replace(params={**state.params, **updates}), loss

  state = fl.TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.adam(lr))
  losses = []
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
  return np.array(losses)


def check_model(module, args, kwargs, *, outputs, counts, projection_counts, loss_of,
                parity, mutable=(), rules=None, loss_rtol=0.02):
  """The checks every model gets (see the module doc).

  Args:
    module: the unmodified Linen module.
    args, kwargs: its forward arguments.
    outputs: ``y -> array`` (the logits of the model's output object).
    counts: the product report under the default rules (quantize everything).
    projection_counts: the report under the rules trained with.
    loss_of: ``output -> scalar loss``.
    parity: largest relative error of the quantized forward against float.
    mutable: collections the training forward updates.
    rules: the rules to train with (default ``fl.projection_rules()``).
    loss_rtol: how close the quantized loss curve is to float's.

  Returns:
    The quantized model's initial variables.
  """
  rng = jax.random.key(0)
  qm_all = fl.quantize_model(module, RECIPE)
  qm = fl.quantize_model(module, RECIPE, rules or fl.projection_rules())
  with warnings.catch_warnings():
    # Nothing silently unquantized: a product the interception cannot see (init
    # checks), or one it had to leave unquantized, would warn here.
    warnings.simplefilter("error", UserWarning)
    v_all = jax.eval_shape(lambda r: qm_all.init(r, *args, **kwargs), rng)  # traced only
    v = jax.jit(lambda r: qm.init(r, *args, **kwargs))(rng)
  vf = {k: c for k, c in v.items() if k != fl.OWG}
  # The params tree (and every other collection, e.g. batch_stats) is the
  # unmodified model's: its checkpoints load as they are.
  plain = jax.eval_shape(lambda r: module.init(r, *args, **kwargs), rng)
  for w in (v, v_all):
    assert jax.tree.map(jnp.shape, {k: c for k, c in w.items() if k != fl.OWG}) == \
        jax.tree.map(jnp.shape, plain)
  # Every product accounted for.
  assert qm_all.product_report(v_all, *args, **kwargs).counts == counts
  report = qm.product_report(v, *args, **kwargs)
  assert report.counts == projection_counts, str(report)
  # Forward close to float.
  y = outputs(jax.jit(lambda v: qm.apply(v, *args, **kwargs))(v))
  yf = outputs(jax.jit(lambda v: module.apply(v, *args, **kwargs))(vf))
  assert rel_err(y, yf) < parity, rel_err(y, yf)
  # Training: the quantized loss falls like float's.
  call = lambda apply: (lambda v, **kw: apply(v, *args, **kwargs, **kw))
  q_losses = train(call(qm.apply), v, loss_of, mutable=mutable)
  f_losses = train(call(module.apply), vf, loss_of, mutable=mutable)
  assert f_losses[-1] < f_losses[0] - 0.1, f_losses
  assert q_losses[-1] < q_losses[0] - 0.1, q_losses
  np.testing.assert_allclose(q_losses, f_losses, rtol=loss_rtol)
  return v


def lm_loss(labels):
  return lambda out: optax.softmax_cross_entropy_with_integer_labels(
      out.logits if hasattr(out, "logits") else out, labels).mean()


# ----------------------------------------------------------------------------
# transformers (Flax): GPT-2, BERT, Llama.
# ----------------------------------------------------------------------------


def lm_inputs():
  t = tokens_with_structure(jax.random.key(3))
  ids, labels = t[:, :-1], t[:, 1:]
  mask = jnp.ones_like(ids)
  pos = jnp.broadcast_to(jnp.arange(SEQ), ids.shape)
  return ids, labels, mask, pos


def test_gpt2_lm_head_model_tied_head():
  """GPT-2's lm_head is a Dense applied inside the model with the embedding
  (``self.lm_head.apply({'params': {'kernel': wte.T}}, h)``)."""
  cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2)
  module = FlaxGPT2LMHeadModel(cfg, _do_init=False).module
  ids, labels, mask, pos = lm_inputs()
  v = check_model(module, (ids, mask, pos), {}, outputs=lambda o: o.logits,
                  counts={"quantized": 13},   # 2 x (c_attn, q.k, p.v, c_proj, c_fc, c_proj) + head
                  projection_counts={"quantized": 8, "excluded": 5},
                  loss_of=lm_loss(labels), parity=PARITY)
  assert sorted(v[fl.OWG]["transformer"]["h"]["0"]) == ["attn", "mlp"]
  assert "lm_head" not in v[fl.OWG]


def test_bert_masked_lm_with_gradient_checkpointing():
  cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=16)
  module = FlaxBertForMaskedLM(cfg, _do_init=False, gradient_checkpointing=True).module
  ids, _, mask, pos = lm_inputs()
  v = check_model(module, (ids, mask, jnp.zeros_like(ids), pos, None), {},
                  outputs=lambda o: o.logits,
                  counts={"quantized": 18},   # 2 x (q, k, v, q.k, p.v, out, up, down) + 2 head
                  projection_counts={"quantized": 13, "excluded": 5},
                  loss_of=lm_loss(ids), parity=PARITY)
  assert "kernel_scale" in v[fl.OWG]["bert"]["encoder"]["layer"]["0"]["intermediate"]["dense"]
  assert "decoder" not in v[fl.OWG]["cls"]["predictions"]


def test_llama_grouped_query_attention_untied_head():
  cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
  module = FlaxLlamaForCausalLM(cfg, _do_init=False).module
  ids, labels, mask, pos = lm_inputs()
  v = check_model(module, (ids, mask, pos), {}, outputs=lambda o: o.logits,
                  counts={"quantized": 19},   # 2 x (q, k, v, q.k, p.v, o, gate, up, down) + head
                  projection_counts={"quantized": 14, "excluded": 5},
                  loss_of=lm_loss(labels), parity=PARITY)
  attn = v[fl.OWG]["model"]["layers"]["0"]["self_attn"]
  assert sorted(attn) == ["k_proj", "o_proj", "q_proj", "v_proj"]


class _GPT2Layer(nn.Module):
  config: Any

  @nn.compact
  def __call__(self, h, mask):
    return FlaxGPT2Block(self.config, name="block")(h, mask, deterministic=True)[0], None


class ScannedGPT2(nn.Module):
  """A user's GPT-2 built on transformers' own block: layers rematerialized and
  scanned (params and fp8 state stacked on a leading layer axis), head tied
  through ``Embed.attend``."""

  config: Any

  @nn.compact
  def __call__(self, ids):
    cfg = self.config
    wte = nn.Embed(cfg.vocab_size, cfg.n_embd, name="wte")
    h = wte(ids) + nn.Embed(cfg.n_positions, cfg.n_embd, name="wpe")(jnp.arange(ids.shape[1]))
    layers = nn.scan(nn.remat(_GPT2Layer), variable_axes={True: 0},
                     split_rngs={"params": True}, in_axes=nn.broadcast, length=cfg.n_layer)
    h, _ = layers(cfg, name="h")(h, jnp.ones_like(ids))
    return wte.attend(nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, name="ln_f")(h))


def test_gpt2_blocks_scanned_and_rematerialized():
  cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=3, n_head=2)
  ids, labels, _, _ = lm_inputs()
  v = check_model(ScannedGPT2(cfg), (ids,), {}, outputs=lambda o: o,
                  counts={"quantized": 7},   # one scanned layer's 6 + Embed.attend
                  projection_counts={"quantized": 4, "excluded": 3},
                  loss_of=lm_loss(labels), parity=PARITY)
  # One state per layer, stacked like the params.
  assert v[fl.OWG]["h"]["block"]["attn"]["c_attn"]["dot_general_0"]["input_scale"].shape == (3, 1)


# ----------------------------------------------------------------------------
# jax-resnet: convolutions and BatchNorm.
# ----------------------------------------------------------------------------


def test_jax_resnet_with_batchnorm_and_remat_blocks():
  model = ResNet(block_cls=nn.remat(ResNetBlock), stage_sizes=[1, 1], hidden_sizes=(8, 16),
                 n_classes=10)
  x = jax.random.normal(jax.random.key(1), (8, 16, 16, 3))
  labels = jax.random.randint(jax.random.key(2), (8,), 0, 10)
  loss_of = lambda logits: optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  v = check_model(model, (x,), {}, outputs=lambda y: y,
                  counts={"quantized": 8},   # stem, 2 x (2 convs + projection shortcut), head
                  projection_counts={"quantized": 8}, loss_of=loss_of, parity=PARITY,
                  mutable=("batch_stats",), rules=[fl.QuantizationRule()], loss_rtol=0.03)
  assert "batch_stats" in v and "kernel_scale" in v[fl.OWG]["layers_0"]["ConvBlock_0"]["Conv_0"]
