"""The command line: useful --help everywhere, one-line errors with a non-zero exit, no tracebacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attnkit.cli import COMMANDS, build_parser, main

AVAILABLE = [c for c in COMMANDS if c in build_parser()._subparsers._group_actions[0].choices]


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "usage: attnkit" in text
    for cmd in AVAILABLE:
        assert cmd in text


@pytest.mark.parametrize("cmd", AVAILABLE)
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: attnkit {cmd}" in out and "options:" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    assert "usage: attnkit" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["bench", "nosuch"], "invalid choice: 'nosuch'"),
    (["bench", "core", "--repeat", "3"], "unrecognized arguments: --repeat 3"),
])
def test_usage_mistakes_are_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_console_script_has_no_traceback_for_user_mistakes():
    proc = subprocess.run([sys.executable, "-m", "attnkit", "bench", "nosuch"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
