"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds a shard of the queries and of the keys/values (see :mod:`.shard` for the
layouts). The key/value blocks travel once around the ring; each rank attends its queries to the
block it holds while the next block is already in flight, and merges the partial results through
their log-sum-exp (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers"; the
per-block maths is FlashAttention's). The backward sends the key/value blocks around again,
together with an accumulator for their gradients (float32 for half inputs), which comes home to
its owner after the last step.

The call is ``attnkit.attention``'s on the unsharded sequence: the same argument names and checks
(:func:`attnkit.call.validate_call`), the same compute dtype, every mask (``is_causal``,
``window``, any ``mask_mod``: padding, documents, the sparse patterns) and the score_mods the banded
kernel applies (a bias per head and diagonal, tanh soft-capping) on *global* positions. The
mask is worked out once per call as each of this rank's query rows' allowed keys, as intervals
(:func:`attnkit.mask_plan`); each (query run, key run) of a block then goes through the banded C++
kernel of the ``"band"`` backend (:func:`attnkit.backends._band.partial_forward`), so a rank
computes only allowed cells, as one process would. On CUDA tensors a block goes through compiled
FlexAttention (:func:`attnkit.backends.flex.attention_with_lse`): its BlockMask from the block's own
mask plan, the bias and cap as a score mod on global positions, its log-sum-exp merged as the
kernel's; its backward computes the block again under autograd and hands Flex's backward the
block's share of the merged result (see :func:`_flex_block_backward`). Otherwise (the kernel not
built, a mask without an interval form shared by the heads, a block compiled Flex cannot serve),
the block is computed in tiles of at most 512 x 512 scores with the predicate evaluated per tile,
and empty tiles are skipped.

Every rank must be called alike (apart from its shards): one small ``all_gather`` per call of
each rank's shard lengths and arguments (:mod:`.agree`) checks that, so a rank called differently
makes every rank raise the same ``ValueError`` rather than compute wrong rows or die in the ring.
A ``mask_mod`` is compared by its function and the tensors it captures (document ids, lengths).
The rest of the communication lives inside one ``autograd.Function``: point-to-point exchanges
with the ring neighbours in the same order on every rank, forward and backward. Nothing depends
on the order in which autograd runs other nodes.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import closures, scores
from .. import masks as _masks
from ..backends import _band, flex
from ..call import validate_call
from ..dtypes import compute_dtype
from ..intervals import row_bounds
from ..maskplan import mask_plan
from ..masks import combined_mask_mod
from ..ops.tiles import merge_partials, tile_backward, tile_forward
from .agree import Field, agree, name_code, name_of, refuse
from .shard import LAYOUTS, group_info, positions_from_sizes

__all__ = ["ring_attention"]

_SKIP = "skip"  # sentinel: the block has no allowed (query, key) pair
_KV_TAG, _DKV_TAG = 17, 18
_TILE = 512  # rows and columns of the largest score tile a rank materialises (tiles path)
#: Devices whose blocks go through compiled FlexAttention (the banded kernel runs on the CPU only).
_FLEX_DEVICES = ("cuda",)
_FLEX_SAID: set[str] = set()  # the reasons compiled Flex could not serve a block, said once each


