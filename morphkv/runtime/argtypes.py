"""Command-line value types: numbers with a stated range, model references, one-line errors.

Every type rejects a bad value inside argument parsing (``argparse.ArgumentTypeError``), so the
user sees one line naming the flag they typed and the command exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path

HF_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class UsageError(ValueError):
    """A bad command-line value found after parsing (one line on stderr, exit status 2)."""


@dataclass(frozen=True)
class Number:
    """An int or float within ``[lo, hi]`` (``lo_open`` / ``hi_open`` exclude the bound)."""

    kind: type = int
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    @property
    def __name__(self) -> str:  # argparse names the type in some messages
        return "integer" if self.kind is int else "number"

    def describe(self) -> str:
        """The range in words, as stated in ``--help`` and in errors."""
        what = "an integer" if self.kind is int else "a number"
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return f"{what} in {'(' if self.lo_open else '['}{_num(lo)}, {_num(hi)}]"
        if lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {_num(lo)}"
        if hi is not None:
            return f"{what} <= {_num(hi)}"
        return what

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}")
        too_low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        too_high = self.hi is not None and value > self.hi
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def model_ref(text: str) -> str:
    """An existing file or directory, the name of an embedded model (``gemma3-270m``,
    ``qwen2.5-0.5b``), or a Hugging Face repo id (``owner/name``)."""
    from ..model import EMBEDDED_NAMES

    path = Path(text).expanduser()
    if path.exists():
        return str(path)
    if text.lower() in EMBEDDED_NAMES:
        return text.lower()
    looks_like_path = text.lower().endswith(".gguf") or text.startswith(("/", ".", "~"))
    if looks_like_path or not HF_REPO.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"no such file or directory: {text!r} (give a .gguf file, an mlx_lm model folder, "
            "gemma3-270m, qwen2.5-0.5b or a Hugging Face repo id such as "
            "mlx-community/SmolLM2-135M-Instruct)"
        )
    return text


def add_number(parser, *flags: str, kind: Number, default, help: str, **kw) -> None:
    """``parser.add_argument`` for a ranged number; the help states the range and default."""
    parser.add_argument(
        *flags, type=kind, default=default, help=f"{help} ({kind.describe()}; default %(default)s)",
        **kw,
    )


def flag_names(message: str, fields: dict[str, str]) -> str:
    """``message`` with each config field name replaced by the flag the user typed."""
    for field in sorted(fields, key=len, reverse=True):
        message = re.sub(rf"(?<![\w-]){re.escape(field)}(?![\w])", fields[field], message)
    return message
