"""``morphkv`` command line: ``morphkv <command> [options]``.

Adding a command is one line in ``COMMANDS``: a name ("bench speed" nests under "bench") and
a module exposing
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
    ("bench mechanism", "morphkv.bench.mechanism"),
    ("bench speed", "morphkv.bench.speed"),
    ("eval fidelity", "morphkv.bench.fidelity"),
    ("eval generation", "morphkv.bench.generation"),
    ("eval recall", "morphkv.bench.recall"),
    ("report", "morphkv.bench.report"),
]


def _help_of(module) -> str:
    """The first sentence of the module docstring."""
    paragraph = (module.__doc__ or "").strip().split("\n\n")[0]
    sentence = " ".join(paragraph.split()).split(". ")[0]
    return sentence.rstrip(".")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="morphkv", description="Constant-size KV caches (MorphKV) for mlx_lm."
    )
    parser.add_argument("--version", action="version", version=f"morphkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        help_text = _help_of(module)
        *group, leaf = name.split()
        target = sub
        if group:  # "bench speed": a subcommand of the "bench" group
            if group[0] not in groups:
                p = sub.add_parser(group[0], help=f"{group[0]} commands")
                groups[group[0]] = p.add_subparsers(dest=f"{group[0]}_command", metavar="NAME")
                groups[group[0]].required = True
            target = groups[group[0]]
        p = target.add_parser(leaf, help=help_text, description=help_text)
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
        rc = vars(args).pop("_run")(args)  # the Namespace stays plain data (JSON-able)
    except ModelUnavailableError as e:
        print(f"morphkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
