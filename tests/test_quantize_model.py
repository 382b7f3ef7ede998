"""quantize_model: unmodified Linen models run with fp8 products by path rules."""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8_linen as fl

ORIG_DOT = jax.lax.dot_general
ORIG_EINSUM = jnp.einsum


class Mixed(nn.Module):
  @nn.compact
  def __call__(self, x):                      # x: (b, 6, 6, 2)
    h = nn.Conv(4, (3, 3), name="conv")(x)
    h = h.reshape(h.shape[0], -1, 4)
    h = nn.DenseGeneral((2, 3), name="dg")(h)  # (b, 36, 2, 3)
    h = nn.Einsum((2, 3, 5), "btij,ijk->btk", name="ein")(h)
    return nn.Dense(3, name="logits")(h.mean(1))


class Raw(nn.Module):
  """A setup-style module with raw jnp.einsum / lax.dot_general calls."""

  def setup(self):
    self.w = self.param("w", nn.initializers.normal(1.0), (4, 5))

  def __call__(self, x):
    h = jnp.einsum("bd,de->be", x, self.w)
    return jax.lax.dot_general(h, h, (((1,), (1,)), ((), ())))


def test_params_unchanged_state_at_layer_paths_and_parity_with_q_layers():
  x = jax.random.normal(jax.random.key(1), (2, 6, 6, 2))
  model = Mixed()
  qm = fl.quantize_model(model, rules=[fl.QuantizationRule(module_path="logits",
                                                           quantize=False),
                                       fl.QuantizationRule(module_path=".*")])
  v = jax.jit(qm.init)(jax.random.key(0), x)
  vf = jax.jit(model.init)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(jnp.shape, vf["params"])
  assert sorted(v[fl.OWG]) == ["conv", "dg", "ein"]
  assert "kernel_scale" in v[fl.OWG]["conv"]
  assert jax.lax.dot_general is ORIG_DOT and jnp.einsum is ORIG_EINSUM  # patches undone

  class Twin(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = fl.QConv(4, (3, 3), name="conv")(x)
      h = h.reshape(h.shape[0], -1, 4)
      h = fl.QDenseGeneral((2, 3), name="dg")(h)
      h = fl.QEinsum((2, 3, 5), "btij,ijk->btk", name="ein")(h)
      return nn.Dense(3, name="logits")(h.mean(1))

  twin = Twin()
  # Jitted: eager quantized convolutions cost seconds each.
  y = jax.jit(qm.apply)(v, x)
  np.testing.assert_array_equal(y, jax.jit(twin.apply)(v, x))
  ct = jax.random.normal(jax.random.key(2), (2, 3))
  g1 = jax.jit(jax.grad(lambda v: jnp.sum(qm.apply(v, x) * ct)))(v)
  g2 = jax.jit(jax.grad(lambda v: jnp.sum(twin.apply(v, x) * ct)))(v)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # The logits layer stayed in f32: same output as the unquantized model's layer.
  assert not np.array_equal(y, jax.jit(model.apply)(vf, x))


def test_raw_calls_get_per_call_site_state():
  x = jax.random.normal(jax.random.key(1), (3, 4))
  qm = fl.quantize_model(Raw())
  v = jax.jit(qm.init)(jax.random.key(0), x)
  assert sorted(v[fl.OWG]) == ["dot_general_0", "einsum_0"]
  assert set(v["params"]) == {"w"}
  y = jax.jit(qm.apply)(v, x)
  h = x @ v["params"]["w"]
  np.testing.assert_allclose(y, h @ h.T, rtol=0.15, atol=0.15 * float(jnp.max(jnp.abs(h @ h.T))))
  # Jitted: op by op, a quantized backward costs seconds.
  g = jax.jit(jax.grad(lambda v: jnp.sum(qm.apply(v, x))))(v)
  np.testing.assert_allclose(g[fl.OWG]["einsum_0"]["input_amax_history"][0],
                             jnp.max(jnp.abs(x)), rtol=1e-6)


def test_unmatched_rule_is_reported():
  x = jnp.ones((2, 4))
  rules = [fl.QuantizationRule(module_path="no_such_layer"), fl.QuantizationRule()]
  with pytest.warns(UserWarning, match="no_such_layer"):
    jax.jit(fl.quantize_model(nn.Dense(3), rules=rules).init)(jax.random.key(0), x)
  with pytest.raises(ValueError, match="no_such_layer"):
    jax.jit(fl.quantize_model(nn.Dense(3), rules=rules, on_unmatched="raise").init)(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="module_path"):
    fl.QuantizationRule(module_path="(")
  with pytest.raises(ValueError, match="ops"):
    fl.QuantizationRule(ops=("tensordot",))
  with pytest.raises(ValueError, match="operands"):
    fl.QuantizationRule(operands="weights")


def test_flax_multi_head_attention_all_products_quantized():
  mha = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))
  qm = fl.quantize_model(mha)
  v = jax.jit(qm.init)(jax.random.key(0), x)
  assert sorted(v[fl.OWG]) == ["einsum_0", "einsum_1", "key", "out", "query", "value"]
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(
      jnp.shape, jax.eval_shape(mha.init, jax.random.key(0), x)["params"])
  y = jax.jit(qm.apply)(v, x)
  yf = jax.jit(mha.apply)({"params": v["params"]}, x)
  assert float(jnp.max(jnp.abs(y - yf))) < 0.15 * float(jnp.max(jnp.abs(yf)))
  # Keeping the softmax path (the module's own einsums) in high precision.
  qm2 = fl.quantize_model(mha, rules=[fl.QuantizationRule(module_path="", ops=("einsum",),
                                                          quantize=False),
                                      fl.QuantizationRule()])
  assert sorted(jax.jit(qm2.init)(jax.random.key(0), x)[fl.OWG]) == [
      "key", "out", "query", "value"]


