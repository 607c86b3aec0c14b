"""Keys as proxy queries, one token at a time, on the MLX engine: one compiled step per token.

Once the storage is full (``budget + 1`` rows, an eviction due before every token), a token of
a window rule scored by keys as proxy queries (MorphKV's window, TOVA's newest key; the seed's
API: a cache used alone) costs one compiled call (``step``). The window's proxy attention is
kept as a matrix updated by one row in and one column in per token, never recomputed nor
rescaled (``ProxyState``): ``E`` (B, H, window, slots) holds ``exp((l - M) * scale)`` for the
unscaled logits ``l`` of the newest ``window`` keys (row ``p % window`` for the token at
position ``p``) against every stored key, ``M`` (B, H, window, 1) each row's maximum when it
was written (a later key's exp-logit may exceed 1: capped at e^``CAP``, far from float32's
overflow), ``S`` each row's sum in float32 (MLX's float64 is CPU-only: summed afresh when the
row is written, then plus the token's entry less the victim's, one rounding each, at most
``window - 1`` times; the victim scores lowest, so its entry is ~``window / slots`` of a
MorphKV row's sum at most, no cancellation, and TOVA reads only its newest row, fresh: a few
float32 ulps of drift); ``inv`` = 1 / (S * window), derived each step. MorphKV's mean score
of the slots is then one (1, window) x (window, slots) product a row. Per token: the victim is the
lowest (score, position) unprotected slot; the token's key and value take its slot (no row
moves: the storage stays ``budget + 1`` rows, slots out of position order as ever); the
token's logits against every stored key (one product) give its row (written over the row of
the token leaving the window) and, at the window's ``slots``, its column (written in the
victim's place). No pass over ``E`` but the score product: the step is ~20 small primitives,
and MLX's CPU backend pays ~3-5 us of dispatch per primitive (a budget-16 cache costs what a
budget-512 one does), so the step is as cheap as its primitive count. Stored keys that are
not float32 are mirrored in float32 (``kf``, (B, H, D, n): transposed, the token's row is a
plain product, which OpenBLAS packs faster; counted in the engine's bytes) so no step
converts the whole storage. Shapes are constant once full, so the compiled graph is traced
once per cache shape. Decisions are ``DeviceEngine.select``'s: the same scores up to float32
rounding (inside ``RTOL``), the same (score bits, position) keys to ``argmin``.
"""

from __future__ import annotations

import mlx.core as mx

from .rules import Tova, WindowAttention

TOP_BITS = mx.array(0xFFFFFFFF, mx.uint32)  # above every score's bits (NaN included)
SHIFT = mx.array(32, mx.uint64)
ABS = mx.array(0x7FFFFFFF, mx.uint32)  # a float32's bits but the sign
INF_BITS = mx.array(0x7F800000, mx.uint32)
ZERO = mx.array(0, mx.uint32)

_STEPS: dict = {}
_CONSTANTS: dict = {}  # (slots, window) -> the slot index, row indices and one-hot rows
E_DUMMY = mx.zeros((1,))  # the mirror's place when the stored keys are float32
CAP = 80.0  # the most an exp-logit grows above its row's first maximum (e^80: no overflow)


def fits(engine, config) -> bool:
    """Can this engine's tokens take the compiled proxy step? A MorphKV / TOVA window rule
    scored by keys as proxies, per token, no running score, value norms, pins, pooling or
    quantized storage."""
    static = engine.__dict__.get("_proxy_fits")
    if static is None:
        rule = engine.rule
        static = engine._proxy_fits = (
            not engine.real and engine.block == 1 and type(rule) in (WindowAttention, Tova)
            and not engine.running and engine.value_norms is None and config.kv_bits is None)
    return static and not engine.pins  # ``Pins.__bool__``: no sum


def bound_nbytes(engine) -> int:
    """Bytes ``ProxyState`` holds for ``engine`` once built (0 when it does not fit)."""
    if not fits(engine, engine.config):
        return 0
    R, W, cap = engine.rows, engine.config.window, engine.capacity
    D = engine.head_dim
    mirror = 0 if engine.key_bytes == 4 else R * cap * D * 4
    return mirror + 4 * (3 * R * W + R * W * cap)  # slots, M, S; E


