"""Tile kinds: which (query tile, key block) pairs of a mask are empty, full or partial.

The tile kernels cut queries into tiles of ``q_tile`` rows and keys into blocks of ``kv_block``
columns; a pair is **empty** (skipped), **full** (every real row of the tile attends every key of
the block: no mask is evaluated) or **partial** (the mask is evaluated on it). :func:`tile_kinds`
finds the kinds from a plan's intervals without looking at a cell.
"""

from __future__ import annotations

import torch
from torch import Tensor

EMPTY, FULL, PARTIAL = 0, 1, 2


def tile_kinds(starts: Tensor, ends: Tensor, q_len: int, kv_len: int, q_tile: int, kv_block: int) -> Tensor:
    """``[tiles, blocks]`` EMPTY/FULL/PARTIAL from intervals, by difference arrays over blocks.

    A pair is FULL when every real row of the tile, in every batch element, attends every key of
    the block (a block cut short by ``kv_len`` never is: its padding keys must be masked), EMPTY
    when no row attends any of its keys.
    """
    p, lq, k = starts.shape
    nb, nt = -(-kv_len // kv_block), -(-q_len // q_tile)
    row = torch.arange(p * lq).repeat_interleave(k)
    s, e = starts.reshape(-1), ends.reshape(-1)

    def covered(first: Tensor, end: Tensor) -> Tensor:  # blocks first <= c < end, per row
        live = end > first
        d = torch.zeros(p * lq, nb + 1, dtype=torch.int32)
        ones = torch.ones(int(live.sum()), dtype=torch.int32)
        d.index_put_((row[live], first[live]), ones, accumulate=True)
        d.index_put_((row[live], end[live]), -ones, accumulate=True)
        return d.cumsum(1)[:, :nb] > 0

    live = e > s
    touched = covered(torch.where(live, s // kv_block, 0), torch.where(live, (e - 1) // kv_block + 1, 0))
    full = covered((s + kv_block - 1) // kv_block, e // kv_block)
    if kv_len % kv_block:
        full[:, -1] = False
    pad = nt * q_tile - lq
    touched = torch.nn.functional.pad(touched.view(p, lq, nb), (0, 0, 0, pad), value=False)
    full = torch.nn.functional.pad(full.view(p, lq, nb), (0, 0, 0, pad), value=True)
    touched = touched.view(p, nt, q_tile, nb).any(2).any(0)
    full = full.view(p, nt, q_tile, nb).all(2).all(0)
    return torch.where(full & touched, FULL, torch.where(touched, PARTIAL, EMPTY)).to(torch.int8)
