"""fp8 ops with custom gradients (every ``jax.custom_vjp`` of the library).

Two families, both built by factories that close over static configuration
(dtypes, recipe, dimension numbers) and cache the resulting closures:

* :func:`quantize` / :func:`dequantize` -- the quantize/dequantize pair of the
  card's mechanism. ``quantize(x, scale, history) -> (x_fp8, scale_out)`` and
  ``dequantize(x_fp8, scale_out, grad_scale, grad_history) -> x``. In the
  backward pass ``dequantize`` runs first: it picks the gradient's scale,
  quantizes the gradient to e5m2 and returns that scale *as the cotangent of
  its dummy* ``scale_out`` *input*. ``quantize``'s backward receives exactly that
  scale and dequantizes the gradient with it.
* :func:`fp8_dot_general` -- the direct fp8 GEMM: fp8 operands go straight into
  ``lax.dot_general`` and the per-tensor scales multiply the output. Its
  backward runs both gradient GEMMs in fp8 (e5m2 gradient x e4m3 operand).
  Only the fp8 copies of the operands are kept for the backward pass.

State updates leave the step as "gradients": each op returns, as the
cotangent of its ``scale``/``amax_history`` inputs, the new values of those
variables (the ``_overwrite_with_gradient`` convention).

**Several uses of one state in a step.** Autodiff *sums* the cotangents of a
variable used twice, which would double scales and add amaxes. Every op
therefore also takes and returns a *chain* array: the uses of one state are
linked through it (use ``k`` takes use ``k-1``'s ``chain_out``). In the
backward pass each later use sends its observed amax back along the chain; only
the first use (``chain=None``) returns the new state, built from the max of all
observations, and the other uses return zeros for the state. The sum autodiff
forms then has exactly one non-zero term. The layers in
:mod:`fp8_linen.layers` do this linking for you.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from fp8_linen import ops, recipes
  >>> cfg = recipes.ScalingConfig(history_length=4)
  >>> x = jnp.array([1.0, -2.0, 3.0])
  >>> xq, s, _ = ops.quantize(x, jnp.ones((1,)), jnp.zeros((4,)), cfg=cfg)
  >>> xq.dtype
  dtype(float8_e4m3fn)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
from jax import lax

from fp8_linen import numerics
from fp8_linen.recipes import Fp8Recipe, IntQuantConfig, ScalingConfig, resolve_gemm

__all__ = [
    "RoleState",
    "quantize",
    "dequantize",
    "fp8_dot_general",
    "chain_init",
    "CHECKPOINT_NAME",
    "name_fp8_residual",
    "operand_op",
    "quantize_operands",
    "operand_op_cotangents",
    # issue 4: integer QAT estimators
    "fake_quant_ste",
    "lsq_fake_quant",
    "lsq_plus_fake_quant",
    "observed_fake_quant",
]

# Name given (jax.ad_checkpoint.checkpoint_name) to the fp8 copies saved for the
# backward pass, so a remat policy can keep exactly those.
CHECKPOINT_NAME = "fp8_linen.fp8_residual"


class RoleState(NamedTuple):
  """The fp8 state of one tensor role: ``scale`` (1,) and ``amax_history`` (L,)."""

  scale: jnp.ndarray
  amax_history: jnp.ndarray


def chain_init(n: int) -> jnp.ndarray:
  """The chain value a first use starts from (ignored by the ops)."""
  return jnp.zeros((n,), jnp.float32)


def _new_state(cfg: ScalingConfig, state: RoleState, observed_amax) -> RoleState:
  """The state after a step that observed ``observed_amax`` (non-finite -> 0)."""
  a = numerics.finite_or_zero(observed_amax)
  scale = numerics.select_scale(cfg, state.scale, state.amax_history, a)
  return RoleState(scale, numerics.roll_history(state.amax_history, a))


def _state_cotangents(cfgs, states, observed, ct_chain, first):
  """Cotangents for the state inputs and the chain input (see module doc).

  Args:
    cfgs: scaling config per role.
    states: :class:`RoleState` per role (the values read at the start of the step).
    observed: this use's amax per role (float32 scalars).
    ct_chain: cotangent of ``chain_out``: the max amax of the later uses per role.
    first: whether this use is the first (the one that returns the state).

  Returns:
    ``(state_cts, chain_ct)``.
  """
  combined = jnp.maximum(numerics.finite_or_zero(jnp.stack(observed)), ct_chain)
  if first:
    state_cts = tuple(_new_state(c, s, combined[i]) for i, (c, s) in enumerate(zip(cfgs, states)))
    return state_cts, jnp.zeros_like(ct_chain)
  zeros = tuple(RoleState(jnp.zeros_like(s.scale), jnp.zeros_like(s.amax_history)) for s in states)
  return zeros, combined


def _varying_axes(x) -> frozenset:
  """Mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()) or ())
  return frozenset(getattr(aval, "vma", ()) or ())


def _match_varying(ct, like, reduce):
  """Makes cotangent ``ct`` vary over exactly the mesh axes its primal ``like`` does.

  Inside ``shard_map`` a replicated input's cotangent must be reduced over the
  axes the cotangent varies on: gradients are summed (``lax.psum``, what JAX's
  own autodiff does) and fp8 state is max-reduced (``lax.pmax``: the global
  amax, never a sum or mean of the per-device ones).
  """
  want, have = _varying_axes(like), _varying_axes(ct)
  extra = tuple(sorted(have - want))
  if extra:
    ct = reduce(ct, extra)
  missing = tuple(sorted(want - have))
  if missing:
    ct = lax.pcast(ct, missing, to="varying")
  return ct


def _match_state(ct: RoleState, like: RoleState) -> RoleState:
  return RoleState(*(_match_varying(c, l, lax.pmax) for c, l in zip(ct, like)))


def _bits_named(q, name):
  bits = jax.ad_checkpoint.checkpoint_name(lax.bitcast_convert_type(q, jnp.uint8), name)
  return lax.bitcast_convert_type(bits, q.dtype)


