"""Runs of allowed keys, packed into the interval tables every kernel reads.

Each way of deriving a predicate's rows finds *runs*: ``[first, last)`` stretches of allowed keys
in a row. :func:`runs` finds them in rows of booleans, :func:`join` merges runs that touch, and
:func:`pack` / :func:`assemble` lay them out as ``(starts, ends)`` int64 ``[P, Lq, K]`` (the form of
:mod:`attnkit.intervals`), or say there is no such form when a row has more than
:data:`MAX_INTERVALS` runs. All vectorised: O(runs) work after a sort.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_INTERVALS = 256
"""Rows with more intervals than this are not worth the band kernel's per-row bookkeeping: such a mask
has no interval form, and the tile kernels evaluate it tile by tile."""


def runs(rows: Tensor, buf: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The runs of True in bool ``rows [N, L]``, in order: ``(starts, ends)``, each ``[runs, 2]`` of
    ``(row, column)``. ``buf``: a ``[>= N, L + 2]`` bool buffer whose first and last columns are
    False, reused across calls (made here when not given)."""
    n, length = rows.shape
    if buf is None:
        buf = torch.zeros(n, length + 2, dtype=torch.bool, device=rows.device)
    buf[:n, 1:length + 1] = rows
    edges = (buf[:n, 1:] ^ buf[:n, :-1]).nonzero().cpu()  # row-major: each row's start, end, start, end, ...
    return edges[0::2], edges[1::2]


def join(group: Tensor, start: Tensor, end: Tensor, ordered: bool = False,
          joins: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Disjoint runs ``[start, end)`` in groups, in order of group then start, each run that begins
    where the one before it in its group ended joined to it: the index (into the inputs) of each
    joined run's first part, and the joined run's end. ``ordered``: the runs come in that order
    already (else they are sorted here). ``joins``: which runs (in order) begin where the one
    before them ends, where the caller has worked that out itself."""
    order = None
    if not ordered:
        key = group * (int(end.max()) + 1) + start
        order = torch.argsort(key.int() if int(key.max()) < 2**31 else key)  # int32 sorts faster
        group, start, end = group[order], start[order], end[order]
    if joins is None:
        joins = torch.zeros_like(group, dtype=torch.bool)
        joins[1:] = (group[1:] == group[:-1]) & (start[1:] == end[:-1])
    first = (~joins).nonzero().view(-1)  # the first part of each joined run
    if first.numel() < group.numel():  # the last part (just before the next first) ends the joined run
        end = end[torch.cat([first[1:], first.new_tensor([group.numel()])]) - 1]
    return first if order is None else order[first], end


def assemble(pieces: list, p: int, q_len: int, kv_len: int,
              most: int | None = MAX_INTERVALS) -> tuple[Tensor, Tensor] | None:
    """``[p, Lq, K]`` intervals from the chunks' runs (a chunk with one row set per batch
    element, or one shared by all); None when a row has more than ``most`` runs."""
    rows, firsts, lasts = [], [], []
    for r0, pb, n, starts, ends in pieces:
        bi, ri = starts[:, 0] // n, starts[:, 0] % n
        for copy in range(p if pb == 1 else 1):  # a shared chunk of a per-batch plan: every element
            rows.append((bi + copy) * q_len + r0 + ri)
            firsts.append(starts[:, 1])
            lasts.append(ends[:, 1])
    row = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    order = row.argsort(stable=True)  # each row's runs in column order (chunks keep it)
    return pack(row[order], torch.cat(firsts)[order] if firsts else row, torch.cat(lasts)[order] if lasts else row,
                 p, q_len, kv_len, most)


def pack(row: Tensor, first: Tensor, last: Tensor, p: int, q_len: int, kv_len: int,
          most: int | None = MAX_INTERVALS) -> tuple[Tensor, Tensor] | None:
    """``[p, Lq, K]`` intervals from runs ``[first, last)`` of rows ``row`` (``pi * Lq + i``,
    sorted by row, then column); None when a row has more than ``most`` runs."""
    counts = torch.bincount(row, minlength=p * q_len)
    k = int(counts.max()) if row.numel() else 0
    if most is not None and k > most:
        return None
    k = max(k, 1)
    # each run's place in the [rows, k] table: its row's first place, plus its rank within the row
    place = torch.arange(row.numel()) + (row * k - (counts.cumsum(0) - counts).index_select(0, row))
    starts = torch.full((p * q_len * k,), kv_len, dtype=torch.int64).index_copy_(0, place, first)
    ends = torch.full((p * q_len * k,), kv_len, dtype=torch.int64).index_copy_(0, place, last)
    return starts.view(p, q_len, k), ends.view(p, q_len, k)
