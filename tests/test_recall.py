"""``morphkv eval recall``: arm specs, scoring, items, and a smoke run on the embedded model."""

from __future__ import annotations

import json

import pytest

from morphkv.bench import recall as R
from morphkv.cli import main


def test_arm_specs_map_onto_config_fields():
    arms = R.parse_arms("full,streaming_llm,morphkv:window=32,fusion=max,tova:morphkv_n_sink=2")
    assert [a.label for a in arms] == [
        "full",
        "streaming_llm",
        "morphkv:window=32,fusion=max",
        "tova:morphkv_n_sink=2",
    ]
    config = arms[2].config(128, n_sink=4)
    assert (config.method, config.morphkv_budget) == ("morphkv", 128)
    assert (config.morphkv_window, config.morphkv_fusion, config.morphkv_n_sink) == (32, "max", 4)
    assert arms[3].config(64, n_sink=4).morphkv_n_sink == 2  # the spec beats --n-sink


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
    argv = ["eval", "recall", "--arms", "morphkv:window=60", "--budgets", "64", "--out", str(out)]
    assert main(argv) == 2
    assert "morphkv_budget must exceed" in capsys.readouterr().err
    assert main(["eval", "recall", "--arms", "h2o:colour=1", "--out", str(out)]) == 2
    assert "'colour'" in capsys.readouterr().err
    assert not out.exists()


def test_exact_match_is_on_whole_words():
    assert R.is_correct("Mia.", "Mia")
    assert R.is_correct(" is 47, I remember!", "47")
    assert not R.is_correct("Miami.", "Mia")
    assert not R.is_correct("4 and 7", "47")


@pytest.mark.slow
def test_items_are_deterministic_split_apart_and_long_enough():
    from smollm2_fixture import load_embedded

    _, tok = load_embedded()
    a = [R.build_item(tok, 0, "tune", i, 200) for i in range(4)]
    assert a == [R.build_item(tok, 0, "tune", i, 200) for i in range(4)]
    test = [R.build_item(tok, 0, "test", i, 200) for i in range(4)]
    assert [x.ids for x in a] != [x.ids for x in test]
    for item in a + test:
        assert item.distance >= 200 and item.turns >= 3 and len(item.fact_positions) >= 2
        assert max(item.fact_positions) < item.fact_end
        text = tok.decode(list(item.ids))
        assert item.value in text.split("<|im_start|>user")[1]  # stated in the first user turn
        assert text.count(item.value) == 2  # the statement and its acknowledgement, not later
        fact = next(f for f in R.FACTS if f.kind == item.kind)
        assert text.endswith("<|im_start|>assistant\n" + fact.lead_in)


@pytest.mark.slow
def test_quick_run_writes_table_json_and_png(tmp_path, capsys):
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # skip (or fail under CI) when the model is unobtainable
    out = tmp_path / "recall"
    assert main(["eval", "recall", "--quick", "--quiet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| streaming_llm |" in printed and "budget 32" in printed
    result = json.loads((out / "recall.json").read_text())
    assert (out / "recall.png").stat().st_size > 0
    summary = result["summary"]
    assert summary["built"] == 2 and summary["full_correct"] >= 1
    rows = {r["arm"]: r for r in summary["rows"]}
    assert set(rows) == {"streaming_llm", "morphkv"}
    for row in rows.values():
        assert row["n"] == summary["full_correct"] and 0 <= row["correct"] <= row["n"]
    # equal budget, equal bytes; both below the full cache, which keeps the whole prompt
    # same K/V storage; morphkv also holds its selection state (a few percent)
    assert rows["streaming_llm"]["nbytes"] <= rows["morphkv"]["nbytes"]
    assert rows["morphkv"]["nbytes"] <= 1.1 * rows["streaming_llm"]["nbytes"]
    assert rows["morphkv"]["nbytes"] < summary["full_nbytes"]
    # the fact lies past the budget: recency keeps none of it, the full cache all of it
    assert rows["streaming_llm"]["fact_kept"] == 0
    assert all(r["full"]["fact_kept"] == 1 for r in result["items"])
