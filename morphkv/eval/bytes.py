"""``morphkv eval fidelity --mode bytes``: fidelity at equal bytes: KL to the unquantized full
cache.

Arms are ``morphkv.eval.arms`` specs: ``memory=f16`` gives an arm the bytes of a float16 cache
of ``--tokens`` tokens on the model (storage bits and tokens resolved by
``KVCacheBuilder.for_model``), an arm without ``memory`` holds ``--tokens`` tokens, ``spec+pin``
pins the conversations' user turns (``morphkv.pin``). Each text (``--split``:
``texts.split_texts``) is fed teacher-forced in exact chunks of 256 and KL(full || arm) is
averaged over the SAME positions for every arm: from the first one a cache of ``--tokens``
tokens lacks a token. The reference is mlx_lm's unquantized ``KVCache``, so quantization error
counts. Per arm: bytes held (``nbytes``: storage + selection state), tokens per KV head, KL per
text, mean and worst ratio to ``--reference`` (default ``streaming_llm`` at ``--tokens`` in the
model's dtype: what ``RotatingKVCache(tokens, keep=4)`` keeps decoding token by token; mlx_lm's
class is not the reference: a multi-token chunk's queries do not see its kept sinks, which
would flatter every other arm). ``--mode state``: ``State``.
"""

from __future__ import annotations

import argparse

from ..core.pins import pin
from ..core.quant import dims
from ..mlxlm.turns import user_positions
from . import plots
from .arms import Arm, cells
from .metrics import held_bytes, position_kl, reference_logprobs
from .models import prefill
from .runner import Evaluation, add_flags, markdown_table, standard
from .texts import CONVERSATIONS, split_texts

NAME = "bytes"
DEFAULT_ARMS = ("h2o,streaming_llm:memory=f16:bits=8,recommended:memory=f16,"
                "recommended:memory=f16:peak=1")
CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--arms", DEFAULT_ARMS, "comma-separated arm specs (memory=f16: the bytes of a "
         "float16 cache of --tokens tokens)"),
        ("--tokens", [128], "comma-separated token counts (the f16 reference sizes)"),
        ("--split", "heldout", "texts: tune or heldout"),
        ("--reference", "streaming_llm", "the arm KL ratios are taken to"),
        ("--prose-tokens", 1024, "tokens of the prose text"),
        ("--continuation-tokens", 600, "tokens of the model's own continuation"),
        ("--conversation-tokens", 0, "cut each conversation to its first N tokens (0: whole)"),
        *standard(NAME, "model", "out"),
        ("--stem", None, "output file stem (default bytes_<split>)"),
    ])


