"""``morphkv chat``'s conversation and sessions with the embedded model (real mlx_lm
generation): a turn prefills only its new tokens, the fed tokens are the template of the whole
conversation, a saved session resumes to the same greedy reply, and bad sessions are refused
in one line without touching the running conversation. Plus piped input and the fast checks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from morphkv.chat import session
from morphkv.cli import main

REPO = Path(__file__).resolve().parents[1]
MESSAGES = ["What is the capital of France?", "And of Italy?", "Name a river in Italy."]


@pytest.fixture(scope="module")
def embedded():
    from smollm2_fixture import load_embedded

    return load_embedded()


def _conversation(embedded, budget=32, pin_user=True, **overrides):
    from morphkv.chat.conversation import Conversation
    from morphkv.core.presets import PRESETS

    model, tokenizer = embedded
    config = PRESETS["recommended"](budget, **overrides)
    return Conversation(model, tokenizer, config, pin_user=pin_user)


def _say(conv, text, max_tokens=12):
    from mlx_lm.sample_utils import make_sampler

    return "".join(conv.turn(text, max_tokens=max_tokens, sampler=make_sampler(0.0)))


@pytest.mark.slow
def test_each_turn_prefills_only_its_new_tokens(embedded):
    conv = _conversation(embedded)
    _, tokenizer = embedded
    fed = []
    for i, text in enumerate(MESSAGES, start=1):
        before = conv.seen()
        _say(conv, text, max_tokens=[12, 40, 6][i - 1])
        turn = conv.last
        # the turn fed its new tokens and its reply, nothing of the history again
        assert conv.seen() == before + len(turn.prompt) + len(turn.tokens) == conv.fed
        assert turn.last.prompt_tokens == len(turn.prompt)
        if i > 1:  # the user's message and the template around it, no more
            assert len(turn.prompt) < len(tokenizer.encode(text)) + 12, turn.prompt
        # the preset pins prompts itself (pin="prompt"): the turn's prompt, less the template
        # runs an earlier prompt held (pin_repeats); the conversation pins nothing more
        held = {p for a, b in conv.caches[0].pins.ranges() for p in range(a, b)}
        mine = held & set(range(before, before + len(turn.prompt)))
        assert before + len(turn.prompt) - 1 in mine and not conv.pinned
        assert len(mine) == len(turn.prompt) if i == 1 else 0 < len(mine) < len(turn.prompt)
        fed += turn.prompt + turn.tokens
    assert {t.finish for t in [conv.last]} <= {"stop", "length"}
    # what the cache has seen is the template of the whole conversation, token for token
    whole = tokenizer.apply_chat_template(conv.messages, tokenize=False)
    assert whole.startswith(tokenizer.decode(fed))
    assert whole[len(tokenizer.decode(fed)):] == conv.pending
    assert max(c.tokens_kept for c in conv.caches) <= 32 < conv.seen()


@pytest.mark.slow
def test_a_resumed_session_gives_the_same_next_reply(embedded, tmp_path):
    model, _ = embedded
    fp = session.model_fingerprint(model)
    talk = _conversation(embedded)
    for text in MESSAGES[:2]:
        _say(talk, text)
    path = tmp_path / "s.safetensors"
    session.save(path, talk, "embedded", fp)
    straight = _say(talk, MESSAGES[2])

    resumed = _conversation(embedded)
    _say(resumed, "Something else entirely.")  # a conversation that the load replaces
    loaded = session.load(path, model, "embedded", fp, resumed.config)
    assert (loaded.turns, loaded.fed) == (2, talk.fed - len(talk.last.prompt)
                                          - len(talk.last.tokens))
    resumed.resume(loaded)
    assert _say(resumed, MESSAGES[2]) == straight
    assert resumed.turns == 3 and resumed.fed == talk.fed
    assert loaded.pins == talk.pinned[:2] == []  # the caches pinned the prompts themselves
    assert loaded.caches[0].pins.ranges() and loaded.caches[0].pins.heard.size


@pytest.mark.slow
def test_pinned_user_turns_outlast_the_replies(embedded):
    """Three turns through a 48-token cache evicting by age: with the turns pinned (the
    default) more of the user's tokens are still held at the end than with
    ``pin_user=False``. (The preset's attention-ranked rule keeps many user tokens unpinned
    too: the pins are the mechanism tested here.)"""
    import numpy as np

    held = {}
    for pin_user in (True, False):
        conv = _conversation(embedded, budget=48, pin_user=pin_user, method="streaming_llm",
                             pin_repeats=0)  # whole prompts, template too (as counted here)
        ranges = []
        for text in MESSAGES:
            start = conv.fed
            _say(conv, text, max_tokens=24)
            ranges.append(range(start, start + len(conv.last.prompt)))
        user = np.concatenate([np.arange(r.start, r.stop) for r in ranges])
        kept = conv.caches[0].kept_positions[0]
        held[pin_user] = np.isin(kept, user).sum()
    assert held[True] > held[False], held


@pytest.mark.slow
def test_bad_sessions_are_one_line_and_change_nothing(embedded, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model, _ = embedded
    fp = session.model_fingerprint(model)
    conv = _conversation(embedded)
    _say(conv, MESSAGES[0], max_tokens=4)
    good = tmp_path / "good.safetensors"
    session.save(good, conv, "embedded", fp)
    caches, meta = load_prompt_cache(str(good), return_metadata=True)

    def variant(name, **change):
        path = tmp_path / f"{name}.safetensors"
        save_prompt_cache(str(path), change.pop("caches", caches), {**meta, **change})
        return path

    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(good.read_bytes()[:-1000])
    plain = tmp_path / "plain.safetensors"
    save_prompt_cache(str(plain), caches)
    other = dataclasses.replace(conv.config, morphkv_budget=48)
    cases = {
        truncated: "not a complete, valid session",
        plain: "not a morphkv chat session",
        variant("foreign", fingerprint="0" * 16): "belongs to another model",
        variant("turns", turns="5"): "transcript does not match",
        variant("fed", fed="3"): "saw",
        variant("config", config=other.to_json()): "another setting",
        variant("layers", caches=caches[:-1]): "do not fit this model",
        variant("json", messages="[{"): "bad session metadata",
        variant("pins", pins="[[0, 99999]]"): "pinned ranges",
        variant("pins_kind", pins='"all"'): "pinned ranges",
        tmp_path / "missing.safetensors": "no such file",
    }
    for path, words in cases.items():
        with pytest.raises(session.SessionError) as e:
            session.load(path, model, "embedded", fp, None)
        assert words in str(e.value) and "\n" not in str(e.value), (path, str(e.value))
    with pytest.raises(session.SessionError, match="cache setting"):
        session.load(good, model, "embedded", fp, other)
    assert session.load(good, model, "embedded", fp, conv.config).turns == 1


def test_an_interrupted_save_leaves_the_old_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from morphkv.core.config import KVCacheConfig

    path = tmp_path / "s.safetensors"
    path.write_bytes(b"old session")
    conv = SimpleNamespace(config=KVCacheConfig(), turns=0, fed=0, messages=[], pending="",
                           system_prompt=None, caches=[object()])  # not serialisable: fails
    with pytest.raises(Exception):  # noqa: B017 (whatever mlx_lm raises mid-write)
        session.save(path, conv, "m", "f")
    assert path.read_bytes() == b"old session"
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary left


def test_session_file_names():
    assert session.session_path("a/b").name == "b.safetensors"
    assert session.session_path("b.safetensors").name == "b.safetensors"


def test_load_of_a_missing_file_is_one_line_before_the_model_loads(capsys, tmp_path):
    assert main(["chat", "--load", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file" in err, err


@pytest.mark.parametrize("flags", [["--max-tokens", "0"], ["--temp", "-1"], ["--budget", "1"],
                                   ["--top-p", "0"]])
def test_bad_flags_are_one_line(capsys, flags):
    with pytest.raises(SystemExit) as e:
        main(["chat", *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


@pytest.mark.slow
def test_piped_input_one_line_per_turn(tmp_path):
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]))
    env.pop("MORPHKV_BLAS_REEXEC", None)
    lines = [MESSAGES[0], "", "/stats", "h", MESSAGES[1], f"/save {tmp_path / 'p'}",
             "/nope", "//etc is a folder?", "r", MESSAGES[2]]
    out = subprocess.run(
        [sys.executable, "-m", "morphkv", "chat", "--budget", "32", "--max-tokens", "8"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, env=env, cwd=REPO,
        timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    status = [s for s in out.stderr.splitlines() if s.startswith("[turn")]
    assert [s.split("]")[0] for s in status] == ["[turn 1", "[turn 2", "[turn 3", "[turn 1"]
    assert "saved turn 2 to" in out.stderr and "unknown command /nope" in out.stderr
    assert "[turn" not in out.stdout and "/help" in out.stdout  # replies and command output
    assert "KV cache:" in out.stdout  # /stats
    assert "Traceback" not in out.stderr
    assert json.loads(session_meta(tmp_path / "p.safetensors")["turns"]) == 2


def session_meta(path):
    from mlx_lm.models.cache import load_prompt_cache

    return load_prompt_cache(str(path), return_metadata=True)[1]


@pytest.mark.slow
def test_bench_chat_quick(tmp_path, capsys):
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()
    assert main(["bench", "serve", "--scenario", "chat", "--quick", "--turns", "4",
                 "--timing-repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "chat_quick.json").read_text())
    morph, full = result["summary"]["morphkv"], result["summary"]["kvcache"]
    assert morph["budget_reached_turn"] is not None
    low, high = morph["cache_bytes_after_budget"]
    assert low <= high <= 1.3 * low  # bounded once the budget is reached (blocks of 16 vary it)
    assert full["cache_bytes_first_last"][1] > morph["cache_bytes_first_last"][1]
    assert [r["kept"] for r in result["rows"] if r["arm"] == "kvcache"] == [
        r["seen"] for r in result["rows"] if r["arm"] == "kvcache"]  # keeps everything
    assert result["resume"]["same_next_reply"] is True
    assert (tmp_path / "chat_quick.png").is_file()


@pytest.mark.slow
def test_a_plain_transcript_reply_ends_at_the_stop_text(embedded):
    """A model without a chat template gets PLAIN_TEMPLATE; its reply ends where the model starts
    the next "User:" turn. Here the stop text is a piece of the model's own greedy reply, so
    the cut is certain: the stream holds back a partial match and never shows the stop text,
    the turn ends as "stop", the caches saw every generated token, and the next turn goes on."""
    from morphkv.chat.conversation import PLAIN_STOP, Conversation
    from morphkv.core.presets import PRESETS
    from morphkv.model.tokenizer import PLAIN_TEMPLATE

    model, tokenizer = embedded
    saved = tokenizer.chat_template
    tokenizer.chat_template = PLAIN_TEMPLATE
    try:
        def fresh():
            return Conversation(model, tokenizer, PRESETS["recommended"](32))

        assert fresh().stop_text == PLAIN_STOP
        free = fresh()
        free.stop_text = None
        whole = _say(free, MESSAGES[0], max_tokens=24)
        cut = len(whole) // 2
        stop = whole[cut : cut + 6]
        assert len(stop) == 6 and stop not in whole[:cut]
        conv = fresh()
        conv.stop_text = stop
        streamed = _say(conv, MESSAGES[0], max_tokens=24)
        assert streamed == whole[:cut] and conv.last.finish == "stop"
        assert conv.last.text.lstrip() == streamed.lstrip()
        assert conv.seen() == conv.fed and conv.ahead.startswith(stop)
        _say(conv, MESSAGES[1], max_tokens=6)
        assert conv.seen() == conv.fed and conv.turns == 2
    finally:
        tokenizer.chat_template = saved
