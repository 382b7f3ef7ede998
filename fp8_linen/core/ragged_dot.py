"""The fp8 grouped GEMM: ``jax.lax.ragged_dot`` (an MoE's expert products) with fp8 operands.

:func:`fp8_ragged_dot` multiplies ``lhs`` ``(m, k)`` (the routed tokens,
sorted by group) with ``rhs`` ``(g, k, n)`` (one weight per group, e.g. per
expert), rows ``[start_i, start_i + group_sizes[i])`` of ``lhs`` with
``rhs[i]``, as ``jax.lax.ragged_dot`` does, in fp8: forward e4m3 x e4m3,
dgrad e5m2 gradient x e4m3 weight, wgrad e4m3 tokens x e5m2 gradient (the
ragged-contracting form, one ``(k, n)`` gradient per group).

State layout: ``input`` and ``output_grad`` have one per-tensor
:class:`~fp8_linen.core.owg.RoleState` each, measuring every routed row.
``kernel`` has either one state per group (``scale`` ``(g, 1)``,
``amax_history`` ``(g, history_length)``: each expert's weight measured,
scaled and cast alone, so one expert's large weights never cost another
its precision; what ``quantize_model`` declares) or one for all groups
(``(1,)``, ``(history_length,)``). A per-group kernel scale reaches the
output rows of its group (forward and dgrad); the wgrad of group ``i`` has
the input's and the gradient's scales only. An expert with no rows still has
its weight measured; it contributes nothing to the products, and an empty
batch leaves every state as it was. Rows past ``sum(group_sizes)`` give zero
output rows and a zero gradient, as in ``ragged_dot`` (they are measured by
the input amax: keep padding rows zero). Row-wise and block recipes are
refused (``ValueError``).

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import owg, ragged_dot
  >>> st = lambda: owg.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
  >>> y, _ = ragged_dot.fp8_ragged_dot(jnp.ones((5, 3)), jnp.ones((2, 3, 4)),
  ...     jnp.array([2, 3]), input_state=st(), kernel_state=st(), output_grad_state=st())
  >>> y.shape
  (5, 4)
"""

from __future__ import annotations

import functools

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np

from fp8_linen.core import grouped_kernels, lowering, numerics, owg, uses
from fp8_linen.core.fp8_vjp import Fp8Spec, backward_with_state
from fp8_linen.recipes.fp8 import Fp8Recipe

__all__ = ["fp8_ragged_dot", "ragged_gemm", "group_scales"]


