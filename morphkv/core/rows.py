"""Attention rows: the per-slot attention that attention rules (morphkv, tova, h2o) read.

Both kinds below are fed one token at a time with the new token's logits against every stored
slot (``logits``: (rows, groups, slots), already scaled; the new token is in ``slot``) and keep
a ring of the last ``window`` tokens' rows. Neither keeps a copy of the stored keys.

* ``CausalRows`` (real queries, the paper's estimator): row t is the attention the model's
  queries at step t paid to the tokens stored then — softmax over those tokens, summed over the
  query heads that share the KV head — rounded to float16 (the state is ``window`` float16
  numbers per slot). A row is never revised: a token arriving later is not in it (causal), and
  a slot reused by a newer token keeps stale entries only in rows older than that token, which
  leave the ring before the token stops being protected (``recent >= window``). Sums of float16
  values are exact in float64, so scores do not depend on summation order.
* ``ProxyRows`` (keys as proxy queries): row w is the softmax of stored key w against every
  stored slot, revised as slots change: the ring keeps float64 numerators with their shifts and
  sums, and each step adds one row and one column. The column (the window's keys against the
  new key) is read off the new row, since k_w . k_new = k_new . k_w; the window's keys are the
  stored keys of the last ``window`` tokens, located by ``ring_slot``.
"""

from __future__ import annotations

import numpy as np


def _clean(xp, logits, top: float):
    """NaN logits become -inf (zero attention); +inf becomes the largest finite float."""
    return xp.nan_to_num(logits, nan=-np.inf, posinf=top, neginf=-np.inf)


def _peak(xp, logits, finite: bool):
    """Row max (0 for a row without a finite logit)."""
    peak = logits.max(axis=-1)
    return peak if finite else xp.where(xp.isfinite(peak), peak, 0.0)


def _nonzero(xp, total, finite: bool):
    """Sums of numerators; a row without a finite logit (all zero) divides by 1."""
    return total if finite else xp.where(total > 0, total, 1.0)


class CausalRows:
    ARRAYS = ("ring",)

    def __init__(self, engine) -> None:
        self.engine = engine
        self.ring = engine.xp.zeros((engine.rows, engine.config.window, 0), dtype=self.dtype)

    @property
    def dtype(self):
        return self.engine.xp.float16

    def widen(self, pad: int) -> None:
        xp = self.engine.xp
        self.ring = xp.pad(self.ring, [(0, 0), (0, 0), (0, pad)])

    def add(self, logits, slot, head: int) -> None:
        """Row of the new token (its slot needs no special care: it is in ``logits``)."""
        e, xp = self.engine, self.engine.xp
        if not e.finite:
            logits = _clean(xp, logits, e.top)
        weights = xp.exp(logits - _peak(xp, logits, e.finite)[..., None])  # (rows, G, n)
        total = _nonzero(xp, weights.sum(axis=-1), e.finite)  # (rows, G)
        row = ((1.0 / total)[:, None, :] @ weights)[:, 0]  # probabilities summed over G
        self.ring[:, head, : logits.shape[-1]] = row.astype(self.dtype)

    def window_probs(self):
        """(rows, window, slots) attention rows of the last ``window`` tokens."""
        return self.ring[..., : self.engine.slots]

    def window_mean(self):
        """(rows, slots) mean of the window's rows (float16 sums are exact in float64)."""
        e, probs = self.engine, self.window_probs()
        if e.xp is np:
            return probs.sum(axis=1, dtype=e.float) / probs.shape[1]
        return probs.astype(e.float).sum(axis=1) / probs.shape[1]

    def newest_probs(self):
        """(rows, slots) attention of the newest token."""
        return self.ring[:, self.engine.head, : self.engine.slots]


class ProxyRows:
    ARRAYS = ("ring_weights", "ring_shift", "ring_total", "ring_slot")

    def __init__(self, engine) -> None:
        self.engine = engine
        xp, R, W = engine.xp, engine.rows, engine.config.window
        self.ring_weights = xp.zeros((R, W, 0), dtype=engine.float)
        self.ring_shift = xp.zeros((R, W), dtype=engine.float)
        self.ring_total = xp.zeros((R, W), dtype=engine.float)
        self.ring_slot = xp.zeros((R, W), dtype=engine.int)

    def widen(self, pad: int) -> None:
        self.ring_weights = self.engine.xp.pad(self.ring_weights, [(0, 0), (0, 0), (0, pad)])

    def add(self, logits, slot, head: int) -> None:
        """``logits`` (rows, 1, slots): the new key against every stored key."""
        e, xp = self.engine, self.engine.xp
        logits = logits[:, 0]
        if not e.finite:
            logits = _clean(xp, logits, e.top)
        r, n = e.row_index, logits.shape[-1]
        # the column: the window's keys against the new key, replacing the slot's old column
        flat = r[:, None] * n + self.ring_slot
        column = xp.take(logits.reshape(-1), flat) - self.ring_shift
        column = xp.exp(xp.minimum(column, e.max_exponent))
        self.ring_total = self.ring_total - self.ring_weights[r, :, slot] + column
        self.ring_weights[r, :, slot] = column
        # the row: the new key against every stored key, replacing the oldest row
        self.ring_slot[:, head] = slot
        self.ring_shift[:, head] = shift = _peak(xp, logits, e.finite)
        self.ring_weights[:, head, :n] = weights = xp.exp(logits - shift[:, None])
        self.ring_total[:, head] = weights.sum(axis=-1)

    def _window(self):
        """Numerators (rows, window, slots) and sums (rows, window) of the valid ring rows."""
        e, xp = self.engine, self.engine.xp
        weights, total = self.ring_weights[..., : e.slots], self.ring_total
        rows = min(e.seen, e.config.window)
        if rows < e.config.window:  # the ring is not full yet
            ring = xp.array([(e.head - i) % e.config.window for i in range(rows)])
            weights, total = weights[:, ring], total[:, ring]
        return weights, _nonzero(xp, total, e.finite)

    def window_probs(self):
        weights, total = self._window()
        return weights / total[..., None]

    def window_mean(self):
        """(rows, slots) mean probability over the window: one matvec, no division of the
        whole ring."""
        weights, total = self._window()
        return ((1.0 / total)[:, None, :] @ weights)[:, 0] / total.shape[1]

    def newest_probs(self):
        e = self.engine
        total = _nonzero(e.xp, self.ring_total[:, e.head, None], e.finite)
        return self.ring_weights[:, e.head, : e.slots] / total
