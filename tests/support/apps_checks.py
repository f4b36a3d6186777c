"""Checks every application's tests make the same way: its report holds its pictures, a seed fixes its weights."""

from __future__ import annotations

import base64
from pathlib import Path
from unittest import mock

from matplotlib.figure import Figure

from attnkit.apps import _common
from attnkit.viz.report import write_report


def report_embeds_pictures(result: _common.Result, out: Path) -> list[str]:
    """Assert the result's PNGs lie in ``out`` and ``report.html`` embeds each; return their names."""
    pngs = [p for s in result.sections for p in s.images]
    page = write_report(out / "report.html", result.task, result.sections).read_text()
    for p in pngs:
        assert p.parent == out and base64.b64encode(p.read_bytes()).decode() in page
    return [p.name for p in pngs]


def _png_signature(figure, fname, *args, **kwargs) -> None:
    """What ``Figure.savefig`` writes in :func:`same_seed_same_checkpoint`: a PNG's signature only."""
    if hasattr(fname, "write"):
        fname.write(b"\x89PNG\r\n\x1a\n")
    else:
        Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n")


def same_seed_same_checkpoint(task, tmp_path: Path) -> None:
    """Assert two quick runs with one seed write the same weights (and loss), and another seed does not.

    The runs make their figures but do not render them (``Figure.savefig`` writes only a PNG
    signature): rendering draws no random number and touches no weight, and it was most of these
    three runs' time (lm's: about three quarters). Each application's report test checks its real
    pictures (:func:`report_embeds_pictures`).
    """
    with mock.patch.object(Figure, "savefig", _png_signature):
        runs = [task.run(out=tmp_path / name, steps=5, seed=seed, quick=True, progress=False)
                for name, seed in (("a", 3), ("b", 3), ("c", 4))]
    weights = [(tmp_path / name / _common.WEIGHTS).read_bytes() for name in "abc"]
    assert weights[0] == weights[1] and runs[0].metrics["final_loss"] == runs[1].metrics["final_loss"]
    assert weights[0] != weights[2]