@dataclass(frozen=True)
class _Ring:
    """What every step of the ring needs to know, fixed for one call."""

    group: object
    rank: int
    world: int
    next_peer: int  # global ranks of the ring neighbours
    prev_peer: int
    q_pos: Tensor  # [Lq_local] global positions of this rank's queries
    kv_pos: tuple[Tensor, ...]  # [Lk_r] global positions of rank r's keys
    kv_sizes: tuple[int, ...]
    predicate: _masks.MaskMod | None  # the whole mask on global positions; None = everything allowed
    rows: tuple[Tensor, Tensor] | None  # my query rows' allowed global keys [1|B, Lq_local, K]; None: tiles
    q_len: int  # global lengths
    cap: float  # the score_mod's tanh soft cap (0: none); its diagonal bias is the autograd input `table`
    bounds: tuple[Tensor, Tensor]  # [Lq_local] each query row's causal/window keys [lo, hi) (row_bounds)
    batch: int
    heads: int
    kv_heads: int
    scale: float
    compute_dtype: torch.dtype
    flex: bool = False  # blocks through compiled FlexAttention (see _flex_block); else the kernel or tiles
    _jobs: dict = field(default_factory=dict, compare=False, repr=False)
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

    def source(self, step: int) -> int:
        """Which rank's key/value block this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def jobs(self, src: int) -> list[tuple[slice, slice, Tensor, Tensor, slice]]:
        """``(query rows, block columns, starts, ends, diagonals)`` for the kernel, one per (run of
        consecutive query positions, run of consecutive key positions of block ``src``) with an
        allowed cell; the intervals are the runs', relative to the key run's first position, and
        ``diagonals`` the columns of the global diagonal bias table ``[H, Lq + Lk - 1]`` that the
        run pair covers, in the kernel's order. Worked out once per call and block, for the forward
        and the backward."""
        if src not in self._jobs:
            out = []
            starts, ends = self.rows
            for rs, q0 in _runs(self.q_pos):
                r = rs.stop - rs.start
                for cs, lo in _runs(self.kv_pos[src]):
                    n = cs.stop - cs.start
                    st, en = _masks.normalize(starts[:, rs].clamp(lo, lo + n) - lo,
                                              ends[:, rs].clamp(lo, lo + n) - lo, n)
                    if bool((st < en).any()):
                        # block column j - i + r - 1 is global diagonal (lo + j) - (q0 + i), column + Lq - 1
                        first = lo - q0 + self.q_len - r
                        out.append((rs, cs, st, en, slice(first, first + r + n - 1)))
            self._jobs[src] = out
        return self._jobs[src]

    def plan(self, src: int):
        """The mask plan of (my queries, block ``src``) on the block's own indices, for Flex: the whole mask on
        global positions, worked out once per call and block; _SKIP where no cell is allowed."""
        if src not in self._plans:
            q_pos, kv_pos = self.q_pos, self.kv_pos[src]
            if q_pos.numel() == 0 or kv_pos.numel() == 0:
                self._plans[src] = _SKIP
                return _SKIP
            whole = self.predicate

            def block(b, h, q_idx, kv_idx):  # row i, column j: global query q_pos[i], key kv_pos[j]
                return whole(b, h, q_pos[q_idx], kv_pos[kv_idx])

            plan = mask_plan(None if whole is None else block, q_len=q_pos.numel(), kv_len=kv_pos.numel(),
                             batch=self.batch, heads=self.heads, device=q_pos.device)
            empty = plan.starts is not None and not bool((plan.starts < plan.ends).any())
            self._plans[src] = _SKIP if empty else plan
        return self._plans[src]

    def allowed(self, q_pos: Tensor, kv_pos: Tensor):
        """Mask ``[B|1, Hkv|1, G|1, Lq, Lk]`` for these positions; None = all allowed; _SKIP = none."""
        if q_pos.numel() == 0 or kv_pos.numel() == 0:
            return _SKIP
        if self.predicate is None:
            return None
        b = torch.arange(self.batch, device=q_pos.device).view(-1, 1, 1, 1)
        h = torch.arange(self.heads, device=q_pos.device).view(1, -1, 1, 1)
        grid = self.predicate(b, h, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))
        grid = _masks.as_grid(grid)  # [B|1, H|1, Lq|1, Lk|1]
        if not bool(grid.any()):
            return _SKIP
        if bool(grid.all()):
            return None
        if grid.shape[1] == 1:
            return grid.unsqueeze(1)  # the same for every head
        return grid.unflatten(1, (self.kv_heads, self.heads // self.kv_heads))  # (B, Hkv, G, Lq, Lk)

    def tiles(self, src: int):
        """``(rows, cols, allowed)`` for each tile of (my queries, block ``src``) with work in it.

        Tiles of at most ``_TILE`` x ``_TILE`` bound the working memory of a rank by the tile,
        not by ``Lq_local x Lk_local``, and let a causal or window mask skip empty tiles inside
        a block too. Tiles outside the rows' causal/window bounds are skipped from their position
        ranges alone, so a sliding window costs O(L * window), mask checks included.
        """
        kv_pos = self.kv_pos[src]
        kv_tiles = _tile_ranges(kv_pos)
        lo, hi = self.bounds
        for rows, _, _ in _tile_ranges(self.q_pos):
            first, end = int(lo[rows].min()), int(hi[rows].max())  # the keys any row of the tile may see
            for cols, kv_lo, kv_hi in kv_tiles:
                if kv_hi < first or kv_lo >= end:
                    continue
                allowed = self.allowed(self.q_pos[rows], kv_pos[cols])
                if allowed is not _SKIP:
                    yield rows, cols, allowed


def _runs(pos: Tensor) -> list[tuple[slice, int]]:
    """``(slice, first position)`` of each run of consecutive positions in ``pos`` (a contiguous
    shard is one run, a zigzag shard two)."""
    if pos.numel() == 0:
        return []
    cuts = [0, *((pos[1:] - pos[:-1]) != 1).nonzero().flatten().add(1).tolist(), pos.numel()]
    return [(slice(a, b), int(pos[a])) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _tile_ranges(pos: Tensor):
    """``(slice, lowest, highest position)`` for each run of ``_TILE`` entries of ``pos``."""
    n = pos.numel()
    if n == 0:
        return []
    starts = list(range(0, n, _TILE))
    lows = [int(pos[s:s + _TILE].min()) for s in starts]
    highs = [int(pos[s:s + _TILE].max()) for s in starts]
    return [(slice(s, s + _TILE), lo, hi) for s, lo, hi in zip(starts, lows, highs, strict=True)]


def _exchange(ring: _Ring, send: Tensor, recv: Tensor, tag: int) -> list:
    """Send ``send`` to the next rank and receive ``recv`` from the previous one, asynchronously."""
    ops = []
    if send.numel():  # the receiver knows the size too, so both sides skip empty blocks
        ops.append(dist.P2POp(dist.isend, send, ring.next_peer, ring.group, tag))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, ring.prev_peer, ring.group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _grouped(q: Tensor, kv_heads: int) -> Tensor:
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)  # (B, H, L, D) -> (B, Hkv, G, L, D)


class _RingAttention(torch.autograd.Function):
    """Forward and backward around the ring; out, lse and the gradients in the compute dtype."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, table: Tensor | None, ring: _Ring) -> Tensor:
        bsz, heads, lq, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        cd = ring.compute_dtype
        qc = q.to(cd)
        out = qc.new_zeros(bsz, heads, lq, dv)
        lse = qc.new_full((bsz, heads, lq), float("-inf"))
        kv = torch.cat([k, v], -1).contiguous()  # one message per step: (B, Hkv, Lk_src, D + Dv)
        for step in range(ring.world):
            src = ring.source(step)
            pending, nxt = [], None
            if step + 1 < ring.world:
                nxt = kv.new_empty(bsz, hkv, ring.kv_sizes[ring.source(step + 1)], d + dv)
                pending = _exchange(ring, kv, nxt, _KV_TAG)
            try:
                kb, vb = kv[..., :d].to(cd), kv[..., d:].to(cd)
                for rows, _, o, l in _block_forward(ring, src, qc, kb, vb, table):
                    out[..., rows, :], lse[..., rows] = merge_partials(out[..., rows, :], lse[..., rows], o, l)
            finally:  # a block that raises (on every rank alike) leaves no exchange in flight: the group stays usable
                _wait(pending)
            if nxt is not None:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse, table)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, table = ctx.saved_tensors
        ring: _Ring = ctx.ring
        bsz, _, _, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        cd = ring.compute_dtype
        qc, dout = q.to(cd), grad_out.to(cd).contiguous()
        # each row's dout . out (FlashAttention's D), once for every block of the tiles and Flex (the kernel its own)
        delta = (dout * out).sum(-1) if ring.rows is None else None
        dq = torch.zeros_like(qc)
        dtable = None if table is None else table.new_zeros(table.shape, dtype=cd)  # this rank's rows' share
        kv = torch.cat([k, v], -1).contiguous()
        acc_in, acc_works = None, []  # gradient accumulator of the block in hand, arriving
        for step in range(ring.world):
            src = ring.source(step)
            kv_works, nxt = [], None
            if step + 1 < ring.world:
                nxt = kv.new_empty(bsz, hkv, ring.kv_sizes[ring.source(step + 1)], d + dv)
                kv_works = _exchange(ring, kv, nxt, _KV_TAG)
            kb, vb = kv[..., :d].to(cd), kv[..., d:].to(cd)
            local = None  # this rank's share of the block's gradients (B, Hkv, Lk, D + Dv)
            try:
                for rows, cols, dq_t, dk_t, dv_t, diagonals, db in _block_backward(ring, src, qc, kb, vb, dout, out,
                                                                                   lse, delta, table):
                    dq[..., rows, :] += dq_t
                    if db is not None:
                        dtable[:, diagonals] += db
                    if local is None:
                        local = kv.new_zeros(kv.shape, dtype=cd)
                    local[..., cols, :d] += dk_t
                    local[..., cols, d:] += dv_t
            except BaseException:  # as in the forward: nothing left in flight
                _wait(acc_works)
                _wait(kv_works)
                raise
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
            if ring.world == 1:
                acc_in = acc
                break
            # Pass it on; after the last step it reaches the block's owner.
            acc_in = acc.new_empty(bsz, hkv, ring.kv_sizes[ring.source(step + 1)], d + dv)
            acc_works = _exchange(ring, acc.contiguous(), acc_in, _DKV_TAG)
        _wait(acc_works)
        assert acc_in.shape[-2] == k.shape[-2]
        dtable = None if dtable is None else dtable.to(table.dtype)
        return dq.to(q.dtype), acc_in[..., :d].to(k.dtype), acc_in[..., d:].to(v.dtype), dtable, None


