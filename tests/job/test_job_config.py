"""Tests of fp8_linen_job.config and the command-line overrides."""

import dataclasses
import os

import pytest
import yaml

from fp8_linen_job import config as config_lib
from fp8_linen_job import main as main_lib


def _write(tmp_path, text):
  path = tmp_path / 'cfg.yaml'
  path.write_text(text)
  return str(path)


def test_default_yaml_equals_builtin_defaults():
  assert config_lib.load_config('default') == config_lib.JobConfig()
  assert config_lib.load_config(None) == config_lib.JobConfig()


@pytest.mark.parametrize('name', ['default', 'tiny', 'large'])
def test_shipped_configs_load(name):
  cfg = config_lib.load_config(
      os.path.join(config_lib.CONFIG_DIR, f'{name}.yaml'))
  assert set(cfg.tasks) <= set(config_lib.TASKS)


def test_config_is_frozen_and_keyword_only():
  cfg = config_lib.JobConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.seed = 1  # type: ignore[misc]
  with pytest.raises(TypeError):
    config_lib.LmConfig(10)  # type: ignore[misc]


def test_unknown_key_names_file_key_and_allowed(tmp_path):
  path = _write(tmp_path, 'lm:\n  d_modle: 64\n')
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(path)
  msg = str(e.value)
  assert path in msg and "'lm.d_modle'" in msg
  assert "did you mean 'd_model'" in msg and 'num_heads' in msg


def test_unknown_top_level_key(tmp_path):
  path = _write(tmp_path, 'optimizer: sgd\n')
  with pytest.raises(config_lib.ConfigError, match=r"'optimizer'.*allowed keys"):
    config_lib.load_config(path)


def test_bad_type_names_expected_type(tmp_path):
  path = _write(tmp_path, 'digits:\n  steps: many\n')
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(path)
  msg = str(e.value)
  assert path in msg and "'digits.steps'" in msg and 'expected int' in msg


def test_bool_is_not_an_int(tmp_path):
  with pytest.raises(config_lib.ConfigError, match='expected int'):
    config_lib.load_config(_write(tmp_path, 'seed: true\n'))


def test_bad_choice_lists_allowed_values(tmp_path):
  path = _write(tmp_path, 'arms: [bf16, fp16]\n')
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(path)
  msg = str(e.value)
  assert "'arms'" in msg and "'fp16'" in msg and 'bf16, fp8, int8' in msg


def test_out_of_range_value(tmp_path):
  with pytest.raises(config_lib.ConfigError, match=r"'lm.steps'.*minimum 1"):
    config_lib.load_config(_write(tmp_path, 'lm:\n  steps: 0\n'))


def test_cross_field_check_names_file(tmp_path):
  path = _write(tmp_path, 'lm:\n  d_model: 30\n  num_heads: 4\n')
  with pytest.raises(config_lib.ConfigError, match='divisible') as e:
    config_lib.load_config(path)
  assert path in str(e.value)


def test_not_a_mapping(tmp_path):
  with pytest.raises(config_lib.ConfigError, match='mapping'):
    config_lib.load_config(_write(tmp_path, '- lm\n- digits\n'))


def test_missing_file():
  with pytest.raises(config_lib.ConfigError, match='not found'):
    config_lib.load_config('no_such_config.yaml')


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
  cfg = config_lib.load_config(_write(tmp_path, 'lm:\n  learning_rate: 3e-4\n'))
  assert cfg.lm.learning_rate == pytest.approx(3e-4)


def test_cli_overrides():
  args = main_lib.parse_args(['--config', 'tiny', '--steps', '5', '--tasks',
                              'digits', '--arms', 'bf16', '--seed', '3'])
  cfg = main_lib.config_from_args(args)
  assert cfg.tasks == ('digits',) and cfg.arms == ('bf16',)
  assert cfg.seed == 3 and cfg.lm.steps == 5 and cfg.digits.steps == 5
  args = main_lib.parse_args(['--tasks', 'lm,digits'])
  assert main_lib.config_from_args(args).tasks == ('lm', 'digits')


def test_cli_bad_value_exits_with_message(capsys):
  assert main_lib.main(['--arms', 'fp4', '--out', 'unused']) == 2
  err = capsys.readouterr().err
  assert "'fp4'" in err and 'allowed values: bf16, fp8, int8' in err