class Bytes(Evaluation):
    """Texts x token counts x arms: KL to the unquantized full cache, bytes held."""

    name, key, command = NAME, "rows", "morphkv eval fidelity --mode bytes"
    stem_of = "bytes_{split}"

    def arms(self) -> list:
        found = cells(self.args.arms, 0)  # spec+pin: the conversations' user turns pinned
        if self.args.reference not in [c.label for c in found]:
            found.insert(0, cells(self.args.reference, 0)[0])
        return found

    def items(self, model, tok):
        a = self.args
        texts = split_texts(tok, model, a.split, a.prose_tokens, a.continuation_tokens,
                            a.conversation_tokens)
        self.info["texts"] = {k: len(v) for k, v in texts.items()}
        return texts.items()

    def measure(self, model, tok, item, arms, bar) -> list:
        """Per token count and arm: mean KL(full || arm) from the first position a cache of
        that many tokens lacks a token; bytes and tokens held."""
        (name, tokens), rows = item, []
        ref = reference_logprobs(model, tokens)
        for budget, c in ((b, c) for b in self.args.tokens for c in arms):
            caches = c.arm.caches(model, budget, 4)
            if c.pins and name.startswith("conversation"):  # the conversation's user turns
                pin(caches, user_positions(tok, CONVERSATIONS[int(name[12:])]))
            n, total = position_kl(model, caches, tokens, ref, budget + 1, budget + 1, CHUNK)
            held = [k.config.budget for k in caches if hasattr(k, "config")]
            rows.append(row := {"text": name, "arm": c.label, "f16_tokens": budget,
                                "kl": total / max(n, 1), "positions": n,
                                "nbytes": int(sum(held_bytes(k) for k in caches)),
                                "tokens": max(held) if held else budget})
            print(f"{name} {c.label} @{budget}: KL {row['kl']:.4f}, {row['tokens']} tokens, "
                  f"{row['nbytes'] / 2**20:.2f} MiB", flush=True)
        return rows

    def report(self, rows: list, arms) -> tuple:
        """Per (arm, token count): KL per text, its ratio to the reference arm's, mean and
        worst; the table."""
        out, reference = [], self.args.reference
        for arm, budget in dict.fromkeys((r["arm"], r["f16_tokens"]) for r in rows):
            mine = {r["text"]: r for r in rows if (r["arm"], r["f16_tokens"]) == (arm, budget)}
            ref = {r["text"]: r["kl"] for r in rows
                   if (r["arm"], r["f16_tokens"]) == (reference, budget)}
            ratios = {t: r["kl"] / ref[t] for t, r in mine.items() if ref.get(t)}
            out.append({
                "arm": arm, "f16_tokens": budget,
                "tokens": max(r["tokens"] for r in mine.values()),
                "mib": max(r["nbytes"] for r in mine.values()) / 2**20,
                "kl": {t: r["kl"] for t, r in mine.items()},
                "mean_kl": sum(r["kl"] for r in mine.values()) / len(mine),
                "worst_kl": max(r["kl"] for r in mine.values()),
                "ratio": ratios,
                "mean_ratio": sum(ratios.values()) / len(ratios) if ratios else None,
                "worst_ratio": max(ratios.values()) if ratios else None,
            })
        texts = list(dict.fromkeys(r["text"] for r in rows))
        return out, markdown_table(
            ["arm", "f16 tokens", "tokens", "MiB held", *[f"KL {t}" for t in texts], "mean KL",
             "worst KL", "mean ratio", "worst ratio"],
            [[s["arm"], s["f16_tokens"], s["tokens"], f"{s['mib']:.2f}",
              *[f"{s['kl'].get(t, float('nan')):.4f}" for t in texts], f"{s['mean_kl']:.4f}",
              f"{s['worst_kl']:.4f}", "-" if s["mean_ratio"] is None else f"{s['mean_ratio']:.2f}",
              "-" if s["worst_ratio"] is None else f"{s['worst_ratio']:.2f}"] for s in out])

    def plot(self, result: dict, path) -> None:
        """Mean KL against bytes held, one point per arm and token count."""
        fig, ax = plots.plt().subplots(figsize=(7.5, 4.5))
        for arm in dict.fromkeys(s["arm"] for s in result["summary"]):
            pts = sorted((s["mib"], s["mean_kl"]) for s in result["summary"] if s["arm"] == arm)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
        ax.set(xlabel="bytes held over all layers (MiB, storage + selection state)",
               ylabel="mean KL(full || arm), nats/token", yscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        plots.save(fig, path, 120)


EVALUATION = Bytes


STATE_ARMS = ("streaming_llm:memory={m}:bits=8,h2o:memory={m}:bits=8:block=16,"
              "tova:memory={m}:bits=8:block=16,peak:memory={m}:bits=8:block=16,"
              "keydiff:memory={m}:bits=8:block=16,morphkv:memory={m}:bits=8:window=16:block=16,"
              "morphkv:memory={m}:bits=8:window=16:block=1,"
              "morphkv:memory={m}:bits=8:window=16:recent=0.5:value=true:peak=0.02:block=16,"
              "recommended:memory={m},tuned:memory={m},paper:memory={m}")


class State(Evaluation):
    """What every byte of a bounded cache holds, per rule.

    Each arm (default: every evicting rule and the presets at one memory size, 8-bit storage
    where the arm says so) is fed a fixed 1,024-token ramp (bytes do not depend on the text;
    past the budget, the selection state is at its largest) and measured: tokens kept per KV
    head, bytes per slot of K/V storage and of selection state (positions, running scores,
    value norms, the window's ring, pending queries), and the state's share of all bytes
    held: every byte of state is a token recency holds instead.
    """

    name, key, command, stem_of = "state", "rows", "morphkv eval fidelity --mode state", \
        "state_bytes"

    def arms(self) -> list:
        specs = (self.args.arms or STATE_ARMS).format(m=self.args.memory).split(",")
        return [spec for spec in specs if Arm.parse(spec)]  # a bad spec: named before any work

    def measure(self, model, tok, spec, arms, bar) -> dict:
        caches = Arm.parse(spec).caches(model, 128)
        prefill(model, caches, [t % 1000 + 100 for t in range(1024)], 256)
        c = [k for k in caches if hasattr(k, "engine_nbytes")]
        slots = sum((k.config.budget + 1) * dims(k.keys)[1] for k in c)  # layers x KV heads
        storage, state = sum(k.storage_nbytes for k in c), sum(k.engine_nbytes for k in c)
        r = {"arm": spec, "tokens": c[0].config.budget, "kv_bytes_per_slot": storage / slots,
             "state_bytes_per_slot": state / slots, "state_share": state / (storage + state),
             "bytes_held": storage + state}
        print(f"{spec}: {r['tokens']} tokens, state {r['state_bytes_per_slot']:.1f} of "
              f"{r['kv_bytes_per_slot'] + r['state_bytes_per_slot']:.1f} bytes a slot "
              f"({100 * r['state_share']:.1f}%)", flush=True)
        return r

    def report(self, rows: list, arms) -> tuple:
        return None, markdown_table(
            ["arm", "tokens per KV head", "K/V bytes a slot", "state bytes a slot",
             "state share"], [[r["arm"], r["tokens"], f"{r['kv_bytes_per_slot']:.1f}",
                               f"{r['state_bytes_per_slot']:.1f}",
                               f"{100 * r['state_share']:.1f}%"] for r in rows])

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, [
            *standard("state", "model", "out"),
            ("--memory", 1572864, "bytes per sequence"),
            ("--arms", None, "comma-separated arm specs ({m} stands for --memory)"),
        ])
