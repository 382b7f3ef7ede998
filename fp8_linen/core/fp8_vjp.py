"""The custom_vjp every fp8 product (GEMM or convolution) runs under.

:func:`fp8_vjp` takes ``(spec, lhs, rhs, states, chain)`` with ``states`` three
:class:`~fp8_linen.core.owg.RoleState` (``input``, ``kernel``,
``output_grad``) and returns ``(y, chain_out)``; its backward rule returns
the gradients of ``lhs`` and ``rhs`` and the new state as the cotangent of
``states`` (the protocol of :mod:`fp8_linen.core.owg`). What differs between
the tensor, row-wise and block GEMMs and the convolution is only the maths of
the forward and of the two gradient products; each is a frozen, hashable
*spec* (the static first argument) with two methods:

* ``forward(lhs, rhs, states) -> (y, (q_lhs, q_rhs), (amax_lhs, amax_rhs), extras)``:
  ``q_*`` are the fp8 operands (the only large residuals, named with
  :func:`~fp8_linen.core.owg.name_fp8_residual`), ``extras`` small ones
  (scales);
* ``backward(q_lhs, q_rhs, extras, states, g) -> (d_lhs, d_rhs, amax_g)``
  (never called for an empty product: its gradients are zeros and it leaves
  the state unchanged).

Specs derive from :class:`Fp8Spec`, which holds what every product needs:
the recipe (``cfgs`` gives the three roles' :class:`~fp8_linen.ScalingConfig`),
the GEMM lowering, the dtypes and ``first`` (whether this use returns the
state; see :mod:`fp8_linen.core.owg`).

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.core import dot_general, owg
  >>> st = lambda: owg.RoleState(jnp.ones((1,)), jnp.zeros((4,)))
  >>> y, _ = dot_general.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)),
  ...     (((1,), (0,)), ((), ())), input_state=st(), kernel_state=st(),
  ...     output_grad_state=st())
  >>> y.shape
  (2, 2)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.ad_checkpoint
import jax.numpy as jnp

from fp8_linen.core import dims, lowering, mesh, owg, uses

__all__ = ["Fp8Spec", "DotSpec", "fp8_vjp", "backward_with_state"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Spec:
  """Static configuration every fp8 product spec carries (hashable).

  Attributes:
    recipe: the :class:`~fp8_linen.Fp8Recipe`.
    gemm: the resolved lowering (``'fp8'``, ``'bf16'`` or ``'f32'``).
    out_dtype: dtype of the product.
    lhs_dtype: dtype of the ``lhs`` gradient.
    rhs_dtype: dtype of the ``rhs`` gradient.
    first: whether this use returns the state.
    frozen: :func:`~fp8_linen.core.owg.frozen_quantizers` was on when the
      product was called: it returns its state unchanged.
    rhs_grad_dtype: the dtype of the parameter ``rhs`` was cast from (a
      float32 master weight of a bfloat16 layer), or ``None``: see
      :attr:`wgrad_dtype`.
    rhs_param_dtype: the dtype ``rhs`` arrives in when the product is handed
      a layer's parameter uncast (where :meth:`reads_param`), or ``None``.
      The spec rounds it to ``rhs_dtype`` before quantizing it, and its
      gradient, computed in ``rhs_dtype``, is returned cast to this dtype:
      the values of a product of the cast parameter.
  """

  recipe: Any
  gemm: str
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any
  first: bool
  frozen: bool = False
  rhs_grad_dtype: Any = None
  rhs_param_dtype: Any = None

  def reads_param(self, rhs) -> bool:
    """Whether the product rounds ``rhs`` itself where it is handed a layer's parameter.

    Only where that saves a pass: a Pallas kernel that quantizes the weight
    reads the parameter and rounds it in registers, so the rounded copy is
    never written (:class:`~fp8_linen.core.block_dot.BlockDot`). Elsewhere
    the parameter is cast before the product, whose program is then the one
    a cast kernel gives (XLA fuses the cast into the quantization's).
    """
    del rhs
    return False

  @property
  def cfgs(self):
    """The ``input``, ``kernel`` and ``output_grad`` configs."""
    return (self.recipe.input, self.recipe.kernel, self.recipe.output_grad)

  @property
  def wgrad_dtype(self):
    """The dtype the weight-gradient GEMM writes; the product returns it cast to ``rhs_dtype``.

    A bfloat16 layer over float32 parameters casts its weight gradient back
    to float32 right after the product; writing the GEMM's float32 output
    and casting it to bfloat16 and back lets XLA:GPU drop the pair (excess
    precision, its default), so the optimizer reads the GEMM's output
    instead of a bfloat16 copy cast in a pass of its own. Set only when a GPU
    is traced for (:func:`~fp8_linen.core.lowering.grad_dtype_for`).
    """
    return self.rhs_grad_dtype or self.rhs_dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotSpec(Fp8Spec):
  """A GEMM spec: :class:`~fp8_linen.core.fp8_vjp.Fp8Spec` plus dimension numbers.

  Its forward is two halves: ``quantize`` (the operands to fp8 with their
  scales, from this step's state) and ``multiply`` (the GEMM of the quantized
  operands, the scales applied once). The served model quantizes its input
  with frozen scales and reads the weight from its stored codes, then runs
  the same ``multiply``
  (:func:`~fp8_linen.core.dot_general.fp8_dot_of`), so the two agree by
  construction. (:class:`~fp8_linen.core.block_dot.BlockDot` multiplies its
  operands' 3-D views; its served forward is
  :meth:`~fp8_linen.core.block_dot.BlockDot.serve`.)
  """

  dn: dims.DimensionNumbers

  def quantize(self, lhs, rhs, states):
    """``(q_l, s_l, q_r, s_r, (amax_l, amax_r))``."""
    raise NotImplementedError

  @staticmethod
  def multiply(q_l, s_l, q_r, s_r, *, dn, recipe, gemm: str, out_dtype):
    """The product of the quantized operands.

    See :func:`~fp8_linen.core.dot_general.fp8_dot_of`.
    """
    raise NotImplementedError

  def forward(self, lhs, rhs, states):
    q_l, s_l, q_r, s_r, amaxes = self.quantize(lhs, rhs, states)
    y = self.multiply(q_l, s_l, q_r, s_r, dn=self.dn, recipe=self.recipe, gemm=self.gemm,
                      out_dtype=self.out_dtype)
    return y, (q_l, q_r), amaxes, (s_l, s_r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_vjp(spec, lhs, rhs, states, chain):
  """``(y, chain)``: ``spec``'s product, its backward the OWG state protocol (see module doc)."""
  return spec.forward(lhs, rhs, states)[0], chain


def _saved(q):
  """A residual fp8 operand as its bytes, named for remat policies (:data:`owg.CHECKPOINT_NAME`).

  Bytes, not fp8: remat rounds floating residuals it saves to IEEE formats
  (see :func:`~fp8_linen.core.owg.name_fp8_residual`), and on a mesh the
  gradient GEMMs then read the very bytes the forward GEMM gathered, so the
  partitioner gathers a weight once per step (:func:`mesh.sharing_bytes`).
  """
  return jax.ad_checkpoint.checkpoint_name(mesh.as_bytes(q), owg.CHECKPOINT_NAME)


def _fp8_vjp_fwd(spec, lhs, rhs, states, chain):
  with mesh.sharing_bytes():
    y, (q_l, q_r), amaxes, extras = spec.forward(lhs, rhs, states)
    # On an explicit mesh a spec may regather an operand (MX blocks along a
    # sharded axis); the residuals keep the operands' own sharding, which the
    # gradients must have.
    q_l, q_r = lowering.reshard_like(q_l, lhs), lowering.reshard_like(q_r, rhs)
    # Residuals: the fp8 operands, a few scalars/scale vectors, and the state
    # inputs (arguments of the step, alive anyway). No high-precision copy.
    res = ((_saved(q_l), _saved(q_r)), amaxes, extras, states)
  return (y, chain), res


def _unobserved(amaxes):
  """Zero observations shaped as the forward's (a grouped kernel observes one per group)."""
  return (*(jnp.zeros(jnp.shape(a), jnp.float32) for a in amaxes), jnp.zeros((), jnp.float32))


def backward_with_state(spec, q_l, q_r, g, states, amaxes, ct_chain, grads):
  """``((d_lhs, d_rhs), state_cts, chain_ct)``: a product's backward and its new state.

  ``grads()`` runs the two gradient products, ``-> (d_lhs, d_rhs, amax_g)``;
  ``amaxes`` are the forward's ``(amax_lhs, amax_rhs)``. Shared by every fp8
  product's custom_vjp (GEMMs, convolutions, grouped GEMMs).
  """
  empty = q_l.size == 0 or q_r.size == 0 or g.size == 0
  if empty:
    # A product with an empty operand or output (an empty batch, a VALID
    # convolution smaller than its kernel, no routed tokens) is identically
    # zero: both gradients are zero and it observes nothing, so the state
    # stays as it was.
    d_l, d_r = jnp.zeros(q_l.shape, spec.lhs_dtype), jnp.zeros(q_r.shape, spec.rhs_dtype)
    a_l, a_r, a_g = _unobserved(amaxes)
  else:
    (a_l, a_r), (d_l, d_r, a_g) = amaxes, grads()
  if spec.frozen:
    # Frozen quantizers observe nothing, so the state comes back as it was.
    a_l, a_r, a_g = _unobserved(amaxes)
  state_cts, chain_ct = owg.state_cotangents(spec.cfgs, states, (a_l, a_r, a_g), ct_chain,
                                             spec.first, empty=empty or spec.frozen)
  return (d_l, d_r), state_cts, chain_ct


def _fp8_vjp_bwd(spec, res, cts):
  with mesh.sharing_bytes():
    return _backward(spec, res, cts)


def _backward(spec, res, cts):
  (b_l, b_r), (a_l, a_r), extras, states = res
  q_l = mesh.from_bytes(b_l, spec.cfgs[0].jnp_dtype)
  q_r = mesh.from_bytes(b_r, spec.cfgs[1].jnp_dtype)
  g, ct_chain = cts
  (d_l, d_r), state_cts, chain_ct = backward_with_state(
      spec, q_l, q_r, g, states, (a_l, a_r), ct_chain,
      lambda: spec.backward(q_l, q_r, extras, states, g))
  d_l, d_r = lowering.reshard_like(d_l, q_l), lowering.reshard_like(d_r, q_r)
  d_l, d_r = owg.match_varying(d_l, q_l), owg.match_varying(d_r, q_r)
  if spec.rhs_param_dtype is not None:
    # After the sum over devices (inside shard_map), which then moves rhs_dtype's bytes,
    # as the cast parameter's gradient does.
    d_r = d_r.astype(spec.rhs_param_dtype)
  return d_l, d_r, state_cts, chain_ct


fp8_vjp.defvjp(_fp8_vjp_fwd, _fp8_vjp_bwd)
fp8_vjp = uses.compiled_when_eager(fp8_vjp, static_argnums=(0,))
