"""Runs every benchmark script in sequence, then draws the plots.

Order: bench_dense, bench_layers, bench_recipes, bench_int_qat, bench_serving,
qat_digits, bench_transformer, bench_h100_compile, plot_results. Each runs as its own subprocess (a fresh JAX backend each, so
one script's compiled programs and memory cannot skew the next) and gets one
summary line: OK or FAILED (exit code), seconds, and what it wrote. The exit
code is non-zero if any script failed; the others still run.

How long: a full run on the 2-core CPU machine takes roughly 10-20 minutes
(an estimate, not a measurement: bench_dense ~1-2 min, bench_layers ~2 min,
bench_recipes ~2 min, bench_int_qat ~4 min, bench_serving ~2 min, qat_digits
~3 min (its last full run took 157 s),
bench_transformer ~4-8 min, most of it the 3 x 150 parity steps and
compilation, bench_h100_compile ~1.5 min: compiles only, for an H100, on the
CPU; it prints "skipped" and writes nothing where the CUDA plugin of the test
extra is missing). Keep the machine otherwise idle while it runs. On a GPU machine
(``jax.default_backend() == 'gpu'``) the scripts pick GPU sizes: bench_dense
and bench_transformer by themselves (4096/8192 GEMMs; a ~126M-parameter
transformer), bench_recipes via ``--sizes 2048 4096 8192`` passed from here.

``--quick`` is a smoke run (about 3-5 minutes on the CPU machine, nearly all
compilation): tiny sizes,
few runs. Its results are not figures to quote, so every script writes them to
a scratch folder (``--quick-dir``, default a new temporary folder) and the
files in benchmarks/results/ are never touched.

Usage:
  python benchmarks/run_all.py                 # full run, results in benchmarks/results/
  python benchmarks/run_all.py --quick         # smoke run, results in a temp folder
  python benchmarks/run_all.py --only bench_transformer plot_results
  python benchmarks/run_all.py --quick --dry-run   # print the commands only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
ORDER = ("bench_dense", "bench_layers", "bench_recipes", "bench_int_qat", "bench_serving",
         "qat_digits", "bench_transformer",
         "bench_h100_compile", "plot_results")
"""Every script, in the order it runs."""


@dataclasses.dataclass(frozen=True)
class Job:
  """One script to run.

  Attributes:
    name: Script name without ``.py``.
    args: Its command-line arguments.
    outputs: Files it writes (for the summary line).
  """

  name: str
  args: tuple[str, ...]
  outputs: tuple[str, ...] = ()


def probe_device() -> tuple[str, str]:
  """``(device prefix, backend)`` as the scripts will see them.

  Asked in a subprocess so that this process never starts a JAX backend (on a
  GPU that would hold device memory the benchmarks need).
  """
  code = ("import sys; sys.path.insert(0, %r); import common, jax; "
          "print(common.device_name(), jax.default_backend())" % HERE)
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                       text=True).stdout.split()
  return out[-2], out[-1]


def plan(device: str, backend: str, quick: bool, quick_dir: str) -> list[Job]:
  """The jobs to run, with arguments for the mode and device."""
  out = quick_dir if quick else RESULTS_DIR
  gpu = backend == "gpu"
  dense = os.path.join(out, f"{device}-dense.json")
  layers = os.path.join(out, f"{device}-layers.json")
  h100 = os.path.join(out, "h100-compile.json")
  recipes = os.path.join(out, f"{device}-recipes.json")
  digits = os.path.join(out, f"{device}-qat-digits.json")
  int_qat = os.path.join(out, f"{device}-int-qat.json")
  serving = os.path.join(out, f"{device}-serving.json")
  transformer = os.path.join(out, f"{device}-transformer.json")
  if quick:
    return [
        Job("bench_dense", ("--sizes", "128", "256", "--reps", "5", "--out-dir", out), (dense,)),
        Job("bench_layers", ("--quick", "--runs", "5", "--out-dir", out), (layers,)),
        Job("bench_recipes", ("--sizes", "128", "--runs", "5", "--warmup", "1", "--out", recipes),
            (recipes,)),
        Job("bench_int_qat", ("--sizes", "128", "--runs", "3", "--warmup", "1", "--out", int_qat),
            (int_qat,)),
        Job("bench_serving", ("--quick", "--reps", "3", "--out-dir", out), (serving,)),
        Job("qat_digits", ("--seeds", "1", "--epochs", "2", "--out", digits), (digits,)),
        Job("bench_transformer", ("--quick", "--out-dir", out), (transformer,)),
        Job("bench_h100_compile", ("--quick", "--out-dir", out), (h100,)),
        Job("plot_results", ("--device", device, "--results-dir", out), _pngs(out, device)),
    ]
  return [
      Job("bench_dense", (), (dense,)),
      Job("bench_layers", (), (layers,)),
      Job("bench_recipes", ("--out", recipes) + (("--sizes", "2048", "4096", "8192") if gpu else ()),
          (recipes,)),
      Job("bench_int_qat", ("--h100", "2048", "--out", int_qat), (int_qat,)),
      Job("bench_serving", ("--out-dir", out), (serving,)),
      Job("qat_digits", ("--out", digits), (digits,)),
      Job("bench_transformer", (), (transformer,)),
      Job("bench_h100_compile", (), (h100,)),
      Job("plot_results", ("--device", device), _pngs(out, device)),
  ]


def _pngs(folder: str, device: str) -> tuple[str, ...]:
  return tuple(os.path.join(folder, f"{device}-{n}.png") for n in ("dense", "recipes", "transformer"))


def run_job(job: Job) -> tuple[bool, str]:
  """Runs one script; returns (ok, summary line)."""
  cmd = [sys.executable, os.path.join(HERE, f"{job.name}.py"), *job.args]
  print(f"\n=== {job.name}: {' '.join(cmd[1:])}", flush=True)
  t0 = time.perf_counter()
  rc = subprocess.run(cmd, check=False).returncode
  seconds = time.perf_counter() - t0
  written = [p for p in job.outputs if os.path.exists(p)]
  status = "OK    " if rc == 0 else f"FAILED (exit {rc})"
  line = f"{job.name:18s} {status} {seconds:7.1f} s  {', '.join(written) or '-'}"
  return rc == 0, line


def main(argv=None) -> int:
  """Runs the selected scripts; returns the process exit code."""
  p = argparse.ArgumentParser(
      description="Run every benchmark script in sequence (then plot_results) and "
                  "summarize; exits non-zero if any script fails.")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: tiny sizes and few runs, results to --quick-dir only")
  p.add_argument("--quick-dir", default=None,
                 help="scratch folder for quick results (default: a new temporary folder)")
  p.add_argument("--only", nargs="+", choices=ORDER, default=None,
                 help="run only these scripts (kept in the standard order)")
  p.add_argument("--skip", nargs="+", choices=ORDER, default=(), help="scripts to leave out")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  args = p.parse_args(argv)

  device, backend = probe_device()
  quick_dir = args.quick_dir
  if args.quick and not quick_dir:
    quick_dir = "<temporary folder>" if args.dry_run else tempfile.mkdtemp(prefix="fp8_linen_quick_")
  if args.quick and not args.dry_run:
    os.makedirs(quick_dir, exist_ok=True)
  selected = [j for j in plan(device, backend, args.quick, quick_dir or "")
              if (args.only is None or j.name in args.only) and j.name not in args.skip]
  print(f"device {device} ({backend}); {'quick' if args.quick else 'full'} run of "
        f"{', '.join(j.name for j in selected)}"
        + (f"; quick results in {quick_dir}" if args.quick else ""), flush=True)
  if args.dry_run:
    for j in selected:
      print(" ".join(["python", f"benchmarks/{j.name}.py", *j.args]))
    return 0

  t0 = time.perf_counter()
  lines, failed = [], []
  for job in selected:
    ok, line = run_job(job)
    lines.append(line)
    if not ok:
      failed.append(job.name)
  print(f"\n=== summary ({time.perf_counter() - t0:.0f} s, device {device})")
  for line in lines:
    print(line)
  if failed:
    print(f"FAILED: {', '.join(failed)}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
