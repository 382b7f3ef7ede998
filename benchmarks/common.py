"""Shared measuring helpers for the benchmark scripts.

Rules kept here: every arm is timed in one process, interleaved, after warm-up;
``block_until_ready`` on every output; median of >= 20 runs with min and max;
random inputs and a random cotangent; results as ratios to a baseline arm. The
train step (:func:`make_train_step`) returns the loss and ``dL/dx`` with the new
state, so forward, dgrad and wgrad of every layer all run; the variables (fp8
scales and histories included) are jit arguments.

The scripts import the public API (``fp8_linen``, ``fp8_linen.testing``) and
this module only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import platform
import re
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8_linen as fl
from fp8_linen.testing import hlo_products, targets
from fp8_linen.testing.compile import CompileReport
from fp8_linen.testing.train_step import make_train_step as make_grads_step

# Both spellings: HLO's (s8, u32) and jaxpr's (i8, u32) as print_saved_residuals writes them.
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "i8": 1, "i16": 2, "i32": 4, "i64": 8, "u16": 2, "s16": 2,
                "bool": 1, "pred": 1, "s64": 8, "u64": 8, "i4": 0.5, "s4": 0.5, "u4": 0.5}


def device_name() -> str:
  """'cpu', or the GPU/TPU kind with spaces replaced (for file names)."""
  d = jax.devices()[0]
  return "cpu" if d.platform == "cpu" else re.sub(r"[^A-Za-z0-9]+", "-", d.device_kind).lower()


def environment() -> dict:
  """Device kind and library versions for the output JSON."""
  import flax  # pylint: disable=import-outside-toplevel
  d = jax.devices()[0]
  return {"device_kind": d.device_kind, "platform": d.platform, "device_count": jax.device_count(),
          "cpu_count": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__,
          "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__,
          "flax": flax.__version__, "optax": optax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _block(tree):
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, "block_until_ready"):
      leaf.block_until_ready()


def time_interleaved(arms: dict[str, Callable[[], object]], reps: int = 20,
                     warmup: int = 3) -> dict[str, dict]:
  """Times zero-argument callables round-robin; returns median/min/max in ms."""
  for _ in range(warmup):
    for fn in arms.values():
      _block(fn())
  times = {name: [] for name in arms}
  for _ in range(reps):
    for name, fn in arms.items():
      t0 = time.perf_counter()
      _block(fn())
      times[name].append((time.perf_counter() - t0) * 1e3)
  return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                 "runs": len(t)} for name, t in times.items()}


def time_calls(fns: dict[str, Callable[[], object]], rounds: int,
               calls: int) -> dict[str, dict]:
  """Median / min ms per call of each fn: rounds of ``calls`` back-to-back calls, interleaved.

  For kernels too short to time one call at a time (launch overhead); each fn
  runs once first (compile and warm-up).
  """
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      for _ in range(calls):
        r = fn()
      jax.block_until_ready(r)
      times[k].append((time.perf_counter() - t0) * 1e3 / calls)
  return {k: {"median_ms": statistics.median(t), "min_ms": min(t)} for k, t in times.items()}


def saved_residuals(f: Callable, *args) -> list[dict]:
  """Residuals ``f``'s backward pass keeps, parsed from ``print_saved_residuals``.

  Each entry: ``dtype``, ``shape``, ``bytes``, ``from_argument`` (the argument
  path, or None), ``literal`` (a constant of the program) and the raw ``line``.
  """
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    jax.ad_checkpoint.print_saved_residuals(f, *args)
  out = []
  for line in buf.getvalue().splitlines():
    m = re.match(r"\s*([a-z0-9_]+)\[([0-9,]*)\]\s*(.*)", line)
    if not m:
      continue
    dt, shape, rest = m.group(1), m.group(2), m.group(3)
    dims = [int(s) for s in shape.split(",") if s]
    if not dt.startswith("f8") and dt not in _DTYPE_BYTES:
      raise ValueError(f"saved_residuals: unknown dtype {dt!r} in {line!r}")
    nbytes = int((1 if dt.startswith("f8") else _DTYPE_BYTES[dt]) * int(np.prod(dims)))
    arg = re.match(r"from the argument (.*)", rest)
    out.append({"dtype": dt, "shape": dims, "bytes": nbytes,
                "from_argument": arg.group(1) if arg else None,
                "literal": rest.startswith("from a literal"), "line": line.strip()})
  return out


def residual_bytes(model, variables, x) -> dict:
  """Bytes ``model``'s backward pass keeps (``jax.vjp`` outside jit), by kind.

  The fp8 scales and histories (the ``fl.OWG`` collection) are model state that
  lives across steps anyway, so they are counted apart. This is a per-layer
  figure: inside one jitted step XLA drops residuals the backward never reads,
  so quote :func:`memory_stats` of a compiled step for peak memory.

  Args:
    model: anything with ``apply(variables, x)``.
    variables: its variables.
    x: its input.

  Returns:
    ``{"bytes": everything but the fp8 state (inputs and parameters the backward
    reads included), "activation_bytes": arrays computed by the forward pass
    (inputs, parameters and constants excluded), "argument_bytes",
    "state_bytes", "entries": the raw lines}``.
  """
  res = saved_residuals(lambda v, x: model.apply(v, x), variables, x)
  owg = f"['{fl.OWG}']"
  state = sum(r["bytes"] for r in res if owg in (r["from_argument"] or ""))
  args = sum(r["bytes"] for r in res if r["from_argument"] and owg not in r["from_argument"])
  literals = sum(r["bytes"] for r in res if r["literal"])
  total = sum(r["bytes"] for r in res)
  return {"bytes": total - state, "activation_bytes": total - state - args - literals,
          "argument_bytes": args, "state_bytes": state, "entries": [r["line"] for r in res]}


def memory_stats(compiled) -> dict | None:
  """The byte counts of ``compiled.memory_analysis()``, or None if unavailable."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # Not every backend has it.
    return None
  if stats is None:
    return None
  out = {}
  for field in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes"):
    value = getattr(stats, field, None)
    if value is not None:
      out[field] = int(value)
  return out or None


