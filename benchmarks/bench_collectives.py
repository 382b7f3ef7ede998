"""Collectives per training step of an FSDP stack, read from the compiled programs (compile only).

The model is the issue's stack (``fp8_linen.testing.collectives.stack``):
``depth`` dense layers of 1024 features, bf16 activations and float32
parameters, every kernel sharded ``P('fsdp', None)`` over all devices and the
batch (1024 rows) over the same axis. The step is the one that proves a
layer (``fp8_linen.testing.train_step``: loss, dL/dx and every gradient, the new
fp8 state included). Arms: ``nn.Dense`` bf16, ``fl.QDense`` fp8 delayed and
current scaling, int8 STE (channel weights). Depth 4 and 16, on:

* the 8-device CPU mesh ("CPU (8 virtual devices)");
* 8 x H100 in one host ("8 x H100 (compile only)");
* a 2x2 TPU v6e slice ("TPU v6e 2x2 (compile only)").

Meshes with ``Auto`` axes (a plain ``jax.sharding.Mesh``; XLA places every
sharding, as in the issue) and ``Explicit`` ones (``jax.make_mesh``'s
default; the shardings are in the arrays' types). Per arm and depth: collectives per step by kind (count, bytes), the ones a
first step adds (delayed scaling's scales from the current amax, in a
``lax.cond`` branch), the all-reduces that only make the new quantization
state (the step compiled without returning it has the rest; current
scaling's amaxes feed its casts and count there), and the weight-gather
bytes against float32 parameters. Nothing runs: the figures are the
compiled program's.

Writes ``benchmarks/results/collectives.json`` and prints the table (and the
README's markdown with ``--markdown``).

Usage:
  python benchmarks/bench_collectives.py
  python benchmarks/bench_collectives.py --where cpu --depths 4     # one mesh, one depth
  python benchmarks/bench_collectives.py --quick --out /tmp/c.json  # 256 wide, CPU, smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WHERE = ("cpu", "h100x8", "tpu-v6e-2x2")
DEPTHS = (4, 16)
MIB = 2.0 ** 20


def _setup():
  # The CPU mesh needs 8 host devices, the compile-only targets the CPU platform;
  # both before JAX starts.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flag = "--xla_force_host_platform_device_count=8"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def measure(where: str, depths, width: int, axis_types=("auto",)) -> dict:
  """The rows of one mesh (``{'device': ..., 'rows': [...]}``), or why it is unavailable."""
  from fp8_linen.testing import collectives, targets  # pylint: disable=import-outside-toplevel
  if where != collectives.CPU_MESH:
    available = targets.availability(where)
    if not available:
      return {"device": collectives.DEVICES[where], "unavailable": available.reason, "rows": []}
  rows = []
  for axis_type, depth in ((a, d) for a in axis_types for d in depths):
    bf16 = collectives.fsdp_step("bf16", depth, where, width=width, axis_type=axis_type)
    for arm in collectives.ARMS:
      r = collectives.fsdp_step(arm, depth, where, width=width, axis_type=axis_type)
      row = r.row()
      row["state_all_reduces"] = collectives.state_all_reduces(r)
      row["all_reduces_over_bf16"] = collectives.extra_all_reduces(r, bf16)
      row["weight_gathers_vs_bf16"] = (r.weight_gather_bytes / bf16.weight_gather_bytes
                                       if bf16.weight_gather_bytes else None)
      rows.append(row)
      print(f"  {collectives.DEVICES[where]:28s} {axis_type:8s} depth {depth:2d} {arm:12s} "
            f"{_cells(row)}", flush=True)
  return {"device": collectives.DEVICES[where], "rows": rows}


def _kind(row, kind, key="every_step"):
  c = row[key].get(kind)
  return "-" if c is None else f"{c['count']} / {c['bytes'] / MIB:.2f} MiB"


def _cells(row) -> str:
  first = row["first_step_only"].get("all-reduce")
  return (f"all-gather {_kind(row, 'all-gather'):>16s}  all-reduce {_kind(row, 'all-reduce'):>16s}"
          f"  state {row['state_all_reduces']} (+{row['all_reduces_over_bf16']} over bf16)"
          f"  first step +{first['count'] if first else 0}"
          f"  weights {row['weight_gathers_vs_f32_params']:.2f}x f32 "
          f"({'/'.join(row['gather_dtypes'])})")


def markdown(payload: dict, axis_type: str = "auto") -> str:
  """The README table: one row per device, depth and arm (meshes with ``axis_type`` axes)."""
  lines = ["| device | depth | arm | all-gather: count / bytes | all-reduce: count / bytes | "
           "state-only all-reduces | first step adds | weight gathers vs f32 params "
           "(dtypes) |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
  for mesh in payload["meshes"].values():
    if not mesh["rows"]:
      lines.append(f"| {mesh['device']} | | | unavailable: {mesh.get('unavailable', '')} "
                   "| | | | |")
    for row in (r for r in mesh["rows"] if r["axis_type"] == axis_type):
      other = [k for k in row["every_step"] if k not in ("all-gather", "all-reduce")]
      extra = "".join(f"; {k} {_kind(row, k)}" for k in other)
      first = row["first_step_only"].get("all-reduce")
      lines.append(
          f"| {mesh['device']} | {row['depth']} | {row['arm']} | {_kind(row, 'all-gather')} | "
          f"{_kind(row, 'all-reduce')}{extra} | {row['state_all_reduces']} | "
          f"{first['count'] if first else 0} all-reduces | "
          f"{row['weight_gathers_vs_f32_params']:.2f}x ({', '.join(row['gather_dtypes'])}) |")
  return "\n".join(lines)


def goals(payload: dict) -> list[str]:
  """Which goals a measured table misses (delayed: <= 2 state collectives; codes: <= 0.25x)."""
  misses = []
  for mesh in payload["meshes"].values():
    for row in mesh["rows"]:
      where = f"{mesh['device']} ({row['axis_type']} axes) depth {row['depth']} {row['arm']}"
      if row["arm"] == "fp8_delayed" and row["state_all_reduces"] > 2:
        misses.append(f"{where}: {row['state_all_reduces']} state all-reduces > 2")
      if row["arm"] != "bf16" and row["weight_gathers_vs_f32_params"] > 0.25 + 1e-9:
        misses.append(f"{where}: weight gathers {row['weight_gathers_vs_f32_params']:.2f}x "
                      "f32 params > 0.25x")
  return misses


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--where", nargs="+", default=list(WHERE), choices=WHERE,
                      help="meshes: the CPU mesh and compile-only targets")
  parser.add_argument("--depths", nargs="+", type=int, default=list(DEPTHS))
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--axis-types", nargs="+", default=["auto", "explicit"],
                      choices=["auto", "explicit"],
                      help="mesh axis types: Auto (a plain Mesh) and Explicit (jax.make_mesh)")
  parser.add_argument("--quick", action="store_true",
                      help="256-wide layers, depths 2 and 4, the CPU mesh only (smoke run)")
  parser.add_argument("--markdown", action="store_true", help="also print the README table")
  parser.add_argument("--out", default=os.path.join(HERE, "results", "collectives.json"))
  args = parser.parse_args(argv)
  if args.quick:
    args.where, args.depths, args.width, args.axis_types = ["cpu"], [2, 4], 256, ["auto"]
  _setup()
  sys.path.insert(0, HERE)
  import common  # pylint: disable=import-outside-toplevel

  print("Collectives per training step (compiled programs; nothing runs): an FSDP stack of "
        f"{args.width}-wide bf16 dense layers, kernels P('fsdp', None), batch over 'fsdp'.")
  payload = {"benchmark": "collectives", "env": common.environment(),
             "model": {"layers": "nn.Dense / fl.QDense, bf16 activations, float32 params",
                       "width": args.width, "tokens": 1024, "depths": args.depths,
                       "sharding": "kernels P('fsdp', None), batch P('fsdp'), state P()",
                       "step": "loss, dL/dx and every gradient (train_step.make_train_step)"},
             "arms": {"bf16": "nn.Dense(dtype=bf16)", "fp8_delayed": "fl.QDense, delayed_scaling()",
                      "fp8_current": "fl.QDense, current_scaling()",
                      "int8": "fl.QDense, IntRecipe (STE, channel weights)"},
             "meshes": {}}
  for where in args.where:
    payload["meshes"][where] = measure(where, args.depths, args.width, args.axis_types)
  payload["goals_missed"] = goals(payload)
  common.write_json_to(args.out, payload)
  if args.markdown:
    for axis_type in args.axis_types:
      print(f"\n{axis_type.capitalize()} mesh axes:\n" + markdown(payload, axis_type))
  print("goals: " + ("all met" if not payload["goals_missed"] else
                     "; ".join(payload["goals_missed"])))
  return payload


if __name__ == "__main__":
  main()
