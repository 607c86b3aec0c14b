"""A memory size (kv_memory): resolved from the model's real shape into the most tokens per KV
head that fit, and the caches never hold more bytes than asked, however far they are filled."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from smollm2_fixture import load_embedded

import morphkv
from morphkv import KVCacheBuilder, KVCacheConfig, recommended
from morphkv.core.memory import at_budget, bound_bytes, parse_size
from morphkv.core.presets import MEMORY_METHOD
from morphkv.eval.models import tiny_llama
from morphkv.mlxlm.layout import morph_caches
from morphkv.mlxlm.memory import layer_shapes

MiB = 2**20


def held(caches) -> int:
    return sum(c.nbytes for c in morph_caches(caches))


def fill(model, caches, tokens: int, step: int = 37) -> None:
    """Feed ``tokens`` tokens in chunks of ``step``, then decode a few: past any budget."""
    prompt = mx.array([[(7 * i + 3) % 200 + 1 for i in range(tokens)]])
    for i in range(0, tokens, step):
        model(prompt[:, i : i + step], cache=caches)
    for _ in range(3):
        model(mx.array([[5]]), cache=caches)
    mx.eval([c.state for c in caches])


def check_memory(model, config, tokens: int, step: int = 37, tight: bool = True):
    """Resolved budget B: caches filled past B hold <= kv_memory; B + 1 would not fit."""
    resolved = KVCacheBuilder.resolve(model, config)
    budget = resolved.budget
    assert resolved.kv_memory == config.kv_memory and budget > 0
    tokens = max(tokens, budget + 40)
    caches = KVCacheBuilder.for_model(model, config)
    assert all(c.config.budget == budget for c in morph_caches(caches))
    fill(model, caches, tokens, step)
    block = resolved.morphkv_block  # block eviction frees `block` slots at once
    assert all(budget - block < c.tokens_kept <= budget for c in morph_caches(caches))
    assert held(caches) <= config.kv_memory
    assert sum(c.nbytes_bound for c in morph_caches(caches)) <= config.kv_memory
    # the largest: with one more token per KV head the caches' own bound (nbytes_bound, what
    # they may hold once running) exceeds the memory asked, filled the same way
    bigger = KVCacheBuilder.for_model(model, at_budget(resolved, budget + 1))
    fill(model, bigger, tokens, step)
    if tight:  # float16 models: the probe counts pending queries as float32 (conservative)
        assert sum(c.nbytes_bound for c in morph_caches(bigger)) > config.kv_memory
    assert bound_bytes(at_budget(resolved, budget + 1), layer_shapes(model)) > config.kv_memory
    return resolved, held(caches)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(3, head_dim=64)
    yield model
    morphkv.detach(model)


@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("memory", [100_000, 223_457])
def test_tiny_model_never_holds_more_than_asked(tiny, bits, memory):
    config = recommended(memory=memory, kv_bits=bits)
    resolved, _ = check_memory(tiny, config, tokens=100)
    assert resolved.kv_bits == bits and resolved.method == MEMORY_METHOD


def test_float16_model_and_other_methods(tiny):
    model = tiny_llama(4, head_dim=64)
    model.set_dtype(mx.float16)
    for method in ("h2o", "sliding_window", "morphkv"):
        config = morphkv.PRESETS["paper"](memory=80_000, method=method)
        check_memory(model, config, tokens=100, tight=False)
    f32 = KVCacheBuilder.resolve(tiny, recommended(memory=150_000, kv_bits=None)).budget
    f16 = KVCacheBuilder.resolve(model, recommended(memory=150_000, kv_bits=None)).budget
    assert f16 > 1.5 * f32  # half the bytes per stored element


def test_more_bits_fewer_tokens(tiny):
    budgets = [KVCacheBuilder.resolve(tiny, recommended(memory=200_000, kv_bits=b)).budget
               for b in (None, 8, 4)]
    assert budgets[0] < budgets[1] < budgets[2]


def test_too_small_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match=r"kv_memory=1000 bytes .* too small.*4 sinks"):
        KVCacheBuilder.for_model(tiny, recommended(memory=1000))
    with pytest.raises(ValueError, match="too small"):
        morphkv.patch_model(tiny, recommended(memory=1000))


def test_an_error_not_about_the_size_is_raised_not_searched():
    """A config that fails at every budget (8-bit groups of 64 on head_dim 16) says why at
    once instead of searching budgets forever."""
    with pytest.raises(ValueError, match="kv_group_size=64 must divide head_dim=16"):
        KVCacheBuilder.for_model(tiny_llama(head_dim=16), recommended(memory=2**20))


def test_unresolved_config_is_refused_by_a_bare_cache():
    config = recommended(memory=10 * MiB)
    assert config.budget == 0 and config.kv_bits == 8
    with pytest.raises(ValueError, match="no budget resolved"):
        KVCacheBuilder.build(config)
    with pytest.raises(ValueError, match="kv_memory must be a positive int"):
        KVCacheConfig(kv_memory=-3, morphkv_budget=0).validate(resolved=False)
    with pytest.raises(ValueError, match="not both"):
        KVCacheConfig(morphkv_recent=20, morphkv_recent_share=0.5).validate()


def test_budget_setting_keeps_tokens_in_the_model_dtype():
    config = recommended(128)
    assert (config.budget, config.kv_bits, config.kv_memory) == (128, None, None)


def test_patch_model_generates_within_memory(tiny):
    morphkv.patch_model(tiny, recommended(memory=60_000))
    try:
        caches = tiny.make_cache()
        prompt = mx.array([(5 * i + 1) % 200 + 1 for i in range(250)])
        for (_, _), _ in zip(generate_step(prompt, tiny, prompt_cache=caches), range(30),
                             strict=False):
            pass
        assert held(caches) <= 60_000
        config = morph_caches(caches)[0].config
        assert config.budget - config.morphkv_block < morph_caches(caches)[0].tokens_kept
    finally:
        morphkv.unpatch_model(tiny)


@pytest.mark.parametrize("text,value", [("64M", 64 * MiB), ("1.5G", int(1.5 * 2**30)),
                                         ("512k", 512 * 1024), ("4096", 4096), ("2MiB", 2 * MiB)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "M", "-3M", "64X", "1e3", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.slow
def test_embedded_model_never_holds_more_than_asked():
    """The bytes of a float16 cache of 128 tokens on this model (2.81 MiB)."""
    model, _ = load_embedded()
    memory = "2.81M"
    config = recommended(memory=parse_size(memory))
    tokens = 400  # past the resolved budget (171 at 8 bits)
    resolved = KVCacheBuilder.resolve(model, config)
    assert resolved.budget < tokens
    _, used = check_memory(model, config, tokens, step=128)
    assert used <= parse_size(memory)
    plain = dataclasses.replace(config, kv_bits=None)
    assert KVCacheBuilder.resolve(model, plain).budget < resolved.budget / 2  # float32 model


def test_bad_memory_flag_is_one_line(capsys):
    from morphkv.cli import main

    for command in ("serve", "generate", "chat"):
        with pytest.raises(SystemExit) as stop:
            main([command, "--kv-memory", "12X"])
        assert stop.value.code == 2
        assert "--kv-memory: '12X' is not a size" in capsys.readouterr().err


@pytest.mark.slow
def test_server_bound_is_within_the_memory_asked():
    from morphkv.cli.commands import build_parser
    from morphkv.server.app import cache_config, load_served
    from morphkv.server.memory import kv_bound, startup_line

    load_embedded()  # skips when the model cannot be had
    args = build_parser().parse_args(["serve", "--kv-memory", "3M"])
    served = load_served(args, cache_config(args))
    config, bound, _ = kv_bound(served)
    assert config.kv_memory == 3 * MiB and 0 < bound <= 3 * MiB
    assert "--kv-memory 3.0 MiB" in startup_line(served, config, bound)
    small = build_parser().parse_args(["serve", "--kv-memory", "100K"])
    with pytest.raises(ValueError, match="--kv-memory=102400 bytes .* too small"):
        load_served(small, cache_config(small))


@pytest.mark.slow
def test_gemma_kv_memory_counts_every_layer_and_says_which():
    """Gemma 3: the 15 sliding-window layers count against --kv-memory (at their 512-token
    window, or cut to the budget with --bound-sliding) and the start-up line names them."""
    from mlx_lm.models.cache import RotatingKVCache

    from morphkv.mlxlm.builder import unpatch_model
    from morphkv.model import load_gguf_model, resolve_embedded
    from morphkv.server.app import ServedModel, install_caches
    from morphkv.server.memory import kv_bound, startup_line

    try:
        path = str(resolve_embedded("gemma3-270m"))
    except Exception as e:  # noqa: BLE001 (any failure to fetch: skip)
        pytest.skip(f"Gemma 3 unavailable: {e}")
    model, tokenizer = load_gguf_model(path)
    served = ServedModel(model, tokenizer, {}, path, frozenset())
    asked = 20 * MiB
    config = install_caches(model, recommended(memory=asked))
    _, bound, _ = kv_bound(served)
    line = startup_line(served, config, bound)
    assert bound <= asked
    assert "3 morphkv layers" in line
    assert "15 sliding-window layers, window 512 (layers 0-4,6-10,12-16) 15.0 MiB" in line
    caches = model.make_cache()
    fill(model, caches, tokens=700, step=64)
    assert sum(c.nbytes for c in caches) <= asked  # every layer, filled past both windows
    sliding = sum(c.nbytes for c in caches if isinstance(c, RotatingKVCache))
    assert 14 * MiB < sliding <= 15 * MiB
    with pytest.raises(ValueError, match=r"too small.* in the layers morphkv does not replace"):
        unpatch_model(model)
        install_caches(model, recommended(memory=12 * MiB))

    unpatch_model(model)
    config = install_caches(model, recommended(64), bound_sliding=True)
    _, bound, _ = kv_bound(served)
    assert "cut to the budget (64 newest tokens" in startup_line(served, config, bound)
    caches = model.make_cache()
    assert {c.max_size for c in caches if isinstance(c, RotatingKVCache)} == {64}
    fill(model, caches, tokens=300, step=64)
    assert sum(c.nbytes for c in caches) <= bound
