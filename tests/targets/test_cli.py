"""``python -m fp8_linen.testing.cli``: the table of what each case multiplies on each target."""

import os
import subprocess
import sys

import pytest

from fp8_linen.testing import cli


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "fp8_linen.testing.cli", *args],
                        capture_output=True, text=True, timeout=600,
                        env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})


def test_cli_lists_targets_and_cases(capsys):
  assert cli.main(["--list"]) == 0
  out = capsys.readouterr().out
  assert "target tpu7x" in out and "case   qconv" in out


def test_cli_prints_one_row_per_case_and_target(require_target, tmp_path):
  """As a user runs it: ``python -m`` in a process of its own, which picks its platform."""
  require_target("h100")
  require_target("tpu-v5e")
  out = _cli("--target", "h100", "--target", "tpu-v5e", "--case", "qdense-delayed",
             "--case", "bf16-dense", "--json", str(tmp_path / "rows.json"))
  assert out.returncode == 0, out
  rows = {tuple(line.split()[:2]): line.split() for line in out.stdout.splitlines()[2:]}
  assert rows[("qdense-delayed", "h100")][2:5] == ["3/3", "cuBLASLt", "fp8"], out.stdout
  assert rows[("qdense-delayed", "tpu-v5e")][2:5] == ["3/3", "MXU", "f8"], out.stdout
  assert rows[("bf16-dense", "h100")][2] == "0/3", out.stdout
  assert rows[("bf16-dense", "tpu-v5e")][2] == "0/3", out.stdout
  assert '"target": "tpu-v5e"' in (tmp_path / "rows.json").read_text()


def test_cli_rejects_unknown_names(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--target", "v7x"])
  assert exit_info.value.code == 2 and "unknown target(s) ['v7x']" in capsys.readouterr().err