def ragged_gemm(a, b, group_sizes, how: str, scales, out_dtype, *, wgrad: bool = False,
                transpose_rhs: bool = False):
  """A grouped GEMM of two fp8 operands under the lowering ``how``, scaled and cast.

  Group ``i``'s output (its rows, or with ``wgrad`` its ``(k, n)``) is
  multiplied by ``scales[i]`` (float32 ``(g,)``, or a scalar for all) and
  cast to ``out_dtype``.

  ``'fp8'`` feeds the codes to the product; ``'bf16'`` / ``'f32'`` upcast
  them first, which is exact. ``wgrad``: the ragged-contracting form, ``a``
  ``(m, k)`` and ``b`` ``(m, n)`` give one ``(k, n)`` per group. With
  ``transpose_rhs`` group ``i`` multiplies ``b[i].T`` (the dgrad, reading the
  weight codes in their stored layout).
  On a GPU, ``'fp8'`` runs in :mod:`~fp8_linen.core.grouped_kernels`'
  Pallas kernels (each row multiplied by its own group's weight) where they
  apply and pay (:func:`~fp8_linen.core.grouped_kernels.run`); XLA's
  lowering is one dense GEMM over every group.
  """
  return grouped_kernels.ragged_product(
      a, b, group_sizes, gpu_kernel=how == "fp8", transpose_rhs=transpose_rhs,
      wgrad=wgrad, scales=scales, out_dtype=out_dtype,
      upcast=None if how == "fp8" else (jnp.bfloat16 if how == "bf16" else jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged_vjp(spec, grouped, lhs, rhs, group_sizes, states, chain):
  return _forward(spec, grouped, lhs, rhs, group_sizes, states)[0], chain


def group_scales(s_other, s_r):
  """Each group's output scale: ``s_other`` times its kernel scale (``(g, 1)`` per group,
  or one for all)."""
  return numerics.scale_product(s_other, jnp.reshape(s_r, (-1,)))


def _forward(spec, grouped, lhs, rhs, group_sizes, states):
  c_l, c_r, _ = spec.cfgs
  q_l, s_l, a_l = numerics.quantize_with(c_l, *states[0], lhs)
  if grouped:
    # One scale per group: each expert's weight is measured, scaled and cast alone.
    q_r, s_r, a_r = jax.vmap(functools.partial(numerics.quantize_with, c_r, weight=True))(
        states[1].scale, states[1].amax_history, rhs)
  else:
    q_r, s_r, a_r = numerics.quantize_with(c_r, *states[1], rhs, weight=True)
  y = ragged_gemm(q_l, q_r, group_sizes, spec.gemm, group_scales(s_l, s_r), spec.out_dtype)
  named = lambda q: jax.ad_checkpoint.checkpoint_name(q, owg.CHECKPOINT_NAME)
  return y, (named(q_l), named(q_r), s_l, s_r, (a_l, a_r))


def _fwd(spec, grouped, lhs, rhs, group_sizes, states, chain):
  y, res = _forward(spec, grouped, lhs, rhs, group_sizes, states)
  return (y, chain), (res, group_sizes, states)


def _bwd(spec, grouped, res, cts):
  (q_l, q_r, s_l, s_r, amaxes), group_sizes, states = res
  g, ct_chain = cts

  def grads():
    q_g, s_g, a_g = numerics.quantize_with(spec.cfgs[2], *states[2], g, gradient=True)
    # dgrad: g (m, n) x rhs[i]^T (n, k) per group.
    d_l = ragged_gemm(q_g, q_r, group_sizes, spec.gemm, group_scales(s_g, s_r),
                      spec.lhs_dtype, transpose_rhs=True)
    # wgrad: lhs rows^T (k, m_i) x g rows (m_i, n) per group.
    d_r = ragged_gemm(q_l, q_g, group_sizes, spec.gemm, numerics.scale_product(s_g, s_l),
                      spec.wgrad_dtype, wgrad=True).astype(spec.rhs_dtype)
    return d_l, d_r, a_g

  (d_l, d_r), state_cts, chain_ct = backward_with_state(spec, q_l, q_r, g, states, amaxes,
                                                         ct_chain, grads)
  zero_sizes = np.zeros(group_sizes.shape, jax.dtypes.float0)
  # Inside shard_map the experts closed over are replicated; each device's
  # wgrad covers its own rows, summed as JAX's own autodiff would.
  return (owg.match_varying(d_l, q_l), owg.match_varying(d_r, q_r),
          zero_sizes, state_cts, chain_ct)


_ragged_vjp.defvjp(_fwd, _bwd)
_ragged_vjp = uses.compiled_when_eager(_ragged_vjp, static_argnums=(0, 1))


def fp8_ragged_dot(lhs, rhs, group_sizes, *, input_state: owg.RoleState,
                   kernel_state: owg.RoleState, output_grad_state: owg.RoleState,
                   recipe: Fp8Recipe | None = None, out_dtype=None, chain=None,
                   rhs_grad_dtype=None):
  """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` with fp8 operands and fp8 gradient GEMMs.

  Args:
    lhs: floating ``(m, k)``: rows sorted by group.
    rhs: floating ``(g, k, n)``: one weight per group.
    group_sizes: integer ``(g,)``: rows per group, in order.
    input_state: :class:`~fp8_linen.RoleState` of ``lhs``.
    kernel_state: :class:`~fp8_linen.RoleState` of ``rhs``: per group (scale
      ``(g, 1)``, history ``(g, L)``) or for all groups (``(1,)``, ``(L,)``).
    output_grad_state: :class:`~fp8_linen.RoleState` of the output gradient.
    recipe: a per-tensor :class:`~fp8_linen.Fp8Recipe` (default: delayed).
    out_dtype: output dtype (default: the result type of ``lhs`` and ``rhs``).
    chain: ``None`` for the first use of these states in a step, else the
      previous use's ``chain_out``.
    rhs_grad_dtype: the dtype of the parameter ``rhs`` (the experts) was cast
      from, if any: the experts' weight-gradient GEMM writes it (see
      :func:`~fp8_linen.fp8_dot_general`).

  Returns:
    ``(out (m, n), chain_out)``.

  Raises:
    ValueError: shapes that ``ragged_dot`` does not take, integer
      ``group_sizes`` missing, or a row-wise / block recipe.

  Example:
    >>> import jax.numpy as jnp
    >>> import fp8_linen as fl
    >>> st = lambda: fl.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
    >>> y, _ = fl.fp8_ragged_dot(jnp.ones((3, 2)), jnp.ones((2, 2, 2)), jnp.array([1, 2]),
    ...     input_state=st(), kernel_state=st(), output_grad_state=st())
    >>> [[round(v, 4) for v in row] for row in y.tolist()]
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
  """
  recipe = recipe or Fp8Recipe()
  if recipe.granularity != "tensor":
    raise ValueError(f"fp8_ragged_dot: recipe granularity={recipe.granularity!r} is not "
                     "supported for grouped GEMMs yet; use a per-tensor recipe "
                     "(fl.delayed_scaling() or fl.current_scaling())")
  lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
  owg.check_float("lhs", lhs)
  owg.check_float("rhs", rhs)
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer) or group_sizes.ndim != 1:
    raise ValueError(f"fp8_ragged_dot: group_sizes must be a 1-D integer array, got "
                     f"{group_sizes.dtype}{list(group_sizes.shape)}")
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] \
      or rhs.shape[0] != group_sizes.shape[0]:
    raise ValueError(f"fp8_ragged_dot: expected lhs (m, k), rhs (g, k, n), group_sizes (g,); "
                     f"got lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}")
  grouped = jnp.ndim(kernel_state[0]) == 2
  states = tuple(
      owg.check_grouped_state(name, st, rhs.shape[0]) if grouped and name == "kernel" else
      owg.check_state(name, st)
      for name, st in zip(owg.ROLES, (input_state, kernel_state, output_grad_state)))
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  first = chain is None
  spec = Fp8Spec(recipe=recipe, gemm=lowering.resolve_gemm(recipe), out_dtype=out_dtype,
                 lhs_dtype=jnp.dtype(lhs.dtype), rhs_dtype=jnp.dtype(rhs.dtype), first=first,
                 frozen=owg.quantizers_frozen(),
                 rhs_grad_dtype=lowering.grad_dtype_for(rhs, rhs_grad_dtype))
  n_chain = 2 + (rhs.shape[0] if grouped else 1)
  return _ragged_vjp(spec, grouped, lhs, rhs, group_sizes.astype(jnp.int32), states,
                     owg.chain_init(n_chain) if first else chain)
