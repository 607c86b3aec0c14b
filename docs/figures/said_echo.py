"""The prefilled said chats re-scored with names that echo their ask set apart (issue 42).

The 0.5B model names a sourdough bakery "Sourdough Bakery" and a volcanic island "Volcanic
Island"; asked back with no chat at all (``nofact``) it says the same. ``chat_items.echoes``
marks an invented name that repeats a word (3+ letters) of its ask or question; ``said_by``
then calls its item ``echo``, not ``model``. This script re-tallies stored runs with the
package's own ``of_full`` (of the full cache's right items, bootstrap over chats): nothing is
run again, every answer is the one the run gave.

    python docs/figures/said_echo.py FILE.json[:ALIAS=LABEL,...] ... [--out OUT.json]
    (default out: said_echo.json beside this script)

``ALIAS=LABEL`` pools arms that ran under other labels (the preset of an earlier round) as one.
"""

import argparse
import json
from pathlib import Path

from morphkv.eval.chat_items import WHO
from morphkv.eval.chat_recall import FULL, of_full


def load(spec: str) -> list[dict]:
    """The chats of one run, arm labels renamed by the spec's ``ALIAS=LABEL`` pairs."""
    path, _, names = spec.partition(":")
    alias = {label: name for name, label in (p.split("=", 1) for p in names.split(",") if p)}
    chats = json.loads(Path(path).read_text())["chats"]
    for c in chats:
        c["arms"] = {alias.get(k, k): v for k, v in c["arms"].items()}
    return chats


def tally(chats: list[dict]) -> dict:
    labels = sorted({k for c in chats for k in c["arms"]}, key=lambda k: (k != FULL, k))
    return {label: {w: of_full(chats, label, w) for w in WHO} for label in labels}


def main(specs: list[str], out_path: Path) -> None:
    runs = {spec.partition(":")[0]: load(spec) for spec in specs}
    out = {Path(k).stem: tally(v) for k, v in runs.items()}
    out["pooled"] = tally([c for v in runs.values() for c in v])
    for name, arms in out.items():
        print(f"## {name}")
        for label, by in arms.items():
            print(f"  {label}: " + "; ".join(
                f"{w} {s['k']} of {s['n']}" + (f" [{100 * s['interval'][1]:.0f}, "
                                                 f"{100 * s['interval'][2]:.0f}]"
                                                 if s["interval"] else "")
                for w, s in by.items()))
    out_path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="+", help="FILE.json[:ALIAS=LABEL,...]")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("said_echo.json"))
    args = ap.parse_args()
    main(args.specs, args.out)
