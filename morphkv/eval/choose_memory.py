"""The rule that picks ``recommended(memory=...)``'s setting, fixed before any test run.

Inputs: a ``morphkv eval fidelity --mode bytes`` result on the TUNE texts (KL to the full cache per
text, every
candidate next to StreamingLLM at 8 bits in the same bytes and StreamingLLM of the same tokens
in the model's dtype, i.e. what ``RotatingKVCache(tokens, keep=4)`` keeps) and a ``morphkv eval
chatrecall --split tune`` result with the same candidates. The rule:

1. admissible: mean KL <= ``KL_FACTOR`` x that of ``streaming_llm:memory=f16:bits=8``, and on
   every text KL <= that of ``streaming_llm`` (the model's dtype, same tokens);
2. among the admissible, the highest tune recall (all questions); ties: the lower mean KL.
A ``spec+pin`` candidate (the chat's user turns pinned, ``morphkv.pin``) is judged on the KL
of ``spec``: a text without turns has nothing pinned, so it keeps exactly what ``spec`` keeps.

Writes the choice and the whole recall-vs-KL curve (JSON + PNG).

    python -m morphkv.eval.choose_memory results/chatrecall/bytes_tune_candidates.json \
        results/chatrecall/chatrecall_tune_128.json --out docs/figures/choose_memory
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .arms import PIN, unpinned
from .chat_report import recall_plot
from .output import write_json

KL_FACTOR = 1.5
EIGHT_BIT = "streaming_llm:memory=f16:bits=8"
DTYPE = "streaming_llm"


def choose(kl_rows: list[dict], recall: dict) -> dict:
    """``kl_rows``: the bytes summary (one row per arm); ``recall``: the chatrecall summary."""
    by_arm = {r["arm"]: r for r in kl_rows}
    eight, dtype = by_arm[EIGHT_BIT], by_arm[DTYPE]
    points = []
    pinned = [a + PIN for a in by_arm if a + PIN in recall]  # judged on their base's KL
    for arm in dict.fromkeys([*by_arm, *pinned]):
        row = by_arm[unpinned(arm)[0]]
        if arm in (EIGHT_BIT, DTYPE) or (unpinned(arm)[1] and arm not in recall):
            continue
        worse = [t for t, v in row["kl"].items() if v > dtype["kl"][t]]
        ratio = row["mean_kl"] / eight["mean_kl"]
        rec = recall.get(arm, {}).get("all") or {"rate": None, "k": None, "n": 0, "ci95": None}
        points.append({"arm": arm, "mean_kl": row["mean_kl"], "kl_vs_8bit": ratio,
                       "texts_worse_than_dtype": worse, "recall": rec["rate"], "k": rec["k"],
                       "n": rec["n"], "ci95": rec["ci95"],
                       "kl_with_pins": by_arm.get(arm, row)["kl"],  # reported, not judged
                       "admissible": ratio <= KL_FACTOR and not worse})
    ok = [p for p in points if p["admissible"] and p["recall"] is not None]
    best = max(ok, key=lambda p: (p["recall"], -p["mean_kl"])) if ok else None
    return {"rule": __doc__.split("The rule:")[1].split("Writes")[0].strip(),
            "kl_factor": KL_FACTOR, "eight_bit_mean_kl": eight["mean_kl"],
            "dtype_kl": dtype["kl"], "points": points, "choice": best and best["arm"]}


def plot(result: dict, path: Path) -> None:
    points = [(p["kl_vs_8bit"], p["recall"], p["ci95"],
               p["arm"].replace("recommended:memory=f16", "rec")
               + (" (chosen)" if p["arm"] == result["choice"] else ""),
               "o" if p["admissible"] else "x") for p in result["points"] if p["n"]]
    recall_plot(points, "mean KL on tune texts / StreamingLLM at 8 bits in the same bytes",
                "tune recall, all questions (%)", path, vline=KL_FACTOR)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bytes_json")
    p.add_argument("recall_json", nargs="+", help="chatrecall results on the same tune chats "
                   "(their arms are pooled)")
    p.add_argument("--out", default="results/chatrecall/choose_memory", help="path stem")
    args = p.parse_args(argv)
    kl = json.loads(Path(args.bytes_json).read_text())["summary"]
    recall = {}
    for path in args.recall_json:
        recall.update(json.loads(Path(path).read_text())["summary"])
    result = choose(kl, recall)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), result)
    plot(result, out.with_suffix(".png"))
    for q in result["points"]:
        got = f"{q['k']}/{q['n']}" if q["n"] else "not run"
        print(f"{q['arm']}: recall {got}, KL {q['kl_vs_8bit']:.2f}x 8-bit, "
              f"worse than dtype on {q['texts_worse_than_dtype'] or 'none'}"
              f"{'' if q['admissible'] else ' (inadmissible)'}")
    print(f"choice: {result['choice']}; wrote {out}.json and {out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
