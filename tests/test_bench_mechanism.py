"""Synthetic retention benchmark: smoke run and mechanism assertions that can fail."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from morphkv.bench import mechanism as M


def test_quick_run_writes_json_and_png(tmp_path):
    parser = argparse.ArgumentParser()
    M.add_arguments(parser)
    result = M.execute(parser.parse_args(["--quick", "--quiet", "--out", str(tmp_path)]))
    data = json.loads((tmp_path / "mechanism.json").read_text())
    assert (tmp_path / "mechanism.png").stat().st_size > 0
    assert data["rows"] and len(data["rows"]) == len(result["rows"])
    arms = {r["arm"] for r in data["rows"]}
    assert arms == set(M.ARMS)
    for r in data["rows"]:
        assert 0.0 <= r["kept"] <= 1.0 and 0.0 <= r["mass"] <= 1.0 + 1e-9 and r["err"] >= 0


def test_invalid_grid_points_are_skipped_and_reported():
    ns = argparse.Namespace(lengths=[256], budgets=[32, 64], windows=[8, 32])
    points, skipped = M.grid(ns)
    assert (256, 32, 32) not in points and (256, 64, 32) in points
    assert [(s["budget"], s["window"]) for s in skipped] == [(32, 32)]


def _mean(scenario, length, budget, window, arm, key, seeds=5):
    return np.mean(
        [M.run_point(scenario, length, budget, window, arm, s)[key] for s in range(seeds)]
    )


def test_recall_morphkv_keeps_the_recalled_topic_recency_does_not():
    # Grid point of the full benchmark: L=256, budget 64, window 8, 5 seeds.
    # Observed: morphkv_mean 0.40 of the old topic kept, streaming_llm 0.00, random 0.12.
    morph = _mean("recall", 256, 64, 8, "morphkv_mean", "kept")
    stream = _mean("recall", 256, 64, 8, "streaming_llm", "kept")
    rand = _mean("recall", 256, 64, 8, "random", "kept")
    assert morph > stream + 0.2
    assert morph > rand + 0.1
    # ... and it reads the probe closer to the full-cache output than recency does
    assert _mean("recall", 256, 64, 8, "morphkv_mean", "err") < _mean(
        "recall", 256, 64, 8, "streaming_llm", "err"
    )


@pytest.mark.parametrize("arm", ["morphkv_mean", "morphkv_max", "tova", "h2o"])
def test_stable_control_no_attention_rule_is_catastrophically_worse_than_random(arm):
    # Observed at L=256, budget 64, window 8: probe error morphkv 0.70, max 0.72, tova 0.83,
    # h2o 1.22, random 1.71, streaming 1.70 (every attention rule is below random here).
    err = _mean("stable", 256, 64, 8, arm, "err")
    rand = _mean("stable", 256, 64, 8, "random", "err")
    assert err < 1.25 * rand


def test_stable_control_keeps_the_same_fraction_for_everybody():
    kept = {a: _mean("stable", 256, 64, 8, a, "kept", seeds=2) for a in M.ARMS}
    assert max(kept.values()) - min(kept.values()) < 1e-12


def test_commands_follow_the_cli_contract(tmp_path):
    """run(args) returns an int, or execute(args) a dict of figures (the CLI takes its "exit");
    help is the docstring."""
    from morphkv.bench import blas, layer, overhead, speed
    from morphkv.eval import fidelity, generation, report

    for module in (M, fidelity, generation, report, speed, layer, overhead, blas):
        assert callable(module.add_arguments)
        assert callable(getattr(module, "run", None) or getattr(module, "execute", None))
        assert (module.__doc__ or "").strip().splitlines()[0]
    parser = argparse.ArgumentParser()
    M.add_arguments(parser)
    M.execute(parser.parse_args(["--quick", "--quiet", "--out", str(tmp_path)]))
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    args = parser.parse_args(["--results", str(tmp_path.parent), "--docs", str(tmp_path / "docs")])
    assert report.run(args) == 0
    assert (tmp_path.parent / "report.md").read_text().startswith("# Results")
    assert not (tmp_path / "docs" / "results.md").exists()  # the docs keep current figures


def test_report_renders_every_committed_figure(tmp_path):
    """docs/figures holds JSON of every benchmark kind: each one gets its section."""
    from pathlib import Path

    from morphkv.eval import report

    docs = Path(__file__).resolve().parents[1] / "docs"
    found = report.load_results(tmp_path / "none", docs)
    text = report.build_report(found)
    for name in found:
        assert name in text
    assert "`morphkv bench speed --mode layer`" in text and "`morphkv eval fidelity`" in text


def test_missing_matplotlib_is_one_line_before_any_work(tmp_path, monkeypatch):
    import sys

    from morphkv.eval import fidelity

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    parser = argparse.ArgumentParser()
    fidelity.add_arguments(parser)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        fidelity.execute(parser.parse_args(["--quick", "--out", str(tmp_path)]), model=object())
    assert not any(tmp_path.iterdir())


def test_cli_lists_the_bench_commands(capsys):
    from morphkv.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in ("mechanism", "speed", "blas", "serve"):
        assert name in out
