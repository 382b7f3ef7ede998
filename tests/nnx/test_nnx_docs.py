"""The NNX snippet of docs/NNX.md runs as written and trains the state."""

import pathlib
import re

import numpy as np

import fp8_linen.nnx  # noqa: F401  (fl.nnx, until fp8_linen/__init__.py imports it)

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "NNX.md"


def test_nnx_doc_snippet_runs():
  code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  assert len(code) == 1
  ns = {}
  exec(compile(code[0], str(DOC), "exec"), ns)  # pylint: disable=exec-used
  hist = np.asarray(ns["model"].up.input_amax_history[...])
  assert (hist[:3] > 0).all() and np.isfinite(float(ns["loss"]))
