"""Code blocks of the Markdown a user reads (the README, the guides under ``docs/``), for the tests
that run them: every ```python block as its own script in a fresh process and folder, every
```bash block parsed, every ``attnkit`` command it shows checked against the command line.

A block that cannot run on one machine in a test is preceded by ``<!-- not-run: reason -->``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*\S.*?-->\s*$")


def fenced(text: str, lang: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, marked not-run)`` of each ```lang block of ``text``."""
    found = []
    for m in FENCE.finditer(text):
        if m.group(1) != lang:
            continue
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append((text.count("\n", 0, m.start()) + 1, m.group(2), bool(NOT_RUN.search(before))))
    return found


def run_python(code: str, where: str, tmp_path: Path, timeout: int = 300) -> None:
    """Run ``code`` as a script in ``tmp_path``; fail with its stderr, naming ``where`` it was written."""
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    # ATTNKIT_BUILD=0: a block that reaches the banded kernel uses a cached build or its stated
    # fallback, so the test does not spend a minute compiling it. The block runs on this process's
    # threads (one per xdist worker): more would fight the other workers for the cores.
    import torch

    env = {**os.environ, "ATTNKIT_BUILD": "0", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{where}:\n{code}\n{proc.stderr[-3000:]}"


def bash_parses(code: str, where: str) -> None:
    """Fail unless ``code`` is valid bash."""
    proc = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{where}: {proc.stderr}"


def commands(text: str) -> list[str]:
    """Every ``attnkit ...`` command line in ``text``: in bash blocks and in inline code."""
    lines = [ln for _, code, _ in fenced(text, "bash") for ln in code.splitlines()]
    lines += re.findall(r"`(attnkit [^`]+)`", text)
    found = []
    for ln in lines:
        for part in re.split(r"&&|\|\||;", ln):
            part = part.strip()
            if part.startswith("attnkit "):
                found.append(part)
    return found


def check_command(cmd: str, where: str) -> None:
    """Fail unless ``attnkit CMD`` names a real command and only its real options."""
    from attnkit.cli import build_parsers

    subparsers = build_parsers()[1]
    words = shlex.split(cmd, comments=True)
    name = words[1] if len(words) > 1 else None
    assert name in subparsers, f"{where} shows {cmd!r}: no command {name!r}"
    flags = set(subparsers[name]._option_string_actions)
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", cmd):
        assert flag in flags, f"{where} shows {cmd!r}: 'attnkit {name}' has no option {flag}"


#: Measured figures in prose: a ratio (``1.5x``), a time or a size (``12 ms``, ``900 MiB``), a
#: share (``83%``), a throughput. They belong in ``bench/results/*.md`` and the pages made from it.
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
                    r"(?:x(?![\w])|\s?(?:%|ms\b|s\b|seconds\b|minutes?\b|GFLOP/s|MiB\b|GiB\b|MB\b|GB\b))")


def prose(text: str) -> str:
    """``text`` without its fenced blocks, inline code and HTML comments: what a reader reads as prose."""
    text = FENCE.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def figures(text: str) -> list[str]:
    """Measured figures stated in the prose of ``text`` (see :data:`FIGURE`)."""
    return [m.group(0) for m in FIGURE.finditer(prose(text))]
