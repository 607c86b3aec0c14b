"""Evaluation at equal bytes: memory arms (``memory=f16`` / a size) resolved for the model,
natural-chat recall items, and ``morphkv eval fidelity --mode bytes``."""

from __future__ import annotations

import json

import pytest

from morphkv.cli import main
from morphkv.eval import recall_items as N
from morphkv.eval.arms import Arm, f16_bytes
from morphkv.eval.models import tiny_llama
from morphkv.mlxlm.layout import morph_caches
from morphkv.runtime.argtypes import UsageError


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(5, head_dim=64)


def test_memory_arms_resolve_to_the_f16_bytes(tiny):
    memory = f16_bytes(tiny, 64)
    assert memory == 2 * 2 * (64 + 64) * 2 * 64  # layers x KV heads x (K+V dims) x 2 bytes
    for spec, bits in (("recommended:memory=f16", 8), ("streaming_llm:memory=f16:bits=8", 8),
                       ("recommended:memory=f16:bits=None:recent=0.25", None)):
        caches = Arm.parse(spec).caches(tiny, 64)
        config = morph_caches(caches)[0].config
        assert config.kv_memory == memory and config.kv_bits == bits and config.budget > 0
        if bits == 8:
            assert config.budget > 64  # 8-bit storage buys tokens
    share = morph_caches(Arm.parse("recommended:memory=f16:recent=0.25").caches(tiny, 64))
    assert share[0].config.recent == max(16, share[0].config.budget // 4)
    sized = morph_caches(Arm.parse("h2o:memory=300K").caches(tiny, 64))[0].config
    assert sized.kv_memory == 300 * 1024 and sized.kv_bits is None


def test_a_memory_the_model_cannot_hold_is_a_usage_error_naming_the_arm(tiny):
    small = r"arm h2o\S* on this model: kv_memory=1024 bytes .*too small"
    with pytest.raises(UsageError, match=small):
        Arm.parse("h2o:memory=1K").caches(tiny, 64)


def test_a_memory_arm_checks_without_a_model():
    config = Arm.parse("recommended:memory=f16").config(128)
    assert config.budget == 0 and config.method == "peak" and config.kv_bits == 8
    config = Arm.parse("recommended:memory=f16:method=morphkv:peak=1").config(128)
    assert config.budget == 0 and config.morphkv_peak == 1


def test_distractor_pools_are_prose_and_disjoint():
    tune, test = N.pool("tune"), N.pool("test")
    assert len(tune) >= 20 and len(test) >= 20
    assert not {t for t, _ in tune} & {t for t, _ in test}
    for _, paragraphs in tune + test:
        for p in paragraphs:
            assert len(p) >= 160 and ">>>" not in p and "\n" not in p


@pytest.mark.slow
def test_natural_items_are_deterministic_split_apart_and_far():
    from smollm2_fixture import load_embedded

    _, tok = load_embedded()
    items = {s: [N.build_natural_item(tok, 0, s, i, 64) for i in range(6)] for s in N.SPLITS}
    assert items["tune"] == [N.build_natural_item(tok, 0, "tune", i, 64) for i in range(6)]
    assert not {x.ids for x in items["tune"]} & {x.ids for x in items["test"]}
    kinds = {k.name: k for k in N.KINDS}
    for split, found in items.items():
        for item in found:
            assert 3 * 64 <= item.distance and item.fact_positions
            assert max(item.fact_positions) < item.fact_end
            text = tok.decode(list(item.ids))
            kind = kinds[item.kind]
            assert text.endswith("<|im_start|>assistant\n" + kind.lead_in)
            assert item.value in text and kind.question in text
            assert all(kind.question not in s for s in kind.statements)
            topics = [t for t, _ in N.pool(split)]
            assert all(t in topics for t in item.distractors)


@pytest.mark.slow
def test_eval_bytes_writes_kl_at_equal_bytes(tmp_path, capsys, monkeypatch):
    from smollm2_fixture import load_embedded

    from morphkv.eval import runner

    pair = load_embedded()  # the module's one load of the model
    monkeypatch.setattr(runner, "load_model", lambda name: pair)
    out = tmp_path / "bytes"
    argv = ["eval", "fidelity", "--mode", "bytes", "--split", "tune", "--tokens", "32",
            "--prose-tokens", "160",
            "--continuation-tokens", "60", "--conversation-tokens", "160", "--arms",
            "streaming_llm:memory=f16:bits=8,recommended:memory=f16,recommended:memory=f16+pin",
            "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "bytes_tune.json").read_text())
    rows = {s["arm"]: s for s in result["summary"]}
    assert set(rows) == {"streaming_llm", "streaming_llm:memory=f16:bits=8",
                         "recommended:memory=f16", "recommended:memory=f16+pin"}
    pinned, plain = rows["recommended:memory=f16+pin"]["kl"], rows["recommended:memory=f16"]["kl"]
    assert pinned["prose"] == plain["prose"]  # no turns: nothing pinned, the same cache
    assert pinned["conversation0"] != plain["conversation0"]  # the user turns were pinned
    assert rows["streaming_llm"]["mean_ratio"] == pytest.approx(1.0)
    f16 = 30 * 3 * 128 * 2 * 32  # the embedded model: 30 layers, 3 KV heads, head_dim 64
    for arm in ("streaming_llm:memory=f16:bits=8", "recommended:memory=f16",
                "recommended:memory=f16+pin"):
        assert rows[arm]["mib"] * 2**20 <= f16 and rows[arm]["tokens"] > 32
    assert (out / "bytes_tune.png").stat().st_size > 0
