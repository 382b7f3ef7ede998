"""The targets module itself: names, reasons a target cannot compile, and meshes."""

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
