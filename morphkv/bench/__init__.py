"""Speed and load: the ``morphkv bench`` commands (modes in ``morphkv.cli.commands.MODES``):
``bench speed --mode`` overhead, kernels, layer; ``bench serve --scenario`` load (+
``load_clients``, ``load_report``), chat, fair, sharing ``servers``. They use ``morphkv.eval``'s
parts (arms, texts, output, plots, process); nothing there imports this.
"""
