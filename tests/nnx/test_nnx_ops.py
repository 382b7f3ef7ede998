"""fl.nnx.quantize_model(example=...): products inside a model's own NNX modules."""

import dataclasses
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl

_DN = lambda x: (((x.ndim - 1,), (0,)), ((), ()))


class Proj(nnx.Module):
  """A projection of its own (MaxText's DenseGeneral, EasyDeL's ParallelLinear)."""

  def __init__(self, k, n, seed=0):
    self.w = nnx.Param(jax.random.normal(jax.random.key(seed), (k, n)) * 0.2)

  def __call__(self, x):
    return jax.lax.dot_general(x, self.w[...], _DN(x))


class Attn(nnx.Module):
  def __init__(self, d):
    self.q, self.k = Proj(d, d, 1), Proj(d, d, 2)
    self.o = nnx.Linear(d, d, rngs=nnx.Rngs(3))

  def __call__(self, x):
    s = jnp.einsum("btd,bsd->bts", self.q(x), self.k(x))
    return self.o(jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), x))


class Lm(nnx.Module):
  """Embedding, attention of its own modules, a raw matmul, a tied head."""

  def __init__(self, vocab=50, d=16):
    self.emb = nnx.Embed(vocab, d, rngs=nnx.Rngs(0))
    self.attn = Attn(d)
    self.w2 = nnx.Param(jax.random.normal(jax.random.key(4), (d, d)) * 0.2)

  def __call__(self, ids):
    h = self.emb(ids)
    h = h + self.attn(h)
    return self.emb.attend(jnp.matmul(h, self.w2[...]))


IDS = jnp.arange(8).reshape(2, 4) % 50


def _state_paths(model):
  return sorted("/".join(map(str, k[:-1])) for k, _ in
                nnx.to_flat_state(nnx.state(model, fl.nnx.QuantState)) if k[-1] == "input_scale")


def _by_scope(report):
  return {p.scope.rsplit("/", 1)[0] if "->" in p.scope else p.scope: p.status
          for p in report.products}


def test_projection_rules_quantize_own_projections_and_keep_attention_and_head():
  model = fl.nnx.quantize_model(Lm(), rules=fl.projection_rules(), example=(IDS,))
  # Sites at <module path>/<op>_<i>; the flax Linear becomes a twin (state at its path).
  assert _state_paths(model) == ["attn/k/dot_general_0", "attn/o", "attn/q/dot_general_0",
                                 "matmul_0"]
  report = fl.nnx.product_report(model, IDS)
  assert report.counts == {"quantized": 4, "excluded": 3}
  scopes = _by_scope(report)
  for path in ("attn/q/dot_general_0", "attn/k/dot_general_0", "attn/o", "matmul_0"):
    assert scopes[path] == "quantized", (path, scopes)
  assert scopes["emb"] == "excluded"  # the tied head: the vocabulary table as a weight
  assert sum(s == "excluded" and k.startswith("attn") for k, s in scopes.items()) == 1


def test_fast_path_projection_rules_keep_an_untied_head():
  class Untied(nnx.Module):
    def __init__(self):
      self.emb = nnx.Embed(40, 8, rngs=nnx.Rngs(0))
      self.up = nnx.Linear(8, 8, rngs=nnx.Rngs(1))
      self.head = nnx.Linear(8, 40, rngs=nnx.Rngs(2))

    def __call__(self, ids):
      return self.head(self.up(self.emb(ids)))

  model = fl.nnx.quantize_model(Untied(), rules=fl.projection_rules())
  assert type(model.up) is fl.nnx.Linear
  assert type(model.head) is nnx.Linear  # (8, 40): the vocabulary table's shape


class Single(nnx.Module):
  def __init__(self):
    self.p = Proj(16, 8)

  def __call__(self, x):
    return self.p(x)


