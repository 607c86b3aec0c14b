"""The memory bound holds at every moment of a prefill, not only between updates: with
``kv_memory`` the K/V storage plus the selection state of every morphkv layer, sampled each
time a piece of a prefill chunk is written (inside ``update_and_fetch`` / the attention hook),
never exceeds the memory asked. The MLX engine feeds a long chunk in pieces that end at the
eviction grid, so a piece never needs more than ``budget + 1`` stored rows; a scheduled chunk
(``core.device_schedule``: rules that rank without attention, as ``recommended``'s) attends
over the stored rows and the chunk's own (mlx_lm's arrays) without joining them, and moves
its kept rows into the ``budget + 1`` slots."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from morphkv import KVCacheBuilder, MorphKVCache, recommended
from morphkv.core import quant
from morphkv.eval.models import greedy_tokens, tiny_llama
from morphkv.mlxlm.attach import attach


def held_bytes(caches) -> int:
    """What the morphkv caches hold now, read without flushing anything."""
    return sum(quant.nbytes(c.keys) + quant.nbytes(c.values) + c.engine.nbytes
               for c in caches if c.keys is not None and c.engine is not None)


def prefill_samples(model, config, prompt, step: int) -> tuple[list[int], list[MorphKVCache]]:
    """The bytes held, sampled right after every piece is written into a layer's storage,
    during a greedy prefill of ``prompt`` in chunks of ``step`` (mlx_lm's generate_step)."""
    attach(model)
    caches = KVCacheBuilder.for_model(model, config)
    morph = [c for c in caches if isinstance(c, MorphKVCache)]
    samples: list[int] = []
    for cache in morph:
        write = cache._write

        def sampled(keys, values, start, write=write):
            write(keys, values, start)
            samples.append(held_bytes(morph))

        cache._write = sampled
        scheduled = cache._feed_scheduled

        def sampled_chunk(*args, scheduled=scheduled):
            out = scheduled(*args)
            samples.append(held_bytes(morph))
            return out

        cache._feed_scheduled = sampled_chunk
    greedy_tokens(model, caches, prompt, max_tokens=1, prefill_step_size=step)
    return samples, morph


def check_bound(model, memory: int, prompt, step: int, **overrides) -> None:
    config = recommended(memory=memory, **overrides)
    samples, morph = prefill_samples(model, config, prompt, step)
    budget = morph[0].config.budget
    assert morph[0].config.engine == "mlx"
    # sampled inside every chunk: at least one piece (or scheduled chunk) per chunk and layer
    assert len(samples) >= len(morph) * -(-len(prompt) // step)
    assert max(samples) <= memory, f"{max(samples)} bytes held > {memory} asked"
    assert all(c.tokens_kept <= budget for c in morph)


def test_tiny_model_bound_holds_inside_a_long_chunk():
    model = tiny_llama(0)
    prompt = np.random.default_rng(0).integers(0, 256, 600).tolist()
    check_bound(model, 64 * 1024, prompt, step=512, kv_bits=None)  # head dim 16: float K/V


def _prose_tokens(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode(text)[:n]


@pytest.mark.slow
def test_smollm2_bound_holds_during_a_4k_prefill():
    from tests.smollm2_fixture import load_embedded

    model, tokenizer = load_embedded()
    check_bound(model, int(2.81 * 2**20), _prose_tokens(tokenizer, 4096), step=2048)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MORPHKV_GEMMA") != "1", reason="set MORPHKV_GEMMA=1")
def test_gemma3_bound_holds_during_a_4k_prefill():
    from morphkv.model import load_gguf_model, resolve_embedded

    model, tokenizer = load_gguf_model(str(resolve_embedded("gemma3-270m")))
    check_bound(model, int(2.81 * 2**20), _prose_tokens(tokenizer, 4096), step=2048)
    mx.clear_cache()