class Decoder(nn.Module):
  vocab: int = 32
  d: int = 32
  layers: int = 1
  dtype: Any = None

  @nn.compact
  def __call__(self, tokens):
    dt = self.dtype
    h = nn.Embed(self.vocab, self.d, dtype=dt)(tokens)
    mask = nn.make_causal_mask(tokens)
    for i in range(self.layers):
      a = nn.LayerNorm(dtype=dt)(h)
      h = h + nn.MultiHeadDotProductAttention(num_heads=4, dtype=dt, name=f"attn_{i}")(a, mask=mask)
      a = nn.LayerNorm(dtype=dt)(h)
      h = h + nn.Dense(self.d, dtype=dt, name=f"down_{i}")(
          nn.gelu(nn.Dense(4 * self.d, dtype=dt, name=f"up_{i}")(a)))
    return nn.Dense(self.vocab, dtype=jnp.float32, name="logits")(nn.LayerNorm(dtype=dt)(h))


def _train(apply_fn, variables, tokens, steps=6):
  def loss_fn(v):
    logits = apply_fn(v, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  state = fl.TrainState.create(apply_fn=apply_fn, params=variables, tx=optax.adam(3e-3))

  @jax.jit
  def step(state):
    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), loss

  losses = []
  for _ in range(steps):
    state, loss = step(state)
    losses.append(float(loss))
  return state, np.array(losses)


