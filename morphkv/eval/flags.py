"""Command-line flag helpers shared by the benchmark commands."""

from __future__ import annotations

import argparse
from typing import Any


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
