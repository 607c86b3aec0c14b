"""The cache flags shared by ``morphkv generate`` and ``morphkv serve``.

``--preset`` picks a named setting (``morphkv.PRESETS``; default ``recommended``) whose values
scale with ``--budget``; every other flag left unset keeps the preset's value, and a flag that
is set overrides it. ``--method`` other than morphkv starts from the plain defaults instead
(the presets' knobs are morphkv's). Errors name the flags, not the config fields.
"""

from __future__ import annotations

import argparse

from ..core.config import ENGINES, PIN_POLICIES, PIN_RANKS, SCORINGS, KVCacheConfig
from ..core.knobs import FIELDS, flag
from ..core.presets import PIN_REPEATS, PIN_REPLIES, PRESETS
from ..core.repeats import MAX_RUN
from ..core.rules import METHODS
from ..core.rules.attention import FUSIONS
from .argtypes import Number, UsageError, add_number, flag_names

DEFAULT_PRESET = "recommended"


def _size(text: str) -> int:
    from ..core.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


ARGS = {  # knob -> its flag's settings; the flag is --knob (morphkv.core.knobs), the dest knob
    "method": dict(choices=sorted(METHODS), metavar="METHOD", help="Eviction rule, one of "
                   f"{', '.join(sorted(METHODS))} (default: the preset's: peak for "
                   "recommended, morphkv for tuned and paper)."),
    "window": dict(type=Number(int, lo=1), help="Recent tokens whose queries rank the rest (an "
                   "integer >= 1; default: the preset's, 16 for tuned, 8 for recommended and "
                   "paper)."),
    "recent": dict(type=Number(int, lo=1), help="Newest tokens never evicted, >= --window (an "
                   "integer >= 1; default: the preset's, half the budget for tuned, the "
                   "window otherwise)."),
    "value": dict(action=argparse.BooleanOptionalAction, help="Weight attention scores by the "
                  "value vectors' norms (default: the preset's, on for tuned)."),
    "peak": dict(type=Number(float, lo=0), help="Fuse each token's peak attention into the "
                 "window score: max(window, PEAK x peak) (a number >= 0; 0: off; default: the "
                 "preset's)."),
    "decay": dict(type=Number(float, lo=0, hi=1, lo_open=True), help="Per-token decay of the "
                  "peak (a number in (0, 1]; default: the preset's, 0.95 for recommended, else "
                  "1)."),
    "pool": dict(type=Number(int, lo=1), help="Span pooling kernel over neighbouring stored "
                 "tokens (an integer >= 1, odd; default: the preset's, 1 = none)."),
    "block": dict(type=Number(int, lo=1), help="Tokens evicted at once: once the budget is full, "
                  "every BLOCK-th token evicts BLOCK tokens and the tokens between only append "
                  "(an integer >= 1; budget >= sinks + recent + block; default: the preset's: 16 "
                  "for recommended and tuned, 8 for paper, 1 for other methods)."),
    "sinks": dict(type=Number(int, lo=0), help="First tokens never evicted (an integer >= 0; "
                  "default: 4; none for sliding_window)."),
    "fusion": dict(choices=list(FUSIONS), help="How morphkv fuses the window's attention rows "
                   "(default: mean)."),
    "scoring": dict(choices=list(SCORINGS), help="attention: the model's real queries; proxy: "
                    "stored keys stand in for queries; auto: attention where the model is "
                    "supported (default: auto)."),
    "engine": dict(choices=list(ENGINES), help="Where the rule's statistics and selection run: "
                   "mlx, the one engine (from the layer's own attention, no host sync); auto: "
                   "the same (default: auto)."),
    "pin": dict(choices=list(PIN_POLICIES), help="What the cache pins (evicts last): prompt: "
                "every prefilled token (prompts, chat turns, server requests), not the model's "
                "own generated tokens; none: nothing (default: the preset's: prompt for "
                "recommended, else none)."),
    "pin_rank": dict(choices=list(PIN_RANKS), help="Which pinned tokens go first once pins "
                     "alone overflow the budget: rule (its own score; recency: the oldest), "
                     "keydiff (the key most like the mean key), keydiff-span (that, pooled "
                     "over 5 neighbours), vote (one keydiff ranking over every layer and head "
                     "unpins the same tokens in all layers before a prompt overflows them), "
                     "vote-span (that vote, each score pooled over 5 pinned neighbours) "
                     "(default: the preset's)."),
    "pin_replies": dict(type=Number(int, lo=0), help="With --pin prompt: when a prompt "
                        "arrives, also pin the model's reply before it if it is at most this "
                        "many tokens (a name, a number, a decision; an integer >= 0, 0: off; "
                        f"default: the preset's, {PIN_REPLIES} for recommended)."),
    "pin_fit": dict(action=argparse.BooleanOptionalAction, help="With --pin-replies: pin a "
                    "reply only while the pins, the reply with them, fit in the budget (a "
                    "long chat's later replies then go before the user's words; default: the "
                    "preset's)."),
    "pin_repeats": dict(type=Number(int, lo=0, hi=MAX_RUN), help="With --pin prompt: a "
                        "prompt token in a run of this many tokens an earlier prompt of the "
                        "same conversation held is not pinned (a chat template sent again "
                        f"every turn; an integer in [0, {MAX_RUN}], 0: off, 1 refused; default: "
                        f"the preset's, {PIN_REPEATS} for recommended)."),
    "kv_bits": dict(type=int, choices=(4, 8), help="Store keys and values quantized to 4 or 8 "
                    "bits (default: as they arrive, unquantized)."),
    "kv_group_size": dict(type=int, choices=(32, 64, 128), help="Quantization group size with "
                          "--kv-bits (default: 64)."),
    "kv_smooth": dict(action=argparse.BooleanOptionalAction, help="With --kv-bits, on a "
                      "model whose key projection adds a bias (Qwen2): divide the keys' "
                      "outlier channels out before rounding, the queries multiplied back "
                      "(logits unchanged; default: on)."),
    "kv_memory": dict(type=_size, metavar="SIZE", help="Bytes of KV cache "
                      "per sequence over all layers (e.g. 64M, 1.5G, 512K: K/V storage plus "
                      "selection state); replaces --budget with the most tokens per KV head "
                      "that fit, stored at 8 bits for recommended unless --kv-bits says "
                      "otherwise (default: none, --budget bounds the tokens)."),
}
OVERRIDES = {k: FIELDS[k] for k in ARGS if k != "kv_memory"}  # dest -> the field it overrides
FLAGS = {FIELDS[k]: flag(k) for k in ("budget", *ARGS)}  # for errors: field (or property) -> flag
FLAGS.update({p: flag(p) for p in ("budget", "window", "recent", "block", "n_sink")})