def gpu_products(hlo_text: str) -> dict:
  """fp8 products among all products of optimized XLA:GPU HLO (``compiled.as_text()``).

  The counting is :func:`fp8_linen.testing.hlo_products.count_products`, the
  same on a real GPU and in the deviceless H100 compile.
  """
  c = hlo_products.count_products(hlo_text)
  return {"fp8_products": c.fp8_products, "products": c.products, "fp8_gemms": c.fp8_gemms,
          "gemms": c.gemms, "fp8_convs": c.fp8_convs, "convs": c.convs,
          "fp8_triton_gemms": c.fp8_triton_gemms, "triton_gemms": c.triton_gemms,
          "other_dots": c.other_dots}


def compile_report_row(report: CompileReport) -> dict:
  """The JSON row of a deviceless compile: product counts and planned memory."""
  return {"fp8_products": report.fp8_products, "products": report.products,
          "fp8_gemms": report.fp8_gemms, "gemms": report.gemms, "fp8_convs": report.fp8_convs,
          "convs": report.convs, "other_dots": report.other_dots,
          "temp_size_in_bytes": report.temp_bytes,
          "argument_size_in_bytes": report.argument_bytes,
          "output_size_in_bytes": report.output_bytes,
          "alias_size_in_bytes": report.alias_bytes,
          "compile_s": report.compile_seconds}


# ----------------------------------------------------------------------------
# The training step every timing benchmark runs.
# ----------------------------------------------------------------------------


