"""Pure-JAX quantization: numerics and custom-gradient ops. Never imports flax.

* :mod:`~fp8_linen.core.numerics`, :mod:`~fp8_linen.core.int_numerics`: plain
  ``jnp`` functions (casts, scales, histories; integer grids);
* :mod:`~fp8_linen.core.dims`: dimension-number algebra and einsum planning;
* :mod:`~fp8_linen.core.lowering`: which GEMM form a backend gets;
* :mod:`~fp8_linen.core.owg`: the state protocol (``RoleState``, chains, state
  cotangents, residual names);
* :mod:`~fp8_linen.core.fp8_vjp`: the custom_vjp every fp8 product runs under;
* :mod:`~fp8_linen.core.qdq`, :mod:`~fp8_linen.core.dot_general`,
  :mod:`~fp8_linen.core.conv`, :mod:`~fp8_linen.core.int_ops`: the ops.
"""
