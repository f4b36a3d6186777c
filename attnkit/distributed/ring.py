"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds a shard of the queries and of the keys/values (see :mod:`.shard` for the
layouts). The key/value blocks travel once around the ring; each rank attends its queries to the
block it holds with :func:`attnkit.ops.tiles.tile_forward` (in tiles of at most 512 x 512
scores, so a rank's working memory does not grow with its shard lengths) while the next block is
already in flight, and merges the partial results through their log-sum-exp (Liu, Zaharia & Abbeel 2023,
"Ring Attention with Blockwise Transformers"; the per-tile maths is FlashAttention's). The
backward sends the key/value blocks around again, together with an accumulator for their
gradients (float32 for half inputs), which comes home to its owner after the last step.

Masks are evaluated on *global* positions with the :mod:`attnkit.masks` predicates, for each pair
(this rank's queries, the block in hand), so ``is_causal``, ``window`` and padding mean exactly
what they mean in :func:`attnkit.attention` on the unsharded sequence. A tile with nothing
allowed is not computed (a block with nothing allowed is still passed on).

Every rank must be called alike (apart from its shards): one small ``all_gather`` per call of
each rank's shard lengths and arguments (:mod:`.agree`) checks that, so a rank called differently
makes every rank raise the same ``ValueError`` rather than compute wrong rows or die in the ring.
The rest of the communication lives inside one ``autograd.Function``: point-to-point exchanges
with the ring neighbours in the same order on every rank, forward and backward. Nothing depends
on the order in which autograd runs other nodes.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import masks as _masks
from .._text import describe
from ..backends._fused import compute_dtype
from ..ops.tiles import merge_partials, tile_backward, tile_forward
from .agree import Field, agree, name_code, name_of, refuse
from .shard import LAYOUTS, group_info, positions_from_sizes

__all__ = ["ring_attention"]

_SKIP = "skip"  # sentinel: the block has no allowed (query, key) pair
_KV_TAG, _DKV_TAG = 17, 18
_TILE = 512  # rows and columns of the largest score tile a rank materialises


@dataclass(frozen=True)
class _Plan:
    """What every step of the ring needs to know, fixed for one call."""

    group: object
    rank: int
    world: int
    next_peer: int  # global ranks of the ring neighbours
    prev_peer: int
    q_pos: Tensor  # [Lq_local] global positions of this rank's queries
    kv_pos: tuple[Tensor, ...]  # [Lk_r] global positions of rank r's keys
    kv_sizes: tuple[int, ...]
    mask_mod: _masks.MaskMod | None  # on global positions; None = everything allowed
    band: tuple[int | None, int | None] | None  # (left, right) of causal/window around p = i + offset
    batch: int
    scale: float
    compute_dtype: torch.dtype

    def source(self, step: int) -> int:
        """Which rank's key/value block this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def allowed(self, q_pos: Tensor, kv_pos: Tensor):
        """Mask ``[B|1, 1, 1, Lq, Lk]`` for these positions; None = all allowed; _SKIP = none."""
        if q_pos.numel() == 0 or kv_pos.numel() == 0:
            return _SKIP
        if self.mask_mod is None:
            return None
        b = torch.arange(self.batch, device=q_pos.device).view(-1, 1, 1)
        grid = self.mask_mod(b, None, q_pos.view(1, -1, 1), kv_pos.view(1, 1, -1))  # [B|1, Lq, Lk]
        if not bool(grid.any()):
            return _SKIP
        if bool(grid.all()):
            return None
        return grid[:, None, None]  # broadcast over (Hkv, group) of the grouped layout

    def tiles(self, src: int):
        """``(rows, cols, allowed)`` for each tile of (my queries, block ``src``) with work in it.

        Tiles of at most ``_TILE`` x ``_TILE`` bound the working memory of a rank by the tile,
        not by ``Lq_local x Lk_local``, and let a causal or window mask skip empty tiles inside
        a block too. Tiles outside the causal/window band are skipped from their position
        ranges alone, so a sliding window costs O(L * window), mask checks included.
        """
        kv_pos = self.kv_pos[src]
        kv_tiles = _tile_ranges(kv_pos)
        for rows, q_lo, q_hi in _tile_ranges(self.q_pos):
            for cols, kv_lo, kv_hi in kv_tiles:
                if self.band is not None:
                    left, right = self.band  # key j allowed only if p - left <= j <= p + right
                    if right is not None and kv_lo > q_hi + right:
                        continue
                    if left is not None and kv_hi < q_lo - left:
                        continue
                allowed = self.allowed(self.q_pos[rows], kv_pos[cols])
                if allowed is not _SKIP:
                    yield rows, cols, allowed


def _tile_ranges(pos: Tensor):
    """``(slice, lowest, highest position)`` for each run of ``_TILE`` entries of ``pos``."""
    n = pos.numel()
    if n == 0:
        return []
    starts = list(range(0, n, _TILE))
    lows = [int(pos[s:s + _TILE].min()) for s in starts]
    highs = [int(pos[s:s + _TILE].max()) for s in starts]
    return [(slice(s, s + _TILE), lo, hi) for s, lo, hi in zip(starts, lows, highs, strict=True)]


def _exchange(plan: _Plan, send: Tensor, recv: Tensor, tag: int) -> list:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one, asynchronously."""
    ops = []
    if send.numel():  # the receiver knows the size too, so both sides skip empty blocks
        ops.append(dist.P2POp(dist.isend, send, plan.next_peer, plan.group, tag))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, plan.prev_peer, plan.group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _grouped(q: Tensor, kv_heads: int) -> Tensor:
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)  # (B, H, L, D) -> (B, Hkv, G, L, D)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> Tensor:
        bsz, heads, lq, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        cd = plan.compute_dtype
        qc = _grouped(q.to(cd), hkv)  # (B, Hkv, G, Lq, D)
        out = qc.new_zeros(qc.shape[:-1] + (dv,))
        lse = qc.new_full(qc.shape[:-1], float("-inf"))
        kv = torch.cat([k, v], -1).contiguous()  # one message per step: (B, Hkv, Lk_src, D + Dv)
        for step in range(plan.world):
            src = plan.source(step)
            pending, nxt = [], None
            if step + 1 < plan.world:
                nxt = kv.new_empty(bsz, hkv, plan.kv_sizes[plan.source(step + 1)], d + dv)
                pending = _exchange(plan, kv, nxt, _KV_TAG)
            kb = kv[..., :d].to(cd).unsqueeze(2)  # (B, Hkv, 1, Lk, D): shared by the G query heads
            vb = kv[..., d:].to(cd).unsqueeze(2)
            for rows, cols, allowed in plan.tiles(src):
                o, l = tile_forward(qc[..., rows, :], kb[..., cols, :], vb[..., cols, :], scale=plan.scale,
                                    allowed=allowed)
                out[..., rows, :], lse[..., rows] = merge_partials(out[..., rows, :], lse[..., rows], o, l)
            _wait(pending)
            if nxt is not None:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.reshape(bsz, heads, lq, dv).to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        bsz, _, lq, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        cd = plan.compute_dtype
        qc = _grouped(q.to(cd), hkv)
        dout = _grouped(grad_out.to(cd), hkv)  # (B, Hkv, G, Lq, Dv)
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qc)
        kv = torch.cat([k, v], -1).contiguous()
        acc_in, acc_works = None, []  # gradient accumulator of the block in hand, arriving
        for step in range(plan.world):
            src = plan.source(step)
            kv_works, nxt = [], None
            if step + 1 < plan.world:
                nxt = kv.new_empty(bsz, hkv, plan.kv_sizes[plan.source(step + 1)], d + dv)
                kv_works = _exchange(plan, kv, nxt, _KV_TAG)
            kb = kv[..., :d].to(cd).unsqueeze(2)
            vb = kv[..., d:].to(cd).unsqueeze(2)
            local = None  # this rank's share of the block's gradients (B, Hkv, Lk, D + Dv)
            for rows, cols, allowed in plan.tiles(src):
                dq_t, dk_t, dv_t, _ = tile_backward(qc[..., rows, :], kb[..., cols, :], vb[..., cols, :],
                                                    dout[..., rows, :], lse[..., rows], delta[..., rows],
                                                    scale=plan.scale, allowed=allowed)
                dq[..., rows, :] += dq_t
                if local is None:
                    local = kv.new_zeros(kv.shape, dtype=cd)
                local[..., cols, :d] += dk_t.sum(2)  # sum over the G query heads
                local[..., cols, d:] += dv_t.sum(2)
            # The accumulator for this block was sent by the previous rank one step ago; it
            # travelled while we computed.
            _wait(acc_works)
            if acc_in is None:
                acc = local if local is not None else kv.new_zeros(kv.shape, dtype=cd)
            else:
                acc = acc_in  # received in full: add in place, one block-sized buffer fewer
                if local is not None:
                    acc += local
            del local
            _wait(kv_works)
            if nxt is not None:
                kv = nxt
            if plan.world == 1:
                acc_in = acc
                break
            # Pass it on; after the last step it reaches the block's owner.
            acc_in = acc.new_empty(bsz, hkv, plan.kv_sizes[plan.source(step + 1)], d + dv)
            acc_works = _exchange(plan, acc.contiguous(), acc_in, _DKV_TAG)
        _wait(acc_works)
        assert acc_in.shape[-2] == k.shape[-2]
        dq = dq.reshape(q.shape).to(q.dtype)
        return dq, acc_in[..., :d].to(k.dtype), acc_in[..., d:].to(v.dtype), None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    layout: str = "contiguous",
    scale: float | None = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``group``; takes and returns this rank's shard.

    The result on each rank is its rows of ``attnkit.attention`` on the full, unsharded
    sequences, and so are the gradients of ``q``, ``k`` and ``v``. Shape notation:
    ``Lq_local``/``Lk_local`` this rank's shard lengths, ``Lq``/``Lk`` the global lengths (the sums
    over ranks), ``H % Hkv == 0`` (grouped-query attention).

    A collective: every rank of ``group`` calls it with the same arguments apart from its shards
    (checked: otherwise every rank raises), and every rank must run the backward when one does (use
    each rank's output in its loss).

    Args:
        q: ``[B, H, Lq_local, E]``, this rank's queries.
        k: ``[B, Hkv, Lk_local, E]``, this rank's keys.
        v: ``[B, Hkv, Lk_local, Ev]``, this rank's values.
        group: the process group (default: the world).
        is_causal: look-ahead mask over the global positions, aligned bottom-right: query ``i``
            sits at position ``Lk - Lq + i``.
        window: ``(left, right)``: the query at position ``p`` sees keys ``p - left ... p + right``
            (``None`` = unbounded), aligned like ``is_causal``.
        layout: how q and k/v were sharded: ``"contiguous"`` (any shard lengths, in rank order)
            or ``"zigzag"`` (exactly the split :func:`attnkit.distributed.shard` makes).
        scale: defaults to ``1 / sqrt(E)``.
        lengths: ``[B]`` int, the number of real keys of each batch element over the global
            sequence; keys at positions ``>= lengths[b]`` are masked.

    Returns:
        ``[B, H, Lq_local, Ev]`` in the dtype of ``q`` (computed in float32 for half inputs, in the
        input dtype otherwise). Rows with no key to attend are zeros, with zero gradients.

    Raises:
        TypeError, ValueError: bad arguments, naming them; shard lengths that do not fit the layout.
            Every rank raises when one does: a rank whose arguments differ from rank 0's (dtype,
            batch, heads, head sizes, layout, ``is_causal``, ``window``, ``scale``, ``lengths``,
            whether autograd records the call) makes all raise a ``ValueError`` naming that rank
            and argument, and a rank that refuses its own arguments makes the others raise too.
        RuntimeError: ``torch.distributed`` is not initialised.

    Plain PyTorch on one process, for a reader (``full`` gathers the shards)::

        out = attnkit.attention(full(q), full(k), full(v), is_causal=is_causal, window=window,
                                mask=attnkit.masks.padding(lengths, Lk))  # then take my rows
    """
    try:
        window, scale, lengths = _check_args(q, k, v, is_causal, window, layout, scale, lengths)
    except (TypeError, ValueError):
        # Take part in the call's one collective, marked as refused, so that the other ranks raise
        # too instead of waiting for this one in the ring.
        refuse_ring_call(group, q)
        raise
    plan = _make_plan(q, k, v, group, is_causal, window, layout, scale, lengths)
    return _RingAttention.apply(q, k, v, plan)


def _check_args(q, k, v, is_causal, window, layout, scale, lengths):
    """This rank's own checks: ``(window as a pair or None, scale as a float, lengths on q's device)``."""
    _check_inputs(q, k, v)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if window is not None:
        if not (isinstance(window, tuple | list) and len(window) == 2):
            raise ValueError(f"window must be a (left, right) pair, got {window!r}")
        window = (window[0], window[1])
        for side, n in zip(("left", "right"), window, strict=True):
            _masks._check_window_side(side, n)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if lengths is not None:
        if not isinstance(lengths, Tensor) or lengths.dim() != 1 or lengths.shape[0] != q.shape[0] or \
                lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be a [B] = [{q.shape[0]}] integer tensor, got {describe(lengths)}")
        lengths = lengths.to(q.device)
    return window, float(scale), lengths


def _check_inputs(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, heads, L_local, dim], got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} ({t.dtype}, {t.device}) must match q ({q.dtype}, {q.device})")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} batch {t.shape[0]} must equal q batch {q.shape[0]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head size {k.shape[-1]} must equal q head size {q.shape[-1]}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"v must have k's heads and length: k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")


def _show_window(code: tuple[int, ...]):
    return None if not code[0] else tuple(None if n < 0 else n for n in code[1:])


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", scale))[0]  # exact: equal bits, equal scale


def _show_lengths(code: tuple[int, ...]) -> str:
    return "None" if not code[0] else f"a tensor with crc32 {code[1]:#010x}"


# What a rank's call looks like to the others: one int64 row per rank, gathered once per call. Every
# field but the shard lengths must agree; a rank that differs would compute wrong rows or abort in
# the ring. Checked in this order, so the first field named is the first that differs.
_CALL = (
    Field("q_len", same=False),
    Field("kv_len", same=False),
    Field("dtype", 3, show=lambda c: f"torch.{name_of(c)}"),
    Field("batch"),
    Field("heads"),
    Field("kv_heads"),
    Field("head_dim"),
    Field("value_dim"),
    Field("layout", show=lambda c: repr(LAYOUTS[c[0]])),
    Field("is_causal", show=lambda c: bool(c[0])),
    Field("window", 3, show=_show_window),  # (given, left, right), -1 = unbounded
    Field("scale", show=lambda c: struct.unpack("<d", struct.pack("<q", c[0]))[0]),
    Field("lengths", 2, show=_show_lengths),  # (given, crc32 of the values)
    Field("requires_grad", show=lambda c: bool(c[0])),  # one rank's backward would wait for the others'
)


def _call(q, k, v, is_causal, window, layout, scale, lengths) -> dict[str, tuple[int, ...]]:
    """This rank's row of :data:`_CALL`."""
    if lengths is None:
        lengths_code = (0, 0)
    else:
        values = lengths.tolist()
        lengths_code = (1, zlib.crc32(struct.pack(f"<{len(values)}q", *values)))
    return {
        "q_len": (q.shape[2],), "kv_len": (k.shape[2],),
        "dtype": name_code(str(q.dtype).removeprefix("torch."), 3),
        "batch": (q.shape[0],), "heads": (q.shape[1],), "kv_heads": (k.shape[1],),
        "head_dim": (q.shape[3],), "value_dim": (v.shape[3],),
        "layout": (LAYOUTS.index(layout),), "is_causal": (int(is_causal),),
        "window": (0, -1, -1) if window is None else (1, *(-1 if n is None else n for n in window)),
        "scale": (_scale_bits(scale),), "lengths": lengths_code,
        "requires_grad": (int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))),),
    }


