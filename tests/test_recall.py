"""``morphkv eval recall --data longchat``: arm specs, scoring, items, intervals, retention, and
a smoke run on the embedded model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from morphkv.cli import main
from morphkv.eval import models, runner
from morphkv.eval import recall as R
from morphkv.eval import recall_items as I
from morphkv.eval.chat_recall import wilson

LONGCHAT = ["eval", "recall", "--data", "longchat"]  # the long-chat fact recall (was eval recall)


@pytest.fixture
def one_load(monkeypatch):
    """The commands below reuse the module's one load of the embedded model (seconds each)."""
    from smollm2_fixture import load_embedded

    pair = load_embedded()
    monkeypatch.setattr(runner, "load_model", lambda name: pair)


def test_arm_specs_map_onto_config_fields():
    arms = R.parse_arms("full,streaming_llm,morphkv:window=32,fusion=max,tova:morphkv_n_sink=2,"
                        "peak:recent=32:value=true:pool=3,tuned:peak=0.25,rotating")
    assert [a.label for a in arms] == [
        "full", "streaming_llm", "morphkv:window=32,fusion=max", "tova:morphkv_n_sink=2",
        "peak:recent=32:value=true:pool=3", "tuned:peak=0.25", "rotating",
    ]
    config = arms[2].arm.config(128, n_sink=4)
    assert (config.method, config.morphkv_budget) == ("morphkv", 128)
    assert (config.morphkv_window, config.morphkv_fusion, config.morphkv_n_sink) == (32, "max", 4)
    assert arms[3].arm.config(64, n_sink=4).morphkv_n_sink == 2  # the spec beats --n-sink
    peak = arms[4].arm.config(128, n_sink=4)
    assert (peak.method, peak.recent, peak.morphkv_value, peak.morphkv_pool) == (
        "peak", 32, True, 3)
    fused = arms[5].arm.config(128, n_sink=4)
    assert fused.morphkv_peak == 0.25 and fused.recent == 64 and fused.morphkv_value
    assert arms[0].arm.method == "full" and arms[6].arm.is_baseline


@pytest.mark.parametrize(
    "spec, words",
    [
        ("morphkv:windw=32", "windw"),
        ("morphkv:morphkv_budget=64", "--budgets"),
        ("morphkv:budget=64", "--budgets"),
        ("morphkv:window", "field=value"),
        ("lru", "unknown method 'lru'"),
    ],
)
def test_bad_arm_specs_are_named(spec, words):
    with pytest.raises(ValueError, match=words):
        R.parse_arms(spec)


def test_bad_settings_fail_before_any_work(tmp_path, capsys):
    out = tmp_path / "r"
    argv = [*LONGCHAT, "--arms", "morphkv:window=60", "--budgets", "64", "--out",
            str(out)]
    assert main(argv) == 2
    assert "morphkv_budget must exceed" in capsys.readouterr().err
    assert main([*LONGCHAT, "--arms", "h2o:colour=1", "--out", str(out)]) == 2
    assert "'colour'" in capsys.readouterr().err
    assert main([*LONGCHAT, "--arms", "peak:pool=2", "--out", str(out)]) == 2
    assert "odd int" in capsys.readouterr().err
    assert not out.exists()


def test_exact_match_is_on_whole_words():
    assert I.is_correct("Mia.", "Mia")
    assert I.is_correct(" is 47, I remember!", "47")
    assert I.is_correct(" maple-river.", "maple-river")
    assert not I.is_correct("Miami.", "Mia")
    assert not I.is_correct("4 and 7", "47")
    assert not I.is_correct(" maple.", "maple-river")


def test_wilson_interval():
    assert wilson(0, 0) is None
    lo, hi = wilson(30, 48)
    assert lo < 30 / 48 < hi and round(lo, 3) == 0.484 and round(hi, 3) == 0.748
    assert wilson(0, 12)[0] == 0 and wilson(12, 12)[1] == 1


