"""The quantized products of the NNX layers, per recipe family.

Each layer declares its recipe's variables once, in its constructor
(:func:`declare`), and runs its product through :func:`dot_general`,
:func:`einsum` or :func:`conv` (which read them and call the core ops). The
numerics are the core ops' (``fp8_dot_general``, ``fp8_conv_general_dilated``,
the integer fake-quant ops), exactly as the Linen layers run them.

What each recipe declares on the layer:

* :class:`~fp8_linen.Fp8Recipe`: ``<role>_scale`` and ``<role>_amax_history``
  (:class:`QuantState`) for ``input``, ``kernel``, ``output_grad``.
* :class:`~fp8_linen.IntRecipe`, STE activation: ``input_range``
  (:class:`QuantState`, ``[-min, max]``); STE weight: nothing.
* LSQ / LSQ+: ``<role>_step`` (and ``<role>_offset``) as ``nnx.Param``. The
  weight's are initialised from the initial kernel; the activation's need data:
  run :func:`calibrate` on a representative batch before training.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import fp8_linen as fl
  >>> layer = fl.nnx.Linear(8, 4, recipe=fl.int8_lsq(), rngs=nnx.Rngs(0))
  >>> fl.nnx.calibrate(layer, jnp.ones((2, 8)))
  >>> round(float(layer.input_step[0]), 4), layer.kernel_step.shape
  (0.1775, (1, 4))
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax.numpy as jnp
from flax import nnx
from jax import lax

from fp8_linen.core import dims, int_numerics, int_ops, int_product, lowering, serve, settings
from fp8_linen.core.conv import fp8_conv_general_dilated
from fp8_linen.core.dims import conv_contract, einsum_plan
from fp8_linen.core.dot_general import fp8_dot_general
from fp8_linen.nnx.state import ROLES, QuantState, chained, declare_role, read_role
from fp8_linen.recipes.fp8 import Fp8Recipe
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["declare", "einsum_kernel", "dot_general", "einsum", "conv", "calibrate",
           "check_recipe", "Serving", "converting"]

_CALIBRATING = settings.TraceSetting("nnx_calibrating", default=False)


def check_recipe(owner: str, recipe, conv: bool = False) -> None:
  """Raises ``TypeError`` unless ``recipe`` is a recipe the NNX layers run."""
  if isinstance(recipe, (Fp8Recipe, IntRecipe)):
    return
  hint = " (call it: the function returns the recipe)" if callable(recipe) else ""
  raise TypeError(f"{owner}: recipe must be an Fp8Recipe or an IntRecipe, got {recipe!r}{hint}")


def einsum_kernel(equation: str, kernel):
  """The kernel as :func:`einsum`'s product sees it, and its contracting axes there.

  An LSQ weight step covers the kernel's contracting axes in the
  ``dot_general`` that :func:`einsum_plan` lowers ``equation`` to, after the
  kernel axes the product sums away are reduced. The plan reads the input's
  shape, which a constructor does not have: the input here has the kernel's
  size on every shared subscript (and, under an ellipsis, the kernel's
  ellipsis axes), which gives the plan of every input that does not broadcast
  against the kernel. :func:`einsum` checks the step's shape against the real
  input's at every call.

  Args:
    equation: the two-operand einsum equation (input, kernel), without spaces.
    kernel: the kernel array.

  Returns:
    ``(kernel_operand, contracting_axes)``.

  Example:
    >>> import jax.numpy as jnp
    >>> k, axes = einsum_kernel('btd,dhk->bthk', jnp.ones((4, 2, 3)))
    >>> k.shape, axes
    ((4, 2, 3), (0,))
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
  if plan.rhs_sum_axes:
    kernel = jnp.sum(kernel, axis=plan.rhs_sum_axes)
  return kernel, plan.dimension_numbers[0][1]


def _step_shape(role: str, view, axes) -> tuple:
  if role == "input":
    return (1,)
  return tuple(1 if i in axes else d for i, d in enumerate(view.shape))


def _lsq_init(cfg: IntQuantConfig, view, red, shape):
  if cfg.estimator == "lsq":
    return jnp.reshape(int_numerics.lsq_init_step(view, red, cfg.qmax), shape), None
  s, b = int_numerics.lsq_plus_init(view, red, cfg.qmin, cfg.qmax)
  return jnp.reshape(s, shape), jnp.reshape(b, shape)


