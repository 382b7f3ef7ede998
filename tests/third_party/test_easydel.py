"""fl.nnx.quantize_model on EasyDeL's own Llama (an NNX model of EasyDeL's own modules).

EasyDeL pins flax 0.12.3 and jax 0.9, older than ours, so this runs where
EasyDeL is installed without its pins next to our flax and jax (not in CI): in
a virtual environment with ``pip install -e ".[test]"``, then ``pip install
--no-deps easydel==0.3.0 eformer==0.0.99.12 ejkernel==0.0.78`` and the runtime
packages their imports ask for (``torch`` included: importing any EasyDeL
model imports every one, and GLM-4V-MoE's reads a transformers class that needs
torch). A tiny random-init config (nothing downloaded), float32, on the mesh
EasyDeL makes of every device (tests/conftest.py's 8 CPU devices: fsdp=8, the
batch split over it by EasyDeL's own sharding constraints, the variables
replicated): two layers whose q/k/v/o and gate/up/down projections are EasyDeL's
``ColumnParallelLinear``/``RowParallelLinear`` (``jnp.einsum`` against their own
kernel), attention computed by EasyDeL's own XLA attention (two einsums of
activations), the head an untied ``ColumnParallelLinear`` with the vocabulary
table's shape, the tokens looked up with ``jnp.take``.

Two things EasyDeL needs on newer flax and jax, both EasyDeL's and not ours:

* importing it appends GPU flags to ``XLA_FLAGS`` unless ``EASYDEL_AUTO=0``, and
  XLA from jax 0.10 on aborts the process on one it no longer knows
  (``--xla_gpu_enable_shared_constants``), on CPU too;
* ``LlamaModel.frequencies`` (the RoPE table) is a ``functools.cached_property``
  holding an ``nnx.Cache``: written straight into ``__dict__``, which flax 0.12.5
  and later take as a static attribute, so the Variable stays in the graphdef
  and any ``nnx.grad`` under ``nnx.jit`` fails with "Cannot extract graph node
  from different trace level". ``_llama`` computes it once and declares it data.
"""

import os

# Before EasyDeL is imported (pytest.importorskip imports it).
os.environ["EASYDEL_AUTO"] = "0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import fp8_linen as fl  # noqa: E402

# EasyDeL's sharding needs `with mesh:` (eformer reads that mesh); its modules read `.value`.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`with mesh.` context manager has been deprecated:DeprecationWarning",
    "ignore:jax.interpreters.pxla.thread_resources is deprecated:DeprecationWarning",
    "ignore:'.value' access is now deprecated:DeprecationWarning")

_CACHE_DIR = jax.config.jax_compilation_cache_dir
ed = pytest.importorskip("easydel", reason="EasyDeL, installed without its flax/jax pins")
LlamaConfig, LlamaForCausalLM = ed.LlamaConfig, ed.LlamaForCausalLM  # imports every model
# ejkernel points JAX's persistent compilation cache at ~/.cache when it defines its jitted
# functions: keep the run's own.
jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)

# vocab_size != intermediate_size: projection_rules tells an untied head by the vocabulary
# table's shape, so an MLP kernel of that shape would be kept in float as a head too.
# attn_dtype: EasyDeL's attention runs in bf16 unless told otherwise.
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=64, attn_dtype=jnp.float32,
              attn_softmax_dtype=jnp.float32)
TOKENS = jax.random.randint(jax.random.key(0), (8, 16), 1, 256)
PROJECTIONS = ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
               "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
SITES = {f"model/layers/{i}/{p}/native_forward_einsum_0" for i in range(2) for p in PROJECTIONS}


def _llama():
  model = LlamaForCausalLM(config=LlamaConfig(**CONFIG), dtype=jnp.float32,
                           param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  with model.mesh:  # EasyDeL's sharding constraints read the mesh of `with mesh:`
    model.model.frequencies = nnx.data(model.model.frequencies)
  return model


def _sites(model):
  return {s.site_path: s for _, s in nnx.iter_graph(model) if isinstance(s, fl.nnx.ProductSite)}


def test_projection_rules_quantize_every_projection():
  model = _llama()
  with model.mesh:
    qm = fl.nnx.quantize_model(model, rules=fl.projection_rules(), example=(TOKENS,),
                               on_unquantized="raise")
    report = fl.nnx.product_report(qm, TOKENS)
  quantized = report.with_status("quantized")
  excluded = report.with_status("excluded")
  # Per layer: q, k, v, o, gate, up, down. Kept: the attention scores and the attention-
  # weighted values per layer (two activations) and the untied logits head.
  assert report.counts == {"quantized": 14, "excluded": 5}, str(report)
  assert {p.scope for p in quantized} == SITES, str(report)
  assert sum("attention_performer" in p.scope for p in excluded) == 4, str(report)
  assert [p.scope for p in excluded if "attention_performer" not in p.scope] == [
      "lm_head/...ik,...kj->...ij"], str(report)
  # The embedding lookup is a gather, no product: nothing of embed_tokens is quantized.
  assert not any("embed_tokens" in p.scope for p in report.products), str(report)
  # One state per quantized product, on the projections only.
  assert set(_sites(qm)) == SITES


def _train(model, steps=5):
  optimizer = fl.nnx.Optimizer(model, optax.adam(3e-3))

  def loss_fn(m):
    logits = m(TOKENS[:, :-1]).logits
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), TOKENS[:, 1:]).mean()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = fl.nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  # On the mesh from the start, as the step's outputs are (else the second step compiles again).
  replicated = jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec())
  nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))
  return np.array([float(step(model, optimizer)) for _ in range(steps)])


def test_training_tracks_float():
  model = _llama()
  float_model = nnx.clone(model)
  with model.mesh:
    qm = fl.nnx.quantize_model(model, fl.current_scaling(), rules=fl.projection_rules(),
                               example=(TOKENS[:, :-1],), on_unquantized="raise")
    float_losses = _train(float_model)
    q_losses = _train(qm)
  assert q_losses[-1] < q_losses[0]
  np.testing.assert_allclose(q_losses, float_losses, rtol=0.05)
  assert not np.array_equal(q_losses[1:], float_losses[1:])
  # fl.nnx.Optimizer wrote every product's new state back: one amax per step, newest first.
  for path, site in _sites(qm).items():
    history = np.asarray(site.input_amax_history[...])
    assert (history[:5] > 0).all() and not history[5:].any(), (path, history)
