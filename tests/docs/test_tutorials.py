"""The tutorials under ``docs/tutorials/*.py``: each one is a percent-format script that parses into
cells, opens with its title and has prose and code, each code cell compiling on its own; and the docs
hook that executes them (``docs/_hooks/tutorials.py``) splits cells as documented, puts each tutorial's
outputs and figures on its page, and fails loudly, naming the tutorial and the cell, when a cell raises.

Running the tutorials is the docs build's job: ``.ci/run`` builds the site with ``mkdocs build
--strict``, whose hook executes every tutorial cell by cell and fails on the first cell that raises
(checked below: CI runs that build, with that hook). Running them here as well would spend their
whole running time twice in every CI run. ``ATTNKIT_RUN_TUTORIALS=1`` runs each one here too, as a
plain script (``python docs/tutorials/NAME.py``), for a developer who runs only pytest
(docs/contributing/tests.md).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import types

import pytest

from tests.support.markdown_blocks import ROOT, run_python

HOOK = ROOT / "docs" / "_hooks" / "tutorials.py"
RUN_TUTORIALS = os.environ.get("ATTNKIT_RUN_TUTORIALS") == "1"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_hook_tutorials", HOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


tutorials = _hook()
SCRIPTS = tutorials.tutorials()


def test_there_are_tutorials():
    """Guards the glob: with no script found, the tests below would check nothing."""
    assert any(p.name == "attention_by_hand.py" for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_tutorial_has_a_title_prose_and_code_cells_that_compile(script):
    text = script.read_text(encoding="utf-8")
    cells = tutorials.parse(text)
    kinds = [c.kind for c in cells]
    assert "markdown" in kinds and "code" in kinds, f"{script.name}: cells {kinds}"
    assert cells[0].kind == "markdown" and cells[0].source.startswith("# "), "a tutorial opens with its title"
    # The hook compiles and runs each code cell on its own: a statement split across cells fails the
    # build, so it fails here first, in a second rather than at the end of the docs build.
    for number, cell in enumerate(cells, 1):
        if cell.kind == "code":
            compile(cell.source, f"{script.name} (cell {number})", "exec")
    compile(text, script.name, "exec")


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_the_last_code_cell_asserts_what_the_closing_text_states(script):
    """A tutorial's closing text states what its run found. The last code cell checks those figures
    with ``assert``, so the page cannot state a finding its run did not give: the docs build runs
    the asserts, and a cell that raises fails the build."""
    code = [c for c in tutorials.parse(script.read_text(encoding="utf-8")) if c.kind == "code"]
    asserts = [n for n in ast.walk(ast.parse(code[-1].source)) if isinstance(n, ast.Assert)]
    assert asserts, f"{script.name}: the last code cell asserts nothing"


def test_the_first_tutorial_draws_one_attention_call_and_one_transformer_layer():
    """The first tutorial of the nav holds the two data-flow diagrams, drawn by code from a real call."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    first = re.search(r"^\s+- [^:]+: tutorials/(\w+)\.md$", nav, re.M).group(1)
    assert first == "attention_by_hand"
    text = (tutorials.SOURCES / f"{first}.py").read_text(encoding="utf-8")
    assert text.count("viz.flow_diagram(") == 2
    assert "register_forward_hook" in text and "project_qkv(x, x, x)" in text  # shapes from real calls


@pytest.mark.skipif(not RUN_TUTORIALS, reason="the docs build (mkdocs build --strict, in .ci/run) executes "
                                              "the tutorials; ATTNKIT_RUN_TUTORIALS=1 runs them here too")
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_tutorial_runs_as_a_script(script, tmp_path):
    run_python(script.read_text(encoding="utf-8"), str(script.relative_to(ROOT)), tmp_path, timeout=120)


