"""An MoE expert layer's grouped GEMMs on a real GPU: the library's kernels against XLA's ``ragged_dot``.

``bench_grouped_gemm.py`` compiles the layer for GPU targets without a GPU and
estimates it; this script runs it on the GPU it finds (an H200 or H100), on
the Mixtral-shaped layer of that benchmark (16384 routed rows, 4096 -> 14336,
8 experts) with routing that is uneven (group sizes drawn once, seed 0) and
passed to the step as an argument, as a router's counts are. In priority
order, the JSON rewritten after each step so a killed run keeps what it had:

1. **steps**: every arm of ``bench_grouped_gemm.ARMS`` (forward, dgrad and
   wgrad of the layer), plus ``fp8_e4m3_grads_xla`` so that every kernel arm
   has an XLA twin; each compiled (compile seconds kept), its products
   counted in the program the GPU ran (``bench_gpu.product_summary``) and
   estimated at the device's published peaks (compile only, beside the
   measurement); all arms timed interleaved; every kernel arm's loss and
   gradients compared with its XLA twin (int8: bit for bit; floats: the
   largest difference relative to the largest value, since the two sum in
   different orders).
2. **products**: each grouped GEMM alone (forward, dgrad, wgrad, for bf16,
   e4m3, int8 and the mixed e5m2 x e4m3 gradient products), the kernel
   (``grouped_kernels.ragged_product`` with the kernels on) against XLA's
   ``ragged_dot`` (kernels off) on the same codes: compared, timed
   interleaved, and the routed rows' TFLOP/s each reaches.
3. **sweep**: the forward and wgrad kernels under each launch of ``SWEEP``
   (tiles, warps, stages; ``grouped_kernels._LAUNCH`` holds the library's),
   each compared with the library's launch; the fastest named.
4. **tuned**: the kernel arms' steps again with the sweep's fastest launches,
   timed interleaved with the XLA bf16 step.

Writes ``<out-dir>/<device>-grouped-gpu.json``. ``--smoke`` runs tiny shapes
with the kernels in Pallas' interpreter (any machine; nothing it times means
anything).

Usage:
  python benchmarks/bench_grouped_gpu.py --out-dir /tmp/g               # on a GPU (~5 min)
  python benchmarks/bench_grouped_gpu.py --smoke --out-dir /tmp/g       # any machine
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402
import bench_grouped_gemm  # noqa: E402
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen.core import grouped_kernels  # noqa: E402

ARMS = bench_grouped_gemm.ARMS + ["fp8_e4m3_grads_xla"]
# Each kernel arm and the XLA arm it must agree with.
TWINS = {"bf16_kernel": "bf16", "fp8": "fp8_xla", "fp8_e4m3_grads": "fp8_e4m3_grads_xla",
         "int8": "int8_xla", "fp8_nmajor": "fp8", "int8_nmajor": "int8"}
SHAPE = {"rows": 16384, "k": 4096, "n": 14336, "experts": 8}
SMOKE_SHAPE = {"rows": 256, "k": 64, "n": 128, "experts": 4}

# (name, which product, lhs dtype, rhs dtype) of the products section.
F8, F5 = jnp.float8_e4m3fn, jnp.float8_e5m2
PRODUCTS = [
    ("fwd bf16", "fwd", jnp.bfloat16, jnp.bfloat16), ("fwd e4m3", "fwd", F8, F8),
    ("fwd int8", "fwd", jnp.int8, jnp.int8),
    ("dgrad bf16", "dgrad", jnp.bfloat16, jnp.bfloat16), ("dgrad e5m2 x e4m3", "dgrad", F5, F8),
    ("dgrad e4m3", "dgrad", F8, F8), ("dgrad int8", "dgrad", jnp.int8, jnp.int8),
    ("wgrad bf16", "wgrad", jnp.bfloat16, jnp.bfloat16), ("wgrad e4m3 x e5m2", "wgrad", F8, F5),
    ("wgrad e4m3", "wgrad", F8, F8), ("wgrad int8", "wgrad", jnp.int8, jnp.int8),
]

# Launches the sweep tries: (rows, contracted, output columns, warps, stages).
SWEEP = {
    "grouped_gemm": [(64, 128, 128, 4, 3), (64, 64, 128, 4, 4), (128, 64, 128, 4, 3),
                     (128, 64, 128, 8, 3), (128, 128, 128, 8, 3), (64, 128, 256, 8, 3),
                     (128, 64, 256, 8, 3), (128, 128, 256, 8, 3), (64, 64, 256, 4, 4),
                     (32, 128, 128, 4, 3), (128, 64, 128, 4, 4), (64, 128, 128, 8, 4)],
    "grouped_wgrad": [(64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 128, 256, 8, 3),
                      (128, 64, 128, 4, 3), (128, 128, 256, 8, 3), (32, 128, 128, 4, 4),
                      (64, 256, 128, 8, 3), (128, 128, 128, 4, 4)],
}
SMOKE_SWEEP = {"grouped_gemm": [(64, 64, 64, 4, 3), (32, 32, 64, 4, 3)],
               "grouped_wgrad": [(64, 64, 64, 4, 3), (32, 64, 32, 4, 3)]}
# The sweep's cases: (kernel, product name of PRODUCTS).
SWEEP_CASES = [("grouped_gemm", "fwd e4m3"), ("grouped_gemm", "fwd bf16"),
               ("grouped_wgrad", "wgrad e4m3")]


# Section "layouts": each kernel with its operands as the library stores them and with
# the contracted edge contiguous (the layout Hopper's 8-bit tensor-core products read
# without a transpose): the forward's weight codes as (g, n, k), the wgrad's operands
# with the routed rows last. Dtypes of (input, weight, output gradient) codes.
LAYOUT_DTYPES = {"bf16": (jnp.bfloat16,) * 3, "e4m3": (F8,) * 3, "int8": (jnp.int8,) * 3,
                 "e5m2 gradients": (F8, F8, F5)}
LAYOUT_FORMS = ("fwd", "fwd_kmajor", "dgrad", "wgrad", "wgrad_kmajor")
LAYOUT_LAUNCHES = {
    1: {"grouped_gemm": [(128, 128, 256, 8, 3), (128, 64, 256, 8, 3)],
        "grouped_wgrad": [(128, 128, 256, 8, 3), (32, 128, 128, 4, 4)]},
    2: {"grouped_gemm": [(128, 64, 256, 8, 3), (128, 64, 128, 8, 3)],
        "grouped_wgrad": [(64, 128, 128, 4, 3), (32, 128, 128, 4, 4)]},
}
SMOKE_LAYOUT_LAUNCHES = {1: {"grouped_gemm": [(64, 64, 64, 4, 3)],
                             "grouped_wgrad": [(64, 64, 64, 4, 3)]},
                         2: {"grouped_gemm": [(64, 64, 64, 4, 3)],
                             "grouped_wgrad": [(64, 64, 64, 4, 3)]}}


class _Stop(Exception):
  """The run's time is up (SIGTERM, or --stop-after-s reached)."""


