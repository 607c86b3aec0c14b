"""Imported by pytest before any test module: ``import morphkv`` first, so on a Linux CPU it
loads OpenBLAS before MLX is (``morphkv.runtime.blas.load_in_process``) and the in-process
model tests run MLX's matmuls on it, as the ``morphkv`` command does.

Single-threaded (``OPENBLAS_NUM_THREADS=1``, read when the library loads): in one long pytest
process (many models, mlx_lm's generation streams, forked children) a threaded ``sgemm`` was
seen spinning forever in OpenBLAS's ``exec_blas`` waiting for its worker threads; one thread
has no worker pool to wait for. Child processes inherit it.

Property tests (hypothesis) draw fresh examples on every local run, so they keep looking for
new failures; under ``.ci/run`` (``MORPHKV_CI=1``) they draw a fixed sequence, so CI on a
clean checkout passes or fails the same way every time."""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from hypothesis import settings  # noqa: E402

import morphkv  # noqa: E402, F401

settings.register_profile("ci", derandomize=True)
if os.environ.get("MORPHKV_CI") == "1":
    settings.load_profile("ci")