def test_decoder_trains_close_to_bf16():
  tokens = jax.random.randint(jax.random.key(3), (8, 17), 0, 32)
  tokens = tokens.at[:, 1::2].set((tokens[:, 0::2][:, :8] + 1) % 32)   # learnable structure
  model = Decoder(dtype=jnp.bfloat16)  # the reference is the same model run in bf16
  rules = [fl.QuantizationRule(module_path="logits", quantize=False),
           fl.QuantizationRule(module_path="attn_[0-9]+", ops=("einsum",), quantize=False),
           fl.QuantizationRule()]
  qm = fl.quantize_model(model, fl.delayed_scaling(16), rules)
  v = jax.jit(qm.init)(jax.random.key(0), tokens[:, :-1])
  assert "logits" not in v[fl.OWG] and "einsum_0" not in v[fl.OWG]["attn_0"]
  assert "kernel_scale" in v[fl.OWG]["attn_0"]["query"]
  state, q_losses = _train(qm.apply, v, tokens)
  _, ref_losses = _train(model.apply, {"params": v["params"]}, tokens)
  assert q_losses[-1] < q_losses[0] - 0.3
  np.testing.assert_allclose(q_losses, ref_losses, rtol=0.03)
  hist = state.params[fl.OWG]["up_0"]["output_grad_amax_history"]
  assert int(jnp.sum(hist > 0)) == 6   # one observation per step, none summed


# ----------------------------------------------------------------------------
# Exactly representable inputs: with current scaling an fp8 product of these is
# exact, so quantized results must equal plain jnp results.
# ----------------------------------------------------------------------------

CURRENT = fl.current_scaling()


def exact(key, shape, k=0, top=448.0, lo=8):
  """Integers in [-lo, lo] times 2**k, one entry top * 2**k (the e4m3 max: the scale is 2**k)."""
  x = jax.random.randint(key, shape, -lo, lo + 1).astype(jnp.float32)
  return x.reshape(-1).at[0].set(top).reshape(shape) * 2.0 ** k


def exact_ct(key, shape, k=0):
  """A cotangent exact in e5m2 under current scaling (integers in [-4, 4], one 57344)."""
  return exact(key, shape, k, top=57344.0, lo=4)


def assert_tree_close(a, b, rtol=1e-6, atol=1e-6):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# Gradients through nn.remat and nn.scan: our own products are never intercepted
# when JAX traces their custom-gradient rules later.
# ----------------------------------------------------------------------------


class Block(nn.Module):
  dense: Any = nn.Dense

  @nn.compact
  def __call__(self, x):
    return nn.tanh(self.dense(8, name="proj")(x))


class Remat(nn.Module):
  dense: Any = nn.Dense

  @nn.compact
  def __call__(self, x):
    return nn.remat(Block)(self.dense)(x)


class ScanBody(nn.Module):
  dense: Any = nn.Dense

  @nn.compact
  def __call__(self, c, _):
    return Block(self.dense)(c), None


class Scanned(nn.Module):
  dense: Any = nn.Dense
  axes: Any = None

  @nn.compact
  def __call__(self, x):
    axes = {"params": 0, fl.OWG: 0} if self.axes is None else self.axes
    y, _ = nn.scan(ScanBody, variable_axes=axes, split_rngs={"params": True},
                   length=3)(self.dense)(x, None)
    return y


def q_dense(features, name=None):
  return fl.QDense(features, recipe=fl.Fp8Recipe(), name=name)


@pytest.mark.parametrize("model_cls", [Remat, Scanned], ids=["remat", "scan"])
def test_grad_through_lifted_transform_matches_q_layers(model_cls):
  x = jax.random.normal(jax.random.key(1), (2, 8))
  ct = jax.random.normal(jax.random.key(2), (2, 8))
  qm = fl.quantize_model(model_cls())
  v = jax.jit(qm.init)(jax.random.key(0), x)
  twin = model_cls(dense=q_dense)
  assert jax.tree.map(jnp.shape, v) == jax.tree.map(
      jnp.shape, jax.eval_shape(twin.init, jax.random.key(0), x))
  loss = lambda apply: (lambda v: jnp.sum(apply(v, x) * ct))
  g = jax.jit(jax.grad(loss(qm.apply)))(v)   # was ScopeVariableNotFoundError
  g_twin = jax.jit(jax.grad(loss(twin.apply)))(v)
  assert_tree_close(g, g_twin)
  # The new state came back: the first layer saw x.
  hist = jax.tree.leaves(jax.tree.map(lambda a: a, g[fl.OWG]),
                         is_leaf=lambda t: isinstance(t, dict) and "input_amax_history" in t)
  first = hist[0]["input_amax_history"]
  np.testing.assert_allclose(first[..., 0].reshape(-1)[0], jnp.max(jnp.abs(x)), rtol=1e-6)


