"""Sharded generation: 3 ranks (ring backend, loopback) of the embedded model, one KV head each.

The test launches this file with ``mlx.launch``; each rank runs ``_worker`` and writes what it
generated and stored to a JSON file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

CONFIG = dict(morphkv_budget=32, morphkv_n_sink=4, morphkv_window=8)
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
    "fifty years presses were running in more than two hundred European cities, and the"
)
MAX_TOKENS = 20
PREFILL_STEP = 256  # the prompt in one chunk (evicting inside it): fewer collectives
RANKS = 3
TIMEOUT_S = 600  # all 3 ranks; took 6 min here at load average 18 on 2 cores
ROOT = Path(__file__).resolve().parents[1]


def _generate(model, tokenizer):
    """Greedy tokens and the morphkv caches, through the Python API."""
    from morphkv import KVCacheBuilder, KVCacheConfig
    from morphkv.eval.models import greedy_tokens

    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CONFIG))
    prompt = tokenizer.encode(TEXT)
    tokens = greedy_tokens(model, caches, prompt, MAX_TOKENS, prefill_step_size=PREFILL_STEP)
    return [int(t) for t in tokens], caches, len(prompt)


def _record(caches, tokens, prompt_len, rank, size) -> dict:
    from morphkv.mlxlm.layout import morph_caches

    morph = morph_caches(caches)
    return dict(
        rank=rank,
        size=size,
        tokens=tokens,
        prompt_len=prompt_len,
        kv_heads=[int(c.keys.shape[1]) for c in morph],
        kept=[int(c.tokens_kept) for c in morph],
        kv_bytes=sum(c.nbytes for c in morph),
    )


def _worker(out_dir: str, gguf: str) -> None:
    from morphkv.mlxlm.shard import shard_if_launched
    from morphkv.model import load_gguf_model

    model, tokenizer = load_gguf_model(gguf)
    group = shard_if_launched(model, quiet=False)
    assert group is not None and group.size() == RANKS, "not launched as 3 ranks"
    tokens, caches, prompt_len = _generate(model, tokenizer)
    record = _record(caches, tokens, prompt_len, group.rank(), group.size())
    Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(record))


def _launch(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``mlx.launch -n 3 --backend ring`` on 127.0.0.1; the process group is killed by pid
    whatever happens."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    port = random.randrange(20000, 32000, 16)  # below Linux's ephemeral ports (32768-60999):
    # another test's client connections (pytest -n 2) never hold them
    cmd = [str(launcher), "-n", str(RANKS), "--backend", "ring", "--starting-port", str(port)]
    cmd += ["--python", sys.executable, "--cwd", str(ROOT)]
    cmd += ["--env", "OPENBLAS_NUM_THREADS=1", "--", *args]  # 3 ranks share the cores
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_three_ranks_generate_the_single_process_tokens_with_a_third_of_the_kv(tmp_path):
    from smollm2_fixture import embedded_gguf_path, load_embedded

    gguf = embedded_gguf_path()
    model, tokenizer = load_embedded()
    tokens, caches, prompt_len = _generate(model, tokenizer)
    single = _record(caches, tokens, prompt_len, 0, 1)
    assert single["prompt_len"] > CONFIG["morphkv_budget"]  # eviction happens
    assert set(single["kept"]) == {CONFIG["morphkv_budget"]} and set(single["kv_heads"]) == {3}

    done = _launch([str(Path(__file__).resolve()), str(tmp_path), gguf], TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    missing = [r for r in range(RANKS) if not (tmp_path / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote nothing: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    for rank in ranks:
        assert rank["size"] == RANKS
        assert rank["tokens"] == single["tokens"], f"rank {rank['rank']}"
        assert set(rank["kv_heads"]) == {1} and rank["kept"] == single["kept"]
        assert rank["kv_bytes"] * RANKS == single["kv_bytes"]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(*sys.argv[1:3])
