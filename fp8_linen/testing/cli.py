"""``python -m fp8_linen.testing.cli``: what every case multiplies on every target, as a table.

Compiles each case of :mod:`fp8_linen.testing.cases` for each requested
target of :mod:`fp8_linen.testing.targets` (no GPU or TPU needed) and prints,
per case and target, what the compiled program multiplies in low precision and
whether the case's claim holds; ``--markdown`` prints the README's accelerator
table (:func:`markdown_cell` per cell). See :func:`main` for the options.

Example:
  >>> from fp8_linen.testing import cli
  >>> cli.main(['--list'])  # doctest: +ELLIPSIS
  target h100         NVIDIA H100 SXM
  ...
  case   qdense-delayed         QDense, fp8 delayed scaling
  ...
  0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import jax

from fp8_linen.testing.cases import Case, cases, check, compile_case
from fp8_linen.testing.compile import CompileReport
from fp8_linen.testing.targets import (SINGLE_DEVICE, TARGETS, TargetUnavailable, availability,
                                       use_cpu_platform)

__all__ = ["markdown_cell", "main"]


def _cell(case: Case, r: CompileReport) -> list[str]:
  kinds = ", ".join(f"{k} {n}" for k, n in r.by_kind.items()) or "-"
  classes = ", ".join(f"{k} {n}" for k, n in r.classes.items())
  problem = check(case, r)
  return [case.name, r.target, f"{r.low_precision}/{len(r.product_list)}", kinds, classes,
          f"{r.temp_bytes / 2**20:.1f}", "ok" if problem is None else "NO: " + problem,
          case.note_on(r.target, r.platform) or case.what]


def markdown_cell(case: Case, target: str) -> str:
  """One cell of the README table: the report's ``describe()``, flagged if the claim fails.

  Args:
    case: a case of :func:`fp8_linen.testing.cases.cases`.
    target: a target name.

  Returns:
    ``CompileReport.describe()`` of :func:`~fp8_linen.testing.cases.compile_case`,
    followed by ``(NOT AS CLAIMED: why)`` when :func:`~fp8_linen.testing.cases.check`
    fails.
  """
  r = compile_case(case.name, target)
  problem = check(case, r)
  return r.describe() + ("" if problem is None else f" (NOT AS CLAIMED: {problem})")


def _markdown(selected: Sequence[Case], names: Sequence[str]) -> int:
  print("| case | " + " | ".join(TARGETS[n].description for n in names) + " |")
  print("| --- |" + " --- |" * len(names))
  failed = False
  for case in selected:
    cells = [markdown_cell(case, n) for n in names]
    failed |= any("NOT AS CLAIMED" in c for c in cells)
    print(f"| `{case.name}` {case.what} | " + " | ".join(cells) + " |", flush=True)
  return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
  """Prints, per case and target, what the compiled step multiplies.

  Columns: low-precision products / all products; the low-precision ones by
  kernel kind; all products by operand class; planned temp memory; whether
  the case's claim holds on that target.

  Args:
    argv: ``--target NAME`` and ``--case NAME`` (repeatable; default all
      single-device targets and all cases), ``--list``, ``--json PATH`` (the
      rows as JSON), ``--markdown`` (one table, cases x targets).

  Returns:
    0; 1 if a claim does not hold; 2 if no requested target is available
    (the reasons are printed).
  """
  parser = argparse.ArgumentParser(
      prog="python -m fp8_linen.testing.cli",
      description="Compile each case's training step for accelerators this machine does not "
                  "have (no GPU or TPU needed) and print what XLA multiplies in low precision. "
                  "Proves the kernels and their input dtypes; says nothing about speed.")
  parser.add_argument("--target", action="append", default=[],
                      help=f"a target (repeatable; default: {', '.join(SINGLE_DEVICE)})")
  parser.add_argument("--case", action="append", default=[], help="a case (repeatable)")
  parser.add_argument("--list", action="store_true", help="list targets and cases, then exit")
  parser.add_argument("--json", help="also write the rows to this JSON file")
  parser.add_argument("--markdown", action="store_true",
                      help="print one markdown table, cases x targets (the README's)")
  args = parser.parse_args(argv)
  all_cases = cases()
  if args.list:
    for t in TARGETS.values():
      print(f"target {t.name:12s} {t.description}")
    for c in all_cases:
      print(f"case   {c.name:22s} {c.what}")
    return 0
  names = args.target or list(SINGLE_DEVICE)
  unknown = sorted(set(names) - set(TARGETS))
  unknown_cases = sorted(set(args.case) - {c.name for c in all_cases})
  if unknown or unknown_cases:
    parser.error(f"unknown target(s) {unknown} / case(s) {unknown_cases}; known targets "
                 f"{sorted(TARGETS)}, cases {[c.name for c in all_cases]}")
  try:
    use_cpu_platform()
  except TargetUnavailable as e:
    print(f"compile-only targets unavailable: {e}", file=sys.stderr)
    return 2
  ready = []
  for n in names:
    a = availability(n)
    if a:
      ready.append(n)
    else:
      print(f"{n}: unavailable: {a.reason}", file=sys.stderr)
  if not ready:
    return 2
  selected = [c for c in all_cases if not args.case or c.name in args.case]
  if args.markdown:
    return _markdown(selected, ready)
  header = ["case", "target", "low/all", "low precision by kernel", "by operands", "temp MiB",
            "claim", "what"]
  widths = [22, 8, 8, 34, 18, 9, 6, 0]
  print("Training step (loss, dL/dx, grads) of each case compiled for each target; "
        "low-precision products / all products.")
  print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), flush=True)
  rows, failed = [], False
  for case in selected:
    for n in ready:
      try:
        r = compile_case(case.name, n)
        row = _cell(case, r)
        failed |= not row[6].startswith("ok")
      except TargetUnavailable:
        raise
      except Exception as e:  # pylint: disable=broad-except  # a failed compile is a result
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        row, failed = [case.name, n, "FAILED", "", "", "", "NO", msg[:90]], True
      rows.append(dict(zip(header, row)))
      print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip(), flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

