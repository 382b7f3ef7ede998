"""Configuration of the main job: frozen keyword-only dataclasses plus a YAML loader.

The built-in defaults are the dataclass defaults (``JobConfig()``); a YAML file
overrides any subset of them. Every key is checked: an unknown key, a value of
the wrong type or a value outside the allowed set raises :class:`ConfigError`
naming the file, the dotted key and what would have been accepted.

Example:
  >>> cfg = load_config('tiny')  # configs/job/tiny.yaml
  >>> cfg.lm.steps
  8
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Mapping

import yaml

TASKS = ('lm', 'digits')
"""Task names the job knows: a byte-level transformer LM and a digits CNN."""

ARMS = ('bf16', 'fp8', 'int8')
"""Arm names the job knows (see :mod:`fp8_linen_job.arms`)."""

APIS = ('linen', 'nnx')
"""Flax APIs the tasks' models can be written in (``JobConfig.api``)."""

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')
"""Where the shipped YAML configs live (package data, so a wheel has them)."""


class ConfigError(ValueError):
  """A config file or override holds an unknown key or a bad value."""


def _choices(*values: str) -> dict[str, Any]:
  return {'choices': values}


def _at_least(low: float) -> dict[str, Any]:
  return {'min': low}


def _in_range(low: float, high: float) -> dict[str, Any]:
  return {'min': low, 'max': high}


def _recipe_of(kind: str) -> dict[str, Any]:
  return {'recipe': kind}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LmConfig:
  """A small decoder-only byte-level transformer on the stdlib's Python source.

  Attributes:
    steps: Optimizer steps.
    batch_size: Sequences per step.
    seq_len: Tokens (bytes) per sequence fed to the model.
    d_model: Width of the residual stream.
    num_heads: Attention heads; must divide ``d_model``.
    num_layers: Transformer blocks.
    mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
    quantize_head: Whether the vocabulary projection uses the arm's dense
      class too (by default it stays a bf16 ``nn.Dense``, as in common fp8
      recipes).
    learning_rate: Peak AdamW learning rate.
    warmup_steps: Linear warm-up steps before the cosine decay.
    weight_decay: AdamW weight decay.
    grad_clip: Global-norm gradient clipping threshold (0 disables).
    text_bytes: Byte budget read from the stdlib ``.py`` files.
    val_fraction: Trailing fraction of the text held out for validation.
    eval_every: Evaluate every this many steps (0: only at the end).
    eval_batches: Validation batches per evaluation.
  """

  steps: int = dataclasses.field(default=300, metadata=_at_least(1))
  batch_size: int = dataclasses.field(default=16, metadata=_at_least(1))
  seq_len: int = dataclasses.field(default=64, metadata=_at_least(2))
  d_model: int = dataclasses.field(default=128, metadata=_at_least(8))
  num_heads: int = dataclasses.field(default=4, metadata=_at_least(1))
  num_layers: int = dataclasses.field(default=2, metadata=_at_least(1))
  mlp_ratio: int = dataclasses.field(default=4, metadata=_at_least(1))
  quantize_head: bool = False
  learning_rate: float = dataclasses.field(default=3e-3, metadata=_at_least(0))
  warmup_steps: int = dataclasses.field(default=40, metadata=_at_least(0))
  weight_decay: float = dataclasses.field(default=0.01, metadata=_at_least(0))
  grad_clip: float = dataclasses.field(default=1.0, metadata=_at_least(0))
  text_bytes: int = dataclasses.field(default=2_000_000,
                                      metadata=_at_least(10_000))
  val_fraction: float = dataclasses.field(default=0.05,
                                          metadata=_in_range(0.001, 0.5))
  eval_every: int = dataclasses.field(default=100, metadata=_at_least(0))
  eval_batches: int = dataclasses.field(default=4, metadata=_at_least(1))

  def __post_init__(self):
    if self.d_model % self.num_heads:
      raise ConfigError(
          f'lm.d_model ({self.d_model}) must be divisible by lm.num_heads '
          f'({self.num_heads})')


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsConfig:
  """A small CNN on scikit-learn's bundled 8x8 handwritten digits.

  Attributes:
    steps: Optimizer steps.
    batch_size: Images per step.
    conv_features: Output channels of each 3x3 convolution.
    hidden: Width of the dense layer before the classifier.
    quantize_head: Whether the 10-way classifier uses the arm's dense class.
    learning_rate: Peak AdamW learning rate.
    warmup_steps: Linear warm-up steps before the cosine decay.
    weight_decay: AdamW weight decay.
    grad_clip: Global-norm gradient clipping threshold (0 disables).
    test_fraction: Fraction of the 1797 images held out for testing.
    eval_every: Evaluate every this many steps (0: only at the end).
  """

  steps: int = dataclasses.field(default=300, metadata=_at_least(1))
  batch_size: int = dataclasses.field(default=64, metadata=_at_least(1))
  conv_features: tuple[int, ...] = (32, 64)
  hidden: int = dataclasses.field(default=128, metadata=_at_least(1))
  quantize_head: bool = False
  learning_rate: float = dataclasses.field(default=2e-3, metadata=_at_least(0))
  warmup_steps: int = dataclasses.field(default=20, metadata=_at_least(0))
  weight_decay: float = dataclasses.field(default=1e-4, metadata=_at_least(0))
  grad_clip: float = dataclasses.field(default=1.0, metadata=_at_least(0))
  test_fraction: float = dataclasses.field(default=0.2,
                                           metadata=_in_range(0.05, 0.5))
  eval_every: int = dataclasses.field(default=50, metadata=_at_least(0))

  def __post_init__(self):
    if not self.conv_features or min(self.conv_features) < 1:
      raise ConfigError('digits.conv_features must be a non-empty list of '
                        f'positive ints, got {list(self.conv_features)}')