def refuse_ring_call(group, like) -> None:
    """This rank's part of a :func:`ring_attention` call it will not make, its own arguments refused.

    For a caller that checks its arguments before calling (``like``: its input tensor): the other
    ranks then raise, naming this rank, instead of waiting for it. The caller raises its own error.
    """
    refuse(_CALL, group, like)


def _make_plan(q, k, v, group, is_causal, window, layout, scale, lengths) -> _Plan:
    rank, world = group_info(group)
    # One small collective: every rank checks that all ranks were called alike, and learns every
    # shard length, hence the global lengths.
    calls = agree("ring_attention", _CALL, _call(q, k, v, is_causal, window, layout, scale, lengths), group, q)
    q_sizes = [c["q_len"][0] for c in calls]
    kv_sizes = [c["kv_len"][0] for c in calls]
    q_len, kv_len = sum(q_sizes), sum(kv_sizes)
    q_pos = positions_from_sizes(q_sizes, layout, "q", q.device)[rank]
    kv_pos = positions_from_sizes(kv_sizes, layout, "k", q.device)
    if lengths is not None and ((lengths < 0) | (lengths > kv_len)).any():
        raise ValueError(f"lengths must be in [0, Lk = {kv_len}], got {lengths.tolist()}")

    offset = kv_len - q_len  # bottom-right alignment over the global lengths
    mods = []
    if is_causal:
        mods.append(_masks.causal_mod(offset))
    if window is not None:
        mods.append(_masks.window_mod(*window, offset=offset))
    if lengths is not None:
        mods.append(_masks.padding_mod(lengths))
    mask_mod = None if not mods else mods[0] if len(mods) == 1 else _masks.and_masks(*mods)
    band = None
    if is_causal or window is not None:
        left, right = window if window is not None else (None, None)
        if is_causal:
            right = 0 if right is None else min(right, 0)
        # In query-position terms: key j is allowed only if q - left' <= j <= q + right', with
        # the offset folded in (q is the raw global query index).
        band = (None if left is None else left - offset, None if right is None else right + offset)

    return _Plan(
        group=group, rank=rank, world=world,
        next_peer=_global_rank(group, (rank + 1) % world), prev_peer=_global_rank(group, (rank - 1) % world),
        q_pos=q_pos, kv_pos=tuple(kv_pos), kv_sizes=tuple(kv_sizes), mask_mod=mask_mod, band=band,
        batch=q.shape[0], scale=scale, compute_dtype=compute_dtype(q.dtype),
    )


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
