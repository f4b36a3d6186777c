"""The blockwise backend: exact attention with programmable masks and scores, in O(tile) memory.

Queries are cut into tiles and keys into blocks (Rabe & Staats 2021; FlashAttention, Dao et al.
2022). A plan made once per call (:mod:`._tiling`) marks each (tile, block) pair empty, full or
partial; empty pairs are skipped, ``mask_mod`` runs only on partial ones, and chunks with the same
layout from many tiles go through one batched matmul. Tiles are merged with an online softmax; the
backward pass recomputes each tile's probabilities from the saved log-sum-exp (FlashAttention-2)
and pushes the score gradient through ``score_mod`` with autograd, which also gives the gradients
of the tensors a score_mod captures (an ALiBi slope or a relative-position table as
``nn.Parameter``).

Semantics match the reference backend: ``mask_mod``/``score_mod`` get raw indices (FlexAttention's
convention); ``is_causal`` and ``window`` align bottom-right; ``score_mod`` sees
``q . k * scale + bias``; rows with nothing to attend give zeros and zero gradients; half types
are computed in float32.

The index tensors handed to ``mask_mod``/``score_mod`` broadcast against a 6-D score tile
``[J, B, Hkv, G, Tq, W]`` (``h = hkv * G + g``), so predicates written with elementwise ops and
tensor indexing (as FlexAttention requires too) work unchanged.

Plain PyTorch, for a reader (what one tile computes)::

    s = score_mod(q_tile @ k_chunk.T * scale + bias, b, h, q_idx, kv_idx).masked_fill(~allowed, -inf)
    m_new = max(m, s.amax(-1)); p = exp(s - m_new)
    l = l * exp(m - m_new) + p.sum(-1); acc = acc * exp(m - m_new) + p @ v_chunk
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..request import Request
from . import _tiling
from ._captured import captured_tensors, check_covered

#: Default tile sizes, chosen by measurement on a 2-core CPU (see bench/results/blockwise.md).
Q_TILE = 128
KV_BLOCK = 128
KV_CHUNK = 1024
#: Most scores held at once by one batched matmul (float32: 4 bytes each).
SCORE_BUDGET = 1 << 22

#: Test hook: the largest number of scores one step has held (reset it to 0 to measure a call).
largest_score_tile = 0

_NEG_INF = float("-inf")


class BlockwiseBackend:
    """Exact attention by tiles; see the module docstring.

    Args:
        q_tile: query rows per tile.
        kv_block: key columns per block (the unit of the empty/full/partial plan).
        kv_chunk: most keys one tile attends in one matmul.
        score_budget: most scores held by one batched matmul.
    """

    name = "blockwise"

    def __init__(self, *, q_tile: int | None = None, kv_block: int | None = None,
                 kv_chunk: int | None = None, score_budget: int | None = None):
        for arg, val in (("q_tile", q_tile), ("kv_block", kv_block), ("kv_chunk", kv_chunk),
                         ("score_budget", score_budget)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
                raise ValueError(f"{arg} must be a positive int or None, got {val!r}")
        self.q_tile, self.kv_block, self.kv_chunk, self.score_budget = q_tile, kv_block, kv_chunk, score_budget

    def not_supported_reasons(self, req: Request) -> list[str]:
        reasons = []
        if req.return_weights:
            reasons.append("the blockwise backend never forms the weights (use backend='reference')")
        if req.dropout_p > 0:
            reasons.append("dropout is not implemented in the blockwise backend")
        if req.bias is not None and req.bias.requires_grad and torch.is_grad_enabled():
            reasons.append("a bias that requires grad would need a dense gradient (use score_mod)")
        return reasons

    def __call__(self, req: Request) -> tuple[Tensor, None]:
        captured: list[Tensor] = []
        if req.score_mod is not None and torch.is_grad_enabled():
            captured = captured_tensors(req.score_mod)
            check_covered(req.score_mod, captured, _compute_dtype(req.query.dtype), req.query.device)
        st = _setup(req, self)
        out = _BlockwiseFn.apply(st, req.query, req.key, req.value, *captured)
        return out, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass
class _Setup:
    """Everything about one call that is not a tensor to differentiate."""

    req: Request
    batch: int  # all batch dims flattened
    heads: int
    kv_heads: int
    q_tile: int
    kv_block: int
    n_tiles: int
    kv_padded: int
    batches: list = field(default_factory=list)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


def _setup(req: Request, cfg: BlockwiseBackend) -> _Setup:
    tq = cfg.q_tile or Q_TILE
    bk = cfg.kv_block or KV_BLOCK
    chunk = max(cfg.kv_chunk or KV_CHUNK, bk)
    budget = cfg.score_budget or SCORE_BUDGET
    batch = math.prod(req.batch_shape)
    lq, lk = req.q_len, req.kv_len
    st = _Setup(req, batch, req.heads, req.kv_heads, tq, bk, -(-lq // tq), -(-lk // bk) * bk)
    if lq == 0 or lk == 0 or batch == 0:
        return st
    kinds = _tiling.analytic_kinds(lq, lk, tq, bk, offset=req.offset, is_causal=req.is_causal,
                                   window=req.window)
    if req.mask_mod is not None or req.mask is not None:
        dev = req.query.device
        b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(req.heads, device=dev).view(1, -1, 1, 1)
        kinds = _tiling.refine_kinds(
            kinds, lambda q, kv: _allowed(st, b, h, q.to(dev)[None, None], kv.to(dev)[None, None]),
            lq, tq, bk, chunk)
    st.batches = _tiling.plan_batches(kinds, bk, chunk, batch * req.heads * tq, budget)
    return st


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
# Layouts: tiles first, so that a run of tiles is a contiguous slice.
# --------------------------------------------------------------------------------------------


def _to_tiles(x: Tensor, st: _Setup) -> Tensor:
    """``[..., H, Lq, D]`` -> ``[n_tiles, B, Hkv, G * Tq, D]`` (padded rows are zero)."""
    b, hkv, g, tq, lq = st.batch, st.kv_heads, st.groups, st.q_tile, st.req.q_len
    x = x.reshape(b, hkv, g, lq, x.shape[-1])
    x = torch.nn.functional.pad(x, (0, 0, 0, st.n_tiles * tq - lq))
    d = x.shape[-1]
    x = x.view(b, hkv, g, st.n_tiles, tq, d).permute(3, 0, 1, 2, 4, 5)
    return x.reshape(st.n_tiles, b, hkv, g * tq, d)


def _from_tiles(x: Tensor, st: _Setup) -> Tensor:
    """Inverse of :func:`_to_tiles`, back to ``[..., H, Lq, D]``."""
    b, hkv, g, tq = st.batch, st.kv_heads, st.groups, st.q_tile
    d = x.shape[-1]
    x = x.view(st.n_tiles, b, hkv, g, tq, d).permute(1, 2, 3, 0, 4, 5)
    x = x.reshape(b, st.heads, st.n_tiles * tq, d)[:, :, : st.req.q_len]
    return x.reshape(*st.req.batch_shape, st.heads, st.req.q_len, x.shape[-1])


def _to_rows(x: Tensor, st: _Setup) -> Tensor:
    """``[..., Hkv, Lk, D]`` -> ``[Lk_padded, B, Hkv, D]`` (padded keys are zero)."""
    x = x.reshape(st.batch, st.kv_heads, st.req.kv_len, x.shape[-1]).permute(2, 0, 1, 3)
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 0, 0, st.kv_padded - st.req.kv_len))


def _from_rows(x: Tensor, st: _Setup) -> Tensor:
    x = x[: st.req.kv_len].permute(1, 2, 0, 3)
    return x.reshape(*st.req.batch_shape, st.kv_heads, st.req.kv_len, x.shape[-1])


def _take(x: Tensor, bt: _tiling.Batch) -> Tensor:
    return x[bt.tile_range[0]:bt.tile_range[1]] if bt.tile_range else x.index_select(0, bt.tiles)


def _put(x: Tensor, bt: _tiling.Batch, value: Tensor) -> None:
    if bt.tile_range:
        x[bt.tile_range[0]:bt.tile_range[1]] = value
    else:
        x.index_copy_(0, bt.tiles, value)


def _add(x: Tensor, bt: _tiling.Batch, value: Tensor) -> None:
    if bt.tile_range:
        x[bt.tile_range[0]:bt.tile_range[1]] += value
    else:
        x.index_add_(0, bt.tiles, value)


# --------------------------------------------------------------------------------------------
# One batch of chunks
# --------------------------------------------------------------------------------------------


@dataclass
class _Chunk:
    """The gathered operands and index grids of one batch of chunks."""

    q: Tensor  # [J, B, Hkv, G*Tq, E] (pre-scaled)
    k: Tensor  # [J, B, Hkv, W, E]
    v: Tensor  # [J, B, Hkv, W, Ev]
    key_index: Tensor  # [J * W] rows of the padded key layout
    b: Tensor  # index grids broadcasting to [J, B, Hkv, G, Tq, W]
    h: Tensor
    q_idx: Tensor
    kv_raw: Tensor


def _gather(st: _Setup, bt: _tiling.Batch, qt: Tensor, kr: Tensor, vr: Tensor) -> _Chunk:
    dev = qt.device
    j, w, tq, g, hkv = len(bt.tiles), bt.width, st.q_tile, st.groups, st.kv_heads
    key_index = (bt.starts.view(-1, 1) + torch.arange(w)).flatten().to(dev)
    k = kr.index_select(0, key_index).view(j, w, st.batch, hkv, -1).permute(0, 2, 3, 1, 4)
    v = vr.index_select(0, key_index).view(j, w, st.batch, hkv, -1).permute(0, 2, 3, 1, 4)
    rows = (bt.tiles.view(-1, 1) * tq + torch.arange(tq)).clamp(max=st.req.q_len - 1).to(dev)
    return _Chunk(
        q=_take(qt, bt), k=k, v=v, key_index=key_index,
        b=torch.arange(st.batch, device=dev).view(1, -1, 1, 1, 1, 1),
        h=(torch.arange(hkv, device=dev).view(-1, 1) * g + torch.arange(g, device=dev)).view(1, 1, hkv, g, 1, 1),
        q_idx=rows.view(j, 1, 1, 1, tq, 1),
        kv_raw=key_index.view(j, 1, 1, 1, 1, w),
    )


def _scores(st: _Setup, bt: _tiling.Batch, c: _Chunk, *, track_mod: bool = False):
    """Masked, modified scores ``[J, B, Hkv, G, Tq, W]``, a fresh tensor safe to change in place.

    With ``track_mod`` also returns ``(x, y)``: the score_mod's input (a leaf requiring grad) and
    its output, for the backward pass.
    """
    global largest_score_tile
    req = st.req
    s = torch.matmul(c.q, c.k.transpose(-2, -1))  # [J, B, Hkv, G*Tq, W]
    largest_score_tile = max(largest_score_tile, s.numel())
    s = s.view(s.shape[0], st.batch, st.kv_heads, st.groups, st.q_tile, bt.width)
    kv = c.kv_raw.clamp(max=req.kv_len - 1)
    if req.bias is not None:
        s += _dense(req.bias, req.batch_shape, c.b, c.h, c.q_idx, kv).to(s.dtype)
    graph = None
    if req.score_mod is not None:
        if track_mod:
            x = s.requires_grad_()
            with torch.enable_grad():
                y = req.score_mod(x, c.b, c.h, c.q_idx, kv)
            graph = (x, y)
            s = torch.broadcast_to(y.detach().to(x.dtype), x.shape).clone()
        else:
            y = req.score_mod(s, c.b, c.h, c.q_idx, kv).to(s.dtype)
            s = y if y.shape == s.shape and y.is_contiguous() else torch.broadcast_to(y, s.shape).clone()
    for a, e in bt.partial:
        ok = _allowed(st, c.b, c.h, c.q_idx, c.kv_raw[..., a:e])
        s[..., a:e].masked_fill_(~ok, _NEG_INF)
    return s, graph


# --------------------------------------------------------------------------------------------
# Forward and backward over the plan
# --------------------------------------------------------------------------------------------


def _forward(st: _Setup, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``(out [n_tiles, B, Hkv, G*Tq, Ev], lse [n_tiles, B, Hkv, G*Tq])`` in the compute dtype."""
    qt = _to_tiles(q * st.req.scale, st)
    kr, vr = _to_rows(k, st), _to_rows(v, st)
    rows = st.groups * st.q_tile
    acc = qt.new_zeros(st.n_tiles, st.batch, st.kv_heads, rows, v.shape[-1])
    run_max = qt.new_full((st.n_tiles, st.batch, st.kv_heads, rows), _NEG_INF)
    run_sum = qt.new_zeros(st.n_tiles, st.batch, st.kv_heads, rows)
    visited = torch.zeros(st.n_tiles, dtype=torch.bool)
    for bt in st.batches:
        c = _gather(st, bt, qt, kr, vr)
        s, _ = _scores(st, bt, c)
        s = s.view(*c.q.shape[:-1], bt.width)  # [J, B, Hkv, G*Tq, W]
        m = s.amax(-1)
        if not visited[bt.tiles].any():
            m_safe = torch.where(m == _NEG_INF, 0.0, m)
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            _put(run_max, bt, m)
            _put(run_sum, bt, p.sum(-1))
            _put(acc, bt, torch.matmul(p, c.v))
        else:
            m_old = _take(run_max, bt)
            m_new = torch.maximum(m_old, m)
            m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            alpha = torch.exp(m_old - m_safe)
            _put(run_max, bt, m_new)
            _put(run_sum, bt, _take(run_sum, bt) * alpha + p.sum(-1))
            _put(acc, bt, torch.baddbmm(
                (_take(acc, bt) * alpha.unsqueeze(-1)).flatten(0, 2), p.flatten(0, 2), c.v.flatten(0, 2),
            ).view_as(_take(acc, bt)))
        visited[bt.tiles] = True
    live = run_sum > 0
    out = acc / torch.where(live, run_sum, 1.0).unsqueeze(-1)
    lse = torch.where(live, run_max + torch.log(torch.where(live, run_sum, 1.0)), _NEG_INF)
    return out, lse


