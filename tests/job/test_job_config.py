"""Tests of fp8_linen_job.config and the command-line overrides."""

import dataclasses
import os

import pytest

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
