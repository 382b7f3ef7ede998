"""Pure-JAX quantization: numerics and custom-gradient ops. Never imports flax.

* :mod:`~fp8_linen.core.numerics`, :mod:`~fp8_linen.core.int_numerics`: plain
  ``jnp`` functions (casts, scales, histories; integer grids);
* :mod:`~fp8_linen.core.dims`: dimension-number algebra and einsum planning;
* :mod:`~fp8_linen.core.lowering`: which GEMM form a backend gets;
* :mod:`~fp8_linen.core.owg`: the state protocol (``RoleState``, chains, state
  cotangents, residual names);
* :mod:`~fp8_linen.core.product`: the custom_vjp skeleton of every fp8 product;
* :mod:`~fp8_linen.core.qdq`, :mod:`~fp8_linen.core.dot_general`,
  :mod:`~fp8_linen.core.conv`, :mod:`~fp8_linen.core.int_ops`,
  :mod:`~fp8_linen.core.int_product`: the ops;
* :mod:`~fp8_linen.core.serve`: served products and conversion records
  (:class:`~fp8_linen.core.serve.ServedRecord`);
* :mod:`~fp8_linen.core.uses`, :mod:`~fp8_linen.core.settings`: the uses of
  one state in a step; trace-time settings.

Nothing here knows a layer: :mod:`fp8_linen.families` runs these ops on a
layer's variables, for both Flax APIs.
"""
