"""Small helpers shared by the evidence benchmarks (progress, output, tables, entry points)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class Progress:
    """A one-line progress meter on stderr: done/total, elapsed, ETA. Silent when quiet."""

    def __init__(self, total: int, label: str = "", quiet: bool = False, every: float = 2.0):
        self.total = max(int(total), 1)
        self.label = label
        self.quiet = quiet
        self.every = every
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
        msg = (
            f"[{self.label}] {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
            f"elapsed {_fmt(elapsed)} eta {_fmt(eta)} {note}"
        )
        print(msg, file=sys.stderr, flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def track(items: Iterable, total: int, label: str, quiet: bool = False) -> Iterator:
    bar = Progress(total, label, quiet)
    for item in items:
        yield item
        bar.update()


def out_dir(args: argparse.Namespace, name: str) -> Path:
    path = Path(args.out) if getattr(args, "out", None) else Path("results") / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment() -> dict:
    """Versions and machine facts stored with every result."""
    import mlx.core as mx

    try:
        import mlx_lm

        mlx_lm_version = getattr(mlx_lm, "__version__", "?")
    except Exception:  # pragma: no cover
        mlx_lm_version = "?"
    return {
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_lm": mlx_lm_version,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj, indent=1, sort_keys=False, default=_jsonable) + "\n")
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


def plt():
    """matplotlib.pyplot with a non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def peak_memory() -> int:
    """Peak MLX memory in bytes (0 when unavailable)."""
    import mlx.core as mx

    for fn in ("get_peak_memory",):
        f = getattr(mx, fn, None) or getattr(getattr(mx, "metal", None), fn, None)
        if f is not None:
            try:
                return int(f())
            except Exception:  # pragma: no cover
                pass
    return 0


def reset_peak_memory() -> None:
    import mlx.core as mx

    f = getattr(mx, "reset_peak_memory", None)
    if f is not None:
        try:
            f()
        except Exception:  # pragma: no cover
            pass


def max_rss() -> int:
    """Peak resident set size of this process in bytes."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # pragma: no cover
        return 0


def main(add_arguments, run, description: str, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def csv_strs(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def tiny_llama(seed: int = 0):
    """A tiny random-weight mlx_lm llama (no download), for tests and smoke runs."""
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
