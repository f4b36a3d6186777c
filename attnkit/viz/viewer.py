"""An interactive attention viewer in one self-contained HTML file.

In the spirit of bertviz's head and model views, but the page carries its own script and styles
and loads nothing (a Content-Security-Policy of ``default-src 'none'`` says so to the browser),
so it opens from ``file://`` with no network, and can be mailed or attached to a CI run.

* head view: queries on the left, keys on the right, one colour per head, line opacity = weight;
  hovering a token keeps its lines only and lists its strongest links per head;
* matrix view: the mean of the selected heads as a heat map; hovering a cell gives its weight;
* model view: every layer x head as a thumbnail; clicking one opens it;
* score terms: given the queries and keys (``qk=``), clicking a cell of the matrix takes that
  cell's score apart into its per-dimension terms ``q[i, d] * k[j, d] * scale``, drawn as bars
  sorted by size, with their sum (the score) and its softmax weight.

Long inputs: weights are stored as 8-bit levels (resolution 1/255). Up to ``max_dense_cells``
layer x head x L x L cells are stored whole; beyond that, each query keeps its ``top_k`` strongest
keys (the rest read as 0, and the page says so). The head view draws each query's 3 strongest
links beyond 128 tokens until a token is hovered; the matrix view is max-pooled to 512 x 512
cells and the thumbnails to 64 x 64. The queries and keys are stored as float32 when they fit the
same budget of ``max_dense_cells`` bytes that dense weights have (one byte a weight); otherwise
the page leaves the score terms out and says so.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .._io import atomic_write
from .._text import utf8_safe
from ..analysis.terms import score_scale
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
        # Weights are shown as levels of [0, 1]; NaN has no level, and drawing it as 0 would hide the bug
        # that produced it.
        _all_finite(a, f"attentions[{i}] (layer {i})", "weights", ("head", "query", "key"),
                    "the viewer needs finite weights")
        out.append(a)
    return np.stack(out)


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _heads_array(t, name: str, batch_index: int) -> np.ndarray:
    """``[H, L, D]`` float32 from ``[B, H, L, D]`` / ``[H, L, D]`` (a tensor or an array)."""
    if isinstance(t, torch.Tensor):
        a = t.detach().to("cpu", torch.float32).numpy()
    elif isinstance(t, np.ndarray):
        a = t.astype(np.float32)
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(t).__name__}")
    if a.ndim == 4:
        if not 0 <= batch_index < a.shape[0]:
            raise ValueError(f"batch_index must be in [0, {a.shape[0]}) for {name}, got {batch_index}")
        a = a[batch_index]
    if a.ndim != 3:
        raise ValueError(f"{name} must be [B, H, L, D] or [H, L, D], got shape {tuple(a.shape)}")
    return a


def _all_finite(a: np.ndarray, what: str, values: str, axes: tuple[str, str, str], need: str) -> None:
    """Raise a ValueError naming ``what``, how many of its ``values`` are not finite and where the first is
    (by the three ``axes``), unless every entry of the 3-D ``a`` is finite."""
    bad = np.argwhere(~np.isfinite(a))
    if len(bad):
        at = tuple(int(x) for x in bad[0])
        where = ", ".join(f"{axis} {x}" for axis, x in zip(axes, at, strict=True))
        raise ValueError(f"{what} has {len(bad)} non-finite {values}, first at {where} ({a[at]}); {need}")


def _score_inputs(qk, n_layers: int, n_heads: int, n: int, batch_index: int):
    """``q [layers, H, L, D]``, ``k [layers, Hkv, L, D]`` (float32) and each layer's scale, checked."""
    if isinstance(qk, str | bytes) or not isinstance(qk, Sequence):
        raise TypeError(f"qk must be a sequence of (q, k) or (q, k, scale), one per layer, got {type(qk).__name__}")
    if len(qk) != n_layers:
        raise ValueError(f"qk must hold one (q, k) per layer: the attentions have {n_layers} layers, qk has {len(qk)}")
    qs, ks, scales = [], [], []
    for i, entry in enumerate(qk):
        if not isinstance(entry, tuple | list) or len(entry) not in (2, 3):
            raise TypeError(f"qk[{i}] must be (q, k) or (q, k, scale), got {type(entry).__name__}"
                            + (f" of {len(entry)}" if isinstance(entry, tuple | list) else ""))
        q = _heads_array(entry[0], f"qk[{i}] q", batch_index)
        k = _heads_array(entry[1], f"qk[{i}] k", batch_index)
        scale = entry[2] if len(entry) == 3 else None
        if q.shape[:2] != (n_heads, n) or k.shape[1] != n or k.shape[2] != q.shape[2]:
            raise ValueError(f"qk[{i}] must hold q [H, L, D] = [{n_heads}, {n}, D] and k [Hkv, {n}, D] for the "
                             f"{n} tokens and {n_heads} heads of the maps, got q {tuple(q.shape)} and k "
                             f"{tuple(k.shape)}")
        if k.shape[0] == 0 or n_heads % k.shape[0]:
            raise ValueError(f"qk[{i}]: q has {n_heads} heads and k {k.shape[0]}: the query heads must be a "
                             "multiple of the key heads (grouped-query attention)")
        if qs and (k.shape, q.shape) != (ks[0].shape, qs[0].shape):
            raise ValueError(f"qk[{i}] has q {tuple(q.shape)} and k {tuple(k.shape)}, expected q "
                             f"{tuple(qs[0].shape)} and k {tuple(ks[0].shape)} like layer 0")
        scale = score_scale(scale, q.shape[-1], f"qk[{i}] scale")
        for name, t in (("q", q), ("k", k)):
            _all_finite(t, f"qk[{i}] {name} (layer {i})", "values", ("head", "position", "dimension"),
                        "the viewer needs finite q and k")
        qs.append(q)
        ks.append(k)
        scales.append(float(scale))
    return np.stack(qs), np.stack(ks), scales


