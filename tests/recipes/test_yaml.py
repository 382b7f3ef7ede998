"""YAML recipe loading: every shipped file loads; errors name file, key, allowed values."""

import dataclasses
import pathlib

import pytest

import fp8_linen as fl

from fp8_linen.recipes import yaml as recipes_yaml

SHIPPED = sorted(pathlib.Path(recipes_yaml.PRESETS_DIR).glob("*.yaml"))


def test_there_are_shipped_recipes():
  names = {p.stem for p in SHIPPED}
  assert {"fp8_delayed", "fp8_current", "fp8_rowwise", "mx_block", "int8_lsq",
          "int4_lsq_plus", "int8_ste"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_yaml_loads_and_round_trips(path):
  r = fl.load_recipe(path)
  assert isinstance(r, (fl.Fp8Recipe, fl.IntRecipe))
  assert fl.recipe_from_dict(fl.recipe_to_dict(r)) == r


def test_shipped_files_mean_what_they_say():
  load = fl.load_recipe  # shipped names resolve to the package presets
  assert load("fp8_delayed") == fl.delayed_scaling(1024)
  assert load("fp8_current") == fl.current_scaling()
  assert load("fp8_rowwise") == fl.rowwise_scaling()
  assert load("mx_block") == fl.mx_block_scaling()
  assert load("int8_lsq") == fl.int8_lsq()
  assert load("int4_lsq_plus") == fl.int4_lsq_plus()
  mixed = load("fp8_mixed")
  assert (mixed.input.scaling, mixed.kernel.scaling) == ("current", "delayed")
  assert mixed.kernel.power_of_two and mixed.output_grad.margin == 1
  assert load("fp8_fnuz").output_grad.dtype == "float8_e5m2fnuz"
  g = load("int4_group")
  assert g.input is None and g.kernel.group_size == 32


def test_defaults_apply_to_every_role_and_roles_override():
  r = fl.recipe_from_dict({"kind": "fp8", "defaults": {"history_length": 8},
                           "kernel": {"history_length": 4}})
  assert (r.input.history_length, r.kernel.history_length, r.output_grad.history_length) == (8, 4, 8)
  assert r.output_grad.dtype == "float8_e5m2"  # role default dtype kept


def _write(tmp_path, text):
  p = tmp_path / "bad.yaml"
  p.write_text(text)
  return p


@pytest.mark.parametrize("text, key, allowed", [
    ("kind: fp8\ninput: {dtyp: e4m3}\n", "input.dtyp", "allowed keys"),
    ("kind: fp8\ngranulrity: row\n", "granulrity", "block_size"),
    ("kind: int\nkernel: {bits: 9}\n", "kernel", "[2, 8]"),
    ("kind: int\nkernel: {estimator: lsqq}\n", "kernel", "'lsq+'"),
    ("kind: fp8\ninput: {dtype: float16}\n", "input", "float8_e4m3fn"),
    ("kind: fp8\ndefaults: {history_length: 0}\n", "input", "history_length"),
    ("kind: fp8\ninput: {dtype: e5m2}\n", "<recipe>", "e5m2"),
    ("kind: fp9\n", "kind", "['fp8', 'int']"),
    ("kind: fp8\ngranularity: row\n", "<recipe>", "['current']"),
    ("kind: fp8\ninput: null\n", "input", "mapping"),
])
def test_errors_name_file_key_and_allowed(tmp_path, text, key, allowed):
  p = _write(tmp_path, text)
  with pytest.raises(fl.RecipeConfigError) as e:
    fl.load_recipe(p)
  msg = str(e.value)
  assert str(p) in msg and f"key '{key}'" in msg and allowed in msg, msg


def test_invalid_yaml_and_non_mapping(tmp_path):
  with pytest.raises(fl.RecipeConfigError, match="not valid YAML"):
    fl.load_recipe(_write(tmp_path, "kind: [fp8\n"))
  with pytest.raises(fl.RecipeConfigError, match="mapping"):
    fl.load_recipe(_write(tmp_path, "- 1\n- 2\n"))


def test_loaded_recipe_is_frozen():
  r = fl.load_recipe(SHIPPED[0])
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.gemm = "f32"