def test_default_run_has_all_three_arms():
  cfg = config_lib.JobConfig()
  assert cfg.arms == ('bf16', 'fp8', 'int8')
  assert config_lib.load_config('default').arms == cfg.arms


@pytest.mark.parametrize('value', ['fp8_rowwise',
                                   'configs/recipes/fp8_rowwise.yaml',
                                   {'kind': 'fp8', 'granularity': 'row',
                                    'defaults': {'scaling': 'current'}}])
def test_fp8_recipe_by_name_path_or_mapping(tmp_path, value):
  path = _write(tmp_path, yaml.safe_dump({'fp8_recipe': value}))
  cfg = config_lib.load_config(path)
  assert cfg.fp8_recipe == value
  recipe = config_lib.build_recipe(cfg.fp8_recipe, 'fp8', 'fp8_recipe')
  assert recipe.granularity == 'row'


def test_recipe_path_next_to_the_config(tmp_path):
  (tmp_path / 'mine.yaml').write_text('kind: int\nkernel: {bits: 4}\n')
  path = _write(tmp_path, 'int8_recipe: mine.yaml\n')
  cfg = config_lib.load_config(path)
  recipe = config_lib.build_recipe(cfg.int8_recipe, 'int', 'int8_recipe')
  assert recipe.kernel.bits == 4


def test_bad_recipe_names_file_and_full_key_once(tmp_path):
  path = _write(tmp_path, 'arms: [bf16]\nfp8_recipe:\n  input: {bogus: 1}\n')
  # Checked although the fp8 arm does not run.
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(path)
  msg = str(e.value)
  assert msg.startswith(f"{path}: key 'fp8_recipe.input.bogus': unknown key")
  assert msg.count(path) == 1 and msg.count('fp8_recipe') == 1
  assert 'history_length' in msg  # The allowed keys.


def test_bad_recipe_file_names_both_files(tmp_path):
  (tmp_path / 'bad.yaml').write_text('kind: fp8\ninput: {scaling: sometimes}\n')
  path = _write(tmp_path, f'fp8_recipe: {tmp_path / "bad.yaml"}\n')
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(path)
  msg = str(e.value)
  assert msg.startswith(f"{path}: key 'fp8_recipe': ")
  assert str(tmp_path / 'bad.yaml') in msg and 'sometimes' in msg


def test_unknown_recipe_name_lists_shipped_ones(tmp_path):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(_write(tmp_path, 'fp8_recipe: fp8_rowwize\n'))
  assert "'fp8_recipe'" in str(e.value) and 'fp8_rowwise' in str(e.value)


def test_recipe_of_the_other_kind(tmp_path):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(_write(tmp_path, 'fp8_recipe: int8_lsq\n'))
  msg = str(e.value)
  assert "'fp8_recipe'" in msg and 'IntRecipe' in msg and 'fp8_delayed' in msg
  with pytest.raises(config_lib.ConfigError, match=r"'int8_recipe\.kind'"):
    config_lib.load_config(_write(tmp_path, 'int8_recipe: {kind: fp8}\n'))


def test_recipe_checked_on_construction_too():
  with pytest.raises(config_lib.ConfigError,
                     match=r"^key 'int8_recipe\.kernel': .*bits"):
    config_lib.JobConfig(int8_recipe={'kernel': {'bits': 9}})


def test_top_level_task_key_suggests_the_nested_key(tmp_path):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config(_write(tmp_path, 'steps: 50\n'))
  msg = str(e.value)
  assert "'steps'" in msg and "'lm.steps' or 'digits.steps'" in msg


def test_unknown_config_name_lists_shipped_names():
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.load_config('nosuch')
  assert "'nosuch' not found" in str(e.value)
  assert 'shipped configs: default, large, tiny' in str(e.value)


def test_checkout_style_config_path_resolves_from_anywhere(tmp_path,
                                                           monkeypatch):
  monkeypatch.chdir(tmp_path)  # No configs/ here, as after a wheel install.
  assert config_lib.load_config('configs/job/tiny.yaml').lm.steps == 8


def test_print_config(capsys):
  assert main_lib.main(['--config', 'tiny', '--steps', '3',
                        '--print-config']) == 0
  out = capsys.readouterr().out
  assert config_lib.merge(config_lib.JobConfig(), yaml.safe_load(out)) == (
      config_lib.merge(config_lib.load_config('tiny'),
                       {'lm': {'steps': 3}, 'digits': {'steps': 3}}))
