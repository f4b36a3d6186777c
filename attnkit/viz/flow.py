"""A data-flow diagram: labelled boxes on a grid, joined by arrows.

For pictures such as "X -> Q, K, V -> scores -> softmax -> ...", with each box's text (a tensor's
shape, say) supplied by the caller, ideally read off a real call. Built with
``matplotlib.figure.Figure`` and the Agg canvas, as :mod:`attnkit.viz.heatmap` is (no ``pyplot``,
nothing global changes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Box colours by kind: a tensor that flows, an operation applied to it.
COLOURS = {"tensor": "#dbe7f3", "op": "#f6e3c6"}


def flow_diagram(boxes: Mapping[str, tuple[str, tuple[float, float]] | tuple[str, tuple[float, float], str]],
                 arrows: Sequence[tuple[str, str] | tuple[str, str, str]], *, title: str | None = None,
                 cell: tuple[float, float] = (2.6, 0.9)) -> Figure:
    """Boxes with text at grid positions, and arrows between them.

    Args:
        boxes: name -> ``(text, (column, row))`` or ``(text, (column, row), kind)``: the text drawn
            in the box (several lines allowed), its place (row 0 at the top; fractions are fine) and
            its kind, ``"tensor"`` (default) or ``"op"`` (:data:`COLOURS`).
        arrows: ``(from, to)`` or ``(from, to, label)`` by box name, drawn from box edge to box edge;
            one that skips rows down a column (a residual connection) passes to the right of the
            boxes between.
        title: the figure's title.
        cell: inches per grid column and per grid row.

    Returns:
        A matplotlib ``Figure`` (save it with :func:`attnkit.viz.save`).

    Raises:
        ValueError: no boxes, two boxes at one place, a kind that is not in :data:`COLOURS`, or an
            arrow naming a box that does not exist.
    """
    if not boxes:
        raise ValueError("boxes must name at least one box, got none")
    placed: dict[str, tuple[str, tuple[float, float], str]] = {}
    taken: dict[tuple[float, float], str] = {}
    for name, spec in boxes.items():
        text, (col, row), *rest = spec
        kind = rest[0] if rest else "tensor"
        if kind not in COLOURS:
            raise ValueError(f"box {name!r}: kind must be one of {sorted(COLOURS)}, got {kind!r}")
        if (col, row) in taken:
            raise ValueError(f"boxes {taken[col, row]!r} and {name!r} are both at (column, row) = {(col, row)}")
        taken[col, row] = name
        placed[name] = (text, (float(col), float(row)), kind)
    for arrow in arrows:
        unknown = [end for end in arrow[:2] if end not in placed]
        if unknown:
            raise ValueError(f"arrow {tuple(arrow[:2])} names {unknown[0]!r}, which is not a box; boxes: "
                             f"{', '.join(placed)}")
    def skips(arrow) -> bool:  # down one column past boxes in between: a residual connection
        (x0, y0), (x1, y1) = placed[arrow[0]][1], placed[arrow[1]][1]
        return x0 == x1 and abs(y1 - y0) > 1

    lane = 0.6 if any(skips(a) for a in arrows) else 0.0  # room on the right for the bends
    cols = [c for _, (c, _), _ in placed.values()]
    rows = [r for _, (_, r), _ in placed.values()]
    width, height = (max(cols) - min(cols) + 1 + lane) * cell[0], (max(rows) - min(rows) + 1) * cell[1]
    top = 0.4 if title else 0.0
    fig = Figure(figsize=(width, height + top))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, height / (height + top)))
    ax.set_xlim(min(cols) - 0.5, max(cols) + 0.5 + lane)
    ax.set_ylim(max(rows) + 0.5, min(rows) - 0.5)
    ax.axis("off")
    patches = {}
    for name, (text, (col, row), kind) in placed.items():
        patches[name] = ax.text(col, row, text, ha="center", va="center", fontsize=9, family="monospace",
                                bbox={"boxstyle": "round,pad=0.4", "facecolor": COLOURS[kind], "edgecolor": "#555555"})
    fig.canvas.draw()  # lays the boxes out, so that a bend can pass to the right of them
    to_data = ax.transData.inverted()

    def right_edge(name) -> float:
        extent = patches[name].get_bbox_patch().get_window_extent()
        return float(to_data.transform((extent.x1, extent.y0))[0])

    style = {"arrowstyle": "-|>", "mutation_scale": 12, "color": "#333333", "linewidth": 1.0}
    for arrow in arrows:
        start, end = (patches[n] for n in arrow[:2])
        (x0, y0), (x1, y1) = placed[arrow[0]][1], placed[arrow[1]][1]
        if skips(arrow):
            # Out of the right side of the first box, down past every box of the column, into the last.
            column = [n for n, (_, (c, r), _) in placed.items() if c == x0 and min(y0, y1) <= r <= max(y0, y1)]
            out = max(right_edge(n) for n in column) + 0.12 * lane
            ax.plot([right_edge(arrow[0]), out, out], [y0, y0, y1], color=style["color"], linewidth=1.0, zorder=4)
            ax.annotate("", xy=(right_edge(arrow[1]), y1), xytext=(out, y1), zorder=4,
                        arrowprops={**style, "shrinkA": 0, "shrinkB": 1})
            where = (out, (y0 + y1) / 2)
        else:
            ax.annotate("", xy=end.get_position(), xytext=start.get_position(), zorder=4,
                        arrowprops={**style, "patchA": start.get_bbox_patch(), "patchB": end.get_bbox_patch(),
                                    "shrinkA": 1, "shrinkB": 1})
            where = ((x0 + x1) / 2, (y0 + y1) / 2)
        if len(arrow) > 2:
            ax.text(*where, f" {arrow[2]} ", ha="center", va="center", fontsize=8, style="italic", zorder=5,
                    color="#333333", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
