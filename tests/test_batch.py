"""Batched generation with morphkv caches: every row equals a single-sequence run.

Rows scored by keys as proxy queries and ``full`` rows (the row-wise ``BatchMorphKVCache``;
rows scored by real queries: tests/test_batch_device.py). Real mlx_lm ``batch_generate`` /
``BatchGenerator`` on tiny random-weight llama models (and the logic of mlx_lm's own batching
tests on the embedded model): rows of different lengths, rows joining and leaving
mid-stream, rows continuing from history, several eviction rules.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step, stream_generate

from morphkv import KVCacheConfig, MorphKVCache, patch_model
from morphkv.core.batch import BatchMorphKVCache
from morphkv.eval.models import tiny_llama
from tests.smollm2_fixture import load_embedded

STEP = 8  # prefill step: prompts span several chunks


def tiny_model(config: KVCacheConfig, seed: int = 0):
    """Keys as proxy queries: the row-wise batch (``morphkv.core.batch``)."""
    return patch_model(tiny_llama(seed), dataclasses.replace(config, scoring="proxy"))


class _Tok:
    eos_token_ids: list[int] = []

    def decode(self, tokens):
        return " ".join(map(str, tokens))


def single(model, prompt, n, cache=None):
    """(tokens, logprobs of the tokens, caches) of a one-sequence greedy run."""
    cache = model.make_cache() if cache is None else cache
    tokens, logprobs = [], []
    steps = generate_step(
        mx.array(prompt), model, prompt_cache=cache, max_tokens=n, prefill_step_size=STEP
    )
    for tok, lp in steps:
        tokens.append(int(tok))
        logprobs.append(lp[int(tok)].item())
    return tokens, logprobs, cache


def assert_same_cache(batched, reference):
    for a, b in zip(batched, reference, strict=True):
        assert a.offset == b.offset
        np.testing.assert_array_equal(a.kept_positions, b.kept_positions)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


METHODS = ["morphkv", "h2o", "streaming_llm", "tova", "random", "full"]


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("method", METHODS)
def test_batch_generate_rows_equal_single_runs(method, block):
    config = KVCacheConfig(method=method, morphkv_budget=16, morphkv_n_sink=2, morphkv_window=4,
                           morphkv_block=block)
    model = tiny_model(config)
    prompts, max_tokens = prompts_of([5, 30, 12]), [20, 9, 25]
    res = batch_generate(
        model,
        _Tok(),
        prompts,
        max_tokens=max_tokens,
        prefill_step_size=STEP,
        return_prompt_caches=True,
        return_token_ids=True,
        return_logprobs=True,
    )
    for prompt, n, ids, lps, caches in zip(
        prompts, max_tokens, res.token_ids, res.logprobs, res.caches, strict=True
    ):
        tokens, logprobs, reference = single(model, prompt, n)
        assert ids == tokens
        np.testing.assert_allclose(lps, logprobs, rtol=1e-4, atol=1e-4)
        assert all(isinstance(c, MorphKVCache) for c in caches)
        kept = max(c.tokens_kept for c in caches)  # eviction happened (full: none)
        if method == "full":
            assert kept == caches[0].offset
        else:
            assert kept == 16 if block == 1 else 16 - block < kept <= 16 < caches[0].offset
        assert_same_cache(caches, reference)


JOIN_CONFIGS = {
    "per-token": dict(morphkv_budget=12, morphkv_n_sink=2, morphkv_window=3),
    "block 4, peak, value": dict(morphkv_budget=14, morphkv_n_sink=2, morphkv_window=3,
                                 morphkv_recent=4, morphkv_block=4, morphkv_peak=0.02,
                                 morphkv_value=True),
    "block 3, 8-bit": dict(morphkv_budget=13, morphkv_n_sink=2, morphkv_window=4,
                           morphkv_block=3, kv_bits=8, kv_group_size=32),
}


def drive(gen, prompts, max_tokens, history=None):
    """Four rows through ``gen`` (a ``BatchGenerator``): one at first, two join at step 4, one
    at step 9, the third leaves at step 12 (a client goes away); row i starts from
    ``history(i)`` when given. (uids, tokens per uid, final caches per uid, the removed uid)."""
    def cache(rows):
        return None if history is None else {"caches": [history(i) for i in rows]}

    out, caches, steps, removed = {}, {}, 0, None
    uids = gen.insert(prompts[:1], max_tokens=max_tokens[:1], **(cache([0]) or {}))
    while True:
        if steps == 4:
            uids += gen.insert(prompts[1:3], max_tokens=max_tokens[1:3], **(cache([1, 2]) or {}))
        if steps == 9:
            uids += gen.insert(prompts[3:], max_tokens=max_tokens[3:], **(cache([3]) or {}))
        if steps == 12:
            removed = uids[2]
            gen.remove([removed])
        responses = gen.next_generated()
        if not responses and steps > 12:
            break
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
        steps += 1
    gen.close()
    assert set(caches) == set(uids) - {removed}
    return uids, out, caches, removed


@pytest.mark.parametrize("name", list(JOIN_CONFIGS))
def test_rows_join_and_leave_mid_stream(name):
    config = KVCacheConfig(method="morphkv", scoring="attention", **JOIN_CONFIGS[name])
    model = patch_model(tiny_llama(3, head_dim=64 if config.kv_bits else None), config)
    prompts = prompts_of([7, 19, 3, 26], seed=1)
    max_tokens = [30, 12, 20, 15]
    gen = BatchGenerator(
        model, max_tokens=30, prefill_step_size=STEP, completion_batch_size=3, prefill_batch_size=2
    )
    uids, out, caches, removed = drive(gen, prompts, max_tokens)
    for uid, prompt, n in zip(uids, prompts, max_tokens, strict=True):
        tokens, _, reference = single(model, prompt, n)
        if uid == removed:
            assert out[uid] == tokens[: len(out[uid])]
            continue
        assert out[uid] == tokens
        assert_same_cache(caches[uid], reference)


def test_continued_generation_from_history():
    """Rows start from caches with different histories (merge of non-empty caches)."""
    config = KVCacheConfig(method="morphkv", morphkv_budget=14, morphkv_n_sink=2, morphkv_window=3)
    model = tiny_model(config, seed=5)
    first, second = prompts_of([9, 21], seed=2), prompts_of([4, 13], seed=3)
    res = batch_generate(
        model, _Tok(), first, max_tokens=6, prefill_step_size=STEP, return_prompt_caches=True
    )
    res2 = batch_generate(
        model,
        _Tok(),
        second,
        max_tokens=[11, 7],
        prefill_step_size=STEP,
        prompt_caches=res.caches,
        return_prompt_caches=True,
        return_token_ids=True,
    )
    for p1, p2, n, ids, caches, history in zip(
        first, second, [11, 7], res2.token_ids, res2.caches, res.caches, strict=True
    ):
        _, _, ref_cache = single(model, p1, 6)
        assert_same_cache(history, ref_cache)  # the inputs were not updated in place
        tokens, _, ref_cache = single(model, p2, n, cache=ref_cache)
        assert ids == tokens
        assert_same_cache(caches, ref_cache)


def test_right_padded_prefill_drops_padding():
    """The cache protocol directly: right-padded chunks, then decode, per-row offsets."""
    config = KVCacheConfig(
        method="h2o",
        head_dim=8,
        morphkv_budget=6,
        morphkv_n_sink=1,
        morphkv_window=2,
        scoring="proxy",
    )
    lengths = [3, 10, 7]
    rows = [MorphKVCache(config) for _ in lengths]
    batch = MorphKVCache.merge([MorphKVCache(config) for _ in lengths])
    assert isinstance(batch, BatchMorphKVCache)
    keys = mx.random.normal((3, 2, 10, 8), key=mx.random.key(0))
    batch.prepare(lengths=lengths, right_padding=[10 - n for n in lengths])
    for start in (0, 4, 8):
        chunk = keys[:, :, start : start + 4]
        k, v = batch.update_and_fetch(chunk, chunk)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            real = chunk[i : i + 1, :, : max(0, min(4, n - start))]
            if real.shape[2]:
                rk, _ = row.update_and_fetch(real, real)
                assert mx.array_equal(k[i : i + 1, :, : rk.shape[2]], rk)
    batch.finalize()
    assert batch.offset.tolist() == lengths
    for _ in range(5):
        new = mx.random.normal((3, 2, 1, 8))
        mask = batch.make_mask(1)
        k, _ = batch.update_and_fetch(new, new)
        for i, row in enumerate(rows):
            rk, _ = row.update_and_fetch(new[i : i + 1], new[i : i + 1])
            assert mx.array_equal(k[i : i + 1, :, : rk.shape[2]], rk)
            if mask is not None:  # the zero fill is hidden
                assert mask[i, 0, 0].tolist() == [j < rk.shape[2] for j in range(k.shape[2])]
    for b, r in zip(batch.rows, rows, strict=True):
        np.testing.assert_array_equal(b.kept_positions, r.kept_positions)
    one = batch.extract(1)
    batch.filter([0, 2])
    assert len(batch.rows) == 2 and one.offset == 15
    np.testing.assert_array_equal(one.kept_positions, rows[1].kept_positions)


def test_bad_input_is_rejected_and_changes_nothing():
    config = KVCacheConfig(method="morphkv", head_dim=8, morphkv_budget=16, scoring="proxy")
    with pytest.raises(TypeError, match="MorphKVCache"):
        MorphKVCache.merge([MorphKVCache(config), object()])
    batch = MorphKVCache.merge([MorphKVCache(config), MorphKVCache(config)])
    with pytest.raises(ValueError, match="batch of 2 rows"):
        batch.update_and_fetch(mx.zeros((3, 2, 1, 8)), mx.zeros((3, 2, 1, 8)))
    with pytest.raises(ValueError, match="needs lengths"):
        batch.prepare(right_padding=[0, 2])
    assert batch.empty() and batch.offset.tolist() == [0, 0]


# ---- mlx_lm's own batching tests (tests/test_generate.py), on the embedded model -----------
CHATS = ["Write a story about Einstein", "Hi", "What time is it?", "How tall is Mt Everest?"]


@pytest.fixture(scope="module")
def embedded():
    model, tokenizer = load_embedded()
    config = KVCacheConfig(method="morphkv", morphkv_budget=24, morphkv_n_sink=4, morphkv_window=4)
    patch_model(model, config)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in CHATS
    ]
    yield model, tokenizer, [list(p) for p in prompts]
    del model.make_cache


@pytest.mark.slow
def test_mlx_lm_many_batches(embedded):
    """mlx_lm's test_many_batches and test_batch_matches_single: first-token logprobs."""
    model, tokenizer, prompts = embedded
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        max_tokens=1,
        prefill_batch_size=2,
        prefill_step_size=8,
        completion_batch_size=3,
    )
    uids = gen.insert(prompts)
    responses, iters = {}, 0
    while batch := gen.next_generated():
        for r in batch:
            assert r.uid not in responses
            responses[r.uid] = r
        iters += 1
    gen.close()
    assert iters > 1
    for uid, prompt in zip(uids, prompts, strict=True):
        ref = next(iter(stream_generate(model, tokenizer, prompt, max_tokens=1)))
        assert mx.allclose(responses[uid].logprobs, ref.logprobs, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_mlx_lm_batch_unique_max_toks(embedded):
    """mlx_lm's test_batch_unique_max_toks, long enough to evict (budget 24)."""
    model, tokenizer, prompts = embedded
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        prefill_batch_size=2,
        prefill_step_size=8,
        completion_batch_size=3,
    )
    num_toks = [6, 2, 8, 4]
    uids = gen.insert(prompts, max_tokens=num_toks)
    out = {uid: [] for uid in uids}
    while batch := gen.next_generated():
        for r in batch:
            out[r.uid].append(r.token)
    gen.close()
    for uid, prompt, n in zip(uids, prompts, num_toks, strict=True):
        tokens = [
            r.token
            for r in stream_generate(model, tokenizer, prompt, max_tokens=n, prefill_step_size=8)
        ]
        assert out[uid] == tokens