class _Rows:
    """What a window rule reads (``rules.attention``), from the window's rows (R, W, n)."""

    xp, float = mx, mx.float32
    running = None

    def __init__(self, probs, newest) -> None:
        self.probs, self.newest = probs, newest

    def window_probs(self):
        return self.probs

    def window_mean(self):
        return self.probs.sum(axis=1) / self.probs.shape[1]

    def newest_probs(self):
        return mx.take_along_axis(self.probs, self.newest[..., None], axis=1)[:, 0]


def _scores(rule, E, inv, t):
    """The rule's scores (R, n) from the window's exp-logit rows ``E`` (B, H, W, n) and their
    sums' reciprocals ``inv`` = 1 / (sum * W) (B, H, W, 1)."""
    B, H, W, n = E.shape
    R = B * H
    if isinstance(rule, WindowAttention) and rule.window_rows == "all":  # MorphKV's window
        if rule.fusion == "mean":  # sum_w E[w] / (S[w] W): one (1, W) x (W, n) product a row
            return (inv.reshape(B, H, 1, W) @ E).reshape(R, n)
        if rule.fusion == "max":
            return (E * (inv * W)).max(axis=2).reshape(R, n)
    newest = mx.broadcast_to(mx.remainder(t - 1, W).astype(mx.int32), (R, 1))
    probs = (E * (inv * W)).reshape(R, W, n)
    return rule.score(_Rows(probs, newest)).astype(mx.float32)


def _step_fn(rule, mirrored: bool, n_sink: int, recent: int, scale: float):
    """The compiled step for ``rule`` and these constants (traced per shape)."""
    key = (rule, mirrored, n_sink, recent, scale)
    if key not in _STEPS:

        def step(K, V, kf, pos, slots, E, M, S, k_new, v_new, t, w, mine, cols):
            B, H, n, D = K.shape
            W = E.shape[2]
            inv = 1.0 / (S * W)
            # the victim: the lowest (score bits, position) unprotected slot; NaN ranks as +inf
            bits = _scores(rule, E, inv, t).view(mx.uint32)
            nan = (bits & ABS) > INF_BITS
            bits = mx.where(nan, INF_BITS, mx.where(bits > ABS, ZERO, bits))  # -x: 0
            protected = (pos < n_sink) | (pos > t - 1 - recent)
            bits = mx.where(protected, TOP_BITS, bits)
            victim = mx.argmin((bits.astype(mx.uint64) << SHIFT) | pos.astype(mx.uint64),
                               axis=1, keepdims=True)  # (R, 1)
            pos = mx.where(cols == victim, t, pos)
            slot = victim.reshape(B, H, 1, 1)
            K = mx.put_along_axis(K, slot, k_new, axis=2)
            V = mx.put_along_axis(V, slot, v_new, axis=2)
            kt = k_new.astype(mx.float32)  # (B, H, 1, D)
            if mirrored:  # (B, H, D, n): a plain product, no transposed operand
                kf = keys = mx.put_along_axis(kf, slot, kt.reshape(B, H, D, 1), axis=3)
            else:
                keys = K.swapaxes(-1, -2)
            row = kt @ keys  # (B, H, 1, n): the token x every key
            top = row.max(axis=-1, keepdims=True)
            fresh = mx.exp((row - top) * scale)  # the token's row
            # the window's tokens x the token: its row at their slots (the window is protected)
            column = mx.take_along_axis(row, slots, axis=3)  # (B, H, W, 1)
            added = mx.exp(mx.minimum((column - M) * scale, CAP))
            gone = mx.take_along_axis(E, slot, axis=3)  # the victim's old column
            E = mx.put_along_axis(E, slot, added, axis=3)
            E = mx.slice_update(E, fresh, w, axes=(2,))  # the token's row (after the column)
            S = mx.where(mine, fresh.sum(axis=-1, keepdims=True), S + (added - gone))
            M = mx.where(mine, top, M)
            slots = mx.where(mine, slot, slots)
            return K, V, kf, pos, slots, E, M, S

        _STEPS[key] = mx.compile(step)
    return _STEPS[key]


