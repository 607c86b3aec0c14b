"""Hostile GGUF files (issue 13): each reproduced corruption ends in one GGUFError naming the
field and value, before anything is allocated; loads run in a subprocess with an address-space
limit, so a crash or a runaway allocation fails the test instead of the test run."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import textwrap

import pytest

from morphkv.model import MODEL_ERRORS, GGUFError, load_gguf_model
from morphkv.model.gguf import check_gguf
from morphkv.model.gguf_tiny import tiny_llama_gguf, tiny_llama_meta, tiny_llama_tensors
from morphkv.model.gguf_writer import Meta
from morphkv.model.gguf_writer import write_gguf as _write

AS_LIMIT = 2 << 30  # bytes of address space for the loading subprocess
RSS_LIMIT_KB = 1 << 20  # 1 GiB peak resident memory

_RUNNER = textwrap.dedent(
    """
    import json, sys
    from morphkv.model import GGUFError, load_gguf_model
    for path in sys.argv[1:]:
        print(json.dumps({"start": path}), flush=True)
        try:
            load_gguf_model(path)
            out = {"file": path, "outcome": "ok"}
        except GGUFError as e:
            out = {"file": path, "outcome": "GGUFError", "msg": str(e)}
        except BaseException as e:
            out = {"file": path, "outcome": type(e).__name__, "msg": str(e)[:300]}
        print(json.dumps(out), flush=True)
    """
)


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def load_in_subprocess(paths: list[str], timeout: float = 120) -> dict[str, dict]:
    """Load each GGUF file in one child process (address space limited); outcome per file.
    A child killed by a signal or over the memory bound fails the calling test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *paths],
        capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=_limit,
    )  # fmt: skip
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    done = {d["file"]: d for d in lines if "file" in d}
    started = [d["start"] for d in lines if "start" in d]
    crashed = [p for p in started if p not in done]
    assert proc.returncode == 0 and not crashed, (
        f"loader crashed (rc {proc.returncode}) on {crashed}: {proc.stderr[-2000:]}"
    )
    assert rss <= max(before, RSS_LIMIT_KB), f"peak RSS {rss} KB"
    return done


def patch(data: bytes, lay, name: str, value) -> bytes:
    off, fmt = lay.fields[name]
    out = bytearray(data)
    struct.pack_into(fmt, out, off, value)
    return bytes(out)


def _rename_key(data: bytes, lay, key: str, new: str) -> bytes:
    assert len(new) == len(key)
    off = lay.fields[f"meta:{key}:keylen"][0] + 8
    return data[:off] + new.encode() + data[off + len(key) :]


def _edit_string(data: bytes, lay, key: str, new: str) -> bytes:
    off = lay.fields[f"meta:{key}:len"][0] + 8
    return data[:off] + new.encode() + data[off + len(new) :]


