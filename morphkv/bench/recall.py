"""Recall of a fact stated early in a long chat, per eviction method and budget.

Each item is a chat in the model's own template: the user states a fact (a name, a city, a
colour, a number, a pet's name), the assistant acknowledges it, many unrelated question and
answer turns follow (canned replies, so every item reads the same to every arm), then the user
asks for the fact and the assistant's reply starts with the answer's lead-in ("Your name is").
The model continues greedily for a few tokens through one arm's caches (exact chunked prefill:
``KVCacheBuilder.for_model`` attaches the attention hook); the answer counts as correct when the
fact's words appear in it (lower-cased, punctuation ignored).

Items come from small word lists and a seed (no download): ``--split tune`` and ``--split test``
draw disjoint items, so a format chosen on one can be reported on the other. Accuracy is counted
only over the items the full cache answers correctly; their number is reported next to the
number built. KV bytes (sum of ``cache.nbytes`` over layers, mean over items) stand next to every
accuracy, so arms are compared at equal bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.config import KVCacheConfig
from .arms import Arm as SpecArm

NAME = "recall"
DEFAULT_ARMS = "full,streaming_llm,morphkv,morphkv:window=32,tova,h2o"
FIXED_FIELDS = ("method", "morphkv_budget", "head_dim")  # set by the arm name / --budgets / model


@dataclass(frozen=True)
class Fact:
    """One kind of fact: how it is said, acknowledged, asked for and answered."""

    kind: str
    values: tuple[str, ...]
    statement: str  # after "Please remember this: "
    ack: str  # after "I will remember it. "
    topic: str  # "Earlier I asked you to remember {topic}."
    question: str
    lead_in: str  # the start of the assistant's answer, ending the prompt

    def turns(self, value: str) -> tuple[str, str, str]:
        """(statement, acknowledgement, question) for ``value``."""
        return (
            "Please remember this: " + self.statement.format(v=value),
            "I will remember it. " + self.ack.format(v=value),
            f"Earlier I asked you to remember {self.topic}. {self.question}",
        )


FACTS = (
    Fact(
        "name",
        ("Alice", "Oliver", "Sophia", "Lucas", "Emma", "Noah", "Mia", "Leo", "Clara", "Hugo"),
        "my name is {v}.",
        "Your name is {v}.",
        "my name",
        "What is my name?",
        "Your name is",
    ),
    Fact(
        "city",
        ("Paris", "Tokyo", "Madrid", "Berlin", "Cairo", "Lima", "Oslo", "Rome", "Dublin"),
        "I live in the city of {v}.",
        "You live in the city of {v}.",
        "my city",
        "Which city do I live in?",
        "You live in the city of",
    ),
    Fact(
        "colour",
        ("green", "purple", "orange", "yellow", "blue", "red", "pink", "brown"),
        "my favourite colour is {v}.",
        "Your favourite colour is {v}.",
        "my favourite colour",
        "What is my favourite colour?",
        "Your favourite colour is",
    ),
    Fact(
        "number",
        tuple(str(n) for n in range(12, 99)),
        "my lucky number is {v}.",
        "Your lucky number is {v}.",
        "my lucky number",
        "What is my lucky number?",
        "Your lucky number is",
    ),
    Fact(
        "pet",
        ("Biscuit", "Pepper", "Shadow", "Ziggy", "Mango", "Rocky", "Luna", "Oscar"),
        "my dog's name is {v}.",
        "Your dog's name is {v}.",
        "my dog's name",
        "What is my dog's name?",
        "Your dog's name is",
    ),
)

# Unrelated turns with fixed replies; no names, places, colours or numbers in them.
FILLERS = (
    ("How do I boil an egg?", "Put the egg in boiling water, then cool it in cold water."),
    ("Why is the sea salty?", "Rivers carry minerals from rocks into the sea, and they stay."),
    ("What should I eat for breakfast?", "Oatmeal with fruit is a healthy and filling breakfast."),
    ("How can I sleep better?", "Go to bed at the same time every night and avoid screens."),
    ("What is a good way to learn to cook?", "Start with simple recipes and cook often."),
    ("How do plants grow?", "Plants use sunlight, water and air to make their own food."),
    ("Can you suggest a hobby?", "Drawing is a relaxing hobby that anyone can start."),
    ("How do I stay focused?", "Work in short blocks of time and take small breaks."),
    ("How do bees make honey?", "Bees collect nectar from flowers and store it in the hive."),
    ("How can I save money?", "Make a budget and set aside a small amount every week."),
    ("What is a healthy snack?", "Nuts, fruit and yogurt are healthy snacks."),
    ("How do I write a good email?", "Keep it short, say what you need clearly, and be polite."),
    ("What makes a good friend?", "A good friend listens, is honest and helps when needed."),
    ("How do fish breathe?", "Fish take oxygen from the water through their gills."),
    ("How do I clean a window?", "Spray it with soapy water and wipe it with a dry cloth."),
    ("Why do cats purr?", "Cats often purr when they are calm and content."),
    ("How can I learn a new language?", "Practise a little every day and speak with others."),
    ("What is rain?", "Rain is water that falls from clouds when drops get heavy."),
    ("How do I keep my desk tidy?", "Put things back after use and clear it every evening."),
    ("Why should I drink water?", "Water keeps your body working well and helps you think."),
)


# ---------------------------------------------------------------------------------- items


@dataclass(frozen=True)
class Item:
    """One chat: ``ids`` is the whole prompt (ending in the answer's lead-in)."""

    index: int
    kind: str
    value: str
    ids: tuple[int, ...]
    fact_end: int  # tokens up to the end of the assistant's acknowledgement of the fact
    turns: int  # filler question/answer pairs
    fact_positions: tuple[int, ...] = ()  # tokens of the value in the statement and the ack

    @property
    def distance(self) -> int:
        """Tokens between the end of the fact's acknowledgement and the end of the prompt."""
        return len(self.ids) - self.fact_end


def _encode(tok, messages: list[dict], tail: str | None) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=tail is not None)
    return list(tok.encode(text + (tail or ""), add_special_tokens=False))


