"""Chat sessions on disk: mlx_lm's prompt-cache file plus what is needed to continue.

A session is a ``.safetensors`` file written by mlx_lm's ``save_prompt_cache`` (the caches'
``state``, each checked on load by ``MorphKVCache``'s state setter, ``morphkv.core.saved``)
whose metadata holds the model's identity, the cache setting, the turn count, the tokens fed
and the transcript (needed to template the next turn). Saving writes a temporary file beside
the target and renames it over the target (atomic on POSIX): an interrupted save leaves the
old file in place. Loading checks everything before the running conversation is touched; any
problem is one ``SessionError`` line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..core import quant
from ..core.config import KVCacheConfig
from ..mlxlm.builder import KVCacheBuilder
from ..mlxlm.layout import morph_caches
from ..runtime.cache_flags import describe

FORMAT = "morphkv-chat-session"
VERSION = "1"
SUFFIX = ".safetensors"


class SessionError(ValueError):
    """A session that cannot be saved or loaded (one line)."""


def model_fingerprint(model) -> str:
    """A short hash of the model's parameters (names, shapes, dtypes and their first values):
    two different checkpoints of one architecture differ."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, a in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)};".encode())
        head = a.reshape(-1)[:256]
        head = head if mx.issubdtype(head.dtype, mx.integer) else head.astype(mx.float32)
        h.update(np.array(head).tobytes())
    return h.hexdigest()[:16]


def session_path(text: str) -> Path:
    """The file name as given, with ``.safetensors`` appended when missing (as MLX does)."""
    path = Path(text).expanduser()
    return path if path.name.endswith(SUFFIX) else path.with_name(path.name + SUFFIX)


def save(path: Path, conv, model_name: str, fingerprint: str) -> float:
    """Write ``conv`` to ``path`` atomically; returns the seconds it took."""
    from mlx_lm.models.cache import save_prompt_cache

    start = time.perf_counter()
    metadata = {
        "format": FORMAT, "version": VERSION, "model": model_name, "fingerprint": fingerprint,
        "config": conv.config.to_json(), "turns": str(conv.turns), "fed": str(conv.fed),
        "messages": json.dumps(conv.messages), "pending": conv.pending,
        "system_prompt": json.dumps(conv.system_prompt), "pins": json.dumps(conv.pinned),
    }
    if not path.parent.is_dir():
        raise SessionError(f"cannot save to {path}: no such folder {path.parent}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{SUFFIX}")
    try:
        save_prompt_cache(str(tmp), conv.caches, metadata)
        os.replace(tmp, path)
    except OSError as e:
        raise SessionError(f"cannot save to {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return time.perf_counter() - start


@dataclass
class Loaded:
    caches: list
    config: KVCacheConfig
    messages: list[dict]
    system_prompt: str | None
    turns: int
    fed: int
    pending: str
    seconds: float
    pins: list = dataclasses.field(default_factory=list)  # [start, end) ranges to pin again


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def load(path: Path, model, model_name: str, fingerprint: str,
         config: KVCacheConfig | None) -> Loaded:
    """The session in ``path`` for this model, checked (``SessionError`` otherwise).
    ``config``: the setting the running chat uses (the session must match it), or None to
    take the session's own."""
    from mlx_lm.models.cache import load_prompt_cache

    start = time.perf_counter()
    where = f"cannot load session {path}"
    if not path.is_file():
        raise SessionError(f"{where}: no such file")
    if not path.name.endswith(SUFFIX):
        raise SessionError(f"{where}: session files end in {SUFFIX}")
    try:
        caches, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # truncated / corrupt / edited: MLX, mlx_lm or the state check
        raise SessionError(f"{where}: not a complete, valid session file ({_one_line(e)})") \
            from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SessionError(f"{where}: an mlx_lm prompt cache but not a morphkv chat session")
    if meta.get("version") != VERSION:
        raise SessionError(f"{where}: session format version {meta.get('version')!r}, "
                           f"this morphkv reads {VERSION}")
    if meta.get("fingerprint") != fingerprint:
        raise SessionError(f"{where}: it belongs to another model ({meta.get('model')}, "
                           f"fingerprint {meta.get('fingerprint')}); this chat runs "
                           f"{model_name} ({fingerprint})")
    try:
        saved = KVCacheConfig.from_json(meta["config"]).validate()
        turns, fed = int(meta["turns"]), int(meta["fed"])
        messages = json.loads(meta["messages"])
        system_prompt = json.loads(meta["system_prompt"])
        pending = meta["pending"]
        pins = json.loads(meta.get("pins", "[]"))  # absent: saved before pins existed
    except (KeyError, ValueError, TypeError) as e:
        raise SessionError(f"{where}: bad session metadata ({_one_line(e)})") from None
    if config is not None and "seed" not in saved.rule.knobs():
        config = dataclasses.replace(config, seed=saved.seed)  # only a rule with a seed uses it
    if config is not None and saved != config:
        raise SessionError(f"{where}: saved with cache setting {describe(saved)}; this chat "
                           f"uses {describe(config)} (start with the same flags)")
    _check_transcript(where, messages, system_prompt, turns, fed)
    _check_pins(where, pins, fed)
    _check_caches(where, caches, model, saved, fed)
    return Loaded(caches, saved, messages, system_prompt, turns, fed, pending,
                  time.perf_counter() - start, pins)


def _check_pins(where, pins, fed: int) -> None:
    ok = isinstance(pins, list) and len(pins) <= fed and all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
        and 0 <= r[0] < r[1] <= fed for r in pins)
    if not ok:
        raise SessionError(f"{where}: its pinned ranges are not [start, end) token ranges "
                           f"within the {fed} tokens it saw")


def _check_transcript(where, messages, system_prompt, turns, fed) -> None:
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and set(m) == {"role", "content"}
        and isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages)
    ok = ok and (system_prompt is None or isinstance(system_prompt, str))
    dialogue = messages[1:] if ok and system_prompt else messages
    ok = ok and turns >= 0 and fed >= 0 and len(dialogue) == 2 * turns and (turns > 0) == (fed > 0)
    ok = ok and all(m["role"] == ("user", "assistant")[i % 2] for i, m in enumerate(dialogue))
    if not ok:
        raise SessionError(f"{where}: the transcript does not match the turn count")


def _check_caches(where, caches, model, config: KVCacheConfig, fed: int) -> None:
    expected = KVCacheBuilder.for_model(model, config)  # also attaches the attention hook
    kinds = [type(c).__name__ for c in caches]
    if kinds != [type(c).__name__ for c in expected]:
        raise SessionError(f"{where}: its {len(caches)} layer caches do not fit this model "
                           f"({len(expected)} layers)")
    heads = getattr(getattr(model, "args", None), "num_key_value_heads", None)
    for got, want in zip(morph_caches(caches), morph_caches(expected), strict=True):
        if got.config != want.config:
            raise SessionError(f"{where}: a layer cache was saved with another setting")
        if got.offset != fed:
            raise SessionError(f"{where}: a layer cache saw {got.offset} tokens, the session "
                               f"says {fed}")
        if got.keys is not None:
            b, h, _ = quant.dims(got.keys)
            if b != 1 or (heads is not None and h != heads):
                raise SessionError(f"{where}: caches of {b} x {h} KV heads, this model has "
                                   f"1 x {heads}")