@functools.lru_cache(maxsize=None)
def _named_identity(name: str):
  @jax.custom_vjp
  def keep(q):
    return _bits_named(q, name)

  def keep_fwd(q):
    return _bits_named(q, name), None

  def keep_bwd(_, g):
    return (g,)

  keep.defvjp(keep_fwd, keep_bwd)
  return keep


def name_fp8_residual(q, name: str = CHECKPOINT_NAME):
  """``checkpoint_name(q, name)`` for an fp8 array, safe under ``jax.checkpoint``.

  jax 0.10's remat inserts ``reduce_precision(exponent_bits, mantissa_bits)`` on
  every floating residual it saves; for ``float8_e4m3fn`` that is IEEE e4m3
  (largest finite 240), so saved values of magnitude >= 256 come back as
  inf/NaN. The fp8 bits are therefore named as ``uint8`` (same byte count,
  never rounded) and bitcast back; the gradient passes straight through.
  """
  if jnp.issubdtype(q.dtype, jnp.floating) and jnp.dtype(q.dtype).itemsize == 1:
    return _named_identity(name)(q)
  return jax.ad_checkpoint.checkpoint_name(q, name)


def operand_op(forward, backward):
  """Builds the custom_vjp of an ``(lhs, rhs, 3 x (scale, history), chain)`` op.

  Every fp8 GEMM/conv op has this shape; only its maths differ.

  Args:
    forward: ``(lhs, rhs, ls, lh, rs, rh) -> (y, (q_lhs, q_rhs), extras)``;
      ``q_*`` are the fp8 operands (saved, named with
      :func:`name_fp8_residual`), ``extras`` any other small residuals.
    backward: ``(q_lhs, q_rhs, extras, states, g, ct_chain) -> cotangents``
      with ``states`` the three :class:`RoleState` inputs; it usually ends in
      :func:`operand_op_cotangents`.

  Returns:
    ``op(lhs, rhs, ls, lh, rs, rh, gs, gh, chain) -> (y, chain_out)``.
  """

  @jax.custom_vjp
  def op(lhs, rhs, ls, lh, rs, rh, gs, gh, chain):
    return forward(lhs, rhs, ls, lh, rs, rh)[0], chain

  def op_fwd(lhs, rhs, ls, lh, rs, rh, gs, gh, chain):
    y, (q_l, q_r), extras = forward(lhs, rhs, ls, lh, rs, rh)
    # Residuals: the fp8 operands, a few scalars/scale vectors, and the state
    # inputs (arguments of the step, alive anyway). No high-precision copy.
    return (y, chain), ((name_fp8_residual(q_l), name_fp8_residual(q_r)), extras,
                        (ls, lh, rs, rh, gs, gh))

  def op_bwd(res, cts):
    (q_l, q_r), extras, (ls, lh, rs, rh, gs, gh) = res
    g, ct_chain = cts
    states = (RoleState(ls, lh), RoleState(rs, rh), RoleState(gs, gh))
    return backward(q_l, q_r, extras, states, g, ct_chain)

  op.defvjp(op_fwd, op_bwd)
  return op


def quantize_operands(cfgs, lhs, rhs, ls, lh, rs, rh):
  """Per-tensor scales and fp8 copies of the two operands of a GEMM or conv.

  Returns:
    ``(q_lhs, q_rhs, s_lhs, s_rhs, amax_lhs, amax_rhs)``.
  """
  a_l, a_r = numerics.amax(lhs), numerics.amax(rhs)
  s_l = numerics.select_scale(cfgs[0], ls, lh, a_l)
  s_r = numerics.select_scale(cfgs[1], rs, rh, a_r)
  return (numerics.quantize(lhs, cfgs[0].jnp_dtype, s_l),
          numerics.quantize(rhs, cfgs[1].jnp_dtype, s_r), s_l, s_r, a_l, a_r)


def operand_op_cotangents(cfgs, states, observed, ct_chain, first, d_lhs, d_rhs,
                          like_lhs, like_rhs):
  """The cotangents of an ``(lhs, rhs, 3 x (scale, history), chain)`` op.

  Builds the state "gradients" (see :func:`_state_cotangents`) and makes every
  cotangent vary over the same ``shard_map`` axes as its primal
  (:func:`_match_varying`): operand gradients are summed, state max-reduced.
  """
  cts, chain_ct = _state_cotangents(cfgs, states, observed, ct_chain, first)
  nl, nr, ng = (_match_state(c, l) for c, l in zip(cts, states))
  return (_match_varying(d_lhs, like_lhs, lax.psum), _match_varying(d_rhs, like_rhs, lax.psum),
          nl.scale, nl.amax_history, nr.scale, nr.amax_history, ng.scale, ng.amax_history,
          _match_varying(chain_ct, ct_chain, lax.pmax))


def _as_state(scale, amax_history) -> RoleState:
  return RoleState(jnp.asarray(scale, jnp.float32), jnp.asarray(amax_history, jnp.float32))


def _check_state(name: str, cfg: ScalingConfig, state: RoleState) -> None:
  if state.scale.shape != (1,):
    raise ValueError(f"{name}_scale must have shape (1,), got {state.scale.shape}")
  if state.amax_history.ndim != 1 or state.amax_history.shape[0] < 1:
    raise ValueError(
        f"{name}_amax_history must have shape (history_length,), got {state.amax_history.shape}")
  del cfg


def _check_float(name: str, x) -> None:
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} must be a floating array, got dtype {jnp.result_type(x)}")


