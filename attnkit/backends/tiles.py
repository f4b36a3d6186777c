"""The tile backends: exact attention with programmable masks and scores, in O(tile) memory.

Queries are cut into tiles and keys into blocks (Rabe & Staats 2021; FlashAttention, Dao et al.
2022). A plan made once per call (:mod:`.tile_schedule`) marks each (tile, block) pair empty, full or
partial; empty pairs are skipped, the mask is evaluated only on partial ones, and chunks with the
same layout from many tiles go through one batched matmul. Each chunk takes a fused
``torch.softmax`` (one cache-friendly pass, where max/subtract/exp/sum would be four passes over a
tile larger than the cache) and chunks of one tile are merged through their log-sum-exps
(``merge_partials``, the online softmax). The backward pass recomputes each tile's probabilities
from the saved log-sum-exp (FlashAttention-2; a tile covered by a single chunk uses the fused
softmax backward) and pushes the score gradient through ``score_mod`` with autograd, which also
gives the gradients of the tensors a score_mod captures (an ALiBi slope or a relative-position
table as ``nn.Parameter``, found by :mod:`attnkit.closures`). That is the ``"tiles"`` backend.

Without a ``score_mod`` nothing needs the scores as a tensor, and on CPU each batch of chunks can be
one call of PyTorch's fused flash-attention kernel instead (:mod:`._fused`): same plan, same merge,
no score tile in memory, so a chunk can be a tile's whole row of keys. That is the
``"fused_tiles"`` backend. Masks whose rows are a few intervals go further, to the ``"band"``
backend (:mod:`.band`).

Semantics match the reference backend: ``mask_mod``/``score_mod`` get raw indices (FlexAttention's
convention); ``is_causal`` and ``window`` align bottom-right; ``score_mod`` sees
``q . k * scale + bias``; rows with nothing to attend give zeros and zero gradients; half types
are computed in float32.

The index tensors handed to ``mask_mod``/``score_mod`` broadcast against a 6-D score tile
``[B, Hkv, J, G, Tq, W]`` (``h = hkv * G + g``), so predicates written with elementwise ops and
tensor indexing (as FlexAttention requires too) work unchanged.

Plain PyTorch, for a reader (what one tile computes)::

    s = score_mod(q_tile @ k_chunk.T * scale + bias, b, h, q_idx, kv_idx).masked_fill(~allowed, -inf)
    out_c, lse_c = torch.softmax(s, -1) @ v_chunk, torch.logsumexp(s, -1)
    lse_new = logaddexp(lse, lse_c)
    out = out * exp(lse - lse_new) + out_c * exp(lse_c - lse_new); lse = lse_new
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import scores
from ..call import Call
from ..closures import captured_tensors, check_covered
from ..dtypes import compute_dtype
from ..ops.tiles import merge_partials
from . import _fused, refusals, tile_schedule
from .refusals import Refusal, reasons

#: Default tile sizes of the plain path, chosen by single-thread CPU time on this 2-core machine
#: (window and causal, n = 8192): 64-256 rows differ by < 10%; a score budget of 2^18-2^20 keeps
#: tiles near the cache.
Q_TILE = 128
KV_BLOCK = 128
KV_CHUNK = 1024
#: Most scores held at once by one batched matmul (float32: 4 bytes each).
SCORE_BUDGET = 1 << 20

#: The fused path (no score_mod) holds no scores, so a chunk is a tile's whole row. Its tiles are
#: ``(q_tile, kv_block)`` = FUSED_BAND_TILE for a narrow band (window left + right < FUSED_BAND):
#: small tiles compute little of the band's masked corners. FUSED_CAUSAL_TILE for plain causal masks:
#: square diagonal blocks go to the kernel's own causal mode, and few large calls keep both threads
#: busy. Chosen by measurement on 2 cores at n = 8192 (``attnkit bench blockwise``).
#: FUSED_TILE for everything else (mask_mod, dense masks): smaller tiles skip more.
FUSED_BAND_TILE = (64, 64)
FUSED_CAUSAL_TILE = (1024, 1024)
FUSED_TILE = (256, 128)
FUSED_BAND = 1024
FUSED_KV_CHUNK = 1 << 40  # whole rows
#: Largest additive mask (elements) handed to one fused call; wider chunks are split (see
#: ``_fused_segments``).
FUSED_MASK_CACHE = 1 << 16

_NEG_INF = float("-inf")


_SHARED_REFUSALS = (
    Refusal(lambda c: torch.compiler.is_compiling(),
            "the tile backends plan their tiles on the host, from the mask's values, which torch.compile cannot "
            "trace (build an attnkit.mask_plan outside the compiled code for the banded kernel)"),
    Refusal(lambda c: c.bias is not None and c.bias.requires_grad and torch.is_grad_enabled(),
            "a bias that requires grad would need a dense gradient (use score_mod)"),
)


class _TileKernel:
    """What the two tile backends share: tile sizes, refusals, the call; each makes its own plan of tiles
    (:meth:`_plan`), which says which path the chunks take. See the module docstring.

    Args:
        q_tile: query rows per tile (None: the default of the path).
        kv_block: key columns per block (the unit of the empty/full/partial schedule).
        kv_chunk: most keys one tile attends in one matmul.
        score_budget: most scores held by one batched matmul.

    Raises:
        ValueError: a size that is not a positive int or None.
    """

    name: str
    REFUSALS: tuple[Refusal, ...]

    def __init__(self, *, q_tile: int | None = None, kv_block: int | None = None, kv_chunk: int | None = None,
                 score_budget: int | None = None):
        for arg, val in (("q_tile", q_tile), ("kv_block", kv_block), ("kv_chunk", kv_chunk),
                         ("score_budget", score_budget)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
                raise ValueError(f"{arg} must be a positive int or None, got {val!r}")
        self.q_tile, self.kv_block, self.kv_chunk, self.score_budget = q_tile, kv_block, kv_chunk, score_budget

    def not_supported_reasons(self, req: Call) -> list[str]:
        return reasons(self.REFUSALS, req)

    def __call__(self, req: Call) -> tuple[Tensor, None]:
        why = self.not_supported_reasons(req)
        if why:  # select() asks first; this is a direct call
            raise refusals.refused(self.name, req, why)
        captured: list[Tensor] = []
        if req.score_mod is not None and torch.is_grad_enabled():
            captured = captured_tensors(req.score_mod)
            check_covered(req.score_mod, captured, compute_dtype(req.query.dtype), req.query.device)
        out = _TilesFn.apply(self._plan(req), req.query, req.key, req.value, *captured)
        return out, None

    def _plan(self, req: Call) -> _Setup:
        """This kernel's plan of tiles for ``req``: each subclass makes its own."""
        raise NotImplementedError


