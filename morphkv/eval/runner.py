"""The shared runner: arms x items x models -> records -> a summary, a table, JSON and PNGs.

Every measurement is an ``Evaluation`` (the way kvpress's pipeline serves every press): it
parses its arms (checked before any work), yields its items, measures one item under every arm
(a record, or a list of rows) and reports (summary, table). ``run`` does the rest alike for
all of them: the model, the progress line, ``--max-minutes``, the JSON written after every
item (a stopped run keeps what it measured), the table printed, the JSON and PNG at the end.
``--model a,b`` runs each model in turn, its files named ``<stem>_<model>``. Also here: the
options most commands share (``add_flags``, ``standard``) and the result files' helpers.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

from .models import load_model
from .plots import require_matplotlib

ENGINE = 2  # 2: no key mirror, real-query rows fixed at arrival (2026-11-30); 1 before


class Evaluation:
    """What ``run`` needs of an evaluation (``args``: the command's namespace): ``arms()``
    (checked: ValueError names a bad one), ``items(model, tok)``, ``measure(model, tok, item,
    arms, bar)`` (a record, or a list of rows), ``report(records, arms)`` -> (summary, table)
    and, to draw ``<stem>.png`` at the end, ``plot(result, path)``."""

    name = ""  # results/<name> and the JSON's "benchmark"
    stem_of = "{name}"  # the files' default stem: formatted with the args, name and _quick
    key = "items"  # the JSON's list of records
    command = "morphkv eval"  # names the command in a one-line error
    plot = None  # a method plot(result, path): the PNG drawn at the end
    model = True  # False: no model is loaded (one layer alone)

    def __init__(self, args) -> None:
        self.args, self.info = args, {}  # ``info``: more top-level JSON fields

    def stem(self) -> str:
        quick = "_quick" if getattr(self.args, "quick", False) else ""
        return getattr(self.args, "stem", None) or self.stem_of.format(
            name=self.name, _quick=quick, **vars(self.args))

    def steps(self, arms) -> int:
        """Progress steps in all (0: no progress line)."""
        return 0

    def items(self, model, tok):
        """The items (default: the arms, each measured in turn)."""
        return self.arm_list


def run(ev: Evaluation, model=None, tok=None) -> dict:
    """Every item under every arm (see the module doc); the result dict of the last model."""
    args = ev.args
    try:
        arms = ev.arm_list = ev.arms()
    except ValueError as e:
        raise SystemExit(f"{ev.command}: error: {e}") from None
    if ev.plot:
        require_matplotlib(args)
    names = str(getattr(args, "model", None) or "").split(",")
    if model is None and len(names) > 1:  # one run per model, each in its own files
        for name in names:
            each = copy.copy(ev)
            each.args = copy.copy(args)
            each.args.model, stem = name, ev.stem()
            each.args.stem = f"{stem}_{re.sub(r'[^A-Za-z0-9.]+', '-', name)}"
            result = run(each)
        return result
    if model is None and ev.model:
        model, tok = load_model(getattr(args, "model", None))
    folder, stem = out_dir(args, ev.name), ev.stem()
    start, load = time.perf_counter(), os.getloadavg()
    result = {"benchmark": ev.name, "args": vars(args), "environment": environment(),
              ev.key: []}
    records, items = result[ev.key], ev.items(model, tok)  # then the steps: items may plan
    total = ev.steps(arms)
    bar = Progress(total, ev.name, getattr(args, "quiet", False) or not total)
    for item in items:
        minutes = getattr(args, "max_minutes", 0)
        if minutes and time.perf_counter() - start > 60 * minutes:
            print(f"[{ev.name}] --max-minutes reached", file=sys.stderr)
            break
        got = ev.measure(model, tok, item, arms, bar)
        records += got if isinstance(got, list) else [got]
        result.update(ev.info, seconds=time.perf_counter() - start,
                      load_average={"start": load, "end": os.getloadavg()})
        result["summary"] = ev.report(records, arms)[0]
        write_json(folder / f"{stem}.json", result)  # partial results as we go
    result.update(ev.info)
    result["summary"], result["table"] = ev.report(records, arms)
    print(result["table"])
    wrote = [write_json(folder / f"{stem}.json", result)]
    if ev.plot and not getattr(args, "no_plot", False):
        wrote.append(folder / f"{stem}.png")
        ev.plot(result, wrote[-1])
    print("wrote " + " and ".join(map(str, wrote)))
    return result


class Progress:
    """A one-line progress meter on stderr: done/total, elapsed, ETA. Silent when quiet."""

    def __init__(self, total: int, label: str = "", quiet: bool = False, every: float = 5.0):
        self.total, self.label, self.quiet, self.every = max(int(total), 1), label, quiet, every
        self.done, self.start, self._last = 0, time.perf_counter(), 0.0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        if self.quiet or (now - self._last < self.every and self.done < self.total):
            return
        self._last = now
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(f"[{self.label}] {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
              f"elapsed {_clock(elapsed)} eta {_clock(eta)} {note}", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def add_flags(parser: argparse.ArgumentParser, flags) -> None:
    """Add ``(flag, default, help[, choices])`` flags; the type follows the default (False: a
    switch; a list: comma separated; None: a string) and the help shows the default."""
    for flag, default, text, *choices in flags:
        kw: dict[str, Any] = {"default": default, "help": text}
        if default is False:
            kw = {"action": "store_true", "help": text}
        elif isinstance(default, list):
            kw["type"] = csv_ints if default and isinstance(default[0], int) else csv_strs
            kw["help"] += f" (default {','.join(map(str, default))})" if default else ""
        elif default is not None:
            kw["type"] = type(default)
            kw["help"] += f" (default {default})"
        if choices:
            kw["choices"] = choices[0]
        parser.add_argument(flag, **kw)


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def csv_strs(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def standard(name: str, *keys: str) -> list[tuple]:
    """The flags most measurements share, for ``add_flags``: ``model``, ``out`` (default
    results/<name>), ``stem``, ``quiet``, ``no_plot``, and the items' ``first``, ``seed``,
    ``n_sink``, ``chunk``, ``max_minutes``."""
    known = {"model": ("--model", None, "model: an mlx_lm path/repo or .gguf (default: the "
                       "embedded SmolLM2)"),
             "out": ("--out", None, f"output folder (default results/{name})"),
             "stem": ("--stem", None, "output file stem (default: the command's)"),
             "quiet": ("--quiet", False, "no progress lines"),
             "no_plot": ("--no-plot", False, "skip the PNG"),
             "first": ("--first", 0, "index of the first item"),
             "seed": ("--seed", 0, "the items' seed"),
             "n_sink": ("--n-sink", 4, "protected first tokens"),
             "chunk": ("--chunk", 256, "prefill chunk (exact either way)"),
             "max_minutes": ("--max-minutes", 0.0, "stop adding items after this (0: never)")}
    return [known[k] for k in keys]


def out_dir(args: argparse.Namespace, name: str) -> Path:
    path = Path(args.out) if getattr(args, "out", None) else Path("results") / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment() -> dict:
    """Versions and machine facts stored with every result."""
    import mlx.core as mx
    import mlx_lm

    return {"python": platform.python_version(), "mlx": getattr(mx, "__version__", "?"),
            "mlx_lm": getattr(mlx_lm, "__version__", "?"), "machine": platform.machine(),
            "cpus": os.cpu_count(), "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "engine": ENGINE}


def write_json(path: Path, obj: Any, indent: int = 1) -> Path:
    def jsonable(x: Any) -> Any:
        if hasattr(x, "tolist"):  # NumPy scalars and arrays
            return x.tolist()
        if isinstance(x, Path):
            return str(x)
        raise TypeError(f"not JSON serialisable: {type(x)}")

    path.write_text(json.dumps(obj, indent=indent, default=jsonable) + "\n")
    return path


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