def make_train_step(model, *, loss: str = "linear") -> Callable:
  """``step(state, x, r) -> (new state, loss, dL/dx)`` for a ``fl.TrainState``.

  The loss is ``sum(y * r)`` with ``r`` a random cotangent passed as an
  argument, and the step returns the loss and ``dL/dx`` as well as the new
  state: a step that returned only the updated variables would let XLA delete
  the forward GEMM and never compute dgrad (1 product per layer timed instead
  of 3). The gradient part is
  :func:`fp8_linen.testing.train_step.make_train_step`, the step the
  deviceless H100 compile counts products in; here the optimizer update and the
  fp8 state merge (``TrainState.apply_gradients``) follow.

  Args:
    model: anything with ``apply(variables, x)``; ``state.params`` holds its
      whole variables dict.
    loss: ``'linear'`` (``sum(y * r)``) or ``'mse'`` (``0.5 * sum((y - r)^2)``:
      the cotangent depends on the forward, as a real loss's does).
  """
  grads_step = make_grads_step(model, loss=loss)

  def step(state, x, r):
    loss, dx, grads = grads_step(state.params, x, r)
    return state.apply_gradients(grads=grads), loss, dx

  return step


@dataclasses.dataclass
class TrainArm:
  """One arm of a timing benchmark: a compiled train step and what it runs on.

  Attributes:
    run: zero-argument callable: one step on the arm's own (donated) state;
      returns ``(state, loss, dx)`` for ``block_until_ready``.
    variables: the model's initial variables (for :func:`residual_bytes`).
    x: the input; ``r``: the random cotangent.
    memory: :func:`memory_stats` of the compiled step.
    products: on a GPU, :func:`gpu_products` of the compiled step (else None).
    compiled: the compiled step (``jax.stages.Compiled``), for readers of its
      optimized HLO (``compiled.as_text()``: the step-time estimate, product lists).
    compile_seconds: how long lowering and compiling the step took.
  """

  run: Callable[[], object]
  variables: dict
  x: jax.Array
  r: jax.Array
  memory: dict | None
  products: dict | None
  compiled: object = None
  compile_seconds: float | None = None


def build_train_arm(model, x, *, seed: int = 0, tx=None, loss: str = "linear",
                    split: bool = False) -> TrainArm:
  """Initializes ``model`` on ``x`` and compiles its train step (:func:`make_train_step`).

  The variables (params, fp8 scales and histories) live in a ``fl.TrainState``
  passed to the jitted step as an argument and donated; ``r`` (the cotangent of
  the linear loss, the target of the mse one) is random (normal, the output's
  dtype), drawn from ``seed``.

  Args:
    model: a Linen module.
    x: its input (random, never zeros: the caller draws it).
    seed: seeds the initialization and the cotangent.
    tx: the optax optimizer (default SGD, learning rate 1e-3).
    loss: the step's loss (:func:`make_train_step`).
    split: wrap the step in ``fl.split_first_step`` (its first call runs the
      default trace; once the histories hold an observation, e.g. after the
      timing's warm-up, the steady one).
  """
  k_init, k_r = jax.random.split(jax.random.key(seed))
  variables = model.init(k_init, x)
  y = jax.eval_shape(model.apply, variables, x)
  r = jax.random.normal(k_r, y.shape, jnp.float32).astype(y.dtype)
  # The step donates its state, so it gets copies; `variables` stay readable.
  state = fl.TrainState.create(apply_fn=model.apply, params=jax.tree.map(jnp.copy, variables),
                               tx=tx if tx is not None else optax.sgd(1e-3))
  t0 = time.perf_counter()
  step = make_train_step(model, loss=loss)
  compiled = jax.jit(fl.split_first_step(step) if split else step,
                     donate_argnums=0).lower(state, x, r).compile()
  compile_seconds = time.perf_counter() - t0
  holder = {"state": state}

  def run():
    holder["state"], loss, dx = compiled(holder["state"], x, r)
    return holder["state"], loss, dx

  products = gpu_products(compiled.as_text()) if jax.default_backend() == "gpu" else None
  return TrainArm(run=run, variables=variables, x=x, r=r, memory=memory_stats(compiled),
                  products=products, compiled=compiled, compile_seconds=compile_seconds)


