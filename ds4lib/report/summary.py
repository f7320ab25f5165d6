"""`save_summary` and `markdown_table`: what every notebook's last cell and its tables go through.

Owns the JSON summary written next to an executed notebook (parameters, results, environment: numbers a
later run or BENCHMARKS.md can quote) and plain Markdown tables (rendered by Jupyter, readable as text).
"""
from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
from pathlib import Path

import numpy as np

__all__ = ["save_summary", "markdown_table", "to_jsonable"]


def to_jsonable(obj):
    """NumPy scalars/arrays, tuples, Paths and dataclasses -> plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())        # a NumPy NaN / inf becomes null like a Python one
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def _git_head() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def save_summary(params: dict, results: dict, path) -> Path:
    """Write {"params", "results", "env"} as JSON to `path` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"params": to_jsonable(params), "results": to_jsonable(results),
           "env": {"python": platform.python_version(), "machine": platform.machine(), "git": _git_head(),
                   "numpy": np.__version__}}
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


class _Markdown(str):
    """A str that Jupyter renders as Markdown."""

    def _repr_markdown_(self):
        return str(self)


def _fmt(v, floatfmt):
    if isinstance(v, (float, np.floating)):
        return format(float(v), floatfmt)
    if isinstance(v, (list, tuple)):
        return "x".join(str(x) for x in v)
    return str(v)


def markdown_table(rows, columns=None, floatfmt: str = ".5f", title: str = "") -> str:
    """rows: list of dicts -> a Markdown table of `columns` (default: keys of the first row)."""
    rows = list(rows)
    if not rows:
        return _Markdown(f"{title}\n\n(no rows)" if title else "(no rows)")
    cols = list(columns or rows[0].keys())
    lines = ([f"**{title}**", ""] if title else []) + ["| " + " | ".join(cols) + " |",
                                                        "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, ""), floatfmt) for c in cols) + " |")
    return _Markdown("\n".join(lines))
