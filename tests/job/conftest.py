"""Shared fixtures of the main-job tests.

Repeated runs of the same tiny models (straight and resumed) skip XLA
compilation through the run's persistent compilation cache (tests/conftest.py).
"""

import dataclasses

import pytest

from fp8_linen_job import config as config_lib


@pytest.fixture
def tiny_cfg() -> config_lib.JobConfig:
  """The tiny config with the bf16 arm only (runs without the core)."""
  cfg = config_lib.load_config('tiny')
  return dataclasses.replace(cfg, arms=('bf16',), progress=False)
