"""Obviously-correct NumPy references of the eviction rules, one sequence and one head at a time.

Written straight from the README's rules, without the engine's ring buffers or slot reuse, so
the fast path can be held to it. Scores are sums of float64 values (or of float16 rows, which
sum exactly), so the order of summation never matters.
"""

from __future__ import annotations

import numpy as np

TIE_RTOL = 1e-9


def _softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.nan_to_num(logits, nan=-np.inf, posinf=np.finfo(np.float64).max)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(logits - peak)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def reference_kept(
    keys: np.ndarray,
    method: str,
    budget: int,
    n_sink: int,
    window: int,
    fusion: str = "mean",
    queries: np.ndarray | None = None,
    recent: int | None = None,
    scale: float | None = None,
    values: np.ndarray | None = None,
    peak: float = 0.0,
    decay: float = 1.0,
    pool: int = 1,
    block: int = 1,
    margins: list | None = None,
) -> list[int]:
    """Positions kept after feeding ``keys`` (T, D) one token at a time.

    ``queries`` (T, G, D) are real queries (G per KV head): then token t's attention row is
    fixed when t arrives (softmax over the tokens stored then, summed over the G heads, rounded
    to float16) and the rules read those rows. By default the keys stand in for the queries
    (G = 1) and every row is recomputed over the tokens stored now. ``recent`` protects the
    last ``recent`` tokens instead of the last ``window``; with ``values`` (T, Dv) the
    attention scores are multiplied by the values' norms (float32, stored as float16).

    Persistence: every stored token keeps a peak, ``peak_p = max(decay * peak_p, attention of
    the newest token to p)`` after each token (0 before its first row). Method ``peak`` ranks by
    it; ``morphkv``/``tova`` with ``peak`` = lambda > 0 rank by ``max(window score, lambda *
    peak_p)``. ``pool`` > 1: before the value weighting, each unprotected token's score becomes
    the largest among the ``pool`` stored tokens centred on it in position order, protected
    tokens counting 0.

    ``block``: when a token arrives with ``budget`` tokens stored, the ``block`` lowest-scoring
    unprotected tokens are evicted at once (successive lowest picks over the same scores), and
    the next ``block - 1`` tokens are only stored.

    ``margins``: a list that gets, at every eviction, how far the decision is from a tie: the
    relative gap between the lowest score kept among the candidates and the highest evicted
    (<= 0: a tie decided by position; small: a near-tie another precision may break apart).
    """
    norms = None
    if values is not None:
        v = np.asarray(values, np.float32)
        norms = np.minimum(np.nan_to_num(np.sqrt((v * v).sum(axis=-1))), 65504.0)
        norms = norms.astype(np.float16).astype(np.float64)  # stored as float16
    keys = np.asarray(keys, np.float64)
    T, D = keys.shape
    real = queries is not None
    queries = keys[:, None, :] if queries is None else np.asarray(queries, np.float64)
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    recent = window if recent is None else recent
    if method == "sliding_window":
        n_sink = 0
    stored: list[int] = []
    h2o: dict[int, float] = {}
    peaks: dict[int, float] = {}
    rows: dict[int, dict[int, float]] = {}  # real queries: token -> {position: probability}
    for t in range(T):
        stored.append(t)
        K = keys[stored]
        if real:
            probs = _softmax(queries[t] @ K.T * scale).sum(axis=0).astype(np.float16)
            rows[t] = dict(zip(stored, probs.astype(np.float64), strict=True))
        if method == "h2o":
            h2o[t] = 0.0
            probs = _softmax(queries[t] @ K.T * scale).sum(axis=0)
            for p in stored:
                h2o[p] += rows[t][p] if real else probs[stored.index(p)]
        if method == "peak" or peak > 0:
            probs = _softmax(queries[t] @ K.T * scale).sum(axis=0)
            peaks[t] = 0.0
            for i, p in enumerate(stored):
                seen = rows[t][p] if real else probs[i]
                peaks[p] = max(peaks[p] * decay if decay != 1.0 else peaks[p], seen)
        if method == "full" or len(stored) <= budget:
            continue
        if method in ("sliding_window", "streaming_llm"):
            scores = np.array(stored, np.float64)
        elif method == "h2o":
            scores = np.array([h2o[p] for p in stored])
        elif method in ("tova", "morphkv"):
            recent_rows = [t] if method == "tova" else list(range(t - window + 1, t + 1))
            if real:
                probs = np.array([[rows[w].get(p, 0.0) for p in stored] for w in recent_rows])
            else:
                probs = _softmax(queries[recent_rows] @ K.T * scale).sum(axis=1)
            scores = probs.max(axis=0) if fusion == "max" else probs.sum(axis=0) / len(probs)
            if peak > 0:
                scores = np.maximum(scores, peak * np.array([peaks[p] for p in stored]))
        elif method == "peak":
            scores = np.array([peaks[p] for p in stored])
        else:
            raise ValueError(method)
        guarded = [p < n_sink or p > t - recent for p in stored]
        if pool > 1:  # stored is in position order
            base = [0.0 if g else s for s, g in zip(scores, guarded, strict=True)]
            h = pool // 2
            scores = np.array([max(base[max(0, i - h) : i + h + 1]) for i in range(len(base))])
        if norms is not None:
            scores = scores * norms[stored]
        candidates = [
            (s, p) for s, p in zip(scores, stored, strict=True) if p >= n_sink and p <= t - recent
        ]
        start = list(candidates)
        for _ in range(block):
            low = min(s for s, _ in candidates)
            victim = min(p for s, p in candidates if s <= low + TIE_RTOL * abs(low))
            candidates = [(s, p) for s, p in candidates if p != victim]
            stored.remove(victim)
            h2o.pop(victim, None)
            peaks.pop(victim, None)
        if margins is not None:
            gone = {p for _, p in start} - {p for _, p in candidates}
            worst = max(s for s, p in start if p in gone)
            rest = [s for s, p in candidates]
            if rest:
                best = min(rest)
                margins.append((best - worst) / max(abs(best), abs(worst), 1e-300))
    return stored
