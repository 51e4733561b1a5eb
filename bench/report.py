"""The numbers the services benchmarks report: percentiles and a plain table."""

from __future__ import annotations

import json
import os
from typing import Any


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    head = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    print(head)
    print("-" * len(head))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def write_json(path: str, data: dict[str, Any]) -> None:
    """A results file: `data` as indented JSON at `path` (its folder made), and a line saying so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(path)}")