def test_scan_without_the_state_collection_warns_and_runs_unquantized():
  x = jax.random.normal(jax.random.key(1), (2, 8))
  model = Scanned(axes={"params": 0})
  qm = fl.quantize_model(model)
  with pytest.warns(UserWarning, match="variable_axes"):
    v = jax.jit(qm.init)(jax.random.key(0), x)
  assert fl.OWG not in v
  np.testing.assert_array_equal(jax.jit(qm.apply)(v, x), jax.jit(model.apply)(v, x))
  assert qm.product_report(v, x).counts == {"skipped": 1}


# ----------------------------------------------------------------------------
# A nested apply (tied output head).
# ----------------------------------------------------------------------------


class Tied(nn.Module):
  def setup(self):
    self.emb = nn.Embed(10, 4)
    self.head = nn.Dense(10, use_bias=False)

  def __call__(self, t):
    return self.head.apply({"params": {"kernel": self.emb.embedding.T}}, self.emb(t))


def test_tied_head_nested_apply_keeps_its_state_in_the_outer_model():
  t = jnp.array([[0, 2, 3], [4, 5, 9]])   # row 0 holds the 448: power-of-two scales
  model = Tied()
  qm = fl.quantize_model(model, CURRENT)
  v = jax.jit(qm.init)(jax.random.key(0), t)   # was ScopeCollectionNotFound
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(
      jnp.shape, jax.eval_shape(model.init, jax.random.key(0), t)["params"])
  assert sorted(v[fl.OWG]) == ["head"]           # where self.head(h) would keep it
  assert "kernel_scale" in v[fl.OWG]["head"]
  v = {**v, "params": {"emb": {"embedding": exact(jax.random.key(1), (10, 4))}}}
  # Both jitted: compared exactly.
  np.testing.assert_array_equal(jax.jit(qm.apply)(v, t), jax.jit(model.apply)(v, t))
  ct = exact_ct(jax.random.key(2), (2, 3, 10))
  g = jax.jit(jax.grad(lambda v: jnp.sum(qm.apply(v, t) * ct)))(v)
  g_ref = jax.jit(jax.grad(lambda p: jnp.sum(model.apply({"params": p}, t) * ct)))(v["params"])
  assert_tree_close(g["params"], g_ref)
  h = v["params"]["emb"]["embedding"][t]
  np.testing.assert_allclose(g[fl.OWG]["head"]["input_amax_history"][0], jnp.max(jnp.abs(h)))
  # Rules see the nested module at that path.
  qm2 = fl.quantize_model(model, rules=[fl.QuantizationRule(module_path="head", quantize=False)])
  assert fl.OWG not in jax.jit(qm2.init)(jax.random.key(0), t)
  assert qm2.product_report(v, t).counts == {"excluded": 1}


# ----------------------------------------------------------------------------
# Broadcasting (multi-/grouped-query) and unplannable einsums.
# ----------------------------------------------------------------------------


class RawEinsum(nn.Module):
  eq: str

  @nn.compact
  def __call__(self, *operands):
    return jnp.einsum(self.eq, *operands)


