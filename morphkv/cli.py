"""``morphkv`` command line: ``morphkv <command> [options]``.

Adding a command is one line in ``COMMANDS``: a name and a module exposing
``add_arguments(parser)`` and ``run(args) -> int | None``; the first line of the module's
docstring is its help text.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

COMMANDS: list[tuple[str, str]] = [
    ("generate", "morphkv.generate"),
]


def _help_of(module) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="morphkv", description="Constant-size KV caches (MorphKV) for mlx_lm."
    )
    parser.add_argument("--version", action="version", version=f"morphkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        help_text = _help_of(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _invoked_as_program() -> bool:
    """True when this process is ``morphkv ...`` or ``python -m morphkv ...``."""
    p = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return p.stem == "morphkv" or (p.name == "__main__.py" and p.parent.name == "morphkv")


def main(argv: list[str] | None = None) -> int:
    if argv is None and _invoked_as_program():
        from .blas import ensure_blas_preloaded

        ensure_blas_preloaded()  # re-executes with OpenBLAS on Linux when available
    from .model.resolve import ModelUnavailableError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args._run(args)
    except ModelUnavailableError as e:
        print(f"morphkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
