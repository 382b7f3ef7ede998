"""Running a product on a layer: the recipe's family, in the current mode.

The layers of both APIs call :func:`dot_general`, :func:`einsum` and
:func:`conv` with their :class:`~fp8_linen.families.VariableAccess`; these
look the recipe's family up (:mod:`~fp8_linen.families.table`) and run, as
:func:`~fp8_linen.families.modes.current_mode` says, its QAT product, its
QAT product and conversion record, or its served product. NNX constructors
call :func:`declare`. Einsums are lowered to one ``dot_general`` here, once
for both APIs.

Example:
  >>> import jax.numpy as jnp
  >>> from fp8_linen.families import dispatch
  >>> k, axes = dispatch.einsum_kernel('btd,dhk->bthk', jnp.ones((4, 2, 3)))
  >>> k.shape, axes
  ((4, 2, 3), (0,))
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp
from jax import lax

from fp8_linen.core import dims, serve
from fp8_linen.core.dims import einsum_plan
from fp8_linen.families import calibration, lora, modes
from fp8_linen.families.access import VariableAccess
from fp8_linen.families.table import RecipeFamily, check_recipe, family_for

__all__ = ["declare", "declare_ragged", "dot_general", "conv", "ragged_dot", "einsum",
           "einsum_operands", "einsum_kernel", "servable_error", "kernel_params",
           "remember_kernel_param"]

# The (cast kernel, parameter) pairs the running layer's promotion made.
_PARAMS: contextvars.ContextVar = contextvars.ContextVar("fp8_linen_kernel_params", default=None)


@contextlib.contextmanager
def kernel_params():
  """Scope of one layer call: the kernels its promotion casts, with their parameters.

  The layers of both APIs promote their operands with a function that calls
  :func:`remember_kernel_param`; a :func:`dot_general` handed *that very*
  cast kernel (the same traced array, not an equal one) may give its
  family the parameter instead (``RecipeFamily.dot_general_from_param``).
  Anything done to the kernel between the promotion and the product makes a
  new array, which is then quantized as it is.
  """
  token = _PARAMS.set([])
  try:
    yield
  finally:
    _PARAMS.reset(token)


def remember_kernel_param(cast, param) -> None:
  """Records that ``cast`` is ``param`` cast to ``cast.dtype`` (outside a scope: nothing)."""
  kept = _PARAMS.get()
  if (kept is not None and cast is not None and param is not None
      and jnp.result_type(cast) != jnp.result_type(param)):
    kept.append((cast, param))


def _param_of(rhs):
  """The parameter ``rhs`` was cast from by the running layer's promotion, or ``None``."""
  return next((p for c, p in _PARAMS.get() or () if c is rhs), None)


def servable_error(where: str, recipe, conv: bool = False) -> ValueError | None:
  """The error (naming the layer ``where``) for a recipe that cannot be served, else ``None``."""
  family = family_for(recipe, where)
  missing = [name for name, fn in (("record", family.record),
                                   ("served_conv" if conv else "served_dot",
                                    family.served_conv if conv else family.served_dot))
             if fn is None]
  why = (f"its family defines no RecipeFamily.{missing[0]}" if missing
         else family.servable(recipe, conv))
  return None if why is None else serve.unservable_error(where, recipe, why)


def _check_servable(access: VariableAccess, recipe, conv: bool) -> None:
  err = servable_error(access.path, recipe, conv)
  if err is not None:
    raise err


