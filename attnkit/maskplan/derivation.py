"""The derivation order: each query row's allowed keys, worked out from a predicate itself.

A user's ``mask_mod`` is not annotated by hand: :func:`row_intervals` finds each row's runs of allowed
keys by the first of three ways that can follow the predicate, and says which
(:attr:`attnkit.MaskPlan.derived_by`):

1. ``"closed form"`` (:mod:`.closed_form`): each row's values as affine pieces along the keys,
   for predicates affine in the indices, with ``//`` and ``%`` by constants and tables read at a
   row constant along the keys; O(rows x pieces), without evaluating a cell;
2. ``"ranges"`` (:mod:`.ranges`): the predicate run on ranges of indices, tile by tile; tiles it
   proves all allowed or all masked are settled whole and only the cells of the others are
   evaluated;
3. ``"every cell"`` (:mod:`.every_cell`): vectorised over every cell, O(Lq * Lk).

All three give the same, exact intervals. A way that cannot follow the predicate raises
:class:`.stand_ins.CannotFollow`, the only exception caught here: a bug surfaces, it does not
become a silent slowdown. Costs: the "analysis" column of ``bench/results/mods.md`` (``attnkit bench mods``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import closed_form, ranges
from .every_cell import every_cell
from .rows import MAX_INTERVALS, pack
from .stand_ins import CannotFollow, ReadsHead


def row_intervals(mod, batch: int, heads: int, q_len: int, kv_len: int,
                  device) -> tuple[tuple[Tensor, Tensor] | None, str, bool]:
    """Each row's runs of allowed keys (None when a row has more than :data:`MAX_INTERVALS` runs),
    the way they were found (:attr:`MaskPlan.derived_by`), and whether they are per head.

    The ways, first that can follow ``mod`` first: in closed form (:mod:`.closed_form`), on
    ranges of indices (:mod:`.ranges`: only the cells of tiles it cannot settle are
    evaluated), on every cell (:func:`.every_cell.every_cell`). A predicate that reads the head is worked out
    again with the heads folded into the batch (element ``b * heads + h``): rows ``[B*H, Lq, K]``,
    or ``[1, Lq, K]`` when every head and batch element comes out the same.
    """
    try:
        return (*_one_set(mod, batch, heads, q_len, kv_len, device), False)
    except ReadsHead:
        pass
    rows, way = _one_set(mod, batch, heads, q_len, kv_len, device, per_head=True)
    return rows, way, rows is not None and rows[0].shape[0] > 1


def _one_set(mod, batch: int, heads: int, q_len: int, kv_len: int, device,
             per_head: bool = False) -> tuple[tuple[Tensor, Tensor] | None, str]:
    """:func:`row_intervals` for rows shared by every head (raises :class:`.stand_ins.ReadsHead` when
    they are not), or ``per_head``: for the heads folded into the batch (element ``b * heads + h``)."""
    fold = heads if per_head else 1
    if per_head:
        def whole(b, h, q_idx, kv_idx):  # the predicate of one folded element
            return mod(b // fold, b % fold, q_idx, kv_idx)

        batch, heads = batch * heads, 1
    else:
        whole = mod
    if torch.device(device).type == "cpu":
        def by_ranges():
            return pack(*ranges.flat_runs(whole, batch, heads, q_len, kv_len), q_len, kv_len)

        closed = functools.partial(closed_form.interval_tables, mod, batch, heads, q_len, kv_len,
                                   most=MAX_INTERVALS, fold=fold)
        for name, way in (("closed form", closed),
                          ("ranges", by_ranges)):
            try:
                return way(), name
            except ReadsHead:
                raise
            except CannotFollow:  # this way cannot follow the predicate: the next one decides
                continue
    return every_cell(whole, batch, heads, q_len, kv_len, device), "every cell"

