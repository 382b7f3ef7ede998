"""YAML recipe files: turn a mapping (or a ``.yaml`` file) into a recipe.

A recipe file names its ``kind`` (``fp8`` or ``int``), optional top-level
fields of the recipe, optional ``defaults`` applied to every role, and one
mapping per role (``null`` leaves an integer role in float)::

  kind: fp8                 # Fp8Recipe
  granularity: row          # tensor | row | block
  defaults: {scaling: current, history_length: 16}
  output_grad: {dtype: float8_e5m2}

  kind: int                 # IntRecipe
  input: {bits: 8, estimator: lsq}
  kernel: {bits: 8, estimator: lsq, granularity: channel}

Every key is checked: an unknown key or a bad value raises
:class:`RecipeConfigError` naming the file, the key and the allowed values.

Example:
  >>> import fp8_linen as fl
  >>> r = fl.recipe_from_dict({'kind': 'int', 'kernel': {'bits': 4}, 'input': None})
  >>> r.kernel.qmax, r.input
  (7, None)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import yaml as pyyaml

from fp8_linen.recipes.fp8 import Fp8Recipe, ScalingConfig
from fp8_linen.recipes.integer import IntQuantConfig, IntRecipe

__all__ = ["RecipeConfigError", "recipe_from_dict", "load_recipe", "recipe_to_dict"]

_KINDS = {"fp8": (Fp8Recipe, ScalingConfig, ("input", "kernel", "output_grad")),
          "int": (IntRecipe, IntQuantConfig, ("input", "kernel"))}


class RecipeConfigError(ValueError):
  """A recipe mapping/file with an unknown key or a bad value."""


def _fields(cls) -> list[str]:
  return [f.name for f in dataclasses.fields(cls)]


def _fail(source: str, key: str, msg: str):
  raise RecipeConfigError(f"{source}: key '{key}': {msg}")


def _check_keys(source: str, prefix: str, d: Mapping, allowed) -> None:
  if not isinstance(d, Mapping):
    _fail(source, prefix or "<top>", f"expected a mapping, got {type(d).__name__}")
  for k in d:
    if k not in allowed:
      _fail(source, f"{prefix}{k}", f"unknown key; allowed keys: {sorted(allowed)}")


def _build(source: str, key: str, cls, kw: Mapping):
  try:
    return cls(**kw)
  except (ValueError, TypeError) as e:
    raise RecipeConfigError(f"{source}: key '{key}': {e}") from None


def recipe_from_dict(d: Mapping[str, Any], *, source: str = "<dict>"):
  """Builds an :class:`~fp8_linen.Fp8Recipe` or :class:`~fp8_linen.IntRecipe`.

  Args:
    d: the mapping (see the module docstring for the schema).
    source: name used in error messages (the file path for :func:`load_recipe`).

  Returns:
    The recipe.

  Raises:
    RecipeConfigError: naming ``source``, the offending key and the allowed
      keys or values.
  """
  if not isinstance(d, Mapping):
    _fail(source, "<top>", f"a recipe must be a mapping, got {type(d).__name__}")
  kind = d.get("kind")
  if kind not in _KINDS:
    _fail(source, "kind", f"{kind!r} is not allowed; allowed values: {sorted(_KINDS)}")
  recipe_cls, role_cls, roles = _KINDS[kind]
  top_fields = [f for f in _fields(recipe_cls) if f not in roles]
  _check_keys(source, "", d, ["kind", "defaults", *roles, *top_fields])
  role_fields = _fields(role_cls)
  defaults = d.get("defaults") or {}
  _check_keys(source, "defaults.", defaults, role_fields)
  kw = {k: d[k] for k in top_fields if k in d}
  role_defaults = {f.name: f.default_factory() for f in dataclasses.fields(recipe_cls)
                   if f.name in roles}
  for role in roles:
    if role in d and d[role] is None:
      if kind == "fp8":
        _fail(source, role, "fp8 roles cannot be null; give a mapping (or leave it out)")
      kw[role] = None
      continue
    given = d.get(role, {}) or {}
    _check_keys(source, f"{role}.", given, role_fields)
    if not given and not defaults:
      continue
    base = role_defaults[role]
    base_kw = {f: getattr(base, f) for f in role_fields} if base is not None else {}
    kw[role] = _build(source, role, role_cls, {**base_kw, **defaults, **given})
  return _build(source, "<recipe>", recipe_cls, kw)


PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
"""Where the shipped recipe YAMLs live (package data)."""


def recipe_names() -> tuple[str, ...]:
  """Names of the shipped recipes, each loadable with :func:`load_recipe`.

  Example:
    >>> import fp8_linen as fl
    >>> 'fp8_rowwise' in fl.recipe_names()
    True
  """
  return tuple(sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".yaml")))


def _resolve_recipe_path(path: str) -> str:
  if os.path.exists(path):
    return path
  name = os.path.basename(path)
  name = name[:-5] if name.endswith(".yaml") else name
  shipped = os.path.join(PRESETS_DIR, f"{name}.yaml")
  # A shipped name, or a path written for a source checkout
  # ("configs/recipes/fp8_rowwise.yaml") used after a wheel install.
  if (os.sep not in path or path.replace(os.sep, "/").startswith("configs/recipes/")) and \
      os.path.exists(shipped):
    return shipped
  raise RecipeConfigError(f"recipe file {path!r} not found; shipped recipe names: "
                          f"{', '.join(recipe_names())}")


def load_recipe(path: str | os.PathLike):
  """Loads a recipe from a YAML file or a shipped name (see :func:`recipe_from_dict`).

  Args:
    path: a YAML file, or the name of a shipped recipe (:func:`recipe_names`,
      e.g. ``'fp8_rowwise'``).

  Example:
    >>> import fp8_linen as fl
    >>> fl.load_recipe('fp8_rowwise').granularity
    'row'
    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / 'r.yaml'
    >>> _ = p.write_text('kind: fp8\\ngranularity: row\\ndefaults: {scaling: current}\\n')
    >>> fl.load_recipe(p).granularity
    'row'
  """
  path = _resolve_recipe_path(os.fspath(path))
  try:
    with open(path, encoding="utf-8") as f:
      d = pyyaml.safe_load(f)
  except pyyaml.YAMLError as e:
    raise RecipeConfigError(f"{path}: not valid YAML: {e}") from None
  return recipe_from_dict(d if d is not None else {}, source=path)


def recipe_to_dict(recipe) -> dict:
  """The mapping :func:`recipe_from_dict` turns back into ``recipe``.

  Example:
    >>> import fp8_linen as fl
    >>> r = fl.rowwise_scaling()
    >>> fl.recipe_from_dict(fl.recipe_to_dict(r)) == r
    True
  """
  for kind, (recipe_cls, _, roles) in _KINDS.items():
    if isinstance(recipe, recipe_cls):
      out = {"kind": kind}
      for f in _fields(recipe_cls):
        v = getattr(recipe, f)
        out[f] = (dataclasses.asdict(v) if v is not None else None) if f in roles else v
      return out
  raise TypeError(f"not a recipe: {type(recipe).__name__}")
