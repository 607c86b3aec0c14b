"""Imported by pytest before any test module: ``import morphkv`` first, so on a Linux CPU it
loads OpenBLAS before MLX is (``morphkv.runtime.blas.load_in_process``) and the in-process
model tests run MLX's matmuls on it, as the ``morphkv`` command does."""

import morphkv  # noqa: F401