@pytest.mark.parametrize("eq,ls,rs", [
    ("btnh,bsnh->bnts", (1, 4, 2, 8), (1, 4, 1, 8)),        # multi-query: one key head
    ("btkgh,bskgh->bkgts", (2, 3, 2, 2, 8), (2, 5, 2, 1, 8)),  # grouped-query, broadcast group
    ("bnts,bsnh->btnh", (1, 2, 4, 4), (1, 4, 1, 8)),        # p.v against one value head
    ("...ij,...jk->...ik", (2, 1, 3, 8), (4, 8, 5)),        # ellipses of different ranks
])
def test_broadcasting_einsum_is_quantized_exactly(eq, ls, rs):
  a = exact(jax.random.key(1), ls)
  b = exact(jax.random.key(2), rs, k=-3)
  qm = fl.quantize_model(RawEinsum(eq), CURRENT)
  v = jax.jit(qm.init)(jax.random.key(0), a, b)           # was ValueError for MQA
  assert sorted(v[fl.OWG]) == ["einsum_0"]
  y = jax.jit(qm.apply)(v, a, b)
  np.testing.assert_array_equal(y, jnp.einsum(eq, a, b))
  ct = exact_ct(jax.random.key(3), y.shape, k=-2)
  ga, gb = jax.jit(jax.grad(lambda a, b: jnp.sum(qm.apply(v, a, b) * ct), argnums=(0, 1)))(a, b)
  ra, rb = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.einsum(eq, a, b) * ct), argnums=(0, 1)))(
      a, b)
  np.testing.assert_allclose(ga, ra, rtol=1e-6)
  np.testing.assert_allclose(gb, rb, rtol=1e-6)
  assert qm.product_report(v, a, b).counts == {"quantized": 1}


@pytest.mark.parametrize("eq,shapes", [
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
    ("ii,ij->j", [(3, 3), (3, 4)]),
])
def test_unplannable_einsum_runs_unquantized_and_warns_once(eq, shapes):
  ops = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate(shapes)]
  qm = fl.quantize_model(RawEinsum(eq), on_unmatched="ignore")
  with pytest.warns(UserWarning, match="runs unquantized") as record:
    v = jax.jit(qm.init)(jax.random.key(0), *ops)
    y = jax.jit(qm.apply)(v, *ops)
  assert len([w for w in record if "runs unquantized" in str(w.message)]) == 1
  np.testing.assert_allclose(y, jnp.einsum(eq, *ops), rtol=1e-6)
  assert set(qm.product_report(v, *ops).counts) == {"skipped"}


# ----------------------------------------------------------------------------
# jnp.matmul, jnp.dot and x @ w.
# ----------------------------------------------------------------------------


class Products(nn.Module):
  """The three ways to write a matrix product without a Linen layer."""

  @nn.compact
  def __call__(self, x):
    w1 = self.param("w1", nn.initializers.normal(1.0), (x.shape[-1], 6))
    w2 = self.param("w2", nn.initializers.normal(1.0), (6, 5))
    w3 = self.param("w3", nn.initializers.normal(1.0), (5, 4))
    h = jnp.matmul(x, w1)
    h = jnp.dot(h, w2)
    return h @ w3               # Array.__matmul__: not interceptable


