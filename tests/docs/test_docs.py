"""The documentation under ``docs/`` as a reader meets it: every Python block of every guide runs as
written, every ``attnkit`` command it shows exists with the flags it shows, no guide states a
measured figure (those live in ``bench/results/*.md`` and the Benchmarks pages made from them),
and every public name has the docstring its API page shows.

``.ci/run`` also builds the site with ``mkdocs build --strict`` (broken links, missing
references, any warning fail it); these tests need no docs tools, so the README's test command
runs them.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests.support.markdown_blocks import ROOT, bash_parses, check_command, commands, fenced, figures, run_python

DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "_hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _blocks(lang: str):
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for line, code, skip in fenced(text, lang):
            found.append((f"{page.relative_to(ROOT)}:{line}", code, skip))
    return found


PYTHON = [(where, code) for where, code, skip in _blocks("python") if not skip]


def test_the_guides_have_runnable_python():
    """Guards the extraction: if the fences stopped matching, the test below would check nothing."""
    assert len(PAGES) >= 15 and len(PYTHON) >= 15


@pytest.mark.parametrize("where, code", PYTHON, ids=[where for where, _ in PYTHON])
def test_python_block_runs_as_written(where, code, tmp_path):
    run_python(code, where, tmp_path)


def test_the_masks_guide_checks_the_articles_three_tips():
    """-1e9, cudnn.benchmark and del attn: each named in the tips section and checked by its block."""
    text = (DOCS / "guides" / "masks.md").read_text(encoding="utf-8")
    section = text[text.index("## Three tips from tutorials, checked"):text.index("## What is refused")]
    blocks = [code for _, code, skip in fenced(section, "python") if not skip]
    assert len(blocks) == 1
    for tip in ("-1e9", "cudnn.benchmark", "del attn"):
        assert tip in section.split("```python")[0] and tip in blocks[0], tip
    assert blocks[0].count("assert") >= 8


@pytest.mark.parametrize("where, code", [(w, c) for w, c, _ in _blocks("bash")],
                         ids=[w for w, _, _ in _blocks("bash")])
def test_bash_block_parses(where, code):
    bash_parses(code, where)


def test_every_attnkit_command_and_flag_exists():
    shown = [(page, cmd) for page in PAGES for cmd in commands(page.read_text(encoding="utf-8"))]
    assert any(cmd.startswith("attnkit lab") for _, cmd in shown)  # the extraction finds commands
    for page, cmd in shown:
        check_command(cmd, str(page.relative_to(ROOT)))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_no_measured_figure_in_prose(page):
    """Timings and ratios go stale in prose; the guides link the table that has them instead."""
    found = figures(page.read_text(encoding="utf-8"))
    assert not found, f"{page.relative_to(ROOT)} states {found}: link the bench/results table instead"


def test_every_public_name_has_a_docstring():
    api = _hook("api")
    assert not api.missing_docstrings(), "public names without a docstring: " + ", ".join(api.missing_docstrings())
    assert not api.unlisted_modules()


def test_every_benchmark_table_says_how_it_was_made():
    """A results file without its command and machine line would fail the docs build: say so here first."""
    bench = _hook("benchmarks")
    names = [s.name for s in bench.suites()]
    assert {"core", "blockwise"} <= set(names)
    for h in bench.HEADLINES:
        assert bench.cell(h)


def test_the_guides_link_pages_that_exist():
    """Relative links between hand-written pages resolve; links into the generated sections (Benchmarks,
    API reference, the tutorials made from their scripts) are checked by ``mkdocs build --strict`` in CI."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s:]+\.(?:md|png))(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            resolved = (page.parent / target).resolve()
            if resolved.is_relative_to(DOCS / "benchmarks") or resolved.is_relative_to(DOCS / "api"):
                continue
            if resolved.is_relative_to(DOCS / "tutorials") and resolved.with_suffix(".py").exists():
                continue  # a tutorial page is made from its script at build time
            assert resolved.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