class Twin(nnx.Module):
  def __init__(self, recipe):
    w = Proj(16, 8).w[...]  # its kernel from the start: LSQ's weight step starts from it
    self.p = fl.nnx.Linear(16, 8, use_bias=False, recipe=recipe, kernel_init=lambda *_: w,
                           rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.p(x)


@pytest.mark.parametrize("recipe", [fl.Fp8Recipe(), fl.IntRecipe(), fl.int8_lsq()],
                         ids=["fp8", "int8", "int8_lsq"])
def test_own_product_trains_exactly_as_the_twin_layer(recipe):
  """A raw dot_general quantized in place runs the fl.nnx.Linear product on the same state.

  LSQ: the example's run starts the site's weight step from the weight and its activation
  step from the example, as the twin's constructor and fl.nnx.calibrate do.
  """
  x = jax.random.normal(jax.random.key(5), (4, 16)) * 3
  ops = fl.nnx.quantize_model(Single(), recipe, example=(x,))
  twin = Twin(recipe)
  assert isinstance(ops.p.dot_general_0, fl.nnx.ProductSite)
  learned = nnx.to_flat_state(nnx.state(ops.p.dot_general_0, nnx.Param))
  before = [np.asarray(v[...]) for _, v in learned]
  if getattr(recipe.input, "learned", False):
    fl.nnx.calibrate(twin, x)
    steps = dict(nnx.to_flat_state(nnx.state(twin.p, nnx.Param)))
    assert sorted(k for k, _ in learned) == [("input_step",), ("kernel_step",)]
    for k, v in learned:
      np.testing.assert_array_equal(v[...], steps[k][...], err_msg=str(k))
    assert float(learned[0][1][...].max()) != 1.0  # not the placeholder: from the data
  else:
    assert not learned

  @nnx.jit
  def step(model, opt, x):
    loss, g = fl.nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    opt.update(model, g)
    return loss

  opts = fl.nnx.Optimizer(ops, optax.adam(1e-2)), fl.nnx.Optimizer(twin, optax.adam(1e-2))
  for i in range(3):
    xi = x * (i + 1)
    np.testing.assert_array_equal(step(ops, opts[0], xi), step(twin, opts[1], xi))
  np.testing.assert_array_equal(ops.p.w[...], twin.p.kernel[...])
  kind = nnx.Param if learned else fl.nnx.QuantState
  site = nnx.to_flat_state(nnx.state(ops.p.dot_general_0, kind))
  layer = dict(nnx.to_flat_state(nnx.state(twin.p, kind)))
  assert len(site) > 0 and all(k in layer for k, _ in site)
  for k, v in site:
    np.testing.assert_array_equal(v[...], layer[k][...], err_msg=str(k))
  # The state moved (LSQ: the steps learned): it is the product's, not a constant.
  moved = [v[...] for k, v in site if any(w in k[-1] for w in ("history", "range", "step"))]
  assert any(float(jnp.abs(v).max()) > 0 for v in moved)
  assert not before or any(not np.array_equal(a, b) for a, b in zip(moved, before))


class TestForwardJitAndEager(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_forward_is_quantized_and_the_same_jitted_or_not(self):
    x = jax.random.normal(jax.random.key(6), (4, 16))
    model = fl.nnx.quantize_model(Single(), fl.current_scaling(), example=(x,))
    float_y = Single()(x)
    graphdef, state = nnx.split(model)
    y = self.variant(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    chex.assert_shape(y, (4, 8))
    chex.assert_trees_all_close(y, float_y, rtol=0.1, atol=0.05)
    assert not np.array_equal(np.asarray(y), np.asarray(float_y))  # fp8, not float


def test_rule_excluded_product_runs_in_float_bit_exactly():
  x = jax.random.normal(jax.random.key(7), (2, 4, 16))
  model = fl.nnx.quantize_model(
      Attn(16), rules=[fl.QuantizationRule(module_path="q", quantize=False),
                       fl.QuantizationRule(operands="weight")], example=(x,))
  assert not hasattr(model.q, "dot_general_0") and hasattr(model.k, "dot_general_0")
  np.testing.assert_array_equal(model.q(x), Proj(16, 16, 1)(x))
  assert not np.array_equal(model.k(x), Proj(16, 16, 2)(x))
  scopes = _by_scope(fl.nnx.product_report(model, x))
  assert scopes["q"] == "excluded" and scopes["k/dot_general_0"] == "quantized"


class Branchy(nnx.Module):
  def __init__(self):
    self.a, self.b = Proj(8, 8, 0), Proj(8, 8, 1)

  def __call__(self, x, both=False):
    y = self.a(x)
    return y + jnp.dot(x, self.b.w[...]) if both else y


def test_a_product_the_example_did_not_reach_warns_and_runs_in_float():
  x = jnp.ones((2, 8))
  model = fl.nnx.quantize_model(Branchy(), example=(x,))
  with pytest.warns(UserWarning, match="example never reached this call"):
    y = model(x, both=True)
  np.testing.assert_allclose(y - model(x), jnp.dot(x, Branchy().b.w[...]), rtol=1e-6,
                             atol=1e-6)
  # With the branch in the example, both products are quantized (dot in __call__: dot_0).
  model = fl.nnx.quantize_model(Branchy(), example=lambda m: m(x, both=True))
  assert _state_paths(model) == ["a/dot_general_0", "dot_0"]


def test_methods_other_than_call_are_named_after_the_method():
  class Head(nnx.Module):
    def __init__(self):
      self.table = nnx.Param(jnp.ones((8, 6)))

    def decode(self, h):
      return jnp.einsum("bd,vd->bv", h, self.table[...])

  model = fl.nnx.quantize_model(Head(), example=lambda m: m.decode(jnp.ones((2, 6))))
  assert _state_paths(model) == ["decode_einsum_0"]
  assert model.decode(jnp.ones((2, 6))).shape == (2, 8)


def test_lsq_own_products_need_an_example_of_arrays_and_no_stacked_layers():
  shapes = (jax.ShapeDtypeStruct((2, 16), jnp.float32),)
  with pytest.raises(ValueError, match=r"p/dot_general_0.*LSQ.*arrays, not shapes"):
    fl.nnx.quantize_model(Single(), fl.int8_lsq(), example=shapes)
  with pytest.raises(ValueError, match=r"dot_general_0.*LSQ.*stacked under nnx.scan"):
    fl.nnx.quantize_model(Stack(), fl.int8_lsq(), example=(jnp.ones((2, 8)),))


def test_remat_inside_a_method_keeps_the_state():
  class Remat(nnx.Module):
    def __init__(self):
      self.p = Proj(16, 8)

    def __call__(self, x):
      return nnx.remat(lambda m, x: m(x))(self.p, x)

  x = jax.random.normal(jax.random.key(8), (4, 16))
  model = fl.nnx.quantize_model(Remat(), example=(x,))
  assert fl.nnx.product_report(model, x).counts == {"quantized": 1}
  g = nnx.grad(lambda m: m(x).sum(), argnums=nnx.DiffState(0, fl.nnx.DIFF))(model)
  new_scale = g["p"]["dot_general_0"]["input_scale"][...]
  np.testing.assert_allclose(new_scale, jnp.abs(x).max() / 448.0, rtol=1e-6)


class Stack(nnx.Module):
  """Layers stacked by nnx.vmap and run by nnx.scan (MaxText's scanned layers)."""

  def __init__(self):
    self.layers = nnx.vmap(lambda s: Proj(8, 8, s), in_axes=0)(jnp.arange(3))

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return jnp.tanh(layer(x))
    return body(x, self.layers)


class Unrolled(nnx.Module):
  def __init__(self, stack):
    self.layers = nnx.List([Proj(8, 8) for _ in range(3)])
    for i, layer in enumerate(self.layers):
      layer.w[...] = stack.layers.w[...][i]

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


def test_scanned_stacked_layers_get_one_state_per_layer():
  x = jax.random.normal(jax.random.key(11), (4, 8)) * 2
  stack = fl.nnx.quantize_model(Stack(), example=(x,))
  unrolled = fl.nnx.quantize_model(Unrolled(Stack()), example=(x,))
  site = stack.layers.dot_general_0
  chex.assert_shape(site.input_scale[...], (3, 1))
  assert fl.nnx.product_report(stack, x).counts == {"quantized": 1}  # one scanned product
  diff = nnx.DiffState(0, fl.nnx.DIFF)
  for _ in range(2):  # the second step runs on the first step's per-layer scales
    y_s, g_s = nnx.value_and_grad(lambda m: m(x).sum(), argnums=diff)(stack)
    y_u, g_u = nnx.value_and_grad(lambda m: m(x).sum(), argnums=diff)(unrolled)
    np.testing.assert_allclose(y_s, y_u, rtol=1e-6)
    for i in range(3):
      new = g_u["layers"][i]["dot_general_0"]
      np.testing.assert_allclose(g_s["layers"]["dot_general_0"]["input_scale"][...][i],
                                 new["input_scale"][...], rtol=1e-6)
    fl.nnx.update_state(stack, g_s)
    fl.nnx.update_state(unrolled, g_u)
  scales = np.asarray(stack.layers.dot_general_0.input_scale[...])[:, 0]
  assert len(set(scales.tolist())) == 3  # each layer its own input scale


def test_a_transform_copy_is_recognised_by_its_parameters():
  from fp8_linen.nnx.ops import _stacked  # pylint: disable=import-outside-toplevel
  stack = Stack()
  one = Proj(8, 8)
  assert _stacked(one, one) == 0
  assert _stacked(Proj(8, 8, 5), one) == 0  # a copy: same parameter shapes
  assert _stacked(one, stack.layers) == 3  # one layer's slice of a stack of 3
  assert _stacked(Proj(4, 8), one) is None  # other parameters: skipped, with a warning
  assert _stacked(one, None) is None


def test_products_the_interception_cannot_see_warn_or_raise():
  class AtOp(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))

    def __call__(self, x):
      return x @ self.w[...]

  with pytest.warns(UserWarning, match="never reach the interception"):
    fl.nnx.quantize_model(AtOp(), example=(jnp.ones((2, 4)),), on_unmatched="ignore")
  with pytest.raises(ValueError, match="never reach the interception"):
    fl.nnx.quantize_model(AtOp(), example=(jnp.ones((2, 4)),), on_unquantized="raise",
                          on_unmatched="ignore")


def test_bad_example_and_name_clash_are_errors():
  with pytest.raises(TypeError, match="example must be"):
    fl.nnx.quantize_model(Single(), example=jnp.ones((2, 16)))

  class Clash(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones((4, 4)))
      self.dot_general_0 = 3

    def __call__(self, x):
      return jax.lax.dot_general(x, self.w[...], _DN(x))

  with pytest.raises(ValueError, match="already has an attribute 'dot_general_0'"):
    fl.nnx.quantize_model(Clash(), example=(jnp.ones((2, 4)),))


class Moe(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jax.random.normal(jax.random.key(9), (4, 8, 16)) * 0.2)

  def __call__(self, x, group_sizes):
    return jax.lax.ragged_dot(x, self.w[...], group_sizes)


def test_moe_experts_as_ragged_dot():
  x = jax.random.normal(jax.random.key(10), (6, 8))
  gs = jnp.array([2, 0, 3, 1], jnp.int32)
  model = fl.nnx.quantize_model(Moe(), example=(x, gs))
  assert _state_paths(model) == ["ragged_dot_0"]
  y = model(x, gs)
  ref = jax.lax.ragged_dot(x, Moe().w[...], gs)
  np.testing.assert_allclose(y, ref, rtol=0.15, atol=0.1)
  assert not np.array_equal(y, ref)
  g = nnx.grad(lambda m: m(x, gs).sum(), argnums=nnx.DiffState(0, fl.nnx.DIFF))(model)
  np.testing.assert_allclose(g["ragged_dot_0"]["input_scale"][...], jnp.abs(x).max() / 448.0,
                             rtol=1e-6)
  # Integer experts: fake-quantized, an observer range as state.
  model = fl.nnx.quantize_model(Moe(), fl.IntRecipe(), example=(x, gs))
  assert model.ragged_dot_0.input_range[...].shape == (2,)
  assert not np.array_equal(model(x, gs), ref)
  # Integer gradients: the integer grouped GEMM's, the same forward.
  model8 = fl.nnx.quantize_model(Moe(), fl.IntRecipe(grad_bits=8), example=(x, gs))
  np.testing.assert_array_equal(model8(x, gs), model(x, gs))
  # Learned (LSQ) experts are fake-quantized, with float gradients: grad_bits is
  # refused at quantize time, and they run in float.
  with pytest.warns(UserWarning, match="needs the integer grouped GEMM"):
    model = fl.nnx.quantize_model(Moe(), dataclasses.replace(fl.int8_lsq(), grad_bits=8),
                                  example=(x, gs))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    np.testing.assert_array_equal(model(x, gs), ref)


@nnx.jit
def _lm_step(model, opt):
  loss, grads = fl.nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(IDS) - 0.5)))(model)
  opt.update(model, grads)
  return loss


