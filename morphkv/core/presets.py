"""Named settings: the recommended one (chosen on evidence, docs/recall.md), MorphKV as tuned
on the older items (``tuned``) and MorphKV as published (``paper``).

``recommended`` is one rule whichever argument it gets: recency (``streaming_llm``: 4 sinks,
then the oldest other token goes) over the tokens generated one at a time, with every prompt
pinned (``pin="prompt"``: the tokens of each prefill, a chat's user turns with their template
tokens, go after the model's own) and, once the pinned tokens alone overflow, one KeyDiff
ranking of them over every layer (``pin_rank="vote"``); the model's short replies (at most
``PIN_REPLIES`` tokens: a name, a number, a decision) are pinned when the next prompt arrives
(``pin_replies``). Recency won the fixed rule of issue 42 on held-out chats and long answers
(user-said facts 7/7 of the full cache's vs MorphKV's 6/7, re-mention agreement 77% vs 74%, KL
0.188 vs 0.236 at the float16 bytes of 128 tokens; ``morphkv.eval.choose_said``,
docs/recall.md), as it had won issue 33's; no rule kept the model's own facts there (0 of 7).
Pinning short replies was chosen by the second round's fixed rule on tune chats (model-said 2/8
vs 0/8), the vote among overflowing pins by the eighth's (8/8 vs keydiff's 2/8, docs/recall.md).
The argument says only how much is kept: ``recommended(budget)`` keeps ``budget`` tokens in
the dtype keys arrive in; ``recommended(memory=N)`` keeps at most ``N`` bytes, stored at
``MEMORY_BITS`` bits (at equal bytes 8 bits hold ~1.9x the tokens and won issue 33).
MorphKV, the paper's method, stays in the family: ``paper(budget)`` as published, ``tuned``
as chosen on issue 20-33's items (value-weighted, persistence, a recency floor), measured
beside recency in every evaluation.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import KVCacheConfig

N_SINK = 4
WINDOW = 16
PEAK = 0.02  # tuned's peak fusion lambda: best tune retention with tune KL below StreamingLLM
METHOD = "streaming_llm"  # recommended's rule (issues 33 and 42): recency, no selection state
MEMORY_METHOD = METHOD  # the name older code and tests use
MEMORY_BITS = 8  # storage precision of recommended(memory=...)
# recommended was chosen among settings whose user turns were pinned: it pins every prompt
# itself (KVCacheConfig.pin), so every entry point (mlx_lm's generate, chat loop,
# batch_generate, server) runs it as evaluated, with no morphkv.pin call
PIN = "prompt"
# once the pinned prompts alone overflow, one KeyDiff ranking over every layer and head decides
# which pinned tokens go ("vote", in pieces of a quarter of its room): chosen by round 8's fixed
# rule on tune said chats (model-said 8/8 vs keydiff's 2/8, user-said 6/6 both; docs/recall.md);
# at budgets whose room is under twice PIN_REPLIES each layer ranks its own (as "keydiff")
PIN_RANK = "vote"
PIN_REPLIES = 48  # the model's replies of at most 48 tokens are pinned (issue 42, round 2)
MEMORY_PIN, MEMORY_PIN_RANK = PIN, PIN_RANK
PAPER_BLOCK = 8  # the paper's coarse eviction: every 8 steps (-0.9 accuracy points, 0.82x time)
BLOCK = 16  # tuned: evict 16 tokens every 16 (no window ring; docs/engine.md, issue 26)


def recommended(budget: int = 512, *, memory: int | None = None, **overrides) -> KVCacheConfig:
    """The recommended setting: pinned recency (see the module's docstring for the evidence).

    ``recommended(budget)`` holds ``budget`` tokens per sequence and KV head in the dtype keys
    arrive in; every layer's cache holds K/V for ``budget + 1`` slots plus its pinned ranges
    (``MorphKVCache.nbytes_bound``). ``recommended(memory=N)`` holds at most ``N`` bytes per
    sequence over all layers with a morphkv cache, keys and values stored at ``MEMORY_BITS``
    bits: ``KVCacheBuilder.for_model`` / ``patch_model`` resolve it from the model's shape into
    the most tokens per KV head that fit (``budget`` is then ignored). Both evict one token at
    a time, the oldest unpinned one after 4 sinks; both pin every prompt (``pin="prompt"``),
    so plain mlx_lm calls keep the user's words with no ``morphkv.pin``; once the pinned
    tokens alone overflow, one KeyDiff ranking over every layer and head decides which go
    (``pin_rank="vote"``: a template repeated every turn goes before a word said once); a
    reply of at most ``PIN_REPLIES`` tokens is pinned when the next prompt arrives. Keyword
    arguments override any ``KVCacheConfig`` field."""
    fields = dict(method=METHOD, morphkv_budget=budget, morphkv_n_sink=N_SINK, pin=PIN,
                  pin_rank=PIN_RANK, pin_replies=PIN_REPLIES)
    if memory is not None:
        fields.update(morphkv_budget=0, kv_memory=memory, kv_bits=MEMORY_BITS)
    fields.update(overrides)
    return KVCacheConfig(**fields).validate(resolved=memory is None)


def tuned(budget: int = 512, *, memory: int | None = None, **overrides) -> KVCacheConfig:
    """MorphKV as tuned on issue 20-33's items (``recommended`` before issue 42): the
    real-query ranking of the older tokens, plus a recency floor (the newest half of the
    budget is always kept), value-weighted scores and persistence (a token's score is
    ``max(window mean, PEAK x the largest attention it ever received)``), evicting in blocks of
    ``BLOCK`` tokens (between evictions the cache holds ``budget - 15`` to ``budget`` tokens).
    ``memory``: bytes per sequence instead of a budget, stored as the keys arrive unless
    ``kv_bits`` says otherwise."""
    window = overrides.get("morphkv_window", WINDOW)
    recent = max(window, budget // 2)
    fields = dict(
        method="morphkv",
        morphkv_budget=budget,
        morphkv_n_sink=N_SINK,
        morphkv_window=window,
        morphkv_recent=recent,
        morphkv_value=True,
        morphkv_peak=PEAK,
        # at budgets too small for a whole block above the sinks and recent floor: a smaller one
        morphkv_block=max(1, min(BLOCK, budget - N_SINK - recent)),
    )
    if memory is not None:
        fields.update(morphkv_budget=0, kv_memory=memory, morphkv_recent=None,
                      morphkv_recent_share=0.5, morphkv_block=BLOCK)
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


PRESETS: dict[str, Callable[..., KVCacheConfig]] = {
    "recommended": recommended, "tuned": tuned, "paper": paper}
