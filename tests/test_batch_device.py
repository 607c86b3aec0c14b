"""The batch cache on the MLX engine (``DeviceBatchCache``): every row keeps what the same
sequence run alone keeps, for every rule and blocks 1 and 16, through mlx_lm's real
``batch_generate`` and ``BatchGenerator`` (rows of different lengths, joining, leaving,
continuing from history, pinned), with no host read in a decode step of 4 rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from morphkv import KVCacheConfig, MorphKVCache, patch_model
from morphkv.core.batch import BatchMorphKVCache
from morphkv.core.device_batch import DeviceBatchCache
from morphkv.core.rules import METHODS
from morphkv.eval.models import tiny_llama
from tests.test_batch import STEP, _Tok, assert_same_cache, drive, prompts_of, single

RULES = sorted(set(METHODS) - {"sliding_window"})


def device_config(method: str, block: int, **extra) -> KVCacheConfig:
    return KVCacheConfig(method=method, morphkv_budget=16 if block == 1 else 40,
                         morphkv_n_sink=2, morphkv_window=4, morphkv_recent=4,
                         morphkv_block=block, morphkv_value=METHODS[method].attention,
                         scoring="attention", engine="mlx", **extra)


def device_model(config, seed=0):
    return patch_model(tiny_llama(seed, head_dim=64 if config.kv_bits else None), config)


def batch_rows(model, prompts, max_tokens):
    """``batch_generate``'s rows beside the same prompts run alone: per row (its token ids,
    its caches, the single run's tokens, the single run's caches)."""
    res = batch_generate(model, _Tok(), prompts, max_tokens=max_tokens,
                         prefill_step_size=STEP, return_prompt_caches=True,
                         return_token_ids=True)
    for prompt, n, ids, caches in zip(prompts, max_tokens, res.token_ids, res.caches,
                                      strict=True):
        tokens, _, reference = single(model, prompt, n)
        yield ids, caches, tokens, reference


@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("method", RULES)
def test_batch_generate_rows_equal_single_runs_on_the_mlx_engine(method, block):
    config = device_config(method, block)
    model = device_model(config)
    long = 3 * config.budget
    prompts, max_tokens = prompts_of([5, long, 12]), [long, 9, config.budget + 7]
    for ids, caches, tokens, reference in batch_rows(model, prompts, max_tokens):
        assert ids == tokens, (method, block)
        assert all(isinstance(c, MorphKVCache) and c.config.engine == "mlx" for c in caches)
        assert caches[0].offset > config.budget  # eviction happened in every row
        assert_same_cache(caches, reference)


def test_full_rows_grow_in_one_storage():
    """``full`` rows batch on the MLX engine too: one storage, every row as wide as the widest
    needs (a prompt over 256 slots in its prefill, rows crossing 256 and 512 in decode), each
    row's tokens and stored keys those of the same sequence alone."""
    config = device_config("full", 1)
    model = device_model(config, seed=1)
    prompts, max_tokens = prompts_of([5, 250, 300], seed=2), [520, 20, 10]
    for ids, caches, tokens, reference in batch_rows(model, prompts, max_tokens):
        assert ids == tokens
        assert_same_cache(caches, reference)
        for a, b in zip(caches, reference, strict=True):
            n = b.offset
            assert a.keys.shape == b.keys.shape  # handed back at its own width, not the widest
            np.testing.assert_allclose(np.array(a.keys[..., :n, :]), np.array(b.keys[..., :n, :]),
                                       atol=1e-5)  # (batched projections round differently)


def test_the_merged_batch_is_on_the_mlx_engine():
    for method in ("morphkv", "full"):
        rows = [MorphKVCache(device_config(method, 16)) for _ in range(3)]
        assert isinstance(MorphKVCache.merge(rows), DeviceBatchCache)
    proxy = KVCacheConfig(method="morphkv", morphkv_budget=16, scoring="proxy")
    assert isinstance(MorphKVCache.merge([MorphKVCache(proxy)]), BatchMorphKVCache)


