"""Measured figures live in the benchmark tables (``bench/results/*.md``), not in attnkit's docstrings and
comments, where they go stale and come to contradict each other and the tables. A docstring states the
contract, the complexity and what fails, and points to the table (``attnkit bench ...``)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "attnkit"

#: A timing or a throughput: "3 ms", "0.7 ms", "20 us", "1.5 s", "103 GFLOP/s", "4.3x faster".
FIGURE = re.compile(r"\b\d[\d,.]*\s?(?:ms|us|µs|ns)\b|\b\d[\d,.]*\s(?:s|seconds?|minutes?)\b(?![\w(])"
                    r"|\b\d[\d,.]*\s?[GT]FLOP/s|\b\d[\d,.]*\s?x (?:faster|slower)\b")


def figures(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each figure in the docstrings and comments of one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            doc = first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            if isinstance(doc, str):
                found += [(first.lineno, m.group(0)) for m in FIGURE.finditer(doc)]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found += [(tok.start[0], m.group(0)) for m in FIGURE.finditer(tok.string)]
    return found


def test_the_pattern_finds_the_figures_it_is_for_and_not_others():
    source = ('"""Takes 3 ms at n = 8192, 0.7 ms per head, 103 GFLOP/s; 4.3x faster."""\n'
              "x = 1  # 20 us when warm, 1.5 s cold\n"
              "def f():\n"
              "    \"\"\"O(n) in 2 passes, n = 64 rows, p - 2s keys, % of the GFLOP/s anchor, 1 << 20 cells.\"\"\"\n")
    assert [text for _, text in figures(source)] == ["3 ms", "0.7 ms", "103 GFLOP/s", "4.3x faster", "20 us", "1.5 s"]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_measured_figure_in_a_docstring_or_comment(path):
    found = figures(path.read_text(encoding="utf-8"))
    assert not found, (f"{path.relative_to(PACKAGE.parent)}: measured figures in prose {found}; move them to the "
                       "benchmark table (bench/results/*.md) and point to it")
