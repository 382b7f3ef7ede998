"""The job as a new user meets it: from a wheel, and without the [job] extra.

These run ``python`` in subprocesses, from a temporary working directory, so
that nothing of the source checkout is picked up by accident.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

from fp8_linen_job import main as main_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Makes the [job] extra's packages unimportable, as in an environment where
# only `pip install .` (without [job]) was run; then runs `python -m
# fp8_linen` with the command-line arguments.
BLOCKER = '''
import runpy, sys
BLOCKED = {'tqdm', 'matplotlib', 'sklearn', 'orbax'}
class Blocker:
  def find_spec(self, name, path=None, target=None):
    if name.partition('.')[0] in BLOCKED:
      raise ModuleNotFoundError(f'No module named {name!r}', name=name)
    return None
sys.meta_path.insert(0, Blocker())
runpy.run_module('fp8_linen', run_name='__main__', alter_sys=True)
'''


def _run(args, cwd, env=None, timeout=120):
  env = dict(os.environ if env is None else env, JAX_PLATFORMS='cpu')
  return subprocess.run(args, cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)


def test_help_and_config_work_without_the_job_extra(tmp_path):
  proc = _run([sys.executable, '-c', BLOCKER, '--help'], tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert 'usage: python -m fp8_linen' in proc.stdout
  assert '--print-config' in proc.stdout
  proc = _run([sys.executable, '-c', BLOCKER, '--config', 'tiny',
               '--print-config'], tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert 'steps: 8' in proc.stdout


def test_run_without_the_job_extra_says_what_to_install(tmp_path):
  proc = _run([sys.executable, '-c', BLOCKER, '--config', 'tiny', '--out',
               str(tmp_path / 'run')], tmp_path)
  assert proc.returncode == main_lib.EXIT_MISSING == 1
  assert 'pip install "fp8_linen[job]"' in proc.stderr
  for package in ('tqdm', 'matplotlib', 'scikit-learn', 'orbax-checkpoint'):
    assert package in proc.stderr
  assert 'Traceback' not in proc.stderr
  assert not (tmp_path / 'run').exists()  # Stopped before any work.


def test_missing_job_dependencies_in_process(monkeypatch):
  assert main_lib.missing_job_dependencies() == []  # The test env has them.
  monkeypatch.setitem(sys.modules, 'tqdm', None)  # Blocks `import tqdm`.
  assert main_lib.missing_job_dependencies() == ['tqdm']


def _copy_source(dest: pathlib.Path) -> None:
  """Copies what a wheel is built from, so the build leaves the checkout be."""
  dest.mkdir()
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy2(ROOT / name, dest / name)
  ignore = shutil.ignore_patterns('__pycache__', '*.pyc', '*.egg-info')
  for package in ('fp8_linen', 'fp8_linen_job'):
    shutil.copytree(ROOT / package, dest / package, ignore=ignore)


def test_wheel_works_outside_the_checkout(tmp_path):
  src, dist, site = tmp_path / 'src', tmp_path / 'dist', tmp_path / 'site'
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  _copy_source(src)
  pip = [sys.executable, '-m', 'pip', '--disable-pip-version-check', '-q']
  proc = _run(pip + ['wheel', '--no-deps', str(src), '-w', str(dist)],
              tmp_path, timeout=240)
  assert proc.returncode == 0, proc.stderr
  (wheel,) = dist.glob('fp8_linen-*.whl')
  names = zipfile.ZipFile(wheel).namelist()
  for config in ('default', 'tiny', 'large'):
    assert f'fp8_linen_job/configs/{config}.yaml' in names
  assert 'fp8_linen/recipes/presets/fp8_rowwise.yaml' in names
  proc = _run(pip + ['install', '--no-deps', '--target', str(site),
                     str(wheel)], tmp_path, timeout=120)
  assert proc.returncode == 0, proc.stderr

  env = dict(os.environ, PYTHONPATH=str(site))
  check = (
      'import fp8_linen as fl, fp8_linen_job\n'
      f'assert fl.__file__.startswith({str(site)!r}), fl.__file__\n'
      f'assert fp8_linen_job.__file__.startswith({str(site)!r})\n'
      "assert fl.load_recipe('fp8_rowwise').granularity == 'row'\n"
      "assert fl.load_recipe('configs/recipes/fp8_rowwise.yaml')"
      ".granularity == 'row'\n"
      "print('recipes ok')\n")
  proc = _run([sys.executable, '-c', check], elsewhere, env)
  assert proc.returncode == 0 and 'recipes ok' in proc.stdout, proc.stderr
  for config in ('tiny', 'configs/job/tiny.yaml'):
    proc = _run([sys.executable, '-m', 'fp8_linen', '--config', config,
                 '--print-config'], elsewhere, env)
    assert proc.returncode == 0, proc.stderr
    assert 'steps: 8' in proc.stdout
  proc = _run([sys.executable, '-m', 'fp8_linen', '--config', 'nosuch'],
              elsewhere, env)
  assert proc.returncode == 2
  assert 'shipped configs: default, large, tiny' in proc.stderr
