"""The engine's host fast path: its state handed to the compiled kernels (``kernels``).

Used for a rule ``fused_code`` knows, with real-query rows or none, on the host; the
engine's generic path (the rule's ``score()`` in NumPy) runs everything else. Both read and
write the same arrays, so an engine can move between them (the device path, save/load).
"""

from __future__ import annotations

import numpy as np

from . import kernels, rules


def fused_code(rule) -> int | None:
    """Kernel code of ``rule``, or None when only its ``score()`` knows it. Exact class
    checks: a subclass that changes a method is not mistaken for its parent."""
    kind = type(rule)
    if kind is rules.Recency:
        return kernels.RECENCY
    if kind is rules.WindowAttention:
        if rule.newest_only:
            return kernels.NEWEST
        return kernels.MAX if rule.fusion == "max" else kernels.MEAN
    if kind is rules.Cumulative:
        return kernels.CUMULATIVE
    if kind is rules.Peak:
        return kernels.PEAK
    return None


def peak_of(rule) -> tuple[float, float]:
    """(lambda, decay) of a rule's peak-attention persistence: the fusion weight of
    ``max(window score, lambda * peak)`` (0: none) and the peak's decay per token."""
    if type(rule) is rules.WindowAttention:
        return rule.peak, rule.decay
    if type(rule) is rules.Peak:
        return 0.0, rule.decay
    return 0.0, 1.0


def kernel_view(a: np.ndarray) -> np.ndarray:
    """float16 arrays as their uint16 bit patterns (numba has no float16 on the host)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


class Fused:
    """Kernel arguments that do not change between steps, per engine."""

    def __init__(self, engine, code: int) -> None:
        self.engine = engine
        self.code = code
        self.peak, self.decay = peak_of(engine.rule)
        rows = engine.rows
        self.no_scores = np.zeros((rows, 1))
        self.no_norms = np.zeros((rows, 1), np.uint16)
        self.no_ring = np.zeros((rows, 1, 1), np.uint16)
        self.no_queries = np.zeros((rows, 0, 1), np.float32)

    def _state(self):
        e = self.engine
        ring = self.no_ring if e.attention is None else e.attention.ring.view(np.uint16)
        scores = self.no_scores if e.accumulated is None else e.accumulated
        norms = self.no_norms if e.value_norms is None else e.value_norms.view(np.uint16)
        return ring, scores, norms

    def decode(self, queries, stored, norms) -> None:
        """One token (see ``Engine.feed``): queries (rows, 1, G, D) or None, stored keys
        (rows, N, D), norms (rows, 1) float16 or None."""
        e, c = self.engine, self.engine.config
        slot = e._place()
        if e.attention is not None:
            e.head = (e.head + 1) % c.window
            q, keys = kernel_view(queries[:, 0]), kernel_view(stored)
        else:
            q, keys = self.no_queries, self.no_queries
        ring, scores, norms_state = self._state()
        weighted = norms is not None
        new_norms = norms[:, 0].view(np.uint16) if weighted else self.no_norms[:, 0]
        dead = np.empty(e.rows, np.int32)
        over, e.finite = kernels.decode_step(
            self.code, q, keys, e.scale, e.finite, e.top, e.positions, ring, scores,
            norms_state, new_norms, weighted, slot, e.slots, e.seen, e.head, e.rule.evicts,
            c.budget, c.n_sink, c.recent, dead, self.peak, self.decay,
        )
        e.seen += 1
        e.dead = dead if over else None

    def chunk(self, keys, queries, stored, evicted, norms, block: int) -> None:
        """A chunk of C tokens (see ``Engine._feed_chunk``): logits from one BLAS matmul per
        block of queries, the token-by-token steps compiled."""
        e, c = self.engine, self.engine.config
        R, C, D = keys.shape
        final = e.slots if e.dead is not None else e.slots + C
        e._grow_like_steps(min(final, c.budget + 1) if e.rule.evicts else final)
        attention = e.attention is not None
        slot_keys = np.zeros((R, 0, D))
        if attention:
            slot_keys = np.zeros((R, max(e.capacity, e.slots + C), D))
            slot_keys[:, : e.slots] = stored[:, : e.slots]
            keys = keys.astype(np.float64)
        else:
            keys, queries = slot_keys, slot_keys[..., None]
        needed = e._first_row_needed(C)
        ring, scores, norms_state = self._state()
        weighted = norms is not None
        new_norms = norms.view(np.uint16) if weighted else self.no_norms
        dead = np.zeros(R, np.int32) if e.dead is None else e.dead.astype(np.int32)
        has_dead = e.dead is not None
        slots, seen, head = e.slots, e.seen, e.head
        G = queries.shape[2]
        window_sum = np.zeros((R, 0))
        if self.code == kernels.MEAN and attention:  # exact: float16 values summed in float64
            window_sum = e.attention.ring.sum(axis=1, dtype=np.float64)
        for start in range(0, C, block):
            end = min(C, start + block)
            n0 = slots
            if attention and end > needed:
                columns = np.concatenate([slot_keys[:, :n0], keys[:, start:end]], axis=1)
                flat = np.ascontiguousarray(e._logits(queries[:, start:end], columns))
                slot_column = np.zeros((R, e.capacity + end - start), np.int64)
                slot_column[:, :n0] = np.arange(n0)
            else:
                flat = np.zeros((R, end - start, G if attention else 0, 0))
                slot_column = np.zeros((R, e.capacity + end - start), np.int64)
            slots, seen, head, has_dead = kernels.chunk_block(
                self.code, flat, slot_column, n0, start, needed, keys, slot_keys, e.finite,
                e.top, e.positions, ring, scores, norms_state, new_norms, weighted, dead,
                has_dead, slots, seen, head, c.window, e.rule.evicts, c.budget, c.n_sink,
                c.recent, evicted, window_sum, self.peak, self.decay,
            )
        e.slots, e.seen, e.head = slots, seen, head
        e.dead = dead if has_dead else None
