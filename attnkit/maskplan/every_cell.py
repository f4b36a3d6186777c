"""The every-cell way: evaluate the predicate on every cell and read each row's runs.

The last way of deriving a predicate's rows (``derived_by == "every cell"``), for what neither the
closed form nor the ranges can follow: vectorised, in cache-sized chunks of rows, O(Lq * Lk) cells.
Under ``torch.compile`` the predicate is evaluated on the whole grid in the traced graph
(:func:`traced`), its runs read by one operator, ``attnkit::mask_runs``, whose output size is known
only when it runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import masks as _masks
from ..memory import check_op_fits
from .ranges import CELLS
from .rows import MAX_INTERVALS, assemble, runs
from .stand_ins import ReadsHead


def every_cell(mod, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[Tensor, Tensor] | None:
    """:func:`.derivation.row_intervals` by evaluating ``mod`` on every cell, in row chunks.

    Dependence on ``b`` and ``h`` shows in the result's shape: a broadcasting predicate that never
    reads ``h`` returns size 1 along it. One that does is compared across heads, and raises
    :class:`.stand_ins.ReadsHead` where they differ.
    """
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    step = max(1, CELLS // max(1, kv_len))
    buf = torch.zeros(step * batch, kv_len + 2, dtype=torch.bool, device=device)
    pieces, per_batch = [], False
    for r0 in range(0, q_len, step):
        q = torch.arange(r0, min(r0 + step, q_len), device=device).view(1, 1, -1, 1)
        grid = (batch, heads, q.shape[2], kv_len)
        out = mod(b, h, q, kv)
        _masks.check_mask_mod_output(mod, out, grid)
        out = _masks.as_grid(out)
        if out.shape[1] > 1:
            if not bool((out == out[:, :1]).all()):
                raise ReadsHead()  # the caller works it out per head
            out = out[:, :1]
        out = out.expand(out.shape[0], 1, q.shape[2], kv_len)[:, 0]  # [1 or B, R, Lk]
        per_batch = per_batch or out.shape[0] > 1
        starts, ends = runs(out.reshape(-1, kv_len), buf)
        if starts.shape[0] and int(torch.bincount(starts[:, 0]).max()) > MAX_INTERVALS:
            return None  # a row with too many runs: no interval form, whatever the other rows hold
        pieces.append((r0, out.shape[0], q.shape[2], starts, ends))
    return assemble(pieces, batch if per_batch else 1, q_len, kv_len)


def traced(mod, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[Tensor, Tensor] | None:
    """:func:`.derivation.row_intervals` in a graph torch.compile traces: ``mod`` on the whole grid at once, its runs
    read by one operator whose ``K`` is known only when it runs. None (no interval form) when the
    result varies along the head axis; a result that does not vary along the rows (key padding) is
    read once and shared by every row."""
    grid = (batch, heads, q_len, kv_len)
    b, h, q, kv = (torch.arange(n, device=device).view([-1 if d == i else 1 for d in range(4)])
                   for i, n in enumerate(grid))
    out = mod(b, h, q, kv)
    _masks.check_mask_mod_output(mod, out, grid)
    out = _masks.as_grid(out)
    if out.shape[1] > 1:
        return None
    rows = out.shape[2]
    starts, ends = torch.ops.attnkit.mask_runs(out[:, 0].expand(out.shape[0], rows, kv_len).contiguous())
    return starts.expand(-1, q_len, -1), ends.expand(-1, q_len, -1)


def _check_allowed(allowed: Tensor) -> None:
    """``attnkit::mask_runs``' argument, as PyTorch's own ops check theirs (in its fake too)."""
    if not isinstance(allowed, Tensor):
        raise TypeError(f"attnkit::mask_runs: allowed must be a tensor, got {type(allowed).__name__}")
    if allowed.dtype != torch.bool:
        raise TypeError(f"attnkit::mask_runs: allowed must be a bool tensor (True = may attend), got dtype "
                        f"{allowed.dtype}")
    if allowed.dim() != 3:
        raise ValueError(f"attnkit::mask_runs: allowed must be 3-D [P, R, Lk] (rows of keys per batch element), "
                         f"got shape {tuple(allowed.shape)}; pass allowed[None] for one set of rows")


@torch.library.custom_op("attnkit::mask_runs", mutates_args=(), device_types="cpu")
def _mask_runs(allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's runs of True in a bool CPU ``[P, R, Lk]``, as ``(starts, ends)`` int64 ``[P, R, K]``
    (``K`` the most runs a row has, at least 1; empty slots ``(Lk, Lk)``).

    Raises:
        TypeError: ``allowed`` not a bool tensor.
        ValueError: ``allowed`` not 3-D, or outputs (``P * R * K`` slots) beyond the memory limit
            (:func:`attnkit.masks.check_op_fits`).
    """
    _check_allowed(allowed)
    p, r, lk = allowed.shape
    if allowed.numel() == 0:  # no rows, or no keys: every row's one slot empty
        return torch.full((p, r, 1), lk, dtype=torch.int64), torch.full((p, r, 1), lk, dtype=torch.int64)
    rows = allowed.reshape(-1, lk)
    # runs per row: its rising edges; K known before the [runs, 2] edge lists and [P, R, K] slots are made
    k = int(((rows[:, 1:] & ~rows[:, :-1]).sum(-1) + rows[:, 0]).max())
    check_op_fits("attnkit::mask_runs", f"2 x int64 [P, R, K] = {(p, r, k)} and its runs' edges "
                         "(K: the most runs of True in a row)", p * r * k * 48, "call it on fewer rows at a time")
    buf = torch.zeros(p * r, lk + 2, dtype=torch.bool)
    starts, ends = runs(rows, buf)
    return assemble([(0, p, r, starts, ends)], p, r, lk, most=None)


@_mask_runs.register_fake
def _(allowed):
    _check_allowed(allowed)
    k = torch.library.get_ctx().new_dynamic_size(min=1)
    return (allowed.new_empty(*allowed.shape[:2], k, dtype=torch.int64),
            allowed.new_empty(*allowed.shape[:2], k, dtype=torch.int64))
