"""The shared runner: arms x items x models -> records -> a summary, a table, JSON and PNGs.

Every evaluation is an ``Evaluation`` (the way kvpress's pipeline serves every press): it
parses its arms (checked before any work), yields its items, measures one item under every arm
(a record, or a list of rows) and reports (summary, table). ``run`` does the rest alike for
all of them: the model, the progress line, ``--max-minutes``, the JSON written after every
item (a stopped run keeps what it measured), the table printed, the JSON and PNGs at the end.
``--model a,b`` runs each model in turn, its files named ``<stem>_<model>``.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import time

from .models import load_model
from .output import environment, finish, out_dir, write_json
from .plots import require_matplotlib
from .progress import Progress


class Evaluation:
    """What ``run`` needs of an evaluation (``args``: the command's namespace): ``arms()``
    (checked: ValueError names a bad one), ``items(model, tok)``, ``measure(model, tok, item,
    arms, bar)`` (a record, or a list of rows), ``report(records, arms)`` -> (summary, table)
    and, to draw ``<stem>.png`` at the end, ``plot(result, path)``."""

    name = ""  # results/<name> and the JSON's "benchmark"
    stem_of = "{name}"  # the files' default stem: formatted with the args, name and _quick
    key = "items"  # the JSON's list of records
    command = "morphkv eval"  # names the command in a one-line error
    plot = None  # a method plot(result, path): the PNG drawn at the end

    def __init__(self, args) -> None:
        self.args, self.info = args, {}  # ``info``: more top-level JSON fields

    def stem(self) -> str:
        quick = "_quick" if getattr(self.args, "quick", False) else ""
        return getattr(self.args, "stem", None) or self.stem_of.format(
            name=self.name, _quick=quick, **vars(self.args))

    def steps(self, arms) -> int:
        """Progress steps in all (0: no progress line)."""
        return 0


def run(ev: Evaluation, model=None, tok=None) -> dict:
    """Every item under every arm (see the module doc); the result dict of the last model."""
    args = ev.args
    try:
        arms = ev.arms()
    except ValueError as e:
        raise SystemExit(f"{ev.command}: error: {e}") from None
    if ev.plot:
        require_matplotlib(args)
    names = str(getattr(args, "model", None) or "").split(",")
    if model is None and len(names) > 1:  # one run per model, each in its own files
        for name in names:
            each = copy.copy(ev)
            each.args = copy.copy(args)
            each.args.model, stem = name, ev.stem()
            each.args.stem = f"{stem}_{re.sub(r'[^A-Za-z0-9.]+', '-', name)}"
            result = run(each)
        return result
    if model is None:
        model, tok = load_model(getattr(args, "model", None))
    folder, stem = out_dir(args, ev.name), ev.stem()
    start, load = time.perf_counter(), os.getloadavg()
    result = {"benchmark": ev.name, "args": vars(args), "environment": environment(),
              ev.key: []}
    records, items = result[ev.key], ev.items(model, tok)  # then the steps: items may plan
    total = ev.steps(arms)
    bar = Progress(total, ev.name, getattr(args, "quiet", False) or not total, every=5.0)
    for item in items:
        minutes = getattr(args, "max_minutes", 0)
        if minutes and time.perf_counter() - start > 60 * minutes:
            print(f"[{ev.name}] --max-minutes reached", file=sys.stderr)
            break
        got = ev.measure(model, tok, item, arms, bar)
        records += got if isinstance(got, list) else [got]
        result.update(ev.info, seconds=time.perf_counter() - start,
                      load_average={"start": load, "end": os.getloadavg()})
        result["summary"] = ev.report(records, arms)[0]
        write_json(folder / f"{stem}.json", result)  # partial results as we go
    result.update(ev.info)
    result["summary"], result["table"] = ev.report(records, arms)
    finish(args, ev.name, result, stem, ev.plot and (lambda path: ev.plot(result, path)),
           result["table"])
    return result
