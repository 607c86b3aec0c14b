"""The speed benchmarks' --quick runs complete on a tiny random-weight llama (no download)
and write their JSON (and PNG) files: ``bench speed`` (in the model: time and memory per
context), ``--mode kernels``."""

from __future__ import annotations

import argparse
import json

from morphkv.eval.runner import run


def _parse(module, *argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_overhead_records_time_and_memory_per_context(tmp_path):
    """Past the budget the unbounded cache holds more than the bounded ones, at every context;
    the bounded ones hold the same at both contexts (constant size)."""
    from morphkv.bench import overhead

    args = _parse(overhead, "--quick", "--contexts", "64,600", "--out", str(tmp_path))
    run(overhead.Overhead(args))
    by_context = json.loads((tmp_path / "overhead_quick.json").read_text())["summary"]
    assert set(by_context) == {"64", "600"}
    for c in ("64", "600"):
        kv = {arm: m["kv_mib"] for arm, m in by_context[c].items()}
        assert kv["kvcache"] > kv["rotating"] > 0 and kv["kvcache"] > kv["morphkv"] > 0
        assert all(m["peak_mib"] > 0 and m["decode_ms"] > 0 for m in by_context[c].values())
    grow = {arm: by_context["600"][arm]["kv_mib"] / by_context["64"][arm]["kv_mib"]
            for arm in by_context["64"]}
    assert grow["kvcache"] > 1.5 and abs(grow["rotating"] - 1) < 0.01, grow
    assert abs(grow["morphkv"] - 1) < 0.1, grow


def test_overhead_quick(tmp_path):
    from morphkv.bench import overhead

    parse = _parse
    run(overhead.Overhead(parse(overhead, "--quick", "--out", str(tmp_path))))
    data = json.loads((tmp_path / "overhead_quick.json").read_text())
    (median,) = data["summary"].values()
    assert set(median) == {"kvcache", "rotating", "morphkv", "proxy"}
    assert all(m["decode_ms"] > 0 for m in median.values())


def test_kernels_counts_a_block_of_decode_steps(tmp_path):
    """The engine never reads the device on the host (evictions included); kernels are
    counted with the layer's attention."""
    from morphkv.bench import kernels

    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--arms",
                              "rotating,tuned:block=8,tuned:block=1"])
    rows = {r["cache"]: r for r in run(kernels.Kernels(args))["rows"]}
    assert rows["rotating"]["host_syncs_per_step"] == 0
    assert rows["tuned:block=1"]["host_syncs_per_step"] == 0  # auto: block 1 on MLX too
    assert rows["tuned:block=8"]["host_syncs_per_step"] == 0
    assert rows["tuned:block=8"]["steps"] == 8
    assert rows["rotating"]["kernels_per_step"] < rows["tuned:block=8"]["kernels_per_step"]
    assert (tmp_path / "kernels_quick.json").exists()
