"""``python -m cramswarm <command>``: one command per workflow stage.

Each Snakemake rule runs exactly one of these commands, so every stage also runs (and is tested) outside
Snakemake. Structured settings (a config section) are passed as JSON strings, e.g.
``--recipe "$(python -m cramswarm show-config config/config.yaml --key pretrain)"``.

This module is only the dispatcher. Each command is declared, with its arguments, beside its handler in a light
command module of the stage it belongs to (:data:`COMMAND_MODULES`); those modules import nothing heavy at
module level, so ``--help`` and the report commands never wait for torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

# Imported in this order; the order is the order of ``--help``.
COMMAND_MODULES = (
    "cramswarm.commands",
    "cramswarm.data.commands",
    "cramswarm.glue.commands",
    "cramswarm.swarm.commands",
    "cramswarm.testbed.commands",
    "cramswarm.swarm_study.commands",
    "cramswarm.preflight.commands",
    "cramswarm.report.commands",
)


@dataclass(frozen=True)
class Argument:
    """One ``add_argument`` call: its flags and keywords."""

    flags: tuple[str, ...]
    options: dict = field(default_factory=dict)


def arg(*flags: str, **options) -> Argument:
    return Argument(flags, options)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    handler: Callable[[argparse.Namespace], int]
    arguments: tuple[Argument, ...]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, *arguments: Argument):
    """Register ``handler`` as ``python -m cramswarm <name>`` with these arguments."""

    def register(handler):
        if name in COMMANDS:
            raise ValueError(f"command {name!r} is declared twice")
        COMMANDS[name] = Command(name, help, handler, arguments)
        return handler

    return register


def json_arg(text: str):
    """argparse type of the structured settings: a JSON string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text[:80]!r}") from None


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def report(path: str | None, payload: dict) -> None:
    """Print a stage's counts as one JSON line (and its warnings on stderr); also write them to ``path``."""
    from cramswarm.io import write_json

    print(json.dumps(payload, sort_keys=True))
    for warning in payload.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    if path:
        write_json(path, payload)


def load_commands() -> dict[str, Command]:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    return COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cramswarm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in load_commands().values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for argument in cmd.arguments:
            p.add_argument(*argument.flags, **argument.options)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cramswarm.config import ConfigError

    try:
        return COMMANDS[args.command].handler(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"cramswarm {args.command}: error: {err}", file=sys.stderr)
        return 2
