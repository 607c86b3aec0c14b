"""Fair batching (``morphkv.server.fair``): a long prompt does not hold short requests hostage.

In process: the scheduler gives every prompt exactly the tokens it gets alone, and a short
prompt arriving during a long prefill gets its first token before that prefill ends (counted
in scheduler steps, not seconds). On a real server (loopback, stopped by pid): a short chat's
first token arrives before a long prompt's, sent first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from smollm2_fixture import embedded_gguf_path, load_embedded

from morphkv.eval.process import stop_process
from morphkv.server.fair import FairBatchGenerator, group_lengths

ROOT = Path(__file__).resolve().parents[1]


def test_groups_keep_similar_lengths_together():
    assert group_lengths([30, 2000, 40, 35, 900, 61]) == [[0, 3, 2], [5], [4], [1]]
    assert group_lengths([10, 20, 21]) == [[0, 1], [2]]
    assert group_lengths([]) == []


def _model(budget=32):
    from morphkv.mlxlm.builder import patch_model
    from morphkv.runtime.cache_flags import add_cache_flags, config_from_flags

    model, tokenizer = load_embedded()
    p = argparse.ArgumentParser()
    add_cache_flags(p, budget=budget)
    patch_model(model, config_from_flags(p.parse_args(["--budget", str(budget)])))
    return model, tokenizer


def _prompts(tokenizer, lengths):
    from morphkv.bench.load_clients import long_text

    ids = tokenizer.encode(long_text(max(lengths)))
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def _generate(generator_class, model, prompts, max_tokens=5, step=64):
    g = generator_class(model, prefill_step_size=step, max_tokens=max_tokens)
    uids = g.insert(prompts)
    out = {u: [] for u in uids}
    for _ in range(1000):
        for r in g.next_generated():
            out[r.uid].append(r.token)
        if all(len(v) == max_tokens for v in out.values()):
            break
    return [out[u] for u in uids]


@pytest.mark.slow
def test_every_prompt_gets_the_tokens_it_gets_alone():
    from mlx_lm.generate import BatchGenerator

    embedded_gguf_path()
    model, tokenizer = _model()
    prompts = _prompts(tokenizer, [20, 300, 45, 150])
    alone = [_generate(BatchGenerator, model, [p])[0] for p in prompts]
    assert _generate(FairBatchGenerator, model, prompts) == alone


@pytest.mark.slow
def test_a_short_prompt_arriving_mid_prefill_goes_first():
    embedded_gguf_path()
    model, tokenizer = _model()
    long, *shorts = _prompts(tokenizer, [400, 12, 14])
    g = FairBatchGenerator(model, prefill_step_size=64, max_tokens=2)
    (long_uid,) = g.insert([long])
    g.next()  # the long prompt's first piece
    g.insert(shorts)
    first: dict[int, int] = {}
    prefilled_at = None
    for step in range(200):
        prompt_responses, responses = g.next()
        for r in prompt_responses:
            if r.uid == long_uid and r.end_of_prompt:
                prefilled_at = step
        for r in responses:
            first.setdefault(r.uid, step)
        if long_uid in first:
            break
    assert prefilled_at is not None and len(first) == 3
    assert max(first[u] for u in first if u != long_uid) < prefilled_at


def _stream_first_token(url, content, max_tokens, out, key):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    t0 = time.monotonic()
    for chunk in client.chat.completions.create(
            model="default_model", max_tokens=max_tokens, stream=True,
            messages=[{"role": "user", "content": content}]):
        if chunk.choices and chunk.choices[0].delta.content and key not in out:
            out[key] = time.monotonic() - t0 + (out.get(f"{key}_sent", 0.0))


@pytest.mark.slow
def test_on_the_server_a_short_chat_is_answered_during_a_long_prefill():
    pytest.importorskip("openai")
    from morphkv.bench.load_clients import long_text
    from morphkv.eval.process import free_port as _free_port

    embedded_gguf_path()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "morphkv", "serve", "--port", str(port), "--budget", "32",
         "--prefill-step-size", "64", "--log-level", "WARNING"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        from test_serve import _healthy

        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
        times: dict = {"short_sent": 1.0}  # both measured from the moment the long one is sent
        long = threading.Thread(target=_stream_first_token, args=(
            url, "Summarize: " + long_text(1500), 2, times, "long"))
        long.start()
        time.sleep(1.0)
        _stream_first_token(url, "Name a color.", 2, times, "short")
        long.join(timeout=300)
        assert "long" in times and "short" in times
        assert times["short"] < times["long"], times
    finally:
        stop_process(proc, 20)


def test_the_mixed_level_has_one_8k_prompt_2k_prompts_drops_and_malformed_requests():
    from morphkv.bench.load import by_class, kind_of

    kinds = [kind_of(k) for k in range(500)]
    assert kinds.count("long8k") == 1 and kinds.count("long2k") == 20
    assert kinds.count("bad") > 50 and kinds.count("drop") > 50 and kinds.count("stream") > 50
    assert "long8k" not in [kind_of(k, with_8k=False) for k in range(500)]
    rows = [{"kind": "chat", "ok": True, "start": 0.0, "end": 2.0, "ttft_s": None},
            {"kind": "long2k", "ok": True, "start": 0.0, "end": 9.0, "ttft_s": 3.0},
            {"kind": "long2k", "ok": False, "start": 0.0, "end": 1.0}]
    classes = by_class(rows)
    assert classes["short"]["p50_s"] == 2.0 and classes["long2k"]["failed"] == 1
    assert classes["long2k"]["ttft_p50_s"] == 3.0 and classes["long8k"]["requests"] == 0
