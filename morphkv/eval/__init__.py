"""Quality evaluation: the ``morphkv eval`` commands and the parts every measurement shares.

Parts (dependencies point down the list): ``progress``, ``flags``, ``output`` (result folder,
machine facts, JSON, tables; ``finish``), ``models``, ``process``, ``arms`` (a spec string ->
``KVCacheConfig`` or an mlx_lm cache; ``cells``: ``--arms`` labels ``spec[+pinN][@N]``),
``metrics``, ``texts`` (+ ``data/texts.json``), ``plots``, ``runner`` (THE shared runner: arms
x items x models -> JSON + PNG + a table; every evaluation is an ``Evaluation``), ``asking``
(a chat prefilled once, each question from a copy), ``forced`` (teacher-forced feeding,
``position_kl``), ``equal_bytes``. Commands (modes in ``morphkv.cli.commands.MODES``):
``eval recall --data`` chats (``chat_recall`` + ``chat_items``, ``chat_report``,
``chat_answers``), said (``said_recall`` + ``said_items``; ``choose_said``), longchat
(``recall`` + ``recall_items``, ``recall_natural``, ``recall_report``), answers, ``--live``
(``live``); ``eval fidelity --mode`` texts (``fidelity``), bytes, state (``state_bytes``);
``eval generation``.

Adding an evaluation: an ``Evaluation`` subclass (arms, items, measure, report, plot) and
``runner.run``, plus one line in ``MODES``. A knob or quantized storage needs nothing here: an
arm names any ``KVCacheConfig`` field. A metric: a function in ``metrics`` and a column where a
command records it.
"""