def _cases() -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, text the GGUFError must contain)."""
    d, lay = tiny_llama_gguf()
    q = "blk.0.attn_q.weight"
    tensors = tiny_llama_tensors()
    meta_100k = [
        Meta(m.key, m.vtype, 100000 if m.key == "llama.block_count" else m.value, m.elem)
        for m in tiny_llama_meta()
    ]
    bad_merge = [
        Meta(m.key, m.vtype, ["a b", "x y"] if m.key.endswith("merges") else m.value, m.elem)
        for m in tiny_llama_meta()
    ]
    no_eos = [m for m in tiny_llama_meta() if m.key != "tokenizer.ggml.eos_token_id"]
    return {
        "tensor_count_2^40": (patch(d, lay, "tensor_count", 1 << 40), "tensor count 1099511627776"),
        "metadata_count_2^40": (patch(d, lay, "metadata_count", 1 << 40), "metadata count"),
        "n_dims_1000": (patch(d, lay, f"tensor:{q}:n_dims", 1000), "n_dims=1000"),
        "block_count_100000": (_write(meta_100k, tensors)[0], "block_count=100000"),
        "head_count_0": (patch(d, lay, "meta:llama.attention.head_count", 0), "head_count=0"),
        "kv_not_dividing": (patch(d, lay, "meta:llama.attention.head_count_kv", 3),
                            "head_count_kv=3"),
        "unknown_tensor_type": (patch(d, lay, f"tensor:{q}:type", 99), "unknown (99)"),
        "unsupported_type_q8k": (patch(d, lay, f"tensor:{q}:type", 15), "Q8_K (15)"),
        "q6k_row_not_256": (patch(d, lay, f"tensor:{q}:type", 14), "block size 256"),
        "version_99": (patch(d, lay, "version", 99), "version 99"),
        "no_vocabulary": (_rename_key(d, lay, "tokenizer.ggml.tokens", "tokenizer.ggml.tokenz"),
                          "tokenizer.ggml.tokens"),
        "eos_out_of_range": (patch(d, lay, "meta:tokenizer.ggml.eos_token_id", 1000),
                             "eos_token_id=1000"),
        "no_eos": (_write(no_eos, tensors)[0], "eos_token_id"),
        "merge_not_in_vocab": (_write(bad_merge, tensors)[0], "merges[1]='x y'"),
        "truncated": (d[: len(d) - 100], "outside the data section"),
        "truncated_header": (d[: lay.header_end - 7], "truncated"),
        "dim_2^40": (patch(d, lay, f"tensor:{q}:dim1", 1 << 40), "needs"),
        "offset_past_end": (patch(d, lay, f"tensor:{q}:offset", 1 << 50),
                            "offset=1125899906842624"),
        "key_length_2^40": (patch(d, lay, "meta:llama.block_count:keylen", 1 << 40), "length"),
        "string_length_2^60": (patch(d, lay, "meta:general.architecture:len", 1 << 60), "length"),
        "array_count_2^40": (patch(d, lay, "meta:tokenizer.ggml.tokens:count", 1 << 40),
                             "array length"),
        "wrong_shape": (patch(d, lay, f"tensor:{q}:dim1", 64), "dims [32, 64], expected [32, 32]"),
        "bad_value_type": (patch(d, lay, "meta:llama.block_count:type", 77), "value type 77"),
        "arch_not_llama": (_edit_string(d, lay, "general.architecture", "gemma"),
                           "general.architecture is 'gemma'"),
        "not_gguf": (b"PK\x03\x04" + d[4:], "not a GGUF file"),
    }  # fmt: skip


_SAMPLE = {
    "uint8": 7, "int8": -7, "uint16": 7, "int16": -7, "uint32": 7, "int32": -7, "float32": 1.5,
    "bool": True, "string": "x", "uint64": 7, "int64": -7, "float64": 1.5,
}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    out = {}
    for name, (data, needle) in _cases().items():
        p = root / f"{name}.gguf"
        p.write_bytes(data)
        out[name] = (str(p), needle)
    good, _ = tiny_llama_gguf()
    (root / "good.gguf").write_bytes(good)
    out["good"] = (str(root / "good.gguf"), None)
    return out


@pytest.fixture(scope="module")
def type_files(tmp_path_factory):
    """An extra metadata entry of each value type, scalar and array: path -> type."""
    root = tmp_path_factory.mktemp("types")
    paths = {}
    for vtype, v in _SAMPLE.items():
        for extra in (Meta("x.k", vtype, v), Meta("x.k", "array", [v, v], vtype)):
            data, _ = _write([*tiny_llama_meta(), extra], tiny_llama_tensors())
            p = root / f"{vtype}_{extra.vtype}.gguf"
            p.write_bytes(data)
            paths[str(p)] = vtype
    return paths


@pytest.fixture(scope="module")
def results(files, type_files):
    """Every file of this module loaded in one limited subprocess (one start-up cost)."""
    return load_in_subprocess([p for p, _ in files.values()] + list(type_files))


def test_each_hostile_file_is_one_gguf_error_naming_the_field(files, results):
    assert results[files["good"][0]]["outcome"] == "ok"
    for name, (path, needle) in files.items():
        if needle is None:
            continue
        r = results[path]
        assert r["outcome"] == "GGUFError", (name, r)
        assert needle in r["msg"] and "\n" not in r["msg"], (name, r["msg"])


def test_header_checked_in_process_without_mlx_allocations(files):
    """The same files fail in check_gguf (pure Python, nothing handed to MLX), except a bad
    merge list, which only the tokenizer build (after mx.load, before any use) detects."""
    for name, (path, needle) in files.items():
        if needle is None or name == "merge_not_in_vocab":
            check_gguf(path)
            continue
        with pytest.raises(GGUFError, match=None) as ei:
            check_gguf(path)
        assert needle in str(ei.value), name


def test_errors_are_value_errors_and_catchable_as_model_errors(files):
    path, _ = files["head_count_0"]
    with pytest.raises(ValueError):
        load_gguf_model(path)
    assert issubclass(GGUFError, MODEL_ERRORS[0]) and FileNotFoundError in MODEL_ERRORS


def test_tiny_model_loads_and_runs(files):
    import mlx.core as mx

    model, tok = load_gguf_model(files["good"][0])
    assert model.args.num_hidden_layers == 2 and not model.args.tie_word_embeddings
    assert set(tok.eos_token_ids) == {2}
    ids = tok.encode("ab a")
    assert tok.decode(ids) == "ab a"
    assert model(mx.array([ids])).shape == (1, len(ids), 32)


def test_every_metadata_value_type_loads(type_files, results):
    """Every value type, scalar or array, float64 included (mx.load crashed on float64
    metadata; the gguf library reads it), loads."""
    for path, vtype in type_files.items():
        assert results[path]["outcome"] == "ok", (vtype, results[path])


def test_real_model_header_passes():
    from smollm2_fixture import embedded_gguf_path

    _, spec = check_gguf(embedded_gguf_path())
    assert (spec.layers, spec.heads, spec.kv_heads, spec.vocab) == (30, 9, 3, 49152)


def test_alignment_other_than_32_reads_the_same_tensors(tmp_path):
    from morphkv.model.gguf import read_gguf
    from morphkv.model.gguf_writer import write_gguf

    paths = []
    for align in (32, 64, 8):
        extra = [Meta("general.alignment", "uint32", align)] if align != 32 else []
        data, _ = write_gguf(tiny_llama_meta() + extra, tiny_llama_tensors(), align=align)
        paths.append(tmp_path / f"a{align}.gguf")
        paths[-1].write_bytes(data)
    ref, _ = read_gguf(paths[0])
    for p in paths[1:]:
        got, _ = read_gguf(p)
        assert set(got) == set(ref)
        assert all((got[k] == ref[k]).all().item() for k in ref), p
    bad, _ = write_gguf(tiny_llama_meta() + [Meta("general.alignment", "uint32", 48)], [])
    (tmp_path / "bad.gguf").write_bytes(bad)
    with pytest.raises(GGUFError, match="general.alignment=48"):
        check_gguf(tmp_path / "bad.gguf")
