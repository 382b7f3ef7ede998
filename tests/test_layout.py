"""The package's dependencies run one way (docs/ARCHITECTURE.md).

recipes -> core -> families -> {linen, nnx} -> {model_quantization,
conversion, training, monitor} -> ``__init__``; core and families never import
flax, training never imports linen, and no module imports the job or anything
above it. ``import fp8_linen`` leaves ``flax.nnx`` unimported, and nothing
fills a table of ours on import.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

import flax.linen as nn

import fp8_linen as fl

PKG = pathlib.Path(fl.__file__).resolve().parent

# layer -> the package layers its modules may import (besides themselves).
ALLOWED = {
    "recipes": set(),
    "core": {"recipes"},
    "families": {"recipes", "core"},
    "linen": {"recipes", "core", "families"},
    "interception": set(),
    "product_report": set(),
    "product_calls": {"core", "families", "interception"},
    "nnx": {"recipes", "core", "families", "interception", "product_report", "product_calls"},
    "model_quantization": {"recipes", "core", "families", "linen", "interception",
                           "product_report", "product_calls"},
    "training": {"core"},
    "monitor": {"core"},
    "conversion": {"core", "families", "linen", "product_report"},
    "ptq": {"recipes", "core", "families", "linen", "model_quantization", "conversion"},
    "lora": {"core", "families", "linen", "conversion"},
    "sensitivity": {"recipes", "core", "families", "model_quantization", "product_report"},
    "testing": {"recipes", "core", "families", "linen", "nnx", "model_quantization",
                "product_report", "training", "conversion", "root"},
}


def _layer(path: pathlib.Path) -> str:
  rel = path.relative_to(PKG)
  return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: pathlib.Path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == "fp8_linen":  # from fp8_linen import x: x is the layer
        yield from (f"fp8_linen.{a.name}" for a in node.names)
      else:
        yield node.module


def _modules():
  return [p for p in PKG.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")
          or p.parent != PKG]


def test_every_module_imports_only_lower_layers():
  bad = []
  for path in _modules():
    layer = _layer(path)
    if layer not in ALLOWED:
      bad.append(f"{path.relative_to(PKG)}: layer {layer!r} is not in the layout")
      continue
    for name in _imports(path):
      if name.startswith("fp8_linen_job"):
        bad.append(f"{path.relative_to(PKG)} imports the job ({name})")
      if not name.startswith("fp8_linen."):
        continue
      target = name.split(".")[1]
      target = "root" if target not in ALLOWED else target
      if target != layer and target not in ALLOWED[layer]:
        bad.append(f"{path.relative_to(PKG)} ({layer}) imports {name} ({target})")
  assert not bad, "\n".join(bad)


def test_core_recipes_and_families_never_import_flax():
  for sub in ("core", "recipes", "families"):
    for path in (PKG / sub).rglob("*.py"):
      flax_imports = [n for n in _imports(path) if n.split(".")[0] == "flax"]
      assert not flax_imports, (path, flax_imports)


def _core_imports(path: pathlib.Path):
  """The core modules ``path`` imports (``from fp8_linen.core import a``, ``fp8_linen.core.a``)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "fp8_linen.core":
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp8_linen.core."):
      yield node.module.split(".")[2]
    elif isinstance(node, ast.Import):
      yield from (a.name.split(".")[2] for a in node.names
                  if a.name.startswith("fp8_linen.core."))


def test_core_modules_import_each_other_one_way():
  """Inside core, modules import only modules core/__init__.py lists before them (no cycle)."""
  core = PKG / "core"
  listed = [line.split("``")[1] for line in fl.core.__doc__.splitlines()
            if line.startswith("* ``")]
  assert sorted(listed) == sorted(p.stem for p in core.glob("*.py") if p.stem != "__init__")
  bad = [f"core/{name}.py imports core/{target}.py, listed after it"
         for i, name in enumerate(listed) for target in _core_imports(core / f"{name}.py")
         if listed.index(target) >= i]
  assert not bad, "\n".join(bad)


