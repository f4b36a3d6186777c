"""An independent float64 oracle: the textbook formula, written without any attnkit code.

Masks are built here from first principles (Python loops over positions), not from
``attnkit.masks``, so a mistake there cannot hide in both sides of a comparison.
"""

from __future__ import annotations

import itertools
import math

import torch


def allowed_grid(b: int, h: int, lq: int, lk: int, *, is_causal=False, window=None, mask_mod=None,
                 mask=None) -> torch.Tensor | None:
    """Bool ``[b, h, lq, lk]`` of what may attend, or None when nothing is masked."""
    if not is_causal and window is None and mask_mod is None and mask is None:
        return None
    cells = []  # each cell's verdict in order, made into a tensor once (a tensor write per cell cost most of the time)
    off = lk - lq  # bottom-right: query i sits at position i + off
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                p = i + off
                for j in range(lk):
                    ok = True
                    if is_causal and j > p:
                        ok = False
                    if window is not None:
                        left, right = window
                        if left is not None and j < p - left:
                            ok = False
                        if right is not None and j > p + right:
                            ok = False
                    if mask_mod is not None and ok:
                        ok = bool(mask_mod(torch.tensor(bi), torch.tensor(hi), torch.tensor(i), torch.tensor(j)))
                    cells.append(ok)
    out = torch.tensor(cells, dtype=torch.bool).view(b, h, lq, lk)
    if mask is not None:
        out = out & mask.expand(b, h, lq, lk)
    return out


def attention(q, k, v, *, allowed=None, bias=None, scale=None, score_mod=None):
    """``softmax(q k^T * scale + bias) v`` in float64; rows with nothing allowed give zeros.

    q ``[B, H, Lq, E]``, k ``[B, Hkv, Lk, E]``, v ``[B, Hkv, Lk, Ev]``. Returns ``(out, weights)``.
    """
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    h, hkv = q.shape[-3], k.shape[-3]
    idx = torch.tensor([i * hkv // h for i in range(h)])  # query head i reads kv head i // (h/hkv)
    k, v = k.index_select(-3, idx), v.index_select(-3, idx)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("...qd,...kd->...qk", q, k) * scale
    if bias is not None:
        s = s + bias.detach().to(torch.float64)
    if score_mod is not None:
        grid = [torch.arange(n).view([-1 if d == i else 1 for d in range(4)]) for i, n in enumerate(s.shape)]
        s = score_mod(s, *grid)
    keep = torch.ones_like(s, dtype=torch.bool) if allowed is None else allowed.expand_as(s)
    keep = keep & (s > float("-inf"))
    w = torch.zeros_like(s)
    for index in itertools.product(*(range(n) for n in s.shape[:-1])):
        row, ok = s[index], keep[index]
        if ok.any():
            e = torch.exp(row[ok] - row[ok].max())
            w[index][ok] = e / e.sum()
    return w @ v, w
