"""Obviously-correct NumPy references of the eviction rules, one sequence and one head at a time.

Written straight from the README's rules, without the engine's ring buffers or slot reuse, so
the fast path can be held to it. Scores are sums of float64 values (or of float16 rows, which
sum exactly), so the order of summation never matters. Each rule's score is one function in
``SCORERS`` (a new rule adds its own); the tests run every rule of ``morphkv.METHODS`` that has
one.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

TIE_RTOL = 1e-9
FLOOR = float(np.finfo(np.float32).tiny)  # float32's smallest normal: 1.2e-38


def _softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.nan_to_num(logits, nan=-np.inf, posinf=np.finfo(np.float64).max)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(logits - peak)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def _recency(s) -> np.ndarray:
    return np.array(s.stored, np.float64)


def _h2o(s) -> np.ndarray:
    return np.array([s.h2o[p] for p in s.stored])


def _peak(s) -> np.ndarray:
    return np.array([s.peaks[p] for p in s.stored])


def _window(s, newest: bool = False) -> np.ndarray:
    """morphkv (tova: the newest row alone), with the peak fused in when ``peak`` > 0."""
    t, stored = s.t, s.stored
    recent_rows = [t] if newest else list(range(t - s.window + 1, t + 1))
    if s.real:
        probs = np.array([[s.rows[w].get(p, 0.0) for p in stored] for w in recent_rows])
    else:
        probs = _softmax(s.queries[recent_rows] @ s.K.T * s.scale).sum(axis=1)
    scores = probs.max(axis=0) if s.fusion == "max" else probs.sum(axis=0) / len(probs)
    if s.peak > 0:
        scores = np.maximum(scores, s.peak * _peak(s))
    return scores


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))
    return x / np.where(norm > 0, norm, 1.0)


def _keydiff(s) -> np.ndarray:
    """1 - cos(key, mean of the stored keys' unit vectors), one key at a time."""
    units = [_unit(k) for k in s.K]
    anchor = _unit(sum(units) / len(units))
    return np.array([max(1.0 - float(u @ anchor), 0.0) for u in units])


SCORERS = {  # method -> its score of the stored tokens (None: never evicts)
    "full": None,
    "sliding_window": _recency,
    "streaming_llm": _recency,
    "h2o": _h2o,
    "tova": lambda s: _window(s, newest=True),
    "morphkv": _window,
    "peak": _peak,
    "keydiff": _keydiff,
}


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
    pinned: frozenset = frozenset(),
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
    A decision between two scores both under float32's smallest normal (``FLOOR``, 1.2e-38) is
    a tie (margin 0): the engine's float32 exps flush such attention to 0, so two keys a query
    all but ignores (probabilities 1e-42 and 2e-41) tie there and the oldest goes.

    ``pinned``: positions evicted last: each pick is among the unpinned candidates while any
    remain, else among the pinned ones (margins: within the group the picks came from).
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
        # the running scores every rule may read: h2o's sum and the (decaying) peak
        probs = _softmax(queries[t] @ K.T * scale).sum(axis=0)
        h2o[t] = peaks[t] = 0.0
        for i, p in enumerate(stored):
            seen = rows[t][p] if real else probs[i]
            h2o[p] += seen
            peaks[p] = max(peaks[p] * decay if decay != 1.0 else peaks[p], seen)
        if SCORERS[method] is None or len(stored) <= budget:
            continue
        scores = SCORERS[method](SimpleNamespace(**locals()))
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
            group = [c for c in candidates if c[1] not in pinned] or candidates
            low = min(s for s, _ in group)
            victim = min(p for s, p in group if s <= low + TIE_RTOL * abs(low))
            candidates = [(s, p) for s, p in candidates if p != victim]
            stored.remove(victim)
            h2o.pop(victim, None)
            peaks.pop(victim, None)
        if margins is not None:
            gone = {p for _, p in start} - {p for _, p in candidates}
            last = max(gone, key=lambda p: p in pinned)  # the group the last pick came from
            group = [(s, p) for s, p in start if (p in pinned) == (last in pinned)]
            worst = max(s for s, p in group if p in gone)
            rest = [s for s, p in candidates if (p in pinned) == (last in pinned)]
            if rest:
                best = min(rest)
                size = max(abs(best), abs(worst))
                margins.append(0.0 if size < FLOOR else (best - worst) / size)
    return stored
