"""The Tutorials section: each ``docs/tutorials/NAME.py`` becomes the page ``tutorials/NAME.md``, executed.

A tutorial is a plain Python script in jupytext's "percent" format, so it also runs as
``python docs/tutorials/NAME.py`` and ruff lints it like any other file::

    # %% [markdown]
    # # A title
    # Prose, as Markdown, each line behind "# ".

    # %%
    print("a code cell")

At build time this hook runs the script cell by cell, in one namespace, in a fresh Python process
(``python docs/_hooks/tutorials.py --run SCRIPT OUTDIR``, in a temporary folder, with matplotlib's
Agg backend, the random generators of ``random``, NumPy and torch seeded with 0, and the Hugging
Face libraries told to stay offline). For each code cell it keeps what the cell printed and every
figure the cell made: the pyplot figures it opened and the ``matplotlib.figure.Figure`` objects it
bound to a name (``attnkit.viz.heatmap`` returns one without pyplot). The page shows the Markdown
cells as written and each code cell as a Python block followed by its output, in a text block, and
its figures, as PNGs beside the page. Output goes into a fence longer than any run of backticks it
holds, so nothing a cell prints can become markup.

A cell that raises fails the build, naming the tutorial, the cell and the error. Standard library
only (the executed script imports what it needs), so the tests can import it without the docs
extra.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Where the tutorials live in ``docs/`` and where their pages go in the site.
SECTION = "tutorials"
SOURCES = ROOT / "docs" / SECTION
#: A tutorial that runs longer than this fails the build.
TIMEOUT_S = 300
MARKER = re.compile(r"^# %%(.*)$")


class TutorialError(Exception):
    """A tutorial that cannot be parsed or whose cell raised (or that ran past the time limit)."""


@dataclass
class Cell:
    """One cell: ``kind`` is ``"markdown"`` or ``"code"``; ``output`` and ``images`` (PNG file names)
    are filled by :func:`execute` for code cells."""

    kind: str
    source: str
    output: str = ""
    images: list[str] = field(default_factory=list)


def parse(text: str) -> list[Cell]:
    """Split a percent-format script into cells; blank cells are dropped.

    ``# %%`` starts a code cell and ``# %% [markdown]`` (or ``[md]``) a Markdown cell, whose lines
    lose their leading ``# `` (a bare ``#`` is a blank line). Text before the first marker is a
    code cell.

    Raises:
        TutorialError: a Markdown cell has a line that is not a comment.
    """
    cells: list[Cell] = []
    kind, lines = "code", []

    def close():
        source = "\n".join(lines).strip("\n")
        if source.strip():
            cells.append(Cell(kind, source))

    for number, line in enumerate(text.splitlines(), 1):
        m = MARKER.match(line)
        if m:
            close()
            kind = "markdown" if re.search(r"\[(markdown|md)\]", m.group(1)) else "code"
            lines = []
        elif kind == "markdown":
            if line.strip() and not (line == "#" or line.startswith("# ")):
                raise TutorialError(f"line {number}: a Markdown cell's lines start with '# ', got {line!r}")
            lines.append(line[2:] if line.startswith("# ") else "")
        else:
            lines.append(line)
    close()
    return cells


def execute(path: Path, outdir: Path) -> list[Cell]:
    """Run the tutorial at ``path`` in a fresh process; its figures are written into ``outdir``.

    Raises:
        TutorialError: a cell raised (the message names the tutorial, the cell and the error), or
            the run took longer than :data:`TIMEOUT_S`.
    """
    path, outdir = Path(path).resolve(), Path(outdir).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MPLBACKEND": "Agg", "ATTNKIT_BUILD": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", str(path), str(outdir)],
                                  cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise TutorialError(f"tutorial {path.name}: ran past {TIMEOUT_S} s") from e
    result = outdir / "result.json"
    if not result.exists():
        raise TutorialError(f"tutorial {path.name}: the runner failed before any cell ran:\n{proc.stderr[-3000:]}")
    data = json.loads(result.read_text(encoding="utf-8"))
    result.unlink()
    if data.get("error"):
        raise TutorialError(f"tutorial {path.name}: cell {data['error']['cell']} raised:\n{data['error']['traceback']}")
    return [Cell(**c) for c in data["cells"]]


def _run(path: Path, outdir: Path) -> int:
    """The child process: execute the cells of ``path`` and write ``outdir/result.json``."""
    import contextlib
    import io
    import random
    import traceback

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    random.seed(0)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(0)
    with contextlib.suppress(ImportError):
        import torch

        torch.manual_seed(0)

    cells = parse(path.read_text(encoding="utf-8"))
    namespace = {"__name__": "__main__", "__file__": str(path)}
    shown: list = []  # the figures already on the page (kept, so that no later figure can reuse an id)
    result: dict = {"cells": [], "error": None}
    for number, cell in enumerate(cells, 1):
        if cell.kind == "code":
            out = io.StringIO()
            try:
                code = compile(cell.source, f"{path.name} (cell {number})", "exec")
                with contextlib.redirect_stdout(out):
                    exec(code, namespace)
            except BaseException:  # noqa: B036 -- SystemExit too: the build reports any cell that stops
                result["error"] = {"cell": number, "traceback": traceback.format_exc(limit=-8)}
                break
            figures = [plt.figure(n) for n in plt.get_fignums()]
            figures += [v for v in namespace.values() if isinstance(v, Figure) and v not in figures]
            for fig in figures:
                if any(fig is f for f in shown):
                    continue
                shown.append(fig)
                name = f"cell{number:02d}-{len(cell.images) + 1}.png"
                fig.savefig(outdir / name, dpi=100, bbox_inches="tight")
                cell.images.append(name)
            plt.close("all")
            cell.output = out.getvalue()
        result["cells"].append(cell.__dict__)
    (outdir / "result.json").write_text(json.dumps(result), encoding="utf-8")
    return 0


def _fence(text: str, lang: str) -> str:
    """``text`` in a fence longer than any run of backticks inside it."""
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def page(name: str, cells: list[Cell]) -> str:
    """The Markdown page of an executed tutorial; its figures are at ``NAME/FILE.png`` beside it."""
    out = [f'!!! info "Made by running [{name}.py]({name}.py)"\n\n'
           f"    This page is the script `docs/{SECTION}/{name}.py`, executed cell by cell when the site "
           f"was built; each output below is what the code above it printed. Run it yourself with "
           f"`python docs/{SECTION}/{name}.py`.\n"]
    # The info box goes under the tutorial's own title, when it starts with one.
    if cells and cells[0].kind == "markdown" and cells[0].source.startswith("# "):
        title, _, rest = cells[0].source.partition("\n")
        out = [title + "\n", *out, rest.strip("\n") + "\n"]
        cells = cells[1:]
    for cell in cells:
        if cell.kind == "markdown":
            out.append(cell.source + "\n")
            continue
        out.append(_fence(cell.source, "python") + "\n")
        if cell.output.strip():
            out.append(_fence(cell.output, "text") + "\n")
        out += [f"![figure {i} of this cell]({name}/{img})\n" for i, img in enumerate(cell.images, 1)]
    return "\n".join(out)


def tutorials() -> list[Path]:
    """Every tutorial script, by name."""
    return sorted(SOURCES.glob("*.py"))


# --- MkDocs hook -------------------------------------------------------------------------------


def on_files(files, config):
    """Execute each tutorial and add its page and figures."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    for script in tutorials():
        name = script.stem
        with tempfile.TemporaryDirectory() as outdir:
            try:
                cells = execute(script, Path(outdir))
            except TutorialError as e:
                raise PluginError(str(e)) from e
            files.append(File.generated(config, f"{SECTION}/{name}.md", content=page(name, cells)))
            for cell in cells:
                for img in cell.images:
                    files.append(File.generated(config, f"{SECTION}/{name}/{img}",
                                                content=(Path(outdir) / img).read_bytes()))
    return files


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--run":
        raise SystemExit("usage: python docs/_hooks/tutorials.py --run SCRIPT OUTDIR")
    sys.exit(_run(Path(sys.argv[2]), Path(sys.argv[3])))
