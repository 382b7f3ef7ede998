"""The thin Flax Linen layer over :mod:`fp8_linen.core`.

* :mod:`~fp8_linen.linen.state`: where a module keeps its state, and the one
  helper that runs a stateful op on it;
* :mod:`~fp8_linen.linen.dispatch`: the recipe type -> product table;
* :mod:`~fp8_linen.linen.dense`, :mod:`~fp8_linen.linen.conv`,
  :mod:`~fp8_linen.linen.activation`: the layers;
* :mod:`~fp8_linen.linen.integer`: the integer QAT products.
"""
