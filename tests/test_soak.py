"""Soak: 50,000 single-token updates through one MorphKVCache stay at constant size, constant
MLX memory and the budget, and keep exactly what a straightforward NumPy reference keeps."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.device_proxy import bound_nbytes as proxy_bound

STEPS = 50_000
BUDGET, WINDOW, N_SINK = 32, 4, 4
B, H, D = 1, 2, 16
CHECKPOINTS = (BUDGET, BUDGET + 1, 100, 1_000, 7_919, 20_000, 50_000)
MEMORY_SLACK = 64 * 1024  # bytes of MLX active-memory drift tolerated between checkpoints
TIE_RTOL = 1e-9


def reference_kept_at(
    keys: np.ndarray, budget: int, n_sink: int, window: int, checkpoints
) -> dict[int, list[int]]:
    """MorphKV (key-as-query proxy) fed one token at a time, written plainly: the kept
    positions after each checkpoint's number of tokens. keys: (T, D)."""
    keys = np.asarray(keys, np.float64)
    scale = 1.0 / np.sqrt(keys.shape[1])
    wanted = set(checkpoints)
    stored: list[int] = []
    out = {}
    for t in range(keys.shape[0]):
        stored.append(t)
        if len(stored) > budget:
            K = keys[stored]
            logits = K[-window:] @ K.T * scale  # the last `window` stored keys as queries
            logits -= logits.max(axis=1, keepdims=True)
            probs = np.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            scores = probs.mean(axis=0)
            candidates = [
                (s, p)
                for s, p in zip(scores, stored, strict=True)
                if n_sink <= p <= t - window  # sinks and the last `window` are protected
            ]
            low = min(s for s, _ in candidates)
            stored.remove(min(p for s, p in candidates if s <= low + TIE_RTOL * abs(low)))
        if t + 1 in wanted:
            out[t + 1] = sorted(stored)
    return out


def test_soak_50k_single_token_updates():
    rng = np.random.default_rng(6)
    host = rng.standard_normal((B, H, STEPS, D)).astype(np.float16)
    host[..., 0] += np.sin(np.arange(STEPS) / 50.0).astype(np.float16)  # slow drift: not iid
    stream = mx.array(host)
    mx.eval(stream)
    cache = KVCacheBuilder.build(
        KVCacheConfig(
            method="morphkv", morphkv_budget=BUDGET, morphkv_window=WINDOW, morphkv_n_sink=N_SINK
        )
    )
    kept_at: dict[int, np.ndarray] = {}
    nbytes_at: dict[int, int] = {}
    storage_at: dict[int, int] = {}
    active_at: dict[int, int] = {}
    t0 = time.process_time()  # CPU time: the wall clock of a shared machine measures its load
    for i in range(STEPS):
        x = stream[:, :, i : i + 1]
        k, v = cache.update_and_fetch(x, x)
        mx.eval(k, v)
        n = i + 1
        if n >= BUDGET:
            assert cache.tokens_kept == BUDGET
            assert k.shape[2] <= BUDGET + 1
        if n in CHECKPOINTS or n % 5_000 == 0:
            del k, v
            kept_at[n] = cache.kept_positions.copy()
            nbytes_at[n] = cache.nbytes
            storage_at[n] = cache.storage_nbytes
            active_at[n] = mx.get_active_memory()
            assert cache.tokens_seen == n
    elapsed = time.process_time() - t0
    assert elapsed < 60, f"50k single-token updates took {elapsed:.1f} s of CPU time"

    # no growth in held bytes once the budget is reached (budget + 1 rows: one awaits reuse)
    full = [n for n in nbytes_at if n > BUDGET]
    assert len({nbytes_at[n] for n in full}) == 1, nbytes_at
    assert storage_at[full[0]] == 2 * B * H * (BUDGET + 1) * D * 2
    # the bound also counts the compiled proxy step's state (core.device_proxy), held while
    # tokens come one after another and dropped by a read such as these checkpoints
    assert nbytes_at[full[0]] <= cache.nbytes_bound
    assert cache.nbytes_bound - nbytes_at[full[0]] == proxy_bound(cache.engine)
    # no growth in MLX active memory after warm-up
    steady = [active_at[n] for n in sorted(active_at) if n >= 1_000]
    assert max(steady) - steady[0] <= MEMORY_SLACK, active_at

    # the kept set equals the plain reference, for every head, at every checkpoint
    for h in range(H):
        ref = reference_kept_at(host[0, h], BUDGET, N_SINK, WINDOW, CHECKPOINTS)
        for n in CHECKPOINTS:
            got = kept_at[n][0, h].tolist()
            assert got == ref[n], f"head {h}, after {n} tokens: {got} != {ref[n]}"
            assert len(got) == min(n, BUDGET)
            assert got[:N_SINK] == list(range(N_SINK))  # sinks survive
            assert got[-WINDOW:] == list(range(n - WINDOW, n))  # the recent window survives