def _block_forward(ring: _Ring, src: int, q: Tensor, k: Tensor, v: Tensor, table: Tensor | None):
    """``(query rows, block columns, out, lse)`` of each piece of block ``src`` with work in it."""
    if ring.flex:
        got = _flex_block(ring, src, q, k, v, table)
        if got is _SKIP:
            return
        if got is not None:
            yield slice(None), slice(None), *got
            return
    if ring.rows is not None:
        for rows, cols, starts, ends, diagonals in ring.jobs(src):
            bias = None if table is None else table[:, diagonals]
            yield (rows, cols, *_band.partial_forward(q[..., rows, :], k[..., cols, :], v[..., cols, :], starts, ends,
                                                      ring.scale, bias, ring.cap))
        return
    hkv = k.shape[1]
    qg, kg, vg = _grouped(q, hkv), k.unsqueeze(2), v.unsqueeze(2)  # (B, Hkv, G|1, L, D)
    for rows, cols, allowed in ring.tiles(src):
        o, l = tile_forward(qg[..., rows, :], kg[..., cols, :], vg[..., cols, :], scale=ring.scale, allowed=allowed)
        yield rows, cols, o.flatten(1, 2), l.flatten(1, 2)


def _block_backward(ring: _Ring, src: int, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor,
                    delta: Tensor | None, table: Tensor | None):
    """``(query rows, block columns, dq, dk, dv, diagonals, dbias)`` of each piece of block ``src`` with work
    in it, given the merged ``out`` and ``lse`` of every block and each row's ``delta = dout . out`` (None on
    the kernel's path); dk, dv summed over the query heads of a group; dbias (None without a bias) for the
    columns ``diagonals`` of the table."""
    if ring.flex:
        got = _flex_block_backward(ring, src, q, k, v, dout, lse, delta, table)
        if got is _SKIP:
            return
        if got is not None:
            yield slice(None), slice(None), *got[:3], slice(None), got[3]
            return
    if ring.rows is not None:
        for rows, cols, starts, ends, diagonals in ring.jobs(src):
            bias = None if table is None else table[:, diagonals]
            dq, dk, dv, db = _band.partial_backward(dout[..., rows, :], q[..., rows, :], k[..., cols, :],
                                                    v[..., cols, :], out[..., rows, :], lse[..., rows].contiguous(),
                                                    starts, ends, ring.scale, bias, ring.cap)
            yield rows, cols, dq, dk, dv, diagonals, db
        return
    hkv = k.shape[1]
    qg, kg, vg = _grouped(q, hkv), k.unsqueeze(2), v.unsqueeze(2)
    dg, lg, dl = _grouped(dout, hkv), lse.unflatten(1, (hkv, -1)), delta.unflatten(1, (hkv, -1))
    for rows, cols, allowed in ring.tiles(src):
        dq_t, dk_t, dv_t, _ = tile_backward(qg[..., rows, :], kg[..., cols, :], vg[..., cols, :], dg[..., rows, :],
                                            lg[..., rows], dl[..., rows], scale=ring.scale, allowed=allowed)
        yield rows, cols, dq_t.flatten(1, 2), dk_t.sum(2), dv_t.sum(2), None, None


