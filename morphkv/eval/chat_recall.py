"""``morphkv eval recall``: does a bounded cache remember what was said in a chat?

Chats (``chat_items``): model-written assistant turns, three facts said in passing, one of them
updated later, each asked in a new turn at the end with a question worded unlike its statement,
the statements 3-6 token budgets back. Every arm prefills each chat ONCE (exact chunks through
the attention hook); each question is then asked from a copy of that cache (``copy.deepcopy``),
answered greedily in a few tokens and judged strictly (``chat_items.judge``: the current value,
and no other value of its kind). ``nofact`` is the full cache on the same chat with every fact
clause removed: how often the model guesses. Retention: the fraction of the value's own tokens
still stored when the question arrives (per layer, mean over KV heads). Every figure comes with
its item count and Wilson 95% interval; partial results are saved after every chat.

An arm ``spec+pin`` pins the chat's user turns (``spec+pinN``: and the assistant's replies of at
most N tokens) (``morphkv.pin``: evicted last, the assistant's
turns first). An arm ``spec@N`` runs at N tokens (``memory=f16``: the float16 bytes of N
tokens) instead of ``--budget``, on the same chats: the chats are cut by ``--min-distance``
budgets of ``--budget``, so one run measures several sizes on the same items (statement
distance / size differs, the distance plot shows it).

    morphkv eval recall --model qwen2.5-0.5b --split test --chats 14
    morphkv eval recall --model qwen2.5-0.5b --arms "kvcache,nofact,h2o@64,h2o@256"
    morphkv eval recall --model qwen2.5-0.5b --arms "kvcache,recommended:memory=f16+pin@64"
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

from ..core.pins import pin
from ..mlxlm.turns import common_prefix, user_positions
from .arms import Arm, pinned_replies, unpinned
from .chat_items import build_chat, encode, judge, tokenize
from .chat_report import distance_plot, plot, summarize, table
from .models import load_model
from .output import environment, out_dir, write_json
from .progress import Progress
from .recall import retention

NAME = "chatrecall"
NOFACT = "nofact"
LIVE_MEM = 1572864  # the float16 bytes of 128 tokens on Qwen2.5-0.5B (24 layers x 2 KV heads x 64)
DEFAULT_ARMS = ("kvcache,nofact,recommended:memory=f16,h2o,streaming_llm,"
                "streaming_llm:memory=f16:bits=8")


def answer(model, tok, caches, suffix: list[int], max_tokens: int) -> str:
    from .models import greedy_tokens

    ids = greedy_tokens(model, copy.deepcopy(caches), suffix, max_tokens)
    eos = set(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    ids = ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]
    return tok.decode(ids).strip()


def prefill(model, caches, ids: list[int], chunk: int) -> None:
    import mlx.core as mx

    x = mx.array(ids)[None]
    for s in range(0, len(ids), chunk):
        mx.eval(model(x[:, s : s + chunk], cache=caches))


def run_chat(model, tok, chat, arms, args, bar) -> dict:
    """Every arm on one chat: one prefill, then each question from a copy of the cache."""
    tokenize(tok, chat, args.min_distance * args.budget)
    rec = {"index": chat.index, "turns": len(chat.messages) // 2, "arms": {},
           "questions": [{"kind": q.kind, "value": q.value, "updated": q.updated,
                          "distance": q.distance, "value_tokens": len(q.positions)}
                         for q in chat.questions]}  # fmt: skip
    for label, arm in arms:
        msgs = chat.nofact if arm is None else chat.messages
        full = [encode(tok, msgs, q) for q in chat.questions]
        n = min(common_prefix(full[0], f) for f in full[1:])
        spec = Arm.parse("kvcache") if arm is None else arm
        caches = spec.caches(model, arm_budget(label, args.budget), args.n_sink)
        if pins_user(label):  # the chat's user turns are evicted last (morphkv.pin)
            pin(caches, user_positions(tok, msgs, replies=pinned_replies(label.rsplit("@", 1)[0])))
        t0 = time.perf_counter()
        prefill(model, caches, full[0][:n], args.chunk)
        budgets = [c.config.budget for c in caches if hasattr(c, "config")]
        out = {"nbytes": int(sum(c.nbytes for c in caches)), "prefix": n,
               "tokens": max(budgets) if budgets else None, "answers": [], "correct": [],
               "retention": []}
        for q, ids in zip(chat.questions, full, strict=True):
            if arm is not None:
                out["retention"].append(retention(caches, q.positions))
            text = answer(model, tok, caches, ids[n:], args.max_tokens)
            out["answers"].append(text)
            out["correct"].append(judge(text, q))
        out["seconds"] = time.perf_counter() - t0
        out["size"] = arm_budget(label, args.budget)
        rec["arms"][label] = out
        bar.update(1, f"chat {chat.index}: {label} {sum(out['correct'])}/{len(out['correct'])}")
    return rec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="model (default: the embedded SmolLM2)")
    add("--split", choices=("tune", "test"), default="test")
    add("--arms", default=DEFAULT_ARMS,
        help="comma-separated arm specs (morphkv.eval.arms; memory=f16: the bytes of a float16 "
        f"cache of --budget tokens) and 'nofact' (default {DEFAULT_ARMS})")
    add("--budget", type=int, default=128, help="token count of the arms (default 128)")
    add("--chats", type=int, default=14, help="chats, three questions each (default 14)")
    add("--first", type=int, default=0, help="index of the first chat")
    add("--seed", type=int, default=0)
    add("--min-distance", type=float, default=3.0,
        help="statements at least this many budgets back (default 3)")
    add("--max-tokens", type=int, default=6, help="answer tokens (default 6)")
    add("--n-sink", type=int, default=4)
    add("--chunk", type=int, default=256, help="prefill chunk (exact either way)")
    add("--out", default=None, help="output folder (default results/chatrecall)")
    add("--stem", default=None, help="output file stem (default chatrecall_<split>_<budget>)")
    add("--quiet", action="store_true")
    live = parser.add_argument_group("live conversations (morphkv.eval.live)")
    live.add_argument("--live", choices=("serve", "mlx_lm"), default=None,
                      help="run the chats live through morphkv serve + the openai client, or "
                      "mlx_lm's chat loop after patch_model, replies generated")
    live.add_argument("--live-arms", default=f"full=--method full;memory=--kv-memory {LIVE_MEM}",
                      help="';'-separated name=cache flags (a name ending ':nofact': the chats "
                      "without their facts; flags 'mlx_lm': mlx_lm's own cache with --live "
                      "mlx_lm)")
    live.add_argument("--turns", type=int, default=11, help="user turns before the questions, "
                      "facts in the first three (default 11)")
    live.add_argument("--reply-tokens", type=int, default=48, help="tokens per live reply")
    live.add_argument("--answer-tokens", type=int, default=12, help="tokens per answer")
    live.add_argument("--verbose", action="store_true", help="show the server's log")


def arm_budget(label: str, budget: int) -> int:
    """The token count of an arm label: N for ``spec@N``, else the command's ``budget``."""
    if "@" not in label:
        return budget
    size = label.rsplit("@", 1)[1]
    if not size.isdigit() or int(size) < 1:
        raise ValueError(f"arm {label!r}: the size after '@' must be a positive token count")
    return int(size)


