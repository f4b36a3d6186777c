"""Structure read from a user's mask_mod or score_mod itself, exactly, or not at all.

What and why: the engine builds a plan once per mod. This module is its analysis half:
pure functions that look at the mod's values (never at attributes attnkit attached) and
say what structure they have, or return None so the engine takes its general exact path.

- ``evaluator(mod, kind)``: the mod with attnkit's broadcasting convention, giving the values
  FlexAttention's per-element (vmapped) semantics give. Decided once per mod (weak cache):
  the broadcasting call is used when, on a small grid taken from the first call's indices,
  it neither raises, nor returns a wrong shape, nor disagrees with per-element calls through
  torch.vmap; otherwise every call goes through torch.vmap over the cells, in chunks.
- ``mask_intervals``: each query row's runs of True, evaluated on the whole grid in row chunks
  (exact, cell by cell), in the shared Intervals convention; None when the mask depends on the
  head or a row has more than ``max_intervals`` runs.
- ``tile_kinds``: EMPTY/FULL/PARTIAL per (query tile, key block) from intervals alone.
- ``score_structure``: recognises exactly ``score + bias(h, kv - q)``, ``cap * tanh(score / cap)``
  and ``cap * tanh((score + bias(h, kv - q)) / cap)``. The bias table is read from the first row
  and first column (which meet every diagonal) with the score at zero, after checking
  additivity at two score tensors; the cap is read at a large score. The result is then
  verified against the mod: on the whole grid when it has at most 2^22 cells, otherwise on
  fixed-seed 64x64 tiles plus the four corners, for several batch and head indices, with
  scores spanning the tanh curve. Any mismatch beyond a tight tolerance, a batch-dependent
  bias, or a mod whose values change between calls gives None. The table is built with
  autograd on, so it is differentiable w.r.t. tensors the mod captures (ALiBi slopes as an
  nn.Parameter): it is the mod's own output at zero score, not a copy.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

EMPTY, FULL, PARTIAL = 0, 1, 2
_CHUNK_CELLS = 1 << 21
_VMAP_CELLS = 1 << 16
_KINDS = ("mask_mod", "score_mod")
_broadcast_ok: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ScoreStructure:
    """A score_mod read as ``softcap(score + table[h, kv - q + Lq - 1])``; either part may be None."""

    table: Tensor | None
    softcap: float | None


# ---------------------------------------------------------------- semantics

def evaluator(mod, kind: str):
    """The mod in attnkit's broadcasting convention with FlexAttention's per-element values."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if not callable(mod):
        raise TypeError(f"mod must be callable, got {type(mod).__name__}")

    def call(*args):
        ok = _broadcast_ok.get(mod)
        if ok is None:
            ok = _decide(mod, args)
            try:
                _broadcast_ok[mod] = ok
            except TypeError:
                pass
        if ok:
            return _broadcast(mod, args)
        return _per_element(mod, args)
    return call


def _broadcast(mod, args):
    out = mod(*args)
    return torch.as_tensor(out).expand(torch.broadcast_shapes(*(a.shape for a in args)))


def _decide(mod, args) -> bool:
    """True when the broadcasting call matches per-element calls on a small sub-grid of args."""
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    picks = [_pick(n) for n in shape]
    small = []
    for a in args:
        for d, p in enumerate(picks):
            if a.shape[d] != 1:
                a = a.index_select(d, p)
        small.append(a)
    try:
        fast = mod(*small)
        want = torch.broadcast_shapes(*(a.shape for a in small))
        if not isinstance(fast, Tensor) or torch.broadcast_shapes(fast.shape, want) != want:
            return False
        fast = fast.expand(want)
    except Exception:
        return False
    slow = _per_element(mod, small)
    return fast.dtype == slow.dtype and bool(torch.equal(fast, slow))


