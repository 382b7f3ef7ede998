"""The README's quick start must keep running as written."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_runs_and_updates_fp8_state():
  text = README.read_text()
  quick = text[text.index("## Quick start"):]
  code = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
  assert len([l for l in code.splitlines() if l.strip()]) <= 15  # "a 15-line quick start"
  scope = {}
  exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - our own README
  state = scope["state"]
  assert int(state.step) == 1
  owg = state.params["_overwrite_with_gradient"]
  # QDense(10) is built first (QDense_0); QDense_1 is the layer that sees x (all ones).
  assert float(jnp.max(owg["QDense_1"]["input_amax_history"])) == 1.0


def test_readme_names_the_two_commands():
  text = README.read_text()
  assert 'pip install ".[job]" && python -m fp8_linen' in text
  assert 'pip install ".[test]" && python -m pytest' in text
