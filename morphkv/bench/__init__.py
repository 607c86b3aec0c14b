"""Speed and load: the ``morphkv bench`` commands (modes in ``morphkv.cli.commands.MODES``),
on ``morphkv.eval``'s parts (runner, arms, texts, plots, process); nothing there imports this.
"""