def time_arms(arms: dict[str, TrainArm], baseline: str, reps: int = 20,
              warmup: int = 3) -> dict[str, dict]:
  """Times the arms' steps interleaved (:func:`time_interleaved`); adds ratios to ``baseline``.

  Returns:
    ``{name: {median_ms, min_ms, max_ms, runs, ratio, min_ratio, max_ratio}}``
    where the ratios are the arm's median, fastest and slowest run divided by
    the baseline's median.
  """
  times = time_interleaved({n: a.run for n, a in arms.items()}, reps=reps, warmup=warmup)
  base = times[baseline]["median_ms"]
  return {n: {**t, "ratio": t["median_ms"] / base, "min_ratio": t["min_ms"] / base,
              "max_ratio": t["max_ms"] / base} for n, t in times.items()}


def compare_train_arms(models: dict, x, *, baseline: str, reps: int = 20, warmup: int = 3,
                       label: str = "") -> dict[str, dict]:
  """Builds, times (interleaved) and measures the residuals of each model's train step.

  Args:
    models: ``{name: Linen module}``, all run on ``x``.
    x: the input.
    baseline: the name every ratio is taken against.
    reps: timed rounds.
    warmup: untimed rounds first.
    label: printed at the start of each line (e.g. the shape).

  Returns:
    ``{name: row}`` with times, ratios, residual bytes (and entries), memory and,
    on a GPU, product counts; one line per arm is printed as it is done.
  """
  built = {k: build_train_arm(m, x, seed=1) for k, m in models.items()}
  times = time_arms(built, baseline, reps=reps, warmup=warmup)
  residuals = {k: residual_bytes(models[k], a.variables, x) for k, a in built.items()}
  base_r = residuals[baseline]["bytes"]
  base_temp = (built[baseline].memory or {}).get("temp_size_in_bytes")
  rows = {}
  for k, arm in built.items():
    t, rb = times[k], residuals[k]["bytes"]
    temp = (arm.memory or {}).get("temp_size_in_bytes")
    rows[k] = {"median_ms": t["median_ms"], "min_ms": t["min_ms"], "max_ms": t["max_ms"],
               "ratio_vs_bf16": t["ratio"], "min_ratio": t["min_ratio"],
               "max_ratio": t["max_ratio"], "residual_bytes": rb,
               "residual_ratio_vs_bf16": rb / base_r, "residual_entries": residuals[k]["entries"],
               "memory": arm.memory,
               **({"temp_ratio_vs_bf16": temp / base_temp} if temp and base_temp else {}),
               **({"gpu_products": arm.products} if arm.products else {})}
    print(f"{label} {k:>16}: {t['ratio']:.2f}x {baseline} "
          f"[{t['min_ratio']:.2f}, {t['max_ratio']:.2f}]  "
          f"residuals {rb / 2**20:.2f} MiB ({rows[k]['residual_ratio_vs_bf16']:.2f}x)"
          + (f"  temp {temp / 2**20:.1f} MiB" if temp else ""), flush=True)
  return rows


def write_json(name: str, payload: dict, out_dir: str | None = None,
               device: str | None = None) -> str:
  """Writes ``<out_dir>/<device>-<name>.json`` and returns its path.

  Args:
    name: the benchmark's name.
    payload: the JSON payload.
    out_dir: the folder (default ``benchmarks/results``).
    device: the file-name prefix (default :func:`device_name`).
  """
  out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
  return write_json_to(os.path.join(out_dir, f"{device or device_name()}-{name}.json"), payload)


def compilable(target_names) -> list[str]:
  """The targets of ``target_names`` this machine can compile for; prints why not for the others."""
  out = []
  for name in target_names:
    available = targets.availability(name)
    if available:
      out.append(name)
    else:
      print(f"{name}: cannot compile here ({available.reason})")
  return out


def finish(payload: dict, table: str, out: str | None) -> dict:
  """Prints a script's table, writes its JSON to ``out`` (when given) and returns the payload."""
  print(table)
  if out:
    write_json_to(out, payload)
  return payload


def write_json_to(path: str, payload: dict) -> str:
  """Writes ``payload`` to ``path`` (folders created) and returns the path."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
  return path