class TilesBackend(_TileKernel):
    """``"tiles"``: the plain path, for any ``score_mod``: matmul, ``score_mod``, softmax, per chunk."""

    name = "tiles"
    REFUSALS = (refusals.weights("tiles"), refusals.dropout("tiles"), *_SHARED_REFUSALS)

    def _plan(self, req: Call) -> _Setup:
        return _plain_setup(req, self)


class FusedTilesBackend(_TileKernel):
    """``"fused_tiles"``: the same schedule, each chunk one call of PyTorch's fused CPU flash kernel
    (:mod:`._fused`); serves calls without a ``score_mod``."""

    name = "fused_tiles"
    REFUSALS = (
        refusals.weights("fused_tiles"), refusals.dropout("fused_tiles"), *_SHARED_REFUSALS,
        Refusal(lambda c: not _fused_serves(c),
                "PyTorch's fused CPU kernel needs no score_mod, a CPU tensor of float32/float64 (or a half type), "
                "values as wide as queries and a torch whose kernel passes its self-check"),
    )

    def _plan(self, req: Call) -> _Setup:
        return _fused_setup(req, self)


def _fused_serves(req: Call) -> bool:
    return (req.score_mod is None and req.value.shape[-1] == req.query.shape[-1]
            and _fused.usable(req.query.device, compute_dtype(req.query.dtype)))


def _structured(req: Call) -> bool:
    """Only causal/window masks: what may attend depends on ``kv - q`` alone, tile by tile."""
    return req.mask_mod is None and req.mask is None and req.bias is None


@dataclass
class _Setup:
    """Everything about one call that is not a tensor to differentiate."""

    req: Call
    batch: int  # all batch dims flattened
    heads: int
    kv_heads: int
    q_tile: int
    kv_block: int
    n_tiles: int
    kv_padded: int
    fused: bool = False
    batches: list = field(default_factory=list)  # the forward's plan
    plan_bwd: Callable[[], list] | None = None  # the backward's plan, when it differs (made on demand)
    mask_cache: dict = field(default_factory=dict)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @functools.cached_property
    def bwd_batches(self) -> list:
        return self.plan_bwd() if self.plan_bwd is not None else self.batches


def _plain_setup(req: Call, cfg: _TileKernel) -> _Setup:
    """The ``"tiles"`` plan: matmul, ``score_mod`` and softmax per chunk, a batch holding ``B*H*Tq`` scores per key."""
    st, kinds, chunk, budget = _schedule(req, cfg, Q_TILE, KV_BLOCK, KV_CHUNK, fused=False)
    if kinds is not None:
        st.batches = tile_schedule.plan_batches(kinds, st.kv_block, chunk, st.batch * req.heads * st.q_tile, budget)
    return st