def _set_launch(kernel: str, choice) -> dict:
  """Gives every launch table of ``kernel`` (``grouped_gemm``: 16- and 8-bit; ``grouped_wgrad``:
  both layouts) the launch ``choice``; returns the tables it replaced."""
  tm, tc, to, warps, stages = choice
  tables = grouped_kernels._LAUNCH  # pylint: disable=protected-access
  saved = {k: v for k, v in tables.items() if k.startswith(kernel)}
  for k in saved:
    tables[k] = {"rows": (tm,), "contracted": (tc,), "cols": (to,), "num_warps": warps,
                 "num_stages": stages}
  return saved


def group_sizes(rows: int, groups: int) -> np.ndarray:
  """Uneven routing: each expert's share drawn once (Dirichlet, seed 0), summing to ``rows``."""
  rng = np.random.default_rng(0)
  return rng.multinomial(rows, rng.dirichlet(np.full(groups, 4.0))).astype(np.int32)


def _compare(got, want) -> dict:
  """Per output: elements that differ, and the largest difference over the largest value."""
  rows = []
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # On the device: the outputs are gigabytes. Integers are compared as they are.
    gf, wf = g.astype(jnp.float32), w.astype(jnp.float32)
    scale = max(float(jnp.max(jnp.abs(wf))), 1e-30)
    rows.append({"dtype": str(g.dtype), "shape": list(g.shape),
                 "differing": int(jnp.sum(g != w)),
                 "max_rel": float(jnp.max(jnp.abs(gf - wf))) / scale})
  return {"outputs": rows, "bit_exact": all(r["differing"] == 0 for r in rows)}


