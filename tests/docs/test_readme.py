"""The README as a new user meets it: every Python block runs as written, every ``attnkit`` command
it shows exists with the flags it shows, it states no figure but the generated headline table,
and nothing in it points at documents users do not have.

Each ```python block runs as its own script in a fresh process and folder, so a block that leans on
a name defined in another block, or on something lying around, fails here. A block that cannot run
on one machine in a test (none today) would be preceded by ``<!-- not-run: reason -->``. The
helpers are shared with ``tests/docs/test_docs.py``, which does the same for the guides under ``docs/``.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests.support.markdown_blocks import ROOT, bash_parses, check_command, commands, fenced, figures, run_python

README = ROOT / "README.md"
TEXT = README.read_text(encoding="utf-8")
PYTHON = [(line, code) for line, code, skip in fenced(TEXT, "python") if not skip]


def _benchmarks_hook():
    spec = importlib.util.spec_from_file_location("docs_hook_benchmarks", ROOT / "docs" / "_hooks" / "benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_readme_has_runnable_python():
    """Guards the extraction: if the fences stopped matching, the test below would check nothing."""
    assert len(PYTHON) >= 3 and len(PYTHON) == len(fenced(TEXT, "python"))


@pytest.mark.parametrize("line, code", PYTHON, ids=[f"README.md:{line}" for line, _ in PYTHON])
def test_python_block_runs_as_written(line, code, tmp_path):
    run_python(code, f"README.md line {line}", tmp_path)


@pytest.mark.parametrize("line, code", [(line, code) for line, code, _ in fenced(TEXT, "bash")],
                         ids=[f"README.md:{line}" for line, _, _ in fenced(TEXT, "bash")])
def test_bash_block_parses(line, code):
    bash_parses(code, f"README.md line {line}")


def test_every_attnkit_command_and_flag_exists():
    shown = commands(TEXT)
    assert any(c.startswith("attnkit demo") for c in shown)  # the set-up command is found
    for cmd in shown:
        check_command(cmd, "README.md")


def test_the_headline_table_is_the_generated_one():
    """The README's figures are cells of bench/results, copied by the generator; after a benchmark is
    rerun, ``python docs/_hooks/benchmarks.py --readme`` refreshes them."""
    bench = _benchmarks_hook()
    assert bench.readme_block() in TEXT, "stale headline table: python docs/_hooks/benchmarks.py --readme"


def test_no_figure_outside_the_headline_table():
    """A timing or a ratio in prose goes stale; the README's only figures are the generated table's."""
    bench = _benchmarks_hook()
    outside = TEXT.split(bench.START)[0] + TEXT.split(bench.END)[-1]
    assert not figures(outside), f"README states {figures(outside)} outside the headline table"


def test_the_readme_points_at_no_internal_documents():
    """Users do not have the articles the project was seeded with; the README says what they claimed."""
    text = re.sub(r"--seed\b", "", TEXT)  # the option that seeds the random generator is not a document
    assert not re.search(r"\bseeds?\b", text, re.I), re.search(r".*\bseeds?\b.*", text, re.I).group(0)
