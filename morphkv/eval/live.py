"""Live conversations: the chat runs through the entry point a user runs, replies generated.

``--live serve`` starts ``morphkv serve`` with each arm's cache flags and talks to it with the
official ``openai`` client as chat apps do (the whole history resent every turn, streamed);
``--live mlx_lm`` is mlx_lm's own chat loop after ``patch_model`` (one prompt cache, each turn
templates only its new message). An arm is a name and ``morphkv serve``'s cache flags
(``"memory=--kv-memory 1572864"``; ``mlx_lm``: mlx_lm's own cache, never patched).

Each chat (``chat_items``): ``--turns`` user turns (facts in turns 1-3), each answered live in up
to ``--reply-tokens`` greedy tokens; then each fact's question from the conversation so far (a
request with the history, or a copy of the prompt cache), judged strictly. ``:nofact`` arms run
the chats without their fact clauses. Per turn: time to the first token and the server's
resident memory. Intervals: a bootstrap over chats.

``--data said --live ...``: what the model said, the way the server and the chat loop run it.
After user turns 1 and 2 the user asks the model to invent a name (``data/said.json``); the
arm's own live reply is the value (``chat_items.name_of``), asked back at the end with the
user's facts, each arm judged against what it itself said. ``:nofact`` arms (no facts, no
asks) are judged against the first arm's names: how often the question alone finds them.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import shlex
import subprocess
import sys
import time

import numpy as np

from .chat_answers import questions
from .chat_items import (
    HEADS,
    INVENTIONS,
    WHO,
    build_chat,
    judge,
    said_asks,
    said_by,
    said_question,
    value_of,
)
from .metrics import cluster_interval
from .process import free_port, stop_process, stream_chat, wait_healthy
from .runner import Evaluation, markdown_table

NAME = "chatrecall"  # results/chatrecall/, as eval recall's other data sets
NOFACT = ":nofact"  # an arm name ending so runs the chats without their facts
MLX_LM = "mlx_lm"  # --live mlx_lm: mlx_lm's own cache (make_prompt_cache of the bare model)


def user_turns(chat, turns: int, nofact: bool) -> list[str]:
    """The chat's first ``turns`` user turns; past the chat's own (16 test, 13 tune), more
    questions of its split (``data/chat_questions.json``, never a fact clause) in an order
    fixed by the chat: the long conversations whose user turns alone overflow the budget."""
    msgs = chat.nofact if nofact else chat.messages
    said = [m["content"] for m in msgs if m["role"] == "user"]
    if turns > len(said):
        own = {m["content"] for m in chat.nofact if m["role"] == "user"}
        more = [q for q in questions(chat.split) if q not in own]
        random.Random(f"live:{chat.split}:{chat.index}").shuffle(more)
        said += more
    if turns > len(said):
        raise SystemExit(f"morphkv: error: --turns {turns}: the {chat.split} split has "
                         f"{len(said)} user turns")
    return said[:turns]


def said_mode(args) -> bool:
    """``--data said``: the chats ask the model to invent names, asked back at the end."""
    return getattr(args, "data", "chats") == "said"


def asks_of(chat, args) -> list[dict]:
    """The chat's invention asks (``--asks``: the split they come from), one after each of
    its first ``INVENTIONS`` user turns."""
    asks = said_asks(chat.split, chat.index, args.seed, getattr(args, "asks", None))
    return asks[: min(INVENTIONS, args.turns)]


def turns_of(texts: list[str], asks: list[dict]) -> list[tuple[str, dict | None]]:
    """(text, the invention ask's kind or None) per user turn: ask i follows user turn i + 1,
    as ``chat_items.build_said_chat`` places it."""
    out = []
    for i, text in enumerate(texts):
        out.append((text, None))
        if i < len(asks):
            out.append((asks[i]["ask"], asks[i]))
    return out


def talk(chats, args, say, fork, new, rss=None, names=None) -> list[dict]:
    """Every chat: its user turns (``say(state, text, tokens)`` -> (reply, first-token
    seconds), on ``new()``: a prompt cache or a history), then each question from
    ``fork(state)``; ``rss()``: the server's memory after each turn. With ``--data said``
    the names the model invented are asked too; ``names`` (chat index -> names) keeps the
    first arm's for the ``:nofact`` arms."""
    rows, names = [], {} if names is None else names
    for chat, nofact in chats:
        state, firsts, mem, invented = new(), [], [], {}
        asks = asks_of(chat, args) if said_mode(args) else []
        for text, ask in turns_of(user_turns(chat, args.turns, nofact), [] if nofact else asks):
            reply, first = say(state, text, args.reply_tokens)
            firsts.append(first)
            mem += [rss()] if rss else []
            if ask is not None:
                invented[ask["kind"]] = value_of(ask, reply)
        questions = list(chat.questions)
        if asks:
            if not nofact:
                names.setdefault(chat.index, invented)
            questions += [said_question(k, (invented or names[chat.index]).get(k["kind"], ""))
                          for k in asks]
        answers = [say(fork(state), q.text, args.answer_tokens)[0] for q in questions]
        out = {"chat": chat.index, "answers": answers, "first_token_s": firsts, "rss_mb": mem,
               "right": [bool(q.value) and judge(a, q)  # an empty name: never right
                         for a, q in zip(answers, questions, strict=True)],
               "values": [q.value for q in questions],
               "who": [said_by(q.kind, q.value) for q in questions], "invented": invented}
        if state and hasattr(state[0], "pins"):  # the patched prompt cache's pinned ranges
            out["pinned"] = state[0].pins.ranges()
        rows.append(out)
    return rows


def patch_with_flags(model, flags: list[str]) -> None:
    """``patch_model`` with ``morphkv serve``'s cache flags (``["--kv-memory", "1572864"]``)."""
    from ..mlxlm.builder import patch_model
    from ..runtime.cache_flags import add_cache_flags, config_from_flags

    parser = argparse.ArgumentParser()
    add_cache_flags(parser, budget=512)
    patch_model(model, config_from_flags(parser.parse_args(flags)))


def loop_turn(model, tok, cache, text: str, max_tokens: int):
    """One turn of mlx_lm's chat loop: (the turn's templated prompt, the greedy reply's
    ``stream_generate`` responses, on ``cache``)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                     add_generation_prompt=True)
    return prompt, stream_generate(model, tok, prompt, max_tokens=max_tokens,
                                   sampler=make_sampler(0.0), prompt_cache=cache)


def mlx_lm_chat(model, tok, flags: list[str], chats, args, names=None) -> list[dict]:
    """mlx_lm's chat loop: one prompt cache, each turn templates only its new message."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..mlxlm.builder import unpatch_model

    unpatch_model(model)
    if flags != [MLX_LM]:  # morphkv serve's cache flags
        patch_with_flags(model, flags)

    def say(cache, text: str, max_tokens: int):
        start, first, out = time.perf_counter(), None, []
        for r in loop_turn(model, tok, cache, text, max_tokens)[1]:
            first = first or time.perf_counter() - start
            out.append(r.text)
        return "".join(out), first

    rows = talk(chats, args, say, copy.deepcopy, lambda: make_prompt_cache(model), names=names)
    unpatch_model(model)
    return rows


def start_server(model: str | None, flags: list[str], log) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "morphkv", "serve", *(["--model", model] if model else []),
           "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, f"the server ({' '.join(cmd)})")
    return proc, url, " ".join(cmd)


def served_chat(model_name: str | None, flags: list[str], chats, args, log,
                names=None) -> list[dict]:
    """morphkv serve with the openai client: the whole history resent every turn."""
    import openai

    proc, url, _ = start_server(model_name, flags, log)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)

        def say(history, text: str, max_tokens: int):
            history.append({"role": "user", "content": text})
            start = time.perf_counter()
            r = stream_chat(client, history, max_tokens, temperature=0.0)
            history.append({"role": "assistant", "content": r["text"]})
            return r["text"], r["first"] and r["first"] - start

        def rss() -> float:
            with open(f"/proc/{proc.pid}/status") as f:
                line = next((ln for ln in f if ln.startswith("VmRSS:")), "VmRSS: 0 kB")
            return int(line.split()[1]) / 1024

        return talk(chats, args, say, list, list, rss, names)
    finally:
        stop_process(proc, 30)  # by its process id, also when a request failed


