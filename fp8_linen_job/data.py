"""Data for the main job: data that ships with Python and scikit-learn.

Nothing is downloaded. The language-model text is the Python standard
library's own source code; the image task uses scikit-learn's bundled 8x8
handwritten digits. Every batch is a pure function of ``(seed, step)``, so
arms that share a seed see identical data in identical order, and a resumed
run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

SKIP_DIRS = frozenset({'site-packages', 'dist-packages', 'test', 'tests',
                       'idle_test', '__pycache__'})
"""Directories of the stdlib tree left out of the text corpus."""


def stdlib_root() -> str:
  """Returns the directory holding the Python standard library sources."""
  return os.path.dirname(os.__file__)


def stdlib_source_files(root: str | None = None) -> list[str]:
  """Lists the stdlib's ``.py`` files in a deterministic (sorted) order.

  Args:
    root: Directory to walk; defaults to :func:`stdlib_root`.

  Returns:
    Absolute paths, sorted by their path relative to ``root``. Third-party
    packages and test suites (:data:`SKIP_DIRS`) are left out.
  """
  root = root or stdlib_root()
  rel_paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames
                   if d not in SKIP_DIRS and not d.startswith('.')]
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if name.endswith('.py'):
        rel_paths.append(os.path.normpath(os.path.join(rel_dir, name)))
  rel_paths.sort(key=lambda p: p.split(os.sep))
  return [os.path.join(root, p) for p in rel_paths]


def load_stdlib_text(budget: int, root: str | None = None) -> np.ndarray:
  """Reads stdlib source files, in sorted order, up to ``budget`` bytes.

  Args:
    budget: Maximum number of bytes returned.
    root: Directory to read; defaults to :func:`stdlib_root`.

  Returns:
    A ``uint8`` array of at most ``budget`` bytes: the files concatenated,
    each followed by a newline.

  Raises:
    FileNotFoundError: If no ``.py`` files are found under ``root``.
  """
  chunks, total = [], 0
  for path in stdlib_source_files(root):
    with open(path, 'rb') as f:
      data = f.read() + b'\n'
    chunks.append(data[:budget - total])
    total += len(chunks[-1])
    if total >= budget:
      break
  if not chunks:
    raise FileNotFoundError(f'no .py files under {root or stdlib_root()}')
  return np.frombuffer(b''.join(chunks), dtype=np.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextData:
  """Byte-level next-token data with a train/validation split.

  Attributes:
    train: Training bytes (``uint8``).
    val: Validation bytes (``uint8``), the tail of the corpus.
    seq_len: Model input length; windows are ``seq_len + 1`` bytes.
    batch_size: Windows per batch.
    seed: Seeds the choice of training windows.
  """

  train: np.ndarray
  val: np.ndarray
  seq_len: int
  batch_size: int
  seed: int

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """Returns the training batch for ``step`` (a pure function of it).

    Args:
      step: The 0-based optimizer step.

    Returns:
      ``{'x': int32[batch, seq_len], 'y': int32[batch, seq_len]}`` where
      ``y`` is ``x`` shifted left by one byte.
    """
    rng = np.random.default_rng([self.seed, 1, step])
    starts = rng.integers(0, len(self.train) - self.seq_len - 1,
                          size=self.batch_size)
    return _windows(self.train, starts, self.seq_len)

  def eval_batches(self, num_batches: int) -> list[dict[str, np.ndarray]]:
    """Returns fixed validation batches: evenly spaced windows of ``val``."""
    count = num_batches * self.batch_size
    last = len(self.val) - self.seq_len - 1
    starts = np.linspace(0, last, count).astype(np.int64)
    return [_windows(self.val, s, self.seq_len)
            for s in np.split(starts, num_batches)]


def _windows(data: np.ndarray, starts: np.ndarray,
             seq_len: int) -> dict[str, np.ndarray]:
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  win = data[idx].astype(np.int32)
  return {'x': win[:, :-1], 'y': win[:, 1:]}


def make_text_data(*, text_bytes: int, val_fraction: float, seq_len: int,
                   batch_size: int, seed: int,
                   root: str | None = None) -> TextData:
  """Loads the stdlib text and splits it into train and validation.

  Args:
    text_bytes: Byte budget of the corpus.
    val_fraction: Fraction of the corpus (its tail) kept for validation.
    seq_len: Model input length.
    batch_size: Windows per batch.
    seed: Seeds the training window order.
    root: Directory to read; defaults to the stdlib.

  Returns:
    A :class:`TextData`.

  Raises:
    ValueError: If either split is too short for one window.
  """
  text = load_stdlib_text(text_bytes, root)
  n_val = int(len(text) * val_fraction)
  train, val = text[:len(text) - n_val], text[len(text) - n_val:]
  for name, part in (('train', train), ('validation', val)):
    if len(part) < seq_len + 2:
      raise ValueError(f'{name} text has {len(part)} bytes, fewer than '
                       f'seq_len + 2 = {seq_len + 2}; raise text_bytes')
  return TextData(train=train, val=val, seq_len=seq_len,
                  batch_size=batch_size, seed=seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitsData:
  """scikit-learn's 8x8 digits with a fixed train/test split.

  Attributes:
    train_x: ``float32[n_train, 8, 8, 1]`` in ``[0, 1]``.
    train_y: ``int32[n_train]`` labels 0-9.
    test_x: ``float32[n_test, 8, 8, 1]``.
    test_y: ``int32[n_test]``.
    batch_size: Images per training batch.
    seed: Seeds the epoch shuffles.
  """

  train_x: np.ndarray
  train_y: np.ndarray
  test_x: np.ndarray
  test_y: np.ndarray
  batch_size: int
  seed: int

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """Returns the training batch for ``step`` (a pure function of it).

    Batches walk through a fresh permutation of the training set each epoch;
    a batch that straddles an epoch boundary wraps into the next epoch.
    """
    n = len(self.train_x)
    flat = step * self.batch_size + np.arange(self.batch_size)
    epochs, offsets = np.divmod(flat, n)
    idx = np.empty(self.batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
      perm = np.random.default_rng([self.seed, 2, int(epoch)]).permutation(n)
      mask = epochs == epoch
      idx[mask] = perm[offsets[mask]]
    return {'x': self.train_x[idx], 'y': self.train_y[idx]}

  def eval_batches(self, batch_size: int = 512) -> list[dict[str, np.ndarray]]:
    """Returns the whole test set in order, in batches of ``batch_size``."""
    return [{'x': self.test_x[i:i + batch_size],
             'y': self.test_y[i:i + batch_size]}
            for i in range(0, len(self.test_x), batch_size)]


def make_digits_data(*, test_fraction: float, batch_size: int,
                     seed: int) -> DigitsData:
  """Loads scikit-learn's bundled digits and splits them into train and test.

  The split is the same for every seed (so runs with different seeds are
  scored on the same test images); the seed only orders the training batches.

  Args:
    test_fraction: Fraction of the 1797 images held out.
    batch_size: Images per training batch.
    seed: Seeds the epoch shuffles.

  Returns:
    A :class:`DigitsData`.
  """
  from sklearn import datasets  # pylint: disable=g-import-not-at-top

  digits = datasets.load_digits()
  x = (digits.images.astype(np.float32) / 16.0)[..., None]
  y = digits.target.astype(np.int32)
  perm = np.random.default_rng(3).permutation(len(x))
  n_test = int(round(len(x) * test_fraction))
  test, train = perm[:n_test], perm[n_test:]
  return DigitsData(train_x=x[train], train_y=y[train], test_x=x[test],
                    test_y=y[test], batch_size=batch_size, seed=seed)