def _declare_int(module, role: str, cfg: IntQuantConfig | None, kernel, kernel_contract):
  if cfg is None:
    return
  if not cfg.learned:
    if role == "input":  # the observer range; weights take their range from themselves
      module.input_range = QuantState(jnp.zeros((2,), jnp.float32))
    return
  if role == "input":
    # Data-dependent init: placeholders until calibrate() sees a batch.
    module.input_step = nnx.Param(jnp.ones((1,), jnp.float32))
    if cfg.estimator == "lsq+":
      module.input_offset = nnx.Param(jnp.zeros((1,), jnp.float32))
    return
  view, axes = int_numerics.int_view(kernel, kernel_contract, cfg)
  step, offset = _lsq_init(cfg, view, axes, _step_shape(role, view, axes))
  module.kernel_step = nnx.Param(step)
  if offset is not None:
    module.kernel_offset = nnx.Param(offset)


def declare(module: nnx.Module, recipe, kernel, kernel_contract) -> None:
  """Creates ``recipe``'s state and learned quantization parameters on ``module``.

  Args:
    module: the layer (called from its constructor).
    recipe: an :class:`~fp8_linen.Fp8Recipe` or :class:`~fp8_linen.IntRecipe`.
    kernel: the layer's initial kernel (LSQ weight steps start from it).
    kernel_contract: the kernel's contracting axes in the product.
  """
  if isinstance(recipe, Fp8Recipe):
    for role in ROLES:
      declare_role(module, role, recipe.role(role))
  elif isinstance(recipe, IntRecipe):
    _declare_int(module, "input", recipe.input, None, None)
    _declare_int(module, "kernel", recipe.kernel, kernel, kernel_contract)
  else:
    check_recipe(type(module).__name__, recipe)


def _lsq_params(module, role: str, view, axes, cfg: IntQuantConfig):
  """The learned step (and offset) of one operand, broadcastable to ``view``."""
  step_var = getattr(module, f"{role}_step")
  off_var = getattr(module, f"{role}_offset", None)
  shape = _step_shape(role, view, axes)
  if _CALIBRATING.get() and role == "input":
    step, offset = _lsq_init(cfg, view, tuple(range(view.ndim)), shape)
    step_var[...] = step
    if off_var is not None:
      off_var[...] = offset
  step = step_var[...]
  if step.shape != shape:
    raise ValueError(f"{type(module).__name__}: {role}_step has shape {step.shape}, the "
                     f"recipe ({cfg.granularity}) asks for {shape}")
  as_view = (lambda t: t.reshape(())) if role == "input" else (lambda t: t)
  if cfg.estimator == "lsq":
    return (as_view(step),)
  return as_view(step), as_view(off_var[...])


def _lsq(module, role: str, view, axes, cfg: IntQuantConfig, n: int):
  params = _lsq_params(module, role, view, axes, cfg)
  g = 1.0 / math.sqrt(n * cfg.qmax)
  if cfg.estimator == "lsq":
    return int_ops.lsq_fake_quant(view, params[0], qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)
  return int_ops.lsq_plus_fake_quant(view, *params, qmin=cfg.qmin, qmax=cfg.qmax, grad_scale=g)


def _operand_params(module, role: str, x, contract_axes, cfg: IntQuantConfig):
  return int_product.operand_params(
      role, x, contract_axes, cfg, lsq_params=functools.partial(_lsq_params, module),
      observer_range=lambda: lowering.in_context(module.input_range[...]))


def _int_product(module, lhs, rhs, lc, rc, recipe: IntRecipe, key: str, run):
  """Runs ``run(**params)`` (an integer product) on ``module``'s variables."""
  return int_product.run_product(
      recipe, lhs, rhs, lc, rc, functools.partial(_operand_params, module),
      lambda f, leaf: chained(module, f"{key}/input_observer", f, leaf), run)


def _int_operand(module, role: str, x, contract_axes, cfg: IntQuantConfig | None, key: str):
  """Fake-quantizes one operand as ``cfg`` says (same estimators as the Linen layers)."""
  if cfg is None:
    return x
  view, axes = int_numerics.int_view(x, contract_axes, cfg)
  if cfg.learned:
    n = int_ops.lsq_elements(x, view, axes, role)
    return _lsq(module, role, view, axes, cfg, n).reshape(x.shape)
  if role == "input":
    rng = lowering.in_context(module.input_range[...])
    return chained(module, f"{key}/{role}_observer",
                   lambda chain: int_ops.observed_fake_quant(x, rng, cfg=cfg, chain=chain), rng)
  return int_ops.minmax_fake_quant(view, axes, cfg).reshape(x.shape)


