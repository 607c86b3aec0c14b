"""Quality evaluation: the ``morphkv eval`` commands (modes in ``morphkv.cli.commands.MODES``)
and the parts every measurement shares.

Shared parts: ``output`` (result folder, machine facts, JSON, tables), ``flags``, ``progress``,
``models``, ``process``, ``arms`` (a spec -> ``KVCacheConfig`` or an mlx_lm cache; ``cells``:
``--arms`` labels ``spec[+pinN][@N]``), ``metrics``, ``texts``, ``plots``, ``runner`` (THE
shared runner: arms x items x models -> JSON + PNG + a table), ``asking`` (a chat prefilled
once, each question from a copy), ``forced`` (teacher-forced feeding). ``eval recall --data``:
chats and said (``chat_recall``, ``chat_items``, ``chat_report``, ``chat_answers``,
``choose_said``), longchat (``recall``,
``recall_items``; its report is ``chat_report``'s), answers,
``--live`` (``live``); ``eval fidelity --mode`` texts (``fidelity``), bytes and state
(``bytes``); ``eval generation``. A new evaluation: an ``Evaluation`` (arms, items, measure,
report, plot) run by ``runner.run``, and one line in ``MODES``; an arm names any
``KVCacheConfig`` field, so a new knob needs nothing here.
"""
