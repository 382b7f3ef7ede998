"""The package's dependencies run one way (docs/ARCHITECTURE.md).

recipes -> core -> linen -> {model_quantization, training, monitor} ->
``__init__``; core never imports flax, training never imports linen, and no
module imports the job or anything above it.
"""

import ast
import pathlib

import flax.linen as nn

import fp8_linen as fl

PKG = pathlib.Path(fl.__file__).resolve().parent

# layer -> the package layers its modules may import (besides themselves).
ALLOWED = {
    "recipes": set(),
    "core": {"recipes"},
    "linen": {"recipes", "core"},
    "nnx": {"recipes", "core"},
    "interception": set(),
    "product_report": set(),
    "model_quantization": {"recipes", "core", "linen", "interception", "product_report"},
    "training": {"core"},
    "monitor": {"core"},
    "conversion": {"core", "linen"},
    "testing": {"recipes", "core", "linen", "nnx", "model_quantization", "product_report",
                "training", "conversion", "root"},
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


def test_core_and_recipes_never_import_flax():
  for sub in ("core", "recipes"):
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
