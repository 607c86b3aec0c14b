"""Speed and load: the ``morphkv bench`` commands.

``speed`` (+ ``length``), ``layer``, ``overhead``, ``blas``, ``mechanism`` (synthetic
retention), ``chat`` (a long conversation through ``morphkv.chat``), ``serve`` and ``load``
(+ ``load_clients``, ``load_report``: the server against mlx_lm's under load and faults).
They share ``morphkv.eval``'s parts (arms, texts, util, plots); nothing there imports this
package.
"""