def test_ci_builds_the_site_strictly_and_the_build_executes_the_tutorials():
    """What lets pytest leave the running to the docs build: CI builds the site strictly, after the
    tests and with ``set -e``, and the build's hooks include the one that executes the tutorials."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "set -euo pipefail" in commands
    assert any(re.search(r"(^|\s)mkdocs build --strict(\s|$)", c) for c in commands), "CI no longer builds the docs"
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    hooks = re.search(r"^hooks:\n((?:[ \t]+- .*\n)+)", config, re.M)
    assert hooks and "- docs/_hooks/tutorials.py" in hooks.group(1), "the docs build no longer runs the tutorials"


def test_parse_splits_markdown_and_code_and_strips_the_comment_marks():
    text = ("import os\n"
            "\n"
            "# %% [markdown]\n"
            "# # Title\n"
            "#\n"
            "# Some *prose*.\n"
            "\n"
            "# %%\n"
            "x = 1  # a comment stays\n"
            "# a comment line in code stays too\n"
            "print(x)\n"
            "# %% [md]\n"
            "# more prose\n"
            "# %%\n"
            "\n"
            "# %%\n"
            "y = 2\n")
    cells = tutorials.parse(text)
    assert [(c.kind, c.source) for c in cells] == [
        ("code", "import os"),
        ("markdown", "# Title\n\nSome *prose*."),
        ("code", "x = 1  # a comment stays\n# a comment line in code stays too\nprint(x)"),
        ("markdown", "more prose"),
        ("code", "y = 2"),
    ]


def test_parse_refuses_a_markdown_line_that_is_not_a_comment():
    with pytest.raises(tutorials.TutorialError, match="line 3"):
        tutorials.parse("# %% [markdown]\n# fine\nnot a comment\n")


def test_execute_captures_output_and_figures_per_cell(tmp_path):
    script = tmp_path / "small.py"
    script.write_text("# %% [markdown]\n# # Small\n"
                      "# %%\nimport matplotlib.pyplot as plt\nprint('a <b> & ```')\n"
                      "# %%\nfig = plt.figure()\nplt.plot([0, 1])\n"
                      "# %%\nprint('no new figure', fig is not None)\n", encoding="utf-8")
    cells = tutorials.execute(script, tmp_path / "out")
    assert [c.output for c in cells] == ["", "a <b> & ```\n", "", "no new figure True\n"]
    assert [c.images for c in cells] == [[], [], ["cell03-1.png"], []]
    assert (tmp_path / "out" / "cell03-1.png").read_bytes().startswith(b"\x89PNG")
    page = tutorials.page("small", cells)
    # The output goes into a text fence longer than the backticks it prints, so it stays text.
    assert "````text\na <b> & ```\n````" in page
    assert "![figure 1 of this cell](small/cell03-1.png)" in page


def test_a_failing_cell_fails_naming_the_tutorial_and_the_cell(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("# %% [markdown]\n# # Broken\n# %%\nx = 1\n# %%\nraise ValueError('boom')\n", encoding="utf-8")
    with pytest.raises(tutorials.TutorialError, match=r"tutorial broken\.py: cell 3 raised") as e:
        tutorials.execute(script, tmp_path / "out")
    assert "ValueError: boom" in str(e.value)


@pytest.fixture
def fake_mkdocs(monkeypatch):
    """The two MkDocs names the hook's ``on_files`` uses, so that it runs without the docs extra (the
    README's test command does not install it): ``PluginError`` and ``File.generated``."""
    class PluginError(Exception):
        pass

    class File:
        @staticmethod
        def generated(config, src_uri, *, content):
            return src_uri, content

    modules = {"mkdocs": types.ModuleType("mkdocs"),
               "mkdocs.exceptions": types.ModuleType("mkdocs.exceptions"),
               "mkdocs.structure": types.ModuleType("mkdocs.structure"),
               "mkdocs.structure.files": types.ModuleType("mkdocs.structure.files")}
    modules["mkdocs.exceptions"].PluginError = PluginError
    modules["mkdocs.structure.files"].File = File
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(PluginError=PluginError)


def test_the_build_executes_every_tutorial_and_a_raising_cell_fails_it_by_name(monkeypatch, fake_mkdocs):
    """``on_files``, what ``mkdocs build`` calls: it executes every tutorial of ``docs/tutorials/`` and adds
    each one's page and figures, and a cell that raises stops the build with the error that
    :func:`execute` gives (which names the tutorial and the cell: the two tests above run it for real)."""
    ran = []

    def execute(path, outdir):
        ran.append(path)
        if path == SCRIPTS[-1] and fail:
            raise tutorials.TutorialError(f"tutorial {path.name}: cell 3 raised:\nValueError: boom")
        (outdir / "cell02-1.png").write_bytes(b"\x89PNG " + path.name.encode())
        return [tutorials.Cell("markdown", f"# {path.stem}"),
                tutorials.Cell("code", "print(1)", output="1\n", images=["cell02-1.png"])]

    monkeypatch.setattr(tutorials, "execute", execute)
    fail = False
    files = dict(tutorials.on_files([], config=None))
    assert ran == SCRIPTS
    for script in SCRIPTS:
        page = files[f"tutorials/{script.stem}.md"]
        assert page.startswith(f"# {script.stem}\n") and "```text\n1\n```" in page
        assert "![figure 1 of this cell](" + script.stem + "/cell02-1.png)" in page
        assert files[f"tutorials/{script.stem}/cell02-1.png"] == b"\x89PNG " + script.name.encode()
    assert len(files) == 2 * len(SCRIPTS)

    fail, ran[:] = True, []
    with pytest.raises(fake_mkdocs.PluginError, match=rf"tutorial {re.escape(SCRIPTS[-1].name)}: cell 3 raised") as e:
        tutorials.on_files([], config=None)
    assert "ValueError: boom" in str(e.value)
    assert ran == SCRIPTS
