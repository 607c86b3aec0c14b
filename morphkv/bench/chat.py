"""A long scripted chat: cache bytes, MLX peak memory and time per turn, morphkv vs mlx_lm.

The same ``--turns`` user messages (``--user-tokens`` tokens of Python-docs prose each) go
through ``morphkv chat``'s own ``Conversation`` twice: with a morphkv cache (``--preset``,
``--budget``) and with mlx_lm's default cache (a growing ``KVCache`` per layer). Each reply is
``--reply-tokens`` greedy tokens (end of turn masked: every turn costs the same). Per turn: new
tokens, cache bytes (``nbytes``), MLX peak memory, prefill, decode and wall time, load average.
At the end the morphkv session is saved and loaded (timed) and the resumed session's next reply
compared with the uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from ..eval import plots
from ..eval.runner import Evaluation, add_flags, markdown_table, standard

NAME = "chat"
TIMING_MESSAGE = ("Summarize: a for statement repeats its body once for each item of a "
                  "sequence, and the else clause runs when the loop ends without break.")


DEFAULTS = {"turns": 50, "budget": 512, "user_tokens": 40, "reply_tokens": 24}
QUICK = {"turns": 8, "budget": 64, "user_tokens": 24, "reply_tokens": 8}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        *standard(NAME, "model", "out", "no_plot"),
        ("--preset", "recommended", "morphkv preset"),
        ("--budget", DEFAULTS["budget"], "tokens kept per KV head"),
        ("--turns", DEFAULTS["turns"], "user turns"),
        ("--user-tokens", DEFAULTS["user_tokens"], "tokens of prose per user message"),
        ("--reply-tokens", DEFAULTS["reply_tokens"], "tokens per reply (end of turn masked)"),
        ("--timing-repeats", 3, "interleaved re-runs of turn 5 and the last turn, timed"),
        ("--arms", ["morphkv", "kvcache"], "morphkv and/or kvcache (mlx_lm's default cache)"),
        ("--quick", False, "a short run (8 turns, budget 64, short messages) for tests/CI"),
    ])


def _one_turn(conv, message, args) -> float:
    """Seconds of one turn: ``--reply-tokens`` greedy tokens, the end of turn masked."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    def mask(tokens, logits):
        logits[..., list(conv.tokenizer.eos_token_ids)] = -mx.inf
        return logits

    start = time.perf_counter()
    for _ in conv.turn(message, max_tokens=args.reply_tokens, sampler=make_sampler(0.0),
                       logits_processors=[mask]):
        pass
    return time.perf_counter() - start


def timing_trials(snapshots: dict, message: str, args) -> dict:
    """The same next turn from the conversation after turn 5 and after the last turn, run
    alternately ``--timing-repeats`` times on fresh copies (machine load drifts alike)."""
    times: dict = {name: [] for name in snapshots}
    for _ in range(args.timing_repeats):
        for name, snap in snapshots.items():
            times[name].append(_one_turn(snap.copy(), message, args))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    names = list(snapshots)
    return {"after_turn": names, "seconds": times, "median_s": median,
            "ratio": median[names[-1]] / median[names[0]], "load_avg": os.getloadavg()[0]}


