"""The conversation-memory evaluation: its data (splits disjoint), the chats (facts placed,
updated, asked; the no-fact chat lacks every value), the strict judge, the value's own tokens,
and a smoke run on the embedded model."""

from __future__ import annotations

import json

import pytest

from morphkv.eval import chat_items as C


def test_tune_and_test_share_no_value_question_or_template():
    for field in ("values", "statements", "update", "question"):
        tune = {json.dumps(k[field]) for k in C.facts("tune")}
        test = {json.dumps(k[field]) for k in C.facts("test")}
        assert not tune & test, field
    values = [{v.lower() for k in C.facts(s) for v in k["values"]} for s in ("tune", "test")]
    assert not values[0] & values[1]
    qs = [{q for q, _ in C.answers(s)} for s in ("tune", "test")]
    assert qs[0] and qs[1] and not qs[0] & qs[1]


def test_a_chat_states_three_facts_updates_one_and_the_nofact_chat_says_none():
    chat = C.build_chat("test", 3)
    text = " ".join(m["content"] for m in chat.messages)
    bare = " ".join(m["content"] for m in chat.nofact)
    assert [q.updated for q in chat.questions] == [True, False, False]
    assert len({q.kind for q in chat.questions}) == 3
    for q in chat.questions:
        assert q.value in text and q.value not in bare
        assert q.value not in q.text  # the question does not give the answer away
    old = [w for w in chat.questions[0].wrong if w in text]
    assert len(old) == 1 and text.index(old[0]) < text.rindex(chat.questions[0].value)
    assert C.build_chat("test", 3).messages == chat.messages  # deterministic
    assert C.build_chat("test", 4).messages != chat.messages


@pytest.mark.parametrize(("answer", "ok"), [
    ("Graz", True), ("You are based in Graz.", True), ("graz", True),
    ("You moved from Hobart to Graz", False),  # names the old value too
    ("Grazing", False), ("I don't know", False), ("Hobart", False),
])
def test_the_judge_requires_the_current_value_and_nothing_else_of_its_kind(answer, ok):
    q = C.Question("city", "Graz", ("Hobart", "Tbilisi"), "where?")
    assert C.judge(answer, q) is ok


def test_value_tokens_are_the_values_own_and_chats_reach_the_distance():
    from smollm2_fixture import load_embedded

    _, tok = load_embedded()
    chat = C.build_chat("tune", 0)
    ids = C.tokenize(tok, chat, 3 * 64)
    for q in chat.questions:
        assert q.positions and q.distance >= 3 * 64
        assert tok.decode([ids[p] for p in q.positions]).strip() == q.value
    assert "Philippa" not in C.words(tok.decode(ids[:5]))


@pytest.mark.slow
def test_smoke_run_on_the_embedded_model(tmp_path, monkeypatch):
    from smollm2_fixture import load_embedded

    from morphkv.cli import main
    from morphkv.eval import runner

    pair = load_embedded()  # the module's one load of the model
    monkeypatch.setattr(runner, "load_model", lambda name: pair)

    rc = main(["eval", "recall", "--split", "tune", "--chats", "1", "--budget", "32",
               "--min-distance", "3", "--max-tokens", "3", "--arms",
               "kvcache,nofact,streaming_llm,recommended:memory=f16,recommended:memory=f16+pin",
               "--out", str(tmp_path),
               "--quiet"])  # fmt: skip
    assert rc == 0
    result = json.loads((tmp_path / "chatrecall_tune_32.json").read_text())
    s = result["summary"]
    assert s["_items"]["questions"] == 3
    assert s["streaming_llm"]["retention"] == 0.0  # 3 budgets back: recency has lost it
    assert s["kvcache"]["retention"] == 1.0
    assert s["recommended:memory=f16"]["tokens"] > 32  # 8-bit: more tokens in f16 bytes
    # the facts are said in user turns: pinned, more of the values' tokens are still held
    assert s["recommended:memory=f16+pin"]["retention"] > s["recommended:memory=f16"]["retention"]
    assert (tmp_path / "chatrecall_tune_32.png").is_file()


def test_the_memory_preset_is_the_chosen_arm_and_can_be_overridden():
    """recommended(memory=...) is exactly the arm the rule chose on tune
    (``peak:memory=f16:bits=8:decay=0.95:block=16``, round 12; pinned where a chat knows its
    turns), pinning every prompt itself (``pin=prompt``: the arms pin only what they say), its
    overflowing pins ranked by one KeyDiff vote over the layers (``pin_rank``, round 8), short
    replies pinned (``pin_replies``, chosen on the round-2 tune chats), a template sent again
    not pinned (``pin_repeats``, round 14)."""
    import dataclasses

    from morphkv import recommended
    from morphkv.eval.arms import Arm

    chosen = Arm.parse("peak:memory=f16:bits=8:decay=0.95:block=16:pin=prompt:pin_rank=vote:"
                       "pin_replies=16:pin_repeats=4").config(128, n_sink=4)
    assert Arm.parse("peak:memory=f16:bits=8").config(128, n_sink=4).pin == "none"
    preset = recommended(memory=chosen.kv_memory)
    assert dataclasses.replace(preset, engine=chosen.engine, scoring=chosen.scoring) == chosen
    assert dataclasses.replace(recommended(128), kv_bits=8, morphkv_budget=0,
                               kv_memory=chosen.kv_memory) == preset  # one rule (issue 42)
    assert recommended(memory=3_000_000, method="morphkv").method == "morphkv"


