"""The thin Flax Linen layer over :mod:`fp8_linen.families` (the recipes' products).

* :mod:`~fp8_linen.linen.access`: :class:`~fp8_linen.linen.access.LinenAccess`,
  the Linen side of :class:`~fp8_linen.families.VariableAccess` (state in the
  ``_overwrite_with_gradient`` collection, learned values in ``params``, one
  chain table per ``apply``), and the entry points
  ``quantized_dot_general_on`` / ``quantized_einsum_on`` /
  ``quantized_conv_on`` every layer and ``quantize_model`` call;
* :mod:`~fp8_linen.linen.dense`, :mod:`~fp8_linen.linen.conv`,
  :mod:`~fp8_linen.linen.activation`: the layers; :mod:`~fp8_linen.linen.seam`
  routes flax's injection points to the running layer;
* :mod:`~fp8_linen.linen.flax_fp8`: flax's own fp8 checkpoints.
"""
