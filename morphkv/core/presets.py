"""Named settings: the recommended one (chosen on evidence, see docs/history.md and
docs/recall.md) and the paper's.

``recommended(budget)`` is what ``morphkv generate`` and ``morphkv serve`` use by default:
MorphKV's real-query ranking of the older tokens, plus a recency floor (the newest half of the
budget is always kept: on self-generated text recency is what matters), value-weighted scores
(a token whose value vector is small adds little to the output) and persistence: a token's
score is ``max(window mean, PEAK x the largest attention it ever received)``, so a fact the
conversation attended to strongly once is not evicted as soon as the talk moves on (chosen on
the tune items and texts of ``morphkv eval recall --data longchat`` / ``morphkv eval fidelity
--mode sweep``, docs/recall.md).
``paper(budget)`` is the rule as published (recent region = query window), evicting in blocks
of 8 as the paper's coarse variant did (``morphkv_block=1`` for its per-token rule).
"""

from __future__ import annotations

from collections.abc import Callable

from .config import KVCacheConfig

N_SINK = 4
WINDOW = 16
PEAK = 0.02  # peak fusion lambda: best tune retention with tune KL below StreamingLLM
# recommended(memory=...)'s rule (issue 33, second round): the highest tune recall on
# model-written chats (Qwen2.5-0.5B, user turns pinned where a chat knows them) among settings
# with mean tune KL <= 1.5x StreamingLLM at 8 bits in the same bytes and never worse than
# StreamingLLM of the same tokens in the model's dtype on a text (morphkv.eval.choose_memory,
# docs/recall.md): recency at 8 bits, no selection state (every byte a token). Was MorphKV with
# persistence 1 (first round), 0.02 before.
MEMORY_METHOD = "streaming_llm"
PAPER_BLOCK = 8  # the paper's coarse eviction: every 8 steps (-0.9 accuracy points, 0.82x time)
MEMORY_BITS = 8  # storage precision of recommended(memory=...)
# recommended(memory=...) was chosen among settings whose user turns were pinned: it pins
# every prompt itself (KVCacheConfig.pin), so every entry point (mlx_lm's generate, chat loop,
# batch_generate, server) runs it as evaluated, with no morphkv.pin call
MEMORY_PIN = "prompt"
# once the pinned prompts alone overflow, the pinned token whose key is most like the mean key
# goes first (KeyDiff among the pinned): chosen by the fixed rule of docs/recall.md on tune
# chats through mlx_lm.chat's loop (keydiff 4/9, keydiff-span 2/9, the rule's recency 0/9)
MEMORY_PIN_RANK = "keydiff"
BLOCK = 16  # recommended: evict 16 tokens every 16 (no window ring; docs/engine.md, issue 26)


def recommended(budget: int = 512, *, memory: int | None = None, **overrides) -> KVCacheConfig:
    """The recommended MorphKV setting.

    ``recommended(budget)`` holds ``budget`` tokens per sequence and KV head, stored in the
    dtype keys arrive in: every layer's cache holds K/V for ``budget + 1`` slots plus its
    selection state (``MorphKVCache.nbytes_bound``), so the bytes depend on the model.
    ``recommended(memory=N)`` holds at most ``N`` bytes per sequence over all layers with a
    morphkv cache (K/V storage plus selection state), keys and values stored at ``MEMORY_BITS``
    bits: ``KVCacheBuilder.for_model`` / ``patch_model`` resolve it from the model's shape into
    the most tokens per KV head that fit (``budget`` is then ignored). Its rule is
    ``MEMORY_METHOD`` (recency: 4 sinks, the oldest other token goes, per token), which holds
    no selection state, so every byte is a token; it pins every prompt (``pin="prompt"``: the
    tokens of each prefill, a chat's user turns with their template tokens, are evicted after
    the model's own), so plain mlx_lm calls keep the user's words with no ``morphkv.pin``;
    once the pinned tokens alone overflow, KeyDiff ranks them (``pin_rank="keydiff"``: a
    template repeated every turn goes before a word said once).
    Chosen by a fixed rule on tune chats and texts (issue 33; docs/recall.md).
    ``recommended(budget)`` evicts in blocks of ``BLOCK`` tokens: once full, every 16th token
    evicts 16 at once (between evictions the cache holds ``budget - 15`` to ``budget``
    tokens). Keyword arguments override any ``KVCacheConfig`` field.
    """
    window = overrides.get("morphkv_window", WINDOW)
    fields = dict(
        method="morphkv",
        morphkv_budget=budget,
        morphkv_n_sink=N_SINK,
        morphkv_window=window,
        morphkv_recent=max(window, budget // 2),
        morphkv_value=True,
        morphkv_peak=PEAK,
        # at budgets too small for a whole block above the sinks and recent floor: a smaller one
        morphkv_block=max(1, min(BLOCK, budget - N_SINK - max(window, budget // 2))),
    )
    if memory is not None:  # the KVCacheConfig defaults but for these
        fields = dict(method=MEMORY_METHOD, morphkv_budget=0, kv_memory=memory,
                      kv_bits=MEMORY_BITS, morphkv_n_sink=N_SINK, pin=MEMORY_PIN,
                      pin_rank=MEMORY_PIN_RANK)
    fields.update(overrides)
    return KVCacheConfig(**fields).validate(resolved=memory is None)


def paper(budget: int = 512, *, memory: int | None = None, **overrides) -> KVCacheConfig:
    """MorphKV as published: window 8 of real queries, mean fusion, nothing else protected,
    evicting in blocks of ``PAPER_BLOCK`` tokens (the paper's coarse variant).
    ``memory``: bytes per sequence instead of a budget (see ``recommended``), stored as
    the keys arrive unless ``kv_bits`` says otherwise."""
    fields = dict(method="morphkv", morphkv_budget=budget, morphkv_n_sink=N_SINK,
                  morphkv_block=PAPER_BLOCK)
    if memory is not None:
        fields.update(morphkv_budget=0, kv_memory=memory)
    fields.update(overrides)
    return KVCacheConfig(**fields).validate(resolved=memory is None)


PRESETS: dict[str, Callable[..., KVCacheConfig]] = {"recommended": recommended, "paper": paper}