def _step(arm: str, groups: int):
  """The jitted step of one arm: ``(x, w, r, sizes) -> (loss, (dx, dw))``, and its kernel mode."""
  if arm == "bf16_kernel":
    fn = lambda x, w, r, gs: bench_grouped_gemm._kernel_step(  # pylint: disable=protected-access
        x, w.astype(jnp.bfloat16), r, gs)
  else:
    # The XLA twins trace the same loss with the kernels off ("fp8_xla" is the fp8 recipe);
    # "_nmajor" arms with every operand in the layout the step makes it.
    base = "fp8_e4m3_grads" if arm == "fp8_e4m3_grads_xla" else arm.removesuffix("_nmajor")
    loss = bench_grouped_gemm._loss(base, groups, "h100")  # pylint: disable=protected-access
    fn = jax.value_and_grad(loss, argnums=(0, 1))
  return jax.jit(fn), "off" if arm.endswith("_xla") else None


def compile_arm(arm: str, args, groups: int, kernels: str, peaks) -> tuple[object, dict]:
  """Compiles one arm's step on the device: the executable and its JSON row."""
  fn, mode = _step(arm, groups)
  t0 = time.perf_counter()
  policy = grouped_kernels.contiguous_contraction
  if arm.endswith("_nmajor"):  # no K-major copies (the kernels' layout before them)
    grouped_kernels.contiguous_contraction = lambda *_: False
  try:
    with fl.pallas_kernels(mode or kernels):
      compiled = fn.lower(*args).compile()
  finally:
    grouped_kernels.contiguous_contraction = policy
  row = {"compile_s": time.perf_counter() - t0}
  text = compiled.as_text()
  row["products"] = bench_gpu.product_summary(text)
  row["estimate"] = bench_gpu.estimate_row(text, peaks)
  return compiled, row


def run_steps(args, groups, kernels, peaks, reps, payload, save, arms=ARMS, key="steps"):
  """Section 1 (and 4): compile, compare with the XLA twin, time interleaved."""
  section = payload.setdefault(key, {"arms": {}})
  compiled = {}
  for arm in arms:
    try:
      compiled[arm], section["arms"][arm] = compile_arm(arm, args, groups, kernels, peaks)
    except _Stop:
      raise
    except Exception as e:  # pylint: disable=broad-except  # one arm must not end the run
      section["arms"][arm] = {"error": f"{type(e).__name__}: {e}"[:2000]}
      print(f"{key} {arm}: ERROR {section['arms'][arm]['error'][:300]}", flush=True)
      continue
    print(f"{key} {arm}: compiled in {section['arms'][arm]['compile_s']:.1f} s, "
          f"{section['arms'][arm]['products']['by_kind_and_class']}", flush=True)
    save()
  for arm, twin in TWINS.items():
    if arm in compiled and twin in compiled:
      section["arms"][arm]["vs_" + twin] = _compare(compiled[arm](*args), compiled[twin](*args))
      print(f"{key} {arm} vs {twin}: {section['arms'][arm]['vs_' + twin]}", flush=True)
  save()
  if reps:
    timed = common.time_interleaved({a: (lambda c=c: c(*args)) for a, c in compiled.items()},
                                     reps=reps, warmup=2)
    base = timed.get("bf16", {}).get("median_ms")
    for arm, t in timed.items():
      section["arms"][arm]["time"] = t
      if base:
        section["arms"][arm]["vs_xla_bf16"] = t["median_ms"] / base
      if "bf16_kernel" in timed:
        section["arms"][arm]["vs_bf16_kernel"] = t["median_ms"] / timed["bf16_kernel"]["median_ms"]
      vs = f", x{t['median_ms'] / base:.3f} XLA bf16" if base else ""
      print(f"{key} {arm}: {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}){vs}"
            f"; estimate {section['arms'][arm]['estimate']['ms']:.3f} ms", flush=True)
  save()