def _run(access: VariableAccess, family: RecipeFamily, recipe, lhs, rhs, *, qat, served,
         float_product, contract, lhs_contract, conv_kwargs=None):
  """One product in the current mode.

  ``qat()`` runs the family's QAT product, ``served(lhs, rhs, arrays)`` its
  served one, ``float_product(lhs, rhs)`` the float product of the same
  operands (calibration measures it; a served product's gradient is its
  gradient); ``contract()`` gives the right operand's ``(contracting,
  batch)`` axes, ``lhs_contract()`` the input's contracting axes.
  ``conv_kwargs`` are a convolution's arguments (``None`` for a dot).
  """
  conv = conv_kwargs is not None
  in_mode = modes.current_mode()
  if in_mode == "serve":
    if (family.served_conv if conv else family.served_dot) is None:
      _check_servable(access, recipe, conv)
    return lora.served(access, family, recipe, lhs, rhs, served_fn=served,
                       float_fn=float_product, contract=contract, lhs_contract=lhs_contract,
                       conv_kwargs=conv_kwargs)
  if in_mode == "calibrate":
    # Post-training quantization measures the float model: the float product, and what
    # the product saw. It ends in a conversion, so an unservable recipe is refused now.
    _check_servable(access, recipe, conv)
    y = float_product(lhs, rhs)
    rhs = jnp.asarray(rhs)
    rc, rb = contract()
    samples, with_hessian = calibration.options()
    at, kernel = access.kernel_for(rhs)
    access.record(calibration.record(
        lhs, rhs, lhs_contract(), rc, rb, recipe=recipe, samples=samples,
        with_hessian=with_hessian, conv=conv, kernel_at=at, kernel=kernel))
    return y
  if in_mode == "convert":
    _check_servable(access, recipe, conv)
  y = qat()
  if in_mode == "convert":
    rhs = jnp.asarray(rhs)
    rc, rb = contract()
    rec = family.record(access, recipe, rhs, rc, batch=rb, conv=conv)
    access.record(serve.with_kernel_check(rec, *access.kernel_for(rhs), rhs))
  return y


def declare(access: VariableAccess, recipe, kernel=None, kernel_contract=None) -> None:
  """Declares ``recipe``'s variables on a layer before any data (NNX constructors).

  Args:
    access: the layer's variables.
    recipe: any recipe in the table.
    kernel: the layer's initial weight as the product sees it (LSQ weight
      steps start from it), or ``None`` for a layer without one.
    kernel_contract: its contracting axes in the product.
  """
  family_for(recipe, access.owner).declare(access, recipe, kernel, kernel_contract)


def declare_ragged(access: VariableAccess, recipe, groups: int) -> None:
  """Declares a grouped GEMM's variables (``groups`` experts) before any data (NNX)."""
  family = family_for(recipe, access.owner)
  if family.declare_ragged is not None:
    family.declare_ragged(access, recipe, groups)
  else:
    family.declare(access, recipe, None, None)


def dot_general(access: VariableAccess, lhs, rhs, dimension_numbers, recipe, out_dtype=None,
                key: str = "dot"):
  """``recipe``'s quantized ``dot_general`` of ``lhs`` (input) and ``rhs`` (kernel) on a layer.

  Args:
    access: the layer's variables.
    lhs: the ``input`` operand.
    rhs: the ``kernel`` operand.
    dimension_numbers: as for ``lax.dot_general``.
    recipe: any recipe in the table.
    out_dtype: output dtype (default: the result type of the operands).
    key: chain key (uses of one state in a step with one key are linked).

  Returns:
    The product, as the current mode computes it.
  """
  family = family_for(recipe, access.owner)

  def contract():
    (_, rc), (_, rb) = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
    return rc, rb

  def lhs_contract():
    (lc, _), _ = dims.canonical_dn(dimension_numbers, jnp.ndim(lhs), jnp.ndim(rhs))
    return lc

  param = _param_of(rhs) if family.dot_general_from_param is not None else None

  def qat():
    if param is not None:
      return family.dot_general_from_param(access, lhs, rhs, param, dimension_numbers, recipe,
                                           out_dtype, key)
    return family.dot_general(access, lhs, rhs, dimension_numbers, recipe, out_dtype, key)

  return _run(access, family, recipe, lhs, rhs, contract=contract, lhs_contract=lhs_contract,
              float_product=lambda x, w: calibration.float_dot(x, w, dimension_numbers,
                                                               out_dtype),
              qat=qat,
              served=lambda x, w, arrays: family.served_dot(
                  x, w, dimension_numbers, recipe=recipe, arrays=arrays,
                  out_dtype=out_dtype, where=access.path))


