"""NNX models written the way MaxText (NNX) and EasyDeL write theirs, small.

Their projections are modules of their own (MaxText's ``DenseGeneral``: a
kernel of shape ``(in, *out)`` contracted by ``jax.lax.dot_general``;
EasyDeL's ``ParallelLinear``: ``dot_general`` with a bias and a precision),
attention is ``jnp.einsum``, norms multiply a scale by einsum, the decoder
layers are an ``nnx.List`` run under ``nnx.remat``, and the logits head is
the embedding table (``jnp.dot`` with its transpose). ``fl.nnx.quantize_model``
must reach every projection with ``fl.projection_rules()``, keep attention and
the head in high precision, and train close to float.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fp8_linen as fl


class DenseGeneral(nnx.Module):
  """MaxText-style: kernel ``(in, *out)``, ``dot_general`` over the last input axis."""

  def __init__(self, d_in, out, seed):
    out = (out,) if isinstance(out, int) else tuple(out)
    self.kernel = nnx.Param(jax.random.normal(jax.random.key(seed), (d_in, *out)) / d_in**0.5)

  def __call__(self, x):
    return jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())))


class ParallelLinear(nnx.Module):
  """EasyDeL-style: ``dot_general`` with a precision argument and a bias."""

  def __init__(self, d_in, d_out, seed):
    self.kernel = nnx.Param(jax.random.normal(jax.random.key(seed), (d_in, d_out)) / d_in**0.5)
    self.bias = nnx.Param(jnp.zeros((d_out,)))

  def __call__(self, x):
    y = jax.lax.dot_general(x, self.kernel[...], (((x.ndim - 1,), (0,)), ((), ())),
                            precision=jax.lax.Precision.DEFAULT)
    return y + self.bias[...]


class RMSNorm(nnx.Module):
  def __init__(self, d):
    self.scale = nnx.Param(jnp.ones((d,)))

  def __call__(self, x):
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return jnp.einsum("...k,k->...k", x, self.scale[...])  # a multiply, not a GEMM


class Block(nnx.Module):
  def __init__(self, d, heads, seed):
    self.heads = heads
    self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
    self.qkv = DenseGeneral(d, (3, heads, d // heads), seed)
    self.out = DenseGeneral(d, d, seed + 1)  # applied to the merged heads
    self.gate, self.up = ParallelLinear(d, 2 * d, seed + 2), ParallelLinear(d, 2 * d, seed + 3)
    self.down = ParallelLinear(2 * d, d, seed + 4)

  def __call__(self, x):
    b, t, d = x.shape
    qkv = self.qkv(self.norm1(x))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / (d // self.heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
    x = x + self.out(a)
    h = self.norm2(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Decoder(nnx.Module):
  def __init__(self, vocab=97, d=32, heads=4, layers=2):
    self.embedding = nnx.Param(jax.random.normal(jax.random.key(0), (vocab, d)) * 0.3)
    self.layers = nnx.List([Block(d, heads, 10 * i + 1) for i in range(layers)])
    self.norm = RMSNorm(d)

  def __call__(self, ids):
    x = jnp.take(self.embedding[...], ids, axis=0)
    for layer in self.layers:
      x = nnx.remat(lambda m, x: m(x))(layer, x)
    return jnp.dot(self.norm(x), self.embedding[...].T)  # the tied head


IDS = jax.random.randint(jax.random.key(1), (4, 16), 0, 97)


def test_every_projection_quantized_attention_and_tied_head_kept():
  model = fl.nnx.quantize_model(Decoder(), rules=fl.projection_rules(), example=(IDS,))
  sites = sorted("/".join(map(str, k[:-1])) for k, _ in
                 nnx.to_flat_state(nnx.state(model, fl.nnx.QuantState))
                 if k[-1] == "input_scale")
  expected = sorted(f"layers/{i}/{p}/dot_general_0" for i in range(2)
                    for p in ("qkv", "out", "gate", "up", "down"))
  assert sites == expected
  report = fl.nnx.product_report(model, IDS)
  # 10 projections; kept: 2 attention einsums per layer, the head and the 5 norm
  # scales (einsums that contract nothing); nothing unseen.
  assert report.counts == {"quantized": 10, "excluded": 10}
  kept = [p.scope for p in report.products if p.status == "excluded"]
  assert sum("bthd,bshd" in s or "bhts,bshd" in s for s in kept) == 4


def test_training_tracks_float():
  def train(model, steps=6):
    opt = fl.nnx.Optimizer(model, optax.adam(3e-3))

    @nnx.jit
    def step(model, opt):
      def loss_fn(m):
        logits = m(IDS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, IDS[:, 1:]).mean()
      loss, g = fl.nnx.value_and_grad(loss_fn)(model)
      opt.update(model, g)
      return loss

    return np.array([step(model, opt) for _ in range(steps)])

  float_losses = train(Decoder())
  quant = fl.nnx.quantize_model(Decoder(), fl.current_scaling(),
                                rules=fl.projection_rules(), example=(IDS,))
  q_losses = train(quant)
  assert q_losses[-1] < q_losses[0]  # it learns
  np.testing.assert_allclose(q_losses, float_losses, rtol=0.05)
  assert not np.array_equal(q_losses[1:], float_losses[1:])  # and is not float


class _Weight(nnx.Module):
  def __init__(self, shape, seed):
    self.w = nnx.Param(jax.random.normal(jax.random.key(seed), shape) * 0.3)

  def __call__(self):
    return self.w[...]


class ChildWeightMoe(nnx.Module):
  """gemma 4's ``MoERagged`` in NNX: the experts' weights in child modules, reshaped
  before each ``jax.lax.ragged_dot``."""

  def __init__(self, d=8, h=8):
    self.d, self.h = d, h
    self.gating = _Weight((4, 2, h, d), 0)
    self.linear = _Weight((4, h, d), 1)

  def __call__(self, x, group_sizes):
    w = jnp.transpose(self.gating(), (0, 3, 1, 2)).reshape(4, self.d, 2 * self.h)
    gate = jax.lax.ragged_dot(x, w, group_sizes).reshape(-1, 2, self.h)
    return jax.lax.ragged_dot(jax.nn.gelu(gate[:, 0]) * gate[:, 1],
                              jnp.swapaxes(self.linear(), 1, 2), group_sizes)


def test_projection_rules_quantize_experts_whose_weights_live_in_child_modules():
  x = jax.random.normal(jax.random.key(3), (12, 8))
  groups = jnp.array([3, 0, 5, 4])
  model = fl.nnx.quantize_model(ChildWeightMoe(), rules=fl.projection_rules(),
                                example=(x, groups))
  report = fl.nnx.product_report(model, x, groups)
  assert report.counts == {"quantized": 2}, str(report)
  y_f = ChildWeightMoe()(x, groups)
  y_q = model(x, groups)
  assert not np.allclose(np.asarray(y_q), np.asarray(y_f), atol=1e-6)
  np.testing.assert_allclose(np.asarray(y_q), np.asarray(y_f), atol=0.15)


class ShardMapMoe(nnx.Module):
  """MaxText's sparse MoE in NNX: each device's tokens through every expert in a raw
  ``jax.shard_map`` (``check_vma=False`` as MaxText's), the experts closed over."""

  def __init__(self, mesh, check_vma):
    self.mesh, self.check_vma = mesh, check_vma
    self.w = nnx.Param(jax.random.normal(jax.random.key(4), (4, 8, 8)) * 0.3)

  def __call__(self, x, group_sizes):
    P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
    return jax.shard_map(lambda x, gs, w: jax.lax.ragged_dot(x, w, gs[0]), mesh=self.mesh,
                         in_specs=(P("e"), P("e"), P()), out_specs=P("e"),
                         check_vma=self.check_vma)(x, group_sizes, self.w[...])


def test_experts_in_a_shard_map_record_the_global_amax_once():
  # Without vma tracking (MaxText's check_vma=False) JAX sums the closed-over
  # state's gradient over the 4 devices: the histories would be 4 times too
  # large, each device's amax its own. Both settings must train alike.
  mesh = jax.make_mesh((4,), ("e",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:4])
  x = jax.random.normal(jax.random.key(5), (16, 8)) * jnp.arange(1, 17)[:, None] / 16
  groups = jnp.array([[1, 0, 2, 1], [0, 4, 0, 0], [2, 2, 0, 0], [1, 1, 1, 1]], jnp.int32)
  w_grads = []
  for check_vma in (True, False):
    model = fl.nnx.quantize_model(ShardMapMoe(mesh, check_vma),
                                  fl.delayed_scaling(history_length=4), example=(x, groups))
    opt = fl.nnx.Optimizer(model, optax.sgd(0.0))  # nothing changes: histories must not grow

    @nnx.jit
    def step(model, opt):
      _, g = fl.nnx.value_and_grad(lambda m: jnp.sum(m(x, groups) ** 2))(model)
      opt.update(model, g)
      return g.w[...]

    for _ in range(3):
      w_grad = step(model, opt)
    w_grads.append(np.asarray(w_grad))
    (site,) = [s for _, s in nnx.iter_graph(model) if isinstance(s, fl.nnx.ProductSite)]
    np.testing.assert_allclose(np.asarray(site.input_amax_history[...]),
                               [float(jnp.abs(x).max())] * 3 + [0.0], rtol=1e-6)
    w_amax = np.abs(np.asarray(model.w[...])).max(axis=(1, 2))
    np.testing.assert_allclose(np.asarray(site.kernel_amax_history[...])[:, :3],
                               np.repeat(w_amax[:, None], 3, 1), rtol=1e-6)
  # The same scales on every device either way: the same weight gradient, summed once.
  np.testing.assert_allclose(w_grads[1], w_grads[0], rtol=1e-6, atol=1e-6)
  assert np.abs(w_grads[0]).max() > 0


class _ScanLayer(nnx.Module):
  def __init__(self, key):
    self.kernel = nnx.Param(jax.random.normal(key, (8, 8)) * 0.3)

  def __call__(self, x):
    return jnp.tanh(jax.lax.dot_general(x, self.kernel[...], (((1,), (0,)), ((), ()))))


class AxisOneStack(nnx.Module):
  """MaxText's scanned NNX decoder: its layers' parameters stacked on axis 1
  (``param_scan_axis``), the rest of their state on axis 0, moved to axis 0 and
  run by a raw ``jax.lax.scan``."""

  def __init__(self):
    keys = jax.random.split(jax.random.key(0), 3)
    self.layers = nnx.vmap(_ScanLayer, in_axes=0,
                           out_axes=nnx.StateAxes({nnx.Param: 1, ...: 0}))(keys)

  def __call__(self, x):
    graphdef, params, state = nnx.split(self.layers, nnx.Param, ...)
    params = jax.tree.map(lambda p: jnp.moveaxis(p, 1, 0), params)

    def body(h, xs):
      return nnx.merge(graphdef, *xs)(h), None

    return jax.lax.scan(body, x, (params, state))[0]


def test_layers_stacked_on_axis_one_get_a_state_each():
  x = jax.random.normal(jax.random.key(6), (4, 8))
  model = fl.nnx.quantize_model(AxisOneStack(), fl.delayed_scaling(history_length=4),
                                rules=fl.projection_rules(), example=(x,))
  report = fl.nnx.product_report(model, x)
  assert report.counts == {"quantized": 1}, str(report)  # was skipped: axis 0 stacks only
  (site,) = [s for _, s in nnx.iter_graph(model) if isinstance(s, fl.nnx.ProductSite)]
  assert site.kernel_amax_history[...].shape == (3, 4)  # one history per layer
  y_q, y_f = model(x), AxisOneStack()(x)
  assert not np.allclose(np.asarray(y_q), np.asarray(y_f), atol=1e-6)
  np.testing.assert_allclose(np.asarray(y_q), np.asarray(y_f), atol=0.1)
