"""The NNX page's first snippet runs as written and trains the state."""

import pathlib
import re

import numpy as np

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "nnx.md"


def test_nnx_doc_snippet_runs():
  section = DOC.read_text().split("\n## NNX\n", 1)[1].split("\n## ", 1)[0]
  code = re.findall(r"```python\n(.*?)```", section, re.S)
  assert code  # the first is the training example (the others run in test_readme.py)
  ns = {}
  exec(compile(code[0], str(DOC), "exec"), ns)  # pylint: disable=exec-used
  hist = np.asarray(ns["model"].up.input_amax_history[...])
  assert (hist[:3] > 0).all() and np.isfinite(float(ns["loss"]))
