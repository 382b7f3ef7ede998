"""The targets module itself: names, reasons a target cannot compile, meshes and the CLI."""

import os
import subprocess
import sys

import pytest

from fp8_linen.testing import targets


def test_every_target_has_peaks_and_a_platform():
  for t in targets.TARGETS.values():
    assert t.platform in ("gpu", "tpu")
    assert t.peaks.flops["bf16"] > 0 and t.peaks.hbm > 0 and t.peaks.source
  assert set(targets.SINGLE_DEVICE) <= set(targets.TARGETS)


def test_unknown_target_names_the_known_ones():
  with pytest.raises(ValueError, match=r"target='v5e' is not a known target; known: \["):
    targets.get_target("v5e")


def test_missing_libtpu_says_how_to_install_it(monkeypatch):
  real = targets._version  # pylint: disable=protected-access
  monkeypatch.setattr(targets, "_version", lambda d: None if d == "libtpu" else real(d))
  reason = targets.availability("tpu-v6e").reason
  assert reason.startswith("libtpu is not installed: pip install \"jax[tpu]==")
  assert "fp8_linen[targets]" in reason


def test_libtpu_at_another_version_than_jax_pins_is_named(monkeypatch):
  real = targets._version  # pylint: disable=protected-access
  monkeypatch.setattr(targets, "_version", lambda d: "0.0.1" if d == "libtpu" else real(d))
  reason = targets.availability("tpu-v5e").reason
  assert "libtpu 0.0.1 is not the version jax" in reason and "libtpu==" in reason


def test_missing_cuda_plugin_says_how_to_install_it(monkeypatch):
  monkeypatch.setattr(targets, "plugin_installed", lambda: False)
  reason = targets.availability("b200").reason
  assert reason.startswith("the CUDA PJRT plugin is not installed: pip install")


def test_target_mesh_checks_its_shape(require_target):
  require_target("h100x8")
  mesh = targets.target_mesh("h100x8", (2, 4), ("data", "model"))
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  with pytest.raises(ValueError, match="has 6 devices; h100x8 has 8"):
    targets.target_mesh("h100x8", (2, 3), ("data", "model"))


def test_tpu7x_target_is_one_tensorcore(require_target):
  require_target("tpu7x")
  (device,) = targets.target_mesh("tpu7x").devices.flat
  assert device.device_kind == "TPU7x" and device.core_on_chip == 0


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "fp8_linen.testing.targets", *args],
                        capture_output=True, text=True, timeout=600,
                        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})


def test_cli_lists_targets_and_cases():
  out = _cli("--list")
  assert out.returncode == 0, out
  assert "target tpu7x" in out.stdout and "case   qconv" in out.stdout


def test_cli_prints_one_row_per_case_and_target(require_target, tmp_path):
  require_target("h100")
  require_target("tpu-v5e")
  out = _cli("--target", "h100", "--target", "tpu-v5e", "--case", "qdense-delayed",
             "--json", str(tmp_path / "rows.json"))
  assert out.returncode == 0, out
  rows = {tuple(line.split()[:2]): line.split() for line in out.stdout.splitlines()[2:]}
  assert rows[("qdense-delayed", "h100")][2:5] == ["3/3", "cuBLASLt", "fp8"], out.stdout
  assert rows[("qdense-delayed", "tpu-v5e")][2:5] == ["3/3", "MXU", "f8"], out.stdout
  assert '"target": "tpu-v5e"' in (tmp_path / "rows.json").read_text()


def test_cli_rejects_unknown_names():
  out = _cli("--target", "v7x")
  assert out.returncode == 2 and "unknown target(s) ['v7x']" in out.stderr
