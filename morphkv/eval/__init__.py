"""Quality evaluation: the ``morphkv eval`` commands (modes in ``morphkv.cli.commands.MODES``)
and the parts every measurement shares. A new evaluation is an ``Evaluation`` (arms, items,
measure, report, plot) run by ``runner.run`` and one line in ``MODES``; an arm names any
``KVCacheConfig`` field, so a new knob needs nothing here.
"""