def _fp8_states(module, recipe: Fp8Recipe):
  return tuple(read_role(module, r, recipe.role(r)) for r in ROLES)


def dot_general(module: nnx.Module, lhs, rhs, dimension_numbers, recipe, out_dtype=None,
                key: str = "dot"):
  """``recipe``'s quantized ``dot_general`` of ``lhs`` (input) and ``rhs`` (kernel).

  Reads the state :func:`declare` created on ``module``; uses of ``module`` in
  one trace are chained. A served layer (:func:`~fp8_linen.nnx.convert`) runs
  its served product instead; under a conversion run the product also
  records what serving needs.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  (_, rc), (_, rb) = dims.canonical_dn(dimension_numbers, lhs.ndim, rhs.ndim)
  return _run(module, recipe, rhs, rc, conv=False, batch=rb,
              served=lambda arrays, where: serve.served_dot(
                  lhs, rhs, dimension_numbers, recipe=recipe, arrays=arrays,
                  out_dtype=out_dtype, where=where),
              qat=lambda: _qat_dot_general(module, lhs, rhs, dimension_numbers, recipe,
                                           out_dtype, key))


def _qat_dot_general(module, lhs, rhs, dimension_numbers, recipe, out_dtype, key):
  """The QAT product of :func:`dot_general`."""
  if isinstance(recipe, Fp8Recipe):
    st = _fp8_states(module, recipe)
    return chained(module, key, lambda chain: fp8_dot_general(
        lhs, rhs, dimension_numbers, input_state=st[0], kernel_state=st[1],
        output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype, chain=chain), st[0].scale)
  check_recipe(type(module).__name__, recipe)
  (lc, rc), _ = dimension_numbers
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if int_product.dot_supported(recipe):
    return _int_product(module, lhs, rhs, lc, rc, recipe, key,
                        lambda **kw: int_product.int_dot_general(
                            lhs, rhs, dimension_numbers, recipe=recipe, out_dtype=out_dtype,
                            **kw))
  xq = _int_operand(module, "input", lhs, lc, recipe.input, key)
  wq = _int_operand(module, "kernel", rhs, rc, recipe.kernel, key)
  cd = int_product.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  y = lowering.lax_dot_general(xq.astype(cd), wq.astype(cd), dimension_numbers,
                               preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


def einsum(module: nnx.Module, equation: str, lhs, rhs, recipe, out_dtype=None,
           key: str = "dot"):
  """A two-operand einsum as one quantized ``dot_general`` (see :func:`einsum_plan`)."""
  plan = einsum_plan(equation, jnp.shape(lhs), jnp.shape(rhs))
  if plan.lhs_sum_axes:
    lhs = jnp.sum(lhs, axis=plan.lhs_sum_axes)
  if plan.rhs_sum_axes:
    rhs = jnp.sum(rhs, axis=plan.rhs_sum_axes)
  y = dot_general(module, lhs, rhs, plan.dimension_numbers, recipe, out_dtype=out_dtype, key=key)
  if plan.out_perm != tuple(range(len(plan.out_perm))):
    y = jnp.transpose(y, plan.out_perm)
  return y


def conv(module: nnx.Module, lhs, rhs, conv_kwargs: dict, recipe, out_dtype=None,
         key: str = "conv"):
  """``recipe``'s quantized convolution (``conv_kwargs`` as for ``lax.conv_general_dilated``).

  Served and converting layers as for :func:`dot_general`.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, conv_kwargs["dimension_numbers"])
  return _run(module, recipe, rhs, conv_contract(lhs.ndim, rhs.ndim, dn)[1], conv=True,
              served=lambda arrays, where: serve.served_conv(
                  lhs, rhs, conv_kwargs, recipe=recipe, arrays=arrays, out_dtype=out_dtype,
                  where=where),
              qat=lambda: _qat_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key))


