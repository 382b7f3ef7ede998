"""fl.nnx layers and their Linen twins agree bit for bit (outputs, gradients, new state) and
compile the same program: one product layer (fp8_linen.families) runs under both APIs."""

import difflib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8_linen as fl
import fp8_linen.nnx as fnnx

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
CONV_RECIPES = ["delayed", "current", "int_ste", "int8_lsq"]


def _used_state(owg):
  """A non-trivial state (histories with values) so delayed scaling reads them."""
  out = {}
  for k, v in owg.items():
    if k.endswith("amax_history"):
      v = jnp.linspace(0.5, 2.0, v.shape[0], dtype=jnp.float32)
    out[k] = v
  return out


def _program(step, *args) -> str:
  step.__name__ = step.__qualname__ = "step"  # the program is named after the function
  return jax.jit(step).lower(*args).as_text()


def _assert_same_program(linen_call, nnx_model, nnx_call, variables, arrays, ct):
  """The Linen and the NNX training step lower to the same StableHLO, op for op.

  Both steps take the same flat arguments (parameters and state by name, the
  inputs) and return the same things (output, input gradients, parameter and
  state gradients), so the programs can only differ where the layers do.
  """
  params, state = dict(variables.get("params", {})), dict(variables.get(fl.OWG, {}))
  pn, sn = sorted(params), sorted(state)
  argnums = tuple(range(len(arrays) + 2))

  def linen_step(p, s, *arrays):
    def loss(p, s, *arrays):
      v = {"params": dict(zip(pn, p)), fl.OWG: dict(zip(sn, s))}
      return (linen_call(v, *arrays) * ct).sum()
    return jax.value_and_grad(loss, argnums=argnums)(p, s, *arrays)

  graphdef, _ = nnx.split(nnx_model)

  def nnx_step(p, s, *arrays):
    def loss(p, s, *arrays):
      m = nnx.merge(graphdef, nnx.State(dict(zip(pn, p))), nnx.State(dict(zip(sn, s))))
      return (nnx_call(m, *arrays) * ct).sum()
    return jax.value_and_grad(loss, argnums=argnums)(p, s, *arrays)

  args = ([params[k] for k in pn], [state[k] for k in sn], *arrays)
  linen_text, nnx_text = _program(linen_step, *args), _program(nnx_step, *args)
  assert linen_text == nnx_text, "".join(difflib.unified_diff(
      linen_text.splitlines(True), nnx_text.splitlines(True), "linen", "nnx", n=2))


def _check(linen_model, nnx_model, x):
  variables = jax.jit(linen_model.init)(jax.random.key(0), x)
  variables = {"params": variables["params"], fl.OWG: _used_state(variables.get(fl.OWG, {}))}
  nnx.update(nnx_model, nnx.State(dict(variables["params"])))
  for k, v in variables[fl.OWG].items():
    getattr(nnx_model, k)[...] = v
  r = jax.random.normal(jax.random.key(5), jax.eval_shape(linen_model.apply, variables, x).shape)

  # Both jitted (op by op, a quantized backward costs seconds); the programs are
  # compared below as well.
  y_l, (g_l, dx_l) = jax.jit(jax.value_and_grad(
      lambda v, x: (linen_model.apply(v, x) * r).sum(), argnums=(0, 1)))(variables, x)
  y_n, (g_n, dx_n) = nnx.jit(nnx.value_and_grad(
      lambda m, x: (m(x) * r).sum(), argnums=(nnx.DiffState(0, fnnx.DIFF), 1)))(nnx_model, x)
  np.testing.assert_array_equal(y_l, y_n)
  np.testing.assert_array_equal(dx_l, dx_n)
  g_n = nnx.to_pure_dict(g_n)
  for k, v in {**g_l["params"], **g_l.get(fl.OWG, {})}.items():
    np.testing.assert_array_equal(v, g_n[k], err_msg=k)
  assert set(g_n) == set(g_l["params"]) | set(g_l.get(fl.OWG, {}))
  _assert_same_program(linen_model.apply, nnx_model, lambda m, x: m(x), variables, (x,), r)


@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_matches_qdense(name):
  recipe = RECIPES[name]
  x = jax.random.normal(jax.random.key(1), (8, 64))
  _check(fl.QDense(16, recipe=recipe), fnnx.Linear(64, 16, recipe=recipe, rngs=nnx.Rngs(0)), x)


# (QDenseGeneral arguments, LinearGeneral arguments, input shape): one contracted
# axis to several features, several contracted axes, a batch axis in the kernel.
GENERAL = {
    "features": (dict(features=(2, 8), axis=-1), dict(in_features=32, out_features=(2, 8)),
                 (4, 3, 32)),
    "axes": (dict(features=16, axis=(-2, -1)),
             dict(in_features=(4, 16), out_features=16, axis=(-2, -1)), (3, 4, 16)),
    "batch": (dict(features=8, axis=-1, batch_dims=0),
              dict(in_features=32, out_features=8, batch_axis={0: 2}), (2, 6, 32)),
}


