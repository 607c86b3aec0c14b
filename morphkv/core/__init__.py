"""The cache and its selection engine: ``MorphKVCache`` and what decides what it keeps.

Dependencies point down this list: ``config`` (``KVCacheConfig``) and ``presets``; ``rules``
(one small scorer per eviction method, registered in ``METHODS``); ``quant`` and ``storage``
(quantized rows; the K/V storage every cache shares); ``device`` (the one engine: block
selection over every batch row and KV head, in MLX) with ``attention``, ``device_schedule``,
``device_proxy`` and ``proxy_schedule`` (how pieces reach it); ``queries`` and ``feed``
(whether the attention hook delivers real queries; counters, pins, input checks); ``saved``
(checked saved state); ``batch`` and ``device_batch`` (mlx_lm's batch protocol) and ``cache``
(the cache class itself). Nothing here imports a model, the command line or the benchmarks.
"""
