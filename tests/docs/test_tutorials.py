"""The tutorials under ``docs/tutorials/*.py``: each one is a percent-format script with prose and code
that runs as written, and the docs hook that executes them (``docs/_hooks/tutorials.py``) splits
cells as documented and fails loudly, naming the tutorial and the cell, when a cell raises.

The build itself (``mkdocs build --strict``, in ``.ci/run``) executes every tutorial again, cell by
cell, and puts its outputs and figures on its page.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support.markdown_blocks import ROOT, run_python

HOOK = ROOT / "docs" / "_hooks" / "tutorials.py"


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
def test_tutorial_has_prose_and_code_and_runs_as_a_script(script, tmp_path):
    cells = tutorials.parse(script.read_text(encoding="utf-8"))
    kinds = [c.kind for c in cells]
    assert "markdown" in kinds and "code" in kinds, f"{script.name}: cells {kinds}"
    assert cells[0].kind == "markdown" and cells[0].source.startswith("# "), "a tutorial opens with its title"
    run_python(script.read_text(encoding="utf-8"), str(script.relative_to(ROOT)), tmp_path, timeout=120)


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
