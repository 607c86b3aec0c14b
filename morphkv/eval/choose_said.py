"""The one recommended setting of issue 42, chosen by a rule fixed before any test item existed.

Committed with the candidates and the tune data only (``data/said.json`` and
``data/answer_prompts.json`` had no test split then). Every candidate holds the float16 bytes
of ``SIZE`` tokens (``memory=f16``, counting every byte: 8-bit K/V plus any selection state)
and pins the prompt / the user's turns (``+pin``). Three tune measures, each the share of the
full cache's items kept, pooled over the tune items of Qwen2.5-0.5B:

* ``model``: names the model invented in a chat, asked many turns later
  (``morphkv eval recall --data said``);
* ``user``: facts the user said in the same chats;
* ``answers``: top-1 agreement with the full cache where a long answer re-uses a rare token it
  wrote far back (``morphkv eval recall --data answers``).

The score is their mean. A candidate whose mean KL over every answer token exceeds
``KL_SLACK`` x recency's (the first candidate) is out. The highest score wins, but a candidate
other than recency must beat recency's score by ``MARGIN`` (recency holds no selection state:
every byte is a token); ties go to recency. The winner is then run once on the test split.
"""

from __future__ import annotations

import json
import sys

SIZE = 128
PIN = ":pin_rank=keydiff+pin"  # the pinned tokens ranked as the memory preset ranks them
CANDIDATES = {
    "recency8": "recommended:memory=f16+pin",  # 8-bit recency, the memory preset today
    "morphkv8": "morphkv:memory=f16:bits=8:window=16:recent=0.5:value=true:peak=0.02:block=16"
                + PIN,  # recommended(budget)'s MorphKV at 8 bits in the same bytes
    "persist8": "morphkv:memory=f16:bits=8:window=16:recent=0.25:value=true:peak=1.0:block=16"
                + PIN,  # MorphKV with full persistence, recent floor a quarter
    "h2o8": "h2o:memory=f16:bits=8:block=16" + PIN,  # accumulated attention
}
MARGIN = 0.05
KL_SLACK = 1.10


def measures(said: dict, answers: dict) -> dict:
    """Per candidate {model, user, answers, kl} from the tune JSONs of the two commands."""
    out = {}
    for name, spec in CANDIDATES.items():
        s = said["summary"]["_said"][spec]
        a = answers["summary"][f"{spec}@{SIZE}"]
        out[name] = {"model": s["model"]["k"] / max(1, s["model"]["n"]),
                     "user": s["user"]["k"] / max(1, s["user"]["n"]),
                     "answers": a["remention_agree"][0], "kl": a["kl"]}
    return out


def choose(m: dict) -> tuple[str, dict]:
    """(the winner, per candidate: its score and whether the KL guard let it in)."""
    first = next(iter(CANDIDATES))
    rows = {}
    for name, v in m.items():
        score = (v["model"] + v["user"] + v["answers"]) / 3
        rows[name] = {"score": score, "kl_ok": v["kl"] <= KL_SLACK * m[first]["kl"]}
    best = first
    for name, r in rows.items():
        if name != first and r["kl_ok"] and r["score"] >= rows[first]["score"] + MARGIN \
                and r["score"] > rows[best]["score"]:
            best = name
    return best, rows


if __name__ == "__main__":  # python -m morphkv.eval.choose_said SAID.json ANSWERS.json
    said, answers = (json.load(open(p)) for p in sys.argv[1:3])
    m = measures(said, answers)
    winner, rows = choose(m)
    for name in m:
        print(name, {k: round(v, 4) for k, v in m[name].items()}, rows[name])
    print("chosen:", winner, CANDIDATES[winner])