def resume_check(conv, model, tokenizer, config, args) -> dict:
    """Save and load the session (timed), then compare the next greedy reply."""
    from mlx_lm.sample_utils import make_sampler

    from ..chat import session
    from ..chat.conversation import Conversation

    fp = session.model_fingerprint(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.safetensors"
        save_s = session.save(path, conv, "bench", fp)
        size = path.stat().st_size
        loaded = session.load(path, model, "bench", fp, config)
    resumed = Conversation(model, tokenizer, config)
    resumed.resume(loaded)  # as morphkv chat --resume does
    nxt = "Thank you. What was the first thing I asked you to summarize?"
    replies = []
    for c in (conv, resumed):
        "".join(c.turn(nxt, max_tokens=args.reply_tokens, sampler=make_sampler(0.0)))
        replies.append(c.last.tokens)
    return {"save_s": save_s, "load_s": loaded.seconds, "file_bytes": size,
            "same_next_reply": replies[0] == replies[1], "reply_tokens": len(replies[0])}


class Chat(Evaluation):
    """Every arm (an item) over the same user messages; the session check after morphkv's."""

    name, key, command, stem_of = NAME, "rows", "morphkv bench serve", "chat{_quick}"

    def arms(self) -> list:
        a = self.args
        if a.quick:  # smaller defaults; flags given explicitly still win
            for name, value in QUICK.items():
                if getattr(a, name) == DEFAULTS[name]:
                    setattr(a, name, value)
        unknown = set(a.arms) - {"morphkv", "kvcache"}
        if unknown or not a.arms:
            raise ValueError(f"--arms: choose from morphkv, kvcache (got "
                             f"{','.join(sorted(unknown)) or 'none'})")
        from ..core.presets import PRESETS

        self.config = PRESETS[a.preset](a.budget)
        self.info.update(config=self.config.to_json(), timing={}, resume=None)
        return a.arms

    def items(self, model, tok):
        from ..eval.texts import prose_documents

        n, tokens = self.args.turns, self.args.user_tokens
        docs = prose_documents(tok, tokens, n)
        if len(docs) < n:
            raise SystemExit(f"morphkv: error: the prose has fewer tokens than --turns x "
                             f"--user-tokens = {n * tokens}")
        self.messages = [f"Summarize: {tok.decode(d).strip()}" for d in docs]
        return self.arm_list

    def steps(self, arms) -> int:
        return self.args.turns * len(arms)

    def measure(self, model, tok, arm, arms, bar) -> list:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from ..chat.conversation import Conversation

        factory = None if arm == "morphkv" else (lambda: make_prompt_cache(model))
        conv = Conversation(model, tok, self.config, make_caches=factory)
        rows, snapshots, args = [], {}, self.args
        for message in self.messages:
            mx.reset_peak_memory()
            wall = _one_turn(conv, message, args)
            turn, resp = conv.last, conv.last.last
            rows.append({
                "arm": arm, "turn": turn.number, "new_tokens": len(turn.prompt),
                "reply_tokens": len(turn.tokens), "seen": conv.seen(),
                "kept": max(getattr(c, "tokens_kept", getattr(c, "offset", 0))
                            for c in conv.caches),
                "cache_bytes": conv.cache_bytes(), "peak_bytes": int(mx.get_peak_memory()),
                "active_bytes": int(mx.get_active_memory()),
                "prefill_s": len(turn.prompt) / resp.prompt_tps,
                "decode_s": len(turn.tokens) / resp.generation_tps, "turn_s": wall,
                "load_avg": os.getloadavg()[0],
            })
            bar.update(1, f"{arm} turn {turn.number}: {wall:.1f} s, cache "
                       f"{rows[-1]['cache_bytes'] / 2**20:.1f} MiB")
            if turn.number in (min(5, args.turns), args.turns) and args.timing_repeats:
                snapshots[f"turn {turn.number}"] = conv.copy()
        if snapshots:
            self.info["timing"][arm] = timing_trials(snapshots, TIMING_MESSAGE, args)
        if arm == "morphkv":
            self.info["resume"] = resume_check(conv, model, tok, self.config, args)
        return rows

    def report(self, rows: list, arms) -> tuple:
        """Per arm: tokens seen, cache and peak bytes, turn times; the table and the timing and
        session lines."""
        out = {}
        for arm in dict.fromkeys(r["arm"] for r in rows):
            rs = [r for r in rows if r["arm"] == arm]
            at = {r["turn"]: r for r in rs}
            full = [r for r in rs if r["seen"] > self.args.budget + 8] if arm == "morphkv" else rs
            first, last = at[min(at)], at[max(at)]
            t5 = at.get(5, first)
            early = [r["turn_s"] for r in rs if 3 <= r["turn"] <= 7] or [first["turn_s"]]
            late = [r["turn_s"] for r in rs[-5:]]
            out[arm] = {
                "turns": len(rs), "last_seen": last["seen"],
                "cache_bytes_first_last": [first["cache_bytes"], last["cache_bytes"]],
                "budget_reached_turn": full[0]["turn"] if full else None,
                "cache_bytes_after_budget": [min(r["cache_bytes"] for r in full),
                                             max(r["cache_bytes"] for r in full)] if full else [],
                "peak_growth_after_budget": (max(r["peak_bytes"] for r in full)
                                             / full[0]["peak_bytes"] - 1) if full else None,
                "peak_bytes_first_last": [first["peak_bytes"], last["peak_bytes"]],
                "turn_s_5": t5["turn_s"], "turn_s_last": last["turn_s"],
                "last_over_5": last["turn_s"] / t5["turn_s"],
                "late_over_early_median": statistics.median(late) / statistics.median(early),
                "load_avg_range": [min(r["load_avg"] for r in rs), max(r["load_avg"] for r in rs)],
            }
        cells = [[arm, s["last_seen"],
                  *(x / 2**20 for x in s["cache_bytes_first_last"] + s["peak_bytes_first_last"]),
                  100 * s["peak_growth_after_budget"] if s["peak_growth_after_budget"] is not None
                  else float("nan"), s["turn_s_5"], s["turn_s_last"], s["last_over_5"],
                  s["late_over_early_median"]] for arm, s in out.items()]
        lines = [markdown_table(["arm", "tokens seen", "cache MiB turn 1", "cache MiB last",
                                 "peak MiB turn 1", "peak MiB last", "peak growth after budget %",
                                 "turn 5 s", "last turn s", "last/5",
                                 "median last 5 / turns 3-7"], cells)]
        for arm, t in self.info["timing"].items():
            a, b = t["after_turn"][0], t["after_turn"][-1]
            lines.append(f"{arm}: the same next turn after {a} / after {b}: median "
                         f"{t['median_s'][a]:.2f} / {t['median_s'][b]:.2f} s over "
                         f"{self.args.timing_repeats} interleaved runs: {t['ratio']:.2f}x")
        if r := self.info["resume"]:
            lines.append(f"session at budget {self.args.budget}: save {r['save_s']:.3f} s, load "
                         f"{r['load_s']:.3f} s, {r['file_bytes'] / 2**20:.2f} MiB; resumed next "
                         f"reply identical: {r['same_next_reply']}")
        return out, "\n".join(lines)

    def plot(self, result: dict, path) -> None:
        rows, fig, axes = result["rows"], *plots.panels(3, 5, 4)
        for ax, key, scale, ylabel in ((axes[0][0], "cache_bytes", 2**20, "cache MiB (nbytes)"),
                                       (axes[0][1], "peak_bytes", 2**20, "MLX peak MiB per turn"),
                                       (axes[0][2], "turn_s", 1, "seconds per turn")):
            for arm in dict.fromkeys(r["arm"] for r in rows):
                rs = [r for r in rows if r["arm"] == arm]
                ax.plot([r["turn"] for r in rs], [r[key] / scale for r in rs], "-", markersize=3,
                        label=arm if arm == "kvcache" else f"{arm} (budget {self.args.budget})")
            ax.set(xlabel="turn", ylabel=ylabel, title=ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        plots.save(fig, path)


EVALUATION = Chat
