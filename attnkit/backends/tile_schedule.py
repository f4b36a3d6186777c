"""The tile schedule of the tile backends: which (query tile, key block) pairs to compute, and how.

Queries are cut into tiles of ``q_tile`` rows and keys into blocks of ``kv_block`` columns. Each
pair is **empty** (skipped), **full** (every real query row may attend every key: no mask is
evaluated) or **partial** (the mask is evaluated on it). The kinds come from the request's mask
plan (:meth:`attnkit.MaskPlan.kinds`, from each row's key intervals without looking at a
cell) where it has intervals; otherwise, and for a dense mask, the mask is evaluated once on the
tiles still non-empty (:func:`refine_kinds`).

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

from ..maskplan.tile_kinds import EMPTY, FULL, PARTIAL


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
