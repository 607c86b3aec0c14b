"""Fidelity and generation benchmarks on a tiny random-weight llama (no download)."""

from __future__ import annotations

import argparse
import json

import pytest

from morphkv.eval import fidelity as F
from morphkv.eval import generation as G
from morphkv.eval import texts as T
from morphkv.eval.arms import Arm, grid_arms
from morphkv.eval.metrics import distinct, repetition_rate
from morphkv.eval.models import tiny_llama
from morphkv.eval.runner import run


class ByteTokenizer:
    """Minimal tokenizer stand-in: UTF-8 bytes as token ids, no chat template."""

    chat_template = None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def _args(module, *argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_fidelity_quick_writes_json_and_png(tiny, tmp_path):
    args = _args(F, "--quick", "--quiet", "--out", str(tmp_path))
    result = run(F.Fidelity(args), tiny, ByteTokenizer())
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert (tmp_path / "fidelity.png").stat().st_size > 0
    assert len(data["rows"]) == len(result["rows"]) > 0
    full = [r for r in data["rows"] if r["arm"] == "full"]
    assert full and all(r["kl"] < 1e-4 and r["top1"] == 1.0 for r in full)
    for r in data["rows"]:
        if r["arm"] != "full":
            assert r["kl"] >= 0 and 0 <= r["top1"] <= 1 and r["positions"] > 0
            assert r["kv_bytes_kept"] < max(x["kv_bytes_kept"] for x in full)


def test_arm_parsing():
    arm = Arm.parse("morphkv:max:32:attn")
    assert (arm.method, arm.fusion, arm.window, arm.scoring) == ("morphkv", "max", 32, "attention")
    assert arm.name == "morphkv_max_w32_attn"
    assert Arm.parse("morphkv:fusion=max:window=32:scoring=attention").name == arm.name
    assert Arm.parse("h2o").name == "h2o_w8"
    with pytest.raises(ValueError, match="bogus"):
        Arm.parse("morphkv:bogus")


def test_arm_options_map_onto_any_config_field():
    arm = Arm.parse("morphkv:window=32:sinks=2:seed=7", scoring="proxy")
    cfg = arm.config(128)
    assert (cfg.morphkv_window, cfg.morphkv_n_sink, cfg.seed, cfg.scoring) == (32, 2, 7, "proxy")
    assert cfg.morphkv_budget == 128 and arm.name == "morphkv_mean_w32_n_sink2_seed7"
    grid = grid_arms("morphkv", ["window=8/32", "scoring=attention"])
    assert grid == ["morphkv:window=8:scoring=attention", "morphkv:window=32:scoring=attention"]
    assert [Arm.parse(g).name for g in grid] == ["morphkv_mean_w8_attn", "morphkv_mean_w32_attn"]
    with pytest.raises(ValueError, match="no KVCacheConfig field"):
        Arm.parse("morphkv:nonsense=3")
    with pytest.raises(ValueError, match="unknown method"):
        Arm.parse("lru")
    with pytest.raises(ValueError, match="morphkv_budget must exceed"):
        Arm.parse("morphkv:window=32").config(16)
    with pytest.raises(ValueError, match="morphkv_fusion"):
        Arm.parse("morphkv:fusion=median").config(128)


def test_equal_bytes_budget_is_measured(tiny):
    ref = Arm.parse("streaming_llm")
    target = F.measure_bytes(tiny, ref, 96)
    budget, held = F.budget_for_bytes(tiny, ref, target)
    assert budget == 96 and held == target  # the reference maps onto itself
    morph = Arm.parse("morphkv:attn")
    budget, held = F.budget_for_bytes(tiny, morph, target)
    assert held <= target < F.measure_bytes(tiny, morph, budget + 1)
    assert budget < 96  # today the selection engine holds more than the keys it ranks
    with pytest.raises(ValueError, match="smallest budget"):
        F.budget_for_bytes(tiny, morph, 10)
    floor = Arm.parse("peak:window=1:recent=32:attn")  # the smallest budget is 4 + 32 + 1
    budget, held = F.budget_for_bytes(tiny, floor, target)
    assert 37 <= budget < 96 and held <= target


def test_fidelity_equal_bytes_rows(tiny, tmp_path):
    args = _args(F, "--quiet", "--out", str(tmp_path), "--texts", "prose", "--prose-tokens",
                 "120", "--budgets", "96", "--arms", "streaming_llm,morphkv:attn",
                 "--equal-bytes", "streaming_llm", "--no-full-arm")
    res = run(F.Fidelity(args), tiny, ByteTokenizer())
    rows = {r["arm"]: r for r in res["rows"]}
    assert rows["streaming_llm_w8"]["arm_budget"] == 96
    assert rows["morphkv_mean_w8_attn"]["arm_budget"] < 96
    morph, stream = rows["morphkv_mean_w8_attn"], rows["streaming_llm_w8"]
    assert morph["bytes_measured"] <= stream["bytes_target"]
    assert res["settings"]["equal_bytes"] == "streaming_llm_w8"


def test_generation_quick_writes_json_and_png(tiny, tmp_path):
    args = _args(G, "--quick", "--quiet", "--out", str(tmp_path))
    result = run(G.Generation(args), tiny, ByteTokenizer())
    data = json.loads((tmp_path / "generation.json").read_text())
    assert (tmp_path / "generation.png").stat().st_size > 0
    assert {r["arm"] for r in data["rows"]} == {"full", "streaming_llm_w8", "morphkv_mean_w8"}
    for r in result["rows"]:
        assert r["generated"] == 40
        assert 0 <= r["rep10"] <= 1 and 0 < r["distinct1"] <= 1 and 0 < r["distinct2"] <= 1


def test_degeneration_measures():
    assert repetition_rate(list(range(30)), 10) == 0.0
    loop = [1, 2, 3] * 10  # 21 ten-grams, only 3 distinct
    assert repetition_rate(loop, 10) == pytest.approx(18 / 21)
    assert distinct([1, 1, 2, 2], 1) == 0.5
    assert distinct([1, 2, 1, 2], 2) == pytest.approx(2 / 3)


def test_texts_are_available_without_download():
    tok = ByteTokenizer()
    assert len(T.prose_text()) > 20_000
    docs = T.prose_documents(tok, 2000, 3)
    assert len(docs) == 3 and all(len(d) == 2000 for d in docs)
    assert len(T.CONVERSATIONS) >= 3 and len(T.GENERATION_PROMPTS) == 6
    conv = tok.decode(T.conversation_tokens(tok, 0))
    assert conv.count("<|im_start|>user") >= 4


def test_fidelity_split_and_grid_choose_among_settings(tiny, tmp_path):
    """--split tune feeds the texts for choosing (not --texts); --grid adds its combinations."""
    args = _args(F, "--quick", "--quiet", "--out", str(tmp_path), "--split", "tune",
                 "--grid", "recent=0.5/0.75", "--no-full-arm")
    result = run(F.Fidelity(args), tiny, ByteTokenizer())
    assert set(result["settings"]["texts"]) == {"prose", "conversation0"}
    arms = {r["arm"] for r in result["rows"]}
    assert len(arms) == 5 and {"recent0.5", "recent0.75"} <= {a.split("_")[-1] for a in arms}
    assert all(r["kl"] >= 0 for r in result["rows"])


def test_presets_and_budget_fractions_in_arm_specs():
    arm = Arm.parse("morphkv:recent=0.5:attn", window=8)
    assert arm.config(128).recent == 64
    rec = Arm.parse("tuned", window=8, scoring="proxy")  # command defaults do not apply
    assert rec.config(256) == __import__("morphkv").PRESETS["tuned"](256)
    assert Arm.parse("recommended:window=8").config(128).window == 8
