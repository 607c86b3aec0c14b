"""The ``morphkv`` command: start-up (``program``: quiet Ctrl-C, OpenBLAS preload via
``blas``), the command table (``commands``) and the commands that are not measurements
(``generate``, ``serve``); shared flags in ``cache_flags`` and ``argtypes``."""

from .commands import main

__all__ = ["main"]
