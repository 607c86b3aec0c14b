"""``pin_repeats``: a chat template's tokens, sent again every turn, are not pinned again.

``pin="prompt"`` pins every prompt token, the chat template's with the user's words. A template
repeats itself: its role markers every turn, and where each turn is templated alone (mlx_lm.chat's
loop) Qwen2.5's default system prompt too. After 10 such turns 41% of the memory preset's slots
held template tokens (``docs/figures/pin_kept_probe.py``). With ``pin_repeats=n`` a prompt token
that lies in a run of ``n`` tokens an earlier prompt of the same row already held is not pinned:
the first system prompt and the user's words stay pinned, the repeats rank as any unpinned
token. A word the user says again stays pinned where it was said first.

What a row has heard is the 32-bit hashes of its prompts' ``n``-token runs, at most ``HEARD``,
the most recently heard last (a template heard every turn stays). The model's forward pass reads
the token ids (``morphkv.mlxlm.forward``); the row's first morphkv cache holds them with its pins
(``Pins.heard``: copied, merged, extracted and saved with them).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

HEARD = 256  # hashes a row keeps (1 KiB)
MAX_RUN = 16  # the longest run length pin_repeats accepts
_MUL = np.uint64(0x100000001B3)  # FNV-1a's 64-bit prime


def grams(tokens: np.ndarray, n: int) -> np.ndarray:
    """uint32 hashes of every run of ``n`` consecutive tokens (``len(tokens) - n + 1``)."""
    tokens = np.asarray(tokens).astype(np.uint64).ravel()
    if tokens.size < n:
        return np.zeros(0, np.uint32)
    window = sliding_window_view(tokens, n)
    h = np.full(len(window), 0xCBF29CE484222325, np.uint64)
    for k in range(n):  # arrays wrap modulo 2**64 (no overflow warning)
        h = (h ^ (window[:, k] + np.uint64(1))) * _MUL
    return (h ^ (h >> np.uint64(32))).astype(np.uint32)


def repeated(tokens: np.ndarray, heard: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(which tokens lie in a run of ``n`` already ``heard``, the runs' hashes to remember)."""
    g = grams(tokens, n)
    if not g.size:
        return np.zeros(np.asarray(tokens).size, np.bool_), g
    hit = np.isin(g, heard).astype(np.int32)
    covered = np.convolve(hit, np.ones(n, np.int32))[: np.asarray(tokens).size] > 0
    return covered, g


def remember(heard: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``heard`` with the hashes ``g`` added as the most recent, the oldest past ``HEARD`` gone."""
    if not g.size:
        return heard
    _, first = np.unique(g, return_index=True)
    g = g[np.sort(first)]
    return np.concatenate([heard[~np.isin(heard, g)], g])[-HEARD:]


def check_heard(values) -> np.ndarray:
    """A saved row's heard hashes, checked: at most ``HEARD`` integers in [0, 2**32)."""
    ok = isinstance(values, list) and len(values) <= HEARD and all(
        type(x) is int and 0 <= x < 1 << 32 for x in values)
    if not ok:
        raise ValueError(f"saved cache: 'heard' must be at most {HEARD} integers in "
                         f"[0, 2**32): {str(values)[:80]}")
    return np.array(values, np.uint32)
