"""Interval algebra: each query row's allowed keys as sorted, disjoint ``[start, end)`` pairs.

The one form every exact kernel reads: ``(starts, ends)``, int64 ``[P, Lq, K]`` (``P`` 1 when every
batch element shares the rows, else B, or B*H for a mask per head), row ``i`` attending keys
``starts[..., i, j] <= key < ends[..., i, j]``, sorted, disjoint, empty intervals written
``(Lk, Lk)`` after the others. :func:`row_bounds` is the one place that says which keys
``is_causal`` and ``window`` allow; :func:`normalize`, :func:`intersect_intervals` and
:func:`union_intervals` combine intervals without looking at a cell. The typed masks of
:mod:`attnkit.masks` and the mask plan (:mod:`attnkit.maskplan`) build on this module.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Intervals", "intersect_intervals", "normalize", "positions", "row_bounds", "trim", "union_intervals"]

Intervals = tuple[Tensor, Tensor]
"""Each row's allowed keys: ``(starts, ends)``, int64 ``[1 or B, Lq, K]``, row ``i`` attending keys
``starts[..., i, j] <= key < ends[..., i, j]``; sorted, disjoint, empty intervals ``(Lk, Lk)`` last."""


def normalize(starts: Tensor, ends: Tensor, kv_len: int) -> Intervals:
    """Any intervals ``[Bp, Lq, K]`` (overlapping, unsorted, empty, out of ``[0, kv_len]``) in the
    shared form: clipped to ``[0, kv_len]``, sorted by start, overlapping or adjacent ones merged,
    empties written ``(kv_len, kv_len)`` after the others, and ``K`` cut to the most non-empty
    intervals any row has (at least 1; under ``torch.compile`` it stays as given, since a shape
    there may not depend on the data). Vectorised: a sort, then, where some intervals overlap or touch,
    a running maximum and a scatter."""
    compiling = torch.compiler.is_compiling()  # there, neither a shape nor a branch may depend on the data
    starts, ends = torch.broadcast_tensors(starts, ends)
    # fresh, whole tensors (clamp_min then clamp_max: an int64 clamp with both bounds is not vectorised)
    starts = starts.long().clamp_min(0).clamp_max_(kv_len)
    ends = ends.long().clamp_min(0).clamp_max_(kv_len)
    empty = starts >= ends
    starts.masked_fill_(empty, kv_len)
    ends.masked_fill_(empty, kv_len)
    if compiling or not bool((starts[..., 1:] >= starts[..., :-1]).all()):  # most builders' rows come in order
        starts, order = starts.sort(dim=-1, stable=True)  # empties (kv_len) go last
        ends = ends.gather(-1, order)
        empty = starts >= ends
    k = starts.shape[-1]
    if not compiling and k > 0 and bool(((starts[..., 1:] > ends[..., :-1]) | empty[..., 1:]).all()):
        # each apart from the one before (a builder's usual intervals): sorted, they are the answer, and
        # the running maximum and the scatters below (most of the time on long rows) are not needed
        return trim(starts, ends)
    reach = ends.masked_fill(empty, -1).cummax(dim=-1).values  # furthest end so far
    before = torch.cat([torch.full_like(reach[..., :1], -1), reach[..., :-1]], dim=-1)
    fresh = ~empty & (starts > before)  # a gap before it: a new merged interval
    slot = (fresh.long().cumsum(-1) - 1).masked_fill(empty, k)  # empties go to a slot dropped below
    out_s = torch.full(starts.shape[:-1] + (k + 1,), kv_len, dtype=torch.long, device=starts.device)
    out_e = out_s.clone()
    out_s = out_s.scatter_reduce(-1, slot, starts, "amin", include_self=True)
    out_e = out_e.scatter_reduce(-1, slot, ends, "amax", include_self=False)
    if compiling:  # keep K slots, empties last
        return out_s[..., :max(k, 1)].contiguous(), out_e[..., :max(k, 1)].contiguous()
    return trim(out_s, out_e)  # the last slot, where the empties went, is empty


def trim(starts: Tensor, ends: Tensor) -> Intervals:
    """Sorted intervals ``[..., K >= 1]``, empties last, cut to the most non-empty ones any row
    has (at least 1; under ``torch.compile``, where a shape may not depend on the data, as given)."""
    if torch.compiler.is_compiling():
        return starts.contiguous(), ends.contiguous()
    # empties last: the columns where some row has an interval are the first `width`
    width = max(1, int((starts < ends).reshape(-1, starts.shape[-1]).any(0).sum())) if starts.numel() else 1
    return starts[..., :width].contiguous(), ends[..., :width].contiguous()


def intersect_intervals(a: Intervals, b: Intervals, kv_len: int) -> Intervals:
    """Keys allowed by both ``a`` and ``b`` (each ``(starts, ends)`` ``[1 or B, Lq, K]``): every pair's
    overlap (``K1 x K2`` of them), then :func:`normalize`."""
    s = torch.maximum(a[0][..., :, None], b[0][..., None, :])
    e = torch.minimum(a[1][..., :, None], b[1][..., None, :])
    return normalize(s.flatten(-2), e.flatten(-2), kv_len)


def union_intervals(a: Intervals, b: Intervals, kv_len: int) -> Intervals:
    """Keys allowed by ``a`` or ``b``: both lists side by side, then :func:`normalize` (which merges
    overlapping and adjacent ones)."""
    (sa, ea), (sb, eb) = a, b
    sa, sb = _same_batch(sa, sb)
    ea, eb = _same_batch(ea, eb)
    return normalize(torch.cat([sa, sb], -1), torch.cat([ea, eb], -1), kv_len)


def _same_batch(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    batch = max(x.shape[0], y.shape[0])
    return x.expand(batch, *x.shape[1:]), y.expand(batch, *y.shape[1:])


def positions(q_len: int, offset: int) -> Tensor:
    """``[1, Lq, 1]``: each query row's absolute position ``i + offset``."""
    return (torch.arange(q_len) + offset).view(1, -1, 1)


def row_bounds(q_len: int, kv_len: int, is_causal: bool = False, window=None, offset: int | None = None) -> Intervals:
    """The one interval ``[lo, hi)`` of keys each query row may attend under ``is_causal`` and
    ``window`` (``(left, right)``, None: unbounded on that side), as ``[1, Lq, 1]`` intervals in the
    shared form (an empty row is ``(Lk, Lk)``). Query ``i`` sits at position ``i + offset``;
    ``offset`` defaults to ``kv_len - q_len`` (aligned bottom-right, what a KV cache needs). O(Lq)."""
    pos = torch.arange(q_len, dtype=torch.int64) + (kv_len - q_len if offset is None else offset)
    lo, hi = torch.zeros_like(pos), torch.full_like(pos, kv_len)
    if is_causal:
        hi = torch.minimum(hi, pos + 1)
    if window is not None:
        left, right = window
        lo = lo if left is None else torch.maximum(lo, pos - left)
        hi = hi if right is None else torch.minimum(hi, pos + right + 1)
    return normalize(lo.view(1, -1, 1), hi.view(1, -1, 1), kv_len)