def pins_user(label: str) -> bool:
    """``spec+pin`` (before any ``@N``): the arm pins the chat's user turns."""
    return unpinned(label.rsplit("@", 1)[0])[1]


def parse(text: str) -> list[tuple[str, Arm | None]]:
    out = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        arm_budget(spec, 1)  # checks the size
        base = unpinned(spec.rsplit("@", 1)[0])[0]
        if base == NOFACT and pins_user(spec):
            raise ValueError(f"arm {spec!r}: nofact is the full cache, nothing to pin")
        out.append((spec, None if base == NOFACT else Arm.parse(base)))
    if not out:
        raise ValueError("--arms is empty")
    return out


def run(args: argparse.Namespace, build=None, report=None) -> int:
    """``build(model, tok, split, index, seed)`` makes a chat (default ``build_chat``);
    ``report(chats, labels)`` gives (summary, table) (default ``summarize`` / ``table``)."""
    build = build or (lambda model, tok, split, index, seed: build_chat(split, index, seed))
    report = report or (lambda chats, labels: (summarize(chats, labels), None))
    if args.live:
        from .live import run_live

        path = out_dir(args, NAME) / f"{args.stem or f'{NAME}_live_{args.live}_{args.split}'}.json"
        head = {"benchmark": NAME, "args": vars(args), "environment": environment(),
                "load_average": {"start": os.getloadavg()}}

        def save(result):  # after every arm: a stopped run keeps what it measured
            head["load_average"]["end"] = os.getloadavg()
            write_json(path, {**head, **result})

        run_live(args, save)
        print(f"wrote {path}")
        return 0
    try:
        arms = parse(args.arms)
        for label, arm in arms:
            if arm is not None and not arm.is_baseline:
                arm.config(arm_budget(label, args.budget), n_sink=args.n_sink)
    except ValueError as e:
        print(f"morphkv eval recall: error: {e}", file=sys.stderr)
        return 2
    model, tok = load_model(args.model)
    folder = out_dir(args, NAME)
    stem = args.stem or f"{NAME}_{args.split}_{args.budget}"
    start, load = time.perf_counter(), os.getloadavg()
    bar = Progress(args.chats * len(arms), NAME, args.quiet, every=5.0)
    result = {"benchmark": NAME, "args": vars(args), "environment": environment(), "chats": []}
    for index in range(args.first, args.first + args.chats):
        chat = build(model, tok, args.split, index, args.seed)
        result["chats"].append(run_chat(model, tok, chat, arms, args, bar))
        result["summary"], text = report(result["chats"], [label for label, _ in arms])
        result["seconds"] = time.perf_counter() - start
        result["load_average"] = {"start": load, "end": os.getloadavg()}
        write_json(folder / f"{stem}.json", result)  # partial results as we go
    result["table"] = text or table(result["summary"])
    print(result["table"])
    write_json(folder / f"{stem}.json", result)
    plot(result["summary"], folder / f"{stem}.png")
    distance_plot(result["chats"], folder / f"{stem}_distance.png", args.budget)
    print(f"wrote {folder / f'{stem}.json'}, {stem}.png and {stem}_distance.png")
    return 0
