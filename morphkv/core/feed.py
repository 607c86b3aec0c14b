"""What every morphkv cache shares before its engine runs: the config, the pins, checked input.

``MorphKVCache`` (one sequence, or a batch of rows that advance together), ``DeviceBatchCache``
and the row-wise ``BatchMorphKVCache`` (``morphkv.core.batch``) keep, one entry per engine (a
batch row): ``seen`` (tokens taken: the RoPE position), ``stored`` (slots holding its tokens),
``lead`` (left-padding columns still to skip) and, during a right-padded prompt,
``_remaining`` (real tokens left); the pins and the ``pin="prompt"`` policy
(``pin_arrived``); the check that refuses malformed input before anything changes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import storage
from .pins import Pins, true_runs
from .queries import hooks_attached
from .rules import make_rule

PIN_AFTER = 2  # pin="prompt": one-token updates after a multi-token one that are pinned too


class Feed:
    """Counters, pins and input checks (see the module docstring)."""

    prompt_piece = False  # set by ``mlxlm.forward`` while a one-column piece of a prompt runs
    pin_skip = None  # pin_repeats, set by ``mlxlm.forward``: per engine, columns not to pin

    def init_feed(self, config, engines: int, per: int | None) -> None:
        """``engines`` engines of ``per`` batch rows each (None: known at the first update)."""
        self.config = config
        self.evicts = make_rule(config).evicts
        self.per = per
        self.engines: list = [None] * engines
        # Python lists, not arrays: a decode step touches each once (NumPy costs ~1 us a call)
        self.seen, self.stored, self.lead = ([0] * engines for _ in range(3))
        self._remaining: list[int] | None = None
        self._scale: float | None = None
        self._seal = None
        self.keys = self.values = None
        self.pins = Pins()  # positions evicted last (core.pins; the single cache's ``pin``)
        self.pin_prompts = config.pin == "prompt"  # the policy (KVCacheConfig.pin)
        self.pin_next = [0] * engines  # per engine: one-token updates still to pin (PIN_AFTER)

    @property
    def needs_queries(self) -> bool:
        return self.config.scoring == "attention"

    def pins_of(self, i: int) -> Pins:
        """The pins engine i ranks with (the single cache: one set for all its rows)."""
        return self.pins

    def pin_arrived(self, firsts, counts, C: int) -> None:
        """``pin="prompt"``: for an update of ``C`` columns in which engine i takes
        ``counts[i]`` tokens from position ``firsts[i]`` on, pin them if the update is a
        multi-token one, or one of the ``PIN_AFTER`` one-token updates right after one: mlx_lm
        feeds a prompt's last token alone, and its prefill can end in a one-token chunk (so a
        turn's first generated token is pinned too, at times). Called before the update is
        stored (positions may be pinned ahead), so the pins are there before any eviction
        that could take them. The callers skip it for a plain decode step (no row due)."""
        prompt = self.prompt(C)
        for i, n in enumerate(counts):
            if n and prompt and self.config.pin_replies:
                self.pin_reply(i, int(firsts[i]))
            if n and (prompt or self.pin_next[i]):
                for a, b in self.pinned_runs(i, int(n), C):
                    self.pin_range(i, int(firsts[i]) + a, int(firsts[i]) + b)  # the cache's
            if n:
                self.pin_next[i] = PIN_AFTER if prompt else max(0, self.pin_next[i] - 1)

    def pinned_runs(self, i: int, n: int, C: int) -> list[tuple[int, int]]:
        """[a, b) offsets among engine i's ``n`` tokens of this update that are pinned: all of
        them, or those ``pin_skip`` (``pin_repeats``) leaves."""
        skip = None if self.pin_skip is None else self.pin_skip[i]
        if skip is None:
            return [(0, n)]
        start = int(self.spans(C)[0][i])
        begin, end = true_runs(~skip[start : start + n])
        return list(zip(begin.tolist(), end.tolist(), strict=True))

    def pinned_count(self, i: int, n: int, C: int) -> int:
        """How many of engine i's ``n`` tokens of this update ``pin_arrived`` pins."""
        return sum(b - a for a, b in self.pinned_runs(i, n, C))

    def pin_reply(self, i: int, first: int) -> None:
        """``pin_replies``: a prompt arrives at ``first`` in row i; the row's tokens since its
        last pinned range (the model's reply) are pinned if at most ``pin_replies``. Read from
        the pins alone: merged, extracted, saved and loaded rows keep the policy. ``pin_fit``:
        only while the pinned positions, the reply with them, fit in the budget."""
        n = self.reply_due(i, first)
        if n:
            self.pin_range(i, first - n, first)

    def prompt(self, C: int) -> bool:
        """Is an update of ``C`` columns a prompt's (pinned)? A multi-token one, or a one-column
        piece of a prompt the model's forward pass cut (``mlxlm.forward``: ``prompt_piece``)."""
        return C > 1 or self.prompt_piece

    def reply_due(self, i: int, first: int) -> int:
        """How many tokens of row i's reply a prompt arriving at ``first`` pins
        (``pin_reply``; 0: none)."""
        if not (self.pin_prompts and self.config.pin_replies):
            return 0
        pins = self.pins_of(i)
        ends = pins.ends[pins.ends <= first]
        n = first - int(ends.max()) if ends.size else 0
        fits = not (self.config.pin_fit and len(pins) + n > self.config.budget)
        return n if 0 < n <= self.config.pin_replies and fits else 0

    def set_scale(self, scale: float) -> None:
        if scale != self._scale:
            self._scale = scale
            for e in self.engines:
                if e is not None:
                    e.scale = scale

    def spans(self, C: int) -> tuple[np.ndarray, np.ndarray]:
        """(first column, count) of each engine's real tokens in a chunk of C columns."""
        starts = np.minimum(np.array(self.lead, np.int64), C)
        counts = C - starts
        if self._remaining is not None:
            counts = np.clip(np.minimum(counts, self._remaining), 0, None)
        return starts, counts

    def is_trimmable(self) -> bool:
        """False: eviction is irreversible, so tokens cannot be taken back."""
        return False

    def trim(self, n: int) -> int:
        return 0

    def check(self, keys: mx.array, values: mx.array) -> None:
        """Reject malformed input before anything is changed (``storage.accepted``)."""
        rows = None if self.per is None else self.per * len(self.engines)
        self._seal = storage.accepted(keys, values, self.config, self._seal, self.keys,
                                      self.values, rows)
        if self.per is None and keys.shape[2]:  # the single cache: its batch, from now on
            self.per = keys.shape[0]

    def need_hooks(self, C: int) -> None:
        if C and self.needs_queries and not hooks_attached():
            raise RuntimeError(
                "scoring='attention' ranks tokens by the model's real queries, which reach the "
                "cache only through morphkv.attach(model, config): call it before generating")
