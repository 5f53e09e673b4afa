"""Shared benchmark plumbing: percentiles, tables, and `bench/results/<name>.json` with targets."""
from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    target: float
    higher_is_better: bool = True

    @property
    def met(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": round(self.value, 4), "target": self.target, "met": self.met}


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [f"\n== {title} ==", line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def write_results(name: str, figures: dict[str, Any], targets: list[Target]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        **figures,
        "targets": [t.as_dict() for t in targets],
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(f"{name}: targets", ["target", "value", "goal", "met"], [[t.name, t.value, t.target, "yes" if t.met else "NO"] for t in targets]))
    print(f"-> {path}")
    return path
