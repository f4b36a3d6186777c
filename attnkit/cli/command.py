"""The ``attnkit`` command: the parser, :func:`main`, and what the subcommands share (argument types,
:class:`UserError`, :func:`prepare_out`). Each subcommand lives in its own module beside this one with
two functions: ``add_parser(subparsers)`` and ``run(args) -> int``.

User mistakes (bad arguments, missing files, missing optional packages) print one line on stderr
and exit non-zero; ``--debug`` shows the traceback instead. A command raises :class:`UserError` for them,
turning the ``ValueError`` of a validating function it calls into one where it calls it; any other
exception is a bug of attnkit's and shows its traceback.

Building the parser imports no torch: a mistyped argument is answered without waiting for torch to
import (the slowest part of starting), so each command imports its heavy parts inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ["demo", "viz", "complexity", "bench", "lab", "train"]


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (exit 2), not usage plus error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def int_at_least(minimum: int, note: str = "") -> Callable[[str], int]:
    """argparse type: an integer from ``minimum``; ``note`` says why, in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum}{note}, got {value}")
        return value
    return parse


#: A layer or head number; ``--steps`` and other counts.
index = int_at_least(0, " (layers and heads count from 0)")
positive_int = int_at_least(1)


def prepare_out(out: Path) -> None:
    """Create the ``--out`` folder, or raise :class:`UserError` saying in one line why it cannot be
    (not the user's own, writable by others, a dangling link: :func:`attnkit._io.own_folder`)."""
    from .._io import own_folder

    try:
        own_folder(out, "--out")
    except ValueError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"--out {out}: cannot create this folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: this folder is not writable")


class LazyChoices:
    """argparse ``choices`` computed by ``values()`` only when a value is checked or help is shown,
    so that listing them does not import their module (and torch with it) while the parser is built."""

    def __init__(self, values: Callable[[], Iterable[str]]) -> None:
        self._values = values

    def __contains__(self, value) -> bool:
        return value in self._values()

    def __iter__(self):
        return iter(self._values())


class _Commands:
    """What each subcommand module's ``add_parser`` is given: argparse's subparsers, with the parser made for
    each command kept by name (argparse keeps them only in private attributes)."""

    def __init__(self, subparsers) -> None:
        self._subparsers = subparsers
        self.parsers: dict[str, argparse.ArgumentParser] = {}

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        self.parsers[name] = self._subparsers.add_parser(name, **kwargs)
        return self.parsers[name]


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``attnkit`` parser, and each command's own parser by name."""
    parser = _Parser(
        prog="attnkit",
        description="Self-attention that is correct, fast and inspectable.",
        epilog="Run 'attnkit COMMAND --help' for a command's options.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version())
    commands = _Commands(parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser))
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}").add_parser(commands)
    return parser, commands.parsers


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parsers()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, so the hint names 'attnkit COMMAND --help'
        commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130
    # Only what the user can fix: a UserError (raised where a command checks what it was given) or the file
    # system's answer (a full disk, a permission). Any other error is attnkit's own and shows its traceback.
    except (UserError, OSError) as e:
        if args.debug:
            raise
        print(f"attnkit {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if isinstance(e, UserError) else f"{type(e).__name__}: {msg}"


def _version() -> str:
    from .. import __version__

    return f"attnkit {__version__}"

