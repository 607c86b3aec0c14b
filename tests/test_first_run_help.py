"""``--help`` as a newcomer reads it: every flag explained with its default and range; groups
list their commands; no raw reST markup."""

from __future__ import annotations

import argparse

import pytest

from morphkv.cli.commands import COMMANDS, build_parser, main
from morphkv.runtime.argtypes import Number


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _options(parser):
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def test_every_generate_flag_has_help_with_default_and_range():
    parser = _subparser(build_parser(), "generate")
    text = parser.format_help()
    for action in _options(parser):
        assert action.help and len(action.help) > 10, action.option_strings
        if action.nargs == 0 or action.dest == "help":
            continue  # switches: on when given
        shown = parser._get_formatter()._expand_help(action)
        assert "default" in shown.lower(), (action.option_strings, shown)
        if isinstance(action.type, Number):  # every number states its range
            assert action.type.describe() in shown, (action.option_strings, shown)
    for flag in ("--method", "--fusion", "--scoring", "--budget", "--window", "--sinks"):
        assert flag in text


def test_top_level_flags_have_help():
    parser = build_parser()
    for action in _options(parser):
        assert action.help, action.option_strings
    text = parser.format_help()
    for name in {n.split()[0] for n, _ in COMMANDS}:
        assert name in text


@pytest.mark.parametrize("group", sorted({n.split()[0] for n, _ in COMMANDS if " " in n}))
def test_a_bare_group_lists_its_commands(capsys, group):
    rc = main([group])
    err = capsys.readouterr().err
    assert rc == 2
    for name, _ in COMMANDS:
        if name.startswith(group + " "):
            assert name.split()[1] in err, err
    assert f"morphkv {group}: error: choose a command" in err


def test_bare_morphkv_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "generate" in err and "choose a command" in err


def test_no_raw_double_backticks_in_any_help():
    parser = build_parser()
    texts = [parser.format_help()]
    for name, _ in COMMANDS:
        texts.append(_subparser(parser, *name.split()).format_help())
    for text in texts:
        assert "``" not in text, text
