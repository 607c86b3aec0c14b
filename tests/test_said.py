"""The model-said evaluations: names the model invented in a chat (``--data said``) and re-used
identifiers in long answers (``--data answers``): the data's splits, the name extraction, the
re-mention rule, the choosing rule, and smoke runs on the embedded model."""

from __future__ import annotations

import json

import pytest

from morphkv.eval import answers as A
from morphkv.eval import chat_items as S
from morphkv.eval import runner
from morphkv.eval.choose_said import CANDIDATES, choose


@pytest.mark.parametrize(("reply", "name"), [
    ('Your robot name is "Echo', "Echo"), ("**Sea Breeze**", "Sea Breeze"),
    ("The Whispering Pages", "Whispering Pages"), ("Name: Frostheim.", "Frostheim"),
    ("\u201cBook Nook\u201d is a great name!", "Book Nook"), ("", ""),
    ("Sure, here's a name for your shed:\n\n**Moonlit Haven**", "Moonlit Haven"),
    ("Here is one,\nGlimmerstone", "Glimmerstone"),
])
def test_the_invented_name_is_taken_from_the_reply(reply, name):
    assert S.name_of(reply) == name


@pytest.mark.parametrize(("reply", "name"), [
    ("In the city there lived a young wizard named Elara. Elara was wise.", "Elara"),
    ("The pirate captain's name was Jack, a brilliant pirate.", "Jack"),
    ('A helpful robot named "Alexia" has been built.', "Alexia"),
    ("The mouse was a curious little one.", ""),  # no name given: the item asks nothing
])
def test_a_story_ask_is_answered_by_its_character_name(reply, name):
    assert S.story_name(reply) == name
    assert S.value_of({"kind": "k", "reply_tokens": 64}, reply) == name
    assert S.value_of({"kind": "k"}, "**Moonlit Haven**") == "Moonlit Haven"


def test_a_name_given_twice_in_a_chat_is_not_asked():
    kind = {"kind": "k", "question": "Who?", "lead": ""}
    fact = S.Question("pet", "Noodle", (), "", "")
    asked = [(kind, "Jack"), (kind, "jack"), (kind, "Noodle"), (kind, ""), (kind, "Elara")]
    assert [q.value for q in S.asked_back(asked, [fact])] == ["Elara"]


def test_splits_share_no_kind_ask_or_question():
    data = json.loads((S.DATA / "said.json").read_text())
    prompts = json.loads((S.DATA / A.DATA_FILE).read_text())
    for split in ("tune", "test", "tune3", "test3"):
        assert len({k["kind"] for k in data[split]}) == len(data[split]) >= S.INVENTIONS
    for tune, test in (("tune", "test"), ("tune3", "test3")):
        for field in ("kind", "ask", "question"):
            assert not {k[field] for k in data[tune]} & {k[field] for k in data[test]}
    # the later asks have kinds of their own (``echoes`` reads a kind's asks in every split)
    later = {k["kind"] for s in ("tune3", "test3") for k in data[s]}
    assert not later & {k["kind"] for s in ("tune", "test", "test2") for k in data[s]}
    stories = [k["kind"] for s in ("tune4", "test4") for k in data[s]]  # round 18: stories
    assert len(set(stories)) == len(stories) and not set(stories) & later
    assert all(k["reply_tokens"] > 16 for s in ("tune4", "test4") for k in data[s])
    for field in ("ask", "question"):
        assert not {k[field] for k in data["tune4"]} & {k[field] for k in data["test4"]}
    if "test" in prompts:
        assert not set(prompts["tune"]) & set(prompts["test"])


class Words:
    """A vocabulary of whole words: ``rementions`` only decodes one token at a time."""

    VOCAB = {1: " warehouse", 2: " x", 3: " for", 4: " 12345", 5: " ab", 6: " self"}

    def decode(self, ids):
        return "".join(self.VOCAB[i] for i in ids)


@pytest.mark.parametrize(("token", "counted"), [
    (1, True), (4, True),  # an identifier, a number
    (3, False), (6, False), (5, False),  # a keyword, self, too short
])
def test_a_remention_is_a_rare_word_first_written_far_back_and_not_recent(token, counted):
    tok, size = Words(), 4  # far back: more than 8 positions; recent: the last 2
    ids = [token] + [2] * 10 + [token]
    assert A.rementions(tok, ids, 0, size) == ([11] if counted else [])
    assert A.rementions(tok, [token] + [2] * 7 + [token], 0, size) == []  # 8 back: not far
    assert A.rementions(tok, [token] * 5 + [2] * 10 + [token], 0, size) == []  # not rare
    assert A.rementions(tok, ids, 12, size) == []  # before the answer's start


def test_rementions_on_a_real_tokenizer():
    from smollm2_fixture import load_embedded

    _, tok = load_embedded()
    filler = tok.encode(" 1 2 3 4 5 6 7 8 9 0" * 3, add_special_tokens=False)
    name = tok.encode(" warehouse_inventory", add_special_tokens=False)
    ids = name + filler + name + name
    at = len(name) + len(filler)
    found = A.rementions(tok, ids, 0, 8)
    assert at in found  # far back (> 16), not in the last 4
    assert at + len(name) not in found  # said again right after: in the last 4
    assert A.rementions(tok, ids, 0, 64) == []  # not more than 128 back


