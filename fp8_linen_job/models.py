"""Models of the main job, built from flax.linen blocks with injectable layers.

Each model takes a ``dense_cls`` (and the CNN a ``conv_cls``) field, in the
spirit of flax's ``dot_general_cls``: the ``bf16`` arm passes ``nn.Dense`` /
``nn.Conv``, a quantized arm passes e.g. ``functools.partial(fp8_linen.QDense,
recipe=...)``. The injected class is called like its flax counterpart:
``dense_cls(features, dtype=..., name=...)`` and
``conv_cls(features, kernel_size, dtype=..., name=...)``.

Embeddings, layer norms, attention score math and (by default) the output
head stay plain flax in the compute ``dtype``; only the injected layers change
between arms.

The same models are also written in Flax NNX (:class:`NnxTransformerLM`,
:class:`NnxDigitsCNN`; ``api: nnx``), with the same variable trees, and run by
the job's functional train loop through :class:`NnxAsLinen`.
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp

import fp8_linen as fl

ModuleFactory = Callable[..., nn.Module]


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention with injected projections.

  Attributes:
    num_heads: Number of attention heads.
    dense_cls: Builds the ``qkv`` and ``out`` projections.
    dtype: Compute dtype.
  """

  num_heads: int
  dense_cls: ModuleFactory = nn.Dense
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head_dim = width // self.num_heads
    qkv = self.dense_cls(3 * width, dtype=self.dtype, name='qkv')(x)
    q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.num_heads,
                                    head_dim), 3, axis=2)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    y = y.reshape(batch, length, width)
    return self.dense_cls(width, dtype=self.dtype, name='out')(y)


class Mlp(nn.Module):
  """Two injected dense layers with a GELU between them.

  Attributes:
    hidden: Width of the hidden layer.
    dense_cls: Builds ``fc1`` and ``fc2``.
    dtype: Compute dtype.
  """

  hidden: int
  dense_cls: ModuleFactory = nn.Dense
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.dense_cls(self.hidden, dtype=self.dtype, name='fc1')(x)
    h = nn.gelu(h)
    return self.dense_cls(x.shape[-1], dtype=self.dtype, name='fc2')(h)


class Block(nn.Module):
  """Pre-norm transformer block.

  Attributes:
    num_heads: Attention heads.
    mlp_ratio: MLP width as a multiple of the model width.
    dense_cls: Builds every dense layer of the block.
    dtype: Compute dtype.
  """

  num_heads: int
  mlp_ratio: int = 4
  dense_cls: ModuleFactory = nn.Dense
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    h = nn.LayerNorm(dtype=self.dtype, name='ln1')(x)
    x = x + CausalSelfAttention(self.num_heads, self.dense_cls, self.dtype,
                                name='attn')(h)
    h = nn.LayerNorm(dtype=self.dtype, name='ln2')(x)
    return x + Mlp(self.mlp_ratio * x.shape[-1], self.dense_cls, self.dtype,
                   name='mlp')(h)