def _fused_setup(req: Call, cfg: _TileKernel) -> _Setup:
    """The ``"fused_tiles"`` plan: PyTorch's fused kernel per chunk, tiles sized for the mask's shape."""
    win = req.window or (None, None)
    if None not in win and sum(win) < FUSED_BAND:
        tq, bk = FUSED_BAND_TILE
    elif req.is_causal and win[0] is None and _structured(req):
        tq, bk = FUSED_CAUSAL_TILE
    else:
        tq, bk = FUSED_TILE
    st, kinds, chunk, budget = _schedule(req, cfg, tq, bk, FUSED_KV_CHUNK, fused=True)
    if kinds is None:
        return st
    # What a batch holds per key, under the budget: no scores. The forward holds only a mask, one
    # broadcast tile for causal/window (so few, large kernel calls) or per head; the backward also the
    # kernel's fresh key and value gradients (B*Hkv*E), and fresh buffers are page-faulted in on every call.
    per_head = st.batch * req.kv_heads * max(req.query.shape[-1], req.heads // req.kv_heads * st.q_tile)
    bk = st.kv_block
    st.batches = tile_schedule.plan_batches(kinds, bk, chunk, st.q_tile if _structured(req) else per_head, budget)
    st.plan_bwd = lambda: tile_schedule.plan_batches(kinds, bk, chunk, per_head, budget)
    return st


def _schedule(req: Call, cfg: _TileKernel, tq: int, bk: int, chunk: int,
              fused: bool) -> tuple[_Setup, Tensor | None, int, int]:
    """What both plans share: the tile sizes (``cfg``'s, else the path's ``tq``, ``bk``, ``chunk``), the
    :class:`_Setup`, and each (tile, block) pair's kind (None for an empty call); with the chunk and budget."""
    lq, lk = req.q_len, req.kv_len
    # Never wider than the sequence (rounded up to 64): padding rows would be computed too.
    tq = cfg.q_tile or min(tq, max(64, -(-lq // 64) * 64))
    bk = cfg.kv_block or min(bk, max(64, -(-lk // 64) * 64))
    chunk = max(cfg.kv_chunk or chunk, bk)
    budget = cfg.score_budget or SCORE_BUDGET
    batch = math.prod(req.batch_shape)
    st = _Setup(req, batch, req.heads, req.kv_heads, tq, bk, -(-lq // tq), -(-lk // bk) * bk, fused)
    if lq == 0 or lk == 0 or batch == 0:
        return st, None, chunk, budget
    # The mask plan's tile kinds (from its intervals, no cell evaluated) where it has them;
    # otherwise, and for a dense mask, the predicate is evaluated on the tiles still non-empty.
    plan = req.mask_plan
    kinds = plan.kinds(tq, bk) if plan is not None else None
    exact = kinds is not None
    if kinds is None:
        kinds = torch.full((st.n_tiles, -(-lk // bk)), tile_schedule.FULL, dtype=torch.int8)
        if lk % bk:
            kinds[:, -1] = tile_schedule.PARTIAL  # the padding keys of the last block are masked
    if (plan is not None and not exact) or req.mask is not None:
        dev = req.query.device
        b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(req.heads, device=dev).view(1, -1, 1, 1)
        kinds = tile_schedule.refine_kinds(
            kinds, lambda q, kv: _allowed(st, b, h, q.to(dev)[None, None], kv.to(dev)[None, None]),
            lq, tq, bk, chunk)
    return st, kinds, chunk, budget


def _dense(t: Tensor, batch_shape: torch.Size, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """Gather ``t`` (broadcastable to ``[*batch_shape, H, Lq, Lk]``) at broadcasting indices."""
    nd = len(batch_shape) + 3
    t = t.reshape((1,) * (nd - t.dim()) + tuple(t.shape))
    parts, rem = [], b
    for size in reversed(batch_shape):
        parts.append(rem % size)
        rem = rem // size
    index = parts[::-1] + [h, q, kv]
    zero = b.new_zeros(())
    return t[tuple(ix if t.shape[d] != 1 else zero for d, ix in enumerate(index))]


def _allowed(st: _Setup, b: Tensor, h: Tensor, q: Tensor, kv_raw: Tensor) -> Tensor:
    """What may attend at these indices: every mask of the request and ``kv < Lk`` (padding)."""
    req = st.req
    kv = kv_raw.clamp(max=req.kv_len - 1)
    ok = kv_raw < req.kv_len
    mod = req.structured_mask_mod()
    if mod is not None:
        ok = ok & mod(b, h, q, kv)
    if req.mask is not None:
        ok = ok & _dense(req.mask, req.batch_shape, b, h, q, kv)
    return ok


# --------------------------------------------------------------------------------------------
# Layouts: heads first, then tiles, so that one tile's keys are a plain slice (no copy).
# --------------------------------------------------------------------------------------------


def _to_tiles(x: Tensor, st: _Setup, scale: float = 1.0) -> Tensor:
    """``[..., H, Lq, D]`` -> ``[B, Hkv, n_tiles, G * Tq, D]`` times ``scale`` (padded rows are 0).

    A view of ``x`` when nothing needs padding, scaling or interleaving (one head per group).
    """
    b, hkv, g, tq, lq, d = st.batch, st.kv_heads, st.groups, st.q_tile, st.req.q_len, x.shape[-1]
    if g == 1 and lq % tq == 0 and scale == 1.0:
        return x.reshape(b, hkv, st.n_tiles, tq, d)
    out = x.new_zeros(b, hkv, st.n_tiles, g, tq, d)
    src = x.reshape(b, hkv, g, lq, d)
    full = lq // tq
    if full:
        out[:, :, :full].copy_(src[:, :, :, : full * tq].view(b, hkv, g, full, tq, d).transpose(2, 3))
    if lq % tq:
        out[:, :, full, :, : lq % tq] = src[:, :, :, full * tq:]
    if scale != 1.0:
        out.mul_(scale)
    return out.view(b, hkv, st.n_tiles, g * tq, d)


def _from_tiles(x: Tensor, st: _Setup) -> Tensor:
    """Inverse of :func:`_to_tiles`, back to ``[..., H, Lq, D]``."""
    b, hkv, g, tq, d = st.batch, st.kv_heads, st.groups, st.q_tile, x.shape[-1]
    x = x.view(b, hkv, st.n_tiles, g, tq, d).transpose(2, 3)
    x = x.reshape(b, st.heads, st.n_tiles * tq, d)[:, :, : st.req.q_len]
    return x.reshape(*st.req.batch_shape, st.heads, st.req.q_len, d)


def _to_rows(x: Tensor, st: _Setup) -> Tensor:
    """``[..., Hkv, Lk, D]`` -> ``[B, Hkv, Lk_padded, D]`` (padded keys are zero)."""
    x = x.reshape(st.batch, st.kv_heads, st.req.kv_len, x.shape[-1])
    return torch.nn.functional.pad(x, (0, 0, 0, st.kv_padded - st.req.kv_len)) if st.kv_padded > st.req.kv_len \
        else x


def _from_rows(x: Tensor, st: _Setup) -> Tensor:
    x = x[:, :, : st.req.kv_len]
    return x.reshape(*st.req.batch_shape, st.kv_heads, st.req.kv_len, x.shape[-1])


def _take(x: Tensor, bt: tile_schedule.Batch) -> Tensor:
    return x[:, :, bt.tile_range[0]:bt.tile_range[1]] if bt.tile_range else x.index_select(2, bt.tiles)


def _put(x: Tensor, bt: tile_schedule.Batch, value: Tensor) -> None:
    if bt.tile_range:
        x[:, :, bt.tile_range[0]:bt.tile_range[1]] = value
    else:
        x.index_copy_(2, bt.tiles, value)


def _add(x: Tensor, bt: tile_schedule.Batch, value: Tensor) -> None:
    if bt.tile_range:
        x[:, :, bt.tile_range[0]:bt.tile_range[1]] += value
    else:
        x.index_add_(2, bt.tiles, value)


# --------------------------------------------------------------------------------------------
# One batch of chunks
# --------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """The operands and index grids of one batch of chunks."""

    q: Tensor  # [B, Hkv, J, G*Tq, E] (pre-scaled, except on the fused path)
    k: Tensor  # [B, Hkv, J, W, E]
    v: Tensor  # [B, Hkv, J, W, Ev]
    key_index: Tensor  # [J * W] positions in the padded key layout
    b: Tensor  # index grids broadcasting to [B, Hkv, J, G, Tq, W]
    h: Tensor
    q_raw: Tensor
    kv_raw: Tensor


def _gather(st: _Setup, bt: tile_schedule.Batch, qt: Tensor, kr: Tensor, vr: Tensor) -> _Chunk:
    dev = qt.device
    j, w, tq, g, hkv = len(bt.tiles), bt.width, st.q_tile, st.groups, st.kv_heads
    key_index = (bt.starts.view(-1, 1) + torch.arange(w)).flatten().to(dev)
    step = _even_step(bt.starts)
    if step is not None:  # chunks start at even steps (a window, a causal diagonal): a view, no copy
        k, v = _overlapping(kr, int(bt.starts[0]), step, j, w), _overlapping(vr, int(bt.starts[0]), step, j, w)
    else:
        k = kr.index_select(2, key_index).view(st.batch, hkv, j, w, kr.shape[-1])
        v = vr.index_select(2, key_index).view(st.batch, hkv, j, w, vr.shape[-1])
    rows = bt.tiles.view(-1, 1) * tq + torch.arange(tq)
    return _Chunk(
        q=_take(qt, bt), k=k, v=v, key_index=key_index,
        b=torch.arange(st.batch, device=dev).view(-1, 1, 1, 1, 1, 1),
        h=(torch.arange(hkv, device=dev).view(-1, 1) * g + torch.arange(g, device=dev)).view(1, hkv, 1, g, 1, 1),
        q_raw=rows.to(dev).view(1, 1, j, 1, tq, 1),
        kv_raw=key_index.view(1, 1, j, 1, 1, w),
    )


def _even_step(starts: Tensor) -> int | None:
    """The common difference of ``starts`` (0 for a single chunk), or None when there is none."""
    if starts.numel() == 1:
        return 0
    steps = starts.diff()
    return int(steps[0]) if bool((steps == steps[0]).all()) and int(steps[0]) >= 0 else None


def _overlapping(x: Tensor, first: int, step: int, j: int, w: int) -> Tensor:
    """Rows ``first + i * step ... + w`` of ``x [B, Hkv, L, E]`` as a ``[B, Hkv, j, w, E]`` view."""
    b, h, _, e = x.stride()
    return x.as_strided((x.shape[0], x.shape[1], j, w, x.shape[3]), (b, h, step * x.stride(2), x.stride(2), e),
                        x.storage_offset() + first * x.stride(2))


def _mask_bias(st: _Setup, bt: tile_schedule.Batch, c: _Chunk, a: int, e: int, keep: float = 0.0) -> Tensor:
    """``keep / -inf`` for columns ``a:e`` of the batch: additive with ``keep = 0`` (the fused
    kernel's mask), a limit for ``torch.fmin`` with ``keep = inf`` (the plain path's).

    Causal and window masks depend only on ``kv - q`` and on ``kv < Lk``, so their tiles repeat
    along the diagonal and are computed once per call.
    """
    req = st.req
    key = None
    if req.mask_mod is None and req.mask is None:
        rel = (bt.starts - bt.tiles * st.q_tile).tolist()
        ends = (bt.starts + e).clamp(max=req.kv_len).tolist()
        key = (tuple(rel), tuple(x - s for x, s in zip(ends, bt.starts.tolist(), strict=True)), a, e, keep)
        hit = st.mask_cache.get(key)
        if hit is not None:
            return hit
        q = c.q_raw
    else:
        q = c.q_raw.clamp(max=req.q_len - 1)
    ok = _allowed(st, c.b, c.h, q, c.kv_raw[..., a:e])
    bias = torch.full(ok.shape, keep, dtype=c.q.dtype, device=ok.device).masked_fill_(~ok, _NEG_INF)
    if key is not None and len(st.mask_cache) < 256:
        st.mask_cache[key] = bias
    return bias


_NO_MASK = (None, None, False)


def _fused_segments(st: _Setup, bt: tile_schedule.Batch, c: _Chunk) -> list[tuple]:
    """``(first, end, mask, dead, causal)`` column spans of the batch, one fused-kernel call each.

    A mask over the whole chunk that stays in cache is cheaper than more calls (a window's
    tiles: one call). A larger one (a causal tile's row of thousands of keys, masked only on the
    diagonal) would be read for every head, so full spans then go without a mask and only
    partial spans get one. A dense ``bias`` touches every column: one span.
    """
    if not bt.partial and st.req.bias is None:
        return [(0, bt.width, *_NO_MASK)]
    if st.req.bias is not None or st.groups * st.q_tile * bt.width <= FUSED_MASK_CACHE:
        return [(0, bt.width, *_fused_mask(st, bt, c, 0, bt.width))]
    spans, at = [], 0
    for a, e in bt.partial:
        if a > at:
            spans.append((at, a, *_NO_MASK))
        spans.append((a, e, *_fused_mask(st, bt, c, a, e)))
        at = e
    if at < bt.width:
        spans.append((at, bt.width, *_NO_MASK))
    return spans


def _fused_mask(st: _Setup, bt: tile_schedule.Batch, c: _Chunk, a: int, e: int) -> tuple:
    """Bias and masks of columns ``a:e`` (whole partial spans) as one additive
    ``[J or 1, 1 or B*Hkv, G*Tq, e - a]`` tensor for the kernel, its dead rows, and whether it is
    the kernel's own causal mask (a square diagonal block: then ``(None, None, True)``, and the
    kernel skips the blocks above the diagonal instead of reading a mask)."""
    req = st.req
    key = None
    if _structured(req):
        rel = (bt.starts - bt.tiles * st.q_tile).tolist()
        ends = ((bt.starts + e).clamp(max=req.kv_len) - bt.starts).tolist()
        if len(rel) > 1 and len(set(rel)) == 1 and len(set(ends)) == 1:  # one mask tile, broadcast over J
            return _fused_mask(st, replace(bt, tiles=bt.tiles[:1], starts=bt.starts[:1], tile_range=None),
                               replace(c, q=c.q[:, :, :1], q_raw=c.q_raw[:, :, :1], kv_raw=c.kv_raw[:, :, :1]), a, e)
        # The partial pattern is part of the key: full columns get no mask, and whether a column
        # is full depends on the tile's real rows (the last tile's padding rows do not count).
        key = ("fused", tuple(rel), tuple(ends), a, e, bt.partial)
        if key in st.mask_cache:
            return st.mask_cache[key]
    mask = c.q.new_zeros(())
    if req.bias is not None:
        q, kv = c.q_raw.clamp(max=req.q_len - 1), c.kv_raw[..., a:e].clamp(max=req.kv_len - 1)
        mask = _dense(req.bias, req.batch_shape, c.b, c.h, q, kv).to(c.q.dtype)
    for pa, pe in bt.partial:
        if a <= pa and pe <= e:
            mask = mask + torch.nn.functional.pad(_mask_bias(st, bt, c, pa, pe), (pa - a, e - pe))
    j, g, tq, w = c.q.shape[2], st.groups, st.q_tile, e - a
    heads = 1 if mask.shape[0] == mask.shape[1] == 1 else st.batch * st.kv_heads
    full = (1, 1) if heads == 1 else (st.batch, st.kv_heads)
    mask = mask.expand(*full, j, g, tq, w).movedim(2, 0).reshape(j, heads, g * tq, w)
    out = (None, None, True) if _is_causal_square(mask) else (mask, _fused.dead_rows(mask), False)
    if key is not None and len(st.mask_cache) < 256:
        st.mask_cache[key] = out
    return out


def _is_causal_square(mask: Tensor) -> bool:
    rows, cols = mask.shape[-2:]
    if rows != cols or rows < 2:
        return False
    above = torch.ones(rows, cols, dtype=torch.bool, device=mask.device).triu_(1)
    return bool((torch.isneginf(mask) == above).all()) and bool((mask[..., ~above] == 0).all())


def _fold(x: Tensor) -> Tensor:
    """``[B, Hkv, J, ...]`` -> ``[J, B*Hkv, ...]``, the fused kernel's batch and head dims."""
    return x.movedim(2, 0).flatten(1, 2)


def _unfold(x: Tensor, st: _Setup) -> Tensor:
    """Inverse of :func:`_fold`."""
    return x.unflatten(1, (st.batch, st.kv_heads)).movedim(0, 2)


def _scores(st: _Setup, bt: tile_schedule.Batch, c: _Chunk, *, track_mod: bool = False):
    """Masked, modified scores ``[B, Hkv, J, G, Tq, W]``, a fresh tensor safe to change in place.

    With ``track_mod`` also returns ``(x, y)``: the score_mod's input (a leaf requiring grad) and
    its output, for the backward pass.
    """
    req = st.req
    s = torch.matmul(c.q, c.k.transpose(-2, -1))  # [B, Hkv, J, G*Tq, W]
    s = s.view(st.batch, st.kv_heads, s.shape[2], st.groups, st.q_tile, bt.width)
    if req.bias is not None or req.score_mod is not None:
        q = c.q_raw.clamp(max=req.q_len - 1)
        kv = c.kv_raw.clamp(max=req.kv_len - 1)
    if req.bias is not None:
        s += _dense(req.bias, req.batch_shape, c.b, c.h, q, kv).to(s.dtype)
    graph = None
    if req.score_mod is not None:
        if track_mod:
            x = s.requires_grad_()
            with torch.enable_grad():
                y = scores.apply(req.score_mod, x, c.b, c.h, q, kv)
            graph = (x, y)
            s = torch.broadcast_to(y.detach(), x.shape).clone()
        else:
            y = scores.apply(req.score_mod, s, c.b, c.h, q, kv)
            s = y if y.shape == s.shape and y.is_contiguous() else torch.broadcast_to(y, s.shape).clone()
    # The mask by selection, never by adding -inf: fmin(x, -inf) is -inf whatever x is (a NaN or +inf
    # the score_mod made at a masked cell goes nowhere), fmin(x, inf) is x for a finite score, and +inf
    # for a NaN one at an allowed cell, which still makes its row NaN. As fast as the add (masked_fill: 20x).
    for a, e in bt.partial:
        torch.fmin(s[..., a:e], _mask_bias(st, bt, c, a, e, keep=math.inf), out=s[..., a:e])
    return s, graph


# --------------------------------------------------------------------------------------------
# Forward and backward over the plan
# --------------------------------------------------------------------------------------------


def _chunk_softmax(s: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim and its log-sum-exp; rows with nothing allowed give ``(0, -inf)``.

    ``torch.softmax`` is one fused, cache-friendly pass per row, where max / subtract / exp / sum
    would be four passes over a tile bigger than the cache. The log-sum-exp follows from the
    largest probability: ``lse = max(s) - log(max(p))``. A row is dead when its largest score is
    ``-inf``; a NaN score makes the maximum NaN, so the row stays NaN (NaN in, NaN out).
    """
    p = torch.softmax(s, -1)
    s_max = s.amax(-1)
    lse = s_max - torch.log(p.amax(-1))
    dead = torch.isneginf(s_max)
    if dead.any():
        p = p.masked_fill_(dead.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(dead, _NEG_INF)
    return p, lse


def _visits(st: _Setup) -> Tensor:
    """How many batches each tile takes part in."""
    count = torch.zeros(st.n_tiles, dtype=torch.int64)
    for bt in st.batches:
        count[bt.tiles] += 1
    return count


def _forward(st: _Setup, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``(out [B, Hkv, n_tiles, G*Tq, Ev], lse [B, Hkv, n_tiles, G*Tq])`` in the compute dtype."""
    qt = _to_tiles(q, st, 1.0 if st.fused else st.req.scale)  # the fused kernel scales by itself
    kr, vr = _to_rows(k, st), _to_rows(v, st)
    rows = st.groups * st.q_tile
    once = bool((_visits(st) == 1).all())  # every tile written exactly once: no need to clear first
    out = (qt.new_empty if once else qt.new_zeros)(st.batch, st.kv_heads, st.n_tiles, rows, v.shape[-1])
    lse = qt.new_full((st.batch, st.kv_heads, st.n_tiles, rows), _NEG_INF)
    visited = torch.zeros(st.n_tiles, dtype=torch.bool)
    for bt in st.batches:
        c = _gather(st, bt, qt, kr, vr)
        if st.fused:
            out_j = lse_j = None
            for a, e, mask, dead, causal in _fused_segments(st, bt, c):
                o, m = _fused.forward(_fold(c.q), _fold(c.k[:, :, :, a:e]), _fold(c.v[:, :, :, a:e]), mask, dead,
                                      st.req.scale, causal)
                o, m = _unfold(o, st), _unfold(m, st)
                out_j, lse_j = (o, m) if out_j is None else merge_partials(out_j, lse_j, o, m)
        else:
            s, _ = _scores(st, bt, c)
            p, lse_j = _chunk_softmax(s.view(*c.q.shape[:-1], bt.width))  # [B, Hkv, J, G*Tq, W]
            out_j = torch.matmul(p, c.v)
        if visited[bt.tiles].any():  # merge with the chunks seen before (online softmax)
            out_j, lse_j = merge_partials(_take(out, bt), _take(lse, bt), out_j, lse_j)
        _put(out, bt, out_j)
        _put(lse, bt, lse_j)
        visited[bt.tiles] = True
    # Rows with no visible key are 0 even where a NaN value met their zero weights (0 * NaN).
    return out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0), lse


def _backward(st: _Setup, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
              captured: tuple[Tensor, ...]):
    scale = 1.0 if st.fused else st.req.scale  # the fused kernel scales by itself
    qt = _to_tiles(q, st, scale)
    kr, vr = _to_rows(k, st), _to_rows(v, st)
    do = _to_tiles(dout, st)
    visits = _visits(st)
    delta = (do * out).sum(-1) if not st.fused and bool((visits > 1).any()) else None  # [B, Hkv, n_tiles, G*Tq]
    # A row the score_mod made NaN (NaN log-sum-exp) has NaN probabilities at its masked cells too
    # (exp(-inf - NaN)): those, and their score gradients, are selected out below, so that its NaN
    # reaches the keys it allows and no other. Never on a finite call.
    nan_rows = not st.fused and bool(torch.isnan(lse).any())
    lse = torch.where(~torch.isinf(lse) if nan_rows else torch.isfinite(lse), lse, 0.0)
    dq = torch.zeros_like(qt)
    dk = kr.new_zeros(st.batch, st.kv_heads, st.kv_padded, kr.shape[-1])
    dv = vr.new_zeros(st.batch, st.kv_heads, st.kv_padded, vr.shape[-1])
    dcap = [torch.zeros_like(t) for t in captured]
    for bt in st.bwd_batches:
        c = _gather(st, bt, qt, kr, vr)
        if st.fused:
            do_j, out_j, lse_j = _fold(_take(do, bt)), _fold(_take(out, bt)), _fold(_take(lse, bt))
            for a, e, mask, _, causal in _fused_segments(st, bt, c):
                dq_j, dk_j, dv_j = _fused.backward(do_j, _fold(c.q), _fold(c.k[:, :, :, a:e]),
                                                   _fold(c.v[:, :, :, a:e]), out_j, lse_j, mask, st.req.scale, causal)
                _add(dq, bt, _unfold(dq_j, st))
                _scatter_kv(dk, dv, bt, c, _unfold(dk_j, st), _unfold(dv_j, st), a, e)
            continue
        s, graph = _scores(st, bt, c, track_mod=st.req.score_mod is not None)
        shape5 = (*c.q.shape[:-1], bt.width)
        masked = torch.isneginf(s).view(shape5) if nan_rows else None
        do_j = _take(do, bt)
        whole = bool((visits[bt.tiles] == 1).all())
        if whole:  # the chunk is the tile's whole row: fused softmax and its fused backward
            p = _chunk_softmax(s.view(shape5))[0]
            if masked is not None:
                p = p.masked_fill_(masked, 0.0)
            dp = torch.matmul(do_j, c.v.transpose(-2, -1))
            ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
        else:  # probabilities under the full row from the saved log-sum-exp (FlashAttention-2)
            p = s.view(shape5).sub_(_take(lse, bt).unsqueeze(-1)).exp_()
            if masked is not None:
                p = p.masked_fill_(masked, 0.0)
            ds = torch.matmul(do_j, c.v.transpose(-2, -1)).sub_(_take(delta, bt).unsqueeze(-1)).mul_(p)
        if masked is not None:
            ds = ds.masked_fill_(masked, 0.0)
        dv_j = torch.matmul(p.transpose(-2, -1), do_j)  # [B, Hkv, J, W, Ev]
        if graph is not None:
            x, y = graph
            grads = torch.autograd.grad(y, [x, *captured], ds.view(x.shape).sum_to_size(y.shape).to(y.dtype),
                                        allow_unused=True)
            ds = grads[0].reshape(shape5) if grads[0] is not None else torch.zeros_like(ds)
            for acc_g, g in zip(dcap, grads[1:], strict=True):
                if g is not None:
                    acc_g += g
        _add(dq, bt, torch.matmul(ds, c.k))
        _scatter_kv(dk, dv, bt, c, torch.matmul(ds.transpose(-2, -1), c.q), dv_j)
    return _from_tiles(dq, st) * scale, _from_rows(dk, st), _from_rows(dv, st), dcap


def _scatter_kv(dk: Tensor, dv: Tensor, bt: tile_schedule.Batch, c: _Chunk, dk_j: Tensor, dv_j: Tensor,
                a: int = 0, e: int | None = None) -> None:
    """Add gradients ``[B, Hkv, J, e - a, E]`` of the batch's key columns ``a:e`` into the key rows."""
    e = bt.width if e is None else e
    if dk_j.shape[2] == 1:
        k0 = int(bt.starts[0])
        dk[:, :, k0 + a:k0 + e] += dk_j[:, :, 0]
        dv[:, :, k0 + a:k0 + e] += dv_j[:, :, 0]
    else:
        index = c.key_index.view(-1, bt.width)[:, a:e].flatten()
        dk.index_add_(2, index, dk_j.flatten(2, 3))
        dv.index_add_(2, index, dv_j.flatten(2, 3))


#: The largest |log-sum-exp| whose float32 rounding (half an ulp: 2**-24 relative) keeps the fused
#: backward's recomputed probabilities within float32's tolerance; beyond it the backward runs in float64.
LSE_FLOAT32_LIMIT = 128.0


def _lse_beyond_float32(lse: Tensor) -> bool:
    """Whether some row's finite log-sum-exp is too large for the fused float32 backward."""
    finite = torch.where(torch.isfinite(lse), lse, 0.0)
    return bool(finite.abs().amax() > LSE_FLOAT32_LIMIT) if finite.numel() else False


class _TilesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st: _Setup, query: Tensor, key: Tensor, value: Tensor, *captured: Tensor) -> Tensor:
        dtype = query.dtype
        compute = compute_dtype(dtype)
        q, k, v = query.to(compute), key.to(compute), value.to(compute)
        out, lse = _forward(st, q, k, v)
        ctx.st = st
        ctx.save_for_backward(query, key, value, out, lse, *captured)
        return _from_tiles(out, st).to(dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        query, key, value, out, lse, *captured = ctx.saved_tensors
        st: _Setup = ctx.st
        compute = compute_dtype(query.dtype)
        if st.fused and compute == torch.float32 and _lse_beyond_float32(lse):
            # PyTorch's fused backward recomputes p = exp(s - lse) from the saved float32 log-sum-exp,
            # off by up to half its ulp: a relative error of |lse| * 2**-24 in every probability, which
            # grows past float32's tolerance once scores reach the hundreds. Such rows are recomputed
            # in float64 (forward statistics included), then rounded once.
            compute, st = torch.float64, dataclasses.replace(st, fused=False)
            out, lse = _forward(st, *(t.to(compute) for t in (query, key, value)))
        dq, dk, dv, dcap = _backward(st, query.to(compute), key.to(compute), value.to(compute), out, lse,
                                     dout.to(compute), tuple(captured))
        return (None, dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
                *(g.to(t.dtype) for g, t in zip(dcap, captured, strict=True)))
