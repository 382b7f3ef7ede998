"""Shared fixtures of the main-job tests."""

import dataclasses

import jax
from jax.experimental.compilation_cache import compilation_cache
import pytest

from fp8_linen_job import config as config_lib


@pytest.fixture(scope='module', autouse=True)
def _compilation_cache(tmp_path_factory):
  """Shares compiled programs between the job runs of these tests.

  Several tests train the same tiny models more than once (e.g. straight and
  resumed); a persistent cache makes the repeats skip XLA compilation. The
  previous settings are restored after each test module, so tests outside
  this directory are unaffected.
  """
  names = ('jax_compilation_cache_dir',
           'jax_persistent_cache_min_compile_time_secs',
           'jax_persistent_cache_min_entry_size_bytes')
  old = {n: getattr(jax.config, n) for n in names}
  compilation_cache.reset_cache()
  jax.config.update('jax_compilation_cache_dir',
                    str(tmp_path_factory.mktemp('jax_cache')))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  yield
  for name, value in old.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture
def tiny_cfg() -> config_lib.JobConfig:
  """The tiny config with the bf16 arm only (runs without the core)."""
  cfg = config_lib.load_config('tiny')
  return dataclasses.replace(cfg, arms=('bf16',), progress=False)