def test_matmul_and_dot_are_quantized_and_x_at_w_is_reported():
  x = exact(jax.random.key(1), (2, 3, 8))
  qm = fl.quantize_model(Products(), CURRENT)
  with pytest.warns(UserWarning, match=r"1 product\(s\).*never reach") as record:
    v = jax.jit(qm.init)(jax.random.key(0), x)
  assert "test_quantize_model.py" in str(record[0].message)   # where the `@` is written
  assert sorted(v[fl.OWG]) == ["dot_0", "matmul_0"]
  report = qm.product_report(v, x)
  assert report.counts == {"quantized": 2, "unseen": 1}
  (unseen,) = report.unquantized
  assert unseen.shapes == ((2, 3, 5), (5, 4)) and "Products" in unseen.scope
  with pytest.raises(ValueError, match="never reach"):
    jax.jit(fl.quantize_model(Products(), on_unquantized="raise").init)(jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(fl.quantize_model(Products(), on_unquantized="ignore").init)(jax.random.key(0), x)


def test_a_model_that_needs_concrete_values_still_inits():
  class Concrete(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(int(jnp.sum(x > 0)))(x)   # a width read from the data: eager only

  x = jnp.ones((2, 3))
  with pytest.warns(UserWarning, match="could not trace the model to check its products"):
    v = fl.quantize_model(Concrete()).init(jax.random.key(0), x)
  assert v["params"]["Dense_0"]["kernel"].shape == (3, 6)


@pytest.mark.parametrize("fn,ls,rs", [
    ("matmul", (2, 1, 3, 8), (5, 8, 4)),   # broadcast batch dims
    ("matmul", (8,), (3, 8, 4)),           # vector @ stack of matrices
    ("matmul", (3, 8), (8,)),
    ("dot", (2, 3, 8), (5, 8, 4)),         # dot's N-d rule: no batch dims
    ("dot", (3, 8), (8,)),
], ids=["matmul-bcast", "matmul-vec-lhs", "matmul-vec-rhs", "dot-nd", "dot-vec"])
def test_matmul_and_dot_numerics(fn, ls, rs):
  class M(nn.Module):
    @nn.compact
    def __call__(self, a, b):
      # Looked up when called, as model code does (jnp.matmul(a, b)); a function
      # object bound before quantize_model runs is never intercepted.
      return getattr(jnp, fn)(a, b)

  a, b = exact(jax.random.key(1), ls), exact(jax.random.key(2), rs, k=-2)
  qm = fl.quantize_model(M(), CURRENT)
  v = jax.jit(qm.init)(jax.random.key(0), a, b)
  assert len(v[fl.OWG]) == 1
  np.testing.assert_array_equal(jax.jit(qm.apply)(v, a, b), getattr(jnp, fn)(a, b))


# ----------------------------------------------------------------------------
# The projections preset.
# ----------------------------------------------------------------------------


class LM(nn.Module):
  """A tiny decoder LM with a tied (Embed.attend) or untied head."""

  tied: bool = True

  @nn.compact
  def __call__(self, tokens):
    emb = nn.Embed(50, 16, name="wte")
    h = emb(tokens)
    a = nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(
        h, mask=nn.make_causal_mask(tokens))
    h = h + a
    h = h + nn.Dense(16, name="down")(nn.gelu(nn.Dense(32, name="up")(h)))
    return emb.attend(h) if self.tied else nn.Dense(50, name="lm_head")(h)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_projection_rules_keep_attention_math_and_head_in_high_precision(tied):
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)
  qm = fl.quantize_model(LM(tied=tied), rules=fl.projection_rules())
  v = jax.jit(qm.init)(jax.random.key(0), tokens)
  assert sorted(v[fl.OWG]) == ["attn", "down", "up"]
  assert sorted(v[fl.OWG]["attn"]) == ["key", "out", "query", "value"]
  report = qm.product_report(v, tokens)
  # q.k and p.v (activations) and the head (embedding-shaped weight) are excluded.
  assert report.counts == {"quantized": 6, "excluded": 3}
  # The default quantizes everything it sees.
  v_all = jax.jit(fl.quantize_model(LM(tied=tied)).init)(jax.random.key(0), tokens)
  assert "einsum_0" in v_all[fl.OWG]["attn"]
  assert ("wte" if tied else "lm_head") in v_all[fl.OWG]
  # A head that is no embedding-shaped product is named by path.
  rules = fl.projection_rules(head="down")
  assert "down" not in jax.jit(fl.quantize_model(LM(), rules=rules).init)(
      jax.random.key(0), tokens)[fl.OWG]


# ----------------------------------------------------------------------------
# Two threads trace at once: one quantized, one not.
# ----------------------------------------------------------------------------


def test_two_threads_tracing_at_once_each_get_their_own_program():
  import threading
  sync = {"barrier": None}
  installed = []

  class Waits(nn.Module):
    @nn.compact
    def __call__(self, x):
      if sync["barrier"] is not None:
        sync["barrier"].wait()   # both threads are inside their trace here
        installed.append(jax.lax.dot_general is not ORIG_DOT)
      h = nn.Dense(4)(x)
      if sync["barrier"] is not None:
        sync["barrier"].wait()   # both products were traced while the other thread traced
      return h

  x = jax.random.normal(jax.random.key(1), (2, 3))
  plain, qm = Waits(), fl.quantize_model(Waits())
  vq = jax.jit(qm.init)(jax.random.key(0), x)
  vp = {"params": vq["params"]}
  twin = fl.QDense(4, recipe=fl.Fp8Recipe())
  results, errors = {}, []

  def run(name, fn, report_fn):
    try:
      results[name] = (fl.product_report(report_fn).counts, jax.jit(fn)())
    except Exception as e:  # noqa: BLE001  (reported below)
      errors.append(e)
      sync["barrier"].abort()

  sync["barrier"] = threading.Barrier(2, timeout=120)
  threads = [threading.Thread(target=run, args=("q", lambda: qm.apply(vq, x),
                                                lambda: qm.apply(vq, x))),
             threading.Thread(target=run, args=("p", lambda: plain.apply(vp, x),
                                                lambda: plain.apply(vp, x)))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  sync["barrier"] = None
  assert not errors, errors
  assert installed == [True] * 4
  assert results["q"][0] == {"quantized": 1} and results["p"][0] == {"unseen": 1}
  np.testing.assert_allclose(results["q"][1], jax.jit(twin.apply)(
      {"params": vq["params"]["Dense_0"], fl.OWG: vq[fl.OWG]["Dense_0"]}, x), rtol=1e-6)
  np.testing.assert_allclose(results["p"][1], jax.jit(plain.apply)(vp, x), rtol=1e-6)


# ----------------------------------------------------------------------------
# The library's own products never reach the interception.
# ----------------------------------------------------------------------------


def test_core_and_linen_never_call_an_intercepted_function_by_name():
  import ast
  import pathlib
  from fp8_linen import interception
  pkg = pathlib.Path(fl.__file__).resolve().parent
  names = {attr for _, attr in interception.TARGETS.values()}
  bad = []
  for path in [*(pkg / "core").rglob("*.py"), *(pkg / "linen").rglob("*.py")]:
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr in names
          and isinstance(node.value, (ast.Name, ast.Attribute))
          and ast.unparse(node.value) in ("lax", "jax.lax", "jnp", "jax.numpy", "np")):
        bad.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
      if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        bad.append(f"{path.name}:{node.lineno} uses @ (reviewers cannot tell which matmul)")
  assert not bad, bad


def test_input_regions_follow_views_and_calls_but_not_loops_or_other_uses():
  from fp8_linen.product_report import (  # pylint: disable=import-outside-toplevel
      MARKERS, input_regions, only_product)

  def quantized(name, x, w):
    with jax.named_scope(name), jax.named_scope(MARKERS["quantized"]):
      return x @ w

  def fn(a, b, c, d, e, x):
    y = quantized("p", x, jax.jit(lambda w: w.astype(jnp.bfloat16).reshape(4, 4))(a))
    y = y + quantized("q", x, jax.checkpoint(lambda w: w[0])(b[None]))   # a slice: no view
    y = y + quantized("r", x, c) + quantized("s", x, c)                  # two products
    y = y + jax.lax.scan(lambda h, _: (quantized("t", h, d), None), x, None, length=2)[0]
    return y + quantized("u", x, e.astype(jnp.bfloat16)), e              # e is also returned

  w = jnp.ones((4, 4), jnp.bfloat16)
  got = input_regions(fn, jnp.ones(16), w, w, w, w, jnp.ones((2, 4), jnp.bfloat16))
  assert got[0] == {"p/fp8_linen_quantized"} and only_product(got[0], "p")
  assert got[1] is None and got[3] is None and got[4] is None
  assert got[2] == {"r/fp8_linen_quantized", "s/fp8_linen_quantized"}
  assert not only_product(got[2], "r") and not only_product(got[0], "q")
  assert got[5] is None  # x: the scan's carry too
