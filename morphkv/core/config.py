"""KVCacheConfig: the settings of one cache, checked when a cache is built."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .repeats import MAX_RUN
from .rules import METHODS, Rule, make_rule
from .rules.attention import FUSIONS

SCORINGS = ("auto", "attention", "proxy")
ENGINES = ("auto", "mlx")
PIN_POLICIES = ("none", "prompt")
# how pinned tokens rank among themselves once they alone overflow (``pin_rank``)
PIN_RANKS = ("rule", "keydiff", "keydiff-span", "vote", "vote-span")
VOTES = ("vote", "vote-span")  # the pin ranks run by the model's forward pass (``core.vote``)


@dataclass(frozen=True)
class KVCacheConfig:
    """Settings shared by every layer's cache.

    Args:
        method: eviction rule, one of ``morphkv.METHODS``.
        head_dim: key head dimension (the logit scale is ``1/sqrt(head_dim)``); inferred from
            the keys or the model when ``None``.
        morphkv_budget: most tokens stored per sequence and KV head after every update.
        morphkv_n_sink: first tokens never evicted (ignored by ``sliding_window``).
        morphkv_window: recent tokens protected from eviction; for ``morphkv`` also the number
            of recent queries whose attention ranks the older tokens.
        morphkv_fusion: how the window's attention rows are fused: ``"mean"`` or ``"max"``.
        morphkv_recent: most recent tokens protected from eviction (>= window); ``None``
            means ``morphkv_window`` (the paper's rule). A larger value keeps a recency floor
            while the window's queries rank the older tokens.
        morphkv_value: rules that read attention (morphkv, tova, h2o, peak) multiply a token's
            attention score by the norm of its value vector (what it would add to the output),
            as kvpress's ExpectedAttention does.
        morphkv_peak: lambda >= 0 fusing each token's peak attention into the window's score:
            ``max(window score, lambda * peak)`` (``morphkv`` and ``tova``; 0, the default, is
            the paper's rule). Method ``peak`` ranks by the peak alone.
        morphkv_decay: factor in (0, 1] by which a peak decays per token (1: a running max).
        morphkv_pool: span pooling kernel (odd, >= 1) of attention rules: a token's score is
            the largest among the ``pool`` stored tokens centred on it (1: no pooling).
        scoring: ``"attention"`` ranks by the model's real queries (needs the attention hook,
            ``morphkv.attach``, which ``KVCacheBuilder.for_model`` installs); ``"proxy"`` lets
            the stored keys stand in for queries (any cache, no hook); ``"auto"`` (default) is
            ``"attention"`` for caches built for a supported model and ``"proxy"`` otherwise.
        seed: seed of the ``random`` rule.
        kv_bits: storage precision: ``None`` stores keys/values in the dtype they arrive in;
            4 or 8 stores them quantized (MLX affine quantization, as mlx_lm's
            ``QuantizedKVCache``) and attention runs through mlx_lm's quantized path.
        kv_group_size: elements sharing one scale and bias when quantized (32, 64 or 128;
            must divide head_dim).
        kv_smooth: with ``kv_bits``, on a model whose key projection adds a bias (Qwen2), store
            keys with its outlier channels divided out and the queries multiplied back
            (``morphkv.mlxlm.keyscale``: folded into the model's weights by ``patch_model`` /
            ``KVCacheBuilder.for_model``, logits unchanged); no effect elsewhere.
        morphkv_block: tokens evicted at once (int >= 1): once ``budget`` tokens are stored,
            the next token triggers evicting the ``block`` lowest-scoring unprotected ones, and
            the next ``block - 1`` tokens fill the freed slots (1: evict one per token).
        kv_memory: bytes per sequence over every layer holding a ``MorphKVCache`` (K/V storage
            plus selection state, as ``nbytes`` counts). With ``morphkv_budget=0`` the budget is
            resolved from the model's shape (``KVCacheBuilder.for_model`` / ``patch_model``,
            ``morphkv.core.memory``): the most tokens per KV head whose caches hold at most
            this many bytes. A resolved config keeps it (what was asked).
        morphkv_recent_share: the recency floor as a share of the budget, in [0, 1):
            ``recent = max(window, int(share x budget))``; for a budget resolved from
            ``kv_memory``. Exclusive with ``morphkv_recent``.
        engine: where statistics and selection run: ``"mlx"`` (the one engine, on the device)
            or ``"auto"`` (the same). ``"host"`` (the float64 engine removed in issue 43) raises.
        pin: what the cache pins by itself (``morphkv.core.pins``: evicted last).
            ``"prompt"``: the tokens of every multi-token update (a prefill: a prompt, a chat
            turn's new tokens, a server request's uncached tokens) and the two one-token
            updates right after it (mlx_lm feeds a prompt's last token alone, and a prefill
            may end in a one-token chunk); other tokens the model generates one at a time are
            not. ``"none"``: only what ``pin()`` is given.
            ``recommended(memory=...)`` sets ``"prompt"``.
        pin_rank: which pinned tokens go first once the pins alone overflow the budget
            (``morphkv.core.rules.pin_scorer``): ``"rule"``: the rule's own score (recency:
            the oldest); ``"keydiff"``: key geometry (the pinned key most like the mean key
            goes: a template's tokens repeated every turn before a name or number said once);
            ``"keydiff-span"``: that score max-pooled over 5 neighbours, so a word's
            sub-tokens stay or go together; ``"vote"``: one KeyDiff ranking averaged over every
            layer and KV head decides, before each prefill chunk, which pinned tokens stay
            pinned in every layer alike (``morphkv.core.vote``; a layer that must still take
            a pinned token ranks as "keydiff"); ``"vote-span"``: that vote with each token's
            averaged score max-pooled over 5 pinned neighbours, so the words around a kept
            name ("moved from ... to") stay with it. Unpinned tokens always go before pinned
            ones.
        pin_replies: with ``pin="prompt"`` (no effect otherwise), when a prompt arrives,
            the model's tokens since the last pinned range (its reply) are pinned too if there
            are at most this many: a short answer (a name, a number, a decision) is kept as the
            user's words are; long explanations are not. 0: off. ``recommended()`` sets 48.
        pin_fit: with ``pin_replies``, pin a reply only while the pinned positions, the reply
            with them, still fit in the budget: once a long chat's pins alone fill the cache,
            its later replies go before the user's words instead of crowding them out.
        pin_repeats: with ``pin="prompt"``, a prompt token in a run of this many tokens that an
            earlier prompt of the same row held is not pinned (``morphkv.core.repeats``: a chat
            template re-sent every turn); needs the model's forward pass (``patch_model`` /
            ``attach`` watch it). 0: off; else 2 to 16.
    """

    method: str = "morphkv"
    head_dim: int | None = None
    morphkv_budget: int = 512
    morphkv_n_sink: int = 4
    morphkv_window: int = 8
    morphkv_fusion: str = "mean"
    morphkv_recent: int | None = None
    morphkv_value: bool = False
    morphkv_peak: float = 0.0
    morphkv_decay: float = 1.0
    morphkv_pool: int = 1
    scoring: str = "auto"
    seed: int = 0
    kv_bits: int | None = None
    kv_group_size: int = 64
    kv_smooth: bool = True
    morphkv_block: int = 1
    kv_memory: int | None = None
    morphkv_recent_share: float | None = None
    engine: str = "auto"
    pin: str = "none"
    pin_rank: str = "rule"
    pin_replies: int = 0
    pin_fit: bool = False
    pin_repeats: int = 0

    @property
    def default_engine(self) -> str:
        """What ``engine="auto"`` selects: ``"mlx"``, the one engine (issue 43)."""
        return "mlx"

    @property
    def scheduled(self) -> bool:
        """Does the rule, pinned tokens included, rank without attention (recency, KeyDiff;
        ``pin_rank`` "rule" or "keydiff")? The MLX engine then decides a chunk's evictions
        before its queries attend, one attention per chunk (``core.device_schedule``)."""
        rule = make_rule(self)
        return rule.scheduled is not None and self.pin_rank != "keydiff-span"

    @property
    def pins_by_keys(self) -> bool:
        """Do a layer's overflowing pinned tokens rank by KeyDiff (``pin_rank`` "keydiff", or
        a vote where the model-level vote has not made room: ``core.vote``)?"""
        return self.pin_rank == "keydiff" or self.pin_rank in VOTES

    @property
    def rule(self):
        """The class of ``method``'s rule (``morphkv.core.rules``): what it reads."""
        return METHODS.get(self.method, Rule)

    @property
    def budget(self) -> int:
        return self.morphkv_budget

    @property
    def block(self) -> int:
        return self.morphkv_block

    @property
    def window(self) -> int:
        return self.morphkv_window

    @property
    def recent(self) -> int:
        """Most recent tokens protected from eviction."""
        if self.morphkv_recent is not None:
            return self.morphkv_recent
        if self.morphkv_recent_share:
            return max(self.morphkv_window, int(self.morphkv_recent_share * self.morphkv_budget))
        return self.morphkv_window

    @property
    def n_sink(self) -> int:
        """Protected first tokens; none for a rule without sinks (``sliding_window``)."""
        return self.morphkv_n_sink if self.rule.sinks else 0

    def validate(self, resolved: bool = True) -> KVCacheConfig:
        """Raise ``ValueError`` naming the field and its bound; return self when valid.
        ``resolved=False`` also accepts ``morphkv_budget=0`` with ``kv_memory`` (a budget
        still to be resolved from a model's shape); a cache needs a resolved one."""
        for name in ("morphkv_budget", "morphkv_n_sink", "morphkv_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ValueError(f"head_dim must be a positive int or None, got {self.head_dim!r}")
        if self.morphkv_window < 1:
            raise ValueError(f"morphkv_window must be >= 1, got {self.morphkv_window}")
        if self.morphkv_n_sink < 0:
            raise ValueError(f"morphkv_n_sink must be >= 0, got {self.morphkv_n_sink}")
        if not isinstance(self.morphkv_value, bool):
            raise ValueError(f"morphkv_value must be True or False, got {self.morphkv_value!r}")
        if self.morphkv_fusion not in FUSIONS:  # checked for every rule, as before rules owned it
            raise ValueError(f"morphkv_fusion={self.morphkv_fusion!r} is unknown; valid: {FUSIONS}")
        make_rule(self)  # the method, and the knobs of its rule (fusion, peak, pool, ...)
        if self.morphkv_recent is not None:
            if not isinstance(self.morphkv_recent, int) or isinstance(self.morphkv_recent, bool):
                raise ValueError(
                    f"morphkv_recent must be an int or None, got {self.morphkv_recent!r}"
                )
            if self.morphkv_recent < self.morphkv_window:
                raise ValueError(
                    f"morphkv_recent must be >= morphkv_window = {self.morphkv_window}, "
                    f"got {self.morphkv_recent}"
                )
        block = self.morphkv_block
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"morphkv_block must be an int >= 1, got {block!r}")
        self._validate_memory()
        if self.morphkv_budget == 0 and self.kv_memory is not None:
            if resolved:
                raise ValueError(
                    f"kv_memory={self.kv_memory} has no budget resolved yet: build the caches "
                    "with KVCacheBuilder.for_model / patch_model (they read the model's shape) or "
                    "morphkv.core.memory.resolve"
                )
        elif self.morphkv_budget < self.n_sink + self.recent + block:
            what = "window" if self.morphkv_recent is None else "recent"
            least = f"exceed n_sink + {what} = {self.n_sink} + {self.recent} = " + str(
                self.n_sink + self.recent
            )
            if block > 1:
                least = (f"be at least n_sink + {what} + block = {self.n_sink} + {self.recent} "
                         f"+ {block} = {self.n_sink + self.recent + block}")
            raise ValueError(f"morphkv_budget must {least}, got {self.morphkv_budget}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring={self.scoring!r} is unknown; valid: {SCORINGS}")
        if self.engine == "host":
            raise ValueError("engine='host' is gone: the float64 host engine was removed "
                             "(issue 43); every rule runs on the MLX engine (engine='auto')")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} is unknown; valid: {ENGINES}")
        if self.pin not in PIN_POLICIES:
            raise ValueError(f"pin={self.pin!r} is unknown; valid: {PIN_POLICIES}")
        if self.pin_rank not in PIN_RANKS:
            raise ValueError(f"pin_rank={self.pin_rank!r} is unknown; valid: {PIN_RANKS}")
        if not isinstance(self.pin_replies, int) or isinstance(self.pin_replies, bool) or \
                self.pin_replies < 0:
            raise ValueError(f"pin_replies must be an integer >= 0, got {self.pin_replies!r}")
        if not isinstance(self.pin_fit, bool):
            raise ValueError(f"pin_fit must be True or False, got {self.pin_fit!r}")
        if type(self.pin_repeats) is not int or not (self.pin_repeats == 0 or
                                                      2 <= self.pin_repeats <= MAX_RUN):
            raise ValueError(f"pin_repeats must be 0 (off) or an integer in [2, {MAX_RUN}], "
                             f"got {self.pin_repeats!r}")
        self._validate_storage()
        return self

    def _validate_memory(self) -> None:
        """kv_memory, morphkv_recent_share."""
        memory, share = self.kv_memory, self.morphkv_recent_share
        if memory is not None and (
            not isinstance(memory, int) or isinstance(memory, bool) or memory < 1
        ):
            raise ValueError(f"kv_memory must be a positive int (bytes) or None, got {memory!r}")
        if share is not None:
            if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share < 1:
                raise ValueError(f"morphkv_recent_share must be in [0, 1), got {share!r}")
            if self.morphkv_recent is not None:
                raise ValueError("set morphkv_recent or morphkv_recent_share, not both")

    def _validate_storage(self) -> None:
        from .quant import BITS, GROUP_SIZES

        def bad(value, allowed) -> bool:
            return not isinstance(value, int) or isinstance(value, bool) or value not in allowed

        if self.kv_bits is not None and bad(self.kv_bits, BITS):
            raise ValueError(f"kv_bits must be None or one of {BITS}, got {self.kv_bits!r}")
        if bad(self.kv_group_size, GROUP_SIZES):
            raise ValueError(
                f"kv_group_size must be one of {GROUP_SIZES}, got {self.kv_group_size!r}"
            )
        if not isinstance(self.kv_smooth, bool):
            raise ValueError(f"kv_smooth must be True or False, got {self.kv_smooth!r}")
        if self.kv_bits is not None and self.head_dim is not None:
            if self.head_dim % self.kv_group_size:
                raise ValueError(
                    f"kv_group_size={self.kv_group_size} must divide head_dim={self.head_dim}"
                )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVCacheConfig:
        """The config saved by ``to_json``; a malformed one raises ``ValueError``. A config
        saved before ``kv_smooth`` existed with ``kv_bits`` stored its keys unsmoothed: it
        reads back as ``kv_smooth=False``, so a check against the running config sees the
        difference (a float config keeps the default: the field changes nothing there)."""
        try:
            fields = json.loads(text)
            if isinstance(fields, dict) and "kv_smooth" not in fields:
                fields["kv_smooth"] = fields.get("kv_bits") is None
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"saved cache config is malformed: {e}") from None
