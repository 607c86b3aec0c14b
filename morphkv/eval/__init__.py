"""Quality evaluation: the ``morphkv eval`` commands and the parts every
measurement shares.

Parts (dependencies point down the list): ``progress``, ``flags`` (command-line helpers),
``output`` (result folder, machine facts, JSON, tables; ``finish``: the table, JSON and PNG
every measurement ends with), ``models`` (model loading, ``tiny_llama``, ``greedy_tokens``),
``process`` (peak memory, stopping a child), ``arms`` (a spec string -> ``KVCacheConfig`` or an
mlx_lm cache), ``metrics``, ``texts`` (+ its data in ``data/texts.json``), ``plots`` (+ ``plt``,
``require_matplotlib``), ``runner`` (teacher-forced feeding; ``position_kl``: KL per position
of any caches), ``equal_bytes``; commands (modes in ``morphkv.cli.commands.MODES``):
``eval recall --data`` chats (``chat_recall`` + ``chat_items``, ``chat_report``,
``chat_answers``; data in ``data/chat_*.json``), longchat (``recall`` + ``recall_items``,
``recall_natural``, ``recall_report``; data in ``data/recall_*.json``), said (``said_recall`` +
``said_items``; ``choose_said``), answers, ``--live`` (``live``);
``eval fidelity --mode`` texts (``fidelity``; ``--split``/``--grid`` to choose settings), bytes,
state (``state_bytes``); ``generation``.

Adding things (one small change each):
- a command: a module with ``add_arguments(parser)`` and ``execute(args) -> figures`` (or
  ``run(args)``), one line in ``morphkv.cli.commands.MODES`` (a mode of a merged command),
  ending in ``output.finish`` (table, JSON, PNG). A sweep
  is ``fidelity.run_fidelity`` over ``arms.grid_arms(...)``; a recall task scores answers
  with ``models.greedy_tokens``.
- a knob or quantized storage: nothing here; an arm names any ``KVCacheConfig`` field
  (``morphkv:window=8:recent=64``, ``morphkv:bits=8``) and ``--equal-bytes`` measures its bytes.
- mlx_lm's own quantized cache as a reference: one entry in ``arms.BASELINES``.
- a metric: a function in ``metrics`` and a column where a command records it.
"""