class TransformerLM(nn.Module):
  """Decoder-only byte-level transformer language model.

  Attributes:
    vocab_size: Number of token ids (256 for bytes).
    max_len: Longest input (size of the learned position table).
    d_model: Residual stream width.
    num_heads: Attention heads per block.
    num_layers: Number of blocks.
    mlp_ratio: MLP width as a multiple of ``d_model``.
    dense_cls: Builds the dense layers inside the blocks.
    head_cls: Builds the vocabulary projection (``None``: ``nn.Dense``).
    dtype: Compute dtype.
  """

  vocab_size: int = 256
  max_len: int = 128
  d_model: int = 128
  num_heads: int = 4
  num_layers: int = 2
  mlp_ratio: int = 4
  dense_cls: ModuleFactory = nn.Dense
  head_cls: ModuleFactory | None = None
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Maps ``int[batch, length]`` tokens to ``float32[batch, length, vocab]``."""
    length = tokens.shape[1]
    x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype,
                 name='embed')(tokens)
    pos = nn.Embed(self.max_len, self.d_model, dtype=self.dtype,
                   name='pos_embed')(jnp.arange(length)[None, :])
    x = x + pos
    for i in range(self.num_layers):
      x = Block(self.num_heads, self.mlp_ratio, self.dense_cls, self.dtype,
                name=f'block{i}')(x)
    x = nn.LayerNorm(dtype=self.dtype, name='ln_f')(x)
    head_cls = self.head_cls or nn.Dense
    logits = head_cls(self.vocab_size, dtype=self.dtype, name='head')(x)
    return logits.astype(jnp.float32)


class DigitsCNN(nn.Module):
  """Small CNN for 8x8 single-channel images.

  Two (or more) 3x3 convolutions with ReLU, a 2x2 average pool, a dense
  hidden layer and a classifier.

  Attributes:
    conv_features: Output channels of each convolution.
    hidden: Width of the dense hidden layer.
    num_classes: Number of classes.
    conv_cls: Builds the convolutions.
    dense_cls: Builds the hidden dense layer.
    head_cls: Builds the classifier (``None``: ``nn.Dense``).
    dtype: Compute dtype.
  """

  conv_features: tuple[int, ...] = (32, 64)
  hidden: int = 128
  num_classes: int = 10
  conv_cls: ModuleFactory = nn.Conv
  dense_cls: ModuleFactory = nn.Dense
  head_cls: ModuleFactory | None = None
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    """Maps ``float[batch, 8, 8, 1]`` images to ``float32[batch, classes]``."""
    x = images.astype(self.dtype)
    for i, features in enumerate(self.conv_features):
      x = self.conv_cls(features, (3, 3), dtype=self.dtype,
                        name=f'conv{i}')(x)
      x = nn.relu(x)
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(self.dense_cls(self.hidden, dtype=self.dtype, name='fc')(x))
    head_cls = self.head_cls or nn.Dense
    logits = head_cls(self.num_classes, dtype=self.dtype, name='head')(x)
    return logits.astype(jnp.float32)


# --- The same models in Flax NNX (``api: nnx``) ------------------------------
#
# Attribute names follow the Linen modules' names (``block0/attn/qkv``,
# ``conv0``, ...), so the variables of both APIs have the same tree and the
# train loop, the checkpoints and the quantization report are shared
# unchanged. Flax's NNX layers use the same default initializers as their
# Linen twins (LeCun normal kernels, zero biases, unit-variance embeddings,
# unit LayerNorm scales) and the same convolution padding ('SAME'); only the
# random draws differ.

NnxFactory = Callable[..., nnx.Module]
"""``dense_cls(in_features, out_features, dtype=..., rngs=...)``; a conv
factory also takes ``kernel_size`` after ``out_features``."""


class NnxCausalSelfAttention(nnx.Module):
  """:class:`CausalSelfAttention` in NNX."""

  def __init__(self, width: int, num_heads: int, dense_cls: NnxFactory, dtype: Any,
               *, rngs: nnx.Rngs):
    self.num_heads = num_heads
    self.qkv = dense_cls(width, 3 * width, dtype=dtype, rngs=rngs)
    self.out = dense_cls(width, width, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head_dim = width // self.num_heads
    qkv = self.qkv(x)
    q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.num_heads,
                                    head_dim), 3, axis=2)
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.out(y.reshape(batch, length, width))


class NnxMlp(nnx.Module):
  """:class:`Mlp` in NNX."""

  def __init__(self, width: int, hidden: int, dense_cls: NnxFactory, dtype: Any,
               *, rngs: nnx.Rngs):
    self.fc1 = dense_cls(width, hidden, dtype=dtype, rngs=rngs)
    self.fc2 = dense_cls(hidden, width, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(nn.gelu(self.fc1(x)))


class NnxBlock(nnx.Module):
  """:class:`Block` in NNX."""

  def __init__(self, width: int, num_heads: int, mlp_ratio: int,
               dense_cls: NnxFactory, dtype: Any, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(width, epsilon=1e-6, dtype=dtype, rngs=rngs)
    self.attn = NnxCausalSelfAttention(width, num_heads, dense_cls, dtype, rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, epsilon=1e-6, dtype=dtype, rngs=rngs)
    self.mlp = NnxMlp(width, mlp_ratio * width, dense_cls, dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class NnxTransformerLM(nnx.Module):
  """:class:`TransformerLM` in NNX: same architecture, same variable tree.

  Args:
    vocab_size: Number of token ids.
    max_len: Longest input.
    d_model: Residual stream width.
    num_heads: Attention heads per block.
    num_layers: Number of blocks (attributes ``block0``, ``block1``, ...).
    mlp_ratio: MLP width as a multiple of ``d_model``.
    dense_cls: Builds the dense layers inside the blocks (``nnx.Linear`` or
      e.g. ``functools.partial(fp8_linen.nnx.Linear, recipe=...)``).
    head_cls: Builds the vocabulary projection (``None``: ``nnx.Linear``).
    dtype: Compute dtype.
    rngs: The ``nnx.Rngs``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> lm = NnxTransformerLM(max_len=8, d_model=8, num_heads=2, num_layers=1,
    ...                       rngs=nnx.Rngs(0))
    >>> lm(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 256)
  """

  def __init__(self, *, vocab_size: int = 256, max_len: int = 128, d_model: int = 128,
               num_heads: int = 4, num_layers: int = 2, mlp_ratio: int = 4,
               dense_cls: NnxFactory = nnx.Linear, head_cls: NnxFactory | None = None,
               dtype: Any = jnp.bfloat16, rngs: nnx.Rngs):
    self.num_layers = num_layers
    self.embed = nnx.Embed(vocab_size, d_model, dtype=dtype, rngs=rngs)
    self.pos_embed = nnx.Embed(max_len, d_model, dtype=dtype, rngs=rngs)
    for i in range(num_layers):
      setattr(self, f'block{i}', NnxBlock(d_model, num_heads, mlp_ratio, dense_cls,
                                          dtype, rngs=rngs))
    self.ln_f = nnx.LayerNorm(d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
    self.head = (head_cls or nnx.Linear)(d_model, vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Maps ``int[batch, length]`` tokens to ``float32[batch, length, vocab]``."""
    x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1])[None, :])
    for i in range(self.num_layers):
      x = getattr(self, f'block{i}')(x)
    return self.head(self.ln_f(x)).astype(jnp.float32)