def test_arm_sizes_parse_and_bad_ones_are_named():
    from morphkv.eval.arms import cells

    arms = cells("kvcache,nofact,h2o@64,recommended:memory=f16@256", 128, nofact=True)
    assert [c.label for c in arms] == ["kvcache", "nofact", "h2o@64",
                                       "recommended:memory=f16@256"]
    assert arms[1].arm is None and arms[3].arm.method == "recommended"
    assert [c.size for c in arms] == [128, 128, 64, 256]
    for bad in ("h2o@", "h2o@x", "h2o@0"):
        with pytest.raises(ValueError, match="positive token count"):
            cells(bad, 128, nofact=True)
    (c,) = cells("recommended:memory=f16+pin48@64", 128, nofact=True)
    assert c.pins and c.replies == 48 and c.arm.method == "recommended" and c.size == 64
    assert not cells("h2o@64", 128)[0].pins
    with pytest.raises(ValueError, match="nothing to pin"):
        cells("nofact+pin", 128, nofact=True)


def _chat(index, full, arm, distances, size):
    qs = [{"kind": "k", "value": "v", "updated": i == 0, "distance": d, "value_tokens": 1}
          for i, d in enumerate(distances)]
    run = {"nbytes": 1, "tokens": size, "size": size, "retention": [], "answers": ["x"] * 3}
    return {"index": index, "questions": qs,
            "arms": {"kvcache": {**run, "correct": full, "tokens": None},
                     "h2o@64": {**run, "correct": arm}}}


def test_summary_splits_the_full_caches_items_into_kept_and_updated_facts():
    from morphkv.eval.chat_recall import summarize, table

    chats = [_chat(0, [True, True, False], [True, False, True], [100, 150, 400], 64),
             _chat(1, [False, True, True], [False, True, False], [130, 200, 450], 64)]
    s = summarize(chats, ["kvcache", "h2o@64"])["h2o@64"]
    assert (s["all"]["k"], s["all"]["n"]) == (3, 6)
    assert (s["of_full"]["k"], s["of_full"]["n"]) == (2, 4)  # the 3rd of chat 0 is not counted
    assert (s["of_full_updated"]["k"], s["of_full_updated"]["n"]) == (1, 1)
    assert (s["of_full_kept"]["k"], s["of_full_kept"]["n"]) == (1, 3)
    assert s["size"] == 64
    assert "`kvcache`" in table({"kvcache": summarize(chats, ["kvcache"])["kvcache"]})


@pytest.mark.parametrize(("answer", "value", "ok"), [
    ("Ansel.", "Anselm", True), ("852.", "8521", True), ("Marmot.", "Marmalade", True),
    ("John.", "Anselm", False), ("", "Anselm", False), ("Tor", "To", False),
])
def test_a_fragment_is_the_values_start_without_its_end(answer, value, ok):
    from morphkv.eval.chat_recall import fragment

    assert fragment(answer, value) is ok


@pytest.mark.slow
def test_live_serve_runs_chats_through_the_real_server_and_stops_it(tmp_path):
    """``--live serve``: the real ``morphkv serve`` on 127.0.0.1 and the ``openai`` client,
    each turn answered live; the server is stopped by its process id afterwards."""
    import os

    from morphkv.cli.commands import build_parser
    from morphkv.eval import live, runner
    from tests.smollm2_fixture import embedded_gguf_path

    pytest.importorskip("openai")
    embedded_gguf_path()
    started = []
    real = live.start_server

    def spy(*a, **kw):
        started.append(real(*a, **kw))
        return started[-1]

    live.start_server = spy
    try:
        args = build_parser().parse_args(
            ["eval", "recall", "--live", "serve", "--chats", "1", "--turns", "2",
             "--reply-tokens", "3", "--answer-tokens", "3", "--live-arms",
             "memory=--kv-memory 1M", "--out", str(tmp_path)])
        vars(args).pop("_run")  # as morphkv's main does: the Namespace stays JSON-able
        result = runner.run(live.Live(args))
    finally:
        live.start_server = real
    ((arm, (row,)),) = [(a["arm"], a["rows"]) for a in result["arms"]]
    assert arm == "memory" and result["summary"]["memory"]["items"] == 3
    assert (tmp_path / "chatrecall_live_serve_test.json").exists()  # written after each arm
    assert row["chat"] == 0
    assert [c.index for c in live.held_out_chats(args.split, 2, 1, args.seed)] == [2]  # --first
    assert len(row["first_token_s"]) == 2 and len(row["rss_mb"]) == 2 and all(row["rss_mb"])
    assert len(row["answers"]) == len(row["right"]) == 3
    proc, url, cmd = started[0]
    assert url.startswith("http://127.0.0.1:") and "--kv-memory" in cmd
    assert proc.poll() is not None  # stopped
    with pytest.raises(OSError):
        os.kill(proc.pid, 0)


