"""Shared measuring helpers for the benchmark scripts (see ../shared/BENCHMARKS.md).

Rules kept here: every arm is timed in one process, interleaved, after warm-up;
``block_until_ready`` on every output; median of >= 20 runs with min and max;
random inputs and a random cotangent; results as ratios to a baseline arm.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import statistics
import time
from typing import Callable

import jax
import numpy as np

_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "bool": 1, "pred": 1, "s64": 8, "u64": 8}


def device_name() -> str:
  """'cpu', or the GPU/TPU kind with spaces replaced (for file names)."""
  d = jax.devices()[0]
  return "cpu" if d.platform == "cpu" else re.sub(r"[^A-Za-z0-9]+", "-", d.device_kind).lower()


def environment() -> dict:
  """Device kind and library versions for the output JSON."""
  import flax
  import optax
  d = jax.devices()[0]
  return {"device_kind": d.device_kind, "platform": d.platform, "device_count": jax.device_count(),
          "cpu_count": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__,
          "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__,
          "flax": flax.__version__, "optax": optax.__version__}


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


def saved_residuals(f: Callable, *args) -> list[dict]:
  """Residuals ``f``'s backward pass keeps, parsed from ``print_saved_residuals``.

  Each entry: ``dtype``, ``shape``, ``bytes``, ``from_argument`` (the argument
  path, or None) and the raw ``line``.
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
    nbytes = (1 if dt.startswith("f8") else _DTYPE_BYTES.get(dt, 4)) * int(np.prod(dims))
    arg = re.match(r"from the argument (.*)", rest)
    out.append({"dtype": dt, "shape": dims, "bytes": nbytes,
                "from_argument": arg.group(1) if arg else None, "line": line.strip()})
  return out


def residual_bytes(f: Callable, *args, state_prefix: str = "owg") -> dict:
  """Residual bytes of ``f``, with the fp8 state arguments counted apart.

  The scales and histories are model state that lives across steps anyway; the
  comparison with a plain layer is on everything else.
  """
  res = saved_residuals(f, *args)
  state = sum(r["bytes"] for r in res if (r["from_argument"] or "").startswith(state_prefix))
  total = sum(r["bytes"] for r in res)
  return {"bytes": total - state, "state_bytes": state,
          "entries": [r["line"] for r in res]}


def count_in_hlo(compiled_text: str, needles=("__cublas$lt$matmul$f8",
                                              "__cudnn$convForwardGraph")) -> dict:
  """How often each custom-call target appears in compiled HLO text."""
  return {n: compiled_text.count(n) for n in needles}


def write_json(name: str, payload: dict) -> str:
  """Writes ``benchmarks/results/<device>-<name>.json`` and returns its path."""
  path = os.path.join(os.path.dirname(__file__), "results", f"{device_name()}-{name}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
  return path
