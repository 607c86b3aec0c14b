"""Every ``morphkv ...`` command quoted in README.md and docs/*.md is one the CLI accepts.

Nothing is run: each command's arguments go through ``build_parser().parse_args(argv)`` (the
``morphkv`` command's own argparse parser), and each ``python -m morphkv.x.y`` names a module
that exists (``importlib.util.find_spec``).

What counts as a quoted command (the rule):

* Where: inline code spans (single backticks, which may wrap over lines of one paragraph) and
  the lines of fenced blocks whose info string is ``bash``, ``sh``, ``shell``, ``console``,
  ``text`` or empty. Other fences (``python``, ...) are skipped. In fenced blocks ``#`` starts
  a comment and a trailing ``\\`` joins the next line.
* Which part: the snippet is split with ``shlex`` at shell operators (``|``, ``&&``, ``;``,
  redirections, whose file name is dropped); in each piece leading ``NAME=value`` assignments
  are dropped, and the command is the piece from a ``morphkv`` word that starts it or follows a
  launcher's ``--`` (``mlx.launch ... -- morphkv generate``), or a ``python``/``python3 -m
  morphkv...`` piece.
* Skipped, as not being a concrete command:
  - a bare ``morphkv`` (the program's name), and words such as ``morphkv.pin``;
  - placeholders: any word that is or holds ``...`` (``--prompt "..."``, ``--arms "..."``), or
    starts with ``[`` (a synopsis: ``[--model PATH]``), or holds ``<`` / ``>`` (``<model>``);
  - program output: a line whose word after ``morphkv`` ends with ``:`` (``morphkv serve: ...``);
  - a table of command names in a fenced block: ``morphkv <words>`` followed by two or more
    spaces and a description that does not start with ``-`` (README's command table); only its
    command words are checked.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from morphkv.cli.commands import MOVED

REPO = Path(__file__).resolve().parents[1]
FENCES = {"bash", "sh", "shell", "console", "text", ""}
OPERATORS = {"|", "||", "&&", ";", "&", ";;"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", "<<<"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
TABLE_ROW = re.compile(r"^(morphkv(?: [a-z][a-z_-]*)+) {2,}(?![-#])\S")


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def snippets(text: str) -> list[tuple[int, str, bool]]:
    """(line number, snippet, from a fenced block) for every code snippet of a Markdown text."""
    found, prose, fence, joined, start = [], [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = stripped[3:].strip().lower()
            prose.append("")
            continue
        if fence is not None:
            if stripped.startswith("```"):
                fence = None
            elif fence in FENCES:
                if not joined:
                    start = number
                if stripped.endswith("\\"):
                    joined += stripped[:-1] + " "
                    continue
                found.append((start, joined + stripped, True))
                joined = ""
            prose.append("")
            continue
        prose.append(line)
    # inline code spans: within one paragraph (no blank line inside a span)
    body = "\n".join(prose)
    for match in re.finditer(r"`([^`]+)`", body):
        span = match.group(1)
        if "\n\n" in span or "morphkv" not in span:
            continue
        found.append((body.count("\n", 0, match.start()) + 1, " ".join(span.split()), False))
    return found


def commands(snippet: str, fenced: bool) -> list[list[str]]:
    """The argv lists (first word ``morphkv`` or ``-m``) in one snippet, placeholders dropped."""
    if fenced:
        row = TABLE_ROW.match(snippet)
        if row:  # a table of command names: check the command words only
            snippet = row.group(1)
    lexer = shlex.shlex(snippet, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#" if fenced else ""
    try:
        words = list(lexer)
    except ValueError as error:  # an unclosed quote: a problem only where a command is quoted
        return [["!shlex", str(error)]] if re.search(r"\bmorphkv\s", snippet) else []
    pieces, piece, skip_next = [], [], False
    for i, word in enumerate(words):
        if skip_next:
            skip_next = False
        elif word in OPERATORS:
            pieces.append(piece)
            piece = []
        elif word in REDIRECTS:
            skip_next = True  # the file name
            if piece and piece[-1].isdigit() and i > 0:  # 2> file: the descriptor too
                piece.pop()
        else:
            piece.append(word)
    pieces.append(piece)
    found = []
    for piece in pieces:
        while piece and ENV.match(piece[0]):
            piece = piece[1:]
        if "--" in piece and piece[piece.index("--") + 1:][:1] == ["morphkv"]:
            piece = piece[piece.index("--") + 1:]  # mlx.launch ... -- morphkv ...
        if piece[:1] in (["python"], ["python3"]) and piece[1:2] == ["-m"]:
            if len(piece) > 2 and piece[2].startswith("morphkv"):
                found.append(["-m", piece[2]])
            continue
        if piece[:1] != ["morphkv"] or len(piece) == 1 or piece[1].endswith(":"):
            continue
        argv = piece[1:]
        if any("..." in w or w.startswith("[") or "<" in w or ">" in w for w in argv):
            continue
        found.append(argv)
    return found


def quoted_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in documents():
        for number, snippet, fenced in snippets(path.read_text()):
            for argv in commands(snippet, fenced):
                out.append((f"{path.relative_to(REPO)}:{number}: {snippet}", argv))
    return out


def rejection(argv: list[str], parser) -> str | None:
    """None when the CLI accepts ``argv``, else why not."""
    if argv[0] == "!shlex":
        return f"shlex: {argv[1]}"
    if argv[0] == "-m":
        return None if importlib.util.find_spec(argv[1]) else f"no module {argv[1]}"
    if " ".join(argv[:2]) in MOVED:  # accepted for one release, but not to be quoted
        return f"an old name: use morphkv {MOVED[' '.join(argv[:2])]}"
    try:
        parser.parse_args(argv)
    except SystemExit as stop:
        return None if stop.code == 0 else f"argparse exit {stop.code}"
    return None


@pytest.fixture(scope="module")
def parser():
    from morphkv.cli.commands import build_parser

    return build_parser()


QUOTED = quoted_commands()


def test_the_docs_quote_commands():
    assert len(QUOTED) > 50
    assert any(argv[:4] == ["bench", "speed", "--mode", "overhead"] for _, argv in QUOTED)
    assert any(argv[0] == "-m" for _, argv in QUOTED)


def test_every_quoted_command_parses(parser, capsys):
    bad = []
    for where, argv in QUOTED:
        why = rejection(argv, parser)
        if why:
            err = capsys.readouterr().err.strip().splitlines()
            bad.append(f"{where}\n    -> {why}: {err[-1] if err else ''}")
    assert not bad, "commands in the docs the CLI rejects:\n" + "\n".join(bad)


def test_a_bad_quoted_command_is_caught(parser, capsys):
    text = ("Run `morphkv generate --no-such-flag 3` or\n\n```bash\n"
            "OPENBLAS_NUM_THREADS=1 morphkv bench speed --mode overhead --contexts 1024 \\\n"
            "  --bogus\n"
            "python -m morphkv.no_such_module\n```\n")
    found = [argv for _, s, fenced in snippets(text) for argv in commands(s, fenced)]
    assert found == [["bench", "speed", "--mode", "overhead", "--contexts", "1024", "--bogus"],
                     ["-m", "morphkv.no_such_module"], ["generate", "--no-such-flag", "3"]]
    assert all(rejection(argv, parser) for argv in found)
    capsys.readouterr()


def test_the_skip_rule():
    text = ("```text\nmorphkv chat       a conversation in the terminal\n"
            "morphkv eval ...   chatrecall, fidelity\nmorphkv serve: KV memory bound\n```\n"
            "`morphkv` and `morphkv.pin`, `morphkv generate --prompt \"...\"`,\n"
            "`morphkv generate [--model PATH]`,\n"
            "`printf 'x\\n' | morphkv chat > out.txt 2> err.txt`\n")
    found = [argv for _, s, fenced in snippets(text) for argv in commands(s, fenced)]
    assert found == [["chat"], ["chat"]]