def _constants(n: int, W: int):
    """The step's constant inputs: the slot index (n,) and, per ``p % W``, the row index (1,)
    and the one-hot (W, 1) mask of the token's row (inputs, not ops: no primitive per token)."""
    if (n, W) not in _CONSTANTS:
        cols = mx.arange(n, dtype=mx.uint32)
        rows = tuple(mx.array([w], mx.int32) for w in range(W))
        mine = tuple(mx.arange(W)[:, None] == w for w in range(W))
        mx.eval(cols, rows, mine)
        _CONSTANTS[n, W] = cols, rows, mine
    return _CONSTANTS[n, W]


class ProxyState:
    """The window's tokens' slots, their exp-logits against every stored key, the rows' sums
    and the float32 key mirror, built from the storage once (and after any other path changed
    it)."""

    def __init__(self, engine, stored_keys) -> None:
        W, n = engine.config.window, engine.slots
        keys = stored_keys.reshape(engine.rows, -1, stored_keys.shape[-1])[:, :n]
        keys = keys.astype(mx.float32)
        order = mx.argsort(engine.stored_positions, axis=1)[:, -W:]  # oldest .. newest
        shift = engine.seen % W  # the token at position p is row p % W
        slots = mx.roll(order, shift, axis=1) if shift else order
        ring = mx.take_along_axis(keys, slots[..., None], axis=1)
        logits = ring @ keys.swapaxes(-1, -2)  # unscaled: exps of (l - M) * scale
        M = logits.max(axis=-1, keepdims=True)
        E = mx.exp((logits - M) * engine.scale)
        S = E.sum(axis=-1, keepdims=True)
        B, H = stored_keys.shape[:2]  # the window's arrays: (B, H, W, 1), its rows (B, H, W, n)
        self.slots = slots.astype(mx.uint32).reshape(B, H, W, 1)
        self.E, self.M, self.S = E.reshape(B, H, W, n), M.reshape(B, H, W, 1), S.reshape(B, H, W, 1)
        mirrored = stored_keys.dtype != mx.float32  # the mirror: the storage's shape, float32
        kT = mx.contiguous(keys.swapaxes(-1, -2))
        self.kf = kT.reshape(stored_keys.shape[:2] + kT.shape[1:]) if mirrored else None
        self.window, self.seen, self.scale = W, engine.seen, engine.scale
        self.constants = _constants(n, W)  # shared: not this state's bytes
        c = engine.config
        self.fn = _step_fn(engine.rule, self.kf is not None, c.n_sink, c.recent, self.scale)

    @property
    def nbytes(self) -> int:
        arrays = (self.slots, self.E, self.M, self.S, self.kf)
        return sum(int(a.nbytes) for a in arrays if a is not None)

    def valid(self, engine) -> bool:
        return self.seen == engine.seen and self.scale == engine.scale


def step(engine, storage_kv, state: ProxyState, k_new, v_new):
    """Token ``engine.seen``: evict the due slot and write the token there. Returns the new
    (keys, values) storage; the engine's positions and ``state`` follow."""
    t = engine.seen
    K, V = storage_kv
    cols, rows, mine = state.constants
    w = t % state.window
    mirrored = state.kf is not None
    K, V, kf, engine.positions, state.slots, state.E, state.M, state.S = state.fn(
        K, V, state.kf if mirrored else E_DUMMY, engine.positions, state.slots, state.E, state.M,
        state.S, k_new, v_new, mx.array(t, mx.int32), rows[w], mine[w], cols)
    state.kf = kf if mirrored else None
    if engine.unpinned is not None:
        engine.unpinned = engine.unpinned.arrived(t, 1, engine.pins)
    engine.seen = state.seen = t + 1
    return K, V
