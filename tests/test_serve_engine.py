"""``morphkv serve``: the caches the server installs batch on the one engine (every request runs
in a batch: over one storage with real queries, ``full`` included; row-wise for keys as
proxies), and the start-up line names it; ``--engine host`` (the removed float64 engine) is
refused."""

from __future__ import annotations

import argparse

import pytest
from mlx_lm.generate import batch_generate

from morphkv import MorphKVCache
from morphkv.core.batch import BatchMorphKVCache
from morphkv.core.device_batch import DeviceBatchCache
from morphkv.eval.models import tiny_llama
from morphkv.server import app
from morphkv.server.memory import engine_and_pins
from tests.test_batch import _Tok, prompts_of


def served_config(*flags):
    parser = argparse.ArgumentParser()
    app.add_arguments(parser)
    model = tiny_llama(0)
    config = app.install_caches(model, app.cache_config(parser.parse_args(
        ["--budget", "24", "--window", "4", "--sinks", "2", *flags])))
    return model, config


@pytest.mark.parametrize("flags, engine, batch_class", [
    ([], "mlx", DeviceBatchCache),  # auto: the MLX engine for the recommended preset
    (["--engine", "mlx"], "mlx", DeviceBatchCache),
    (["--scoring", "proxy"], "mlx", BatchMorphKVCache),  # keys as proxies: row-wise
    (["--method", "full"], "mlx", DeviceBatchCache),  # one storage, grown as rows need
    (["--block", "1"], "mlx", DeviceBatchCache),  # auto: per-token recency is scheduled on MLX
    # auto: the per-token rule of a rule that reads attention runs on MLX too (issue 43)
    (["--preset", "tuned", "--block", "1"], "mlx", DeviceBatchCache),
])
def test_the_engine_flag_reaches_the_batches(flags, engine, batch_class):
    model, config = served_config(*flags)
    rows = [model.make_cache() for _ in range(2)]
    batch = MorphKVCache.merge([r[0] for r in rows])
    assert type(batch) is batch_class
    assert engine_and_pins(rows[0][0].config).startswith(f"engine {engine} (batches too")
    res = batch_generate(model, _Tok(), prompts_of([30, 9]), max_tokens=[20, 30],
                         prefill_step_size=8, return_prompt_caches=True)
    assert all(c.config.engine == engine for caches in res.caches for c in caches)
    assert config.engine in ("auto", engine)


def test_the_host_engine_is_refused():
    with pytest.raises(SystemExit):
        served_config("--engine", "host")
