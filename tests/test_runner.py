"""The shared runner (``morphkv.eval.runner``): arms checked before any work, a record per item
written as it goes, the table and PNGs at the end, one run per model of ``--model a,b``."""

from __future__ import annotations

import argparse
import json

import pytest

from morphkv.eval import runner


class Count(runner.Evaluation):
    name = "count"

    def arms(self):
        if self.args.arms == "bad":
            raise ValueError("arm 'bad': no such arm")
        return self.args.arms.split(",")

    def items(self, model, tok):
        return range(self.args.items)

    def measure(self, model, tok, item, arms, bar):
        return {"item": item, "model": model, "arms": {a: item * len(a) for a in arms}}

    def report(self, records, arms):
        summary = {a: sum(r["arms"][a] for r in records) for a in arms}
        return summary, " ".join(f"{a}={v}" for a, v in summary.items())

    def plot(self, result, path):
        path.write_bytes(b"png")


def _args(tmp_path, **kw):
    return argparse.Namespace(**{"arms": "a,bb", "items": 3, "model": None, "stem": None,
                                 "out": str(tmp_path), "no_plot": False, **kw})


def test_records_summary_table_json_and_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "load_model", lambda name: (f"model {name}", None))
    result = runner.run(Count(_args(tmp_path)))
    assert [r["item"] for r in result["items"]] == [0, 1, 2]
    assert result["summary"] == {"a": 3, "bb": 6} and "a=3 bb=6" in capsys.readouterr().out
    saved = json.loads((tmp_path / "count.json").read_text())
    assert saved["summary"] == result["summary"] and saved["benchmark"] == "count"
    assert (tmp_path / "count.png").read_bytes() == b"png"


def test_bad_arms_stop_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda name: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit, match="no such arm"):
        runner.run(Count(_args(tmp_path, arms="bad")))
    assert not any(tmp_path.iterdir())


def test_one_run_per_model(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "load_model", lambda name: (f"model {name}", None))
    runner.run(Count(_args(tmp_path, model="m1,org/m2")))
    for name in ("m1", "org-m2"):
        saved = json.loads((tmp_path / f"count_{name}.json").read_text())
        assert {r["model"] for r in saved["items"]} == {f"model {name.replace('-', '/')}"}