def conv(access: VariableAccess, lhs, rhs, conv_kwargs: dict, recipe, out_dtype=None,
         key: str = "conv"):
  """``recipe``'s quantized convolution (``conv_kwargs`` as for ``lax.conv_general_dilated``).

  As :func:`dot_general`, for a family with a convolution.
  """
  family = check_recipe(access.owner, recipe, conv=True)

  def contract():
    dn = lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs),
                                    conv_kwargs["dimension_numbers"])
    return dims.conv_contract(jnp.ndim(lhs), jnp.ndim(rhs), dn)[1], ()

  def lhs_contract():
    dn = lax.conv_dimension_numbers(jnp.shape(lhs), jnp.shape(rhs),
                                    conv_kwargs["dimension_numbers"])
    return dims.conv_contract(jnp.ndim(lhs), jnp.ndim(rhs), dn)[0]

  return _run(access, family, recipe, lhs, rhs, contract=contract, lhs_contract=lhs_contract,
              conv_kwargs=conv_kwargs,
              float_product=lambda x, w: calibration.float_conv(x, w, conv_kwargs, out_dtype),
              qat=lambda: family.conv(access, lhs, rhs, conv_kwargs, recipe, out_dtype, key),
              served=lambda x, w, arrays: family.served_conv(
                  x, w, conv_kwargs, recipe=recipe, arrays=arrays, out_dtype=out_dtype,
                  where=access.path))


def ragged_dot(access: VariableAccess, lhs, rhs, group_sizes, recipe, out_dtype=None,
               key: str = "ragged"):
  """``recipe``'s quantized grouped GEMM (``jax.lax.ragged_dot``) on a layer.

  Args:
    access: the layer's variables.
    lhs: the ``input`` operand ``(m, k)``, rows sorted by group.
    rhs: the ``kernel`` operand ``(g, k, n)``: one weight per group.
    group_sizes: integer ``(g,)``.
    recipe: a recipe whose family has a grouped GEMM.
    out_dtype: output dtype (default: the result type of the operands).
    key: chain key.

  Raises:
    ValueError: the recipe's family has no grouped GEMM, or none that can be
      converted or served (fp8 and symmetric STE integer recipes can: the
      experts' weights are stored as codes with their trained scales), or
      the model is being calibrated.
  """
  family = family_for(recipe, access.owner)
  if family.ragged_dot is None:
    raise ValueError(f"{access.path}: {type(recipe).__name__} has no quantized grouped GEMM "
                     "(jax.lax.ragged_dot); use an fp8 per-tensor recipe "
                     "(fl.delayed_scaling(), fl.current_scaling()) for the experts, or a rule "
                     "that leaves them unquantized")
  in_mode = modes.current_mode()
  servable = family.ragged_record is not None and family.served_ragged is not None
  if in_mode == "calibrate" or (in_mode in ("convert", "serve") and not servable):
    what = {"convert": "converted", "serve": "served", "calibrate": "calibrated"}[in_mode]
    raise ValueError(f"{access.path}: a quantized grouped GEMM (jax.lax.ragged_dot) under "
                     f"{type(recipe).__name__} cannot be {what} yet; train the experts with an "
                     "fp8 recipe, or convert a model whose rules leave them unquantized")
  if in_mode == "serve":
    if lora.phase() == "merge" and "kernel_scale" in access.served_arrays():
      raise ValueError(f"{access.path}: experts stored as codes (a grouped GEMM, "
                       "jax.lax.ragged_dot) have no LoRA merge yet; merge a model whose rules "
                       "leave the experts unquantized")
    return family.served_ragged(lhs, rhs, group_sizes, recipe=recipe,
                                arrays=access.served_arrays(), out_dtype=out_dtype)
  y = family.ragged_dot(access, lhs, rhs, group_sizes, recipe, out_dtype, key)
  if in_mode == "convert":
    rec = family.ragged_record(access, recipe, rhs)
    access.record(serve.with_kernel_check(rec, *access.kernel_for(rhs), rhs))
  return y