@pytest.mark.parametrize("case", list(GENERAL))
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_general_matches_qdense_general(name, case):
  recipe = RECIPES[name]
  linen_kw, nnx_kw, x_shape = GENERAL[case]
  x = jax.random.normal(jax.random.key(1), x_shape)
  _check(fl.QDenseGeneral(**linen_kw, recipe=recipe),
         fnnx.LinearGeneral(**nnx_kw, recipe=recipe, rngs=nnx.Rngs(0)), x)


# (equation, kernel shape, bias, input shape): a plain projection with a bias,
# heads as a kernel batch axis, two contracted axes, a kernel axis summed away.
EINSUMS = {
    "proj": ("btd,dh->bth", (32, 16), True, (2, 4, 32)),
    "heads": ("btd,hdk->bthk", (2, 32, 8), False, (2, 4, 32)),
    "two_contracted": ("btnd,nde->bte", (2, 16, 8), True, (2, 4, 2, 16)),
    "summed": ("bd,dhx->bh", (32, 8, 2), False, (4, 32)),
}


@pytest.mark.parametrize("case", list(EINSUMS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_einsum_matches_qeinsum(name, case):
  recipe = RECIPES[name]
  equation, kernel_shape, bias, x_shape = EINSUMS[case]
  x = jax.random.normal(jax.random.key(1), x_shape)
  bias_shape = (kernel_shape[-1],) if bias else None
  _check(fl.QEinsum(shape=kernel_shape, einsum_str=equation, use_bias=bias, recipe=recipe),
         fnnx.Einsum(equation, kernel_shape, bias_shape, recipe=recipe, rngs=nnx.Rngs(0)), x)


@pytest.mark.parametrize("name", CONV_RECIPES)
def test_conv_matches_qconv(name):
  recipe = RECIPES[name]
  x = jax.random.normal(jax.random.key(1), (2, 6, 6, 3))
  _check(fl.QConv(4, (3, 3), recipe=recipe),
         fnnx.Conv(3, 4, (3, 3), recipe=recipe, rngs=nnx.Rngs(0)), x)


def test_quantizer_matches_fp8_activation():
  x = 3.0 * jax.random.normal(jax.random.key(1), (4, 8))
  lin = fl.Fp8Activation()
  v = lin.init(jax.random.key(0), x)
  v = {fl.OWG: _used_state(v[fl.OWG])}
  q = fnnx.Quantizer()
  for k, val in v[fl.OWG].items():
    getattr(q, k)[...] = val
  g_l = jax.jit(jax.grad(lambda v, x: (100.0 * lin.apply(v, x)).sum(), argnums=(0, 1)))(v, x)
  g_n = nnx.jit(nnx.grad(lambda q, x: (100.0 * q(x)).sum(),
                         argnums=(nnx.DiffState(0, fnnx.DIFF), 1)))(q, x)
  np.testing.assert_array_equal(g_l[1], g_n[1])
  for k, val in g_l[0][fl.OWG].items():
    np.testing.assert_array_equal(val, nnx.to_pure_dict(g_n[0])[k], err_msg=k)
  _assert_same_program(lin.apply, q, lambda m, x: m(x), v, (x,), jnp.full(x.shape, 100.0))


# Attention scores (both operands activations), and multi-query attention's single
# key head: a size-1 axis broadcast against the query heads, squeezed out of the GEMM.
FP8_EINSUMS = {"scores": ("bqhd,bkhd->bhqk", (2, 3, 4, 8), (2, 5, 4, 8)),
               "mqa": ("bqhd,bkhd->bhqk", (2, 3, 4, 8), (2, 5, 1, 8))}


@pytest.mark.parametrize("case", list(FP8_EINSUMS))
@pytest.mark.parametrize("name", [n for n in RECIPES if n != "int8_lsq" and n != "int4_lsq_plus"])
def test_fp8_einsum_compiles_as_linen_s(name, case):
  recipe = RECIPES[name]
  eq, lhs_shape, rhs_shape = FP8_EINSUMS[case]
  lhs = jax.random.normal(jax.random.key(1), lhs_shape)
  rhs = jax.random.normal(jax.random.key(2), rhs_shape)
  linen = fl.Fp8Einsum(recipe=recipe)
  v = jax.jit(lambda k, l, r: linen.init(k, eq, l, r))(jax.random.key(0), lhs, rhs)
  v = {fl.OWG: _used_state(v.get(fl.OWG, {}))}
  model = fnnx.Fp8Einsum(recipe=recipe)
  out = jax.eval_shape(lambda v, l, r: linen.apply(v, eq, l, r), v, lhs, rhs)
  ct = jax.random.normal(jax.random.key(3), out.shape)
  _assert_same_program(lambda v, l, r: linen.apply(v, eq, l, r), model,
                       lambda m, l, r: m(eq, l, r), v, (lhs, rhs), ct)