def test_the_rule_keeps_recency_unless_another_beats_it_by_the_margin_within_the_kl_guard():
    names = list(CANDIDATES)
    base = {"model": 0.5, "user": 0.8, "answers": 0.6, "kl": 0.2}
    m = {n: dict(base) for n in names}
    assert choose(m)[0] == names[0]  # ties: recency
    m[names[1]].update(model=0.6)  # +0.033 mean: under the margin
    assert choose(m)[0] == names[0]
    m[names[2]].update(model=0.8)  # +0.1: wins
    assert choose(m)[0] == names[2]
    m[names[2]].update(kl=0.3)  # but its KL is 1.5x recency's: out
    assert choose(m)[0] == names[0]


def test_answers_smoke_on_the_embedded_model(tmp_path, monkeypatch):
    from smollm2_fixture import load_embedded

    from morphkv.cli import main

    pair = load_embedded()
    monkeypatch.setattr(runner, "load_model", lambda name: pair)
    rc = main(["eval", "recall", "--data", "answers", "--texts", "1", "--length", "80",
               "--chunk", "16", "--arms", "kvcache@16,recommended:memory=f16+pin@16,h2o@16",
               "--free", "24", "--out", str(tmp_path)])
    assert rc == 0
    s = json.loads((tmp_path / "answers_tune.json").read_text())["summary"]
    assert s["kvcache@16"]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference reads itself
    assert s["kvcache@16"]["rementions"] == s["h2o@16"]["rementions"]
    assert s["h2o@16"]["kl"] > 0
    assert all(0 <= arm["repetition"] <= 1 for arm in s.values())  # --free: each arm wrote
    assert s["recommended:memory=f16+pin@16"]["mib"] < s["kvcache@16"]["mib"]
    texts = json.loads((tmp_path / "answers_texts_tune_smollm2.json").read_text())["texts"]
    assert len(texts[0]["answer_ids"]) <= 80


def test_a_share_of_each_text_sizes_the_arm_per_text(tmp_path, monkeypatch):
    """``@/K``: the arm holds 1/K of each text's prompt + answer tokens; ``--first`` skips
    prompts (the text written is prompt 1's)."""
    from smollm2_fixture import load_embedded

    from morphkv.cli import main

    pair = load_embedded()
    monkeypatch.setattr(runner, "load_model", lambda name: pair)
    rc = main(["eval", "recall", "--data", "answers", "--first", "1", "--texts", "1",
               "--length", "48", "--chunk", "16", "--arms",
               "recommended:memory=f16+pin@/4,recommended:memory=f16+pin@/2", "--out",
               str(tmp_path)])
    assert rc == 0
    text = json.loads((tmp_path / "answers_texts_tune_smollm2.json").read_text())["texts"]
    assert [t["index"] for t in text] == [1]
    n = len(text[0]["prompt_ids"]) + len(text[0]["answer_ids"])
    rec = json.loads((tmp_path / "answers_tune.json").read_text())["texts"][0]["arms"]
    assert rec["recommended:memory=f16+pin@/4"]["size"] == n // 4
    assert rec["recommended:memory=f16+pin@/2"]["size"] == n // 2
    assert rec["recommended:memory=f16+pin@/4"]["nbytes"] < rec[
        "recommended:memory=f16+pin@/2"]["nbytes"]


@pytest.mark.parametrize("bad", ["kvcache@/0", "kvcache@/x", "kvcache@0"])
def test_a_bad_share_is_refused_by_name(bad):
    from morphkv.eval.arms import cells

    with pytest.raises(ValueError, match="size after '@'"):
        cells(bad, 128, shares=True)
    with pytest.raises(ValueError, match="size after '@'"):
        cells("kvcache@/4", 128)  # only where a command sizes per text


def test_said_smoke_on_the_embedded_model(tmp_path, monkeypatch):
    from smollm2_fixture import load_embedded

    from morphkv.cli import main

    pair = load_embedded()
    monkeypatch.setattr(runner, "load_model", lambda name: pair)
    rc = main(["eval", "recall", "--data", "said", "--chats", "1", "--budget", "16",
               "--min-distance", "1", "--max-tokens", "4", "--arms",
               "kvcache,nofact,recommended:memory=f16+pin", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    result = json.loads((tmp_path / "said_tune_16.json").read_text())
    chat = result["chats"][0]
    kinds = [q["kind"] for q in chat["questions"]]
    assert sum(k.startswith(S.MODEL) for k in kinds) >= 1 and len(kinds) >= 4
    said = result["summary"]["_said"]
    who = [S.said_by(q["kind"], q["value"]) for q in chat["questions"]]  # echo: counted apart
    assert said["kvcache"]["asked"] == {w: who.count(w) for w in S.WHO}
    assert said["kvcache"]["asked"]["user"] == 3
    assert "model-said" in result["table"]