def _backward(st: _Setup, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
              captured: tuple[Tensor, ...]):
    scale = st.req.scale
    qt = _to_tiles(q * scale, st)
    kr, vr = _to_rows(k, st), _to_rows(v, st)
    do = _to_tiles(dout, st)
    delta = (do * out).sum(-1)  # [n_tiles, B, Hkv, G*Tq]
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    dq, dk, dv = torch.zeros_like(qt), torch.zeros_like(kr), torch.zeros_like(vr)
    dcap = [torch.zeros_like(t) for t in captured]
    for bt in st.batches:
        c = _gather(st, bt, qt, kr, vr)
        s, graph = _scores(st, bt, c, track_mod=st.req.score_mod is not None)
        shape5 = (*c.q.shape[:-1], bt.width)
        p = s.view(shape5).sub_(_take(lse, bt).unsqueeze(-1)).exp_()  # the final probabilities
        do_j = _take(do, bt)
        dv_j = torch.matmul(p.transpose(-2, -1), do_j)  # [J, B, Hkv, W, Ev]
        ds = torch.matmul(do_j, c.v.transpose(-2, -1)).sub_(_take(delta, bt).unsqueeze(-1)).mul_(p)
        if graph is not None:
            x, y = graph
            grads = torch.autograd.grad(y, [x, *captured], ds.view(x.shape).sum_to_size(y.shape).to(y.dtype),
                                        allow_unused=True)
            ds = grads[0].reshape(shape5) if grads[0] is not None else torch.zeros_like(ds)
            for acc_g, g in zip(dcap, grads[1:], strict=True):
                if g is not None:
                    acc_g += g
        _add(dq, bt, torch.matmul(ds, c.k))
        dk_j = torch.matmul(ds.transpose(-2, -1), c.q)  # [J, B, Hkv, W, E]
        dk.index_add_(0, c.key_index, dk_j.permute(0, 3, 1, 2, 4).flatten(0, 1))
        dv.index_add_(0, c.key_index, dv_j.permute(0, 3, 1, 2, 4).flatten(0, 1))
    return _from_tiles(dq, st) * scale, _from_rows(dk, st), _from_rows(dv, st), dcap


class _BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st: _Setup, query: Tensor, key: Tensor, value: Tensor, *captured: Tensor) -> Tensor:
        dtype = query.dtype
        compute = _compute_dtype(dtype)
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
        compute = _compute_dtype(query.dtype)
        dq, dk, dv, dcap = _backward(st, query.to(compute), key.to(compute), value.to(compute), out, lse,
                                     dout.to(compute), tuple(captured))
        return (None, dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
                *(g.to(t.dtype) for g, t in zip(dcap, captured, strict=True)))
