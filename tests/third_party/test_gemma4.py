"""quantize_model on gemma's own Gemma 4 MoE transformer (the ``models`` extra).

gemma 4 needs Python 3.12, so this runs where the ``models`` extra is
installed (``pip install -e ".[test,models]"`` on Python 3.12), not in CI's
Python 3.11; ``tests/test_real_model_patterns.py`` reproduces its patterns
small in the ordinary suite. A tiny random-init config (nothing downloaded):
two layers, each a dense MLP beside four experts run as ``jax.lax.ragged_dot``
(``MoERagged``, whose expert weights live in child modules and are reshaped
before each product), and the head tied to the embedding table
(``Embedder.decode``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import fp8_linen as fl

pytest.importorskip("gemma", reason="the models extra (gemma 4 needs Python 3.12)")
from gemma.gm.nn.gemma4 import _config, _modules, _transformer  # noqa: E402  pylint: disable=g-import-not-at-top

CONFIG = _config.TransformerConfig(
    num_embed=128, embed_dim=64, hidden_dim=128, num_heads=2, head_dim=32, num_kv_heads=1,
    final_logit_softcap=None, use_post_attn_norm=True, use_post_ffw_norm=True,
    attention_types=(_modules.AttentionType.GLOBAL,) * 2, global_rope_proportion=1.0,
    local_rope_proportion=1.0, enable_moe=True, num_experts=4, expert_dim=64, top_k_experts=2,
    moe_dense_hidden_dim=64)
TOKENS = jax.random.randint(jax.random.key(0), (4, 16), 1, 128)


def test_projection_rules_quantize_every_projection_and_expert():
  qm = fl.quantize_model(_transformer.Transformer(config=CONFIG), rules=fl.projection_rules())
  v = qm.init(jax.random.key(1), TOKENS)
  report = qm.product_report(v, TOKENS)
  quantized = [p for p in report.products if p.status == "quantized"]
  excluded = [p for p in report.products if p.status == "excluded"]
  # Per layer: q, kv, attention output, the dense MLP's two, the router and both experts'
  # grouped GEMMs. Kept: the two attention products per layer, the routing weights'
  # combine (no weight) and the tied head.
  assert len(quantized) == 16 and len(excluded) == 7, str(report)
  assert sum(p.primitive == "ragged_dot_general" for p in quantized) == 4
  assert any("embedder.decode" in p.scope for p in excluded)
  assert not report.unquantized or all(p.status == "excluded" for p in report.unquantized)
  # Each expert product keeps one scale per expert for its weight.
  flat = traverse_util.flatten_dict(v[fl.OWG])
  experts = {k[:-1]: a.shape for k, a in flat.items()
             if k[-1] == "kernel_scale" and k[-2].startswith("ragged_dot")}
  assert len(experts) == 4 and all(s[0] == 4 for s in experts.values()), experts


def test_training_tracks_float():
  model = _transformer.Transformer(config=CONFIG)

  def train(apply, variables, steps=5):
    state = fl.TrainState.create(apply_fn=apply, params=variables, tx=optax.adam(3e-3))

    def loss_fn(p):
      logits = state.apply_fn(p, TOKENS[:, :-1]).logits
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), TOKENS[:, 1:]).mean()

    @jax.jit
    def step(state):
      loss, g = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=g), loss

    losses = []
    for _ in range(steps):
      state, loss = step(state)
      losses.append(float(loss))
    return np.array(losses)

  qm = fl.quantize_model(model, fl.current_scaling(), rules=fl.projection_rules())
  qv = qm.init(jax.random.key(1), TOKENS[:, :-1])
  float_losses = train(model.apply, {"params": qv["params"]})
  q_losses = train(qm.apply, qv)
  assert q_losses[-1] < q_losses[0]
  np.testing.assert_allclose(q_losses, float_losses, rtol=0.05)
  assert not np.array_equal(q_losses[1:], float_losses[1:])