def add_cache_flags(parser, budget: int) -> None:
    """The cache flags, in their own help group; ``budget`` is the command's default."""
    g = parser.add_argument_group("KV cache")
    g.add_argument(
        "--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
        help="Named setting: recommended (after 4 sinks, the tokens whose peak attention from "
        "one query, decaying by 0.95 a token, is lowest go, 16 at a time; every prompt pinned "
        "but its runs of 4 tokens heard in an earlier prompt (a template sent again), one "
        "KeyDiff vote among overflowing pins; chosen on tune chats and answers, "
        "docs/recall.md), tuned "
        "(morphkv with real queries, window 16, the newest half of the budget always kept, "
        "value-weighted scores, peak-attention persistence (--peak)), paper (the published "
        "rule: window 8, nothing else protected, evicting 8 tokens every 8 as its coarse "
        "variant) (default %(default)s).",
    )
    for knob, settings in ARGS.items():
        g.add_argument(flag(knob), default=None, **settings)
        if knob == "method":
            add_number(g, "--budget", kind=Number(int, lo=2), default=budget,
                       help="Tokens kept per sequence and KV head; must exceed --sinks + --recent")


def config_from_flags(args, seed: int = 0) -> KVCacheConfig:
    """The config the flags ask for (``UsageError`` naming the flags when it is invalid)."""
    fields = {f: getattr(args, k) for k, f in OVERRIDES.items() if getattr(args, k) is not None}
    preset = args.preset if fields.get("method", "morphkv") == "morphkv" else "paper"
    if preset == "paper" and fields.get("method") not in (None, "morphkv"):
        fields.setdefault("morphkv_value", False)
        fields.setdefault("morphkv_block", 1)  # other methods: one token per step
    memory = getattr(args, "kv_memory", None)
    try:
        return PRESETS[preset](args.budget, memory=memory, seed=seed, **fields)
    except ValueError as e:
        raise UsageError(flag_names(str(e), FLAGS)) from None


def describe(config: KVCacheConfig) -> str:
    """One line: the setting as flags would spell it."""
    if not config.rule.evicts:
        return f"method={config.method} (no bound)"
    text = f"method={config.method} budget={config.budget} sinks={config.n_sink}"
    if config.kv_memory is not None:
        text = f"method={config.method} memory={config.kv_memory} bytes budget=" + (
            f"{config.budget} sinks={config.n_sink}" if config.budget else "from the model")
    if config.rule.attention:
        text += f" window={config.window}"
    text += f" recent={config.recent}"
    if config.morphkv_value:
        text += " value-weighted"
    if config.morphkv_peak:
        text += f" peak={config.morphkv_peak:g}"
    if config.morphkv_decay != 1:
        text += f" decay={config.morphkv_decay:g}"
    if config.morphkv_pool > 1:
        text += f" pool={config.morphkv_pool}"
    if config.block > 1:
        text += f" block={config.block}"
    if config.kv_bits is not None:
        text += f" {config.kv_bits}-bit (groups of {config.kv_group_size})"
        if not config.kv_smooth:
            text += " keys unsmoothed (--no-kv-smooth)"
    if config.pin != "none":
        text += f" pin={config.pin}"
        if config.pin_rank != "rule":
            text += f" pin-rank={config.pin_rank}"
            from ..core.vote import per_layer

            text += " (keydiff per layer at this budget)" if per_layer(config) else ""
        if config.pin_replies:
            text += f" pin-replies={config.pin_replies}" + (" (while they fit)"
                                                             if config.pin_fit else "")
        if config.pin_repeats:
            text += f" pin-repeats={config.pin_repeats}"
    return text


def resolve_for_model(model, config: KVCacheConfig) -> KVCacheConfig:
    """``config`` with a ``--kv-memory`` size resolved into tokens per KV head for ``model``
    (``UsageError`` naming the flag when the size is too small); other configs as they are."""
    from ..core.memory import needs_resolving
    from ..mlxlm.builder import KVCacheBuilder

    if not needs_resolving(config):
        return config
    try:
        return KVCacheBuilder.resolve(model, config)
    except ValueError as e:
        raise UsageError(flag_names(str(e), FLAGS)) from None
