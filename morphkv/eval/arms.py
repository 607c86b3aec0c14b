"""Arms: one cache setting per spec string, parsed into a ``KVCacheConfig`` or an mlx_lm cache.

A spec is ``method[:option]...``. An option is ``knob=value`` for any ``KVCacheConfig`` knob,
by its one name (``morphkv.core.knobs``: ``window``, ``recent``, ``sinks``, ``block``,
``kv_bits``, ...; the flag of the same name is ``--window``, ...), an older spelling (``n_sink``,
``bits``, ``memory``) or its field name (``morphkv_window``), so a new core knob needs no change
here; or one of the older shorthands: a number (the window), ``mean`` / ``max`` (the fusion),
``attn`` / ``proxy`` (the scoring). Examples: ``streaming_llm``, ``morphkv:mean:32:attn`` (=
``morphkv:fusion=mean:window=32:scoring=attention``), ``morphkv:window=8:recent=64``.
``method`` is one of ``morphkv.METHODS``, a key of ``BASELINES`` (mlx_lm's own caches) or a
preset of ``morphkv.PRESETS`` (``recommended``, ``paper``: settings that scale with the budget;
options override them). ``recent=0.5`` means half the budget. Budgets come from the command,
not the spec.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from ..core.config import KVCacheConfig
from ..core.knobs import field_of
from ..core.memory import parse_size
from ..core.presets import PRESETS
from ..core.rules import METHODS
from ..mlxlm.builder import KVCacheBuilder
from ..runtime.argtypes import UsageError

SHORTHANDS = {"mean": ("morphkv_fusion", "mean"), "max": ("morphkv_fusion", "max"),
              "attn": ("scoring", "attention"), "attention": ("scoring", "attention"),
              "proxy": ("scoring", "proxy")}  # older bare parts: a value standing for its knob
F16 = "f16"  # memory=f16: the bytes of a float16 cache of the command's budget on the model
NAMED = ("morphkv_fusion", "morphkv_window", "scoring")  # spelled by the legacy arm names

# mlx_lm's own caches: name -> (model, budget, n_sink) -> per-layer caches. ``quantized8``:
# mlx_lm's 8-bit cache (unbounded), the speed reference of 8-bit attention over as many tokens
# as ``recommended(memory=...)`` holds at equal bytes
BASELINES = {
    "kvcache": lambda model, budget, n_sink: [KVCache() for _ in model.layers],
    "rotating": lambda model, budget, n_sink: [RotatingKVCache(max_size=budget, keep=n_sink)
                                               for _ in model.layers],
    "quantized8": lambda model, budget, n_sink: [QuantizedKVCache(group_size=64, bits=8)
                                                 for _ in model.layers],
}


def field_name(key: str) -> str:
    """The ``KVCacheConfig`` field an option names; a clear error for an unknown one."""
    try:
        return field_of(key)
    except ValueError as e:
        raise ValueError(f"arm option {e}") from None


# an arm spec ending ``+pin`` pins the user turns of chats (``morphkv.pin``); ``+pinN`` also
# the assistant's replies of at most N tokens of text (as ``pin_replies`` counts them; rounds
# 2-16 of docs/recall.md counted them as rendered, role markers included: ~5 tokens more)
_PIN = re.compile(r"\+pin(\d*)$")


def unpinned(spec: str) -> tuple[str, bool, int]:
    """(the spec without ``+pin`` / ``+pinN``, whether it had one, N: the assistant's replies
    of at most N tokens, as the template renders them, are pinned with the user's turns)."""
    m = _PIN.search(spec)
    return (spec[: m.start()], True, int(m.group(1) or 0)) if m else (spec, False, 0)


def parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@dataclass(frozen=True)
class Arm:
    """One cache setting, budget aside: ``options`` from the spec over ``defaults``."""

    method: str
    options: tuple = ()  # ((field, value), ...) as written in the spec
    defaults: tuple = ()  # the command's defaults, e.g. (("morphkv_window", 8),)

    @classmethod
    def parse(cls, text: str, aliases: dict | None = None, **defaults) -> Arm:
        """``method[:option]...`` (see the module docstring); ``aliases`` renames methods."""
        method, *parts = text.strip().split(":")
        method = (aliases or {}).get(method, method)
        if method not in METHODS and method not in BASELINES and method not in PRESETS:
            raise ValueError(
                f"arm {text!r}: unknown method {method!r}; valid: "
                f"{sorted(METHODS) + sorted(BASELINES) + sorted(PRESETS)}"
            )
        options = []
        for part in parts:
            if "=" in part:
                key, value = part.split("=", 1)
                options.append((field_name(key.strip()), parse_value(value.strip())))
            elif part.isdigit():
                options.append(("morphkv_window", int(part)))
            elif part in SHORTHANDS:
                options.append(SHORTHANDS[part])
            else:
                raise ValueError(f"cannot parse arm part {part!r} in {text!r} (not field=value)")
        defaults = tuple((field_name(k), v) for k, v in defaults.items())
        return cls(method, tuple(options), defaults)

    def get(self, name: str) -> Any:
        if self.method in PRESETS:  # a preset's own values (at a nominal budget)
            return getattr(self.config(4096), name)
        merged = {**dict(self.defaults), **dict(self.options)}
        return merged[name] if name in merged else getattr(KVCacheConfig(), name)

    @property
    def window(self) -> int:
        return self.get("morphkv_window")

    @property
    def fusion(self) -> str:
        return self.get("morphkv_fusion")

    @property
    def scoring(self) -> str:
        return self.get("scoring")

    @property
    def is_baseline(self) -> bool:
        return self.method in BASELINES

    @property
    def name(self) -> str:
        """``method[_fusion]_w<window>[_attn]`` plus ``_<option><value>`` per other option."""
        if self.method == "full" or self.is_baseline or self.method in PRESETS:
            name = self.method
        else:
            name = self.method + (f"_{self.fusion}" if self.method == "morphkv" else "")
            name += f"_w{self.window}" + ("_attn" if self.scoring == "attention" else "")
        for key, value in self.options:
            if key not in NAMED or self.method in PRESETS:
                name += f"_{key.removeprefix('morphkv_').removeprefix('kv_')}{value}"
        return name

    def config(self, budget: int, model=None, **extra) -> KVCacheConfig:
        """The validated config at ``budget``; ``extra`` (e.g. a seed) under the spec.
        With ``memory=SIZE`` (``64M``, bytes) or ``memory=f16`` (the bytes of a float16 cache
        of ``budget`` tokens on ``model``; needs it) the budget is left for
        ``KVCacheBuilder.for_model`` to resolve from that memory, and ``recent=0.5`` becomes a
        share of the resolved budget."""
        # arms feed whole texts and chats as prefills: pin="prompt" would pin all of them, so
        # an arm pins only what it says (``pin=prompt``, or ``+pin``: the chat's user turns)
        fields = {"pin": "none", **{field_name(k): v for k, v in extra.items()}}
        if self.method not in PRESETS:  # a preset sets its own values; the spec overrides them
            fields.update(self.defaults)
        fields.update(self.options)
        memory = fields.pop("kv_memory", None)
        if memory == F16:  # before a model is known, 1 byte: enough to check the spec
            memory = 1 if model is None else f16_bytes(model, budget)
        elif memory is not None:
            memory = parse_size(memory) if isinstance(memory, str) else int(memory)
        for key, value in list(fields.items()):  # recent=0.5: a fraction of the budget
            if key == "morphkv_recent" and isinstance(value, float) and 0 < value < 1:
                if memory is not None:
                    fields["morphkv_recent_share"] = fields.pop(key)
                else:
                    fields[key] = max(1, int(budget * value))
        try:
            if self.method in PRESETS:
                return PRESETS[self.method](int(budget), memory=memory, **fields)
            fields.update(method=self.method, morphkv_budget=int(budget))
            if memory is not None:
                fields.update(morphkv_budget=0, kv_memory=memory)
            return dataclasses.replace(KVCacheConfig(), **fields).validate(resolved=memory is None)
        except (TypeError, ValueError) as e:
            raise ValueError(f"arm {self.name} at budget {budget}: {e}") from None

    def caches(self, model, budget: int, n_sink: int = 4) -> list:
        """Per-layer caches for ``model`` (the attention hook is attached when needed)."""
        if self.is_baseline:
            return BASELINES[self.method](model, budget, n_sink)
        config = self.config(budget, model, n_sink=n_sink)  # names the arm itself
        try:
            return KVCacheBuilder.for_model(model, config)
        except ValueError as e:  # a setting this model cannot hold: the command's one line
            raise UsageError(f"arm {self.name} on this model: {e}") from e


def f16_bytes(model, tokens: int) -> int:
    """Bytes of a float16 cache of ``tokens`` tokens over the model's morphkv layers (what a
    GPU user's ``RotatingKVCache(tokens)`` holds): K+V rows of 2-byte elements."""
    from ..mlxlm.memory import layer_shapes

    return sum(s.kv_heads * (s.key_dim + s.value_dim) * 2 * tokens for s in layer_shapes(model))


NOFACT = "nofact"  # a chat arm: the full cache on the chat without its facts (guessing)


@dataclass(frozen=True)
class Cell:
    """One arm of a command's ``--arms``: ``spec[+pin[N]][@N]``; ``arm`` None for ``nofact``."""

    label: str  # as written
    arm: Arm | None
    size: int  # tokens: N of ``@N``, else the command's
    pins: bool = False  # ``+pin``: the chat's user turns (a prompt) pinned (``morphkv.pin``)
    replies: int = 0  # ``+pinN``: and the assistant's replies of at most N tokens
    share: int = 0  # ``@/K``: 1/K of each item's tokens (``size`` set per item; answers only)


def cells(text: str, size: int, nofact: bool = False, shares: bool = False,
          **defaults) -> list[Cell]:
    """``--arms``: comma-separated labels; a piece ``field=value`` with no ``:`` continues the
    previous spec (``morphkv:window=32,fusion=max``). ``shares``: ``@/K`` (1/K of each item's
    tokens) is accepted. ValueError names a bad one."""
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    if not specs:
        raise ValueError("--arms is empty")
    out = []
    for label in specs:
        spec, at, n = label.rpartition("@") if "@" in label else (label, "", "")
        share = int(n[1:]) if shares and n[1:].isdigit() and n.startswith("/") else 0
        if at and not share and (not n.isdigit() or int(n) < 1):
            raise ValueError(f"arm {label!r}: the size after '@' must be a positive token count"
                             + (" or /K, K >= 1 (1/K of each text's tokens)" if shares else ""))
        base, pinned, replies = unpinned(spec)
        if nofact and base == NOFACT and pinned:
            raise ValueError(f"arm {label!r}: nofact is the full cache, nothing to pin")
        arm = None if nofact and base == NOFACT else Arm.parse(base.replace(",", ":"), **defaults)
        out.append(Cell(label, arm, int(n) if at and not share else size, pinned, replies, share))
    return out


def parse_arms(specs, aliases: dict | None = None, **defaults) -> list[Arm]:
    return [s if isinstance(s, Arm) else Arm.parse(s, aliases, **defaults) for s in specs]


def grid_arms(base: str, grid: list[str]) -> list[str]:
    """``--grid`` items ``key=v1/v2/...``: an arm spec over ``base`` for every combination
    (``["window=8/32"]`` -> ``base:window=8``, ``base:window=32``)."""
    import itertools

    values = {}
    for item in grid:
        key, _, options = item.partition("=")
        if not options:
            raise SystemExit(f"morphkv: error: --grid {item!r}: expected key=v1/v2/...")
        values[key] = options.split("/")
    return [base + "".join(f":{k}={v}" for k, v in zip(values, combo, strict=True))
            for combo in itertools.product(*values.values())] if values else []
