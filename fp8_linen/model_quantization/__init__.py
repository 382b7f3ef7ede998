"""Run an unmodified Linen model with its matrix products in fp8.

:func:`quantize_model` wraps a model you did not write. Its ``init``/``apply``
run the model with:

* ``flax.linen.intercept_methods``, which tells us which module is running
  (its path is matched against the :class:`QuantizationRule` list), and
* ``jax.lax.dot_general``, ``jax.lax.conv_general_dilated``,
  ``jax.numpy.einsum``, ``jax.numpy.matmul`` and ``jax.numpy.dot``
  intercepted (:mod:`fp8_linen.interception`) for the duration of the call:
  they run the quantized product of :mod:`fp8_linen.linen.access` on that
  module's state.

That covers ``nn.Dense``, ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Conv``,
``nn.Embed.attend``, flax's attention (its two ``jnp.einsum`` calls) and raw
``jax.lax.dot_general`` / ``jnp.einsum`` / ``jnp.matmul`` / ``jnp.dot`` /
``jax.lax.conv_general_dilated`` calls inside any module method.

What the default rules quantize: every product seen, i.e. the projections,
the attention math (``q·k`` and ``p·v``) and the logits head.
:func:`projection_rules` is the usual fp8 training choice instead: projections
only, attention math and the logits head in high precision.

Where the state goes: for ``nn.Dense``/``nn.DenseGeneral``/``nn.Einsum``/``nn.Conv``
at the layer's own path (the same place as ``QDense``/``QDenseGeneral``/
``QEinsum``/``QConv``); for raw calls in other modules in a child scope per call
site, ``<module path>/<op>_<i>`` (``einsum_0``, ``dot_general_1``, ``matmul_0``,
``dot_0``, ``conv_0``), numbered in call order within one method call. The
``params`` tree is untouched, so checkpoints of the unmodified model load as
they are.

Nested ``apply`` (a tied output head written
``self.head.apply({'params': {'kernel': emb.T}}, h)``): the nested call runs
on a scope of its own that holds only the variables passed to it, never the
fp8 state. Its products are quantized with their state kept by the outer
model, at the path the nested module would have as a child of the module that
called ``apply`` (``head`` above: the same place as if ``self.head(h)`` were
called), and rules match that path. Only when that is impossible (the nested
call runs inside a transform of its own) does the product run unquantized,
with a warning.

Lifted transforms: ``nn.remat``, ``nn.scan``, ``nn.vmap``, ``nn.jit`` work as
long as the transform carries the ``_overwrite_with_gradient`` collection
(``nn.remat`` does; give ``nn.scan``/``nn.vmap`` ``variable_axes={...,
fl.OWG: 0}`` or ``{True: 0}``). A scanned body without it cannot keep state:
its products run unquantized and a warning names the fix.

Limits (by construction):

* ``x @ w`` (the operator calls jax's internal matmul), other product
  functions (``jnp.tensordot``, ``jnp.inner``, ...) and names bound at import
  time (``from jax.lax import dot_general``) are not seen. ``init`` traces the
  model once more and warns when its forward has such products
  (``on_unquantized``); :func:`~fp8_linen.product_report` lists them;
* einsums that cannot run as one product (three or more operands,
  diagonals), ``out_sharding=`` arguments, and ops called outside any module
  method run unquantized with a warning (once per call site);
* products of non-floating operands are never quantized;
* under ``jax.jit`` the choice is made when tracing; jit the wrapper's
  ``apply`` (or a function calling it), as usual.

The interception is context-local (``contextvars``): two threads may trace at
the same time, one quantized and one not, and each gets its own program.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> import fp8_linen as fl
  >>> model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
  >>> qmodel = fl.quantize_model(model, fl.Fp8Recipe(), rules=[
  ...     fl.QuantizationRule(module_path='layers_2', quantize=False),
  ...     fl.QuantizationRule(module_path='.*')])
  >>> v = qmodel.init(jax.random.key(0), jnp.ones((4, 3)))
  >>> sorted(v[fl.OWG])
  ['layers_0']
  >>> jax.tree.map(jnp.shape, v['params']) == jax.tree.map(
  ...     jnp.shape, model.init(jax.random.key(0), jnp.ones((4, 3)))['params'])
  True
"""

from fp8_linen.model_quantization.rules import projection_rules
from fp8_linen.model_quantization.wrapper import QuantizedModel, quantization, quantize_model
from fp8_linen.recipes.rules import OPERANDS, OPS, QuantizationRule

__all__ = ["OPS", "OPERANDS", "QuantizationRule", "QuantizedModel", "projection_rules",
           "quantize_model", "quantization"]
