"""Field checks shared by the recipe dataclasses (errors name owner and field)."""

from __future__ import annotations

import numpy as np


def check_choice(owner: str, field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(
        f"{owner}.{field}={value!r} is not allowed; allowed values: {list(allowed)}")


def check_int(owner: str, field: str, value, lo: int, hi: int | None = None) -> None:
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  if not ok or value < lo or (hi is not None and value > hi):
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    raise ValueError(f"{owner}.{field}={value!r} must be an int {rng}")


def check_bool(owner: str, field: str, value) -> None:
  if not isinstance(value, bool):
    raise ValueError(f"{owner}.{field}={value!r} must be True or False")
