"""An interactive attention viewer in one self-contained HTML file.

In the spirit of bertviz's head and model views, but the page carries its own script and styles
and loads nothing (a Content-Security-Policy of ``default-src 'none'`` says so to the browser),
so it opens from ``file://`` with no network, and can be mailed or attached to a CI run.

* head view: queries on the left, keys on the right, one colour per head, line opacity = weight;
  hovering a token keeps its lines only and lists its strongest links per head;
* matrix view: the mean of the selected heads as a heat map; hovering a cell gives its weight;
* model view: every layer x head as a thumbnail; clicking one opens it.

Long inputs: weights are stored as 8-bit levels (resolution 1/255). Up to ``max_dense_cells``
layer x head x L x L cells are stored whole; beyond that, each query keeps its ``top_k`` strongest
keys (the rest read as 0, and the page says so). The head view draws each query's 3 strongest
links beyond 128 tokens until a token is hovered; the matrix view is max-pooled to 512 x 512
cells and the thumbnails to 64 x 64.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .._io import atomic_write
from .._text import utf8_safe
from ._viewer_template import TEMPLATE

_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
# The template's two slots, filled in one pass over the template alone: a title or token that
# contains a slot's name is never itself taken for a slot.
_SLOT = re.compile(r"__ATTNKIT_(TITLE|DATA)__")


def _stack(attentions, batch_index: int) -> np.ndarray:
    """``[layers, H, L, L]`` float32 from per-layer ``[B, H, L, L]`` / ``[H, L, L]`` or a 4/5-D tensor."""
    if isinstance(attentions, torch.Tensor | np.ndarray):
        layers = list(attentions)
    else:
        layers = list(attentions)
    if not layers:
        raise ValueError("attentions must hold at least one layer, got none")
    out = []
    for i, t in enumerate(layers):
        a = t.detach().to("cpu", torch.float32).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float32)
        if a.ndim == 4:
            if not 0 <= batch_index < a.shape[0]:
                raise ValueError(f"batch_index must be in [0, {a.shape[0]}), got {batch_index}")
            a = a[batch_index]
        if a.ndim != 3 or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"attentions[{i}] must be [B, H, L, L] or [H, L, L] with square maps, "
                             f"got shape {tuple(a.shape)}")
        if out and a.shape != out[0].shape:
            raise ValueError(f"attentions[{i}] has shape {a.shape}, expected {out[0].shape} like layer 0")
        bad = np.argwhere(~np.isfinite(a))
        if len(bad):
            h, q, k = bad[0]
            # Weights are shown as levels of [0, 1]; NaN has no level, and drawing it as 0 would hide
            # the bug that produced it.
            raise ValueError(f"attentions[{i}] (layer {i}) has {len(bad)} non-finite weights, first at head {h}, "
                             f"query {q}, key {k} ({a[h, q, k]}); the viewer needs finite weights")
        out.append(a)
    return np.stack(out)


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def viewer_html(attentions, tokens: Sequence[str], *, title: str = "attnkit attention viewer",
                text: str | None = None, batch_index: int = 0, max_dense_cells: int = 4_000_000,
                top_k: int = 32) -> str:
    """The viewer page as a string.

    Args:
        attentions: one ``[B, H, L, L]`` (or ``[H, L, L]``) tensor per layer, first layer first,
            or one ``[layers, (B,) H, L, L]`` tensor/array.
        tokens: the ``L`` token strings, shown exactly as given (escaped, never interpreted).
        title: page title.
        text: the input text, shown under the title.
        batch_index: which batch element to show.
        max_dense_cells: most layer x head x L x L cells stored whole; beyond it, top-k per query.
        top_k: keys kept per query beyond ``max_dense_cells``.

    Returns:
        A self-contained HTML document.

    Raises:
        ValueError: shapes disagree, a weight is NaN or infinite (naming layer, head and cell),
            more than 65,535 tokens, or ``top_k < 1``.
        TypeError: ``title`` or ``text`` is not a string.
    """
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"text must be a str or None, got {type(text).__name__}")
    title = utf8_safe(title)
    text = None if text is None else utf8_safe(text)
    a = _stack(attentions, batch_index)
    n_layers, n_heads, n, _ = a.shape
    tokens = [utf8_safe(str(t)) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} entries but the maps are {n} x {n}")
    if n > 65535:
        raise ValueError(f"the viewer takes at most 65,535 tokens, got {n}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    q = np.rint(np.clip(a, 0.0, 1.0) * 255.0).astype(np.uint8)  # clipped first: 1e38 * 255 overflows
    data: dict[str, object] = {"title": title, "text": text, "tokens": tokens, "layers": n_layers,
                               "heads": n_heads, "top_k": 0}
    if a.size <= max_dense_cells:
        data.update(mode="dense", weights=_b64(q), note="")
    else:
        k = min(top_k, n)
        idx = np.argpartition(-a, k - 1, axis=-1)[..., :k] if k < n else np.broadcast_to(np.arange(n), a.shape)
        vals = np.take_along_axis(q, idx, axis=-1)
        data.update(mode="topk", top_k=k, indices=_b64(idx.astype("<u2")), values=_b64(vals),
                    note=f"{n} tokens: each query keeps its {k} strongest keys (the rest show as 0); "
                         "lines show each query's 3 strongest links until you hover a token; the matrix "
                         "is max-pooled to 512 cells a side and the thumbnails to 64.")
    if data["mode"] == "dense" and n > 128:
        data["note"] = (f"{n} tokens: lines show each query's 3 strongest links until you hover a token; "
                        "the matrix is max-pooled to 512 cells a side and the thumbnails to 64.")
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in _JSON_ESCAPES.items():
        payload = payload.replace(ch, esc)
    slots = {"TITLE": html.escape(title), "DATA": payload}
    return _SLOT.sub(lambda m: slots[m.group(1)], TEMPLATE)


def write_viewer(path: str | Path, attentions, tokens: Sequence[str], **kwargs) -> Path:
    """Write :func:`viewer_html` to ``path`` (parent folders created) and return the path.

    The page appears whole or not at all: a failure leaves the previous file untouched.
    """
    path = Path(path)
    page = viewer_html(attentions, tokens, **kwargs).encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: f.write(page))