def test_switch_precision_of_own_products_keeps_variables_and_optimizer_state(
    same_step_as_flax):
  model = fl.nnx.quantize_model(Lm(), rules=fl.projection_rules(), example=(IDS,))
  opt = fl.nnx.Optimizer(model, optax.adam(1e-2))
  for _ in range(2):
    _lm_step(model, opt)
  q_w, quantized = model.attn.q.w, fl.nnx.product_report(model, IDS).counts["quantized"]
  assert quantized == 4  # q, k, the raw matmul and the flax layer o
  # The bf16 tail: the modules run their own code in float, on the same variables.
  new, new_opt = fl.nnx.switch_precision(model, opt)
  assert type(new.attn.q) is Proj and type(new.attn) is Attn and type(new.attn.o) is nnx.Linear
  assert new.attn.q.w is q_w and not hasattr(new.attn.q, "dot_general_0")
  assert not jax.tree.leaves(nnx.state(new, fl.nnx.QuantState))
  assert "quantized" not in fl.nnx.product_report(new, IDS).counts
  assert fl.nnx.product_report(model, IDS).counts["quantized"] == quantized  # left as it was
  assert int(new_opt.step[...]) == 2
  # The reference: the float model's step, flax's optimizer, copies of the same state.
  same_step_as_flax(new, new_opt, opt, lambda m: jnp.mean(jnp.square(m(IDS) - 0.5)),
                    optax.adam(1e-2))
  # Another recipe: found again by the example run, with fresh state of its own.
  cur = fl.current_scaling()
  with pytest.raises(ValueError, match="pass example="):
    fl.nnx.switch_precision(model, opt, cur, rules=fl.projection_rules())
  new, new_opt = fl.nnx.switch_precision(model, opt, cur, rules=fl.projection_rules(),
                                         example=(IDS,))
  assert new.attn.q.dot_general_0.recipe == cur and new.attn.q.w is q_w
  assert _state_paths(new) == _state_paths(model)
  # The optimizer's step is the very variable the float tail stepped too.
  assert float(_lm_step(new, new_opt)) > 0 and int(new_opt.step[...]) == 4
  assert fl.nnx.product_report(new, IDS).counts["quantized"] == quantized


