"""``morphkv`` command line: ``morphkv <command> [options]``.

Adding a command is one line in ``COMMANDS``: a name ("bench speed" nests under "bench") and
a module (or ``module:Class``: ``command_of``) exposing ``add_arguments(parser)`` and either
``run(args) -> int | None`` (the exit status) or, for a measurement, ``execute(args) -> dict``
(its figures; the exit status is the dict's ``"exit"``, 0 when absent) or, for an evaluation of
the shared runner, ``EVALUATION`` (a ``morphkv.eval.runner.Evaluation`` class; ``module:Class``
may name one itself); the first line of the module's docstring is its help text.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from ..runtime.program import INTERRUPTED, invoked_as_program

COMMANDS: list[tuple[str, str]] = [
    ("generate", "morphkv.cli.generate"),
    ("serve", "morphkv.cli.serve"),
    ("chat", "morphkv.cli.chat"),
    ("bench speed", "morphkv.bench.overhead"),
    ("bench serve", "morphkv.bench.load"),
    ("eval recall", "morphkv.eval.chat_recall"),
    ("eval fidelity", "morphkv.eval.fidelity"),
    ("eval generation", "morphkv.eval.generation"),
]

# a command with modes: its mode option and, per mode, the module that measures it (the
# first is the default: the module named in COMMANDS); each mode keeps its own options
MODES: dict[str, tuple[str, str, dict[str, str]]] = {
    "eval recall": ("--data", "Does a bounded cache remember what was said: recall per arm", {
        "chats": "morphkv.eval.chat_recall",  # facts said in chats, asked at the end
        "said": "morphkv.eval.chat_recall:Said",  # names the model invented and user facts
        "answers": "morphkv.eval.answers",  # identifiers re-used in long answers the model wrote
        "longchat": "morphkv.eval.recall",  # one fact early in a long chat
    }),
    "eval fidelity": ("--mode", "KL and NLL to the full cache on texts, per arm and budget", {
        "texts": "morphkv.eval.fidelity",
        "bytes": "morphkv.eval.bytes",
        "state": "morphkv.eval.bytes:State",  # bytes a slot: K/V and selection state, per rule
    }),
    "bench speed": ("--mode", "Speed and memory in the model, kernels per step, vs mlx_lm's "
                    "caches", {
        "overhead": "morphkv.bench.overhead",
        "kernels": "morphkv.bench.kernels",
        "layer": "morphkv.bench.layer",  # one layer's update alone, the seed's API included
    }),
    "bench serve": ("--scenario", "morphkv serve against mlx_lm's server: throughput under "
                    "load, faults, fairness, long chats", {
        "load": "morphkv.bench.load",
        "chat": "morphkv.bench.chat",
        "fair": "morphkv.bench.fair",
    }),
}

# old names (one release): one line naming the new command line, exit status 2, nothing run
MOVED: dict[str, str] = {
    "eval chatrecall": "eval recall",
    "eval sweep": "eval fidelity --split tune",
    "eval bytes": "eval fidelity --mode bytes",
    "bench overhead": "bench speed --mode overhead",
    "bench kernels": "bench speed --mode kernels",
    "bench load": "bench serve --scenario load",
    "bench chat": "bench serve --scenario chat",
    "bench fair": "bench serve --scenario fair",
}


# optional dependencies (pyproject's extras): a missing one is one line naming the extra
OPTIONAL_EXTRAS = {"matplotlib": "bench"}


def command_of(name: str):
    """The module ``name`` names, or with ``module:Attr`` that module's attribute (a class
    with the same contract: several modes in one file)."""
    module, _, attr = name.partition(":")
    module = importlib.import_module(module)
    return getattr(module, attr) if attr else module


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
    """argparse, with every usage error as one line (and exit status 2). A command with modes
    (``MODES``) hands its arguments to the parser of the mode they name (``modes``)."""

    modes: tuple[str, dict[str, argparse.ArgumentParser]] | None = None

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")

    def _mode_parser(self, args: list[str]) -> argparse.ArgumentParser:
        option, parsers = self.modes
        mode = next(iter(parsers))
        for i, word in enumerate(args):
            if word == "--":
                break
            if word == option and i + 1 < len(args):
                mode = args[i + 1]
            elif word.startswith(option + "="):
                mode = word.split("=", 1)[1]
        return parsers.get(mode, parsers[next(iter(parsers))])  # an unknown one: its error

    def parse_known_args(self, args=None, namespace=None):
        if self.modes is None:
            return super().parse_known_args(args, namespace)
        args = list(sys.argv[1:] if args is None else args)
        return self._mode_parser(args).parse_known_args(args, namespace)

    def format_help(self):
        return super().format_help() if self.modes is None else self._mode_parser([]).format_help()


class Moved(Parser):
    """An old command name: takes any arguments; its ``_run`` names the new command line."""

    def __init__(self, *a, new: str = "", **kw):
        super().__init__(*a, **kw)
        self.new = new

    def parse_known_args(self, args=None, namespace=None):
        words = " ".join(shlex.quote(w) for w in (sys.argv[1:] if args is None else args))
        line = f"{self.prog}: renamed: run `morphkv {self.new}{' ' + words if words else ''}`"

        def run(_args) -> int:
            print(line, file=sys.stderr)
            return 2

        return argparse.Namespace(_run=run), []


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
        module = command_of(module_name)
        help_text = MODES[name][1] if name in MODES else _help_of(module)
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
        if name in MODES:
            _add_modes(p, MODES[name][0], MODES[name][2])
        else:
            _add_command(p, module)
    for name, new in MOVED.items():
        group, leaf = name.split()
        gsub = groups[group][0]
        gsub._name_parser_map[leaf] = Moved(prog=f"morphkv {name}", new=new)
    parser.set_defaults(_run=ListCommands(parser, top_names))
    return parser


def _add_command(p: argparse.ArgumentParser, module) -> None:
    module.add_arguments(p)
    if hasattr(module, "run") or hasattr(module, "execute"):
        p.set_defaults(_run=getattr(module, "run", None) or _measurement(module.execute))
        return
    from ..eval.runner import run as evaluate

    evaluation = getattr(module, "EVALUATION", module)  # a module's, or the class named
    p.set_defaults(_run=_measurement(lambda args: evaluate(evaluation(args))))


def _add_modes(p: Parser, option: str, modes: dict[str, str]) -> None:
    """One parser per mode, each with the mode option and that mode's module's options."""
    listed = ", ".join(modes)
    parsers = {}
    for mode, module_name in modes.items():
        module = command_of(module_name)
        child = Parser(prog=p.prog, description=f"{option} {mode}: {_help_of(module)}.")
        child.add_argument(option, choices=list(modes), default=next(iter(modes)),
                           help=f"what to measure: {listed}; each has its own options "
                           f"({p.prog} {option} NAME --help) (default: {next(iter(modes))})")
        _add_command(child, module)
        parsers[mode] = child
    p.modes = (option, parsers)


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