def build_item(tok, seed: int, split: str, index: int, distance: int) -> Item:
    """Item ``index`` of ``split``: filler turns are added until at least ``distance`` tokens
    separate the fact's acknowledgement from the end of the prompt."""
    rng = random.Random(f"recall:{seed}:{split}:{index}")
    fact = rng.choice(FACTS)
    value = rng.choice(fact.values)
    statement, ack, ask = fact.turns(value)
    head = [{"role": "user", "content": statement}, {"role": "assistant", "content": ack}]
    head_ids = _encode(tok, head, None)
    fact_end, spots = len(head_ids), tuple(_value_positions(tok, head_ids, value))
    question = [{"role": "user", "content": ask}]
    fillers: list[dict] = []
    deck: list[tuple[str, str]] = []
    while True:
        ids = _encode(tok, head + fillers + question, fact.lead_in)
        if len(ids) - fact_end >= distance:
            return Item(index, fact.kind, value, tuple(ids), fact_end, len(fillers) // 2, spots)
        if not deck:
            deck = list(FILLERS)
            rng.shuffle(deck)
        user, reply = deck.pop()
        fillers += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def _value_positions(tok, ids: list[int], value: str):
    """Positions whose token is part of the value (a digit, or 2+ letters inside it)."""
    for i, t in enumerate(ids):
        piece = tok.decode([t]).strip().lower()
        if (piece.isdigit() or len(piece) >= 2) and piece in value.lower():
            yield i


def words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def is_correct(answer: str, value: str) -> bool:
    """The fact's words appear, in order and adjacent, among the answer's words."""
    a, v = words(answer), words(value)
    return any(a[i : i + len(v)] == v for i in range(len(a) - len(v) + 1))


# ----------------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class Arm:
    """One cache setting, budget aside: ``label`` as given on the command line, parsed by the
    bench's arm parser (``morphkv.bench.arms``: any config field, presets)."""

    label: str
    spec: SpecArm

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def is_full(self) -> bool:
        return self.spec.method == "full"

    def config(self, budget: int, n_sink: int) -> KVCacheConfig:
        return self.spec.config(budget, n_sink=n_sink)  # the spec's own sinks win


def parse_arm(spec: str) -> Arm:
    """``method`` or ``method:field=value,...`` with ``KVCacheConfig`` fields (the
    ``morphkv_`` prefix may be left out: ``morphkv:window=32``), or a preset name."""
    method, _, rest = spec.strip().partition(":")
    parts = [p.strip() for p in rest.split(",") if p.strip()]
    for part in parts:
        key = part.partition("=")[0].strip()
        if "=" not in part:
            raise ValueError(f"arm {spec!r}: {part!r} is not field=value")
        if key in FIXED_FIELDS or f"morphkv_{key}" in FIXED_FIELDS:
            raise ValueError(f"arm {spec!r}: {key} is set by the command (the budget by --budgets)")
    return Arm(spec.strip(), SpecArm.parse(":".join([method, *parts])))


def parse_arms(text: str) -> list[Arm]:
    """Comma-separated specs; a piece with ``=`` and no ``:`` continues the previous spec."""
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    if not specs:
        raise ValueError("--arms is empty")
    return [parse_arm(s) for s in specs]


# ------------------------------------------------------------------------------- running


def answer(model, tok, item: Item, config: KVCacheConfig, max_tokens: int, chunk: int):
    """(greedy continuation, KV bytes) of one item through fresh caches."""
    from mlx_lm import generate

    from ..mlxlm.builder import KVCacheBuilder

    caches = KVCacheBuilder.for_model(model, config)
    text = generate(
        model,
        tok,
        list(item.ids),
        max_tokens=max_tokens,
        prompt_cache=caches,
        prefill_step_size=chunk,
        verbose=False,
    )
    return text, _bytes(caches) | {"fact_kept": fact_kept(caches, item.fact_positions)}


def fact_kept(caches, positions: tuple[int, ...]) -> float | None:
    """Fraction of (layer, KV head) caches still holding a token of the fact's value."""
    import numpy as np

    if not positions:
        return None
    held = [np.isin(c.kept_positions[0], positions).any(axis=-1) for c in caches]
    return float(np.mean(held))


def _bytes(caches) -> dict:
    """Storage bytes (``cache.nbytes``: the full cache grows in steps of 256 rows) and the
    bytes of the tokens actually kept, each summed over layers."""
    kept = sum(c.morphkv_kept_bytes * c.keys.shape[0] * c.keys.shape[1] for c in caches)
    return {"nbytes": int(sum(c.nbytes for c in caches)), "kept_bytes": int(kept)}


class Progress:
    """done/total runs on stderr with elapsed time and an ETA; the total shrinks when an item
    the full cache gets wrong skips its other arms."""

    def __init__(self, total: int, quiet: bool, max_minutes: float = 0) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.cap = f" (no new item after {max_minutes:g} min)" if max_minutes else ""
        self.start = self._last = time.perf_counter()

    def step(self, done: int = 1, skipped: int = 0, note: str = "") -> None:
        self.done += done
        self.total -= skipped
        now = time.perf_counter()
        if self.quiet or (now - self._last < 5 and self.done < self.total):
            return
        self._last = now
        spent = now - self.start
        eta = spent / max(self.done, 1) * (self.total - self.done)
        print(
            f"[recall] {self.done}/{self.total} runs, {spent:.0f}s elapsed, eta {eta:.0f}s"
            f"{self.cap}: {note}",
            file=sys.stderr,
            flush=True,
        )


def evaluate(model, tok, args, arms: list[Arm]) -> dict:
    """Build items one by one and run every arm on those the full cache answers correctly."""
    full = next((a for a in arms if a.is_full), Arm("full", "full"))
    others = [a for a in arms if not a.is_full]
    cells = [(a, b) for a in others for b in args.budgets]
    full_config = full.config(max(args.budgets), args.n_sink)
    bar = Progress(args.items * (1 + len(cells)), args.quiet, args.max_minutes)
    records, start = [], time.perf_counter()
    for index in range(args.first, args.first + args.items):
        if args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
            print(f"[recall] --max-minutes reached before item {index}", file=sys.stderr)
            break
        item = build_item(tok, args.seed, args.split, index, args.distance)
        text, nbytes = answer(model, tok, item, full_config, args.max_tokens, args.chunk)
        ok = is_correct(text, item.value)
        rec = {
            "index": index,
            "kind": item.kind,
            "value": item.value,
            "tokens": len(item.ids),
            "distance": item.distance,
            "turns": item.turns,
            "full": {"answer": text, "correct": ok, **nbytes},
            "arms": {},
        }
        bar.step(1, 0 if ok else len(cells), f"item {index}: full {'ok' if ok else 'wrong'}")
        for arm, budget in cells if ok else []:
            config = arm.config(budget, args.n_sink)
            text, nbytes = answer(model, tok, item, config, args.max_tokens, args.chunk)
            rec["arms"][f"{arm.label}@{budget}"] = {
                "answer": text,
                "correct": is_correct(text, item.value),
                **nbytes,
            }
            bar.step(1, 0, f"item {index}: {arm.label} @ {budget}")
        records.append(rec)
    return {"items": records, "summary": summarize(records, full, cells)}


def summarize(records: list[dict], full: Arm, cells: list[tuple[Arm, int]]) -> dict:
    kept = [r for r in records if r["full"]["correct"]]
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    rows = []
    for arm, budget in cells:
        runs = [r["arms"][f"{arm.label}@{budget}"] for r in kept]
        correct = sum(x["correct"] for x in runs)
        rows.append(
            {
                "arm": arm.label,
                "budget": budget,
                "correct": correct,
                "n": len(runs),
                "accuracy": correct / len(runs) if runs else None,
                "nbytes": mean([x["nbytes"] for x in runs]),
                "kept_bytes": mean([x["kept_bytes"] for x in runs]),
                "fact_kept": mean([x["fact_kept"] for x in runs]),
            }
        )
    return {
        "built": len(records),
        "full_correct": len(kept),
        "full_arm": full.label,
        "full_nbytes": mean([r["full"]["nbytes"] for r in records]),
        "full_kept_bytes": mean([r["full"]["kept_bytes"] for r in records]),
        "mean_tokens": mean([r["tokens"] for r in records]),
        "mean_distance": mean([r["distance"] for r in records]),
        "rows": rows,
    }


# ------------------------------------------------------------------------------- reports


def _cell(row: dict) -> str:
    if row["accuracy"] is None:
        return "-"
    mib, kept = row["nbytes"] / 2**20, row["fact_kept"]
    kept = "-" if kept is None else f"{100 * kept:.0f}%"
    return f"{100 * row['accuracy']:.0f}% ({row['correct']}/{row['n']}), {kept}, {mib:.2f} MiB"


def table(summary: dict, budgets: list[int]) -> str:
    """Markdown table: one row per arm, one column per budget, and a legend."""
    by = {(r["arm"], r["budget"]): r for r in summary["rows"]}
    arms = list(dict.fromkeys(r["arm"] for r in summary["rows"]))
    lines = ["| arm | " + " | ".join(f"budget {b}" for b in budgets) + " |"]
    lines.append("|---|" + "---|" * len(budgets))
    mib, k = (summary["full_nbytes"] or 0) / 2**20, summary["full_correct"]
    full = f"100% ({k}/{k}), 100%, {mib:.2f} MiB"
    row = " | ".join([full] * len(budgets))
    lines.append(f"| {summary['full_arm']} (no eviction) | {row} |")
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(_cell(by[arm, b]) for b in budgets) + " |")
    lines += [
        "",
        f"Items: {summary['built']} built, the full cache answers {summary['full_correct']} "
        f"correctly; prompts {summary['mean_tokens'] or 0:.0f} tokens on average, the fact "
        f"{summary['mean_distance'] or 0:.0f} tokens before the answer.",
        "Legend: each cell is the accuracy over the items the full cache answers correctly "
        "(correct/counted); the fact kept: share of (layer, KV head) caches still holding a "
        "token of the fact's value after the answer; KV cache bytes: sum of cache.nbytes over "
        "layers, mean over items (the full cache's storage grows in steps of 256 rows; the "
        "bytes of the tokens kept are in the JSON). Budget: tokens kept per layer and KV head.",
    ]
    return "\n".join(lines)


