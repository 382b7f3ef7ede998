"""First compile of each dense arm on a GPU, under XLA flag variants: seconds, products, step time.

fp8 delayed scaling's first compile on an H200 took 107-355+ s where fp8
current took 11-53 s and flax's fp8 op 6 s (docs/known_limits.md); compiled
for an H100 on a CPU (no device: XLA cannot autotune there) both take about a
second. This script finds where the time goes. Each flag variant runs in a
child process of its own (XLA reads ``XLA_FLAGS`` once, when the backend
starts), which builds every arm's training step (``common.build_train_arm``,
the step ``bench_gpu.py`` times, on the same layers) and records:

- the first compile's seconds (bf16 first, so that one-time start-up work is
  not charged to an fp8 arm);
- the GEMMs of the optimized program (``common.gpu_products``), so a variant
  that is fast to compile but picks other kernels shows it;
- the step's median time, all arms of the variant interleaved;
- for ``--trace`` variants, where the compile spent its time: the host events
  of a ``jax.profiler`` trace of the compile, summed by name (digits folded,
  so the events of each fusion or autotuning candidate add up).

Variants: ``default`` (no flags), ``autotune0`` (``--xla_gpu_autotune_level=0``:
no autotuning, the library's heuristic kernels) and ``no_triton_gemm``
(``--xla_gpu_enable_triton_gemm=false``: dots go to cuBLAS only, so Triton
GEMM configurations are not compiled and tried). ``--best-flags FILE`` prints
the flags of the variant that compiled the fp8 arms fastest while choosing
the same GEMM kernels as ``default`` within 2% of its step times (nothing
when none qualifies), for a following benchmark in the same session.

Writes ``<out-dir>/<device>-compile.json``.

  python benchmarks/bench_compile.py --out-dir /tmp/c             # on a GPU (~5 min)
  python benchmarks/bench_compile.py --smoke --out-dir /tmp/c     # tiny shape, any machine
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

VARIANTS = {"default": "", "autotune0": "--xla_gpu_autotune_level=0",
            "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false"}
ARMS = ("bf16_dense", "flax_fp8_direct", "qdense_current", "qdense_delayed")
SHAPES = {"te_dense_example": (8 * 2048, 8192, 32768), "smoke": (128, 256, 512)}


def fold(name: str) -> str:
  """An event name with its numbers folded to ``#`` (``fusion.12`` and ``fusion.7`` add up)."""
  return re.sub(r"\d+", "#", name)


def trace_summary(trace_dir: str, top: int = 40) -> dict:
  """The host events of the ``jax.profiler`` trace under ``trace_dir``, summed by folded name.

  Returns ``{"total_s", "events", "by_name": [[name, seconds, count], ...]}``
  with the ``top`` names of most summed time. Nested events add to both
  names, so the seconds of a name include its children's.
  """
  import jax  # pylint: disable=import-outside-toplevel
  paths = [os.path.join(d, f) for d, _, fs in os.walk(trace_dir) for f in fs
           if f.endswith(".xplane.pb")]
  seconds, counts = collections.Counter(), collections.Counter()
  events = 0
  for path in paths:
    for plane in jax.profiler.ProfileData.from_file(path).planes:
      if "/host:" not in plane.name:
        continue
      for line in plane.lines:
        for event in line.events:
          if event.name.startswith("$"):  # a Python frame, should a tracer have run
            continue
          key = fold(event.name)
          seconds[key] += event.duration_ns * 1e-9
          counts[key] += 1
          events += 1
  return {"events": events, "by_name": [[k, round(s, 3), counts[k]]
                                        for k, s in seconds.most_common(top)]}


