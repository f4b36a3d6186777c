"""Checking, in one small all-gather, that the ranks of a collective call were given the same arguments.

Ranks that disagree on an argument of a collective either compute wrong rows without a word (a
different ``is_causal`` or ``scale``; head sizes swapped between ``k`` and ``v``, so every message
still has the size its receiver expects) or die inside the communication backend (a different dtype
or number of heads). :func:`agree` gathers one fixed-size int64 row per rank, describing its call,
and every rank raises the same ``ValueError`` naming the first rank that differs from rank 0 and the
argument. The row also carries what may differ between ranks (shard lengths), so a caller that must
gather those anyway checks its arguments with no extra collective.

A rank that refused its own arguments still sends its row, marked (:func:`refuse`), before raising its
own error: every rank takes part in the gather before any rank raises, so none is left waiting for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .groups import collective_device, group_info

__all__ = ["Field", "agree", "refuse", "name_code", "name_of"]


class Field(NamedTuple):
    """One entry of a call's row: ``width`` int64s, and how an error message shows them."""

    name: str
    width: int = 1
    show: Callable[[tuple[int, ...]], object] = lambda code: code[0]
    same: bool = True  # must be equal on every rank; False: only gathered (e.g. a shard length)


def _gather(fields: tuple[Field, ...], row: list[int], group, like) -> list[list[int]]:
    _, world = group_info(group)
    assert len(row) == 1 + sum(f.width for f in fields), "a row must have the same size on every rank"
    mine = torch.tensor(row, dtype=torch.int64, device=collective_device(like, group))
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def agree(op: str, fields: tuple[Field, ...], values: dict[str, tuple[int, ...]], group,
          like) -> list[dict[str, tuple[int, ...]]]:
    """Gather every rank's ``values`` and check that the fields marked ``same`` are equal everywhere.

    A collective: every rank of ``group`` calls it (or :func:`refuse`) with the same ``fields``.

    Args:
        op: the caller's name, which starts every message.
        fields: the entries of a row, in the order they are checked.
        values: this rank's entries, ``{field.name: (width ints)}``.
        group: the process group (``None``: the world).
        like: the caller's tensor, which says where the row lives (see :func:`.groups.collective_device`).

    Returns:
        every rank's ``values``, in rank order.

    Raises:
        ValueError: on every rank alike, naming the first rank that refused its arguments, or else the
            first rank (and its first field) that differs from rank 0.
    """
    row = [0]  # not refused
    for f in fields:
        code = tuple(int(x) for x in values[f.name])
        assert len(code) == f.width, f"{f.name} takes {f.width} ints, got {code}"
        row += code
    rows = _gather(fields, row, group, like)
    for r, other in enumerate(rows):
        if other[0]:
            raise ValueError(f"{op}: rank {r} refused its arguments (its own error says why); every rank "
                             f"stops here rather than wait for it")
    calls = [_split(fields, other[1:]) for other in rows]
    for r in range(1, len(calls)):
        for f in fields:
            if f.same and calls[r][f.name] != calls[0][f.name]:
                raise ValueError(f"{op}: rank {r} has {f.name}={f.show(calls[r][f.name])} but rank 0 has "
                                 f"{f.name}={f.show(calls[0][f.name])}; every rank must pass the same {f.name}")
    return calls


def refuse(fields: tuple[Field, ...], group, like) -> None:
    """This rank's side of :func:`agree` when it refused its arguments; the caller then raises its error.

    Does nothing without an initialised process group: there is then no one to wait for this rank.
    """
    if dist.is_available() and dist.is_initialized():
        _gather(fields, [1] + [0] * sum(f.width for f in fields), group, like)


def _split(fields: tuple[Field, ...], row: list[int]) -> dict[str, tuple[int, ...]]:
    out, at = {}, 0
    for f in fields:
        out[f.name] = tuple(row[at:at + f.width])
        at += f.width
    return out


def name_code(name: str, width: int) -> tuple[int, ...]:
    """``name`` (ASCII, at most ``8 * width`` characters) as ``width`` int64s; :func:`name_of` reads it back."""
    raw = name.encode("ascii")
    if len(raw) > 8 * width:
        raise ValueError(f"name must fit in {8 * width} bytes, got {name!r}")
    raw = raw.ljust(8 * width, b"\0")
    return tuple(int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8))


def name_of(code: tuple[int, ...]) -> str:
    return b"".join(x.to_bytes(8, "little", signed=True) for x in code).rstrip(b"\0").decode("ascii")
