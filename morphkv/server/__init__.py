"""``morphkv serve``: mlx_lm's OpenAI-compatible server with morphkv caches.

``app`` (options, model loading, the cache setting, start-up), ``guard`` (request checks),
``handler`` (mlx_lm's handler plus /v1/models, /health, quiet disconnects), ``run`` (the serving
loop: prompt-cache byte limit, memory handed back at idle, clean shutdown), ``fair`` (fair
batching: length groups, prefill pieces), ``memory`` (the caches' memory bound over all
layers). Depends on ``runtime``, ``mlxlm``, ``model`` and ``core``; the command is
``morphkv.cli.serve``.
"""
