"""``attnkit.viz.flow_diagram``: boxes where they are asked for, an arrow per pair, residual arrows
that pass beside the boxes they skip, and refusals that name the box at fault."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from attnkit import viz

BOXES = {"x": ("X\n[2, 5, 12]", (0, 0)), "a": ("attention", (0, 1), "op"), "n": ("sum", (0, 2), "op"),
         "side": ("V", (1, 1))}


def _texts(fig):
    ax = fig.axes[0]
    return {t.get_text(): t for t in ax.texts}, [c for c in ax.get_children() if isinstance(c, Annotation)]


def test_boxes_sit_where_asked_with_their_kind_and_one_arrow_per_pair():
    fig = viz.flow_diagram(BOXES, [("x", "a"), ("a", "n"), ("x", "side", "to V"), ("x", "n", "residual")],
                           title="t")
    assert isinstance(fig, Figure) and fig.get_suptitle() == "t"
    texts, arrows = _texts(fig)
    for text, (col, row), *kind in BOXES.values():
        assert texts[text].get_position() == (col, row)
        assert texts[text].get_bbox_patch().get_facecolor()[:3] == pytest.approx(
            tuple(int(viz.flow.COLOURS[kind[0] if kind else "tensor"][i:i + 2], 16) / 255 for i in (1, 3, 5)))
    assert len(arrows) == 4 and {" to V ", " residual "} <= set(texts)
    # The residual arrow (x -> n, skipping a) runs right of the box it skips, not through it.
    residual = arrows[-1]
    right_of_a = texts["attention"].get_bbox_patch().get_window_extent().x1
    fig.canvas.draw()
    assert fig.axes[0].transData.transform(residual.xyann)[0] > right_of_a


@pytest.mark.parametrize("boxes, arrows, message", [
    ({}, [], "at least one box"),
    ({"a": ("A", (0, 0)), "b": ("B", (0, 0))}, [], r"boxes 'a' and 'b' are both at \(column, row\) = \(0, 0\)"),
    ({"a": ("A", (0, 0), "layer")}, [], r"box 'a': kind must be one of \['op', 'tensor'\], got 'layer'"),
    ({"a": ("A", (0, 0))}, [("a", "b")], r"arrow \('a', 'b'\) names 'b', which is not a box; boxes: a"),
])
def test_bad_boxes_and_arrows_are_refused_naming_them(boxes, arrows, message):
    with pytest.raises(ValueError, match=message):
        viz.flow_diagram(boxes, arrows)
