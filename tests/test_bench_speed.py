"""The speed benchmark's --quick runs complete on a tiny random-weight llama (no download)
and write their JSON and PNG files."""

from __future__ import annotations

import argparse
import json

from morphkv.bench import speed
from morphkv.eval.models import tiny_llama


def _args(*argv: str) -> argparse.Namespace:
    return speed.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def _check_length_result(result: dict, out, arms: list[str]) -> None:
    data = json.loads((out / "speed_quick.json").read_text())
    assert set(data["records"]) == set(arms)
    for arm in arms:
        recs = data["records"][arm]
        assert [r["position"] for r in recs] == [50 * i for i in range(1, 7)]
        for r in recs:
            assert r["tokens_per_s"] > 0 and r["peak_bytes"] >= r["active_bytes"] > 0
    budget_bytes = {arm: data["records"][arm][-1]["kv_bytes"] for arm in arms}
    if "full" in arms and "morphkv" in arms:
        assert budget_bytes["full"] > budget_bytes["morphkv"]
    if "morphkv" in arms:
        kept = [r["tokens_kept_layer0"] for r in data["records"]["morphkv"]]
        assert 64 - 16 < kept[-1] <= 64  # --quick budget, blocks of 16
    names = {t["target"].split(" ")[0] for t in data["targets"]}
    assert names == {"morphkv"}
    assert len(data["targets"]) == 4
    for png in ("speed_tokens_per_s.png", "speed_memory.png"):
        assert (out / png).stat().st_size > 1000


def test_quick_in_process_with_model_object(tmp_path, capsys):
    model = tiny_llama()
    args = _args("--quick", "--out", str(tmp_path))
    result = speed.execute(args, model=model)
    _check_length_result(result, tmp_path, list(speed.DEFAULT_ARMS))
    printed = capsys.readouterr().out
    assert "PASS" in printed or "MISS" in printed
    assert "median ms/token" in printed


def test_quick_worker_processes(tmp_path):
    arms = ["full", "rotating", "morphkv"]
    args = _args(
        "--quick", "--model", speed.RANDOM_TINY, "--arms", ",".join(arms), "--out", str(tmp_path)
    )
    result = speed.execute(args)
    assert result["mode"].startswith("one worker process per arm")
    _check_length_result(result, tmp_path, arms)


def test_quick_sampled_full_arm_stops_early(tmp_path):
    args = _args(
        "--quick",
        "--in-process",
        "--model",
        speed.RANDOM_TINY,
        "--arms",
        "full,morphkv",
        "--full-max-tokens",
        "150",
        "--sample",
        "10",
        "--chunk",
        "16",
        "--out",
        str(tmp_path),
    )
    result = speed.execute(args)
    assert result["records"]["full"][-1]["position"] == 150
    assert result["records"]["morphkv"][-1]["position"] == 300
    assert all(r["timed_tokens"] == 10 for r in result["records"]["morphkv"])


def test_quick_micro_is_the_layer_grid(tmp_path):
    assert speed.execute(_args("--micro", "--quick", "--out", str(tmp_path))).get("exit", 0) == 0
    data = json.loads((tmp_path / "layer_quick.json").read_text())
    assert data["grid"] and {"morphkv", "h2o"} <= {r["method"] for r in data["rows"]}
    for r in data["rows"]:
        assert r["decode_us"] > 0 and r["rotating_us"] > 0 and r["chunk_ms"] > 0
    assert (tmp_path / "layer.png").stat().st_size > 1000


def test_layer_overhead_blas_quick(tmp_path):
    from morphkv.bench import blas, layer, overhead

    def parse(module, *argv):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        return parser.parse_args(list(argv))

    specs = "morphkv:window=4,streaming_llm"
    args = parse(layer, "--quick", "--methods", specs, "--out", str(tmp_path))
    result = layer.execute(args)
    assert [r["method"] for r in result["rows"]] == ["morphkv:window=4", "streaming_llm"]
    assert [r["window"] for r in result["rows"]] == [4, 8]  # the spec's option over --window
    assert (tmp_path / "layer.png").stat().st_size > 1000
    assert overhead.run(parse(overhead, "--quick", "--out", str(tmp_path))) == 0
    data = json.loads((tmp_path / "overhead_quick.json").read_text())
    assert set(data["median"]) == {"kvcache", "rotating", "morphkv", "proxy"}
    assert all(m["decode_ms"] > 0 for m in data["median"].values())
    rc = blas.run(parse(blas, "--quick", "--out", str(tmp_path)))
    if rc == 0:  # OpenBLAS installed: both runs happened
        data = json.loads((tmp_path / "blas_quick.json").read_text())
        assert set(data["speedup"]) == {"matmul_1024_f32", "forward_256_tokens", "prompt_tps",
                                        "generation_tps"}


def test_kernels_counts_a_block_of_decode_steps(tmp_path):
    """The MLX engine never reads the device on the host (evictions included); the host
    engine reads it at every eviction; kernels are counted with the layer's attention."""
    from morphkv.bench import kernels

    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--arms",
                              "rotating,tuned:block=1:engine=mlx,tuned:block=8,"
                              "tuned:block=8:engine=host,tuned:block=1"])
    rows = {r["cache"]: r for r in kernels.execute(args)["rows"]}
    assert rows["rotating"]["host_syncs_per_step"] == 0
    assert rows["tuned:block=1:engine=mlx"]["host_syncs_per_step"] == 0
    assert rows["tuned:block=1"]["host_syncs_per_step"] >= 1  # block 1 runs on the host
    assert rows["tuned:block=8"]["host_syncs_per_step"] == 0
    assert rows["tuned:block=8"]["steps"] == 8
    assert rows["tuned:block=8:engine=host"]["host_syncs_per_step"] >= 1 / 8
    assert rows["rotating"]["kernels_per_step"] < rows["tuned:block=8"]["kernels_per_step"]
    assert (tmp_path / "kernels_quick.json").exists()