def _flex_block(ring: _Ring, src: int, q: Tensor, k: Tensor, v: Tensor, table: Tensor | None):
    """``(out, lse)`` of my queries against block ``src`` through compiled FlexAttention, its BlockMask from the
    block's mask plan (:meth:`_Ring.plan`) and the score's bias and cap on global positions; _SKIP where no
    cell is allowed; None where compiled Flex cannot serve the block (a warning, once per reason: the
    tiles path serves it then, which applies no score_mod, so a call with one raises instead)."""
    plan = ring.plan(src)
    if plan is _SKIP:
        return _SKIP
    req = validate_call(q, k, v, mask=plan, score_mod=_global_score(ring, src, table), scale=ring.scale)
    try:
        return flex.attention_with_lse(req)
    except flex.CompileFailed as e:
        if table is not None or ring.cap:
            raise RuntimeError(f"ring_attention: compiled flex_attention cannot serve a block ({e}), and the tiles "
                               "path that would serve it instead applies no score_mod") from e
        if str(e) not in _FLEX_SAID:
            _FLEX_SAID.add(str(e))
            warnings.warn(f"attnkit: compiled flex_attention cannot serve a ring_attention block ({e}); the tiles "
                          "path serves it", stacklevel=2)
        return None


def _flex_block_backward(ring: _Ring, src: int, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor,
                         delta: Tensor, table: Tensor | None):
    """``(dq, dk, dv, dtable)`` of block ``src`` through Flex's own backward, given the merged ``lse`` and
    ``delta = dout . out``; dtable None without a table. Flex's backward takes its block's own statistics, so
    the block is computed again under autograd and its share of the merge is differentiated:
    ``out = sum_b w_b o_b`` with ``w_b = exp(lse_b - lse)``, whence ``dL/do_b = w_b dout`` and
    ``dL/dlse_b = w_b (dout . o_b - dout . out)``."""
    with torch.enable_grad():
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        tg = None if table is None else table.detach().requires_grad_()
        got = _flex_block(ring, src, *ins, tg)
        if got is _SKIP or got is None:
            return got
        o, l = got
        w = torch.where(torch.isneginf(l), 0.0, torch.exp(l - lse))  # a block with nothing for the row: no share
        grad_o = (w.unsqueeze(-1) * dout).to(o.dtype)
        grad_l = (w * ((dout * o.detach()).sum(-1) - delta)).to(l.dtype)
        wrt = ins + ([tg] if tg is not None else [])
        grads = torch.autograd.grad((o, l), wrt, (grad_o, grad_l), allow_unused=True)
    dq, dk, dv = (torch.zeros_like(t) if g is None else g for t, g in zip(ins, grads, strict=False))
    dtable = None if tg is None else (torch.zeros_like(tg) if grads[3] is None else grads[3])
    return dq, dk, dv, dtable


