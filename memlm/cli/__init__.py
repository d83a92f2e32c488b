"""The `memlm` command line: one typer app; each area registers its commands."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="memlm",
    help="Continual-learning kNN-LM datastore with the MoNIM memorisation policy.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

# Each module defines `register(app)`; imports stay light (heavy imports inside commands).
_COMMAND_MODULES = [
    "memlm.cli.corpus_cmd",
    "memlm.cli.eval_cmd",
    "memlm.cli.compare_cmd",
    "memlm.cli.train_cmd",
    "memlm.cli.service_cmd",
    "memlm.cli.client_cmd",
    "memlm.cli.memory_cmd",
    "memlm.cli.backup_cmd",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()