@dataclasses.dataclass(frozen=True, kw_only=True)
class FromFloatConfig:
  """The from-float stage: PTQ, QAT from PTQ and QLoRA from the trained ``bf16`` arm.

  See :mod:`fp8_linen_job.from_float`.

  Attributes:
    enabled: Run the stage after each task's ``bf16`` arm (needs ``bf16`` in
      ``arms``; Linen models).
    qat_fraction: Steps of the QAT-from-PTQ and QLoRA runs, as a fraction of
      the task's steps.
    learning_rate_scale: Their peak learning rate (QAT, and the float run of
      as many steps) as a fraction of the task's.
    calibration_batches: Training batches PTQ calibrates on.
    lora_rank: Rank of the QLoRA adapters.
    lora_alpha: Their output scale is ``lora_alpha / lora_rank``.
    lora_learning_rate: Peak Adam learning rate of the adapters.
  """

  enabled: bool = False
  qat_fraction: float = dataclasses.field(default=0.2, metadata=_in_range(0.001, 1.0))
  learning_rate_scale: float = dataclasses.field(default=0.3, metadata=_in_range(0.0, 10.0))
  calibration_batches: int = dataclasses.field(default=4, metadata=_at_least(1))
  lora_rank: int = dataclasses.field(default=8, metadata=_at_least(1))
  lora_alpha: float = dataclasses.field(default=16.0, metadata=_at_least(0))
  lora_learning_rate: float = dataclasses.field(default=3e-3, metadata=_at_least(0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
  """The whole job: which tasks and arms to train, and how.

  Attributes:
    seed: Seeds parameter init and data order; shared by all arms.
    tasks: Tasks to run, in order (allowed: ``lm``, ``digits``).
    arms: Arms to train per task, in order (allowed: ``bf16``, ``fp8``,
      ``int8``). The ``bf16`` arm is the reference for step-time ratios.
    checkpoint_every: Save a checkpoint every this many steps (and always at
      the end).
    checkpoints_to_keep: Checkpoints kept per task and arm.
    trace_every: Record quantization scales every this many steps.
    trace_layers: How many quantized layers to trace per arm.
    fp8_recipe: Recipe of the ``fp8`` arm: the name of a shipped recipe
      (``fp8_linen.recipe_names()``, e.g. ``fp8_rowwise``), a recipe YAML
      path (relative paths are also looked up next to the job config), or
      a mapping in the schema of ``configs/recipes/*.yaml`` (``kind`` may be
      left out). Empty mapping: the library default, delayed scaling.
    int8_recipe: Recipe of the ``int8`` arm, given the same ways (default:
      ``int8_lsq``, learned step sizes; empty mapping:
      ``fp8_linen.IntRecipe()``, min/max observers with the straight-through
      estimator).
    progress: Show a tqdm progress bar per arm.
    compilation_cache: Directory of JAX's persistent compilation cache for
      the command-line job (``~`` expanded; empty: off). A later run of the
      same programs loads them instead of compiling them again: on a GPU
      the first compile of a quantized step takes minutes (XLA's GEMM
      autotuning). A cache the environment names (``JAX_COMPILATION_CACHE_DIR``)
      is left as it is.
    api: ``linen`` (default) or ``nnx``: build every task's model in Flax
      NNX (``fp8_linen.nnx.Linear``/``Conv`` in the quantized arms,
      ``nnx.Linear``/``Conv`` in ``bf16``; same architecture, variable tree,
      data and seed).
    lm: Settings of the ``lm`` task.
    digits: Settings of the ``digits`` task.
    from_float: The from-float stage (PTQ, QAT from PTQ, QLoRA; off by
      default, ``--from-float``).
  """

  seed: int = dataclasses.field(default=0, metadata=_at_least(0))
  tasks: tuple[str, ...] = dataclasses.field(default=TASKS,
                                             metadata=_choices(*TASKS))
  arms: tuple[str, ...] = dataclasses.field(default=ARMS,
                                            metadata=_choices(*ARMS))
  checkpoint_every: int = dataclasses.field(default=100, metadata=_at_least(1))
  checkpoints_to_keep: int = dataclasses.field(default=2,
                                               metadata=_at_least(1))
  trace_every: int = dataclasses.field(default=1, metadata=_at_least(1))
  trace_layers: int = dataclasses.field(default=3, metadata=_at_least(1))
  fp8_recipe: str | dict[str, Any] = dataclasses.field(
      default_factory=dict, metadata=_recipe_of('fp8'))
  int8_recipe: str | dict[str, Any] = dataclasses.field(
      default='int8_lsq', metadata=_recipe_of('int'))
  progress: bool = True
  compilation_cache: str = '~/.cache/fp8_linen/jax'
  api: str = dataclasses.field(default='linen', metadata=_choices(*APIS))
  lm: LmConfig = dataclasses.field(default_factory=LmConfig)
  digits: DigitsConfig = dataclasses.field(default_factory=DigitsConfig)
  from_float: FromFloatConfig = dataclasses.field(default_factory=FromFloatConfig)

  def __post_init__(self):
    for name in ('tasks', 'arms'):
      values = getattr(self, name)
      if not values:
        raise ConfigError(f'{name} must not be empty')
      if len(set(values)) != len(values):
        raise ConfigError(f'{name} has duplicates: {list(values)}')
    if self.from_float.enabled and 'bf16' not in self.arms:
      raise ConfigError('from_float.enabled needs the bf16 arm (its trained model is the '
                        f'float model quantized), arms are {list(self.arms)}')
    if self.from_float.enabled and self.api != 'linen':
      raise ConfigError('from_float.enabled runs the Linen models (api: linen); the library '
                        'side of NNX is fl.nnx.ptq / fl.nnx.add_lora')
    # Every recipe is checked, also those of arms not run this time, so a
    # typo surfaces when the config is loaded rather than in a later run.
    for f in dataclasses.fields(self):
      if 'recipe' in f.metadata:
        build_recipe(getattr(self, f.name), f.metadata['recipe'], f.name)

  def task(self, name: str) -> LmConfig | DigitsConfig:
    """Returns the settings of task ``name``."""
    return getattr(self, name)


# ---------------------------------------------------------------------------
# Recipes.

_RECIPE_SOURCE = '<job config>'
_RECIPE_CLASSES = {'fp8': 'Fp8Recipe', 'int': 'IntRecipe'}


def _shipped_recipes(kind: str) -> list[str]:
  """Names of the shipped recipes of ``kind`` (for error messages)."""
  import fp8_linen as fl  # pylint: disable=g-import-not-at-top
  names = []
  for name in fl.recipe_names():
    try:
      recipe = fl.load_recipe(name)
    except (OSError, ValueError):
      continue
    if isinstance(recipe, getattr(fl, _RECIPE_CLASSES[kind])):
      names.append(name)
  return names


def build_recipe(value: str | Mapping[str, Any], kind: str, key: str) -> Any:
  """Builds the ``fp8_linen`` recipe a config value describes.

  Args:
    value: A shipped recipe name, a YAML path, or a mapping in the schema of
      ``configs/recipes/*.yaml`` (``kind`` optional).
    kind: ``'fp8'`` or ``'int'``: the kind the arm needs.
    key: The config key, for error messages (e.g. ``'fp8_recipe'``).

  Returns:
    An ``fp8_linen.Fp8Recipe`` or ``fp8_linen.IntRecipe``.

  Raises:
    ConfigError: Naming ``key`` (and the recipe file, if any) when the
      library rejects the recipe or it is of the other kind.
  """
  # Imported here, not at the top: this module must import without jax and
  # the library, so that `fp8-linen-train --help` is quick.
  import fp8_linen as fl  # pylint: disable=g-import-not-at-top
  if isinstance(value, str):
    try:
      recipe = fl.load_recipe(value)
    except (OSError, ValueError) as e:
      raise ConfigError(f'key {key!r}: {e}') from None
  elif isinstance(value, Mapping):
    given = value.get('kind', kind)
    if given != kind:
      raise ConfigError(f'key {key + ".kind"!r}: {given!r} is not allowed '
                        f'here; allowed values: {kind}')
    try:
      recipe = fl.recipe_from_dict({**value, 'kind': kind},
                                   source=_RECIPE_SOURCE)
    except (TypeError, ValueError) as e:
      # The library names its own source and key; re-root the key under
      # the config key so that the message names each only once.
      m = re.match(rf"{re.escape(_RECIPE_SOURCE)}: key '([^']*)': (.*)", str(e),
                   re.S)
      if m is None:
        raise ConfigError(f'key {key!r}: {e}') from None
      inner = m.group(1)
      full = key if inner.startswith('<') else f'{key}.{inner}'
      raise ConfigError(f'key {full!r}: {m.group(2)}') from None
  else:
    raise ConfigError(f'key {key!r}: expected a recipe name, a YAML path or '
                      f'a mapping, got {value!r}')
  if not isinstance(recipe, getattr(fl, _RECIPE_CLASSES[kind])):
    raise ConfigError(
        f'key {key!r}: {value!r} is a {type(recipe).__name__}, but this arm '
        f'needs a {_RECIPE_CLASSES[kind]}; shipped ones: '
        f'{", ".join(_shipped_recipes(kind))}')
  return recipe


# ---------------------------------------------------------------------------
# Loading and validation.


def _type_name(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is tuple:
    return f'list of {_type_name(typing.get_args(tp)[0])}'
  if origin is dict:
    return 'mapping'
  if dataclasses.is_dataclass(tp):
    return 'mapping'
  return getattr(tp, '__name__', str(tp))


def _bad(where: str, key: str, msg: str) -> ConfigError:
  return ConfigError(f'{where}: key {key!r}: {msg}')


def _coerce_scalar(value: Any, tp: type, where: str, key: str) -> Any:
  """Checks a scalar against ``tp``; ints widen to float, numeric strings too."""
  if tp is bool:
    if isinstance(value, bool):
      return value
  elif tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str):  # PyYAML reads `3e-3` (no dot) as a string.
      try:
        return float(value)
      except ValueError:
        pass
  elif tp is str:
    if isinstance(value, str):
      return value
  else:
    raise TypeError(f'unsupported config field type {tp!r}')
  raise _bad(where, key, f'expected {_type_name(tp)}, got {value!r} '
             f'({type(value).__name__})')


def _check_bounds(value: Any, meta: Mapping[str, Any], where: str,
                  key: str) -> None:
  items = value if isinstance(value, tuple) else (value,)
  choices = meta.get('choices')
  for item in items:
    if choices is not None and item not in choices:
      raise _bad(where, key, f'{item!r} is not allowed; allowed values: '
                 f'{", ".join(choices)}')
    if 'min' in meta and item < meta['min']:
      raise _bad(where, key, f'{item!r} is below the minimum {meta["min"]}')
    if 'max' in meta and item > meta['max']:
      raise _bad(where, key, f'{item!r} is above the maximum {meta["max"]}')


def _coerce(value: Any, tp: Any, where: str, key: str) -> Any:
  """Converts a YAML value to field type ``tp`` or raises ConfigError."""
  origin = typing.get_origin(tp)
  if origin is tuple:
    if isinstance(value, str):  # A single name, e.g. `tasks: lm`.
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise _bad(where, key, f'expected {_type_name(tp)}, got {value!r}')
    item_tp = typing.get_args(tp)[0]
    return tuple(_coerce_scalar(v, item_tp, where, key) for v in value)
  if origin is dict:
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      raise _bad(where, key, f'expected a mapping, got {value!r}')
    return dict(value)
  if origin in (typing.Union, types.UnionType):
    raise TypeError(f'unsupported config field type {tp!r}')
  return _coerce_scalar(value, tp, where, key)


def _suggest(name: str, hints: Mapping[str, Any], prefix: str) -> str:
  """A "did you mean" hint for an unknown key, or ``''``.

  A key that exists one level down (``steps`` for ``lm.steps``) is suggested
  with its full dotted path; otherwise the closest key of this level.
  """
  nested = [f'{prefix}{field}.{name}' for field, tp in hints.items()
            if dataclasses.is_dataclass(tp)
            and name in {f.name for f in dataclasses.fields(tp)}]
  if nested:
    return (f' at this level (did you mean {" or ".join(map(repr, nested))}? '
            'it is set per task)')
  close = difflib.get_close_matches(name, list(hints), n=1)
  return f' (did you mean {close[0]!r}?)' if close else ''


def _coerce_recipe(value: Any, where: str, key: str) -> str | dict[str, Any]:
  """Checks the form of a recipe value (its content is checked on build).

  A relative YAML path that does not exist from the working directory is
  looked up next to the config file ``where``, so a config and its recipe
  can sit side by side.
  """
  if value is None:
    return {}
  if isinstance(value, Mapping):
    return dict(value)
  if isinstance(value, str):
    beside = os.path.join(os.path.dirname(where), value)
    if (not os.path.isabs(value) and not os.path.exists(value)
        and os.path.isfile(where) and os.path.isfile(beside)):
      return beside
    return value
  raise _bad(where, key, 'expected a shipped recipe name, a YAML path or a '
             f'mapping, got {value!r} ({type(value).__name__})')


def merge(base: Any, overrides: Mapping[str, Any], where: str = '<overrides>',
          prefix: str = '') -> Any:
  """Returns ``base`` (a config dataclass) with ``overrides`` applied.

  Args:
    base: A frozen config dataclass instance.
    overrides: Nested mapping of field names to new values.
    where: Names the source in error messages (usually the YAML path).
    prefix: Dotted path of ``base`` inside the top-level config.

  Returns:
    A new instance of ``type(base)``.

  Raises:
    ConfigError: On an unknown key, a bad type or a value out of range.
  """
  if not isinstance(overrides, Mapping):
    raise ConfigError(f'{where}: expected a mapping at '
                      f'{prefix.rstrip(".") or "top level"}, got {overrides!r}')
  fields = {f.name: f for f in dataclasses.fields(base)}
  hints = typing.get_type_hints(type(base))
  changes = {}
  for name, value in overrides.items():
    key = f'{prefix}{name}'
    if name not in fields:
      raise _bad(where, key, f'unknown key{_suggest(str(name), hints, prefix)}'
                 f'; allowed keys: {", ".join(fields)}')
    tp = hints[name]
    if dataclasses.is_dataclass(tp):
      changes[name] = merge(getattr(base, name), value or {}, where,
                            prefix=f'{key}.')
      continue
    if 'recipe' in fields[name].metadata:
      changes[name] = _coerce_recipe(value, where, key)
      continue
    coerced = _coerce(value, tp, where, key)
    _check_bounds(coerced, fields[name].metadata, where, key)
    changes[name] = coerced
  try:
    return dataclasses.replace(base, **changes)
  except ConfigError as e:
    raise ConfigError(f'{where}: {e}') from None


def config_names() -> tuple[str, ...]:
  """Names of the shipped job configs (``configs/job/<name>.yaml``).

  Example:
    >>> config_names()
    ('default', 'large', 'tiny')
  """
  return tuple(sorted(f[:-len('.yaml')] for f in os.listdir(CONFIG_DIR)
                      if f.endswith('.yaml')))


def resolve_path(path: str) -> str:
  """Finds a config by path, or by bare name in ``configs/job/``."""
  if os.path.isfile(path):
    return path
  # A bare name, or a path written for a source checkout
  # (`configs/job/tiny.yaml`) used where only the installed package is.
  name = path
  if path.replace(os.sep, '/').startswith('configs/job/'):
    name = os.path.basename(path)
  for candidate in (os.path.join(CONFIG_DIR, name),
                    os.path.join(CONFIG_DIR, f'{name}.yaml')):
    if os.path.isfile(candidate):
      return candidate
  raise ConfigError(f'config {path!r} not found: no such file, and not a '
                    f'shipped config; shipped configs: '
                    f'{", ".join(config_names())}')


def load_config(path: str | None = None) -> JobConfig:
  """Loads a YAML config on top of the built-in defaults.

  Args:
    path: A YAML file, or a bare name such as ``tiny`` for
      ``configs/job/tiny.yaml``. ``None`` returns the defaults.

  Returns:
    The validated :class:`JobConfig`.

  Raises:
    ConfigError: If the file is missing, is not a YAML mapping, or holds an
      unknown key or a bad value.
  """
  if path is None:
    return JobConfig()
  path = resolve_path(path)
  with open(path, encoding='utf-8') as f:
    try:
      data = yaml.safe_load(f)
    except yaml.YAMLError as e:
      raise ConfigError(f'{path}: not valid YAML: {e}') from None
  if data is None:
    data = {}
  return merge(JobConfig(), data, where=path)


def to_dict(cfg: Any) -> dict[str, Any]:
  """Returns a config as plain nested dicts and lists (YAML/JSON ready)."""
  def plain(v):
    if isinstance(v, tuple):
      return [plain(x) for x in v]
    if isinstance(v, dict):
      return {k: plain(x) for k, x in v.items()}
    return v
  return {k: plain(v) for k, v in dataclasses.asdict(cfg).items()}