def _qat_conv(module, lhs, rhs, conv_kwargs, recipe, out_dtype, key):
  """The QAT product of :func:`conv`."""
  if isinstance(recipe, Fp8Recipe):
    st = _fp8_states(module, recipe)
    return chained(module, key, lambda chain: fp8_conv_general_dilated(
        lhs, rhs, **conv_kwargs, input_state=st[0], kernel_state=st[1],
        output_grad_state=st[2], recipe=recipe, out_dtype=out_dtype, chain=chain), st[0].scale)
  check_recipe(type(module).__name__, recipe)
  dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, conv_kwargs["dimension_numbers"])
  l_contract, r_contract = conv_contract(lhs.ndim, rhs.ndim, dn)
  out_dtype = jnp.dtype(out_dtype or jnp.result_type(lhs, rhs))
  if int_product.conv_supported(recipe):
    conv = int_product.conv_static(lhs.ndim, conv_kwargs, dn)
    return _int_product(module, lhs, rhs, l_contract, r_contract, recipe, key,
                        lambda **kw: int_product.int_conv_general_dilated(
                            lhs, rhs, conv, recipe=recipe, out_dtype=out_dtype, **kw))
  xq = _int_operand(module, "input", lhs, l_contract, recipe.input, key)
  wq = _int_operand(module, "kernel", rhs, r_contract, recipe.kernel, key)
  cd = int_product.resolve_compute_dtype(recipe.compute_dtype, lhs.dtype)
  y = lowering.lax_conv_general_dilated(xq.astype(cd), wq.astype(cd), **conv_kwargs,
                                        preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


# ----------------------------------------------------------------------------
# Conversion and serving (fl.nnx.convert): the arrays and checks of core/serve.py


@dataclasses.dataclass(frozen=True, kw_only=True)
class Serving:
  """What makes a layer a served one (a static attribute ``serving`` of the layer).

  Attributes:
    path: the layer's path in the converted model (named in errors).
    arrays: the names of the served arrays the layer holds next to its
      ``kernel`` (``nnx.Param`` s: scales, zero points/offsets, code sums).
  """

  path: str
  arrays: tuple

  def arrays_of(self, module) -> dict:
    """``module``'s served arrays by name."""
    return {name: getattr(module, name)[...] for name in self.arrays}


class _Conversion:
  """The records of one conversion run: ``path -> record`` (see :mod:`fp8_linen.core.serve`)."""

  def __init__(self, paths: dict):
    self._paths = paths  # id(module) -> path, of the module objects this run calls
    self.records: dict = {}

  def path(self, module) -> str:
    return self._paths.get(id(module), "") or "<root>"

  def add(self, module, rhs, record: dict) -> None:
    var = getattr(module, "kernel", None)
    kernel = var[...] if isinstance(var, nnx.Param) else None
    if kernel is not None and kernel.size != rhs.size:  # not the weight (no fold)
      kernel = None
    self.records[self._paths.get(id(module), "")] = {
        **record, **serve.kernel_check(None if kernel is None else 0, kernel, rhs)}


_CONVERTING = settings.TraceSetting("nnx_converting", default=None)


@contextlib.contextmanager
def converting(model: nnx.Module):
  """Runs ``model``'s products in conversion mode; yields the records (path -> arrays).

  Enter it where ``model`` (the very objects that are called) is built, e.g.
  inside the function a conversion jits.
  """
  conversion = _Conversion({id(m): "/".join(str(p) for p in path)
                            for path, m in nnx.iter_modules(model)})
  with _CONVERTING.set(conversion):
    yield conversion.records


def _run(module, recipe, rhs, contract, *, conv: bool, served, qat, batch=()):
  """One product of ``module``: served (a converted layer), QAT, or QAT and its record.

  ``served(arrays, where)`` runs the served product, ``qat()`` the QAT one;
  ``contract`` and ``batch`` are the right operand's contracting and batch
  axes.
  """
  serving = getattr(module, "serving", None)
  if serving is not None:
    return served(serving.arrays_of(module), serving.path)
  conversion = _CONVERTING.get()
  if conversion is None:
    return qat()
  serve.check_servable(conversion.path(module), recipe, conv)
  y = qat()
  conversion.add(module, rhs, _record(module, recipe, rhs, contract, conv=conv, batch=batch))
  return y


def _record(module, recipe, rhs, contract, *, conv: bool, batch=()) -> dict:
  """What serving needs of one product of ``module`` (its trained state read as stored)."""
  if isinstance(recipe, Fp8Recipe):
    st = _fp8_states(module, recipe)
    return serve.fp8_record(recipe, rhs, contract, st[0], st[1], conv=conv, batch=batch)

  def read(name):
    var = getattr(module, name, None)
    return None if var is None else var[...]
  return serve.int_record(recipe, rhs, contract, read, conv=conv)


def calibrate(model: nnx.Module, *args, **kwargs) -> None:
  """Initialises the LSQ/LSQ+ activation steps (and offsets) from one batch.

  Runs ``model(*args, **kwargs)`` eagerly (not under a transform); every layer
  with a learned activation quantizer sets ``input_step``/``input_offset`` from
  the activations it sees, as the Linen layers do at ``init``. Other state is
  left as it was.
  """
  with _CALIBRATING.set(True):
    model(*args, **kwargs)