def _operands(kind: str, a_dtype, b_dtype, shape: dict):
  """Random codes of one product: ``(a, b)`` and the kwargs of ``ragged_product``."""
  m, k, n, g = shape["rows"], shape["k"], shape["n"], shape["experts"]
  ka, kb = jax.random.split(jax.random.key(1))

  def codes(key, dims, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
      return jax.random.randint(key, dims, -127, 128, jnp.int32).astype(dtype)
    return (jax.random.normal(key, dims, jnp.float32) * 4).astype(dtype)
  if kind == "fwd":
    return codes(ka, (m, k), a_dtype), codes(kb, (g, k, n), b_dtype), {}
  if kind == "dgrad":
    return codes(ka, (m, n), a_dtype), codes(kb, (g, k, n), b_dtype), {"transpose_rhs": True}
  return codes(ka, (m, k), a_dtype), codes(kb, (m, n), b_dtype), {"wgrad": True}


def _product_fn(kw: dict):
  return jax.jit(lambda a, b, gs: grouped_kernels.ragged_product(a, b, gs, gpu_kernel=True, **kw))


def _time_calls(fns: dict, rounds: int, calls: int = 5) -> dict:
  """Median ms per call of each fn (``common.time_calls``)."""
  return {k: t["median_ms"] for k, t in common.time_calls(fns, rounds, calls).items()}


def run_products(shape, sizes, kernels, rounds, payload, save):
  """Section 2: each grouped GEMM alone, kernel vs XLA on the same codes."""
  section = payload.setdefault("products", {})
  flops = 2 * shape["rows"] * shape["k"] * shape["n"]
  for name, kind, a_dtype, b_dtype in PRODUCTS:
    try:
      a, b, kw = _operands(kind, a_dtype, b_dtype, shape)
      with fl.pallas_kernels(kernels):
        fk = _product_fn(kw).lower(a, b, sizes).compile()
      with fl.pallas_kernels("off"):
        fx = _product_fn(kw).lower(a, b, sizes).compile()
      row = {"kernel_calls": fk.as_text().count("fp8_linen_grouped"),
             **_compare(fk(a, b, sizes), fx(a, b, sizes))}
      if rounds:
        t = _time_calls({"kernel": lambda: fk(a, b, sizes), "xla": lambda: fx(a, b, sizes)}, rounds)
        row.update({"kernel_ms": t["kernel"], "xla_ms": t["xla"],
                    "kernel_over_xla": t["kernel"] / t["xla"],
                    "kernel_tflops": flops / t["kernel"] / 1e9,
                    "xla_routed_tflops": flops / t["xla"] / 1e9})
    except _Stop:
      raise
    except Exception as e:  # pylint: disable=broad-except
      row = {"error": f"{type(e).__name__}: {e}"[:2000]}
    section[name] = row
    save()
    print(f"products {name}: " + (row.get("error", "")[:300] or
          f"kernels {row['kernel_calls']}, exact {row['bit_exact']}, max_rel "
          f"{max(o['max_rel'] for o in row['outputs']):.2e}"
          + (f", kernel {row['kernel_ms']:.3f} ms ({row['kernel_tflops']:.0f} TFLOP/s) vs XLA "
             f"{row['xla_ms']:.3f} ms" if rounds else "")), flush=True)


def run_sweep(shape, sizes, kernels, rounds, payload, save, choices):
  """Section 3: the kernels under each launch, compared with the library's launch and timed."""
  section = payload.setdefault("sweep", {})
  by_name = {p[0]: p for p in PRODUCTS}
  for kernel, product in SWEEP_CASES:
    _, kind, a_dtype, b_dtype = by_name[product]
    a, b, kw = _operands(kind, a_dtype, b_dtype, shape)
    with fl.pallas_kernels(kernels):
      want = _product_fn(kw)(a, b, sizes)
    library = {k: dict(v) for k, v in grouped_kernels._LAUNCH.items()  # pylint: disable=protected-access
               if k.startswith(kernel)}
    rows = []
    for choice in choices[kernel]:
      saved = _set_launch(kernel, choice)
      try:
        with fl.pallas_kernels(kernels):
          fk = _product_fn(kw).lower(a, b, sizes).compile()  # a new closure: a new trace
        cmp = _compare(fk(a, b, sizes), want)
        row = {"launch": list(choice), "max_rel_vs_library": cmp["outputs"][0]["max_rel"]}
        if rounds:
          row["kernel_ms"] = _time_calls({"k": lambda: fk(a, b, sizes)}, rounds)["k"]
      except _Stop:
        raise
      except Exception as e:  # pylint: disable=broad-except  # a launch Triton rejects is a result
        row = {"launch": list(choice), "error": f"{type(e).__name__}: {e}"[:500]}
      finally:
        grouped_kernels._LAUNCH.update(saved)  # pylint: disable=protected-access
      rows.append(row)
      print(f"sweep {kernel} {product} {choice}: " + (row.get("error", "")[:150] or
            f"max_rel {row['max_rel_vs_library']:.1e}"
            + (f" {row['kernel_ms']:.3f} ms" if rounds else "")), flush=True)
    ok = sorted((r for r in rows if "kernel_ms" in r and r["max_rel_vs_library"] < 1e-3),
                key=lambda r: r["kernel_ms"])
    section[f"{kernel} {product}"] = {"library": {t: {k: list(v) if isinstance(v, tuple) else v
                                                      for k, v in launch.items()}
                                                  for t, launch in library.items()},
                                      "fastest": ok[0]["launch"] if ok else None, "rows": rows}
    save()


def _layout_case(form: str, x, w, g, sizes):
  """``(kernel, fn, operands, reference form)`` of one form (the reference: the library's layout)."""
  gg, gw = grouped_kernels.grouped_gemm, grouped_kernels.grouped_wgrad
  if form == "fwd":
    return "grouped_gemm", gg, (x, w, sizes), None
  if form == "fwd_kmajor":
    return ("grouped_gemm", lambda a, b, s: gg(a, b, s, transpose_rhs=True),
            (x, jnp.swapaxes(w, 1, 2), sizes), "fwd")
  if form == "dgrad":
    return "grouped_gemm", lambda a, b, s: gg(a, b, s, transpose_rhs=True), (g, w, sizes), None
  if form == "wgrad":
    return "grouped_wgrad", gw, (x, g, sizes), None
  return ("grouped_wgrad", lambda a, b, s: gw(a, b, s, transposed=True), (x.T, g.T, sizes),
          "wgrad")


def run_layouts(shape, sizes, kernels, rounds, payload, save, launches, dtypes=None):
  """Section "layouts": every form and dtype under two launches, timed, checked across layouts."""
  section = payload.setdefault("layouts", {})
  m, k, n, groups = shape["rows"], shape["k"], shape["n"], shape["experts"]
  flops = 2 * m * k * n
  for label, (xd, wd, gd) in LAYOUT_DTYPES.items():
    if dtypes and label not in dtypes:
      continue
    x, w, _ = _operands("fwd", xd, wd, shape)
    g = _operands("dgrad", gd, wd, shape)[0]
    results = {}
    for form in LAYOUT_FORMS:
      if label == "e5m2 gradients" and form.startswith("fwd"):
        continue  # the forward has no gradient operand: the e4m3 row
      kernel, fn, args, ref = _layout_case(form, x, w, g, sizes)
      for choice in launches[jnp.dtype(xd).itemsize][kernel]:
        key = f"{label} {form} {list(choice)}"
        saved = _set_launch(kernel, choice)
        try:
          with fl.pallas_kernels(kernels):  # a new closure: a new trace under this launch
            f = jax.jit(lambda *a, fn=fn: fn(*a)).lower(*args).compile()
          out = f(*args)
          results[(form, tuple(choice))] = out
          row = {"dtype": label, "form": form, "launch": list(choice)}
          want = results.get((ref, tuple(choice))) if ref else None
          if want is not None:
            row["max_rel_vs_" + ref] = _compare(out, want)["outputs"][0]["max_rel"]
          if rounds:
            row["kernel_ms"] = _time_calls({"k": lambda f=f: f(*args)}, rounds)["k"]
            row["tflops"] = flops / row["kernel_ms"] / 1e9
        except _Stop:
          raise
        except Exception as e:  # pylint: disable=broad-except  # a launch Triton rejects is a result
          row = {"dtype": label, "form": form, "launch": list(choice),
                 "error": f"{type(e).__name__}: {e}"[:500]}
        finally:
          grouped_kernels._LAUNCH.update(saved)  # pylint: disable=protected-access
        section[key] = row
        print(f"layouts {key}: " + (row.get("error", "")[:150] or
              ", ".join(f"{a} {row[a]:.3g}" for a in row if a.startswith(("max_rel", "kernel_ms",
                                                                         "tflops")))), flush=True)
        save()
    del results
  # What a separate transpose pass of each 8-bit operand costs (a fused quantization
  # pass would write the second layout from the same read instead).
  if rounds:
    x, w, _ = _operands("fwd", F8, F8, shape)
    g = _operands("dgrad", F5, F8, shape)[0]
    moves = {"weight (g, k, n) -> (g, n, k)": (lambda a: jnp.swapaxes(a, 1, 2), w),
             "input (m, k) -> (k, m)": (jnp.transpose, x),
             "gradient (m, n) -> (n, m)": (jnp.transpose, g)}
    for what, (fn, a) in moves.items():
      f = jax.jit(fn).lower(a).compile()
      section["transpose " + what] = {"ms": _time_calls({"t": lambda f=f, a=a: f(a)}, rounds)["t"],
                                      "bytes": 2 * a.size}
      print(f"layouts transpose {what}: {section['transpose ' + what]}", flush=True)
    save()


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out-dir", default=None, help="folder for the JSON (default benchmarks/results)")
  p.add_argument("--reps", type=int, default=15, help="timed steps per arm")
  p.add_argument("--rounds", type=int, default=7, help="timed rounds per product")
  p.add_argument("--sections", nargs="+",
                 default=["steps", "products", "layouts", "sweep", "tuned"])
  p.add_argument("--arms", nargs="+", default=ARMS, help="the steps section's arms")
  p.add_argument("--layout-dtypes", nargs="+", choices=sorted(LAYOUT_DTYPES), default=None,
                 help="the layouts section's dtypes (default: all)")
  p.add_argument("--stop-after-s", type=float, default=1e9,
                 help="stop starting new work after this many seconds (the JSON keeps what ran)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, kernels in Pallas' interpreter, not timed (any machine)")
  a = p.parse_args(argv)
  env = common.environment()
  if env["platform"] != "gpu" and not a.smoke:
    p.error(f"no GPU here (JAX sees {env['platform']!r}): run with --smoke")
  shape = SMOKE_SHAPE if a.smoke else SHAPE
  kernels = "interpret" if a.smoke else "auto"
  reps, rounds = (0, 0) if a.smoke else (a.reps, a.rounds)
  peaks_name, peaks, note = bench_gpu.peaks_for(env["device_kind"], None)
  sizes_np = group_sizes(shape["rows"], shape["experts"])
  payload = {"benchmark": "grouped_gemm_on_gpu", "env": env, "shape": shape,
             "group_sizes": sizes_np.tolist(), "complete": False,
             "estimate": {"peaks": peaks_name, "note": "estimate (compile only) of the program "
                          f"that ran, at published peaks; {note}"},
             "timing": f"steps: median of {reps} interleaved; products and sweep: median of "
                       f"{rounds} rounds of 5 back-to-back calls",
             "kernels": "Pallas interpreter (smoke)" if a.smoke else "compiled (Triton)"}
  name = "grouped-gpu" + ("-smoke" if a.smoke else "")
  t_start = time.perf_counter()

  def save():
    payload["seconds"] = time.perf_counter() - t_start
    common.write_json(name, payload, a.out_dir)
    if payload["seconds"] > a.stop_after_s:
      raise _Stop()

  def on_term(*_):
    raise _Stop()
  signal.signal(signal.SIGTERM, on_term)
  sizes = jnp.asarray(sizes_np)
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  m, k, n, g = shape["rows"], shape["k"], shape["n"], shape["experts"]
  args = (jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16),
          jax.random.normal(k2, (g, k, n), jnp.float32) * 0.02,
          jax.random.normal(k3, (m, n), jnp.float32), sizes)
  choices = SMOKE_SWEEP if a.smoke else SWEEP
  try:
    if "steps" in a.sections:
      run_steps(args, g, kernels, peaks, reps, payload, save, arms=a.arms)
    if "products" in a.sections:
      run_products(shape, sizes, kernels, rounds, payload, save)
    if "layouts" in a.sections:
      run_layouts(shape, sizes, kernels, rounds, payload, save,
                  SMOKE_LAYOUT_LAUNCHES if a.smoke else LAYOUT_LAUNCHES, a.layout_dtypes)
    if "sweep" in a.sections:
      run_sweep(shape, sizes, kernels, rounds, payload, save, choices)
    if "tuned" in a.sections and payload.get("sweep"):
      for kernel in choices:
        best = [c["fastest"] for key, c in payload["sweep"].items()
                if key.startswith(kernel + " ") and c["fastest"]]
        if best:
          _set_launch(kernel, best[0])
      payload["tuned_launch"] = {t: {k: list(v) if isinstance(v, tuple) else v
                                     for k, v in launch.items()}
                                 for t, launch in grouped_kernels._LAUNCH.items()}  # pylint: disable=protected-access
      run_steps(args, g, kernels, peaks, reps, payload, save,
                arms=["bf16", "bf16_kernel", "fp8", "fp8_e4m3_grads", "int8"], key="tuned")
    payload["complete"] = True
  except _Stop:
    print("stopped: out of time; the JSON keeps what ran", flush=True)
  payload["seconds"] = time.perf_counter() - t_start
  path = common.write_json(name, payload, a.out_dir)
  print(f"wrote {path}", flush=True)
  return payload


if __name__ == "__main__":
  main()