def test_fact_kinds_and_distractor_kinds_cover_the_issue():
    kinds = {f.kind for f in I.FACTS}
    assert {"name", "number", "place", "password", "job"} <= kinds
    assert len(I.FILLERS) >= 4
    text = " ".join(u + " " + r for turns in I.FILLERS.values() for u, r in turns).lower()
    assert not any(c.isdigit() for c in text)
    for fact in I.FACTS:  # no distractor says a value
        assert not any(f" {v.lower()} " in f" {text} " for v in fact.values if len(v) > 3)


class _Rotating:  # what stored_positions reads of mlx_lm's RotatingKVCache
    def __init__(self, offset, max_size, keep):
        self.offset, self.max_size, self.keep = offset, max_size, keep


def test_retention_reads_morphkv_and_mlx_lm_caches():
    assert models.stored_positions(_Rotating(10, 32, 4)).tolist() == [list(range(10))]
    kept = models.stored_positions(_Rotating(100, 32, 4))[0]
    assert kept.tolist() == [0, 1, 2, 3, *range(72, 100)]
    assert models.retention([_Rotating(100, 32, 4)], (2, 3, 50, 80)) == [0.75]
    assert models.retention([_Rotating(100, 32, 4)], ()) is None

    class Kept:
        kept_positions = np.array([[[0, 5, 7], [1, 5, 9]]])

    assert models.retention([Kept()], (5, 7)) == [0.75]


@pytest.mark.slow
def test_items_are_deterministic_split_apart_and_long_enough():
    from smollm2_fixture import load_embedded

    _, tok = load_embedded()
    a = [I.build_item(tok, 0, "tune", i, 200) for i in range(4)]
    assert a == [I.build_item(tok, 0, "tune", i, 200) for i in range(4)]
    test = [I.build_item(tok, 0, "test", i, 200) for i in range(len(I.FACTS))]
    assert [x.ids for x in a] != [x.ids for x in test[:4]]
    assert {x.kind for x in test} == {f.kind for f in I.FACTS}  # test items cycle the kinds
    for item in a + test:
        assert item.distance >= 200 and item.turns >= 3 and len(item.fact_positions) >= 1
        assert max(item.fact_positions) < item.fact_end
        assert len(set(item.distractors)) >= 2
        text = tok.decode(list(item.ids))
        assert item.value in text.split("<|im_start|>user")[1]  # stated in the first user turn
        assert text.count(item.value) == 2  # the statement and its acknowledgement, not later
        fact = next(f for f in I.FACTS if f.kind == item.kind)
        assert text.endswith("<|im_start|>assistant\n" + fact.lead_in)


@pytest.mark.slow
def test_quick_run_writes_table_json_and_png(tmp_path, capsys, one_load):
    out = tmp_path / "recall"
    assert main([*LONGCHAT, "--quick", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| `streaming_llm@32` |" in printed and "Wilson" in printed
    result = json.loads((out / "recall.json").read_text())
    assert (out / "recall.png").stat().st_size > 0
    summary, items = result["summary"], result["items"]
    full_right = sum(r["arms"]["full"]["correct"][0] for r in items)
    assert summary["_items"]["chats"] == len(items) == 2 and full_right >= 1
    for label in ("streaming_llm@32", "morphkv@32"):
        s = summary[label]
        assert s["of_full"]["n"] == full_right and 0 <= s["of_full"]["k"] <= full_right
        lo, hi = s["of_full"]["ci95"]
        assert lo <= s["of_full"]["rate"] <= hi and len(s["layers"]) == 30
    rows = {label: summary[label] for label in ("full", "streaming_llm@32", "morphkv@32")}
    # same K/V storage; morphkv also holds its selection state (a few percent)
    assert rows["streaming_llm@32"]["mib"] <= rows["morphkv@32"]["mib"]
    assert rows["morphkv@32"]["mib"] <= 1.1 * rows["streaming_llm@32"]["mib"]
    assert rows["morphkv@32"]["mib"] < rows["full"]["mib"]
    # the fact lies past the budget: recency keeps none of it, the full cache all of it
    assert rows["streaming_llm@32"]["retention"] == 0
    assert all(r["arms"]["full"]["retention"] == [[1.0] * 30] for r in items)
    assert "load_average" in result