def test_long_live_chats_add_questions_of_their_split_never_a_fact_clause():
    """``--turns`` past a chat's own user turns: more questions of the same split, the same
    ones with and without the facts, a fixed order per chat; too many turns is an error."""
    from morphkv.eval import live

    chat = live.held_out_chats("test", 24, 1, 0)[0]
    own = sum(m["role"] == "user" for m in chat.messages)
    turns, bare = live.user_turns(chat, own + 10, False), live.user_turns(chat, own + 10, True)
    assert len(turns) == own + 10 and turns[own:] == bare[own:]
    assert len(set(turns[own:])) == 10 and set(turns[own:]) <= set(live.questions("test"))
    assert not set(turns[own:]) & {m["content"] for m in chat.nofact if m["role"] == "user"}
    assert live.user_turns(chat, own + 10, False) == turns  # the same order every run
    assert live.user_turns(live.held_out_chats("test", 25, 1, 0)[0], own + 10, True) != bare
    with pytest.raises(SystemExit, match="--turns 500"):
        live.user_turns(chat, 500, False)


@pytest.mark.parametrize("kind, value, who", [
    ("city", "Graz", "user"),
    ("model:bakery", "Sourdough Bakery", "echo"),  # its ask: "a tiny bakery that sells sourdough"
    ("model:island", "the Hidden Volcanic Island", "echo"),
    ("model:horse", "Greta", "model"),
    ("model:wifi", "Wi-Fi Dream", "model"),  # "wi", "fi": shorter than 3 letters
    ("model:wifi", "Home Sweet Wi-Fi", "echo"),  # "our home Wi-Fi network"
])
def test_a_name_that_repeats_its_ask_is_counted_apart(kind, value, who):
    """A model-said item whose invented name repeats a word of its ask or question is ``echo``
    (the question alone finds it), apart from the names the model made up."""
    from morphkv.eval.chat_items import said_by

    assert said_by(kind, value) == who


@pytest.mark.slow
def test_live_said_asks_back_what_each_arm_itself_invented(tmp_path):
    """``--data said --live mlx_lm``: mlx_lm's chat loop on the embedded model; an invention
    ask follows user turns 1 and 2, the arm's own reply is the value asked back with the
    user's facts; a ``:nofact`` arm (no facts, no asks) is asked the first arm's names; the
    table gives each arm's share of the first arm's items by who said them."""
    from morphkv.cli.commands import build_parser
    from morphkv.eval import live, runner
    from morphkv.eval.chat_items import name_of, said_by
    from tests.smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()
    argv = ["eval", "recall", "--data", "said", "--live", "mlx_lm", "--split", "test",
            "--chats", "1", "--turns", "2", "--reply-tokens", "4", "--answer-tokens", "4",
            "--out", str(tmp_path), "--live-arms"]
    args = build_parser().parse_args(argv + ["own=mlx_lm;memory=--budget 48;own:nofact=mlx_lm"])
    vars(args).pop("_run")
    result = runner.run(live.Live(args))
    (own,), (memory,), (bare,) = [a["rows"] for a in result["arms"]]
    assert own["who"][:3] == memory["who"][:3] == bare["who"][:3] == ["user"] * 3
    assert set(own["who"][3:]) <= {"model", "echo"} and bare["who"] == own["who"]
    assert own["who"][3:] == [said_by("model:" + k, v) for k, v in own["invented"].items()]
    assert len(own["first_token_s"]) == 4 and len(bare["first_token_s"]) == 2  # 2 asks
    assert own["values"][3:] == [own["invented"][k] for k in own["invented"]]
    assert all(v == name_of(v) for v in own["values"][3:])  # a name, as name_of cuts it
    assert bare["values"] == own["values"] and bare["invented"] == {}
    assert memory["values"][:3] == own["values"][:3]
    firsts = result["summary"]["own"]["of_first"]
    assert set(firsts) == {"model", "echo", "user"}
    assert all(firsts[w]["right"] == firsts[w]["of"] for w in firsts)
    assert (tmp_path / "said_live_mlx_lm_test.json").exists()
    bad = build_parser().parse_args(argv + ["own:nofact=mlx_lm;own=mlx_lm"])
    with pytest.raises(ValueError, match="the first arm has no facts"):
        live.Live(bad).arms()
