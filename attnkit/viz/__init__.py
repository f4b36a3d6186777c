"""Pictures of attention: static heat maps (matplotlib, Agg) and an offline interactive viewer.

* :func:`heatmap` - one head, token labels, masked cells drawn distinctly (5 to 512 tokens).
* :func:`head_grid` - a grid of heads of one layer.
* :func:`head_stats` - entropy or mean distance per layer and head.
* :func:`score_terms_figure` - one query's scores taken apart by head dimension, keys x dimensions.
* :func:`flow_diagram` - labelled boxes joined by arrows: how tensors flow through a call.
* :func:`save` - write a figure as PNG or SVG.
* :func:`viewer_html` / :func:`write_viewer` - the self-contained HTML viewer.
"""

from .flow import flow_diagram
from .heatmap import head_grid, head_stats, heatmap, save
from .terms import score_terms_figure
from .viewer import viewer_html, write_viewer

__all__ = ["flow_diagram", "head_grid", "head_stats", "heatmap", "save", "score_terms_figure", "viewer_html",
           "write_viewer"]
