"""Every `--help` lists the allowed values of its choice options (typer Literal / enum
types), and the lists are the ones the code accepts."""

from __future__ import annotations

import enum
import types
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import typer
from typer.testing import CliRunner

from memlm.cli import app
from memlm.cli.eval_cmd import IndexKind, LambdaMode
from memlm.cli.train_cmd import RUNNERS, Arch, Objective, Tokenizer
from memlm.knnlm.policy import POLICY_NAMES

runner = CliRunner()
WIDE = {"COLUMNS": "250", "NO_COLOR": "1"}


def _commands() -> list[tuple[list[str], Any]]:
    """Every leaf command of the CLI with its argv prefix (typer's own click objects)."""
    out: list[tuple[list[str], Any]] = []

    def walk(cmd: Any, path: list[str]) -> None:
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            out.append((path, cmd))

    walk(typer.main.get_command(app), [])
    return out


def _choices(annotation: Any) -> tuple[str, ...]:
    """The allowed values of a Literal or enum annotation (optional or not); () otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        return _choices(inner[0]) if len(inner) == 1 else ()
    if get_origin(annotation) is Literal:
        return tuple(str(a) for a in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(str(m.value) for m in annotation)
    return ()


def _help(argv: list[str]) -> str:
    res = runner.invoke(app, [*argv, "--help"], env=WIDE)
    assert res.exit_code == 0, res.output
    return res.output


def test_the_literal_types_match_what_the_code_accepts() -> None:
    from memlm.research.transformer_train import OBJECTIVES

    assert get_args(Arch) == tuple(RUNNERS)
    assert get_args(Objective) == OBJECTIVES
    assert set(get_args(Tokenizer)) == {"word", "subword"}
    assert set(get_args(IndexKind)) == {"auto", "flat"}


@pytest.mark.parametrize(
    ("argv", "option", "values"),
    [
        (["train"], "--arch", get_args(Arch)),
        (["train"], "--objective", ("vanilla", "trime", "trime-long", "trime-ext")),
        (["train"], "--tokenizer", ("word", "subword")),
        (["eval"], "--lambda", tuple(m.value for m in LambdaMode)),
        (["eval"], "--index-kind", ("auto", "flat")),
    ],
)
def test_help_lists_the_choices(argv: list[str], option: str, values: tuple[str, ...]) -> None:
    line = next(x for x in _help(argv).splitlines() if f"{option} " in x)
    assert f"<{'|'.join(values)}>" in line or f"[{'|'.join(values)}]" in line, line


def test_eval_help_lists_the_policies() -> None:
    text = " ".join(_help(["eval"]).split())
    assert f"of: {', '.join(POLICY_NAMES)}" in text


def test_every_choice_option_of_every_command_shows_its_values() -> None:
    """Whatever command is added later: a Choice option's values all appear in its help."""
    commands = _commands()
    assert {" ".join(p) for p, _ in commands} >= {"train", "eval", "up", "db upgrade"}
    seen = 0
    for path, cmd in commands:
        for param in cmd.params:
            desc = getattr(param, "type_descriptor", None)
            values = _choices(getattr(desc, "annotation", None))
            if not values or param.hidden:
                continue
            line = next(x for x in _help(path).splitlines() if f"{param.opts[0]} " in x)
            assert f"{'|'.join(values)}" in line, f"{' '.join(path)} {param.opts[0]}: {line}"
            seen += 1
    assert seen == 5  # train --arch --objective --tokenizer, eval --index-kind --lambda


def test_choices_refuse_other_values_before_any_work() -> None:
    res = runner.invoke(app, ["train", "--arch", "gpt5"], env=WIDE)
    assert res.exit_code == 2 and "gpt5" in res.output
    res = runner.invoke(app, ["train", "--arch", "lstm", "--objective", "trime"], env=WIDE)
    assert res.exit_code == 2 and "vanilla only" in " ".join(res.output.split())
    res = runner.invoke(app, ["eval", "--policies", "monim,fullmen"], env=WIDE)
    assert res.exit_code == 2 and "fullmen" in res.output