def _pick(n: int) -> Tensor:
    return torch.tensor(sorted({0, n // 2, n - 1, min(1, n - 1)}))


def _per_element(mod, args):
    """Per-element values through torch.vmap over the cells, in chunks of bounded size."""
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    flat = [a.expand(shape).reshape(-1) for a in args]
    f = torch.vmap(lambda *xs: torch.as_tensor(mod(*xs)))
    n = flat[0].numel()
    parts = [f(*(x[i:i + _VMAP_CELLS] for x in flat)) for i in range(0, n, _VMAP_CELLS)]
    return torch.cat(parts).reshape(shape)


def check_bool(out: Tensor, mod=None) -> Tensor:
    """The predicate's output, or ValueError when it is not bool."""
    if out.dtype != torch.bool:
        name = getattr(mod, "__name__", repr(mod))
        raise ValueError(f"mask_mod {name} returned dtype {out.dtype}; expected torch.bool")
    return out


# ---------------------------------------------------------------- mask intervals

def _grid(batch, heads, q, kv_len, device):
    """Broadcasting int32 index tensors (half the memory traffic of int64; torch indexes with them)."""
    i32 = torch.int32
    return (torch.arange(batch, device=device, dtype=i32).view(-1, 1, 1, 1),
            torch.arange(heads, device=device, dtype=i32).view(1, -1, 1, 1),
            q.to(i32).view(1, 1, -1, 1),
            torch.arange(kv_len, device=device, dtype=i32).view(1, 1, 1, -1))


def mask_intervals(mask_mod, batch: int, heads: int, q_len: int, kv_len: int, *, device="cpu",
                   max_intervals: int = 64, row_chunk: int | None = None) -> tuple[Tensor, Tensor] | None:
    """Each row's runs of True as (starts, ends) int64 [1 or batch, q_len, K], exact; None if head-dependent
    or some row has more than max_intervals runs."""
    for name, v in (("batch", batch), ("heads", heads), ("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    f = evaluator(mask_mod, "mask_mod")
    rows = row_chunk or max(1, _CHUNK_CELLS // max(1, kv_len * batch * heads))
    found = []  # (batch index, row, start, end) per run, chunk by chunk
    bp = 1
    for q0 in range(0, q_len, rows):
        q = torch.arange(q0, min(q_len, q0 + rows), device=device)
        out = check_bool(torch.as_tensor(f(*_grid(batch, heads, q, kv_len, device))), mask_mod)
        if out.shape[1] > 1 and not bool((out == out[:, :1]).all()):
            return None
        out = out[:, 0]
        if out.shape[0] > 1 and bool((out == out[:1]).all()):
            out = out[:1]
        bp = max(bp, out.shape[0])
        found.append((out.shape[0], q0, _chunk_runs(out.expand(out.shape[0], q.numel(), kv_len).cpu())))
    return _assemble(found, bp, q_len, kv_len, max_intervals)


def _chunk_runs(out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs of True in a bool [b, rows, Lk] block: one nonzero over the edges, which alternate start, end."""
    pad = torch.zeros(out.shape[0], out.shape[1], 1, dtype=torch.bool)
    padded = torch.cat([pad, out, pad], dim=2)
    bi, qi, pos = (padded[..., 1:] ^ padded[..., :-1]).nonzero(as_tuple=True)
    return bi[0::2], qi[0::2], pos[0::2], pos[1::2]


def _assemble(found, bp: int, q_len: int, kv_len: int, max_intervals: int) -> tuple[Tensor, Tensor] | None:
    bis, rows, sk, ek = [], [], [], []
    for nb, q0, (bi, qi, s, e) in found:
        reps = bp if nb == 1 else 1  # a batch-independent chunk stands for every batch element
        for r in range(reps):
            bis.append(bi + r)
            rows.append(qi + q0)
            sk.append(s)
            ek.append(e)
    row = torch.cat(bis) * q_len + torch.cat(rows)
    sk, ek = torch.cat(sk), torch.cat(ek)
    order = torch.argsort(row, stable=True)
    row, sk, ek = row[order], sk[order], ek[order]
    counts = torch.bincount(row, minlength=bp * q_len)
    k = int(counts.max()) if counts.numel() else 0
    if k > max_intervals:
        return None
    k = max(k, 1)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(row.numel()) - first[row]
    starts = torch.full((bp * q_len, k), kv_len, dtype=torch.int64)
    ends = starts.clone()
    starts[row, slot] = sk
    ends[row, slot] = ek
    return starts.view(bp, q_len, k), ends.view(bp, q_len, k)


def tile_kinds(starts: Tensor, ends: Tensor, q_len: int, kv_len: int, q_tile: int, kv_block: int) -> Tensor:
    """int8 [tiles, blocks]: FULL when every real row attends every key of a whole block, EMPTY when none
    attends any, PARTIAL otherwise; from intervals via covered-key counts (no per-cell work)."""
    nb = -(-kv_len // kv_block)
    edges = torch.arange(nb + 1, dtype=torch.int64) * kv_block
    edges = edges.clamp(max=kv_len)
    width = (ends - starts).unsqueeze(-1)
    below = (edges.view(1, 1, 1, -1) - starts.unsqueeze(-1)).clamp(min=0)
    covered = torch.minimum(below, width).sum(2)  # [Bp, Lq, nb + 1]: keys < edge attended
    cov = covered[..., 1:] - covered[..., :-1]
    whole = torch.full((nb,), kv_block, dtype=torch.int64)
    full_row = cov == whole
    empty_row = cov == 0
    nt = -(-q_len // q_tile)
    padn = nt * q_tile - q_len
    full_row = torch.nn.functional.pad(full_row, (0, 0, 0, padn), value=True)
    empty_row = torch.nn.functional.pad(empty_row, (0, 0, 0, padn), value=True)
    full = full_row.view(full_row.shape[0], nt, q_tile, nb).all(2).all(0)
    empty = empty_row.view(empty_row.shape[0], nt, q_tile, nb).all(2).all(0)
    kinds = torch.full((nt, nb), PARTIAL, dtype=torch.int8)
    kinds[full] = FULL
    kinds[empty] = EMPTY
    return kinds


# ---------------------------------------------------------------- score structure

def score_structure(score_mod, batch: int, heads: int, q_len: int, kv_len: int, *, dtype: torch.dtype,
                    device="cpu") -> ScoreStructure | None:
    """The score_mod as a diagonal bias and/or a soft cap, verified against the mod; None otherwise."""
    f = evaluator(score_mod, "score_mod")
    work = _working_dtype(f, device, dtype)
    if work is None:
        return None
    try:
        found = _read_and_verify(f, batch, heads, q_len, kv_len, work, device)
    except Exception:
        return None
    if found is None or found.table is None:
        return found
    return ScoreStructure(table=found.table.to(dtype), softcap=found.softcap)


def _working_dtype(f, device, dtype):
    """float64 when the mod accepts it (tight checks), else the requested dtype, else None."""
    for d in (torch.float64, dtype):
        one = torch.zeros(1, 1, 1, 1, dtype=d, device=device)
        idx = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=device)
        try:
            if torch.as_tensor(f(one, idx, idx, idx, idx)).dtype == d:
                return d
        except Exception:
            continue
    return None


def _edge(f, score_fill, batch, heads, q_len, kv_len, dtype, device):
    """The mod on the first column (q = Lq-1..1, kv = 0) and first row (q = 0) as [B, H, Lq + Lk - 1]."""
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    q = torch.cat([torch.arange(q_len - 1, 0, -1), torch.zeros(kv_len, dtype=torch.int64)]).to(device)
    kv = torch.cat([torch.zeros(q_len - 1, dtype=torch.int64), torch.arange(kv_len)]).to(device)
    shape = (batch, heads, 1, q.numel())
    s = torch.as_tensor(score_fill, dtype=dtype, device=device).expand(shape)
    out = f(s, b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, 1, -1), kv.view(1, 1, 1, -1))
    return out.expand(shape)[:, :, 0]


def _read_and_verify(f, batch, heads, q_len, kv_len, dtype, device):
    gen = torch.Generator().manual_seed(0)
    n = q_len + kv_len - 1
    zero = _edge(f, 0.0, batch, heads, q_len, kv_len, dtype, device)
    t = (torch.rand(batch, heads, n, generator=gen, dtype=torch.float64) * 6 - 3).to(dtype)
    moved = _edge_with(f, t, batch, heads, q_len, kv_len, dtype, device)
    tol = _tol(dtype)
    cap = None
    if _close(moved - zero, t, tol):
        bias = zero
    else:
        big = _edge(f, 1e6, batch, heads, q_len, kv_len, dtype, device).detach()
        cap = float(big.flatten()[0])
        if not (cap > 0 and _close(big, torch.full_like(big, cap), tol)):
            return None
        ratio = (zero / cap).clamp(-1, 1)
        if bool((ratio.detach().abs() >= 1 - 1e-6).any()):
            return None
        bias = cap * torch.atanh(ratio)
    if not bool((bias.detach() == bias.detach()[:1]).all()):
        return None  # the bias depends on the batch element
    table = bias[0]
    if heads > 1 and bool((table.detach() == table.detach()[:1]).all()):
        table = table[:1]
    if bool((table.detach() == 0).all()):
        table = None
    if not _verify(f, table, cap, batch, heads, q_len, kv_len, dtype, device, gen, tol):
        return None
    return ScoreStructure(table=table, softcap=cap)


def _edge_with(f, t, batch, heads, q_len, kv_len, dtype, device):
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    q = torch.cat([torch.arange(q_len - 1, 0, -1), torch.zeros(kv_len, dtype=torch.int64)]).to(device)
    kv = torch.cat([torch.zeros(q_len - 1, dtype=torch.int64), torch.arange(kv_len)]).to(device)
    s = t.to(device).unsqueeze(2)
    out = f(s, b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, 1, -1), kv.view(1, 1, 1, -1))
    return out.expand(s.shape)[:, :, 0]


def _tol(dtype) -> float:
    return 1e-9 if dtype == torch.float64 else 8 * torch.finfo(dtype).eps


def _close(a: Tensor, b: Tensor, tol: float) -> bool:
    a, b = a.detach().double(), b.detach().double()
    return bool(((a - b).abs() <= tol * (1 + b.abs())).all())


def _verify(f, table, cap, batch, heads, q_len, kv_len, dtype, device, gen, tol) -> bool:
    """The structure against the mod on the whole grid (<= 2^22 cells) or on sampled tiles and corners."""
    if q_len * kv_len <= 1 << 22:
        tiles = [(torch.arange(q_len), torch.arange(kv_len))]
    else:
        tiles = [(torch.arange(q_len)[q0:q0 + 64], torch.arange(kv_len)[k0:k0 + 64])
                 for q0 in (0, max(0, q_len - 64)) for k0 in (0, max(0, kv_len - 64))]
        for _ in range(8):
            q0 = int(torch.randint(0, max(1, q_len - 63), (1,), generator=gen))
            k0 = int(torch.randint(0, max(1, kv_len - 63), (1,), generator=gen))
            tiles.append((torch.arange(q0, min(q_len, q0 + 64)), torch.arange(k0, min(kv_len, k0 + 64))))
    bs = sorted({0, batch - 1, batch // 2})
    hs = sorted({0, heads - 1, heads // 2})
    span = 3 * cap if cap is not None else 10.0
    for q, kv in tiles:
        for bi in bs:
            b = torch.tensor([bi]).view(1, 1, 1, 1)
            h = torch.tensor(hs).view(1, -1, 1, 1)
            s = (torch.rand(1, len(hs), q.numel(), kv.numel(), generator=gen, dtype=torch.float64) * 2 - 1) * span
            s = s.to(dtype)
            got = f(s.to(device), b.to(device), h.to(device), q.view(1, 1, -1, 1).to(device),
                    kv.view(1, 1, 1, -1).to(device)).expand(s.shape).detach().cpu()
            want = s.double()
            if table is not None:
                rows = table.detach().cpu().double()
                rows = rows[h.view(-1) if rows.shape[0] > 1 else torch.zeros(len(hs), dtype=torch.int64)]
                want = want + rows[:, (kv.view(1, -1) - q.view(-1, 1) + q_len - 1)].unsqueeze(0)
            if cap is not None:
                want = cap * torch.tanh(want / cap)
            if not _close(got, want, max(tol, 1e-12) * (1 + span)):
                return False
    return True
