"""Named settings: the recommended one (chosen on evidence, docs/recall.md), MorphKV as tuned
on the older items (``tuned``) and MorphKV as published (``paper``).

``recommended`` is one rule whichever argument it gets: ``peak`` with a decay (4 sinks, then,
in blocks of ``BLOCK``, the tokens whose largest attention from one query, decaying by
``DECAY`` a token, is lowest go: one number a slot, what recent queries attended to survives)
over the tokens generated one at a time, with every prompt pinned (``pin="prompt"``: the
tokens of each prefill, a chat's user turns with their template tokens, go after the model's
own) and, once the pinned tokens alone overflow, one KeyDiff ranking of them over every layer
(``pin_rank="vote"``); the model's short replies (at most ``PIN_REPLIES`` tokens: a name, a
number, a decision) are pinned when the next prompt arrives (``pin_replies``), and a prompt's
runs of tokens heard in an earlier prompt (a chat template sent again) are not pinned
(``pin_repeats``, issue 41's round 14). Issue 42's rounds, each a fixed rule on tune items
(docs/recall.md): recency won round 1 (user-said facts and re-mentions on held-out chats and
code answers), pinning short replies round 2 (48 tokens; 16 since round 16), the vote among
overflowing pins round 8, and the decaying peak round 12 (re-mentions a long code answer makes
of its own identifiers at a quarter of its bytes: 72 of 78 vs recency's 64, KL 0.027 vs 0.052,
said tune chats level at 8/8 and 6/6); MorphKV's window of 16 rows won re-mentions too (69)
but its state's bytes came out of the pins (round 11: said 4/8 and 4/6).
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
# recommended's rule (issue 42, round 12): the largest attention a token got from one query,
# decaying by DECAY a token, evicted in blocks of BLOCK (one float a slot: 4% of the bytes)
METHOD = "peak"
DECAY = 0.95
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
# the model's replies of at most 16 tokens are pinned (a name, a number, a decision): round 16's
# fixed rule on live tune chats 9-12 and said tune chats 20-23, 28 vs 21 items with 48 (round 2's
# choice), model-said level: a reply that runs to 17 tokens or more goes first, not the user's words
PIN_REPLIES = 16
# a prompt's runs of 4 tokens heard in an earlier prompt (a chat template sent again) are not
# pinned: round 14's fixed rule on live tune chats 0-2, loop and server together: 4 of 18 facts
# vs 1 without (docs/recall.md)
PIN_REPEATS = 4
MEMORY_PIN, MEMORY_PIN_RANK = PIN, PIN_RANK
PAPER_BLOCK = 8  # the paper's coarse eviction: every 8 steps (-0.9 accuracy points, 0.82x time)
BLOCK = 16  # tuned: evict 16 tokens every 16 (no window ring; docs/engine.md, issue 26)


def recommended(budget: int = 512, *, memory: int | None = None, **overrides) -> KVCacheConfig:
    """The recommended setting: a pinned decaying peak (the module's docstring has the evidence).

    ``recommended(budget)`` holds ``budget`` tokens per sequence and KV head in the dtype keys
    arrive in; every layer's cache holds K/V for ``budget + 1`` slots plus its pinned ranges
    (``MorphKVCache.nbytes_bound``). ``recommended(memory=N)`` holds at most ``N`` bytes per
    sequence over all layers with a morphkv cache, keys and values stored at ``MEMORY_BITS``
    bits: ``KVCacheBuilder.for_model`` / ``patch_model`` resolve it from the model's shape into
    the most tokens per KV head that fit (``budget`` is then ignored). Both evict in blocks of
    ``BLOCK`` the unpinned tokens after 4 sinks whose decaying peak of attention is lowest
    (``morphkv_decay=DECAY``; without the attention hook, keys stand in for the queries); both
    pin every prompt (``pin="prompt"``), so plain mlx_lm calls keep the user's words with no
    ``morphkv.pin``; once the pinned tokens alone overflow, one KeyDiff ranking over every layer
    and head decides which go (``pin_rank="vote"``; it keeps a chat template's tokens at about
    their share of the stream: 41% of the slots after 10 turns of mlx_lm's chat loop,
    docs/figures/pin_kept_probe.py), so a prompt's runs of ``PIN_REPEATS`` tokens heard in an
    earlier prompt (the template sent again) are not pinned (``pin_repeats``: 22%); a reply of
    at most ``PIN_REPLIES`` tokens is pinned when the next prompt arrives. Keyword arguments
    override any ``KVCacheConfig`` field."""
    fields = dict(method=METHOD, morphkv_budget=budget, morphkv_n_sink=N_SINK, pin=PIN,
                  pin_rank=PIN_RANK, pin_replies=PIN_REPLIES, pin_repeats=PIN_REPEATS,
                  morphkv_decay=DECAY,
                  morphkv_block=block_for(budget, KVCacheConfig().recent))
    if memory is not None:
        fields.update(morphkv_budget=0, kv_memory=memory, kv_bits=MEMORY_BITS, morphkv_block=BLOCK)
    if "method" in overrides:  # another rule with the preset's pins: its own decay and block
        fields.update(morphkv_decay=1.0, morphkv_block=1)
    fields.update(overrides)
    return KVCacheConfig(**fields).validate(resolved=memory is None)


def block_for(budget: int, recent: int) -> int:
    """``BLOCK``, or at budgets too small for a whole block above the sinks and the recency
    floor, the largest block that fits."""
    return max(1, min(BLOCK, budget - N_SINK - recent))


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
        morphkv_block=block_for(budget, recent),
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
