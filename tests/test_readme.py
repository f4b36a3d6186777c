"""The README as a new user meets it: every Python block runs as written, every ``attnkit`` command
it shows exists with the flags it shows, and nothing in it points at documents users do not have.

Each ```python block runs as its own script in a fresh process and folder, so a block that leans on
a name defined in another block, or on something lying around, fails here. A block that cannot run
on one machine in a test (none today) would be preceded by ``<!-- not-run: reason -->``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*\S.*?-->\s*$")


def fenced(lang: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, marked not-run)`` of each ```lang block of the README."""
    found = []
    for m in FENCE.finditer(TEXT):
        if m.group(1) != lang:
            continue
        before = TEXT[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((TEXT.count("\n", 0, m.start()) + 1, m.group(2), bool(NOT_RUN.search(before))))
    return found


PYTHON = [(line, code) for line, code, skip in fenced("python") if not skip]


def test_the_readme_has_runnable_python():
    """Guards the extraction: if the fences stopped matching, the test below would check nothing."""
    assert len(PYTHON) >= 5 and len(PYTHON) == len(fenced("python"))


@pytest.mark.parametrize("line, code", PYTHON, ids=[f"README.md:{line}" for line, _ in PYTHON])
def test_python_block_runs_as_written(line, code, tmp_path):
    script = tmp_path / f"readme_{line}.py"
    script.write_text(code, encoding="utf-8")
    # ATTNKIT_BUILD=0: a block that reaches the banded kernel uses a cached build or its stated
    # fallback, so the test does not spend a minute compiling it.
    env = {**os.environ, "ATTNKIT_BUILD": "0", "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README.md line {line}:\n{code}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("line, code", [(line, code) for line, code, _ in fenced("bash")],
                         ids=[f"README.md:{line}" for line, _, _ in fenced("bash")])
def test_bash_block_parses(line, code):
    proc = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"README.md line {line}: {proc.stderr}"


def _commands() -> list[str]:
    """Every ``attnkit ...`` command line in the README: in bash blocks and in inline code."""
    lines = [ln for _, code, _ in fenced("bash") for ln in code.splitlines()]
    lines += re.findall(r"`(attnkit [^`]+)`", TEXT)
    found = []
    for ln in lines:
        for part in re.split(r"&&|\|\||;", ln):
            part = part.strip()
            if part.startswith("attnkit"):
                found.append(part)
    return found


def test_every_attnkit_command_and_flag_exists():
    commands = _commands()
    assert any(c.startswith("attnkit demo") for c in commands)  # the set-up command is found
    subparsers = build_parser()._subparsers._group_actions[0].choices
    for cmd in commands:
        words = shlex.split(cmd, comments=True)
        name = words[1] if len(words) > 1 else None
        assert name in subparsers, f"README shows {cmd!r}: no command {name!r}"
        flags = set(subparsers[name]._option_string_actions)
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", cmd):
            assert flag in flags, f"README shows {cmd!r}: 'attnkit {name}' has no option {flag}"


def test_the_readme_points_at_no_internal_documents():
    """Users do not have the articles the project was seeded with; the README says what they claimed."""
    text = re.sub(r"--seed\b", "", TEXT)  # the option that seeds the random generator is not a document
    assert not re.search(r"\bseeds?\b", text, re.I), re.search(r".*\bseeds?\b.*", text, re.I).group(0)