def _global_score(ring: _Ring, src: int, table: Tensor | None):
    """The score_mod of block ``src`` on its own indices: the diagonal bias ``table[h, kv - q + Lq - 1]`` of
    the global positions, then the tanh cap (what the banded kernel applies); None without either."""
    if table is None and not ring.cap:
        return None
    q_pos, kv_pos, cap, last = ring.q_pos, ring.kv_pos[src], ring.cap, ring.q_len - 1
    per_head = table is not None and table.shape[0] > 1

    def score(s, b, h, q_idx, kv_idx):
        if table is not None:
            s = s + table[h if per_head else 0, kv_pos[kv_idx] - q_pos[q_idx] + last]
        return cap * torch.tanh(s / cap) if cap else s

    return score


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group=None,
    layout: str = "contiguous",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    mask_mod=None,
    score_mod=None,
    scale: float | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across ``group``; takes and returns this rank's shard.

    The result on each rank is its rows of ``attnkit.attention`` on the full, unsharded
    sequences (same arguments, same meaning), and so are the gradients of ``query``, ``key`` and
    ``value``. Shape notation: ``Lq_local``/``Lk_local`` this rank's shard lengths, ``Lq``/``Lk``
    the global lengths (the sums over ranks), ``H % Hkv == 0`` (grouped-query attention).

    A collective: every rank of ``group`` calls it with the same arguments apart from its shards
    (checked: otherwise every rank raises), and every rank must run the backward when one does (use
    each rank's output in its loss).

    Args:
        query: ``[B, H, Lq_local, E]``, this rank's queries.
        key: ``[B, Hkv, Lk_local, E]``, this rank's keys.
        value: ``[B, Hkv, Lk_local, Ev]``, this rank's values.
        group: the process group (default: the world).
        layout: how query and key/value were sharded: ``"contiguous"`` (any shard lengths, in rank
            order) or ``"zigzag"`` (exactly the split :func:`attnkit.distributed.shard` makes).
        is_causal: look-ahead mask over the global positions, aligned bottom-right: query ``i``
            sits at position ``Lk - Lq + i``.
        window: ``(left, right)``: the query at position ``p`` sees keys ``p - left ... p + right``
            (``None`` = unbounded), aligned like ``is_causal``.
        mask_mod: ``fn(b, h, q_idx, kv_idx) -> bool`` on *global* query and key indices, as in
            ``attnkit.attention``: padding (``attnkit.masks.padding_mod(lengths)``), documents,
            the sparse patterns of :mod:`attnkit.masks`, or your own. The same on every rank.
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` on global indices, as in
            ``attnkit.attention``, as the banded kernel (CPU) or compiled Flex (CUDA) apply it: an
            additive bias per head and diagonal (ALiBi, relative positions; ``attnkit.scores``' or your own, probed by
            :func:`attnkit.scores.kernel_terms`) and/or tanh soft-capping. A bias's learned tensors
            get this rank's share of their gradient: sum it over the ranks (``sync_grads``).
        scale: defaults to ``1 / sqrt(E)``.

    Returns:
        ``[B, H, Lq_local, Ev]`` in the dtype of ``query`` (computed in float32 for half inputs, in
        the input dtype otherwise). Rows with no key to attend are zeros, with zero gradients.

    Raises:
        TypeError, ValueError: bad arguments, named as ``attnkit.attention`` names them; shard lengths
            that do not fit the layout. Every rank raises when one does: a rank whose arguments differ
            from rank 0's (dtype, batch, heads, head sizes, layout, ``is_causal``, ``window``, ``scale``,
            ``mask_mod``'s or ``score_mod``'s function or captured tensors, whether autograd records the
            call) makes all raise a ``ValueError`` naming that rank and argument, and a rank that
            refuses its own arguments makes the others raise too.
        RuntimeError: ``torch.distributed`` is not initialised.

    Plain PyTorch on one process, for a reader (``full`` gathers the shards)::

        out = attnkit.attention(full(query), full(key), full(value), is_causal=is_causal, window=window,
                                mask_mod=mask_mod)  # then take my rows
    """
    try:
        req = validate_call(query, key, value, is_causal=is_causal, window=window, mask_mod=mask_mod,
                            score_mod=score_mod, scale=scale)
        if query.dim() != 4:
            raise ValueError(f"query must be [B, heads, L_local, dim], got shape {tuple(query.shape)}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    except (TypeError, ValueError):
        # Take part in the call's one collective, marked as refused, so that the other ranks raise
        # too instead of waiting for this one in the ring.
        refuse_ring_call(group, query)
        raise
    ring, table = _make_ring(req, group, layout)
    return _RingAttention.apply(req.query, req.key, req.value, table, ring)


def _show_window(code: tuple[int, ...]):
    return None if not code[0] else tuple(None if n < 0 else n for n in code[1:])


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", scale))[0]  # exact: equal bits, equal scale


def _show_mod(code: tuple[int, ...]) -> str:
    return "None" if not code[0] else f"a predicate with fingerprint {code[1]:#010x}"


def _fingerprint(mask_mod) -> tuple[int, int]:
    """``(given, crc32)`` of a mask_mod's function (its qualified name) and the tensors it captures
    (document ids, lengths): equal on ranks given the same predicate."""
    if mask_mod is None:
        return (0, 0)
    inner = getattr(mask_mod, "__wrapped__", mask_mod)  # a per-element wrapper made per call: its mod
    code = zlib.crc32(f"{type(inner).__qualname__}.{getattr(inner, '__qualname__', '')}".encode())
    for t in closures.captured_tensors(inner, requiring_grad=False):
        code = zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), code)
    return (1, code)


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
    Field("mask_mod", 2, show=_show_mod),  # (given, crc32 of its function and captured tensors)
    Field("score_mod", 2, show=_show_mod),
    Field("requires_grad", show=lambda c: bool(c[0])),  # one rank's backward would wait for the others'
)


def _call(req, layout: str) -> dict[str, tuple[int, ...]]:
    """This rank's row of :data:`_CALL`."""
    q, k, v, window = req.query, req.key, req.value, req.window
    return {
        "q_len": (q.shape[2],), "kv_len": (k.shape[2],),
        "dtype": name_code(str(q.dtype).removeprefix("torch."), 3),
        "batch": (q.shape[0],), "heads": (q.shape[1],), "kv_heads": (k.shape[1],),
        "head_dim": (q.shape[3],), "value_dim": (v.shape[3],),
        "layout": (LAYOUTS.index(layout),), "is_causal": (int(req.is_causal),),
        "window": (0, -1, -1) if window is None else (1, *(-1 if n is None else n for n in window)),
        "scale": (_scale_bits(req.scale),), "mask_mod": _fingerprint(req.mask_mod),
        "score_mod": _fingerprint(req.score_mod),
        "requires_grad": (int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))),),
    }


def refuse_ring_call(group, like) -> None:
    """This rank's part of a :func:`ring_attention` call it will not make, its own arguments refused.

    For a caller that checks its arguments before calling (``like``: its input tensor): the other
    ranks then raise, naming this rank, instead of waiting for it. The caller raises its own error.
    """
    refuse(_CALL, group, like)


def _make_ring(req, group, layout: str) -> tuple[_Ring, Tensor | None]:
    q = req.query
    rank, world = group_info(group)
    # One small collective: every rank checks that all ranks were called alike, and learns every
    # shard length, hence the global lengths.
    calls = agree("ring_attention", _CALL, _call(req, layout), group, q)
    q_sizes = [c["q_len"][0] for c in calls]
    kv_sizes = [c["kv_len"][0] for c in calls]
    q_len, kv_len = sum(q_sizes), sum(kv_sizes)
    q_pos = positions_from_sizes(q_sizes, layout, "query", q.device)[rank]
    kv_pos = positions_from_sizes(kv_sizes, layout, "key", q.device)
    offset = kv_len - q_len  # bottom-right alignment over the global lengths
    cd = compute_dtype(q.dtype)
    kernel = q.device.type == "cpu" and cd in _band.DTYPES and _band.available()
    use_flex = not kernel and q.device.type in _FLEX_DEVICES and cd in flex.DTYPES
    lo, hi = (t[0, q_pos.cpu(), 0] for t in row_bounds(q_len, kv_len, req.is_causal, req.window))
    bounds = (lo, hi.masked_fill(lo >= hi, 0))  # an empty row widens no tile's bounds
    rows = _my_rows(req, q_pos, q_len, kv_len) if kernel else None
    table, cap = None, 0.0
    if req.score_mod is not None and q_len and kv_len:  # decided from global sizes alike on every rank
        applies = rows is not None or use_flex
        terms = scores.kernel_terms(req.score_mod, batch=q.shape[0], heads=q.shape[1], q_len=q_len, kv_len=kv_len,
                                    dtype=cd, device=q.device) if applies else None
        if terms is None:
            why = scores.NOT_KERNEL_TERMS if applies else (
                "neither runs this call: the banded kernel is not built or the mask has no interval form, and "
                f"compiled Flex serves {' and '.join(_FLEX_DEVICES)} tensors in {', '.join(map(str, flex.DTYPES))}")
            raise ValueError("ring_attention serves a score_mod only as the banded kernel (CPU) or compiled Flex "
                             f"(CUDA) apply it, and here {why}")
        table, cap = terms
    ring = _Ring(
        group=group, rank=rank, world=world,
        next_peer=_global_rank(group, (rank + 1) % world), prev_peer=_global_rank(group, (rank - 1) % world),
        q_pos=q_pos, kv_pos=tuple(kv_pos), kv_sizes=tuple(kv_sizes),
        predicate=combined_mask_mod(req.is_causal, req.window, offset, req.mask_mod),
        rows=rows, q_len=q_len, cap=cap, bounds=bounds,
        batch=q.shape[0], heads=q.shape[1], kv_heads=req.key.shape[1], scale=req.scale, compute_dtype=cd,
        flex=use_flex,
    )
    return ring, table


def _my_rows(req, q_pos: Tensor, q_len: int, kv_len: int) -> tuple[Tensor, Tensor] | None:
    """This rank's query rows' allowed keys over the global sequence, as intervals ``[1|B, Lq_local, K]``
    (:func:`attnkit.mask_plan` on global positions), or None when the mask has no interval form.

    ``is_causal``, ``window`` and the typed masks of :mod:`attnkit.masks` give their intervals
    for the whole sequence without evaluating a cell (then this rank's rows are taken); any other
    predicate is evaluated on this rank's rows only."""
    b, h = req.query.shape[0], req.query.shape[1]
    mod = req.mask_mod
    if q_pos.numel() == 0 or kv_len == 0:
        empty = torch.full((1, q_pos.numel(), 1), kv_len, dtype=torch.int64)
        return empty, empty.clone()
    if mod is None or isinstance(mod, _masks.Mask):
        plan = mask_plan(mod, q_len=q_len, kv_len=kv_len, batch=b, heads=h, is_causal=req.is_causal,
                         window=req.window)
        rows = q_pos.cpu()
        return None if plan.starts is None else (plan.starts[:, rows].contiguous(), plan.ends[:, rows].contiguous())
    whole = combined_mask_mod(req.is_causal, req.window, kv_len - q_len, mod)

    def mine(b, h, q_idx, kv_idx):  # row i of this rank is global query q_pos[i]
        return whole(b, h, q_pos[q_idx], kv_idx)

    plan = mask_plan(mine, q_len=q_pos.numel(), kv_len=kv_len, batch=b, heads=h)
    return None if plan.starts is None or plan.heads is not None else (plan.starts, plan.ends)


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
