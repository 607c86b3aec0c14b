"""Serve a model over mlx_lm's OpenAI-compatible HTTP API with a constant-size KV cache.

The command only: the server is ``morphkv.server`` (options, loading and start-up in
``morphkv.server.app``). See docs/serving.md.
"""

from __future__ import annotations

from ..server.app import add_arguments, run

__all__ = ["add_arguments", "run"]
