"""The cache and its selection engine: ``MorphKVCache`` and what decides what it keeps.

Dependencies point down this list: ``config`` (``KVCacheConfig``) and ``presets``; ``rules``
(one small scorer per eviction method, registered in ``METHODS``); ``quant`` and ``storage``
(quantized rows; the K/V storage every cache shares); ``rows`` (the attention rows of the
recent queries) and ``engine`` (block selection over every batch row and KV head; ``device``:
the same on the MLX path); ``masks``, ``queries`` and ``feed`` (the host path: which slots a
query sees, whether the attention hook delivers real queries, how tokens reach the engines);
``saved`` (checked saved state); ``batch`` (mlx_lm's batch protocol) and ``cache`` (the cache
class itself). Nothing here imports a model, the command line or the benchmarks.
"""
