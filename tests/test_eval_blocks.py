"""``morphkv eval fidelity --mode blocks``: recall and KL per eviction block, on a tiny
random-weight llama
(fast) and on the embedded model (slow)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from morphkv.eval import blocks as B
from morphkv.eval import blocks_report as R
from morphkv.eval.models import tiny_llama


class ChatBytes:
    """Tokenizer stand-in for a random-weight model: UTF-8 bytes, ChatML template."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", "replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def _args(*argv):
    parser = argparse.ArgumentParser()
    B.add_arguments(parser)
    return parser.parse_args(list(argv))


def _inside(point, interval):
    return interval[0] - 1e-9 <= point <= interval[1] + 1e-9


def _check(data: dict, blocks: list[int]) -> None:
    assert data["blocks"] == blocks
    labels = [f"block {b}" for b in blocks] + ["streaming_llm"]
    assert [r["arm"] for r in data["rows"]] == labels
    stream = data["specs"]["streaming_llm"]
    assert stream == f"streaming_llm:memory={max(data['bytes_bound'].values())}"
    kl = data["kl"]
    assert kl["positions"] and all(n > 0 for n in kl["positions"].values())
    for row in data["rows"]:
        k = row["kl"]
        assert k["mean"] > 0 and _inside(k["mean"], k["interval"])
        assert _inside(k["ratio"], k["ratio_interval"])
        assert set(k["per_text"]) == set(kl["texts"])
        rec = row["recall"]
        counted = data["recall"]["summary"]["counted"]
        assert rec["n"] == counted and 0 <= rec["correct"] <= counted
        if counted:
            assert _inside(rec["accuracy"], rec["interval"])
    ref = data["rows"][0]
    assert ref["kl"]["ratio"] == pytest.approx(1.0) and ref["within"] == {"recall": (
        True if data["recall"]["summary"]["counted"] else None), "kl": True}
    assert data["choice"]["block"] in data["choice"]["inside"]
    assert 1 in data["choice"]["inside"]


def test_quick_run_writes_rows_with_intervals(tmp_path):
    args = _args("--quick", "--quiet", "--split", "test", "--out", str(tmp_path))
    result = B.execute(args, tiny_llama(3), ChatBytes())
    data = json.loads((tmp_path / "blocks_test_32.json").read_text())
    assert (tmp_path / "blocks_test_32.png").stat().st_size > 0
    _check(data, [1, 4, 8])
    assert "prose_stdlib" in data["kl"]["texts"]  # test prose: another source than tune's
    assert result["table"].count("\n| block ") == 3
    (tmp_path / "blocks_test_32.png").unlink()
    R.main([str(tmp_path / "blocks_test_32.json")])  # redraws table and PNG from the JSON
    assert (tmp_path / "blocks_test_32.png").stat().st_size > 0
    assert json.loads((tmp_path / "blocks_test_32.json").read_text())["table"] == result["table"]


def test_bootstrap_pairs_draws_and_contains_the_mean():
    rng = np.random.default_rng(1)
    base = {"a": rng.random(300), "b": rng.random(130)}
    per = {"block 1": base, "block 8": {t: 2 * v for t, v in base.items()}}
    out = R.bootstrap(per, size=16, draws=300)["arms"]
    assert out["block 8"]["ratio"] == pytest.approx(2.0)
    assert out["block 8"]["ratio_interval"] == pytest.approx([2.0, 2.0])  # paired draws
    for arm in out.values():
        assert _inside(arm["mean"], arm["interval"])
        assert arm["interval"][1] - arm["interval"][0] > 0


def test_bad_flags_are_one_line_errors(tmp_path):
    for argv, words in ((["--blocks", "4,8"], "include 1"), (["--blocks", "x"], "integers"),
                        (["--no-recall", "--no-kl"], "nothing"),
                        (["--budget", "64", "--blocks", "1,32"], "budget 64")):
        with pytest.raises(SystemExit, match=words):
            B.settings(_args(*argv))
    bad = tmp_path / "bad.json"
    bad.write_text('{"args": {"split": "test", "seed": 0, "set": "natural", "budgets": [128]},'
                   ' "items": []}')
    with pytest.raises(SystemExit, match="split"):
        B.settings(_args("--split", "tune", "--items-from", str(bad)))
    with pytest.raises(SystemExit, match="answered none"):
        B.settings(_args("--split", "test", "--items-from", str(bad)))
    with pytest.raises(SystemExit, match="not a bench speed --mode overhead"):
        R.read_speed(str(bad), "recommended", [1])


def test_speed_join_reads_an_overhead_json(tmp_path):
    arms = {"rotating": {"decode_ms": 50.0, "prefill_s": 4.0, "decode_cpu_ms": 100.0,
                         "prefill_cpu_s": 8.0}}
    for name, f in (("tuned:block=1", 1.3), ("tuned", 1.05)):
        arms[name] = {k: f * v for k, v in arms["rotating"].items()}
    path = tmp_path / "overhead.json"
    path.write_text(json.dumps({"args": {"budget": 512, "prompt_tokens": 1024},
                                "by_context": {"1024": arms}}))
    speed = R.read_speed(str(path), "tuned", [1, 16, 32])
    assert set(speed) == {"block 1", "block 16"}  # "tuned" is block 16 at budget 512
    assert speed["block 16"]["contexts"]["1024"]["decode"] == pytest.approx(1.05)


@pytest.mark.slow
def test_quick_run_on_the_embedded_model(tmp_path):
    from smollm2_fixture import load_embedded

    model, tok = load_embedded()
    args = _args("--quick", "--quiet", "--out", str(tmp_path))
    B.execute(args, model, tok)
    _check(json.loads((tmp_path / "blocks_tune_32.json").read_text()), [1, 4, 8])
