"""The tile plan of the tile backends: which (query tile, key block) pairs to compute, and how.

Queries are cut into tiles of ``q_tile`` rows and keys into blocks of ``kv_block`` columns. Each
pair is **empty** (skipped), **full** (every real query row may attend every key: no mask is
evaluated) or **partial** (the mask is evaluated on it). Causal and window masks are classified
analytically in ``O(tiles x blocks)``; a ``mask_mod`` or dense mask is evaluated once on the tiles
the analytic part leaves non-empty, and its verdict refines the plan.

Consecutive non-empty blocks of a tile form *chunks* of at most ``kv_chunk`` keys. Chunks with the
same layout (width and partial-block pattern) from different tiles are computed together, as one
batched matmul, which is what makes a 2-core CPU fast; each batch holds at most ``score_budget``
scores, so memory stays ``O(tile)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

EMPTY, FULL, PARTIAL = 0, 1, 2


@dataclass(frozen=True)
class Batch:
    """Chunks computed together: one chunk per tile in ``tiles``, all with the same layout.

    ``tiles`` and ``starts`` (first key of each chunk) are ``[J]``; ``width`` keys per chunk;
    ``partial`` lists the ``(first, end)`` column spans, relative to the chunk, whose mask must be
    evaluated. ``tile_range`` is ``(t0, t1)`` when the tiles are ``t0, t0 + 1, ..., t1 - 1``.
    """

    tiles: Tensor
    starts: Tensor
    width: int
    partial: tuple[tuple[int, int], ...]
    tile_range: tuple[int, int] | None


def _row_bounds(q_len: int, kv_len: int, offset: int, is_causal: bool,
                window: tuple[int | None, int | None] | None) -> tuple[Tensor, Tensor]:
    """First and last key each query row may attend (``lo > hi``: the row attends nothing)."""
    p = torch.arange(q_len, dtype=torch.int64) + offset
    lo = torch.zeros(q_len, dtype=torch.int64)
    hi = torch.full((q_len,), kv_len - 1, dtype=torch.int64)
    if is_causal:
        hi = torch.minimum(hi, p)
    if window is not None:
        left, right = window
        if left is not None:
            lo = torch.maximum(lo, p - left)
        if right is not None:
            hi = torch.minimum(hi, p + right)
    return lo, hi


def analytic_kinds(q_len: int, kv_len: int, q_tile: int, kv_block: int, *, offset: int,
                   is_causal: bool, window) -> Tensor:
    """``[tiles, blocks]`` int8 of EMPTY/FULL/PARTIAL from the causal and window masks alone.

    Every row's allowed keys form one interval ``[lo, hi]`` and both ends grow with the row, so
    the keys a tile touches form one interval too; a block is full when the tile's first row
    already reaches its end and its last row still reaches its start. A block cut short by the
    end of the keys is partial (its padding columns must be masked).
    """
    n_tiles, n_blocks = -(-q_len // q_tile), -(-kv_len // kv_block)
    lo, hi = _row_bounds(q_len, kv_len, offset, is_causal, window)
    rows = torch.arange(n_tiles * q_tile).view(n_tiles, q_tile)
    real = rows < q_len
    live = torch.nn.functional.pad(lo <= hi, (0, n_tiles * q_tile - q_len)).view(n_tiles, q_tile)
    first = torch.where(live, rows, q_len - 1).amin(1)  # first live row of each tile
    last = torch.where(live, rows, 0).amax(1)  # last live row
    r0 = rows[:, 0]
    r_end = torch.clamp(r0 + q_tile, max=q_len) - 1  # last real row
    ks = torch.arange(n_blocks, dtype=torch.int64) * kv_block
    ke = torch.clamp(ks + kv_block, max=kv_len) - 1  # last real key of each block
    touched = (ks <= hi[last, None]) & (ke >= lo[first, None]) & live.any(1, keepdim=True)
    every_row = (live | ~real).all(1, keepdim=True)
    full = touched & (ks >= lo[r_end, None]) & (ke <= hi[r0, None]) & every_row & (ks + kv_block <= kv_len)
    return torch.where(full, FULL, torch.where(touched, PARTIAL, EMPTY)).to(torch.int8)


def refine_kinds(kinds: Tensor, allowed: Callable[[Tensor, Tensor], Tensor], q_len: int, q_tile: int,
                 kv_block: int, kv_chunk: int) -> Tensor:
    """Evaluate ``allowed(q_idx [Tq, 1], kv_idx [1, W]) -> bool [..., Tq, W]`` on non-empty blocks.

    A block where nothing is allowed becomes EMPTY; a block the analysis called FULL stays FULL
    only when everything is allowed; anything else is PARTIAL.
    """
    kinds = kinds.clone()
    per = max(1, kv_chunk // kv_block)
    for t in range(kinds.shape[0]):
        blocks = (kinds[t] != EMPTY).nonzero().flatten().tolist()
        if not blocks:
            continue
        q = torch.arange(t * q_tile, min((t + 1) * q_tile, q_len)).view(-1, 1)
        first, last = blocks[0], blocks[-1]
        for c0 in range(first, last + 1, per):
            c1 = min(c0 + per, last + 1)
            kv = torch.arange(c0 * kv_block, c1 * kv_block).view(1, -1)
            m = allowed(q, kv)
            m = m.reshape(-1, *m.shape[-2:]) if m.dim() >= 2 else m.view(1, 1, -1)
            m = torch.broadcast_to(m, (m.shape[0], q.shape[0], kv.shape[1]))
            m = m.reshape(m.shape[0], q.shape[0], c1 - c0, kv_block)
            anyb = m.any(-1).any(-2).any(0)
            allb = m.all(-1).all(-2).all(0)
            old = kinds[t, c0:c1]
            new = torch.where(~anyb, EMPTY, torch.where(allb & (old == FULL), FULL, PARTIAL)).to(torch.int8)
            kinds[t, c0:c1] = torch.where(old == EMPTY, old, new)
    return kinds


def plan_batches(kinds: Tensor, kv_block: int, kv_chunk: int, rows_per_tile: int,
                 score_budget: int) -> list[Batch]:
    """Cut each tile's non-empty blocks into chunks and group equal layouts into batches.

    ``rows_per_tile`` is the number of scores one tile contributes per key (batch x heads x
    ``q_tile``); a batch holds at most ``score_budget`` scores (at least one chunk).
    """
    per = max(1, kv_chunk // kv_block)
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    rows = kinds.tolist()
    for t, row in enumerate(rows):
        seen: dict[tuple, int] = defaultdict(int)
        c, n = 0, len(row)
        while c < n:
            if row[c] == EMPTY:
                c += 1
                continue
            end = c
            while end < n and row[end] != EMPTY and end - c < per:
                end += 1
            pattern = tuple(row[c:end])
            # A tile appears at most once per batch, so its k-th chunk of a layout goes to round k.
            groups[(pattern, seen[pattern])].append((t, c))
            seen[pattern] += 1
            c = end
    batches = []
    for (pattern, _), jobs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        width = len(pattern) * kv_block
        spans = _partial_spans(pattern, kv_block)
        per_batch = max(1, score_budget // max(1, rows_per_tile * width))
        for i in range(0, len(jobs), per_batch):
            part = jobs[i:i + per_batch]
            tiles = [t for t, _ in part]
            contiguous = tiles == list(range(tiles[0], tiles[0] + len(tiles)))
            batches.append(Batch(
                tiles=torch.tensor(tiles, dtype=torch.int64),
                starts=torch.tensor([c * kv_block for _, c in part], dtype=torch.int64),
                width=width,
                partial=spans,
                tile_range=(tiles[0], tiles[-1] + 1) if contiguous else None,
            ))
    return batches


def _partial_spans(pattern: tuple[int, ...], kv_block: int) -> tuple[tuple[int, int], ...]:
    spans: list[list[int]] = []
    for i, kind in enumerate(pattern):
        if kind != PARTIAL:
            continue
        if spans and spans[-1][1] == i * kv_block:
            spans[-1][1] = (i + 1) * kv_block
        else:
            spans.append([i * kv_block, (i + 1) * kv_block])
    return tuple((a, b) for a, b in spans)
