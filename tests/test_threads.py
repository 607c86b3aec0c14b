"""NumPy's BLAS thread setting survives concurrent caches (the limiter is reference-counted)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.core.host_blas import blas_threads, one_blas_thread

pytestmark = pytest.mark.skipif(blas_threads() is None, reason="NumPy without OpenBLAS controls")


def test_interleaved_users_restore_the_callers_setting():
    before = blas_threads()
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()

    def a():
        with one_blas_thread():
            a_inside.set()
            b_inside.wait(5)
        a_left.set()

    def b():
        a_inside.wait(5)
        with one_blas_thread():
            b_inside.set()
            a_left.wait(5)
            assert blas_threads() == 1  # still inside: one thread

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert blas_threads() == before


def test_two_threads_feeding_caches_leave_the_setting_alone():
    before = blas_threads()
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((1, 2, 400, 16)).astype(np.float32))
    errors = []

    def work():
        try:
            for _ in range(5):
                cache = KVCacheBuilder.build(KVCacheConfig(morphkv_budget=64))
                cache.update_and_fetch(keys, keys)
                assert cache.tokens_kept == 64
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert blas_threads() == before
