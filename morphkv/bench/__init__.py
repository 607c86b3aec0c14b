"""Speed and load: the ``morphkv bench`` commands.

``bench speed`` (``--mode``: ``overhead`` (time and memory per context), ``kernels``),
``bench serve`` (``--scenario``: ``load`` (+ ``load_clients``,
``load_mixed``, ``load_report``), ``chat``, ``fair``; every scenario's servers and client
calls: ``servers``); the modes are listed in
``morphkv.cli.commands.MODES``. Every measurement ends in ``morphkv.eval.output.finish``.
They share ``morphkv.eval``'s parts (arms, texts, util, plots); nothing there imports this
package.
"""
