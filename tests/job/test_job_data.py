"""Tests of fp8_linen_job.data: deterministic loaders with the right shapes."""

import os

import numpy as np
import pytest

from fp8_linen_job import data


def test_stdlib_files_sorted_and_without_third_party():
  files = data.stdlib_source_files()
  root = data.stdlib_root()
  rel = [os.path.relpath(f, root) for f in files]
  assert rel == sorted(rel, key=lambda p: p.split(os.sep))
  assert len(files) > 100
  assert all(f.endswith('.py') for f in files)
  assert not any(set(p.split(os.sep)) & data.SKIP_DIRS for p in rel)


def test_text_budget_and_determinism():
  a = data.load_stdlib_text(30_000)
  b = data.load_stdlib_text(30_000)
  assert a.dtype == np.uint8 and len(a) == 30_000
  np.testing.assert_array_equal(a, b)
  assert b'import' in a.tobytes()


@pytest.fixture(scope='module')
def text():
  return data.make_text_data(text_bytes=40_000, val_fraction=0.1, seq_len=32,
                             batch_size=4, seed=7)


def test_text_split_and_batches(text):
  assert len(text.val) == 4_000 and len(text.train) == 36_000
  batch = text.train_batch(3)
  assert batch['x'].shape == batch['y'].shape == (4, 32)
  assert batch['x'].dtype == np.int32
  np.testing.assert_array_equal(batch['x'][:, 1:], batch['y'][:, :-1])
  for key in ('x', 'y'):
    np.testing.assert_array_equal(batch[key], text.train_batch(3)[key])
  assert not np.array_equal(batch['x'], text.train_batch(4)['x'])


def test_text_batches_depend_on_seed_only_through_seed():
  kw = dict(text_bytes=20_000, val_fraction=0.1, seq_len=8, batch_size=2)
  a = data.make_text_data(seed=1, **kw).train_batch(0)['x']
  b = data.make_text_data(seed=1, **kw).train_batch(0)['x']
  c = data.make_text_data(seed=2, **kw).train_batch(0)['x']
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_text_eval_batches_fixed(text):
  a, b = text.eval_batches(3), text.eval_batches(3)
  assert len(a) == 3
  for x, y in zip(a, b):
    assert x['x'].shape == (4, 32)
    np.testing.assert_array_equal(x['x'], y['x'])
    assert x['x'].max() < 256


def test_text_too_short_raises():
  with pytest.raises(ValueError, match='text_bytes'):
    data.make_text_data(text_bytes=10_000, val_fraction=0.001, seq_len=64,
                        batch_size=1, seed=0)


@pytest.fixture(scope='module')
def digits():
  return data.make_digits_data(test_fraction=0.2, batch_size=100, seed=0)


def test_digits_shapes_and_split(digits):
  n_train, n_test = len(digits.train_x), len(digits.test_x)
  assert n_train + n_test == 1797 and n_test == 359
  assert digits.train_x.shape == (n_train, 8, 8, 1)
  assert digits.train_x.dtype == np.float32
  assert 0.0 <= digits.train_x.min() and digits.train_x.max() <= 1.0
  assert set(np.unique(digits.train_y)) == set(range(10))
  batch = digits.train_batch(0)
  assert batch['x'].shape == (100, 8, 8, 1) and batch['y'].shape == (100,)


def test_digits_split_is_fixed_across_seeds(digits):
  other = data.make_digits_data(test_fraction=0.2, batch_size=100, seed=5)
  np.testing.assert_array_equal(digits.test_y, other.test_y)
  assert not np.array_equal(digits.train_batch(0)['y'],
                            other.train_batch(0)['y'])


def test_digits_epochs_are_permutations(digits):
  n = len(digits.train_x)
  xs = np.concatenate([digits.train_batch(s)['x'] for s in range(15)])
  first_epoch = xs[:n].reshape(n, -1)
  want = digits.train_x.reshape(n, -1)
  # Every training image appears exactly once in the first epoch.
  order = np.lexsort(first_epoch.T)
  np.testing.assert_array_equal(first_epoch[order],
                                want[np.lexsort(want.T)])
  np.testing.assert_array_equal(digits.train_batch(14)['x'],
                                digits.train_batch(14)['x'])


def test_digits_eval_batches_cover_test_set(digits):
  batches = digits.eval_batches(batch_size=100)
  assert sum(len(b['y']) for b in batches) == len(digits.test_y)
