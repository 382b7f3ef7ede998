"""Every python snippet of the README and of the docs/ pages must run as written.

Each ```python block runs on its own, in a fresh namespace, with the
repository root as working directory (as a reader who copies it would run
it). Shell commands are in ```bash blocks and are not run here.
"""

import functools
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8_linen as fl

# With -n, in one process: a snippet runs once (_run) for every test that reads it.
pytestmark = pytest.mark.xdist_group("readme")

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))


def python_snippets(text: str) -> list[tuple[str, int, str]]:
  """``(section, index within the section, code)`` of every ```python block."""
  snippets, section, counts = [], "", {}
  for m in re.finditer(r"^#+ ([^\n]*)$|^```python\n(.*?)^```", text, re.S | re.M):
    if m.group(1) is not None:
      section = m.group(1).strip()
      continue
    counts[section] = counts.get(section, 0) + 1
    snippets.append((section, counts[section], m.group(2)))
  return snippets


# (page, section, index within the section, code)
SNIPPETS = [(p.name, *s) for p in PAGES for s in python_snippets(p.read_text())]


@functools.lru_cache(maxsize=None)
def _run(section: str, index: int, page: str = "README.md") -> dict:
  """Runs one snippet (once per test session) and returns its namespace."""
  (code,) = [c for pg, s, i, c in SNIPPETS if (pg, s, i) == (page, section, index)]
  scope = {"__name__": "__readme__"}
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    exec(compile(code, f"{page}: {section} #{index}", "exec"), scope)  # noqa: S102
  finally:
    os.chdir(cwd)
  return scope


def test_snippets_are_found():
  found = {(p, s) for p, s, _, _ in SNIPPETS}
  assert len(SNIPPETS) >= 7
  assert {("README.md", "Quick start"), ("recipes.md", "Integer QAT"),
          ("quantize_model.md", "Quantizing a model you did not write")} <= found


@pytest.mark.parametrize("page,section,index", [
    pytest.param(p, s, i, id=f"{p}:{s}#{i}") for p, s, i, _ in SNIPPETS])
def test_snippet_runs_as_written(page, section, index):
  _run(section, index, page)


def test_readme_is_a_front_page():
  # What it is, the two commands, quick starts, recipes, accelerators and links: the rest
  # lives in docs/ pages, each linked from it.
  text = README.read_text()
  assert len(text.splitlines()) <= 260
  for page in PAGES[1:]:
    assert f"docs/{page.name}" in text, page.name


def test_quick_start_runs_and_updates_fp8_state():
  (code,) = [c for p, s, _, c in SNIPPETS if (p, s) == ("README.md", "Quick start")]
  assert len([l for l in code.splitlines() if l.strip()]) <= 15  # "a 15-line quick start"
  state = _run("Quick start", 1)["state"]
  assert int(state.step) == 1
  owg = state.params["_overwrite_with_gradient"]
  # QDense(10) is built first (QDense_0); QDense_1 is the layer that sees x (all ones).
  assert float(jnp.max(owg["QDense_1"]["input_amax_history"])) == 1.0


def test_integer_qat_snippet_adds_lsq_params():
  params = _run("Integer QAT", 1, "recipes.md")["variables"]["params"]
  assert set(params) == {"kernel", "bias", "input_step", "kernel_step"}
  assert params["kernel_step"].shape == (1, 256)  # per output channel


def test_quantize_model_snippet_follows_its_rules():
  scope = _run("Quantizing a model you did not write", 1, "quantize_model.md")
  owg = scope["variables"][fl.OWG]
  assert "logits" not in owg                      # rule 1: not quantized
  assert set(owg["attn_0"]) == {"query", "key", "value", "out"}  # rule 2: no einsum_*
  assert "kernel_scale" in owg["Dense_0"]         # rule 3: everything else
  # The params are those of the unquantized model.
  plain = jax.eval_shape(scope["model"].init, jax.random.key(0),
                         scope["tokens"])["params"]
  assert (jax.tree.map(jnp.shape, scope["variables"]["params"])
          == jax.tree.map(jnp.shape, plain))


def test_readme_names_the_two_commands():
  text = README.read_text()
  assert 'pip install ".[job]" && python -m fp8_linen' in text
  assert 'pip install ".[test]" && python -m pytest -n auto' in text


def test_served_model_snippet_stores_int8_and_matches_qat():
  ns = _run("From QAT to a served model", 1, "serving.md")
  assert ns["served_params"]["params"]["layers_0"]["kernel"].dtype == jnp.int8
  assert fl.OWG not in ns["served_params"]
  assert (ns["y"] == jax.jit(ns["model"].apply)(ns["variables"], ns["x"])).all()


def test_nnx_own_modules_snippet_quantizes_both_projections():
  ns = _run("NNX", 3, "nnx.md")
  model, x = ns["model"], ns["x"]
  assert fl.nnx.product_report(model, x).counts == {"quantized": 2}
  assert isinstance(model.down.dot_general_0, fl.nnx.ProductSite)
  assert not np.array_equal(model(x), ns["Mlp"]()(x))  # quantized, not float


def test_nnx_served_model_snippet_holds_codes_and_matches_frozen_qat():
  ns = _run("NNX", 4, "nnx.md")
  served, model, x = ns["served"], ns["model"], ns["x"]
  assert served.layers[2].kernel[...].dtype == jnp.int8
  assert not jax.tree.leaves(nnx.state(served, fl.nnx.QuantState))
  assert model.layers[0].use_running_average  # model.eval() froze it
  assert (ns["forward"](served, x) == ns["forward"](model, x)).all()


def test_block_served_snippet_stores_e2m1_codes_at_half_a_byte():
  ns = _run("MXFP8 and NVFP4 served models", 1, "serving.md")
  p = ns["p"]
  assert p["kernel"].dtype == jnp.float4_e2m1fn and p["kernel"].shape == (128, 64)
  assert fl.weight_bytes(p["kernel"]) == 128 * 64 // 2