def held_out_chats(split: str, first: int, count: int, seed: int) -> list:
    """Chats ``first`` .. ``first + count - 1`` of ``split`` (``--first``, ``--chats``)."""
    return [build_chat(split, i, seed) for i in range(first, first + count)]


class Live(Evaluation):
    """Every arm (an item: the JSON is written after each) over the same chats, live."""

    name, key, command, stem_of = NAME, "arms", "morphkv eval recall", "{name}_live_{live}_{split}"

    def arms(self) -> list:
        """``--live-arms name=flags;name=flags`` -> [(name, flag list)]."""
        self.model = self.args.live == MLX_LM  # morphkv serve loads its own
        arms = [p.strip().partition("=") for p in self.args.live_arms.split(";") if p.strip()]
        if bad := [f"{n}={f}" for n, _, f in arms if not n.strip()]:
            raise ValueError(f"--live-arms: {bad[0]!r} has no name (name=flags)")
        if said_mode(self.args) and arms and arms[0][0].strip().endswith(NOFACT):
            raise ValueError("--data said: the first arm has no facts; a ':nofact' arm is "
                             "asked the names an arm with the facts invented before it")
        return [(name.strip(), shlex.split(flags)) for name, _, flags in arms]

    def stem(self) -> str:
        a = self.args
        return a.stem or (f"said_live_{a.live}_{a.split}" if said_mode(a) else super().stem())

    def items(self, model, tok):
        a = self.args
        self.chats = held_out_chats(a.split, a.first, a.chats, a.seed)
        self.names = {}  # --data said: chat index -> the first arm's invented names
        self.log = open(os.devnull, "w") if not a.verbose else None
        return self.arm_list

    def measure(self, model, tok, arm, arms, bar) -> dict:
        (name, flags), start = arm, time.perf_counter()
        chats = [(c, name.endswith(NOFACT)) for c in self.chats]
        if self.args.live == MLX_LM:
            rows = mlx_lm_chat(model, tok, flags, chats, self.args, self.names)
        else:
            rows = served_chat(self.args.model, flags, chats, self.args, self.log, self.names)
        hits = [r["right"] for r in rows]
        firsts = np.array([r["first_token_s"] for r in rows], float)
        out = {"arm": name, "flags": flags, "rows": rows, "right": int(sum(map(sum, hits))),
               "items": int(sum(map(len, hits))), "interval": cluster_interval(hits),
               "first_token_last_over_early": float(np.median(
                   firsts[:, -1] / np.median(firsts[:, 1:4], axis=1))),
               "seconds": time.perf_counter() - start}
        print(f"{name}: {out['right']}/{out['items']} facts (interval over {len(rows)} chats: "
              f"{out['interval']}), first token last/early turns "
              f"{out['first_token_last_over_early']:.2f}x, {out['seconds']:.0f} s", flush=True)
        return out

    def report(self, records: list, arms) -> tuple:
        """Per arm: facts right, and of the first arm's right items (the reference: own or
        full), by who said them, with a bootstrap interval over chats."""
        keys = ("right", "items", "interval", "first_token_last_over_early", "seconds")
        who = WHO if said_mode(self.args) else ("user",)
        summary = {r["arm"]: {k: r[k] for k in keys} for r in records}
        for r in records:
            summary[r["arm"]]["of_first"] = {w: of_first(r, records[0], w) for w in who}
        heads = [f"{HEADS[w]}: of {records[0]['arm']}'s" for w in who] if records else []
        return summary, markdown_table(["arm", *keys, *heads], [
            [r["arm"], *(r[k] for k in keys), *map(shown, summary[r["arm"]]["of_first"].values())]
            for r in records])


def of_first(arm: dict, first: dict, who: str) -> dict:
    """The items ``who`` said that the ``first`` arm got right, and how many ``arm`` got right
    (chats matched by index; a chat's questions come in one order in every arm; whether a name
    echoes its ask is the first arm's: each arm invents its own)."""
    ref = {r["chat"]: r for r in first["rows"]}
    hits = [[h for h, g, w in zip(r["right"], ref[r["chat"]]["right"], ref[r["chat"]]["who"],
                                  strict=True) if g and w == who]
            for r in arm["rows"] if r["chat"] in ref]
    return {"right": int(sum(map(sum, hits))), "of": int(sum(map(len, hits))),
            "interval": cluster_interval(hits)}


def shown(share: dict) -> str:
    """``5 of 11 = 45% [33, 60]``."""
    ci = share["interval"]
    tail = f" = {ci[0]:.0%} [{100 * ci[1]:.0f}, {100 * ci[2]:.0f}]" if ci else ""
    return f"{share['right']} of {share['of']}{tail}"
