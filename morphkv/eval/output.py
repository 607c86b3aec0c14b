"""Result files: the output folder, the machine facts stored with every result, JSON and
markdown tables."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any


def out_dir(args: argparse.Namespace, name: str) -> Path:
    path = Path(args.out) if getattr(args, "out", None) else Path("results") / name
    path.mkdir(parents=True, exist_ok=True)
    return path


ENGINE = 2  # 2: no key mirror, real-query rows fixed at arrival (2026-11-30); 1 before


def environment() -> dict:
    """Versions and machine facts stored with every result."""
    import mlx.core as mx
    import mlx_lm

    return {
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_lm": getattr(mlx_lm, "__version__", "?"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "engine": ENGINE,
    }


def write_json(path: Path, obj: Any, indent: int = 1) -> Path:
    path.write_text(json.dumps(obj, indent=indent, default=_jsonable) + "\n")
    return path


def _jsonable(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if not math.isfinite(v):
                return "-"
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pivot(rows: list[dict], keys: list[str], column: str, value: str, columns=None):
    """(headers, body): one line per distinct ``keys`` tuple, one column per ``column`` value,
    cells ``value`` (NaN where missing)."""
    columns = columns if columns is not None else list(dict.fromkeys(r[column] for r in rows))
    lines: dict[tuple, dict] = {}
    for r in rows:
        lines.setdefault(tuple(r[k] for k in keys), {})[r[column]] = r[value]
    body = [[*k] + [cells.get(c, float("nan")) for c in columns] for k, cells in lines.items()]
    return [*keys, *[str(c) for c in columns]], body


def finish(args: argparse.Namespace, name: str, result: dict, stem: str | None = None,
           plot=None, table: str | None = None, png: str | None = None) -> Path:
    """The end every measurement shares: ``table`` printed, ``<out>/<stem>.json`` written,
    ``<png or stem>.png`` drawn by ``plot(path)`` (not with ``--no-plot``), one "wrote" line;
    the folder."""
    folder, stem = out_dir(args, name), stem or name
    if table is not None:
        print(table)
    wrote = [write_json(folder / f"{stem}.json", result)]
    if plot is not None and not getattr(args, "no_plot", False):
        wrote.append(folder / f"{png or stem}.png")
        plot(wrote[-1])
    print("wrote " + " and ".join(map(str, wrote)))
    return folder