class ProjThenMoe(nnx.Module):
  def __init__(self):
    self.p, self.moe = Proj(8, 8), Moe()

  def __call__(self, x, group_sizes):
    return self.moe(jax.nn.relu(self.p(x)), group_sizes)


@pytest.mark.parametrize("recipe", [fl.Fp8Recipe(), fl.IntRecipe()], ids=["fp8", "int8"])
def test_own_products_serve_as_their_frozen_qat_forward(recipe):
  x = jax.random.normal(jax.random.key(12), (6, 8))
  gs = jnp.array([2, 0, 3, 1], jnp.int32)
  model = fl.nnx.quantize_model(ProjThenMoe(), recipe, example=(x, gs))
  opt = fl.nnx.Optimizer(model, optax.adam(1e-2))

  @nnx.jit
  def step(model, opt):
    _, g = fl.nnx.value_and_grad(lambda m: (m(x, gs) ** 2).mean())(model)
    opt.update(model, g)

  for _ in range(2):
    step(model, opt)
  served = fl.nnx.convert(model, x, gs)
  # The sites keep what serving reads; the training state is gone; each weight its one
  # product reads (the projection's, the experts') is stored as that product's codes and
  # read by the module's own code as the float32 it saw in training.
  assert not jax.tree.leaves(nnx.state(served, fl.nnx.QuantState))
  assert {"input_scale", "kernel_scale"} <= set(vars(served.p.dot_general_0))
  codes = jnp.float8_e4m3fn if isinstance(recipe, fl.Fp8Recipe) else jnp.int8
  for w in (served.p.w, served.moe.w):
    assert w.get_raw_value().dtype == codes and w[...].dtype == jnp.float32
  if isinstance(recipe, fl.Fp8Recipe):
    assert served.moe.ragged_dot_0.kernel_scale.shape == (4, 1)  # one scale per expert
  assert fl.weight_bytes(nnx.state(served)) < fl.weight_bytes(nnx.state(model, nnx.Param)) / 3

  @nnx.jit
  def frozen(m, x, g):
    with fl.frozen_quantizers():
      return m(x, g)

  chex.assert_trees_all_equal(nnx.jit(lambda m, x, g: m(x, g))(served, x, gs),
                              frozen(model, x, gs))