def plot(summary: dict, budgets: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in dict.fromkeys(r["arm"] for r in summary["rows"]):
        rows = [r for r in summary["rows"] if r["arm"] == arm and r["accuracy"] is not None]
        acc = [100 * r["accuracy"] for r in rows]
        left.plot([r["budget"] for r in rows], acc, marker="o", label=arm)
        right.plot([r["nbytes"] / 2**20 for r in rows], acc, marker="o", label=arm)
    if summary["full_nbytes"]:
        right.plot([summary["full_nbytes"] / 2**20], [100], "k*", ms=10, label="full")
    left.axhline(100, color="k", ls="--", lw=0.8, label="full")
    left.set_xscale("log", base=2)
    left.set_xticks(budgets, [str(b) for b in budgets])
    left.set_xlabel("budget (tokens kept per layer and KV head)")
    right.set_xlabel("KV cache MiB (sum over layers)")
    for ax in (left, right):
        ax.set_ylabel("recall accuracy (%)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    right.legend(fontsize=8, loc="center right")
    fig.suptitle(
        f"Recall of an early fact: {summary['full_correct']} of {summary['built']} items "
        f"answered by the full cache, fact ~{summary['mean_distance'] or 0:.0f} tokens back"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smoke run (seconds): 2 short items")
    parser.add_argument("--out", default=None, help="output folder (default results/recall)")
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help="comma-separated methods, or method:field=value,... with KVCacheConfig fields "
        f"(morphkv_ prefix optional), e.g. morphkv:window=32 (default {DEFAULT_ARMS})",
    )
    parser.add_argument("--budgets", default="64,128,256", help="comma-separated budgets")
    parser.add_argument("--items", type=int, default=40, help="items to build")
    parser.add_argument("--first", type=int, default=0, help="index of the first item")
    parser.add_argument("--max-minutes", type=float, default=0, help="stop adding items after")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("tune", "test"), default="test")
    parser.add_argument(
        "--distance", type=int, default=0, help="min tokens after the fact (0: 1.5 x max budget)"
    )
    parser.add_argument("--max-tokens", type=int, default=6, help="answer tokens generated")
    parser.add_argument("--n-sink", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (exact either way)")
    parser.add_argument("--quiet", action="store_true")


def _settings(args: argparse.Namespace) -> tuple[list[Arm], list[int]]:
    """Arms and budgets checked before any work; ValueError names the problem."""
    if args.quick:
        args.arms, args.budgets, args.items = "full,streaming_llm,morphkv", "32", min(args.items, 2)
        args.distance = args.distance or 48
    try:
        budgets = [int(b) for b in str(args.budgets).split(",") if b.strip()]
    except ValueError:
        msg = f"--budgets must be comma-separated integers, got {args.budgets!r}"
        raise ValueError(msg) from None
    if not budgets:
        raise ValueError("--budgets is empty")
    arms = parse_arms(args.arms)
    for arm in arms:
        for budget in budgets:
            try:
                arm.config(budget, args.n_sink)
            except (TypeError, ValueError) as e:
                raise ValueError(f"arm {arm.label!r} at budget {budget}: {e}") from None
    args.budgets = budgets
    args.distance = args.distance or int(1.5 * max(budgets))
    if args.items < 1 or args.first < 0:
        raise ValueError(f"need --items >= 1 and --first >= 0, got {args.items}, {args.first}")
    return arms, budgets


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("morphkv eval recall needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    try:
        arms, budgets = _settings(args)
    except ValueError as e:
        print(f"morphkv eval recall: error: {e}", file=sys.stderr)
        return 2
    from ..model import load

    model, tok = load(args.model)
    start = time.perf_counter()
    result = evaluate(model, tok, args, arms)
    summary = result["summary"]
    print(table(summary, budgets))
    out = Path(args.out) if args.out else Path("results") / NAME
    out.mkdir(parents=True, exist_ok=True)
    result["args"] = vars(args) | {"arms": args.arms}
    result["environment"] = {"python": platform.python_version(), "date": time.ctime()}
    result["seconds"] = time.perf_counter() - start
    result["table"] = table(summary, budgets)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(summary, budgets, out / f"{NAME}.png")
    print(f"wrote {out / f'{NAME}.json'} and {out / f'{NAME}.png'}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))


def section(result: dict) -> str:
    """The report's section (``morphkv report``): the table the command printed."""
    args = result.get("args", {})
    def value(v):
        return ",".join(map(str, v)) if isinstance(v, list) else v

    command = "morphkv eval recall " + " ".join(
        f"--{k.replace('_', '-')} {value(v)}" for k, v in args.items()
        if k in ("arms", "budgets", "distance", "items", "split", "seed") and v is not None
    )
    return "\n".join(["## Recall of an early fact (`morphkv eval recall`)", "",
                      f"`{command}`", "", result["table"], ""])