def _reduce(x, axes):
  """Sums ``axes`` away; size-1 axes (broadcast ones) are squeezed, not reduced."""
  if not axes:
    return x
  ones = tuple(a for a in axes if x.shape[a] == 1)
  if len(ones) < len(axes):
    x = jnp.sum(x, axis=tuple(a for a in axes if a not in ones), keepdims=True)
  return jnp.squeeze(x, axis=axes)


def einsum_operands(equation: str, lhs, rhs):
  """``(lhs, rhs, plan)``: the operands as the einsum's one ``dot_general`` takes them.

  The axes only one operand has and the output lacks are summed away first;
  size-1 (broadcast) axes are squeezed, so the other operand's axis becomes a
  free dimension of the GEMM and nothing is broadcast in memory.
  """
  plan = einsum_plan(equation, jnp.shape(lhs), jnp.shape(rhs))
  return _reduce(lhs, plan.lhs_sum_axes), _reduce(rhs, plan.rhs_sum_axes), plan


def einsum(access: VariableAccess, equation: str, lhs, rhs, recipe, out_dtype=None,
           key: str = "dot"):
  """A two-operand einsum as one quantized ``dot_general`` on a layer.

  Broadcasting equations (ellipses of different ranks, size-1 axes such as
  the single key head of multi-query attention) run as one GEMM too
  (:func:`einsum_operands`).

  Args:
    access: the layer's variables.
    equation: the einsum equation (see :func:`~fp8_linen.core.dims.einsum_plan`).
    lhs: first operand (the ``input`` role).
    rhs: second operand (the ``kernel`` role).
    recipe: any recipe in the table.
    out_dtype: output dtype (default: the result type of the operands).
    key: chain key (uses of one state in a step with one key are linked).

  Returns:
    The einsum result.
  """
  lhs, rhs, plan = einsum_operands(equation, lhs, rhs)
  y = dot_general(access, lhs, rhs, plan.dimension_numbers, recipe, out_dtype=out_dtype,
                  key=key)
  if plan.out_perm != tuple(range(len(plan.out_perm))):
    y = jnp.transpose(y, plan.out_perm)
  return y


def einsum_kernel(equation: str, kernel):
  """The kernel as :func:`einsum`'s product sees it, and its contracting axes there.

  An LSQ weight step covers the kernel's contracting axes in the
  ``dot_general`` that :func:`einsum` lowers ``equation`` to, after the
  kernel axes the product sums away are reduced. The plan reads the input's
  shape, which a constructor does not have: the input here has the kernel's
  size on every shared subscript (and, under an ellipsis, the kernel's
  ellipsis axes), which gives the plan of every input that does not broadcast
  against the kernel. The product checks the step's shape against the real
  input's at every call.

  Args:
    equation: the two-operand einsum equation (input, kernel), without spaces.
    kernel: the kernel array.

  Returns:
    ``(kernel_operand, contracting_axes)``.
  """
  ins = equation.partition("->")[0]
  lhs_term, rhs_term = ins.split(",")
  rhs_letters = rhs_term.replace("...", "")
  n_ell = kernel.ndim - len(rhs_letters) if "..." in rhs_term else 0
  ell_at = rhs_term.find("...")
  ell_shape = tuple(kernel.shape[ell_at:ell_at + n_ell]) if n_ell else ()
  rhs_sizes = dict(zip(rhs_term.replace("...", "-" * n_ell), kernel.shape))
  lhs_shape = []
  for part in lhs_term.split("..."):
    lhs_shape += [rhs_sizes.get(c, 1) for c in part]
    lhs_shape += list(ell_shape)
  lhs_shape = lhs_shape[:len(lhs_shape) - len(ell_shape)]  # no ellipsis after the last part
  plan = einsum_plan(equation, tuple(lhs_shape), kernel.shape)
  return _reduce(kernel, plan.rhs_sum_axes), plan.dimension_numbers[0][1]