# ----------------------------------------------------------------------------
# quantize / dequantize: the card's pair, with the tangent scale smuggled back
# through the cotangent of the dummy ``scale_out``.
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _make_quantize(cfg: ScalingConfig, x_dtype, first: bool):
  qdtype = cfg.jnp_dtype

  def _fwd_values(x, scale, history):
    a = numerics.amax(x)
    s = numerics.select_scale(cfg, scale, history, a)
    return numerics.quantize(x, qdtype, s), s, a

  @jax.custom_vjp
  def q(x, scale, history, chain):
    xq, s, _ = _fwd_values(x, scale, history)
    return xq, s, chain

  def q_fwd(x, scale, history, chain):
    xq, s, a = _fwd_values(x, scale, history)
    return (xq, s, chain), (a, scale, history)

  def q_bwd(res, cts):
    a, scale, history = res
    g_q, g_scale, ct_chain = cts
    # g_q is the fp8 gradient made by dequantize's backward, g_scale the scale
    # it was quantized with (delivered through the dummy ``scale_out``).
    dx = numerics.dequantize(g_q, g_scale, x_dtype)
    like = RoleState(scale, history)
    (st,), chain_ct = _state_cotangents((cfg,), (like,), (a,), ct_chain, first)
    st = _match_state(st, like)
    return dx, st.scale, st.amax_history, _match_varying(chain_ct, ct_chain, lax.pmax)

  q.defvjp(q_fwd, q_bwd)
  return q


@functools.lru_cache(maxsize=None)
def _make_dequantize(grad_cfg: ScalingConfig, out_dtype, first: bool):
  gdtype = grad_cfg.jnp_dtype

  @jax.custom_vjp
  def dq(xq, scale_out, grad_scale, grad_history, chain):
    return numerics.dequantize(xq, scale_out, out_dtype), chain

  def dq_fwd(xq, scale_out, grad_scale, grad_history, chain):
    return dq(xq, scale_out, grad_scale, grad_history, chain), (grad_scale, grad_history)

  def dq_bwd(res, cts):
    grad_scale, grad_history = res
    g, ct_chain = cts
    a = numerics.amax(g)
    s = numerics.select_scale(grad_cfg, grad_scale, grad_history, a)
    g_q = numerics.quantize(g, gdtype, s)
    like = RoleState(grad_scale, grad_history)
    (st,), chain_ct = _state_cotangents((grad_cfg,), (like,), (a,), ct_chain, first)
    st = _match_state(st, like)
    # The cotangent of the dummy scale_out *is* the gradient's scale.
    return g_q, s, st.scale, st.amax_history, _match_varying(chain_ct, ct_chain, lax.pmax)

  dq.defvjp(dq_fwd, dq_bwd)
  return dq


def quantize(x, scale, amax_history, *, cfg: ScalingConfig | None = None, chain=None):
  """Quantizes ``x`` to fp8 with a scale chosen by ``cfg``.

  Forward: picks the scale (delayed: from ``amax_history``, or from ``x`` on the
  first step; current: from ``x``) and returns the saturated fp8 value and the
  scale used. Backward: dequantizes the incoming fp8 gradient with the scale
  received through ``scale_out``'s cotangent, and returns the new ``(scale,
  amax_history)`` as the cotangents of those inputs.

  Args:
    x: floating array to quantize.
    scale: float32 ``(1,)``, the stored scale.
    amax_history: float32 ``(L,)``, the stored amax history (index 0 newest).
    cfg: the role's :class:`~fp8_linen.ScalingConfig` (default: e4m3, delayed).
    chain: ``None`` for the first use of this state in a step, else the
      ``chain_out`` of the previous use.

  Returns:
    ``(x_fp8, scale_out, chain_out)``; pass ``x_fp8`` and ``scale_out`` to
    :func:`dequantize`, ``chain_out`` to the next use of the same state.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import ops
    >>> xq, s, _ = ops.quantize(jnp.array([2.0, 896.0]), jnp.ones((1,)), jnp.zeros((8,)))
    >>> s.tolist()  # first step: scale from this amax, no clipping
    [2.0]
  """
  cfg = cfg or ScalingConfig()
  x = jnp.asarray(x)
  _check_float("x", x)
  state = _as_state(scale, amax_history)
  _check_state("input", cfg, state)
  first = chain is None
  chain = chain_init(1) if first else chain
  op = _make_quantize(cfg, jnp.dtype(x.dtype), first)
  return op(x, state.scale, state.amax_history, chain)


def dequantize(x_fp8, scale_out, grad_scale, grad_amax_history, *,
               grad_cfg: ScalingConfig | None = None, dtype=jnp.float32, chain=None):
  """Dequantizes ``x_fp8`` and quantizes the gradient flowing back through it.

  Forward: ``x_fp8 * scale_out`` in ``dtype``. Backward: picks the gradient's
  scale (from ``grad_amax_history``, or from the gradient itself on the first
  step), quantizes the gradient to ``grad_cfg.dtype`` (e5m2 by default) and
  returns it as the cotangent of ``x_fp8``, the scale as the cotangent of the
  dummy ``scale_out``, and the new gradient state as the cotangents of
  ``grad_scale``/``grad_amax_history``.

  Args:
    x_fp8: the fp8 value from :func:`quantize`.
    scale_out: the scale output of :func:`quantize`.
    grad_scale: float32 ``(1,)``, the stored gradient scale.
    grad_amax_history: float32 ``(L,)``, the stored gradient amax history.
    grad_cfg: the gradient role's config (default: e5m2, delayed).
    dtype: the dtype to dequantize to.
    chain: ``None`` for the first use of the gradient state, else the previous
      use's ``chain_out``.

  Returns:
    ``(x, chain_out)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen import ops
    >>> def f(x):
    ...   xq, s, _ = ops.quantize(x, jnp.ones((1,)), jnp.zeros((8,)))
    ...   return ops.dequantize(xq, s, jnp.ones((1,)), jnp.zeros((8,)))[0]
    >>> float(jax.grad(lambda x: 1000.0 * f(x))(5.0))
    1000.0
  """
  grad_cfg = grad_cfg or ScalingConfig(dtype="float8_e5m2")
  state = _as_state(grad_scale, grad_amax_history)
  _check_state("output_grad", grad_cfg, state)
  first = chain is None
  chain = chain_init(1) if first else chain
  op = _make_dequantize(grad_cfg, jnp.dtype(dtype), first)
  return op(x_fp8, scale_out, state.scale, state.amax_history, chain)


# ----------------------------------------------------------------------------
# The direct fp8 dot_general.
# ----------------------------------------------------------------------------

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]],
                         tuple[tuple[int, ...], tuple[int, ...]]]