def test_architecture_names_every_module():
  """docs/ARCHITECTURE.md names every module of the package, as it names them.

  A subpackage's module by its stem, backticked, in the row of its folder's
  layer (``| `core/` | ... `dims` ...``) or by its path anywhere
  (```nnx/layers.py```); a top-level module by its file name (```training.py```).
  """
  doc = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
  ticked = set(re.findall(r"`([^`]+)`", doc))
  rows = {m.group(1): set(re.findall(r"`([^`]+)`", line)) for line in doc.splitlines()
          if (m := re.match(r"\| `([\w/]+)/` \|", line))}
  missing = []
  for path in sorted(PKG.rglob("*.py")):
    rel = path.relative_to(PKG)
    if path.name == "__init__.py":
      continue
    if len(rel.parts) == 1:
      named = rel.name in ticked
    else:
      folder = "/".join(rel.parts[:-1])
      named = (path.stem in rows.get(folder, ()) or f"{folder}/{path.name}" in ticked
               or f"{folder}/{path.stem}" in ticked)
    if not named:
      missing.append(str(rel))
  assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_owg_is_flax_collection_name():
  from flax.linen import fp8_ops
  assert fl.OWG == fp8_ops.OVERWRITE_WITH_GRADIENT
  assert issubclass(fl.QDense, nn.Dense)


def test_public_names_are_explicit():
  assert len(set(fl.__all__)) == len(fl.__all__)
  for name in fl.__all__:
    assert hasattr(fl, name), name
  # no submodule is re-exported under a public name, except the NNX layer namespace
  assert [n for n in fl.__all__ if type(getattr(fl, n)).__name__ == "module"] == ["nnx"]


# fp8_linen.testing, one idea per module: each imports only the ones before it.
TESTING_ORDER = ["hlo", "hlo_products", "hlo_collectives", "hlo_kernels", "estimate", "targets",
                 "train_step", "compile", "passes", "cases", "cli", "collectives"]


def _testing_imports(path: pathlib.Path):
  """The fp8_linen.testing modules ``path`` imports (``from fp8_linen.testing import x``: x)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = ([f"{node.module}.{a.name}" for a in node.names]
               if node.module == "fp8_linen.testing" else [node.module])
    else:
      continue
    for name in names:
      parts = name.split(".")
      if parts[:2] == ["fp8_linen", "testing"] and len(parts) > 2:
        yield parts[2]


def test_testing_modules_import_only_earlier_ones():
  folder = PKG / "testing"
  assert sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__") == sorted(
      TESTING_ORDER)
  bad = [f"testing/{name}.py imports testing.{imported}"
         for i, name in enumerate(TESTING_ORDER)
         for imported in _testing_imports(folder / f"{name}.py")
         if imported not in TESTING_ORDER[:i]]
  assert not bad, "\n".join(bad)


def _run(code: str) -> str:
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=PKG.parent, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
  return out.stdout.strip()


def test_import_leaves_flax_nnx_unimported():
  # flax.linen itself does not import flax.nnx; fp8_linen must not either.
  assert _run("import sys, flax.linen; print('flax.nnx' in sys.modules)") == "False"
  assert _run("import sys, fp8_linen; print('flax.nnx' in sys.modules)") == "False"
  assert _run("import sys, fp8_linen as fl; fl.nnx.Linear; "
              "print('flax.nnx' in sys.modules)") == "True"
  # An NNX user's flax.nnx is already imported: fl.nnx comes with fp8_linen, and the
  # bridge maps the Linen state collection to QuantState from the start.
  assert _run("from flax import nnx; import fp8_linen as fl; "
              f"print(nnx.variablelib.VariableTypeCache['{fl.OWG}'].__name__)") == "QuantState"


def _module_level_calls(path: pathlib.Path):
  for node in ast.parse(path.read_text()).body:
    for sub in ast.walk(node):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
        break
      if isinstance(sub, ast.Call):
        fn = sub.func
        yield fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")


def test_no_module_fills_a_table_on_import():
  # The recipe table is written out in families/table.py: no module registers into it
  # when imported (so what runs never depends on which modules happened to be imported).
  bad = [f"{path.relative_to(PKG)} calls {name} at import" for path in PKG.rglob("*.py")
         for name in _module_level_calls(path) if name in ("register_recipe", "register_mode")]
  assert not bad, bad
  from fp8_linen.families import table
  assert set(table.registered()) == {fl.Fp8Recipe, fl.IntRecipe, fl.Fp8WeightOnly}
