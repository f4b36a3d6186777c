"""One query's scores taken apart by dimension: keys x dimensions, with each row's sum beside it.

Built on :func:`attnkit.analysis.score_terms`, with ``matplotlib.figure.Figure`` and the Agg canvas
as :mod:`attnkit.viz.heatmap` is (no ``pyplot``, nothing global changes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..analysis.terms import score_terms
from .heatmap import _check_tokens, _ticks

#: Diverging, centred at 0: red terms raise the score, blue ones lower it.
CMAP = "RdBu_r"
POSITIVE, NEGATIVE = "#b2182b", "#2166ac"


def score_terms_figure(q, k, *, query: int, key: int | None = None, scale: float | None = None,
                       q_tokens: Sequence[str] | None = None, k_tokens: Sequence[str] | None = None,
                       title: str | None = None) -> Figure:
    """Heat map of one query's score terms, keys down the side and head dimensions across, and
    each key's score (the row's sum) as a bar beside it.

    Args:
        q: ``[Lq, D]`` queries of one head (e.g. ``q[b, h]``), tensor or array.
        k: ``[Lk, D]`` keys of the same head.
        query: the query position whose scores are taken apart.
        key: a key position to look at closely: its row is outlined and a bar chart under the map
            shows its ``D`` terms, positive in red and negative in blue.
        scale: factor on ``q . k`` (default ``1 / sqrt(D)``, as :func:`attnkit.attention`).
        q_tokens: ``Lq`` query labels, for the title (default: positions).
        k_tokens: ``Lk`` key labels (default: ``q_tokens`` when ``Lq == Lk``, else positions).
        title: figure title (default names the query, and the key when given).

    Returns:
        A matplotlib ``Figure`` (save it with :func:`attnkit.viz.save`). The colour scale is
        symmetric about 0 (``RdBu_r``), so a term's colour says its sign; the bars are the scores
        before softmax, the sums of the rows.

    Raises:
        ValueError: ``q`` or ``k`` not two-dimensional, their head sizes differ, ``query`` or
            ``key`` out of range, or ``q_tokens`` / ``k_tokens`` of the wrong length.
    """
    q, k = (torch.as_tensor(x).detach().to("cpu", torch.float64) for x in (q, k))
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be [L, D] for one head, got shape {tuple(t.shape)}")
    terms = score_terms(q, k, scale=scale, query=query).numpy()  # (Lk, D)
    lk, d = terms.shape
    if key is not None and not -lk <= key < lk:
        raise ValueError(f"key must be in [{-lk}, {lk}) for k with {lk} keys, got {key}")
    if k_tokens is None and q.shape[0] == lk:
        k_tokens = q_tokens
    q_tokens = _check_tokens(q_tokens, q.shape[0], "q_tokens")
    k_tokens = _check_tokens(k_tokens, lk, "k_tokens")
    scores = terms.sum(-1)
    vmax = max(float(np.abs(terms).max()) if terms.size else 0.0, 1e-12)
    rows = 2 if key is not None else 1
    fig = Figure(figsize=(min(14.0, 3.5 + 0.16 * d), min(16.0, 2.0 + 0.2 * lk + 2.2 * (rows - 1))),
                 dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows, 2, width_ratios=[4, 1], height_ratios=[max(lk, 4), 6][:rows])
    ax = fig.add_subplot(grid[0, 0])
    im = ax.imshow(terms, cmap=CMAP, vmin=-vmax, vmax=vmax, interpolation="nearest", aspect="auto")
    fontsize = max(5.0, min(9.0, 360.0 / max(lk, 1)))
    _ticks(ax, lk, k_tokens, "y", fontsize)
    ax.set_xlabel("head dimension d")
    ax.set_ylabel("key j")
    bars = fig.add_subplot(grid[0, 1], sharey=ax)
    bars.barh(np.arange(lk), scores, color=np.where(scores >= 0, POSITIVE, NEGATIVE), height=0.8)
    bars.axvline(0.0, color="black", linewidth=0.6)
    bars.set_xlabel("score (row sum)")
    bars.tick_params(axis="y", labelleft=False)
    fig.colorbar(im, ax=[ax, bars], shrink=0.8, label="term q[i,d] k[j,d] scale", location="right")
    who = f"query {q_tokens[query] if q_tokens else query % q.shape[0]}"
    if key is not None:
        ax.add_patch(Rectangle((-0.5, key % lk - 0.5), d, 1, fill=False, edgecolor="black", linewidth=1.5))
        one = fig.add_subplot(grid[1, :])
        t = terms[key]
        one.bar(np.arange(d), t, color=np.where(t >= 0, POSITIVE, NEGATIVE))
        one.axhline(0.0, color="black", linewidth=0.6)
        one.set_xlim(-0.5, d - 0.5)
        one.set_xlabel("head dimension d")
        one.set_ylabel("term")
        label = k_tokens[key] if k_tokens else str(key % lk)
        one.set_title(f"key {label}: score {scores[key]:.3g} = positive terms {t[t > 0].sum():.3g} "
                      f"+ negative terms ({t[t < 0].sum():.3g})", fontsize=9)
        who += f", key {label}"
    fig.suptitle(title or f"score terms of {who}", fontsize=10)
    return fig

