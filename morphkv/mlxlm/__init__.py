"""Attaching morphkv caches to mlx_lm models: the attention hook (``hooks``, ``attach``), the
per-layer cache layout of each model family (``layout``), the factory installed as
``model.make_cache`` (``builder``) and tensor-parallel sharding (``shard``). Imports only
``morphkv.core``."""