def _canonical_dn(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
  (lc, rc), (lb, rb) = dimension_numbers
  norm = lambda dims, n: tuple(int(d) % n if n else int(d) for d in dims)
  dn = ((norm(lc, lhs_ndim), norm(rc, rhs_ndim)), (norm(lb, lhs_ndim), norm(rb, rhs_ndim)))
  if len(dn[0][0]) != len(dn[0][1]) or len(dn[1][0]) != len(dn[1][1]):
    raise ValueError(f"dimension_numbers {dimension_numbers} pair unequal numbers of dimensions")
  return dn


def _free_dims(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
  return [d for d in range(ndim) if d not in contract and d not in batch]


def _as_matmul_operand(x, contract, batch, contract_last: bool):
  """Reshapes ``x`` to ``[B?, rows, cols]`` for a plain (batched) matmul.

  Returns the reshaped operand and whether its contracting block comes last.
  A transpose is made only when neither ``(batch, free, contract)`` nor
  ``(batch, contract, free)`` is already ``x``'s layout.
  """
  free = [d for d in range(x.ndim) if d not in contract and d not in batch]
  options = [(list(batch) + free + list(contract), True),
             (list(batch) + list(contract) + free, False)]
  perm, last = next(((p, l) for p, l in options if p == list(range(x.ndim))),
                    options[0] if contract_last else options[1])
  if perm != list(range(x.ndim)):
    x = jnp.transpose(x, perm)
  b = math.prod(x.shape[:len(batch)])
  k = math.prod(x.shape[d] for d in range(x.ndim) if perm[d] in contract)
  f = math.prod(x.shape[d] for d in range(x.ndim) if perm[d] in free)
  shape = (f, k) if last else (k, f)
  return x.reshape(((b,) if batch else ()) + shape), last


def _gemm(a, b, dn, gemm: str, out_dtype):
  """``dot_general`` of two fp8 operands under one of the lowerings."""
  if gemm == "fp8":
    return lax.dot_general(a, b, dn, preferred_element_type=out_dtype)
  up = jnp.bfloat16 if gemm == "bf16" else jnp.float32  # fp8 -> bf16 is exact
  a, b = a.astype(up), b.astype(up)
  if up == jnp.float32:
    return lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)
  # XLA:CPU has a bf16 x bf16 -> f32 kernel only for plain (batched) matmul
  # layouts; express every product as one, then restore dot_general's output
  # layout (batch, lhs free, rhs free).
  (ac, bc), (ab, bb) = dn
  out_shape = ([a.shape[d] for d in ab]
               + [a.shape[d] for d in range(a.ndim) if d not in ac and d not in ab]
               + [b.shape[d] for d in range(b.ndim) if d not in bc and d not in bb])
  a3, a_last = _as_matmul_operand(a, ac, ab, contract_last=True)
  b3, b_last = _as_matmul_operand(b, bc, bb, contract_last=False)
  nb = 1 if ab else 0
  dn3 = (((nb + (1 if a_last else 0),), (nb + (1 if b_last else 0),)),
         (((0,), (0,)) if ab else ((), ())))
  y = lax.dot_general(a3, b3, dn3, preferred_element_type=jnp.float32)
  return y.reshape(out_shape)


def _scaled(y, scale, out_dtype):
  """Applies a scalar scale to a GEMM output and casts it."""
  return (y * jnp.reshape(scale, ()).astype(y.dtype)).astype(out_dtype)


def _dlhs(g, rhs, dn, lhs_ndim: int, gemm: str, out_dtype, scale):
  """Gradient of ``dot_general(lhs, rhs, dn)`` w.r.t. ``lhs``, given ``g``."""
  (lc, rc), (lb, rb) = dn
  l_free = _free_dims(lhs_ndim, lc, lb)
  r_free = _free_dims(rhs.ndim, rc, rb)
  nb = len(lb)
  g_rfree = list(range(nb + len(l_free), g.ndim))
  y = _gemm(g, rhs, ((g_rfree, r_free), (list(range(nb)), list(rb))), gemm, out_dtype)
  y = _scaled(y, scale, out_dtype)
  # y's dims: batch, lhs-free, then rhs contracting dims in increasing order.
  src = list(lb) + l_free + [lc[list(rc).index(d)] for d in sorted(rc)]
  return jnp.transpose(y, [src.index(i) for i in range(lhs_ndim)])


def _drhs(g, lhs, dn, rhs_ndim: int, gemm: str, out_dtype, scale):
  """Gradient of ``dot_general(lhs, rhs, dn)`` w.r.t. ``rhs``, given ``g``."""
  (lc, rc), (lb, rb) = dn
  l_free = _free_dims(lhs.ndim, lc, lb)
  r_free = _free_dims(rhs_ndim, rc, rb)
  nb = len(lb)
  g_lfree = list(range(nb, nb + len(l_free)))
  y = _gemm(lhs, g, ((l_free, g_lfree), (list(lb), list(range(nb)))), gemm, out_dtype)
  y = _scaled(y, scale, out_dtype)
  # y's dims: batch, lhs contracting dims in increasing order, then rhs-free.
  src = list(rb) + [rc[list(lc).index(d)] for d in sorted(lc)] + r_free
  return jnp.transpose(y, [src.index(i) for i in range(rhs_ndim)])


@functools.lru_cache(maxsize=None)
def _make_fp8_dot(dn: DimensionNumbers, recipe: Fp8Recipe, gemm: str, out_dtype,
                  lhs_dtype, rhs_dtype, first: bool):
  cfgs = (recipe.input, recipe.kernel, recipe.output_grad)
  g_cfg = cfgs[2]

  def forward(lhs, rhs, ls, lh, rs, rh):
    q_l, q_r, s_l, s_r, a_l, a_r = quantize_operands(cfgs, lhs, rhs, ls, lh, rs, rh)
    y = _scaled(_gemm(q_l, q_r, dn, gemm, out_dtype), s_l * s_r, out_dtype)
    return y, (q_l, q_r), (s_l, s_r, a_l, a_r)

  def backward(q_l, q_r, extras, states, g, ct_chain):
    s_l, s_r, a_l, a_r = extras
    gs, gh = states[2]
    a_g = numerics.amax(g)
    s_g = numerics.select_scale(g_cfg, gs, gh, a_g)
    q_g = numerics.quantize(g, g_cfg.jnp_dtype, s_g)
    d_lhs = _dlhs(q_g, q_r, dn, q_l.ndim, gemm, lhs_dtype, s_g * s_r)
    d_rhs = _drhs(q_g, q_l, dn, q_r.ndim, gemm, rhs_dtype, s_g * s_l)
    return operand_op_cotangents(cfgs, states, (a_l, a_r, a_g), ct_chain, first, d_lhs, d_rhs,
                                 q_l, q_r)

  return operand_op(forward, backward)


def fp8_dot_general(lhs, rhs, dimension_numbers, *, input_state: RoleState,
                    kernel_state: RoleState, output_grad_state: RoleState,
                    recipe: Fp8Recipe | None = None, out_dtype=None, chain=None):
  """``lax.dot_general`` with fp8 operands and fp8 gradient GEMMs.

  Forward: ``lhs`` and ``rhs`` are quantized (``recipe.input`` /
  ``recipe.kernel``, e4m3 by default) and multiplied directly in fp8; the
  product of the two scalar scales multiplies the output. Backward: the output
  gradient is quantized (``recipe.output_grad``, e5m2 by default) and both
  gradient GEMMs run with fp8 operands. The new state of all three roles is
  returned as the cotangent of the state inputs.

  On GPU (``recipe.gemm='auto'``) the fp8 operands are fed to the GEMM directly,
  the form XLA rewrites to a cuBLASLt fp8 matmul; on other backends they are
  upcast exactly to bfloat16.

  ``recipe.granularity`` selects finer scales (all from this step's values):

  * ``'row'``: ``lhs`` is scaled per row (amax over its contracting axes) and
    ``rhs`` per output channel. The GEMM runs on the unscaled fp8 operands and
    the outer product of the two scale vectors multiplies its output. In the
    backward pass each scale lies along the *contracted* axis of one gradient
    GEMM, so it is folded into the gradient before that gradient is quantized:
    dgrad quantizes ``g * s_rhs`` per row of ``g`` (amax over the rhs-free
    axes), wgrad quantizes ``g * s_lhs`` per column (amax over the lhs-free
    axes); each GEMM's output is multiplied by its gradient scales. The
    gradient is therefore cast to e5m2 twice; only fp8 operands and the scale
    vectors are kept as residuals.
  * ``'block'``: MX emulation. ``lhs`` and ``rhs`` are quantized in blocks of
    ``recipe.block_size`` along their last contracting axis with e8m0 scales
    (:func:`~fp8_linen.numerics.mx_quantize`), dequantized exactly to bfloat16
    (``gemm='f32'``: float32) and multiplied there. The output gradient is
    quantized per tensor (its ``ScalingConfig``, delayed or current) and both
    gradient GEMMs use the same emulation. Residuals: fp8 elements and e8m0
    scales.

  In both modes the OWG state records the per-tensor amax of each role
  (monitoring); the stored scale is the per-tensor scale of that amax.

  Args:
    lhs: floating array (the activation).
    rhs: floating array (the weight).
    dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``
      as for ``lax.dot_general``.
    input_state: :class:`RoleState` of ``lhs``.
    kernel_state: :class:`RoleState` of ``rhs``.
    output_grad_state: :class:`RoleState` of the output gradient.
    recipe: the :class:`~fp8_linen.Fp8Recipe` (default: delayed e4m3/e5m2).
    out_dtype: output dtype (default: the result type of ``lhs`` and ``rhs``).
    chain: ``None`` for the first use of these states in a step, else the
      ``chain_out`` of the previous use.

  Returns:
    ``(out, chain_out)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from fp8_linen import ops
    >>> st = lambda: ops.RoleState(jnp.ones((1,)), jnp.zeros((16,)))
    >>> y, _ = ops.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())),
    ...                            input_state=st(), kernel_state=st(), output_grad_state=st())
    >>> [round(v, 4) for v in y[0].tolist()]
    [3.0, 3.0, 3.0, 3.0]
  """
  recipe = recipe or Fp8Recipe()
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  _check_float("lhs", lhs)
  _check_float("rhs", rhs)
  dn = _canonical_dn(dimension_numbers, lhs.ndim, rhs.ndim)
  (lc, rc), (lb, rb) = dn
  for ld, rd in zip(lc + lb, rc + rb):
    if lhs.shape[ld] != rhs.shape[rd]:
      raise ValueError(
          f"fp8_dot_general: lhs dimension {ld} (size {lhs.shape[ld]}) does not match rhs "
          f"dimension {rd} (size {rhs.shape[rd]}); lhs.shape={lhs.shape}, rhs.shape={rhs.shape}")
  states = []
  for name, st in (("input", input_state), ("kernel", kernel_state),
                   ("output_grad", output_grad_state)):
    st = _as_state(*st)
    _check_state(name, recipe.role(name), st)
    states.append(st)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  first = chain is None
  chain = chain_init(3) if first else chain
  maker = {"tensor": _make_fp8_dot, "row": _make_fp8_dot_row,
           "block": _make_fp8_dot_block}[recipe.granularity]
  op = maker(dn, recipe, resolve_gemm(recipe), out_dtype, jnp.dtype(lhs.dtype),
             jnp.dtype(rhs.dtype), first)
  (ls, lh), (rs, rh), (gs, gh) = states
  return op(lhs, rhs, ls, lh, rs, rh, gs, gh, chain)


# ----------------------------------------------------------------------------
# Finer granularity for the fp8 dot_general: row-wise and MX block scales.
# ----------------------------------------------------------------------------


def _relayout(t, pairs, dst_ndim: int):
  """Moves the axes of ``t`` to new positions; every other axis has size 1.

  ``pairs`` lists ``(src_axis, dst_axis)``; the axes of ``t`` not listed must
  have size 1 and are dropped, and the result has size 1 on every destination
  axis not listed.
  """
  src = [a for a, _ in pairs]
  t = jnp.squeeze(t, axis=tuple(a for a in range(t.ndim) if a not in src))
  remaining = sorted(src)
  by_dst = sorted(pairs, key=lambda p: p[1])
  t = jnp.transpose(t, [remaining.index(a) for a, _ in by_dst])
  shape = [1] * dst_ndim
  for i, (_, d) in enumerate(by_dst):
    shape[d] = t.shape[i]
  return t.reshape(shape)


class _Layout(NamedTuple):
  """Where the axes of lhs, rhs and the output (= gradient) of a GEMM go."""

  lhs_to_out: list
  rhs_to_out: list
  lhs_free_out: tuple  # output axes of lhs's free dims
  rhs_free_out: tuple  # output axes of rhs's free dims
  out_ndim: int


def _layout(dn: DimensionNumbers, lhs_ndim: int, rhs_ndim: int) -> _Layout:
  (lc, rc), (lb, rb) = dn
  l_free = _free_dims(lhs_ndim, lc, lb)
  r_free = _free_dims(rhs_ndim, rc, rb)
  nb, nl = len(lb), len(l_free)
  lhs_to_out = [(a, i) for i, a in enumerate(lb)] + [(a, nb + j) for j, a in enumerate(l_free)]
  rhs_to_out = ([(a, i) for i, a in enumerate(rb)]
                + [(a, nb + nl + j) for j, a in enumerate(r_free)])
  return _Layout(lhs_to_out, rhs_to_out, tuple(range(nb, nb + nl)),
                 tuple(range(nb + nl, nb + nl + len(r_free))), nb + nl + len(r_free))


def _flip(pairs):
  return [(b, a) for a, b in pairs]


@functools.lru_cache(maxsize=None)
def _make_fp8_dot_row(dn: DimensionNumbers, recipe: Fp8Recipe, gemm: str, out_dtype,
                      lhs_dtype, rhs_dtype, first: bool):
  cfgs = (recipe.input, recipe.kernel, recipe.output_grad)
  in_cfg, k_cfg, g_cfg = cfgs
  (lc, rc), _ = dn

  def forward(lhs, rhs, ls, lh, rs, rh):
    lay = _layout(dn, lhs.ndim, rhs.ndim)
    s_l = numerics.row_scale(lhs, lc, in_cfg)   # lhs layout, contracting axes size 1
    s_r = numerics.row_scale(rhs, rc, k_cfg)    # rhs layout, contracting axes size 1
    q_l = numerics.quantize(lhs, in_cfg.jnp_dtype, s_l)
    q_r = numerics.quantize(rhs, k_cfg.jnp_dtype, s_r)
    s_out = (_relayout(s_l, lay.lhs_to_out, lay.out_ndim)
             * _relayout(s_r, lay.rhs_to_out, lay.out_ndim))
    y = (_gemm(q_l, q_r, dn, gemm, out_dtype).astype(jnp.float32) * s_out).astype(out_dtype)
    return y, (q_l, q_r), (s_l, s_r, numerics.amax(lhs), numerics.amax(rhs))

  def backward(q_l, q_r, extras, states, g, ct_chain):
    s_l, s_r, a_l, a_r = extras
    lay = _layout(dn, q_l.ndim, q_r.ndim)
    g32 = g.astype(jnp.float32)
    # dgrad contracts rhs's free axes: fold s_r into g, scale g per row.
    g1 = g32 * _relayout(s_r, lay.rhs_to_out, lay.out_ndim)
    s_g1 = numerics.row_scale(g1, lay.rhs_free_out, g_cfg)
    q_g1 = numerics.quantize(g1, g_cfg.jnp_dtype, s_g1)
    d_lhs = _dlhs(q_g1, q_r, dn, q_l.ndim, gemm, jnp.float32, jnp.ones((), jnp.float32))
    d_lhs = (d_lhs * _relayout(s_g1, _flip(lay.lhs_to_out), q_l.ndim)).astype(lhs_dtype)
    # wgrad contracts lhs's free axes: fold s_l into g, scale g per column.
    g2 = g32 * _relayout(s_l, lay.lhs_to_out, lay.out_ndim)
    s_g2 = numerics.row_scale(g2, lay.lhs_free_out, g_cfg)
    q_g2 = numerics.quantize(g2, g_cfg.jnp_dtype, s_g2)
    d_rhs = _drhs(q_g2, q_l, dn, q_r.ndim, gemm, jnp.float32, jnp.ones((), jnp.float32))
    d_rhs = (d_rhs * _relayout(s_g2, _flip(lay.rhs_to_out), q_r.ndim)).astype(rhs_dtype)
    return operand_op_cotangents(cfgs, states, (a_l, a_r, numerics.amax(g)), ct_chain, first,
                                 d_lhs, d_rhs, q_l, q_r)

  return operand_op(forward, backward)


@functools.lru_cache(maxsize=None)
def _make_fp8_dot_block(dn: DimensionNumbers, recipe: Fp8Recipe, gemm: str, out_dtype,
                        lhs_dtype, rhs_dtype, first: bool):
  cfgs = (recipe.input, recipe.kernel, recipe.output_grad)
  in_cfg, k_cfg, g_cfg = cfgs
  (lc, rc), _ = dn
  if not lc:
    raise ValueError("granularity='block' needs at least one contracting dimension")
  l_axis, r_axis = lc[-1], rc[-1]  # blocks run along the last contracting axis
  bs = recipe.block_size
  up = jnp.float32 if gemm == "f32" else jnp.bfloat16  # exact for fp8 * 2**e

  def _dq(q, s, axis):
    return numerics.mx_dequantize(q, s, axis, bs, up)

  def forward(lhs, rhs, ls, lh, rs, rh):
    q_l, e_l = numerics.mx_quantize(lhs, l_axis, bs, in_cfg.jnp_dtype)
    q_r, e_r = numerics.mx_quantize(rhs, r_axis, bs, k_cfg.jnp_dtype)
    y = lax.dot_general(_dq(q_l, e_l, l_axis), _dq(q_r, e_r, r_axis), dn,
                        preferred_element_type=jnp.float32).astype(out_dtype)
    return y, (q_l, q_r), (e_l, e_r, numerics.amax(lhs), numerics.amax(rhs))

  def backward(q_l, q_r, extras, states, g, ct_chain):
    e_l, e_r, a_l, a_r = extras
    gs, gh = states[2]
    a_g = numerics.amax(g)
    s_g = numerics.select_scale(g_cfg, gs, gh, a_g)
    q_g = numerics.quantize(g, g_cfg.jnp_dtype, s_g)
    one = jnp.ones((), jnp.float32)
    gg = q_g.astype(up)
    # "fp8" = feed the (already dequantized, bf16/f32) operands to the GEMM as is.
    d_lhs = _scaled(_dlhs(gg, _dq(q_r, e_r, r_axis), dn, q_l.ndim, "fp8", jnp.float32, one),
                    s_g, lhs_dtype)
    d_rhs = _scaled(_drhs(gg, _dq(q_l, e_l, l_axis), dn, q_r.ndim, "fp8", jnp.float32, one),
                    s_g, rhs_dtype)
    return operand_op_cotangents(cfgs, states, (a_l, a_r, a_g), ct_chain, first, d_lhs, d_rhs,
                                 q_l, q_r)

  return operand_op(forward, backward)


# ----------------------------------------------------------------------------
# Integer QAT: straight-through estimator, LSQ, LSQ+ and observed ranges.
# ----------------------------------------------------------------------------


def _sum_to(t, shape):
  """Sums ``t`` over the axes it was broadcast along to reach ``t.shape``."""
  shape = tuple(shape)
  lead = t.ndim - len(shape)
  t = jnp.sum(t, axis=tuple(range(lead))) if lead else t
  axes = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
  return jnp.sum(t, axis=axes, keepdims=True).reshape(shape) if axes else t.reshape(shape)


@functools.lru_cache(maxsize=None)
def _make_ste(qmin: int, qmax: int):

  @jax.custom_vjp
  def op(x, scale, zero_point):
    return numerics.int_fake_quant(x, scale, zero_point, qmin, qmax)

  def op_fwd(x, scale, zero_point):
    return op(x, scale, zero_point), (x, scale, zero_point)

  def op_bwd(res, g):
    x, scale, zero_point = res
    v = x.astype(jnp.float32) / scale + zero_point
    inside = (v >= qmin) & (v <= qmax)
    return (jnp.where(inside, g, jnp.zeros_like(g)).astype(x.dtype),
            jnp.zeros_like(scale), jnp.zeros_like(zero_point))

  op.defvjp(op_fwd, op_bwd)
  return op


def fake_quant_ste(x, scale, zero_point, *, qmin: int, qmax: int):
  """Fake quantization with the straight-through estimator.

  Forward: ``s * (clamp(round(x / s) + z, qmin, qmax) - z)``. Backward: the
  gradient passes unchanged where ``qmin <= x / s + z <= qmax`` and is zero
  outside the clamp range; ``scale`` and ``zero_point`` get zero gradients
  (they come from data or observers, not from the loss).

  Args:
    x: floating array.
    scale: float32 scale, broadcastable against ``x``.
    zero_point: float32 zero point (integer-valued), broadcastable against ``x``.
    qmin: lowest integer level.
    qmax: highest integer level.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen import ops
    >>> f = lambda x: ops.fake_quant_ste(x, 0.5, 0.0, qmin=-8, qmax=7).sum()
    >>> jax.grad(f)(jnp.array([0.3, 9.0])).tolist()
    [1.0, 0.0]
  """
  x = jnp.asarray(x)
  _check_float("x", x)
  scale = jnp.asarray(scale, jnp.float32)
  zero_point = jnp.asarray(zero_point, jnp.float32)
  return _make_ste(int(qmin), int(qmax))(x, scale, zero_point)


@functools.lru_cache(maxsize=None)
def _make_lsq(qmin: int, qmax: int, grad_scale: float, with_offset: bool):

  def _v(x, step, offset):
    s = jnp.maximum(step, numerics.SCALE_FLOOR)
    return (x.astype(jnp.float32) - offset) / s, s

  @jax.custom_vjp
  def op(x, step, offset):
    v, s = _v(x, step, offset)
    return (jnp.clip(jnp.round(v), qmin, qmax) * s + offset).astype(x.dtype)

  def op_fwd(x, step, offset):
    return op(x, step, offset), (x, step, offset)

  def op_bwd(res, g):
    x, step, offset = res
    v, _ = _v(x, step, offset)
    g32 = g.astype(jnp.float32)
    below, above = v < qmin, v > qmax
    inside = ~(below | above)
    # d x_hat / d s: Q_N below, Q_P above, round(v) - v inside (Esser et al.).
    ds = jnp.where(below, float(qmin), jnp.where(above, float(qmax), jnp.round(v) - v))
    d_step = _sum_to(g32 * ds, step.shape) * grad_scale
    # d x_hat / d beta: 0 inside (the STE cancels it), 1 at the clamps.
    d_off = (_sum_to(jnp.where(inside, 0.0, g32), offset.shape) * grad_scale if with_offset
             else jnp.zeros_like(offset))
    return jnp.where(inside, g32, 0.0).astype(x.dtype), d_step, d_off

  op.defvjp(op_fwd, op_bwd)
  return op


def _lsq_args(x, step, *, grad_scale):
  x = jnp.asarray(x)
  _check_float("x", x)
  if not float(grad_scale) > 0:
    raise ValueError(f"grad_scale must be > 0, got {grad_scale!r}")
  return x, jnp.asarray(step, jnp.float32)


def lsq_fake_quant(x, step, *, qmin: int, qmax: int, grad_scale: float = 1.0):
  """LSQ fake quantization with a learnable step size (Esser et al., 2020).

  Forward: ``x_hat = s * clamp(round(x / s), qmin, qmax)``. Backward, with
  ``v = x / s``: ``dx_hat/dx = 1`` for ``qmin <= v <= qmax`` and 0 outside;
  ``dx_hat/ds = round(v) - v`` inside, ``qmin`` below and ``qmax`` above, summed
  over the elements ``s`` covers and multiplied by ``grad_scale`` (LSQ uses
  ``1 / sqrt(N * Q_P)``).

  Args:
    x: floating array.
    step: float32 step size ``s`` (> 0), broadcastable against ``x``.
    qmin: lowest integer level (``Q_N`` of the paper, negated).
    qmax: highest integer level (``Q_P``).
    grad_scale: factor applied to the step's gradient.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen import ops
    >>> f = lambda s: ops.lsq_fake_quant(jnp.array([0.7, 5.0]), s, qmin=-2, qmax=1).sum()
    >>> float(jax.grad(f)(jnp.array(1.0)))  # (round(0.7) - 0.7) + Q_P
    1.2999999523162842
  """
  x, step = _lsq_args(x, step, grad_scale=grad_scale)
  return _make_lsq(int(qmin), int(qmax), float(grad_scale), False)(
      x, step, jnp.zeros((), jnp.float32))


def lsq_plus_fake_quant(x, step, offset, *, qmin: int, qmax: int, grad_scale: float = 1.0):
  """LSQ+ fake quantization: learnable step ``s`` and offset ``beta``.

  Forward: ``x_hat = s * clamp(round((x - beta) / s), qmin, qmax) + beta``.
  Backward, with ``v = (x - beta) / s`` and the STE for ``round``:
  ``dx_hat/dx`` is 1 inside the range and 0 outside; ``dx_hat/ds`` is ``round(v)
  - v`` inside, ``qmin``/``qmax`` at the clamps; ``dx_hat/dbeta`` is 0 inside
  (``s * d round(v)/dbeta + 1 = -1 + 1``) and 1 at the clamps. Both learnable
  gradients are multiplied by ``grad_scale``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen import ops
    >>> f = lambda b: ops.lsq_plus_fake_quant(jnp.array([0.2, 9.0]), 1.0, b, qmin=0, qmax=3).sum()
    >>> float(jax.grad(f)(jnp.array(0.0)))  # only the clamped element
    1.0
  """
  x, step = _lsq_args(x, step, grad_scale=grad_scale)
  return _make_lsq(int(qmin), int(qmax), float(grad_scale), True)(
      x, step, jnp.asarray(offset, jnp.float32))


def _observe(cfg: IntQuantConfig, old, x):
  """The observer's range ``[-min, max]`` after seeing ``x`` (old ``[0, 0]`` = empty)."""
  x32 = jnp.asarray(x, jnp.float32)
  cur = jnp.stack([-jnp.min(x32), jnp.max(x32)])
  cur = jnp.where(jnp.isfinite(cur), cur, old)  # a NaN batch never poisons the range
  empty = jnp.all(old == 0)
  if cfg.observer == "minmax":
    new = jnp.maximum(old, cur)
  else:
    new = cfg.momentum * old + (1.0 - cfg.momentum) * cur
  return jnp.where(empty, cur, new)


@functools.lru_cache(maxsize=None)
def _make_observed(cfg: IntQuantConfig, first: bool):

  def _qparams(x, obs):
    new = _observe(cfg, obs, x)
    s, z = numerics.int_params_from_range(-new[0], new[1], cfg)
    return new, s, z

  @jax.custom_vjp
  def op(x, obs, chain):
    _, s, z = _qparams(x, obs)
    return numerics.int_fake_quant(x, s, z, cfg.qmin, cfg.qmax), chain

  def op_fwd(x, obs, chain):
    new, s, z = _qparams(x, obs)
    return (numerics.int_fake_quant(x, s, z, cfg.qmin, cfg.qmax), chain), (x, new, s, z)

  def op_bwd(res, cts):
    x, new, s, z = res
    g, ct_chain = cts
    v = x.astype(jnp.float32) / s + z
    dx = jnp.where((v >= cfg.qmin) & (v <= cfg.qmax), g, jnp.zeros_like(g)).astype(x.dtype)
    # Chain as for fp8 state: later uses send their range back; the first use
    # returns the widest (elementwise max of [-min, max]) as the new state.
    combined = jnp.maximum(new, ct_chain)
    if first:
      return dx, combined, jnp.zeros_like(ct_chain)
    return dx, jnp.zeros_like(new), combined

  op.defvjp(op_fwd, op_bwd)
  return op


def observed_fake_quant(x, observer_range, *, cfg: IntQuantConfig, chain=None):
  """STE fake quantization with a range observer whose state is overwritten.

  The observer state is ``[-min, max]`` (float32 ``(2,)``; ``[0, 0]`` means
  nothing observed yet). Forward: the range is updated with this batch
  (``'minmax'``: running min/max; ``'moving_average'``: EMA with
  ``cfg.momentum``; the first batch is taken as is), the scale and zero point
  come from it (:func:`~fp8_linen.numerics.int_params_from_range`) and ``x`` is
  fake-quantized. Backward: STE for ``x``; the updated range is returned as the
  cotangent of ``observer_range`` (the ``_overwrite_with_gradient``
  convention), linked across uses through ``chain`` like the fp8 ops.

  Returns:
    ``(x_hat, chain_out)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from fp8_linen import ops, recipes
    >>> cfg = recipes.IntQuantConfig(bits=8)
    >>> f = lambda x, r: ops.observed_fake_quant(x, r, cfg=cfg)[0].sum()
    >>> jax.grad(f, argnums=1)(jnp.array([-1.0, 2.0]), jnp.zeros(2)).tolist()
    [1.0, 2.0]
  """
  x = jnp.asarray(x)
  _check_float("x", x)
  observer_range = jnp.asarray(observer_range, jnp.float32)
  if observer_range.shape != (2,):
    raise ValueError(f"observer_range must have shape (2,), got {observer_range.shape}")
  first = chain is None
  chain = jnp.zeros((2,), jnp.float32) if first else chain
  return _make_observed(cfg, first)(x, observer_range, chain)