def child(variant: str, arms: list[str], shape: tuple[int, int, int], reps: int,
          trace: bool, out: str) -> None:
  """Builds, compiles (traced if asked) and times every arm; writes ``out`` after each step."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, HERE)
  import bench_gpu  # pylint: disable=import-outside-toplevel
  import common  # pylint: disable=import-outside-toplevel
  m, k, n = shape
  x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(jnp.bfloat16)
  row = {"variant": variant, "xla_flags": VARIANTS[variant], "env": common.environment(),
         "arms": {}}
  built = {}
  for arm in arms:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as trace_dir:
      if trace:  # XLA's own host events only: no Python tracer, every TraceMe level
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        options.host_tracer_level = 3
        jax.profiler.start_trace(trace_dir, profiler_options=options)
      try:
        a = common.build_train_arm(bench_gpu.make_layer(arm, n), x, seed=0)
      finally:
        if trace:
          jax.profiler.stop_trace()
      built[arm] = a
      row["arms"][arm] = {"compile_s": a.compile_seconds,
                          "build_s": time.perf_counter() - t0,
                          "products": common.gpu_products(a.compiled.as_text())}
      if trace:
        row["arms"][arm]["trace"] = trace_summary(trace_dir)
    print(f"{variant:>15} {arm:>16}: compile {a.compile_seconds:7.1f} s", flush=True)
    common.write_json_to(out, row)
  times = common.time_arms(built, arms[0], reps=reps, warmup=2)
  for arm, t in times.items():
    row["arms"][arm].update(median_ms=t["median_ms"], ratio_vs_first=t["ratio"])
  common.write_json_to(out, row)


def best_flags(payload: dict, tolerance: float = 0.02) -> str:
  """The flags of the variant fastest to compile the fp8 arms with ``default``'s kernels and speed.

  Empty when no variant but ``default`` compiled every arm, or none of them
  kept every fp8 arm's GEMM counts and came within ``tolerance`` of its step.
  """
  runs = payload["variants"]
  base = runs.get("default", {}).get("arms", {})
  best, best_s = "", sum(r.get("compile_s", 0.0) for a, r in base.items() if a != ARMS[0])
  for name, run in runs.items():
    arms = run.get("arms", {})
    if name == "default" or set(arms) != set(base) or not base:
      continue
    same = all(arms[a]["products"] == base[a]["products"] and "median_ms" in arms[a]
               and "median_ms" in base[a]
               and arms[a]["median_ms"] <= (1 + tolerance) * base[a]["median_ms"]
               for a in base)
    seconds = sum(r["compile_s"] for a, r in arms.items() if a != ARMS[0])
    if same and seconds < best_s:
      best, best_s = run["xla_flags"], seconds
  return best


def main(argv=None) -> dict | None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS),
                 default=["autotune0", "no_triton_gemm", "default"])
  p.add_argument("--trace", nargs="*", choices=sorted(VARIANTS), default=["default"],
                 help="variants whose compiles are traced with jax.profiler")
  p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
  p.add_argument("--shape", choices=sorted(SHAPES), default="te_dense_example")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--budget-s", type=float, default=420.0,
                 help="the variants together (each one after the first keeps at least 60 s)")
  p.add_argument("--out-dir", default=None)
  p.add_argument("--smoke", action="store_true", help="the tiny shape and 2 reps")
  p.add_argument("--best-flags", metavar="FILE", help="print the best variant's flags and exit")
  p.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.best_flags:
    with open(args.best_flags) as f:
      print(best_flags(json.load(f)))
    return None
  shape = SHAPES["smoke" if args.smoke else args.shape]
  reps = 2 if args.smoke else args.reps
  arms = [ARMS[0]] + [a for a in args.arms if a != ARMS[0]]
  if args.child:
    child(args.child[0], arms, shape, reps, args.child[0] in args.trace, args.child[1])
    return None
  t_start = time.perf_counter()
  payload = {"benchmark": "gpu_first_compile", "shape_MKN": list(shape),
             "step": "common.build_train_arm (bench_gpu.py's step: SGD, linear loss)",
             "variants": {}, "failed": []}
  with tempfile.TemporaryDirectory() as tmp:
    for i, variant in enumerate(args.variants):
      # Each variant still to come keeps a minute; this one may use the rest.
      left = args.budget_s - (time.perf_counter() - t_start)
      share = left - 60.0 * (len(args.variants) - i - 1)
      out = os.path.join(tmp, f"{variant}.json")
      env = {**os.environ, "XLA_FLAGS": " ".join(
          f for f in (os.environ.get("XLA_FLAGS", ""), VARIANTS[variant]) if f)}
      cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, out,
             "--arms", *arms, "--shape", "smoke" if args.smoke else args.shape,
             "--reps", str(reps), "--trace", *args.trace]
      try:
        subprocess.run(cmd, env=env, timeout=max(share, 30.0), check=True)
      except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as e:
        payload["failed"].append(variant)  # timed out or crashed
        print(f"{variant}: {type(e).__name__} after {time.perf_counter() - t_start:.0f} s; "
              "keeping what it wrote", flush=True)
      if os.path.exists(out):
        with open(out) as f:
          payload["variants"][variant] = json.load(f)
  sys.path.insert(0, HERE)
  import common  # pylint: disable=import-outside-toplevel
  runs = payload["variants"]
  device = next((r["env"]["device_kind"] for r in runs.values()), "unknown")
  payload["device"] = device
  payload["best_flags"] = best_flags(payload)
  payload["seconds"] = time.perf_counter() - t_start
  print(f"\n{device}: first compile (s) / step (ms), shape {shape}")
  for variant, run in runs.items():
    cells = [f"{a} {r['compile_s']:.1f} s" + (f" / {r['median_ms']:.2f} ms" if "median_ms" in r
                                                else "")
             for a, r in run["arms"].items()]
    print(f"  {variant:>15}: " + "; ".join(cells))
    for a, r in run["arms"].items():
      for name, s, count in r.get("trace", {}).get("by_name", [])[:8]:
        print(f"  {'':>15}  {a}: {s:8.2f} s  x{count:<5} {name[:90]}")
  print(f"best flags: {payload['best_flags']!r}")
  name = re.sub(r"[^A-Za-z0-9]+", "-", device).lower()
  common.write_json("compile-smoke" if args.smoke else "compile", payload, args.out_dir,
                    device=name)
  return payload


if __name__ == "__main__":
  main()