class SharedAndTied(nnx.Module):
  """Weights a served product must not store as codes: one read twice, one also looked up."""

  def __init__(self):
    self.shared = nnx.Param(jax.random.normal(jax.random.key(20), (8, 8)) * 0.2)
    self.table = nnx.Param(jax.random.normal(jax.random.key(21), (8, 8)) * 0.2)
    self.wq = nnx.Param(jax.random.normal(jax.random.key(22), (8, 8)) * 0.2)
    self.wt = nnx.Param(jax.random.normal(jax.random.key(23), (8, 8)) * 0.2)
    self.w3 = nnx.Param(jax.random.normal(jax.random.key(24), (2, 4, 8)) * 0.2)

  def __call__(self, x, ids):
    h = jax.lax.dot_general(x, self.shared[...], _DN(x))
    h = h + jax.lax.dot_general(h, self.shared[...].astype(jnp.bfloat16), _DN(h)).astype(h.dtype)
    h = h + self.table[...][ids] + jax.lax.dot_general(h, self.table[...], _DN(h))
    h = h + jax.lax.dot_general(h, self.wq[...].astype(jnp.bfloat16), _DN(h)).astype(h.dtype)
    h = h + jax.lax.dot_general(h, self.wt[...].T, _DN(h))  # a transposed view
    return h + jnp.einsum("bk,kn->bn", h, self.w3[...].reshape(8, 8))


