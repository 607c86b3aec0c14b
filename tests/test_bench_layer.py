"""``morphkv bench speed --mode layer``: one layer's update per arm beside RotatingKVCache, the
seed's API (keys as proxies) included, on both engines; JSON written."""

from __future__ import annotations

import argparse
import json

import pytest

from morphkv.bench import layer
from morphkv.eval.runner import run


def test_layer_times_each_arm_beside_rotating(tmp_path):
    parser = argparse.ArgumentParser()
    layer.add_arguments(parser)
    args = parser.parse_args(["--quick", "--no-plot", "--out", str(tmp_path), "--arms",
                              "seed,tova:block=1"])
    rows = {r["arm"]: r for r in run(layer.Layer(args))["rows"]}
    assert rows["seed"]["engine"] == "mlx"
    assert {r["queries"] for r in rows.values()} == {"proxy", "real"}  # tova reads attention
    for row in rows.values():
        assert row["decode_us"] > 0 and row["rotating_us"] > 0 and row["chunk_ms"] > 0
        assert row["decode_cpu_ratio"] == pytest.approx(
            row["decode_cpu_us"] / row["rotating_cpu_us"])
    saved = json.loads((tmp_path / "layer_quick.json").read_text())
    assert [r["arm"] for r in saved["rows"]] == list(rows)


def test_a_bad_arm_fails_before_any_timing(tmp_path):
    parser = argparse.ArgumentParser()
    layer.add_arguments(parser)
    args = parser.parse_args(["--quick", "--no-plot", "--out", str(tmp_path), "--arms",
                              "seed,nosuchrule"])
    with pytest.raises(SystemExit, match="nosuchrule"):
        run(layer.Layer(args))
    assert not (tmp_path / "layer_quick.json").exists()
