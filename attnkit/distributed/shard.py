"""Which positions of a sequence each rank holds, and moving between full and sharded sequences.

Two layouts split a sequence of length ``L`` over ``P`` ranks:

* ``"contiguous"``: rank ``r`` holds the ``r``-th of ``P`` consecutive chunks.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and
  ``2P - 1 - r``, so every rank gets one early and one late chunk. Under a causal mask the work
  of a rank (how many keys its queries see) is then nearly equal across ranks, where the
  contiguous layout gives the last rank ``2P - 1`` times the work of the first.

``L = 10, P = 2``::

    positions    0 1 2 3 4 5 6 7 8 9
    contiguous   0 0 0 0 0 1 1 1 1 1
    zigzag       0 0 0 1 1 1 1 1 0 0      (chunks of 3, 3, 2, 2)

Lengths need not divide evenly: chunk sizes follow ``numpy.array_split`` (the first ``L % n``
chunks are one longer).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from .agree import Field, agree, name_code, name_of, refuse
from .groups import group_info

LAYOUTS = ("contiguous", "zigzag")
"""How a sequence is split over ``P`` ranks: ``"contiguous"`` (rank ``r`` holds the ``r``-th slice) or
``"zigzag"`` (chunks ``r`` and ``2P - 1 - r`` of ``2P``, which balances the work under a causal mask)."""

__all__ = ["LAYOUTS", "shard", "unshard", "shard_sizes", "shard_positions", "positions_from_sizes", "group_info"]


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _chunks(length: int, parts: int) -> list[int]:
    base, extra = divmod(length, parts)
    return [base + (i < extra) for i in range(parts)]


def _pieces(length: int, world: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """``(start, size)`` of each piece of the sequence rank ``rank`` holds, in order."""
    if layout == "contiguous":
        sizes = _chunks(length, world)
        return [(sum(sizes[:rank]), sizes[rank])]
    sizes = _chunks(length, 2 * world)
    first, second = rank, 2 * world - 1 - rank
    return [(sum(sizes[:first]), sizes[first]), (sum(sizes[:second]), sizes[second])]


def shard_sizes(length: int, world: int, layout: str) -> list[int]:
    """How many positions each rank holds: ``[size of rank 0, ..., size of rank P-1]``."""
    _check_layout(layout)
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"length must be a non-negative int, got {length!r}")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    return [sum(n for _, n in _pieces(length, world, r, layout)) for r in range(world)]


def shard_positions(length: int, world: int, rank: int, layout: str, *, device=None) -> Tensor:
    """The global positions (int64 ``[L_local]``) that rank ``rank`` holds, in its local order."""
    sizes = shard_sizes(length, world, layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
    pos = [torch.arange(s, s + n, device=device) for s, n in _pieces(length, world, rank, layout)]
    out = torch.cat(pos)
    assert out.numel() == sizes[rank]
    return out


def positions_from_sizes(sizes: list[int], layout: str, name: str, device=None) -> list[Tensor]:
    """Global positions held by each rank, given every rank's shard length.

    ``"contiguous"`` accepts any lengths (rank ``r`` follows rank ``r - 1``); ``"zigzag"`` only
    the split :func:`shard` makes.

    Raises:
        ValueError: zigzag lengths that are not that split (``name`` says of which tensor).
    """
    world, total = len(sizes), sum(sizes)
    if layout == "contiguous":
        starts = [sum(sizes[:r]) for r in range(world)]
        return [torch.arange(s, s + n, device=device) for s, n in zip(starts, sizes, strict=True)]
    expected = shard_sizes(total, world, layout)
    if sizes != expected:
        raise ValueError(f"{name} shard lengths across ranks {sizes} are not the zigzag split of "
                         f"{total} positions, expected {expected}; shard with attnkit.distributed.shard")
    return [shard_positions(total, world, r, layout, device=device) for r in range(world)]


def _check_tensor_dim(x, dim) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % x.dim()


def shard(x: Tensor, dim: int, *, layout: str = "contiguous", group=None) -> Tensor:
    """This rank's shard of the full sequence ``x`` along ``dim`` (no communication).

    Every rank passes the same full ``x``; rank ``r`` gets back the positions
    :func:`shard_positions` names. Differentiable (it is slicing).

    Args:
        x: the full sequence, e.g. ``[B, H, L, D]`` with ``dim=2`` or ``[B, L, E]`` with ``dim=1``.
        dim: the sequence dimension.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
        group: the process group (default: the world).

    Returns:
        ``x`` narrowed to this rank's ``L_local`` positions along ``dim``.
    """
    dim = _check_tensor_dim(x, dim)
    _check_layout(layout)
    rank, world = group_info(group)
    pieces = _pieces(x.shape[dim], world, rank, layout)
    parts = [x.narrow(dim, s, n) for s, n in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


#: Dimensions of ``x`` an unshard call describes to the other ranks one by one; more are folded into a checksum.
_SHOWN_DIMS = 8


def _unshard_fields():
    """What an :func:`unshard` call looks like to the other ranks (:mod:`.agree`): every field but the
    shard length must agree, or gloo aborts a rank (a different dtype or size) or the gather mixes up
    rows (sizes that multiply to the same count)."""
    def show_shape(code: tuple[int, ...]) -> str:
        dims = [("L_local" if c == -1 else str(c)) for c in code if c != -2]
        if len(code) == _SHOWN_DIMS and code[-1] >= 2**32:  # the checksum of dimensions past the shown ones
            dims[-1] = "..."
        return f"({', '.join(dims)})"

    return (
        Field("length", same=False),
        Field("dtype", 3, show=lambda c: f"torch.{name_of(c)}"),
        Field("ndim"),
        Field("dim"),
        Field("shape", _SHOWN_DIMS, show=show_shape),  # every size but the sequence dimension's (L_local)
        Field("layout", show=lambda c: repr(LAYOUTS[c[0]])),
    )


def _unshard_call(x: Tensor, dim: int, layout: str) -> dict[str, tuple[int, ...]]:
    sizes = [-1 if i == dim else n for i, n in enumerate(x.shape)]
    if len(sizes) > _SHOWN_DIMS:
        sizes = sizes[:_SHOWN_DIMS - 1] + [2**32 + zlib.crc32(repr(sizes[_SHOWN_DIMS - 1:]).encode())]
    return {"length": (x.shape[dim],), "dtype": name_code(str(x.dtype).removeprefix("torch."), 3),
            "ndim": (x.dim(),), "dim": (dim,), "shape": tuple(sizes + [-2] * (_SHOWN_DIMS - len(sizes))),
            "layout": (LAYOUTS.index(layout),)}


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, layout, group):
        rank, world = group_info(group)
        # One small gather checks that every rank was called alike and tells each the shard lengths,
        # then one gathers the (padded) shards; every rank issues both.
        calls = agree("unshard", _unshard_fields(), _unshard_call(x, dim, layout), group, x)
        sizes = [c["length"][0] for c in calls]
        length = sum(sizes)
        positions = positions_from_sizes(sizes, layout, "x", x.device)
        width = max(sizes)
        pad = list(x.shape)
        pad[dim] = width - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        shape = list(x.shape)
        shape[dim] = length
        out = x.new_empty(shape)
        for r in range(world):
            out.index_copy_(dim, positions[r], gathered[r].narrow(dim, 0, sizes[r]))
        ctx.dim = dim
        ctx.save_for_backward(positions[rank])
        return out

    @staticmethod
    def backward(ctx, grad):
        (mine,) = ctx.saved_tensors
        return grad.index_select(ctx.dim, mine), None, None, None


def unshard(x: Tensor, dim: int, *, layout: str = "contiguous", group=None) -> Tensor:
    """Gather every rank's shard along ``dim`` back into the full sequence, on every rank.

    The inverse of :func:`shard` (a collective: every rank of ``group`` must call it); with
    ``"contiguous"``, shards of any lengths are joined in rank order. Its
    gradient is this rank's shard of the incoming gradient, with no communication: right when
    what follows is computed identically on every rank (gather, then the same loss everywhere).

    Args:
        x: this rank's shard, e.g. ``[B, H, L_local, D]`` with ``dim=2``.
        dim: the sequence dimension.
        layout: the layout the shards were made with.
        group: the process group (default: the world).

    Returns:
        the full sequence, ``L = sum of L_local`` along ``dim``.

    Raises:
        ValueError: zigzag shard lengths across ranks that are not the split ``shard`` makes; or, on
            every rank alike, ranks called differently (dtype, dimensions, sizes other than the
            sequence length, layout), naming the first rank that differs and what differs. A rank
            whose own arguments are refused tells the others before it raises, so none is left waiting.
    """
    try:
        dim = _check_tensor_dim(x, dim)
        _check_layout(layout)
    except (TypeError, ValueError):
        refuse(_unshard_fields(), group, x)
        raise
    return _Unshard.apply(x, dim, layout, group)