class NnxDigitsCNN(nnx.Module):
  """:class:`DigitsCNN` in NNX: same architecture, same variable tree.

  Args:
    conv_features: Output channels of each 3x3 convolution (attributes
      ``conv0``, ``conv1``, ...).
    hidden: Width of the dense hidden layer (``fc``).
    num_classes: Number of classes (``head``).
    conv_cls: Builds the convolutions (``nnx.Conv`` or e.g.
      ``functools.partial(fp8_linen.nnx.Conv, recipe=...)``).
    dense_cls: Builds the hidden dense layer.
    head_cls: Builds the classifier (``None``: ``nnx.Linear``).
    dtype: Compute dtype.
    image_size: Height and width of the (square) input images.
    in_channels: Channels of the input images.
    rngs: The ``nnx.Rngs``.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> cnn = NnxDigitsCNN(conv_features=(4,), hidden=8, rngs=nnx.Rngs(0))
    >>> cnn(jnp.zeros((2, 8, 8, 1))).shape, cnn.fc.kernel.shape
    ((2, 10), (64, 8))
  """

  def __init__(self, *, conv_features: tuple[int, ...] = (32, 64), hidden: int = 128,
               num_classes: int = 10, conv_cls: NnxFactory = nnx.Conv,
               dense_cls: NnxFactory = nnx.Linear, head_cls: NnxFactory | None = None,
               dtype: Any = jnp.bfloat16, image_size: int = 8, in_channels: int = 1,
               rngs: nnx.Rngs):
    self.num_convs = len(conv_features)
    self.dtype = dtype
    channels = in_channels
    for i, features in enumerate(conv_features):
      setattr(self, f'conv{i}', conv_cls(channels, features, (3, 3), dtype=dtype, rngs=rngs))
      channels = features
    # 'SAME' convolutions keep the image size; the 2x2 pool halves it.
    pooled = (image_size // 2) ** 2 * channels
    self.fc = dense_cls(pooled, hidden, dtype=dtype, rngs=rngs)
    self.head = (head_cls or nnx.Linear)(hidden, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    """Maps ``float[batch, 8, 8, 1]`` images to ``float32[batch, classes]``."""
    x = images.astype(self.dtype)
    for i in range(self.num_convs):
      x = nn.relu(getattr(self, f'conv{i}')(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(self.fc(x.reshape(x.shape[0], -1)))
    return self.head(x).astype(jnp.float32)


class NnxAsLinen:
  """An NNX model behind Linen's functional ``init``/``apply``.

  The train loop of the job is functional (a train state holding a variables
  dict); this adapter lets an NNX model run in it unchanged. ``init`` builds
  the model and returns its variables as ``{'params': ..., OWG: ...}`` pure
  dicts (``nnx.Param`` and :class:`fp8_linen.nnx.QuantState`);
  ``apply(variables, x)`` merges them into the model's graph and calls it. The
  quantized layers return the new state as the gradient of the
  ``QuantState`` s, so ``fp8_linen.TrainState`` writes it back exactly as for
  the Linen layers' OWG collection.

  Args:
    build: ``rngs -> nnx.Module``.
    calibrate: Run :func:`fp8_linen.nnx.calibrate` on the example input at
      ``init`` (learned LSQ activation steps start from data, as the Linen
      layers' do at ``init``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> m = NnxAsLinen(lambda rngs: nnx.Linear(3, 2, rngs=rngs))
    >>> v = m.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> sorted(v), m.apply(v, jnp.ones((4, 3))).shape
    (['params'], (4, 2))
  """

  def __init__(self, build: Callable[[nnx.Rngs], nnx.Module], *, calibrate: bool = False):
    self.build = build
    self.calibrate = calibrate
    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    self.graphdef, _, _, rest = nnx.split(abstract, nnx.Param, fl.nnx.QuantState, ...)
    if jax.tree.leaves(rest):
      raise ValueError('NnxAsLinen: the model holds variables other than nnx.Param and '
                       f'fp8_linen.nnx.QuantState: {rest}')

  def init(self, key: jax.Array, example: jax.Array) -> dict[str, Any]:
    """The variables of a model built from ``key``."""
    model = self.build(nnx.Rngs(key))
    if self.calibrate:
      fl.nnx.calibrate(model, example)
    _, params, state = nnx.split(model, nnx.Param, fl.nnx.QuantState)
    variables = {'params': nnx.to_pure_dict(params)}
    if jax.tree.leaves(state):
      variables[fl.OWG] = nnx.to_pure_dict(state)
    return variables

  def model(self, variables: dict[str, Any]) -> nnx.Module:
    """The NNX model holding ``variables``."""
    states = [nnx.State(variables['params']), nnx.State(variables.get(fl.OWG, {}))]
    return nnx.merge(self.graphdef, *states, nnx.State({}))

  def apply(self, variables: dict[str, Any], x: jax.Array) -> jax.Array:
    """The model with ``variables`` called on ``x``."""
    return self.model(variables)(x)

  def convert(self, variables: dict[str, Any], example: jax.Array):
    """The served model (:func:`fp8_linen.nnx.convert`) of the model holding ``variables``.

    Returns:
      ``(apply, state)``: ``apply(state, x)`` runs the served NNX model, whose
      variables (int8/int4/fp8 kernel codes, scales, biases) are ``state``.
    """
    graphdef, state = nnx.split(fl.nnx.convert(self.model(variables), example))
    return (lambda state, x: nnx.merge(graphdef, state)(x)), state
