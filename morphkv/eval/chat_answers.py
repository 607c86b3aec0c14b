"""Write the assistant turns of the conversation-memory chats: each user question of a split
(``data/chat_questions.json``) answered once by a model with the full cache, greedily, cut at
its last full sentence, saved with the command, model and settings as
``data/chat_answers_<split>.json`` (``chat_items`` builds the chats from them). A second run
keeps the answers written and adds the missing ones (greedy answers do not depend on when).

    python -m morphkv.eval.chat_answers --model qwen2.5-0.5b --split test
    python -m morphkv.eval.chat_answers --split tune          # the embedded SmolLM2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .models import greedy_tokens, load_model, until_end

DATA = Path(__file__).with_name("data")


def questions(split: str) -> list[str]:
    return json.loads((DATA / "chat_questions.json").read_text())[split]


def trim(text: str) -> str:
    """The text up to its last sentence end (whole text when it has none)."""
    text = text.strip()
    end = max(text.rfind(c) for c in ".!?")
    return text[: end + 1] if end > len(text) // 3 else text


def answer(model, tok, question: str, max_tokens: int) -> str:
    from mlx_lm.models.cache import KVCache

    prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                     add_generation_prompt=True)  # fmt: skip
    return trim(until_end(tok, greedy_tokens(model, [KVCache() for _ in model.layers], prompt,
                                             max_tokens)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    p.add_argument("--split", choices=("tune", "test"), required=True)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--out", default=None, help="default data/chat_answers_<split>.json")
    args = p.parse_args(argv)
    model, tok = load_model(args.model)
    out = Path(args.out or DATA / f"chat_answers_{args.split}.json")
    command = "python -m morphkv.eval.chat_answers " + " ".join(argv or sys.argv[1:])
    record = {"command": command, "model": args.model or "smollm2-135m (embedded default)",
              "split": args.split, "max_tokens": args.max_tokens, "cache": "full (mlx_lm KVCache)",
              "sampling": "greedy", "answers": []}
    old = json.loads(out.read_text()) if out.exists() else {}
    same = all(old.get(k) == record[k] for k in ("model", "split", "max_tokens"))
    done = {a["question"]: a["answer"] for a in old.get("answers", [])} if same else {}
    for i, q in enumerate(questions(args.split)):
        t0 = time.perf_counter()
        text = done[q] if q in done else answer(model, tok, q, args.max_tokens)
        record["answers"].append({"question": q, "answer": text})
        out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        print(f"[chat_answers] {i + 1}/{len(questions(args.split))} "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