@pytest.mark.parametrize("recipe", [fl.Fp8Recipe(), fl.IntRecipe()], ids=["fp8", "int8"])
def test_only_a_weight_one_product_reads_through_casts_and_reshapes_is_stored_as_codes(recipe):
  x = jax.random.normal(jax.random.key(25), (4, 8))
  ids = jnp.array([1, 2, 3, 0])
  model = fl.nnx.quantize_model(SharedAndTied(), recipe, example=(x, ids))
  assert fl.nnx.product_report(model, x, ids).counts == {"quantized": 6}
  _, g = nnx.jit(lambda m: fl.nnx.value_and_grad(lambda m: m(x, ids).sum())(m))(model)
  fl.nnx.Optimizer(model, optax.sgd(0.0)).update(model, g)  # trained quantization state
  served = fl.nnx.convert(model, x, ids)
  codes = jnp.float8_e4m3fn if isinstance(recipe, fl.Fp8Recipe) else jnp.int8
  stored = {k: getattr(served, k).get_raw_value().dtype
            for k in ("shared", "table", "wq", "wt", "w3")}
  assert stored == {"shared": jnp.float32, "table": jnp.float32, "wq": codes,
                    "wt": jnp.float32, "w3": codes}, stored

  @nnx.jit
  def frozen(m):
    with fl.frozen_quantizers():
      return m(x, ids)

  chex.assert_trees_all_equal(nnx.jit(lambda m: m(x, ids))(served), frozen(model))
  # QLoRA's merge writes the stored weights back as float, in their own places.
  fl.nnx.add_lora(served, x, ids, rank=2)
  merged = fl.nnx.merge_lora(served, SharedAndTied(), x, ids)
  for k in ("wq", "w3"):
    w, trained = getattr(merged, k)[...], getattr(model, k)[...]
    assert w.dtype == jnp.float32 and not np.array_equal(w, trained)  # dequantized codes
    np.testing.assert_allclose(w, trained, atol=0.02)


def test_served_own_products_multiply_their_stored_codes_on_h100(require_target):
  t = require_target("h100")
  from fp8_linen.testing.compile import compile_for  # pylint: disable=import-outside-toplevel
  x = jax.random.normal(jax.random.key(12), (6, 8))
  gs = jnp.array([2, 0, 3, 1], jnp.int32)
  model = fl.nnx.quantize_model(ProjThenMoe(), fl.delayed_scaling(history_length=4),
                                example=(x, gs))
  _, g = nnx.jit(lambda m: fl.nnx.value_and_grad(lambda m: m(x, gs).sum())(m))(model)
  fl.nnx.Optimizer(model, optax.sgd(0.0)).update(model, g)  # trained quantization state
  graphdef, state = nnx.split(fl.nnx.convert(model, x, gs))
  report = compile_for(t, lambda s, x, g: nnx.merge(graphdef, s)(x, g), state,
                       x.astype(jnp.bfloat16), gs)
  # The projection's GEMM and the experts' grouped GEMM, both from the e4m3 codes stored.
  assert report.classes == {"fp8": 2}, report.classes
