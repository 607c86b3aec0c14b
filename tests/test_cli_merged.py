"""One command per question (issue 44): every mode of a merged command parses with its own
options, and every old name prints the new command line and exits 2 without running anything."""

from __future__ import annotations

import pytest

from morphkv.cli.commands import COMMANDS, MODES, MOVED, build_parser, command_of, main


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_at_most_ten_measuring_commands():
    measuring = [n for n, _ in COMMANDS if n.split()[0] in ("eval", "bench")]
    assert len(measuring) <= 10, measuring
    assert not set(MOVED) & {n for n, _ in COMMANDS}


@pytest.mark.parametrize("name,mode", [(n, m) for n, (_, _, ms) in MODES.items() for m in ms])
def test_every_mode_parses_with_its_own_module(parser, name, mode):
    option, _, modes = MODES[name]
    args = parser.parse_args([*name.split(), option, mode])
    assert getattr(args, option.lstrip("-")) == mode
    runner = args._run  # the mode's module's run, its execute wrapped, or its evaluation's
    module = command_of(modes[mode])
    own, wrapped = getattr(module, "run", None), runner.__closure__ and \
        runner.__closure__[0].cell_contents
    if own is None and not hasattr(module, "execute"):  # run by the shared runner
        evaluation = getattr(module, "EVALUATION", module)
        assert evaluation in [c.cell_contents for c in wrapped.__closure__]
    else:
        assert runner is own or (own is None and wrapped is module.execute)


def test_the_default_mode_is_the_first(parser):
    for name, (option, _, modes) in MODES.items():
        args = parser.parse_args(name.split())
        assert getattr(args, option.lstrip("-")) == next(iter(modes))


def test_a_mode_keeps_its_options_and_rejects_the_others(parser, capsys):
    assert parser.parse_args(["bench", "speed", "--mode", "kernels", "--rows", "4"]).rows == 4
    assert parser.parse_args(["eval", "recall", "--data=said", "--chats", "2"]).chats == 2
    with pytest.raises(SystemExit) as stop:  # --rows is bench speed --mode kernels', not length's
        parser.parse_args(["bench", "speed", "--rows", "4"])
    assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["bench", "serve", "--scenario", "nope"])
    assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_mode_help_lists_the_modes(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["eval", "fidelity", "--mode", "bytes", "--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "--mode bytes:" in out
    assert all(m in out for m in MODES["eval fidelity"][2])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_names_the_new_command_and_exits_2(old, capsys, monkeypatch):
    def ran(*a, **kw):
        raise AssertionError("an old name ran something")

    import morphkv.eval.models as models

    monkeypatch.setattr(models, "load_model", ran)
    assert main([*old.split(), "--quick", "--out", "x y"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out, captured
    assert f"`morphkv {MOVED[old]} --quick --out 'x y'`" in lines[0]
    new = MOVED[old].split()
    assert callable(build_parser().parse_args(new)._run)  # the named command exists


def test_every_command_module_follows_the_contract():
    """add_arguments, and run(args), execute(args) or an evaluation of the shared runner (a
    module's EVALUATION, or the class named); its help is the docstring's first line."""
    from morphkv.eval import runner

    modules = [m for _, m in COMMANDS] + [m for _, _, ms in MODES.values() for m in ms.values()]
    for name in dict.fromkeys(modules):
        module = command_of(name)
        assert callable(module.add_arguments), name
        evaluation = getattr(module, "EVALUATION", module)
        assert callable(getattr(module, "run", None) or getattr(module, "execute", None)) or (
            isinstance(evaluation, type) and issubclass(evaluation, runner.Evaluation)), name
        assert getattr(module, "run", None) is not runner.run, name  # not the shared runner's
        assert (module.__doc__ or "").strip().splitlines()[0], name


def test_missing_matplotlib_is_one_line_before_any_work(tmp_path, monkeypatch):
    import argparse
    import sys

    from morphkv.eval import fidelity, runner

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    parser = argparse.ArgumentParser()
    fidelity.add_arguments(parser)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench\]'"):
        runner.run(fidelity.Fidelity(parser.parse_args(["--quick", "--out", str(tmp_path)])),
                   model=object())
    assert not any(tmp_path.iterdir())


def test_cli_lists_the_bench_commands(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in ("speed", "serve"):
        assert name in out
