"""Rules ranked by attention: MorphKV's window (TOVA its newest row), H2O's sum, the peak."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Array, Rule, check, real

FUSIONS = ("mean", "max")


def check_decay(decay, peak: bool) -> None:
    check(real(decay) and 0 < decay <= 1, "decay", f"must be in (0, 1], got {decay!r}")
    check(decay == 1 or peak, "decay", "decays a peak: set morphkv_peak > 0 or method='peak'")


@dataclass(frozen=True)
class WindowAttention(Rule):
    """MorphKV: attention of the last ``window`` tokens' queries (``morphkv.core.rows``), fused by
    ``fusion`` (mean or max) over the window. With ``peak`` = lambda > 0 the score is
    ``max(window score, lambda * peak)``, peak the running (``decay``-ing) maximum of the
    attention each token has received (kept by the engine): a token the conversation attended
    to strongly once keeps a share of that attention while the window moves on."""

    fusion: str = "mean"
    peak: float = 0.0
    decay: float = 1.0
    attention = True
    window_rows = "all"

    def __post_init__(self) -> None:
        check(self.fusion in FUSIONS, "fusion", f"={self.fusion!r} is unknown; valid: {FUSIONS}")
        check(real(self.peak) and self.peak >= 0 and self.peak != float("inf"), "peak",
              f"must be a finite number >= 0, got {self.peak!r}")
        check_decay(self.decay, self.peak > 0)

    @property
    def running(self) -> str | None:
        return "peak" if self.peak > 0 else None

    def window_score(self, engine) -> Array:
        if self.fusion == "max":  # rows (rows, window, slots), GQA: summed over the group
            return engine.window_probs().max(axis=1).astype(engine.float)
        return engine.window_mean()

    def score(self, engine) -> Array:
        window = self.window_score(engine)
        if not self.observes:
            return window
        peak = engine.accumulated[:, : engine.slots].astype(engine.float)
        return engine.xp.maximum(window, self.peak * peak)


@dataclass(frozen=True)
class Tova(WindowAttention):
    """TOVA: the newest token's attention alone (``morphkv`` at ``window=1``)."""

    window_rows = "newest"

    def window_score(self, engine) -> Array:
        return engine.newest_probs().astype(engine.float)


@dataclass(frozen=True)
class Peak(Rule):
    """Peak attention (Scissorhands-like persistence): a token's score is the largest attention
    it ever received from one query (summed over a KV group's heads), decaying by ``decay`` per
    token since; a running max instead of H2O's running sum, O(slots) per step."""

    decay: float = 1.0
    attention = True
    running = "peak"

    def __post_init__(self) -> None:
        check_decay(self.decay, True)

    def score(self, engine) -> Array:
        return engine.accumulated[:, : engine.slots].astype(engine.float)


@dataclass(frozen=True)
class Cumulative(Rule):
    """H2O: every new token's attention row is added to a running score per stored token."""

    attention = True
    running = "sum"

    def score(self, engine) -> Array:
        return engine.accumulated[:, : engine.slots].astype(engine.float)
