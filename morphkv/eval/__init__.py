"""Quality evaluation: the ``morphkv eval`` commands (modes in ``morphkv.cli.commands.MODES``)
and the parts every measurement shares (``output``, ``flags``, ``progress``, ``models``,
``process``, ``arms``, ``metrics``, ``texts``, ``plots``, ``asking``, ``forced``).

A new evaluation is an ``Evaluation`` (arms, items, measure, report, plot) run by
``runner.run``, and one line in ``MODES``; an arm names any ``KVCacheConfig`` field, so a new
knob needs nothing here.
"""
