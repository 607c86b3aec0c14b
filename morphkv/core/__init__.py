"""The cache and its selection engine: ``MorphKVCache`` and what decides what it keeps.

Dependencies point down this list: ``config`` (``KVCacheConfig``) and ``presets``; ``rules``
(one small scorer per eviction method, registered in ``METHODS``); ``rows`` (the attention
rows of the recent queries) and ``engine`` (token-by-token selection over every batch row and
KV head); ``storage``, ``quant``, ``saved``, ``liveness`` (slot storage, quantized rows, saved
state, the mask of live slots); ``queries`` (whether the attention hook delivers real queries);
``batch`` (mlx_lm's batch protocol) and ``cache`` (the cache class itself). Nothing here
imports a model, the command line or the benchmarks.
"""
