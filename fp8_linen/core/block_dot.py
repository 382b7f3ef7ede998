"""The block-scaled fp8 ``dot_general`` (MXFP8, NVFP4): :class:`BlockDot` and its codes.

Every GEMM of the product (forward, dgrad, wgrad) takes its two operands in
blocks of ``recipe.block_size`` along the axis it contracts, each block with
a scale of its own (:mod:`~fp8_linen.core.block_numerics`). :class:`BlockDot`
is the spec :func:`~fp8_linen.core.dot_general.fp8_dot_general` runs for
``granularity='block'`` (under :func:`~fp8_linen.core.fp8_vjp.fp8_vjp`);
:func:`block_factor` and :func:`block_fold_kernel` give the served model the
weight's codes exactly as the QAT forward makes them.

Example:
  >>> import jax.numpy as jnp
  >>> import fp8_linen as fl
  >>> from fp8_linen.core import block_dot
  >>> recipe = fl.mx_block_scaling()
  >>> codes, scales = block_dot.block_fold_kernel(recipe, jnp.ones((64, 8)), (0,), (),
  ...                                             jnp.ones(()))
  >>> codes.shape, scales.shape  # scales of the (B, N, K) view, blocked along K
  ((64, 8), (1, 8, 2))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fp8_linen.core import block_kernels, block_numerics, dims, lowering, numerics, owg, randomness
from fp8_linen.core.fp8_vjp import DotSpec
from fp8_linen.core.lowering import grad_gemm

__all__ = ["BlockDot", "block_factor", "block_codes", "block_fold_kernel"]


def _view(x, first, second, third):
  """``x`` as (B, P, Q): the axes of each group transposed together and flattened."""
  perm = (*first, *second, *third)
  if perm != tuple(range(x.ndim)):
    x = jnp.transpose(x, perm)
  size = lambda group: math.prod(x.shape[perm.index(a)] for a in group)
  return x.reshape(size(first), size(second), size(third))


def _unview(t, shape, first, second, third):
  """Inverse of :func:`_view`: ``t`` (B, P, Q) back into an array of ``shape``."""
  perm = (*first, *second, *third)
  t = t.reshape(tuple(shape[a] for a in perm))
  return t if perm == tuple(range(len(shape))) else jnp.transpose(t, np.argsort(perm))


def _pad(t, axis: int, multiple: int):
  """``t`` zero-padded along ``axis`` to a multiple of ``multiple``."""
  pad = (-t.shape[axis]) % multiple
  if not pad:
    return t
  widths = [(0, 0)] * t.ndim
  widths[axis] = (0, pad)
  return jnp.pad(t, widths)


def _crop(t, axis: int, n: int):
  return block_numerics.lax_slice_axis(t, axis % t.ndim, n)


def block_factor(recipe, cfg, scale, history, a):
  """NVFP4's per-tensor factor (float32 scalar) of a role; 1 for MX.

  ``select_scale`` of the role's :class:`~fp8_linen.ScalingConfig` (delayed:
  the amax history, else ``a``; current: ``a``, the tensor's global amax)
  over 448 (:func:`~fp8_linen.core.numerics.nvfp4_tensor_scale`).
  """
  if not recipe.is_nvfp4:
    return jnp.ones((), jnp.float32)
  return numerics.nvfp4_tensor_scale(numerics.select_scale(cfg, scale, history, a))


def block_codes(recipe, t, cfg, factor, *, tile=False, noise=None):
  """``(q, scales)`` of ``t`` (B, P, Q) blocked along Q, padded to whole blocks.

  ``tile``: one scale per ``block_size`` square (the padded P too), repeated
  on its rows; ``noise``: stochastic rounding (NVFP4's gradient).
  """
  bs = recipe.block_size
  t = _pad(t, 2, bs)
  if tile:
    t = _pad(t, 1, bs)
  return block_numerics.block_quantize(t, bs, cfg.jnp_dtype,
                                       tensor_scale=factor if recipe.is_nvfp4 else None,
                                       tile=tile, noise=noise,
                                       four_over_six=recipe.four_over_six)


def _rhs_groups(ndim: int, contract, batch):
  """The (batch, free, contracting) axes of ``rhs``: its (B, N, K) view."""
  return tuple(batch), tuple(dims.free_dims(ndim, contract, batch)), tuple(contract)


def _forward_kernel(recipe, w3, cfg, factor):
  """``(q_w, s_w, tiles)``: the forward's weight codes (B, N, Kp) blocked along K.

  With ``kernel_2d_blocks`` they are the rows of the weight's tile codes
  (``tiles``: the codes and scales of the tiles, which dgrad reads by
  columns); otherwise ``tiles`` is ``None``.
  """
  if not recipe.kernel_2d_blocks:
    q, s = block_codes(recipe, w3, cfg, factor)
    return q, s, None
  n = w3.shape[1]
  q_t, s_t = block_codes(recipe, w3, cfg, factor, tile=True)     # (B, Np, Kp)
  return _crop(q_t, 1, n), _crop(s_t, 1, n), (q_t, s_t)


def block_fold_kernel(recipe, w, contract, batch, factor):
  """``(codes, scales)``: a weight's forward codes as :class:`BlockDot` multiplies them.

  Args:
    recipe: the block recipe (MXFP8 or NVFP4).
    w: the weight, in the layout the product sees.
    contract: its contracting axes.
    batch: its batch axes.
    factor: NVFP4's per-tensor factor of the weight (:func:`block_factor`).

  Returns:
    ``codes`` in ``w``'s shape (e4m3 / e2m1) and ``scales`` of its (B, N, K)
    view blocked along K, padded to whole blocks: (B, N, ceil(K / block))
    (e8m0 / e4m3; 2-D tiles: each tile's scale on each of its rows).
  """
  w = jnp.asarray(w)
  groups = _rhs_groups(w.ndim, contract, batch)
  w3 = _view(w, *groups)
  q, s, _ = _forward_kernel(recipe, w3, recipe.kernel, factor)
  return _unview(_crop(q, 2, w3.shape[2]), w.shape, *groups), s



class BlockDot(DotSpec):
  """Block scaling (MXFP8, NVFP4) of all three GEMMs, each along the axis it contracts.

  Every product runs on 3-D views: ``lhs`` as (B, M, K), ``rhs`` as (B, N, K)
  and the output gradient as (B, M, N) (batch, free and contracting axes each
  flattened, in ``dot_general``'s order). A block-scaled GEMM multiplies
  operands blocked along the axis it contracts, so each tensor is quantized
  once per GEMM it feeds, from its own values (never requantized): the
  forward takes ``lhs`` and ``rhs`` blocked along K, dgrad the gradient and
  ``rhs`` along N, wgrad the gradient and ``lhs`` along M. The weight's
  ``kernel_2d_blocks`` tiles serve both of its GEMMs with one set of codes;
  ``wgrad_hadamard`` rotates both wgrad operands along M first;
  ``grad_stochastic_rounding`` rounds both gradient copies stochastically.

  ``gemm='block'`` hands the codes and scales to the block-scaled GEMM
  (:func:`~fp8_linen.core.lowering.block_scaled_matmul`). The emulation
  (``'bf16'``/``'f32'``) dequantizes the same codes exactly and runs the
  layer's own ``dot_general`` on them. Both apply NVFP4's per-tensor factors
  to the GEMM output. The served model (:meth:`serve`) multiplies the very
  forward codes of the weight (:func:`block_fold_kernel`, stored once) with
  the input quantized as here, in the same "multiply" half.

  Where :mod:`~fp8_linen.core.block_kernels` runs (a Blackwell GPU, or its
  interpreter), each operand's two copies come from Pallas kernels that
  read it once (MXFP8) or twice (NVFP4: its amaxes, then its codes), with
  the same bits as the ``jnp`` path here.

  Residuals: the codes the backward reads (``lhs`` blocked along M, ``rhs``
  along N), in the operands' layouts, and their scales. Cropping a padded
  block off and zero-padding it again changes nothing: zeros quantize to
  zero codes, and the Hadamard transform leaves a trailing partial group
  alone.
  """

  def _axes(self, lhs_ndim, rhs_ndim):
    (lc, rc), (lb, rb) = self.dn
    return (lb, tuple(dims.free_dims(lhs_ndim, lc, lb)), lc,
            rb, tuple(dims.free_dims(rhs_ndim, rc, rb)), rc)

  def _emulation_dtype(self):
    """The dtype the emulation (``gemm`` ``'bf16'`` / ``'f32'``) dequantizes blocks to.

    bfloat16 (``'f32'``: float32), which holds a dequantized block exactly:
    an fp8 value times a power of two (MX), an e2m1 value times an e4m3
    scale (NVFP4, before its per-tensor factor).
    """
    return jnp.float32 if self.gemm == "f32" else jnp.bfloat16

  def _tensor_scale(self, cfg, state, a):
    """NVFP4's per-tensor factor of a role (its ScalingConfig: delayed or current); MX: 1."""
    return block_factor(self.recipe, cfg, state.scale, state.amax_history, a)

  def _current_scale(self, cfg, t):
    """The per-tensor factor of a rotated copy: always its own amax (no history of it)."""
    return self._factor_of(cfg, lowering.global_max(numerics.amax(t)))

  def _factor_of(self, cfg, a):
    """NVFP4's per-tensor factor for amax ``a`` alone (current scaling); MX: 1."""
    if not self.recipe.is_nvfp4:
      return jnp.ones((), jnp.float32)
    return numerics.nvfp4_tensor_scale(numerics.scale_from_amax(a, jnp.ones((), jnp.float32),
                                                                cfg))

  def _quant(self, t, cfg, g, *, tile=False, seed=None, salt=0):
    """``(q, scales)`` of ``t`` (B, P, Q) blocked along Q (padded to whole blocks).

    ``seed`` (the gradient's copies): stochastic rounding with noise from
    ``seed`` and ``salt``, when the recipe asks for it.
    """
    bs = self.recipe.block_size
    t = _pad(t, 2, bs)
    if tile:
      t = _pad(t, 1, bs)
    noise = (randomness.uniform_noise(t.shape, seed, salt)
             if seed is not None and self.recipe.grad_stochastic_rounding else None)
    return block_codes(self.recipe, t, cfg, g, tile=tile, noise=noise)

  def _rotate(self, t):
    h = self.recipe.wgrad_hadamard
    return randomness.random_hadamard(t, h) if h else t

  def _one_read(self, x, groups, *, weight: bool = False):
    """``x`` as (B, P, Q) when :mod:`~fp8_linen.core.block_kernels` may quantize it, else None.

    The kernels write both copies of a tensor from its own layout, so
    ``groups`` (the axes that become B, P, Q) must need no transpose. MX: the
    second copy is neither rotated nor rounded stochastically, and a weight
    is not in 2-D tiles. NVFP4: blocks of 16, a rotation that fits a tile,
    no 4/6 choice.
    """
    r = self.recipe
    if r.is_nvfp4:
      h = r.wgrad_hadamard
      if r.four_over_six or r.block_size != 16 or (h and (h & (h - 1) or h > 32)):
        return None
    elif r.wgrad_hadamard or r.grad_stochastic_rounding or (weight and r.kernel_2d_blocks):
      return None
    if tuple(a for g in groups for a in g) != tuple(range(x.ndim)):
      return None
    t = _view(x, *groups)
    return t if block_kernels.kernel_mode(t, r.block_size, gemm=self.gemm) else None

  def reads_param(self, rhs) -> bool:
    """Whether a kernel quantizes ``rhs`` (see :meth:`Fp8Spec.reads_param`)."""
    _, _, _, rb, rf, rc = self._axes(0, rhs.ndim)
    return self._one_read(rhs, (rb, rc, rf), weight=True) is not None

  def _both(self, t, cfg, state, *, rotate: bool = False, tiles: bool = False, seed=None,
            round_to=None):
    """Both copies of ``t`` (B, P, Q) from the kernels: along Q, and along P transposed.

    Returns ``((q, s), (q_t, s_t), a, g, g_t)``: the codes, ``t``'s amax and
    the copies' NVFP4 factors (``g_t`` the rotated copy's own). ``rotate``:
    the copy along P is a wgrad operand (NVFP4 rotates it); ``tiles``: the
    weight's 16 x 16 tiles (NVFP4), one set of codes in both layouts;
    ``seed``: the gradient's stochastic rounding; ``round_to``: the dtype
    the kernels round ``t`` to as they read it (a parameter handed uncast).
    """
    r = self.recipe
    if not r.is_nvfp4:
      along_q, along_p, a = block_kernels.mx_codes_both(t, cfg.jnp_dtype, r.block_size,
                                                        round_to=round_to)
      a = lowering.global_max(a)
      g = self._tensor_scale(cfg, state, a)
      return along_q, along_p, a, g, g
    h = r.wgrad_hadamard if rotate else 0
    a, a_t = block_kernels.nvfp4_amaxes(t, h, round_to=round_to)
    a = lowering.global_max(a)
    g = self._tensor_scale(cfg, state, a)
    if tiles:
      along_q, along_p = block_kernels.nvfp4_tile_codes_both(t, g, round_to=round_to)
      return along_q, along_p, a, g, g
    g_t = self._factor_of(cfg, lowering.global_max(a_t)) if h else g
    keys = None
    if seed is not None and r.grad_stochastic_rounding:
      keys = (randomness.noise_key(seed, 1), randomness.noise_key(seed, 2))
    along_q, along_p = block_kernels.nvfp4_codes_both(t, g, g_t, hadamard=h, keys=keys,
                                                      round_to=round_to)
    return along_q, along_p, a, g, g_t

  def _block_gemm(self, a, sa, b, sb, scale, out_dtype):
    """(B, P, Q) x (B, R, Q) -> (B, P, R): the block-scaled GEMM, then NVFP4's tensor factors."""
    nv = self.recipe.is_nvfp4
    y = lowering.block_scaled_matmul(a, b, sa, sb, jnp.float32 if nv else out_dtype)
    return lowering.scaled(y, scale, out_dtype) if nv else y.astype(out_dtype)

  def _dequant(self, q, s, n, shape, groups):
    """Exact dequantization of codes (B, P, Qp) cropped to Q = ``n``, in the layout ``shape``."""
    d = block_numerics.block_dequantize(q, s, self.recipe.block_size, self._emulation_dtype())
    return _unview(_crop(d, 2, n), shape, *groups)

  def forward(self, lhs, rhs, states):
    if lowering.explicit_spec(lhs) is None and lowering.explicit_spec(rhs) is None:
      return self._forward(lhs, rhs, states)
    # The 3-D views merge and split sharded axes, which an explicit mesh
    # makes the user spell out; XLA's partitioner places them instead (auto
    # axes), and the results get the shardings JAX would give them.
    spec = lambda a: lowering.explicit_spec(a)[1] if lowering.explicit_spec(a) else P()
    out = lowering.dot_out_sharding(lhs, rhs, self.dn)
    shardings = (P(*out.spec) if out is not None else P(), (P(*spec(lhs)), P(*spec(rhs))),
                 (P(), P()), (P(), P(), P(), P()))
    return jax.sharding.auto_axes(self._forward, out_sharding=shardings)(lhs, rhs, states)

  def _forward(self, lhs, rhs, states):
    in_cfg, k_cfg, _ = self.cfgs
    lb, lf, lc, rb, rf, rc = self._axes(lhs.ndim, rhs.ndim)
    (q_x, s_x), (q_xc, s_xc), a_x, g_x, g_xc = self._input_codes(lhs, (lb, lf, lc), in_cfg,
                                                                 states[0])
    (q_w, s_w), (q_wc, s_wc), a_w, g_w = self._kernel_codes(rhs, (rb, rf, rc), k_cfg, states[1])
    m, n = math.prod(lhs.shape[a] for a in lf), math.prod(rhs.shape[a] for a in rf)
    y = self._multiply(q_x, s_x, q_w, s_w, g_x * g_w, lhs.shape, rhs.shape)
    res_l = _unview(_crop(q_xc, 2, m), lhs.shape, lb, lc, lf)
    res_r = _unview(_crop(q_wc, 2, n), rhs.shape, rb, rc, rf)
    extras = (owg.name_fp8_residual(s_xc), owg.name_fp8_residual(s_wc), g_xc, g_w)
    return y, (res_l, res_r), (a_x, a_w), extras

  def _input_codes(self, lhs, groups, cfg, state):
    """``lhs``'s codes along K (B, M, Kp) and along M (B, K, Mp), its amax and factors.

    Returns ``((q_x, s_x), (q_xc, s_xc), a_x, g_x, g_xc)``; ``g_xc`` is the
    wgrad copy's NVFP4 factor (its own when that copy is rotated).
    """
    one = self._one_read(lhs, groups)                              # (B, M, K)
    if one is not None:
      return self._both(one, cfg, state, rotate=True)
    x3 = _view(lhs, *groups)
    a = lowering.global_max(numerics.amax(lhs))
    g = self._tensor_scale(cfg, state, a)
    along_k = self._quant(x3, cfg, g)
    # Along M, for wgrad (rotated first: its factor is the rotated copy's own).
    xc = self._rotate(jnp.swapaxes(x3, 1, 2))                        # (B, K, M)
    g_xc = self._current_scale(cfg, xc) if self.recipe.wgrad_hadamard else g
    return along_k, self._quant(xc, cfg, g_xc), a, g, g_xc

  def _kernel_codes(self, rhs, groups, cfg, state):
    """``rhs``'s codes along K (B, N, Kp) and along N (B, K, Np), its amax and factor.

    A parameter handed uncast (``rhs_param_dtype``, only where
    :meth:`reads_param`) is rounded to ``rhs_dtype`` by the kernels as they
    read it.
    """
    rb, rf, rc = groups
    one = self._one_read(rhs, (rb, rc, rf), weight=True)             # (B, K, N)
    if one is not None:
      round_to = self.rhs_dtype if self.rhs_param_dtype is not None else None
      along_n, along_k, a, g, _ = self._both(one, cfg, state, round_to=round_to,
                                             tiles=self.recipe.kernel_2d_blocks)
      return along_k, along_n, a, g
    w3 = _view(rhs, rb, rf, rc)                                      # (B, N, K)
    k = w3.shape[2]
    a = lowering.global_max(numerics.amax(rhs))
    g = self._tensor_scale(cfg, state, a)
    q_w, s_w, tiles = _forward_kernel(self.recipe, w3, cfg, g)       # along K
    if tiles is None:
      return (q_w, s_w), self._quant(jnp.swapaxes(w3, 1, 2), cfg, g), a, g   # along N
    # One set of tile codes: rows of it for the forward (along K), columns
    # for dgrad (along N); a tile's scale is repeated on each of its rows.
    bs = self.recipe.block_size
    q_t, s_t = tiles                                                 # (B, Np, Kp)
    q_wc = _crop(jnp.swapaxes(q_t, 1, 2), 1, k)                     # (B, K, Np)
    s_wc = _crop(jnp.repeat(jnp.swapaxes(s_t[:, ::bs, :], 1, 2), bs, axis=1), 1, k)
    return (q_w, s_w), (q_wc, s_wc), a, g

  def _multiply(self, q_x, s_x, q_w, s_w, factor, lhs_shape, rhs_shape):
    """The forward GEMM of the codes (B, M, Kp) and (B, N, Kp), in the output's layout.

    The "multiply" half of the forward, which the served model runs too
    (:meth:`serve`). ``factor``: the product of NVFP4's two per-tensor
    factors (1 for MX).
    """
    lb, lf, lc, rb, rf, rc = self._axes(len(lhs_shape), len(rhs_shape))
    if self.gemm == "block":
      y = self._block_gemm(q_x, s_x, q_w, s_w, factor, self.out_dtype)
      return y.reshape(tuple(lhs_shape[a] for a in lb + lf) + tuple(rhs_shape[a] for a in rf))
    k = math.prod(lhs_shape[a] for a in lc)
    xd = self._dequant(q_x, s_x, k, lhs_shape, (lb, lf, lc))
    wd = self._dequant(q_w, s_w, k, rhs_shape, (rb, rf, rc))
    y = lowering.lax_dot_general(xd, wd, self.dn, preferred_element_type=jnp.float32,
                                 out_sharding=lowering.dot_out_sharding(xd, wd, self.dn))
    return lowering.scaled(y, factor, self.out_dtype)

  def serve(self, lhs, codes, scales, kernel_factor, input_scale=None):
    """The served forward: ``lhs`` quantized as the QAT forward does, times stored codes.

    Args:
      lhs: the activation.
      codes: the weight's forward codes in its own layout
        (:func:`block_fold_kernel`).
      scales: their block scales, (B, N, ceil(K / block)).
      kernel_factor: the weight's NVFP4 per-tensor factor (MX: 1).
      input_scale: the input role's frozen scale (NVFP4 with delayed
        scaling: the one its amax history gives), or ``None``: the factor
        is taken from this batch's amax, as current scaling does in QAT.

    Returns:
      The product, as :meth:`forward` computes it from the same codes.
    """
    if lowering.explicit_spec(lhs) is None and lowering.explicit_spec(codes) is None:
      return self._serve(lhs, codes, scales, kernel_factor, input_scale)
    out = lowering.dot_out_sharding(lhs, codes, self.dn)
    return jax.sharding.auto_axes(self._serve, out_sharding=P(*out.spec) if out else P())(
        lhs, codes, scales, kernel_factor, input_scale)

  def _serve(self, lhs, codes, scales, kernel_factor, input_scale):
    in_cfg = self.recipe.input
    lb, lf, lc, rb, rf, rc = self._axes(lhs.ndim, codes.ndim)
    x3 = _view(lhs, lb, lf, lc)
    if input_scale is None:
      a_x = lowering.global_max(numerics.amax(lhs))
      g_x = block_factor(self.recipe, in_cfg, jnp.ones((1,), jnp.float32),
                         jnp.zeros((in_cfg.history_length,), jnp.float32), a_x)
    else:
      g_x = (numerics.nvfp4_tensor_scale(input_scale) if self.recipe.is_nvfp4
             else jnp.ones((), jnp.float32))
    q_x, s_x = self._quant(x3, in_cfg, g_x)
    q_w = _pad(_view(codes, rb, rf, rc), 2, self.recipe.block_size)
    return self._multiply(q_x, s_x, q_w, scales, g_x * jnp.reshape(kernel_factor, ()),
                          lhs.shape, codes.shape)

  def backward(self, q_l, q_r, extras, states, g):
    if lowering.explicit_spec(q_l) is None and lowering.explicit_spec(q_r) is None:
      return self._backward(q_l, q_r, extras, states, g)
    spec = lambda a: lowering.explicit_spec(a)[1] if lowering.explicit_spec(a) else P()
    return jax.sharding.auto_axes(
        self._backward, out_sharding=(P(*spec(q_l)), P(*spec(q_r)), P()))(
            q_l, q_r, extras, states, g)

  def _backward(self, q_l, q_r, extras, states, g):
    s_xc, s_wc, g_xc, g_w = extras
    g_cfg = self.cfgs[2]
    bs = self.recipe.block_size
    lb, lf, lc, rb, rf, rc = self._axes(q_l.ndim, q_r.ndim)
    xc = _pad(_view(q_l, lb, lc, lf), 2, bs)                         # (B, K, Mp)
    wc = _pad(_view(q_r, rb, rc, rf), 2, bs)                         # (B, K, Np)
    b = xc.shape[0]
    m, n = math.prod(q_l.shape[a] for a in lf), math.prod(q_r.shape[a] for a in rf)
    g3 = g.reshape(b, m, n)
    one_g = self._one_read(g3, ((0,), (1,), (2,)))
    # Stochastic rounding draws its bits from the gradient role's state (this
    # layer's amax history: it changes every step and is the same on every
    # device of a mesh, unlike the gradient's own last bits).
    seed = randomness.bits_seed(states[2].scale, states[2].amax_history)
    if one_g is not None:
      # Along N for dgrad and along M for wgrad, from one read of g.
      (q_g1, s_g1), (q_g2, s_g2), a_g, g_g, g_gt = self._both(one_g, g_cfg, states[2],
                                                              rotate=True, seed=seed)
    else:
      a_g = lowering.global_max(numerics.amax(g, columns_first=True))
      g_g = self._tensor_scale(g_cfg, states[2], a_g)
      q_g1, s_g1 = self._quant(g3, g_cfg, g_g, seed=seed, salt=1)   # along N, for dgrad
      gt = self._rotate(jnp.swapaxes(g3, 1, 2))                      # (B, N, M)
      g_gt = self._current_scale(g_cfg, gt) if self.recipe.wgrad_hadamard else g_g
      q_g2, s_g2 = self._quant(gt, g_cfg, g_gt, seed=seed, salt=2)  # along M, for wgrad
    if self.gemm == "block":
      d_l = self._block_gemm(q_g1, s_g1, wc, s_wc, g_g * g_w, self.lhs_dtype)   # (B, M, K)
      # (B, K, N): the kernel's own layout, so no transposed copy of its gradient.
      d_r = self._block_gemm(xc, s_xc, q_g2, s_g2, g_gt * g_xc, self.rhs_dtype)
      return (_unview(d_l, q_l.shape, lb, lf, lc), _unview(d_r, q_r.shape, rb, rc, rf), a_g)
    one = jnp.ones((), jnp.float32)
    nd = (q_l.ndim, q_r.ndim)
    up = self._emulation_dtype()
    gd1 = _crop(block_numerics.block_dequantize(q_g1, s_g1, bs, up), 2, n).reshape(g.shape)
    wd = self._dequant(wc, s_wc, n, q_r.shape, (rb, rc, rf))
    d_l = grad_gemm(gd1, wd, self.dn, *nd, "lhs", "fp8", jnp.float32, one, like=q_l)
    gd2 = _crop(block_numerics.block_dequantize(q_g2, s_g2, bs, up), 2, m)
    gd2 = jnp.swapaxes(gd2, 1, 2).reshape(g.shape)
    xd = self._dequant(xc, s_xc, m, q_l.shape, (lb, lc, lf))
    d_r = grad_gemm(gd2, xd, self.dn, *nd, "rhs", "fp8", jnp.float32, one, like=q_r)
    return (lowering.scaled(d_l, g_g * g_w, self.lhs_dtype),
            lowering.scaled(d_r, g_gt * g_xc, self.rhs_dtype), a_g)