@pytest.mark.parametrize(("method", "block", "lengths"), [
    ("morphkv", 1, [20, 30, 9, 25]), ("morphkv", 16, [20, 30, 9, 25]),
    ("full", 1, [300, 20, 530, 240]),  # rows 512, 256, 768 and 256 slots wide, growing
])
def test_rows_join_leave_and_keep_their_pins(method, block, lengths, tmp_path):
    """BatchGenerator: rows join mid-stream (extend), leave (filter), are handed back
    (extract) and saved; each row started from a pinned history, its pins kept throughout.
    ``full`` rows of different widths share one storage, grown as the widest needs."""
    config = device_config(method, block, **({} if method == "full" else {"morphkv_peak": 0.02}))
    model = device_model(config, seed=3)
    prompts = prompts_of([7, 45, 3, 60], seed=1)
    histories = prompts_of(lengths, seed=4)
    max_tokens = [50, 12, 44, 30]
    pins = [range(3, 12), range(5, 25), range(0, 4), range(10, 20)]

    def history(i):
        _, _, cache = single(model, histories[i], 1)
        for c in cache:
            c.pin(np.array(pins[i]))
        return cache

    gen = BatchGenerator(model, max_tokens=60, prefill_step_size=STEP,
                         completion_batch_size=3, prefill_batch_size=2)
    uids, out, caches, removed = drive(gen, prompts, max_tokens, history)
    for i, (uid, prompt, n) in enumerate(zip(uids, prompts, max_tokens, strict=True)):
        tokens, _, reference = single(model, prompt, n, cache=history(i))
        if uid == removed:
            assert out[uid] == tokens[: len(out[uid])]
            continue
        assert out[uid] == tokens
        assert_same_cache(caches[uid], reference)
        assert all(c.pins.ranges() == reference[0].pins.ranges() for c in caches[uid])
        path = str(tmp_path / f"row{i}.safetensors")
        save_prompt_cache(path, caches[uid])
        loaded = load_prompt_cache(path)
        assert_same_cache(loaded, reference)
        assert all(c.pins.ranges() == reference[0].pins.ranges() for c in loaded)


def test_a_decode_step_of_four_rows_reads_nothing_on_the_host():
    """Four rows at different eviction phases (merged from histories of different lengths,
    as the server builds a batch): every decode step, evictions included, is lazy MLX."""
    from morphkv.bench.kernels import SyncCounter
    from morphkv.mlxlm.hooks import attention_step, queries_by_hand

    config = device_config("morphkv", 16, morphkv_peak=0.02)
    rng = np.random.default_rng(0)

    def arrays(B, n, heads):
        return mx.array(rng.standard_normal((B, heads, n, 16)).astype(np.float16))

    with queries_by_hand():
        rows = []
        for n in (45, 52, 60, 41):
            c = MorphKVCache(config)
            mx.eval(attention_step(c, arrays(1, n, 6), arrays(1, n, 2), arrays(1, n, 2), 0.25))
            rows.append(c)
        batch = MorphKVCache.merge(rows)
        assert isinstance(batch, DeviceBatchCache)
        evictions = 0
        with SyncCounter() as syncs:
            for _ in range(2 * config.block):
                q, k, v = arrays(4, 1, 6), arrays(4, 1, 2), arrays(4, 1, 2)
                evictions += sum(e.due for e in batch.engines)
                syncs.active = True
                out = attention_step(batch, q, k, v, 0.25)
                syncs.active = False
                mx.eval(out, batch.state)
        assert syncs.count == 0 and evictions >= 4


def test_bench_kernels_counts_a_batch_of_four_rows():
    """``morphkv bench speed --mode kernels --rows 4``: the server's kind of batch, merged from
    rows at different eviction phases; the MLX engine reads nothing on the host."""
    from morphkv.bench.kernels import count
    from morphkv.mlxlm.hooks import queries_by_hand

    with queries_by_hand():
        mlx = count("tuned", 64, 3, 1, rows=4)
        full = count("full", 64, 3, 1, rows=4)
        proxy = count("seed", 64, 3, 1, rows=4)  # keys as proxies (no hook): row-wise
    for arm in (mlx, full):
        assert (arm["class"], arm["batch"], arm["host_syncs_per_step"]) == (
            "DeviceBatchCache", 4, 0)
    assert (proxy["class"], proxy["batch"]) == ("BatchMorphKVCache", 4)


@pytest.mark.parametrize("extra", [
    dict(pin="prompt", pin_rank="keydiff", kv_bits=8, kv_group_size=32),  # the memory preset
    dict(morphkv_pool=5, morphkv_peak=0.5, morphkv_decay=0.9),
])
def test_pinned_quantized_and_pooled_rows_equal_single_runs(extra):
    config = device_config("morphkv", 16, **extra)
    model = device_model(config, seed=2)
    prompts, max_tokens = prompts_of([70, 9, 33], seed=5), [30, 75, 50]
    for ids, caches, tokens, reference in batch_rows(model, prompts, max_tokens):
        assert ids == tokens
        assert_same_cache(caches, reference)
        assert [c.pins.ranges() for c in caches] == [c.pins.ranges() for c in reference]
        assert bool(caches[0].pins.ranges()) == (config.pin == "prompt")


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_the_recommended_rule_batches_as_single_runs(kv_bits):
    """Pinned recency, per token, pins ranked by keys (``recommended``): its prompts are
    scheduled chunks (``core.device_schedule``), row by row, as a sequence alone."""
    config = device_config("streaming_llm", 1, pin="prompt", pin_rank="keydiff",
                           kv_bits=kv_bits, kv_group_size=32)
    model = device_model(config, seed=3)
    prompts, max_tokens = prompts_of([70, 9, 33], seed=6), [30, 45, 20]
    for ids, caches, tokens, reference in batch_rows(model, prompts, max_tokens):
        assert ids == tokens
        assert_same_cache(caches, reference)
