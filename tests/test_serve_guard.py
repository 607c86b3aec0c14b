"""The request checks and the bounded prompt cache of ``morphkv serve``, without a server (fast)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from morphkv.server.guard import Limits, Refusal, check_body, check_length, parse_body
from morphkv.server.run import bounded_prompt_cache

LIMITS = Limits(names=frozenset({"default_model", "smol"}), shown_name="smol",
                max_body_bytes=1000, max_request_tokens=64, vocab_size=100)
CHAT = "/v1/chat/completions"


def refusal(path, body) -> Refusal:
    with pytest.raises(Refusal) as e:
        check_body(path, body, LIMITS)
    return e.value


def test_good_requests_pass_with_the_model_name_normalized():
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "stream": True, "stream_options": {}}
    checked = check_body(CHAT, body, LIMITS)
    assert checked["model"] == "default_model"
    assert checked["stream_options"] == {"include_usage": False}  # mlx_lm reads the key
    parts = [{"type": "text", "text": "Hi"}]
    assert check_body(CHAT, {"messages": [{"role": "user", "content": parts}]}, LIMITS)
    assert check_body("/v1/completions", {"prompt": "Once", "stop": ["\n"]}, LIMITS)


@pytest.mark.parametrize("body, status, words", [
    ({"messages": []}, 400, "messages is empty"),
    ({"messages": {"role": "user"}}, 400, "messages must be a list"),
    ({"messages": [{"content": "Hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text only"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": True}, 400, "integer"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 65}, 400, "limit of 64"),
    ({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens must be at least 1"),
    ({"messages": [{"role": "user", "content": "Hi"}], "model": 3}, 400, "model must be"),
    ({"messages": [{"role": "user", "content": "Hi"}], "model": "x"}, 404, "'smol'"),
    ({"messages": [{"role": "user", "content": "Hi"}], "stop": ""}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_k": 101}, 400, "vocabulary"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"a": 1}}, 400, "token id"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"3": "x"}}, 400,
     "must be a number"),
    ({"messages": [{"role": "user", "content": "Hi"}], "seed": -1}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "Hi"}], "n": 2}, 400, "n must be 1"),
    ({"messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": 1}},
     400, "include_usage"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": {}}, 400, "tools must be"),
    ({"messages": [{"role": "user", "content": "Hi"}], "adapters": "a"}, 400, "adapters"),
])
def test_malformed_chat_requests_are_refused_naming_the_problem(body, status, words):
    r = refusal(CHAT, body)
    assert r.status == status and words in r.message


def test_body_and_length_checks():
    assert check_length("10", LIMITS) == 10
    for header, status in [(None, 411), ("ten", 400), ("-1", 400), ("1001", 413)]:
        with pytest.raises(Refusal) as e:
            check_length(header, LIMITS)
        assert e.value.status == status
    for raw, words in [(b"\xff", "UTF-8"), (b"  ", "empty"), (b"{", "invalid JSON"),
                       (b"3", "JSON object")]:
        with pytest.raises(Refusal, match=words):
            parse_body(raw)
    assert refusal("/v1/completions", {"prompt": ""}).message == "prompt is empty"
    assert "prompt must be a string" in refusal("/v1/completions", {"prompt": [1, 2]}).message


def _cache(tokens: int) -> list:
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
    return [c]


def test_the_prompt_cache_never_holds_more_than_its_byte_limit():
    one = _cache(4)[0].nbytes
    cache = bounded_prompt_cache(10, 3 * one)
    seen = []
    for i in range(6):
        cache.insert_cache("m", list(range(i * 10, i * 10 + 4)), _cache(4))
        seen.append(cache.nbytes)
    assert max(seen) <= 3 * one and len(cache) == 3
    cache.insert_cache("m", list(range(100, 120)), _cache(20))  # larger than the whole limit
    assert cache.nbytes <= 3 * one
    assert bounded_prompt_cache(10, None).max_bytes >= 2**62  # mlx_lm's default: no byte limit


def test_the_worst_case_adds_requests_prefill_chunks_and_the_prompt_cache():
    from argparse import Namespace

    from morphkv.server.memory import worst_case

    args = Namespace(max_requests=2, prompt_concurrency=4, prefill_step_size=10,
                     prompt_cache_size=3, prompt_cache_bytes=None)
    total, text = worst_case(args, bound=100, per_token=2)
    assert total == 2 * 100 + 2 * 10 * 2 + 3 * 100  # prefilling rows: at most the requests
    assert "2 requests (--max-requests)" in text and "--prompt-cache-bytes none" in text
    args.prompt_cache_bytes = 150
    assert worst_case(args, 100, 2)[0] == 200 + 40 + 150
    assert worst_case(args, None, None)[0] is None  # mlx_lm's cache, method=full: unbounded
