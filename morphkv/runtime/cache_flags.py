"""The cache flags shared by ``morphkv generate`` and ``morphkv serve``.

``--preset`` picks a named setting (``morphkv.PRESETS``; default ``recommended``) whose values
scale with ``--budget``; every other flag left unset keeps the preset's value, and a flag that
is set overrides it. ``--method`` other than morphkv starts from the plain defaults instead
(the presets' knobs are morphkv's). Errors name the flags, not the config fields.
"""

from __future__ import annotations

import argparse

from ..core.config import ENGINES, FUSIONS, SCORINGS, KVCacheConfig
from ..core.presets import PRESETS
from .argtypes import Number, UsageError, add_number, flag_names

DEFAULT_PRESET = "recommended"
FLAGS = {  # KVCacheConfig field -> the flag that sets it (also for error messages)
    "method": "--method",
    "morphkv_budget": "--budget",
    "budget": "--budget",
    "morphkv_window": "--window",
    "window": "--window",
    "morphkv_recent": "--recent",
    "recent": "--recent",
    "morphkv_value": "--value",
    "morphkv_peak": "--peak",
    "morphkv_decay": "--decay",
    "morphkv_pool": "--pool",
    "morphkv_block": "--block",
    "block": "--block",
    "morphkv_n_sink": "--sinks",
    "n_sink": "--sinks",
    "morphkv_fusion": "--fusion",
    "scoring": "--scoring",
    "engine": "--engine",
    "seed": "--seed",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
    "kv_memory": "--kv-memory",
}
OVERRIDES = {  # argparse dest -> KVCacheConfig field
    "method": "method",
    "window": "morphkv_window",
    "recent": "morphkv_recent",
    "value": "morphkv_value",
    "peak": "morphkv_peak",
    "decay": "morphkv_decay",
    "pool": "morphkv_pool",
    "block": "morphkv_block",
    "sinks": "morphkv_n_sink",
    "fusion": "morphkv_fusion",
    "scoring": "scoring",
    "engine": "engine",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
}


def add_cache_flags(parser, budget: int) -> None:
    """The cache flags, in their own help group; ``budget`` is the command's default."""
    from ..core.rules import METHODS

    g = parser.add_argument_group("KV cache")
    g.add_argument(
        "--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
        help="Named setting: recommended (morphkv with real queries, window 16, the newest "
        "half of the budget always kept, value-weighted scores, peak-attention persistence "
        "(--peak)), paper (the published rule: "
        "window 8, nothing else protected, evicting 8 tokens every 8 as its coarse "
        "variant) (default %(default)s).",
    )
    g.add_argument(
        "--method", default=None, choices=sorted(METHODS), metavar="METHOD",
        help=f"Eviction rule, one of {', '.join(sorted(METHODS))} (default: the preset's, "
        "morphkv).",
    )
    add_number(g, "--budget", kind=Number(int, lo=2), default=budget,
               help="Tokens kept per sequence and KV head; must exceed --sinks + --recent")
    g.add_argument("--window", type=Number(int, lo=1), default=None,
                   help="Recent tokens whose queries rank the rest (an integer >= 1; default: "
                   "the preset's, 16 for recommended, 8 for paper).")
    g.add_argument("--recent", type=Number(int, lo=1), default=None,
                   help="Newest tokens never evicted, >= --window (an integer >= 1; default: "
                   "the preset's, half the budget for recommended, the window for paper).")
    g.add_argument("--value", action=argparse.BooleanOptionalAction, default=None,
                   help="Weight attention scores by the value vectors' norms (default: the "
                   "preset's, on for recommended).")
    g.add_argument("--peak", type=Number(float, lo=0), default=None,
                   help="Fuse each token's peak attention into the window score: max(window, "
                   "PEAK x peak) (a number >= 0; 0: off; default: the preset's).")
    g.add_argument("--decay", type=Number(float, lo=0, hi=1, lo_open=True), default=None,
                   help="Per-token decay of the peak (a number in (0, 1]; default: the "
                   "preset's, 1).")
    g.add_argument("--pool", type=Number(int, lo=1), default=None,
                   help="Span pooling kernel over neighbouring stored tokens (an integer >= 1, "
                   "odd; default: the preset's, 1 = none).")
    g.add_argument("--block", type=Number(int, lo=1), default=None,
                   help="Tokens evicted at once: once the budget is full, every BLOCK-th token "
                   "evicts BLOCK tokens and the tokens between only append (an integer >= 1; "
                   "budget >= sinks + recent + block; default: the preset's: 1 for "
                   "recommended, 8 for paper, 1 for other methods).")
    g.add_argument("--sinks", type=Number(int, lo=0), default=None,
                   help="First tokens never evicted (an integer >= 0; default: 4; none for "
                   "sliding_window).")
    g.add_argument("--fusion", default=None, choices=list(FUSIONS),
                   help="How morphkv fuses the window's attention rows (default: mean).")
    g.add_argument(
        "--scoring", default=None, choices=list(SCORINGS),
        help="attention: the model's real queries; proxy: stored keys stand in for queries; "
        "auto: attention where the model is supported (default: auto).",
    )
    g.add_argument(
        "--engine", default=None, choices=list(ENGINES),
        help="Where the rule's statistics and selection run: mlx (from the layer's own "
        "attention, no host sync), host (the float64 NumPy reference), auto: mlx for every "
        "evicting method (default: auto).",
    )
    g.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                   help="Store keys and values quantized to 4 or 8 bits (default: as they "
                   "arrive, unquantized).")
    g.add_argument("--kv-group-size", type=int, default=None, choices=(32, 64, 128),
                   help="Quantization group size with --kv-bits (default: 64).")
    g.add_argument("--kv-memory", type=_size, default=None, metavar="SIZE",
                   help="Bytes of KV cache per sequence over all layers (e.g. 64M, 1.5G, 512K: "
                   "K/V storage plus selection state); replaces --budget with the most tokens "
                   "per KV head that fit, stored at 8 bits for recommended unless --kv-bits "
                   "says otherwise (default: none, --budget bounds the tokens).")


def _size(text: str) -> int:
    from ..core.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_flags(args, seed: int = 0) -> KVCacheConfig:
    """The config the flags ask for (``UsageError`` naming the flags when it is invalid)."""
    fields = {f: getattr(args, a) for a, f in OVERRIDES.items() if getattr(args, a) is not None}
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
    if config.method == "full":
        return "method=full (no bound)"
    text = f"method={config.method} budget={config.budget} sinks={config.n_sink}"
    if config.kv_memory is not None:
        text = f"method={config.method} memory={config.kv_memory} bytes budget=" + (
            f"{config.budget} sinks={config.n_sink}" if config.budget else "from the model")
    if config.method in ("morphkv", "tova", "h2o", "peak"):
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
