"""The mixed-length level of ``morphkv bench serve --scenario load``: N requests from C concurrent
clients.

Request ``k`` of the level (clients take the next ``k`` as they become free) is: the one 8k-token
prompt (non-streamed) at k = 3, a 2k-token prompt (streamed: its time to first token is
recorded) at every k = 10 mod 25, else the short script in turn: plain, streamed and text
chats, a turn of the client's own conversation, a stream dropped after its first token, a
malformed request. Every long prompt starts with its own number, so no prompt cache can reuse
another's prefill. Also the warm-up (the same level without the 8k prompt), so the memory after
warm-up is the memory of the same concurrency and the same prompt lengths.
"""

from __future__ import annotations

import threading
import time

from .load_clients import User, long_text
from .servers import in_threads

SHORT = ["chat", "stream", "completion", "turn", "chat", "drop", "stream", "bad"]
CLASSES = {"short": ("chat", "stream", "completion", "turn"), "long2k": ("long2k",),
           "long8k": ("long8k",)}


def kind_of(k: int, with_8k: bool = True) -> str:
    if with_8k and k == 3:
        return "long8k"
    if k % 25 == 10:
        return "long2k"
    return SHORT[k % len(SHORT)]


class MixedUser(User):
    """A load client that also sends 2k- and 8k-token prompts (``kind_of``)."""

    TEXTS: dict[int, str] = {}

    def _text(self, tokens: int) -> str:
        if tokens not in self.TEXTS:
            self.TEXTS[tokens] = long_text(tokens)
        return self.TEXTS[tokens]

    def _long2k(self, n: int) -> dict:
        return self.ask("long2k", f"Document {self.i}-{n}. {self._text(2000)}\n\nSummarize "
                        "this.", stream=True)

    def _long8k(self, n: int) -> dict:
        return self.ask("long8k", f"Document {self.i}-{n}. {self._text(8000)}\n\nSummarize "
                        "this.")


def drive_mixed(users: list[MixedUser], total: int, seconds: float, with_8k: bool = True,
                label: str = "") -> tuple[list, float]:
    """Every user takes the next request number until ``total`` are taken or ``seconds`` pass;
    a progress line every 25 requests."""
    records, lock = [], threading.Lock()
    counter = iter(range(total))
    deadline = time.monotonic() + seconds
    t0 = time.perf_counter()

    def work(u: MixedUser):
        while time.monotonic() < deadline:
            with lock:
                k = next(counter, None)
            if k is None:
                return
            r = getattr(u, f"_{kind_of(k, with_8k)}")(k)
            with lock:
                records.append(r)
                if len(records) % 25 == 0:
                    bad = sum(not x["ok"] for x in records if x["kind"] != "bad")
                    print(f"    {label} {len(records)}/{total} requests, "
                          f"{time.perf_counter() - t0:.0f} s, failed good {bad}", flush=True)

    in_threads(work, users, seconds + 1200)
    return records, time.perf_counter() - t0


def by_class(records: list[dict]) -> dict:
    """Per request class (short, long2k, long8k): count, failed, p50/p95 total, median TTFT."""
    out = {}
    for name, kinds in CLASSES.items():
        rows = [r for r in records if r["kind"] in kinds]
        done = sorted(r["end"] - r["start"] for r in rows if r["ok"])
        ttft = sorted(r["ttft_s"] for r in rows if r["ok"] and r.get("ttft_s") is not None)
        out[name] = {
            "requests": len(rows), "failed": len(rows) - len(done),
            "p50_s": done[len(done) // 2] if done else None,
            "p95_s": done[min(len(done) - 1, int(0.95 * len(done)))] if done else None,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None}
    return out
