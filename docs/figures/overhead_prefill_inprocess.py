"""Pinned prefill before/after in ONE process, interleaved (a loaded machine moves the wall clock
of separate runs by +-30%): rotating, recommended (unpinned), recommended:pin=prompt with the
old ``device_schedule.schedule`` and with the current one; 1,024 tokens in chunks of 512,
budget 512, embedded model. Usage (the old module from git):

    git show f87a6cd:morphkv/core/device_schedule.py > /tmp/old_device_schedule.py
    OPENBLAS_NUM_THREADS=1 python docs/figures/overhead_prefill_inprocess.py \
        /tmp/old_device_schedule.py 5
"""

import importlib.util
import statistics
import sys
import time

from morphkv.core import device_schedule as ds
from morphkv.eval.arms import parse_arms
from morphkv.eval.models import load_model
from morphkv.eval.texts import PROSE_TOPICS, prose_text


def main(old_path: str, repeats: int) -> None:
    import mlx.core as mx  # after morphkv (its import loads OpenBLAS for MLX first)

    spec = importlib.util.spec_from_file_location("morphkv.core.old_device_schedule", old_path)
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old
    spec.loader.exec_module(old)
    model, tok = load_model(None)
    ids = tok.encode(prose_text(PROSE_TOPICS))
    while len(ids) < 1024:
        ids = ids + ids
    prompt = mx.array(ids[:1024])
    rot, rec, pin = parse_arms(["rotating", "recommended", "recommended:pin=prompt"])

    def run(arm):
        caches = arm.caches(model, 512, 4)
        t, c = time.perf_counter(), time.process_time()
        for i in range(0, 1024, 512):
            mx.eval(model(prompt[None, i : i + 512], cache=caches))
        return time.perf_counter() - t, time.process_time() - c

    new = ds.schedule
    arms = [("rotating", rot, new), ("recommended", rec, new), ("pin-before", pin, old.schedule),
            ("pin-after", pin, new)]
    res = {n: [] for n, _, _ in arms}
    for rep in range(repeats):
        load = open("/proc/loadavg").read().split()[0]
        for name, arm, schedule in arms:
            ds.schedule = schedule
            res[name].append(run(arm))
        print(f"rep {rep} load {load}: " + ", ".join(
            f"{n} {v[-1][0]:.2f}/{v[-1][1]:.2f}" for n, v in res.items()), flush=True)
    w0, c0 = (statistics.median(x[j] for x in res["rotating"]) for j in (0, 1))
    for n, v in res.items():
        w, c = (statistics.median(x[j] for x in v) for j in (0, 1))
        print(f"{n:12s} wall {w:6.2f} s ({w / w0:.3f}x)   cpu {c:6.2f} s ({c / c0:.3f}x)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
