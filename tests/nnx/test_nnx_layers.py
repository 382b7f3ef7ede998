"""fl.nnx layers: drop-in params, every recipe, the state protocol, seed-002 numerics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8_linen as fl
import fp8_linen.nnx as fnnx
from fp8_linen.nnx import access as nnx_access

RECIPES = {
    "delayed": fl.Fp8Recipe(),
    "current": fl.current_scaling(),
    "rowwise": fl.rowwise_scaling(),
    "mx": fl.mx_block_scaling(),
    "nvfp4": fl.nvfp4(scaling="delayed"),
    "int_ste": fl.IntRecipe(),
    "int8_lsq": fl.int8_lsq(),
    "int4_lsq_plus": fl.int4_lsq_plus(),
}


def _x(shape, seed=1, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def _quant_values(model):
  return jax.tree.leaves(nnx.as_pure(nnx.state(model, fnnx.QuantState)))


def _out_shape(module, *args):
  """The output shape, traced only: op by op, a quantized forward costs seconds."""
  return nnx.eval_shape(lambda m, *a: m(*a), module, *args).shape


def _grad(loss):
  """``fnnx.grad(loss)`` jitted: op by op, a quantized backward costs seconds."""
  return nnx.jit(fnnx.grad(loss))


def _assert_concrete(model):
  for v in _quant_values(model):
    assert isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer), type(v)
  for chains in nnx_access._CHAINS.values():
    for chain in chains.held():
      assert not isinstance(chain, jax.core.Tracer)


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_every_recipe_trains(name):
  recipe = RECIPES[name]
  model = fnnx.Linear(64, 8, recipe=recipe, rngs=nnx.Rngs(0))
  x = _x((4, 64))
  fnnx.calibrate(model, x)
  opt = fnnx.Optimizer(model, optax.sgd(0.1))
  before = nnx.as_pure(nnx.state(model, fnnx.QuantState))

  @nnx.jit
  def step(model, opt, x):
    loss, grads = fnnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss

  assert np.isfinite(float(step(model, opt, x)))
  _assert_concrete(model)
  after = nnx.as_pure(nnx.state(model, fnnx.QuantState))
  if jax.tree.leaves(before):  # fp8 state or an STE observer range: it moved
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after)))
  assert all(np.isfinite(v).all() for v in jax.tree.leaves(after))


def test_float_nnx_params_load():
  ref = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  q = fnnx.Linear(16, 4, rngs=nnx.Rngs(1))
  assert jax.tree.map(jnp.shape, nnx.state(ref, nnx.Param)) == \
      jax.tree.map(jnp.shape, nnx.state(q, nnx.Param))
  nnx.update(q, nnx.state(ref, nnx.Param))
  x = _x((8, 16))
  forward = nnx.jit(lambda m, x: m(x))   # op by op, a quantized forward costs seconds
  np.testing.assert_allclose(forward(q, x), forward(ref, x), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("recipe", [fl.Fp8Recipe(), fl.IntRecipe(), fl.int8_lsq()],
                         ids=["fp8", "int_ste", "int8_lsq"])
def test_other_layers(recipe):
  x3 = _x((2, 5, 8))
  lg = fnnx.LinearGeneral(8, (2, 4), recipe=recipe, rngs=nnx.Rngs(0))
  assert _out_shape(lg, x3) == (2, 5, 2, 4)
  assert lg.kernel[...].shape == nnx.LinearGeneral(8, (2, 4), rngs=nnx.Rngs(0)).kernel.shape
  conv = fnnx.Conv(3, 4, (3, 3), recipe=recipe, rngs=nnx.Rngs(0))
  assert _out_shape(conv, _x((1, 6, 6, 3))) == (1, 6, 6, 4)
  es = fnnx.Einsum("btd,dh->bth", (8, 4), (4,), recipe=recipe, rngs=nnx.Rngs(0))
  assert _out_shape(es, x3) == (2, 5, 4)
  for layer, x in ((lg, x3), (conv, _x((1, 6, 6, 3))), (es, x3)):
    fnnx.calibrate(layer, x)
    grads = _grad(lambda m, x: jnp.sum(m(x) ** 2))(layer, x)
    fnnx.update_state(layer, grads)
    _assert_concrete(layer)


# Kernels with a batch axis, several contracted axes, a summed axis, an ellipsis.
EINSUMS = [("btd,dh->bth", (8, 4), (2, 5, 8)), ("btd,hdk->bthk", (2, 8, 3), (2, 5, 8)),
           ("btnd,nde->bte", (2, 8, 4), (2, 5, 2, 8)), ("bd,dhx->bh", (8, 3, 2), (4, 8)),
           ("...nd,...ndh->...nh", (2, 8, 4), (3, 2, 8))]


@pytest.mark.parametrize("name", ["int8_lsq", "int4_lsq_plus"])
@pytest.mark.parametrize("equation,kernel_shape,x_shape", EINSUMS,
                         ids=[e[0] for e in EINSUMS])
def test_einsum_learned_weight_steps_match_qeinsum(name, equation, kernel_shape, x_shape):
  recipe = RECIPES[name]
  x = _x(x_shape)
  linen = fl.QEinsum(shape=kernel_shape, einsum_str=equation, use_bias=False, recipe=recipe)
  # Shapes only, traced: op by op, a quantized forward costs seconds.
  want = jax.tree.map(jnp.shape, jax.eval_shape(linen.init, jax.random.key(0), x)["params"])
  layer = fnnx.Einsum(equation, kernel_shape, recipe=recipe, rngs=nnx.Rngs(0))
  got = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
  assert got == want
  assert "kernel_step" in got and ("kernel_offset" in got) == (name == "int4_lsq_plus")
  assert _out_shape(layer, x) == jax.eval_shape(
      lambda k, x: linen.apply(linen.init(k, x), x), jax.random.key(0), x).shape


@pytest.mark.parametrize("name", ["int8_lsq", "int4_lsq_plus"])
def test_einsum_learned_weight_steps_train(name):
  x = _x((16, 6, 8))
  target = jnp.tanh(jnp.einsum("btd,dh->bth", x, _x((8, 4), seed=2)))
  model = fnnx.Einsum("btd,dh->bth", (8, 4), (4,), recipe=RECIPES[name], rngs=nnx.Rngs(0))
  assert model.kernel_step[...].shape == (1, 4)  # per output channel
  fnnx.calibrate(model, x)
  step0 = model.kernel_step[...]
  opt = fnnx.Optimizer(model, optax.adam(2e-2))

  @nnx.jit
  def step(model, opt):
    loss, grads = fnnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt)) for _ in range(8)]
  assert losses[-1] < 0.8 * losses[0], losses
  assert not np.array_equal(model.kernel_step[...], step0)
  assert np.isfinite(model.kernel_step[...]).all() and (model.kernel_step[...] > 0).all()


def test_seed_002_quantizer_gradient_and_state():
  """x = 5 through the quantizer: cotangent 1 -> 1, cotangent 1000 -> 1000 (not 448)."""
  def loss(q, x, ct):
    return ct * q(x)

  # Jitted, one program for both cotangents: op by op, a quantized backward costs seconds.
  grad = nnx.jit(nnx.grad(loss, argnums=(nnx.DiffState(0, fnnx.DIFF), 1)))
  for ct in (1.0, 1000.0):
    q = fnnx.Quantizer()
    grads, dx = grad(q, jnp.array(5.0, jnp.float32), jnp.array(ct, jnp.float32))
    assert float(dx) == pytest.approx(ct, rel=2 ** -3)
    fnnx.update_state(q, grads)
    _assert_concrete(q)
    assert float(q.input_amax_history[...][0]) == 5.0
    assert float(q.output_grad_amax_history[...][0]) == ct
    assert float(q.input_scale[...][0]) == pytest.approx(5.0 / 448.0)
    assert float(q.output_grad_scale[...][0]) == pytest.approx(ct / 57344.0)


def test_quantizer_checkpoint_name_and_forward():
  q = fnnx.Quantizer()
  jaxpr = str(jax.make_jaxpr(lambda x: q(x))(jnp.ones((3,))))
  assert fl.CHECKPOINT_NAME in jaxpr


def test_module_called_twice_records_the_max():
  model = fnnx.Linear(4, 4, rngs=nnx.Rngs(0))
  x = _x((2, 4))
  grads = _grad(lambda m, x: m(x).sum() + (5.0 * m(3.0 * x)).sum())(model, x)
  fnnx.update_state(model, grads)
  amax = float(jnp.max(jnp.abs(x)))
  assert float(model.input_amax_history[...][0]) == pytest.approx(3.0 * amax)
  assert float(model.output_grad_amax_history[...][0]) == 5.0
  assert float(model.kernel_amax_history[...][0]) == pytest.approx(
      float(jnp.max(jnp.abs(model.kernel[...]))))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_no_tracer_left_in_module(jit):
  model = fnnx.Linear(4, 4, rngs=nnx.Rngs(0))
  opt = fnnx.Optimizer(model, optax.adam(1e-2))

  def step(model, opt, x):
    loss, grads = fnnx.value_and_grad(lambda m: m(x).sum())(model)
    opt.update(model, grads)
    return loss

  step = nnx.jit(step) if jit else step
  for _ in range(2):
    step(model, opt, _x((2, 4)))
  _assert_concrete(model)
  assert int(opt.step[...]) == 2


def test_missing_quant_state_in_grads_is_an_error():
  model = fnnx.Linear(4, 4, rngs=nnx.Rngs(0))
  opt = fnnx.Optimizer(model, optax.sgd(0.1))
  # Params only; jitted: op by op, a quantized backward costs seconds.
  grads = nnx.jit(nnx.grad(lambda m: m(jnp.ones((1, 4))).sum()))(model)
  with pytest.raises(ValueError, match="DiffState"):
    opt.update(model, grads)
  with pytest.raises(ValueError, match="wrt"):
    fnnx.Optimizer(model, optax.sgd(0.1), wrt=fnnx.DIFF)


def test_bad_recipe_and_override():
  with pytest.raises(TypeError, match="call it"):
    fnnx.Linear(4, 4, recipe=fl.current_scaling, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dot_general"):
    fnnx.Linear(4, 4, dot_general=jax.lax.dot_general, rngs=nnx.Rngs(0))
