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
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

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