#: A softmax of q . k * scale is taken for a head's weights when it gives them within half a
#: level of the 8-bit map: as close as the page shows a weight.
_HALF_LEVEL = 0.5 / 255


def _terms_data(q: np.ndarray, k: np.ndarray, scales: list[float], a: np.ndarray) -> dict[str, object]:
    """What the page needs to show a score's terms: q and k, and per row the log-sum-exp of the
    scores over the keys the weights allow (so a weight is ``exp(score - lse)``), which keys are
    masked (weight exactly 0), and per head whether that softmax gives the recorded weights."""
    n_layers, n_heads = a.shape[:2]
    masked = a == 0
    lse = np.empty(a.shape[:3], np.float64)  # (layers, H, L)
    softmax = []
    for layer in range(n_layers):
        qd = torch.from_numpy(q[layer]).double()  # (H, L, D)
        kd = torch.from_numpy(k[layer]).double().repeat_interleave(n_heads // k.shape[1], dim=0)  # (H, L, D)
        s = qd @ kd.transpose(-2, -1) * scales[layer]  # (H, L, L)
        m = torch.from_numpy(masked[layer])
        row_lse = torch.logsumexp(s.masked_fill(m, -math.inf), dim=-1)  # -inf for a row with no key
        p = torch.exp(s - row_lse[..., None]).masked_fill(m, 0.0)
        err = (p - torch.from_numpy(a[layer]).double()).abs().amax(dim=(-2, -1))  # (H,)
        lse[layer] = row_lse.numpy()
        softmax.append([bool(e <= _HALF_LEVEL) for e in err])
    return {"q": _b64(q.astype("<f4")), "k": _b64(k.astype("<f4")), "lse": _b64(lse.astype("<f8")),
            "masked": _b64(np.packbits(masked, axis=None)) if masked.any() else None,
            "dim": int(q.shape[-1]), "kv_heads": int(k.shape[1]), "scale": scales, "softmax": softmax}


def viewer_html(attentions, tokens: Sequence[str], *, title: str = "attnkit attention viewer",
                text: str | None = None, batch_index: int = 0, max_dense_cells: int = 4_000_000,
                top_k: int = 32, qk: Sequence | None = None) -> str:
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
        qk: the queries and keys behind the weights, one ``(q, k)`` or ``(q, k, scale)`` per layer:
            ``q [B, H, L, D]``, ``k [B, Hkv, L, D]`` (or without ``B``) as the attention took them,
            after any rotary transform, e.g. from :func:`attnkit.analysis.record.recorded_qk`;
            ``scale`` defaults to ``1 / sqrt(D)``. Clicking a cell of the matrix then shows its
            score's terms per dimension. Stored as float32 when the q, k and row data fit
            ``max_dense_cells`` bytes; otherwise left out, and the page says so.

    Returns:
        A self-contained HTML document.

    Raises:
        ValueError: shapes disagree, a weight is NaN or infinite (naming layer, head and cell),
            more than 65,535 tokens, ``top_k < 1``, or ``qk`` that does not fit the maps
            (layers, heads, tokens) or holds a non-finite value.
        TypeError: ``title`` or ``text`` is not a string, or ``qk`` is not a sequence of
            ``(q, k)`` / ``(q, k, scale)`` tuples of tensors or arrays.
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
    data.update(terms=None, terms_note="")
    if qk is not None:
        tq, tk, scales = _score_inputs(qk, n_layers, n_heads, n, batch_index)
        # q and k, each row's log-sum-exp, and a bit a cell when some weight is exactly 0
        need = 4 * (tq.size + tk.size) + 8 * n_layers * n_heads * n + ((a.size + 7) // 8 if (a == 0).any() else 0)
        if need <= max_dense_cells:
            data["terms"] = _terms_data(tq, tk, scales, a)
        else:
            data["terms_note"] = (f"Score terms left out: their queries, keys and row sums take {need:,} bytes, "
                                  f"more than max_dense_cells ({max_dense_cells:,}); write the viewer with a "
                                  "larger max_dense_cells to keep them.")
            data["note"] = " ".join(filter(None, (data["note"], data["terms_note"])))
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
