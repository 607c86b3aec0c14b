"""``morphkv`` command line: ``morphkv <command> [options]``.

Adding a command is one line in ``COMMANDS``: a name ("bench speed" nests under "bench") and
a module exposing ``add_arguments(parser)`` and either ``run(args) -> int | None`` (the exit
status) or, for a measurement, ``execute(args) -> dict`` (its figures; the exit status is the
dict's ``"exit"``, 0 when absent); the first line of the module's docstring is its help text.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..runtime.program import INTERRUPTED, invoked_as_program

COMMANDS: list[tuple[str, str]] = [
    ("generate", "morphkv.cli.generate"),
    ("serve", "morphkv.cli.serve"),
    ("chat", "morphkv.cli.chat"),
    ("bench mechanism", "morphkv.bench.mechanism"),
    ("bench speed", "morphkv.bench.speed"),
    ("bench layer", "morphkv.bench.layer"),
    ("bench overhead", "morphkv.bench.overhead"),
    ("bench kernels", "morphkv.bench.kernels"),
    ("bench blas", "morphkv.bench.blas"),
    ("bench serve", "morphkv.bench.serve"),
    ("bench chat", "morphkv.bench.chat"),
    ("bench load", "morphkv.bench.load"),
    ("bench fair", "morphkv.bench.fair"),
    ("bench batch", "morphkv.bench.batch_step"),
    ("eval fidelity", "morphkv.eval.fidelity"),
    ("eval generation", "morphkv.eval.generation"),
    ("eval sweep", "morphkv.eval.sweep"),
    ("eval recall", "morphkv.eval.recall"),
    ("eval chatrecall", "morphkv.eval.chat_recall"),
    ("eval quantized", "morphkv.eval.quantized"),
    ("eval bytes", "morphkv.eval.bytes"),
    ("eval blocks", "morphkv.eval.blocks"),
    ("report", "morphkv.eval.report"),
]


# optional dependencies (pyproject's extras): a missing one is one line naming the extra
OPTIONAL_EXTRAS = {"matplotlib": "bench"}


def _help_of(module) -> str:
    """The first sentence of the module docstring, without reST double backticks."""
    paragraph = (module.__doc__ or "").strip().split("\n\n")[0]
    sentence = " ".join(paragraph.split()).split(". ")[0]
    return sentence.rstrip(".").replace("``", "")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless it states it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or action.default in (None, False):
            return text
        if action.default is argparse.SUPPRESS or not action.option_strings or action.nargs == 0:
            return text  # positionals, on/off switches
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with every usage error as one line (and exit status 2)."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


class ListCommands:
    """The ``_run`` of a bare group (``morphkv``, ``morphkv bench``): list its commands, exit 2."""

    def __init__(self, parser: argparse.ArgumentParser, names: list[str]):
        self.parser, self.names = parser, names

    def __call__(self, args) -> int:
        self.parser.print_help(sys.stderr)
        print(f"{self.parser.prog}: error: choose a command: {', '.join(self.names)}",
              file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from ..runtime.program import VERSION as __version__

    parser = Parser(prog="morphkv", description="Constant-size KV caches (MorphKV) for mlx_lm.")
    parser.add_argument("--version", action="version", version=f"morphkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    top_names: list[str] = []
    groups: dict[str, tuple[argparse._SubParsersAction, list[str]]] = {}
    for name, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        help_text = _help_of(module)
        *group, leaf = name.split()
        target = sub
        if group:  # "bench speed": a subcommand of the "bench" group
            if group[0] not in groups:
                p = sub.add_parser(group[0], help=f"{group[0]} commands (list: morphkv "
                                   f"{group[0]} --help)", description=f"morphkv {group[0]} "
                                   "commands.")
                gsub = p.add_subparsers(dest=f"{group[0]}_command", metavar="NAME",
                                        title="commands")
                groups[group[0]] = (gsub, [])
                p.set_defaults(_run=ListCommands(p, groups[group[0]][1]))
                top_names.append(group[0])
            target, names = groups[group[0]]
            names.append(leaf)
        else:
            top_names.append(leaf)
        p = target.add_parser(leaf, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=getattr(module, "run", None) or _measurement(module.execute))
    parser.set_defaults(_run=ListCommands(parser, top_names))
    return parser


def _measurement(execute):
    """``run`` of a measurement command: its figures' ``"exit"`` (0 when absent)."""

    def run(args) -> int:
        return int(execute(args).get("exit", 0))

    return run


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """The ``morphkv`` command. Usage errors: one line, status 2; Ctrl-C: status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # in-process callers; the command itself exits via SIGINT handler
        print("", file=sys.stderr)
        return INTERRUPTED


def _main(argv: list[str] | None) -> int:
    if argv is None and invoked_as_program():
        from ..runtime.blas import ensure_blas_preloaded

        ensure_blas_preloaded()  # re-executes with OpenBLAS on Linux when available
    from ..model.resolve import ModelUnavailableError
    from ..runtime.argtypes import UsageError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = vars(args).pop("_run")(args)  # the Namespace stays plain data (JSON-able)
    except (ModelUnavailableError, UsageError) as e:
        print(f"morphkv: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:  # a command's SystemExit("message"): one line, status 2
        if not isinstance(e.code, str):
            raise
        print(_one_line(SystemExit(e.code)), file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = OPTIONAL_EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"morphkv: error: this command needs {e.name}, an optional dependency: "
              f"pip install 'morphkv[{extra}]' (from a clone: pip install -e '.[{extra}]')",
              file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
