"""Static attention pictures with matplotlib: one head, a grid of heads, per-head statistics.

Figures are built with ``matplotlib.figure.Figure`` and the Agg canvas directly, never through
``pyplot``: nothing global changes, no GUI backend is touched, and it works on a headless server.
Masked cells (mask ``False``) are drawn in a separate colour, hatched when cells are large enough
to see the hatching, so "masked" never looks like "weight 0". Beyond :data:`MAX_CELLS` tokens a side
the weights are max-pooled, as the viewer's matrix view is: at 512 tokens a cell would be a fraction
of a pixel and a strong, narrow pattern (a diagonal, one key column) would vanish when drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PatchCollection
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .._io import atomic_write
from ..analysis.heads import entropy, mean_distance

CMAP = "Blues"
MASKED_COLOR = "#f2b880"  # outside the blue colormap, so masked cells never read as low weight
#: Up to this many tokens every token is labelled; beyond it every k-th is.
ALL_LABELS_UP_TO = 64
#: Most cells drawn along an axis; longer axes are max-pooled to this (the title says so).
MAX_CELLS = 128


def _np(x, name: str, ndim: int) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {a.shape}")
    return a


def _cmap() -> Colormap:
    from matplotlib import colormaps

    return colormaps[CMAP].with_extremes(bad=MASKED_COLOR)


def _check_tokens(tokens: Sequence[str] | None, n: int, name: str) -> list[str] | None:
    if tokens is None:
        return None
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name} has {len(tokens)} tokens but the weights have {n} along that axis")
    return tokens


def _pool(w: np.ndarray, mask: np.ndarray | None, max_cells: int = MAX_CELLS):
    """Max-pool ``[Lq, Lk]`` weights to at most ``max_cells`` a side.

    Returns:
        ``(weights, mask, (sq, sk))``: a pooled cell holds the largest weight of its ``sq x sk``
        block and may attend when any cell of the block may; ``(1, 1)`` when nothing was pooled.
    """
    lq, lk = w.shape
    sq, sk = max(1, math.ceil(lq / max_cells)), max(1, math.ceil(lk / max_cells))
    if sq == sk == 1:
        return w, mask, (1, 1)
    nq, nk = math.ceil(lq / sq), math.ceil(lk / sk)

    def blocks(a: np.ndarray, fill) -> np.ndarray:
        a = np.pad(a, ((0, nq * sq - lq), (0, nk * sk - lk)), constant_values=fill)
        return a.reshape(nq, sq, nk, sk)

    pooled = blocks(w, -np.inf).max(axis=(1, 3))
    return pooled, None if mask is None else blocks(mask, False).any(axis=(1, 3)), (sq, sk)


def _pooled_note(stride: tuple[int, int]) -> str:
    return f"max-pooled: each cell is the largest weight of {stride[0]} x {stride[1]} tokens"


def _ticks(ax, n: int, tokens: list[str] | None, axis: str, fontsize: float, stride: int = 1) -> None:
    """Label ``n`` cells, each ``stride`` tokens wide, by the first token they cover."""
    step = 1 if n <= ALL_LABELS_UP_TO else math.ceil(n / 32)
    idx = list(range(0, n, step))
    pos = [i * stride for i in idx]
    if tokens is None:
        labels = [str(p) for p in pos]
    elif step == 1 and stride == 1:
        labels = [tokens[p] for p in pos]
    else:
        labels = [f"{p}:{tokens[p]}" for p in pos]
    if axis == "x":
        ax.set_xticks(idx, labels, rotation=90, fontsize=fontsize)
    else:
        ax.set_yticks(idx, labels, fontsize=fontsize)


def _draw(ax, w: np.ndarray, mask: np.ndarray | None, vmax: float, hatch: bool):
    data = np.ma.masked_array(w, mask=None if mask is None else ~mask)
    im = ax.imshow(data, cmap=_cmap(), vmin=0.0, vmax=vmax, interpolation="nearest", aspect="equal")
    if mask is not None and hatch and (~mask).any():
        rows, cols = np.nonzero(~mask)
        patches = [Rectangle((c - 0.5, r - 0.5), 1, 1) for r, c in zip(rows, cols, strict=True)]
        ax.add_collection(PatchCollection(patches, facecolor="none", edgecolor="#b0703a", hatch="///",
                                          linewidth=0))
    return im


def heatmap(weights, q_tokens: Sequence[str] | None = None, k_tokens: Sequence[str] | None = None, *,
            mask=None, title: str | None = None, vmax: float | None = None) -> Figure:
    """Heat map of one head's weights, queries down the side, keys along the top.

    Args:
        weights: ``[Lq, Lk]`` tensor or array.
        q_tokens: ``Lq`` labels for the queries (default: positions).
        k_tokens: ``Lk`` labels for the keys (default: ``q_tokens`` when square).
        mask: optional ``[Lq, Lk]`` boolean, ``True`` = may attend; the rest is drawn as masked.
        title: figure title.
        vmax: top of the colour scale (default: the largest weight, at least 1e-6).

    Returns:
        A matplotlib ``Figure`` (save it with :func:`save`). Every token is labelled up to 64
        tokens; beyond that every k-th token is, as ``position:token``, to stay readable to 512.
        Beyond :data:`MAX_CELLS` tokens a side the map is max-pooled, and the title says so.

    Raises:
        ValueError: shapes of ``weights``, tokens and ``mask`` disagree.
    """
    w = _np(weights, "weights", 2)
    lq, lk = w.shape
    if k_tokens is None and lq == lk:
        k_tokens = q_tokens
    q_tokens = _check_tokens(q_tokens, lq, "q_tokens")
    k_tokens = _check_tokens(k_tokens, lk, "k_tokens")
    m = None if mask is None else _np(mask, "mask", 2).astype(bool)
    if m is not None and m.shape != w.shape:
        raise ValueError(f"mask has shape {m.shape}, expected {w.shape} like weights")
    vmax = vmax or max(float(w.max()) if w.size else 0.0, 1e-6)
    w, m, stride = _pool(w, m)
    cq, ck = w.shape
    # Square cells, each side as long as its token count asks: an 11 x 6 matrix gets a tall canvas,
    # not a square one with a blank band beside it. The margins hold the labels and the colour bar.
    cell = min(12.0, 3.0 + 0.18 * max(cq, ck)) / max(cq, ck, 1)
    fig = Figure(figsize=(cell * ck + 2.4, cell * cq + 1.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    fontsize = max(5.0, min(10.0, 360.0 / max(cq, ck, 1)))
    im = _draw(ax, w, m, vmax, hatch=max(cq, ck) <= 64)
    _ticks(ax, ck, k_tokens, "x", fontsize, stride[1])
    _ticks(ax, cq, q_tokens, "y", fontsize, stride[0])
    ax.xaxis.tick_top()
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    if m is not None and (~m).any():
        ax.legend(handles=[Patch(facecolor=MASKED_COLOR, hatch="///", edgecolor="#b0703a", label="masked")],
                  loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    _title(fig, title, stride)
    return fig


def _title(fig: Figure, title: str | None, stride: tuple[int, int]) -> None:
    lines = [title] if title else []
    if stride != (1, 1):
        lines.append(_pooled_note(stride))
    if lines:
        fig.suptitle("\n".join(lines))


def head_grid(attn, tokens: Sequence[str] | None = None, *, heads: Sequence[int] | None = None,
              mask=None, title: str | None = None, ncols: int | None = None,
              labels: Sequence[str] | None = None) -> Figure:
    """A grid of small heat maps, one per head (or per any leading index).

    Args:
        attn: ``[H, L, L]`` weights of one layer (one batch element).
        tokens: ``L`` token labels, drawn on the outer axes when ``L <= 24``.
        heads: which heads to draw (default: all).
        mask: optional ``[L, L]`` boolean, ``True`` = may attend.
        title: figure title.
        ncols: columns of the grid (default: about square, at most 6).
        labels: one title per drawn panel (default ``"head h"``).

    Returns:
        A matplotlib ``Figure`` sharing one colour scale, 0 to the largest weight shown, queries
        down and keys across every panel; beyond :data:`MAX_CELLS` tokens each panel is max-pooled,
        and the title says so.
    """
    a = _np(attn, "attn", 3)
    n_heads, lq, lk = a.shape
    heads = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    for h in heads:
        if not 0 <= h < n_heads:
            raise ValueError(f"heads must be in [0, {n_heads}), got {h}")
    if not heads:
        raise ValueError("heads must name at least one head, got none")
    if labels is not None and len(labels) != len(heads):
        raise ValueError(f"labels has {len(labels)} entries, expected one per head ({len(heads)})")
    tokens = _check_tokens(tokens, lk, "tokens") if lq == lk else None
    m = None if mask is None else _np(mask, "mask", 2).astype(bool)
    ncols = ncols or min(6, math.ceil(math.sqrt(len(heads))))
    nrows = math.ceil(len(heads) / ncols)
    cell = 2.2 if (tokens and lk <= 24) else 1.8
    fig = Figure(figsize=(ncols * cell + 1.5, nrows * cell + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    vmax = max(float(a[heads].max()), 1e-6)
    im, stride = None, (1, 1)
    for k, ax in enumerate(axes.flat):
        if k >= len(heads):
            ax.axis("off")
            continue
        w, mk, stride = _pool(a[heads[k]], m)
        im = _draw(ax, w, mk, vmax, hatch=lk <= 16)
        ax.set_title(labels[k] if labels else f"head {heads[k]}", fontsize=9)
        r, c = divmod(k, ncols)
        if tokens and lk <= 24 and c == 0:
            ax.set_yticks(range(lq), tokens, fontsize=6)
        else:
            ax.set_yticks([])
        if tokens and lk <= 24 and r == nrows - 1:
            ax.set_xticks(range(lk), tokens, fontsize=6, rotation=90)
        else:
            ax.set_xticks([])
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention weight")
    fig.supxlabel("key (attended to)", fontsize=9)
    fig.supylabel("query (attending)", fontsize=9)
    _title(fig, title, stride)
    return fig


def head_stats(attentions, stat: str = "entropy", *, title: str | None = None) -> Figure:
    """One cell per layer and head: the mean row entropy (bits) or mean attention distance (tokens).

    Args:
        attentions: one ``[B, H, L, L]`` tensor per layer, or ``[layers, B, H, L, L]``; the batch
            is averaged.
        stat: ``"entropy"`` or ``"distance"``.
        title: figure title (default says which statistic).

    Returns:
        A matplotlib ``Figure`` with the value printed in each cell when there are <= 16 heads.
    """
    fn = {"entropy": entropy, "distance": mean_distance}.get(stat)
    if fn is None:
        raise ValueError(f"stat must be 'entropy' or 'distance', got {stat!r}")
    layers = list(attentions.unbind(0)) if isinstance(attentions, torch.Tensor) else list(attentions)
    if not layers or any(t.dim() != 4 for t in layers):
        raise ValueError("attentions must be one [B, H, L, L] tensor per layer")
    values = torch.stack([fn(t).mean(0) for t in layers]).double().numpy()  # (layers, H)
    n_layers, n_heads = values.shape
    fig = Figure(figsize=(1.6 + 0.55 * n_heads, 1.2 + 0.45 * n_layers), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(values, cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_xticks(range(n_heads), [str(h) for h in range(n_heads)], fontsize=8)
    ax.set_yticks(range(n_layers), [str(layer) for layer in range(n_layers)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    if n_heads <= 16:
        mid = (values.max() + values.min()) / 2
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7,
                    color="black" if v > mid else "white")
    unit = "bits" if stat == "entropy" else "tokens"
    fig.colorbar(im, ax=ax, label=f"mean {stat} ({unit})")
    ax.set_title(title or f"attention {stat} per head ({unit})", fontsize=10)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as PNG or SVG (by suffix) and return the path; parent folders are created.

    The file appears whole or not at all (:func:`attnkit._io.atomic_write`).
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ValueError(f"path must end in .png or .svg, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: fig.savefig(f, format=fmt, dpi=fig.dpi))
