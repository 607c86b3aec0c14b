"""Models for evaluations: the embedded or a named model, a tiny random-weight llama for tests,
and greedy generation through mlx_lm's own loop."""

from __future__ import annotations

RANDOM_TINY = "random-tiny"  # a tiny random-weight llama built in-process (tests, no download)


def load_model(name: str | None):
    """(model, tokenizer or None): the embedded model by default, ``random-tiny`` for tests."""
    if name == RANDOM_TINY:
        return tiny_llama(), None
    from ..model import load

    return load(name)


def tiny_llama(seed: int = 0, head_dim: int | None = None):
    """A tiny random-weight mlx_lm llama (no download), for tests and smoke runs; head_dim
    defaults to 16 (64 lets MLX quantize it in groups of 32/64)."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=head_dim, rms_norm_eps=1e-5, vocab_size=256))
    mx.eval(model.parameters())
    return model


def greedy_tokens(model, caches, prompt, max_tokens: int, prefill_step_size: int = 2048,
                  penalty: float | None = None, ends=()) -> list[int]:
    """Greedy token ids from mlx_lm's own ``generate_step`` with the given caches (a
    repetition ``penalty`` when given), up to and with the first of ``ends``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    out = []
    for token, _ in generate_step(mx.array(prompt), model, prompt_cache=caches,
                                  prefill_step_size=prefill_step_size, sampler=make_sampler(0.0),
                                  max_tokens=max_tokens, logits_processors=penalty and
                                  make_logits_processors(repetition_penalty=penalty)):
        out.append(int(token))
        if out[-1] in ends:
            break
    return out
