"""Memory that returns: a cache kept for reuse by ``morphkv serve`` owns its host arrays.

A batch row's engine can hold views into host arrays shared by every row of its batch (the
queries gathered for all rows at once); a cache extracted from the batch and kept in the
prompt cache would keep those whole arrays alive while its ``nbytes`` counts only its share.
The server's prompt cache copies such views when it keeps a cache (``own_memory``).
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from smollm2_fixture import embedded_gguf_path, load_embedded

from morphkv.server.run import _base_nbytes, bounded_prompt_cache


def _host_arrays(caches) -> tuple[int, int]:
    """(bytes of the engines' host arrays, bytes of the buffers they keep alive)."""
    own = alive = 0
    for c in caches:
        engine = getattr(c, "engine", None)
        for v in vars(engine).values() if engine is not None else ():
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, np.ndarray):
                    own, alive = own + x.nbytes, alive + _base_nbytes(x)
    return own, alive


@pytest.mark.slow
def test_kept_caches_do_not_keep_their_batch_alive():
    from mlx_lm.generate import BatchGenerator

    from morphkv.bench.load_clients import long_text
    from morphkv.mlxlm.builder import patch_model
    from morphkv.runtime.cache_flags import add_cache_flags, config_from_flags

    embedded_gguf_path()
    model, tokenizer = load_embedded()
    p = argparse.ArgumentParser()
    add_cache_flags(p, budget=64)
    # the host engine's batches share host arrays between rows (MLX-engine batches hold none)
    patch_model(model, config_from_flags(p.parse_args(["--preset", "tuned", "--budget", "64",
                                                       "--engine", "host"])))
    ids = tokenizer.encode(long_text(600))
    prompts = [ids[7 * i : 7 * i + 100 + 60 * i] for i in range(4)]
    g = BatchGenerator(model, prefill_step_size=256)
    g.insert(prompts, max_tokens=[5, 11, 17, 23])
    finished = []
    for _ in range(500):
        finished += [r for r in g.next_generated() if r.finish_reason]
        if len(finished) == len(prompts):
            break
    kept = bounded_prompt_cache(10, 10**9)
    shared = 0
    for r in finished:
        own, alive = _host_arrays(r.prompt_cache)
        shared += alive > own  # before: views into the batch's arrays
        kept.insert_cache("m", r.all_tokens, r.prompt_cache)
        assert _host_arrays(r.prompt_cache)[1] == own  # after: its own arrays, same bytes
    assert shared  # the batch did share arrays between rows (what the copy is for)