def test_decode_step_is_the_same_graph_for_any_number_of_rows():
    """Between evictions a decode step adds the same MLX operations at 2 rows as at 8 (no
    per-row work), and an eviction step the same at any number of evicting rows."""
    from morphkv.bench.kernels import graph_nodes
    from morphkv.mlxlm.hooks import queries_by_hand

    config = KVCacheConfig(method="morphkv", head_dim=8, morphkv_budget=16, morphkv_n_sink=2,
                           morphkv_window=3, morphkv_block=4, scoring="attention")

    def step_graph(lengths):
        rng = np.random.default_rng(0)
        singles = []
        with queries_by_hand():
            for n in lengths:
                c = MorphKVCache(config)
                k = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
                c.update_and_fetch(k, k)
                c.prepare_attention(mx.concatenate([k, k], axis=1), 0.3, "causal")
                singles.append(c)
            batch = MorphKVCache.merge(singles)
            counts = []
            for _ in range(4):  # one block: the rows reach their grid at different steps
                mx.eval(batch.state)
                new = mx.array(rng.standard_normal((len(lengths), 2, 1, 8)).astype(np.float32))
                keys, values = batch.update_and_fetch(new, new)
                mask = batch.prepare_attention(mx.concatenate([new, new], axis=1), 0.3, None)
                counts.append(len(graph_nodes([keys, values, *batch.state]
                                              + ([] if mask is None else [mask]))))
            return counts

    two = step_graph([25, 26])
    eight = step_graph([25, 26, 25, 26, 25, 26, 25, 26])
    assert two == eight, (two, eight)
    assert len(set(two)) > 1  # eviction steps and plain steps both measured
