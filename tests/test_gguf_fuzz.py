"""Property-based GGUF corruption (issue 13): truncate, flip bytes, edit counts, dims, types,
offsets and metadata of a valid tiny GGUF. The header check must end in a GGUFError or accept
the file, with bounded memory; accepted files and a sample of rejected ones are then loaded
for real (mx.load + model + tokenizer) in a subprocess where a crash or a runaway allocation
fails the test."""

from __future__ import annotations

import random
import struct
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gguf_hostile import load_in_subprocess

from morphkv.model.gguf_check import check_llama
from morphkv.model.gguf_header import GGUFError, parse_header
from morphkv.model.gguf_tiny import tiny_llama_gguf

DATA, LAYOUT = tiny_llama_gguf()
FIELDS = sorted(LAYOUT.fields)
PEAK_BYTES = 4 << 20  # the header walk of a 24 KB file may allocate at most 4 MB
_INTERESTING = (0, 1, 2, 3, 31, 32, 33, 64, 99, 255, 1000, 1 << 31, 1 << 32, 1 << 40, 1 << 62)


def _fit(fmt: str, v: int | float):
    if fmt in ("<f", "<d"):
        return float(v)
    if fmt == "<?":
        return bool(v)
    bits = struct.calcsize(fmt) * 8
    if fmt[1].islower():  # signed
        return (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    return v % (1 << bits)


def edit_field(data: bytes, name: str, value) -> bytes:
    off, fmt = LAYOUT.fields[name]
    if off + struct.calcsize(fmt) > len(data):  # truncated before this field
        return data
    out = bytearray(data)
    struct.pack_into(fmt, out, off, _fit(fmt, value))
    return bytes(out)


def flip(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, val in edits:
        if out:
            out[pos % len(out)] = val
    return bytes(out)


def truncate(data: bytes, n: int) -> bytes:
    return data[: n % (len(data) + 1)]


def header_outcome(data: bytes) -> str:
    """'ok' or 'GGUFError'; any other exception propagates (and fails the test)."""
    try:
        check_llama(parse_header(data))
        return "ok"
    except GGUFError:
        return "GGUFError"


_value = st.one_of(st.sampled_from(_INTERESTING), st.integers(0, (1 << 64) - 1))
_mutation = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(FIELDS), _value),
    st.tuples(
        st.just("flip"),
        st.lists(st.tuples(st.integers(0, len(DATA)), st.integers(0, 255)), min_size=1, max_size=8),
    ),  # noqa: E501
    st.tuples(
        st.just("flip_header"),
        st.lists(
            st.tuples(st.integers(0, LAYOUT.header_end), st.integers(0, 255)),
            min_size=1,
            max_size=4,
        ),
    ),  # noqa: E501
    st.tuples(st.just("truncate"), st.integers(0, len(DATA))),
)


def mutate(data: bytes, m: tuple) -> bytes:
    if m[0] == "field":
        return edit_field(data, m[1], m[2])
    if m[0] in ("flip", "flip_header"):
        return flip(data, m[1])
    return truncate(data, m[1])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_mutation, min_size=1, max_size=3))
def test_corrupted_header_is_gguf_error_or_valid_with_bounded_memory(muts):
    data = DATA
    for m in muts:
        data = mutate(data, m)
    tracemalloc.start()
    try:
        header_outcome(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, (muts, peak)


def _random_mutation(rng: random.Random) -> tuple:
    kind = rng.choice(("field", "field", "flip", "flip_header", "truncate"))
    if kind == "field":
        bits = rng.choice((8, 32, 64))
        v = rng.choice(_INTERESTING) if rng.random() < 0.5 else rng.getrandbits(bits)
        return ("field", rng.choice(FIELDS), v)
    if kind == "truncate":
        return ("truncate", rng.randrange(len(DATA)))
    hi = len(DATA) if kind == "flip" else LAYOUT.header_end
    return (kind, [(rng.randrange(hi), rng.randrange(256)) for _ in range(rng.randint(1, 4))])


def test_sample_loads_for_real_without_crash(tmp_path):
    """Seeded sample: every corrupted file the header check accepts (they reach mx.load and
    the model build) plus rejected ones, loaded in one limited subprocess."""
    rng = random.Random(13)
    accepted, data_flips, rejected = [], [], []
    for _ in range(1500):
        m = _random_mutation(rng)
        data = mutate(DATA, m)
        if header_outcome(data) != "ok":
            rejected.append(data)
        elif m[0] == "flip" and min(p for p, _ in m[1]) >= LAYOUT.header_end:
            data_flips.append(data)  # tensor bytes only: always harmless, a few suffice
        else:
            accepted.append(data)
    assert len(accepted) >= 20 and rejected, (len(accepted), len(rejected))
    files = {}
    groups = (("acc", accepted[:50]), ("acc", data_flips[:5]), ("rej", rejected[:20]))
    for kind, group in groups:
        for data in group:
            p = tmp_path / f"{len(files)}.gguf"
            p.write_bytes(data)
            files[str(p)] = kind
    results = load_in_subprocess(list(files))
    for path, kind in files.items():
        r = results[path]
        assert r["outcome"] in ("ok", "GGUFError"), r
        if kind == "rej":
            assert r["outcome"] == "GGUFError", r
