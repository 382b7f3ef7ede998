"""Tests for recipe validation in fp8_linen.recipes."""

import dataclasses

import jax.numpy as jnp
import pytest

import fp8_linen as fl


def test_defaults_and_dtype_forms():
  r = fl.Fp8Recipe()
  assert (r.input.dtype, r.kernel.dtype, r.output_grad.dtype) == (
      "float8_e4m3fn", "float8_e4m3fn", "float8_e5m2")
  assert fl.ScalingConfig(dtype=jnp.float8_e5m2).dtype == "float8_e5m2"
  assert fl.ScalingConfig(dtype="e4m3").dtype == "float8_e4m3fn"


def test_frozen_and_keyword_only():
  with pytest.raises(dataclasses.FrozenInstanceError):
    fl.ScalingConfig().margin = 3
  with pytest.raises(TypeError):
    fl.ScalingConfig("float8_e4m3fn")  # positional args are refused
  hash(fl.Fp8Recipe())  # usable as a static jit argument


@pytest.mark.parametrize("kw, field", [
    (dict(dtype="int8"), "dtype"),
    (dict(dtype=jnp.bfloat16), "dtype"),
    (dict(history_length=0), "history_length"),
    (dict(history_length=2.5), "history_length"),
    (dict(scaling="dynamic"), "scaling"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(margin=1000), "margin"),
    (dict(power_of_two="yes"), "power_of_two"),
])
def test_bad_scaling_config_names_field(kw, field):
  with pytest.raises(ValueError, match=field):
    fl.ScalingConfig(**kw)


def test_unknown_dtype_lists_allowed_values():
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    fl.ScalingConfig(dtype="float8_e3m4")


@pytest.mark.parametrize("roles", [("input", "kernel"), ("output_grad", "kernel"),
                                   ("input", "output_grad")])
def test_e5m2_times_e5m2_is_refused(roles):
  kw = {r: fl.ScalingConfig(dtype="float8_e5m2") for r in roles}
  if "output_grad" not in roles:
    kw["output_grad"] = fl.ScalingConfig(dtype="float8_e4m3fn")
  with pytest.raises(ValueError, match="e5m2 x e5m2"):
    fl.Fp8Recipe(**kw)


def test_mixed_fnuz_refused_and_fnuz_pair_ok():
  with pytest.raises(ValueError, match="fnuz"):
    fl.Fp8Recipe(input=fl.ScalingConfig(dtype="float8_e4m3fnuz"))
  r = fl.delayed_scaling(8, fnuz=True)
  assert r.output_grad.dtype == "float8_e5m2fnuz"


def test_bad_gemm_and_role():
  with pytest.raises(ValueError, match="gemm"):
    fl.Fp8Recipe(gemm="tf32")
  with pytest.raises(ValueError, match="input"):
    fl.Fp8Recipe(input="e4m3")


def test_presets():
  assert fl.current_scaling().kernel.scaling == "current"
  assert fl.delayed_scaling(32, margin=1).output_grad.margin == 1


def test_int_recipe_compute_dtype_defaults_to_auto_and_lists_allowed_values():
  assert fl.IntRecipe().compute_dtype == "auto" and fl.int8_lsq().compute_dtype == "auto"
  for pinned in ("float32", "bfloat16"):
    assert fl.IntRecipe(compute_dtype=pinned).compute_dtype == pinned
  with pytest.raises(ValueError) as e:
    fl.IntRecipe(compute_dtype="float16")
  assert str(e.value) == ("IntRecipe.compute_dtype='float16' is not allowed; allowed values: "
                          "['auto', 'float32', 'bfloat16']")
  r = fl.IntRecipe(compute_dtype="auto")
  assert fl.recipe_from_dict(fl.recipe_to_dict(r)) == r
