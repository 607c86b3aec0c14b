"""Small helpers shared by every benchmark: progress, output files, tables, tiny models."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

BENCH_EXTRA = "pip install -e '.[bench]'"
RANDOM_TINY = "random-tiny"  # a tiny random-weight llama built in-process (tests, no download)


class Progress:
    """A one-line progress meter on stderr: done/total, elapsed, ETA. Silent when quiet."""

    def __init__(self, total: int, label: str = "", quiet: bool = False, every: float = 2.0):
        self.total = max(int(total), 1)
        self.label, self.quiet, self.every = label, quiet, every
        self.done = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        if self.quiet or (now - self._last < self.every and self.done < self.total):
            return
        self._last = now
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(
            f"[{self.label}] {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
            f"elapsed {_fmt(elapsed)} eta {_fmt(eta)} {note}",
            file=sys.stderr,
            flush=True,
        )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def require_matplotlib(args: argparse.Namespace | None = None) -> None:
    """Stop before any work, in one line, when the plots cannot be drawn."""
    if args is not None and getattr(args, "no_plot", False):
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            f"morphkv: error: the benchmarks draw PNGs with matplotlib, which is not installed: "
            f"{BENCH_EXTRA} (or pass --no-plot where offered)"
        ) from None


def plt():
    """matplotlib.pyplot with a non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


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


def peak_memory() -> int:
    """Peak MLX memory in bytes."""
    import mlx.core as mx

    return int(mx.get_peak_memory())


def reset_peak_memory() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()


def add_flags(parser: argparse.ArgumentParser, flags) -> None:
    """Add ``(flag, default, help[, choices])`` flags; the type follows the default (False: a
    switch; a list: comma separated; None: a string) and the help shows the default."""
    for flag, default, text, *choices in flags:
        kw: dict[str, Any] = {"default": default, "help": text}
        if default is False:
            kw = {"action": "store_true", "help": text}
        elif isinstance(default, list):
            kw["type"] = csv_ints if default and isinstance(default[0], int) else csv_strs
            kw["help"] += f" (default {','.join(map(str, default))})"
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


def load_model(name: str | None):
    """(model, tokenizer or None): the embedded model by default, ``random-tiny`` for tests."""
    if name == RANDOM_TINY:
        return tiny_llama(), None
    from ..model import load

    return load(name)


def tiny_llama(seed: int = 0, head_dim: int | None = None):
    """A tiny random-weight mlx_lm llama (no download), for tests and smoke runs; head_dim
    defaults to 16 (64 lets MLX quantize it in groups of 32/64)."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(
        ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=head_dim,
            rms_norm_eps=1e-5,
            vocab_size=256,
        )
    )
    mx.eval(model.parameters())
    return model


def greedy_tokens(model, caches, prompt, max_tokens: int, prefill_step_size: int = 2048):
    """Greedy token ids from mlx_lm's own ``generate_step`` with the given caches."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(
        mx.array(prompt),
        model,
        prompt_cache=caches,
        prefill_step_size=prefill_step_size,
        sampler=make_sampler(0.0),
        max_tokens=max_tokens,
    )
    return [int(token) for token, _ in steps]


def stop_process(proc, timeout: float = 20) -> int:
    """Stop a child by its process id: SIGTERM, then SIGKILL after ``timeout`` s. Its status."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    return proc.returncode
