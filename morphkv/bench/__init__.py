"""Measurement: the benchmark and evaluation commands and the parts they share.

Parts (dependencies point down the list): ``_util`` (progress, flags, tables, tiny models),
``arms`` (a spec string -> ``KVCacheConfig`` or an mlx_lm cache), ``metrics``, ``texts`` (+ the
data in ``conversations``), ``plots``, ``runner`` (teacher-forced feeding), ``equal_bytes``;
commands: ``fidelity``, ``generation``, ``mechanism``, ``speed`` (+ ``length``), ``layer``,
``overhead``, ``blas``; ``report`` renders docs/results.md from their JSON.

Adding things (one small change each):
- a command (sweep, recall, serve): a module with ``add_arguments(parser)`` and ``run(args)``,
  one line in ``morphkv.cli.commands.COMMANDS``, and for the report one entry in
  ``report.SOURCES`` and one in ``report.SECTIONS`` (a function, or ``"module:function"`` in
  the new module). A sweep is ``fidelity.run_fidelity`` over ``arms.grid_specs(...)``; a
  recall task is a text kind in ``texts.TEXTS`` or its own command scoring answers with
  ``_util.greedy_tokens``.
- a knob or quantized storage: nothing here; an arm names any ``KVCacheConfig`` field
  (``morphkv:window=8:recent=64``, ``morphkv:bits=8``) and ``--equal-bytes`` measures its bytes.
- mlx_lm's own quantized cache as a reference: one entry in ``arms.BASELINES``.
- a metric: a function in ``metrics`` and a column where a command records it.
"""
