"""Plots: a few chart shapes every benchmark draws its PNG with (matplotlib, Agg backend)."""

from __future__ import annotations

import argparse

import numpy as np


def require_matplotlib(args: argparse.Namespace) -> None:
    """Stop before any work, in one line, when the plots cannot be drawn."""
    if getattr(args, "no_plot", False):
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "morphkv: error: the benchmarks draw PNGs with matplotlib, which is not installed: "
            "pip install -e '.[bench]' (or pass --no-plot where offered)"
        ) from None


def plt():
    """matplotlib.pyplot with a non-interactive backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save(fig, path, dpi: int = 80) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt().close(fig)
    return str(path)


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], title: str) -> None:
    """Bars side by side: one group per x label, one bar per series."""
    x = np.arange(len(groups))
    width = 0.8 / max(len(series), 1)
    for a, (name, vals) in enumerate(series.items()):
        ax.bar(x + (a - len(series) / 2 + 0.5) * width, vals, width, label=name)
    ax.set_xticks(x, groups, rotation=45, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)


def panels(n: int, width: float = 5.5, height: float = 4.5):
    """(figure, axes: one row of ``n`` panels, indexed ``axes[0][i]``)."""
    return plt().subplots(1, n, figsize=(width * n, height), squeeze=False)
