"""Attention masks: one polarity everywhere, ``True`` = *may attend*.

Every structured mask exists in two forms built from one predicate:

* a **mask_mod** ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's signature), which
  the engine reads through a mask plan (:mod:`attnkit.plan`: each row's keys as intervals, found by
  evaluating the predicate once, for the banded kernel and the tile backends alike);
* a **dense builder** that evaluates the same predicate on the full index grid, for backends and
  tests that want a tensor.

Positions: ``q_idx`` and ``kv_idx`` are raw indices, ``0..Lq-1`` and ``0..Lk-1``, as in
FlexAttention. The causal and window predicates here take an ``offset`` (default ``Lk - Lq`` in the
dense builders) so query ``i`` sits at absolute position ``i + offset``: *bottom-right* alignment,
which is what decoding with a KV cache needs. PyTorch's ``is_causal`` aligns top-left (offset 0).

Converters turn the other libraries' conventions into ours:
``from_key_padding_mask`` (PyTorch, ``True`` = ignore) and ``from_hf_attention_mask``
(Hugging Face, ``1`` = real token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._text import describe

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = [
    "MaskMod",
    "and_masks",
    "or_masks",
    "causal_mod",
    "window_mod",
    "prefix_lm_mod",
    "document_mod",
    "padding_mod",
    "causal",
    "sliding_window",
    "prefix_lm",
    "padding",
    "document",
    "block_diagonal",
    "from_key_padding_mask",
    "from_hf_attention_mask",
    "materialize",
    "global_tokens_mod",
    "global_tokens",
    "dilated_window_mod",
    "dilated_window",
    "strided_mod",
    "strided",
    "block_sparse_mod",
    "block_sparse",
    "bigbird_layout",
    "picture",
]


# --------------------------------------------------------------------------------------------
# Predicates (mask_mods)
# --------------------------------------------------------------------------------------------


def causal_mod(offset: int = 0) -> MaskMod:
    """Query ``i`` may attend key ``j`` when ``j <= i + offset``."""

    def mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mod


def window_mod(left: int | None, right: int | None, offset: int = 0) -> MaskMod:
    """Query ``i`` (at position ``p = i + offset``) may attend keys ``p - left ... p + right``.

    ``None`` on a side means unbounded on that side; ``(None, 0)`` is causal.
    """
    _check_window_side("left", left)
    _check_window_side("right", right)

    def mod(b, h, q_idx, kv_idx):
        d = kv_idx - (q_idx + offset)
        ok = torch.ones_like(d, dtype=torch.bool)
        if left is not None:
            ok = ok & (d >= -left)
        if right is not None:
            ok = ok & (d <= right)
        return ok

    return mod


def prefix_lm_mod(prefix_len: int | Tensor, offset: int = 0) -> MaskMod:
    """Bidirectional over the first ``prefix_len`` keys, causal after them (T5/UniLM prefix LM).

    ``prefix_len`` may be a ``[B]`` tensor, one prefix per batch element.
    """

    def mod(b, h, q_idx, kv_idx):
        p = prefix_len[b] if isinstance(prefix_len, Tensor) else prefix_len
        return (kv_idx < p) | (kv_idx <= q_idx + offset)

    return mod


def document_mod(q_doc_ids: Tensor, kv_doc_ids: Tensor | None = None) -> MaskMod:
    """Tokens attend only within their own document (block-diagonal / packed sequences).

    Args:
        q_doc_ids: ``[Lq]`` or ``[B, Lq]`` integer document id of each query token.
        kv_doc_ids: the same for keys; defaults to ``q_doc_ids`` (self-attention).
    """
    kv_ids = q_doc_ids if kv_doc_ids is None else kv_doc_ids

    def mod(b, h, q_idx, kv_idx):
        if q_doc_ids.dim() == 1:
            return q_doc_ids[q_idx] == kv_ids[kv_idx]
        return q_doc_ids[b, q_idx] == kv_ids[b, kv_idx]

    return mod


def padding_mod(lengths: Tensor) -> MaskMod:
    """Key ``j`` of batch element ``b`` is real when ``j < lengths[b]``."""

    def mod(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return mod


def and_masks(*mods: MaskMod) -> MaskMod:
    """A mask_mod that allows a cell only when every ``mods`` allows it."""
    if not mods:
        raise ValueError("and_masks needs at least one mask_mod, got none")

    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mod


def or_masks(*mods: MaskMod) -> MaskMod:
    """A mask_mod that allows a cell when any of ``mods`` allows it."""
    if not mods:
        raise ValueError("or_masks needs at least one mask_mod, got none")

    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    return mod


# --------------------------------------------------------------------------------------------
# Dense builders
# --------------------------------------------------------------------------------------------


def materialize(
    mask_mod: MaskMod,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluate ``mask_mod`` on the full grid: a bool tensor broadcastable to ``[B, H, Lq, Lk]``.

    The indices are passed as broadcasting tensors (``b: [B,1,1,1]``, ``h: [1,H,1,1]``,
    ``q_idx: [1,1,Lq,1]``, ``kv_idx: [1,1,1,Lk]``), so a predicate written with elementwise ops
    or tensor indexing works unchanged.
    """
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    out = mask_mod(b, h, q, kv)
    check_mask_mod_output(mask_mod, out, (batch, heads, q_len, kv_len))
    return out


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (plain Python: torch.broadcast_shapes costs
    tens of microseconds, paid on every call)."""
    extra = len(target) - len(shape)
    return extra >= 0 and all(a in (1, t) for a, t in zip(shape, target[extra:], strict=True))


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shape that ``shapes`` broadcast to, for shapes known to broadcast together (plain Python,
    for the same reason as :func:`broadcasts_to`)."""
    n = max(map(len, shapes))
    return tuple(map(max, zip(*((1,) * (n - len(s)) + tuple(s) for s in shapes), strict=True)))


def mod_name(kind: str, fn) -> str:
    """``"mask_mod 'doc'"``: the argument and the function's name, for error messages."""
    return f"{kind} {getattr(fn, '__qualname__', type(fn).__name__)!r}"


def check_mask_mod_output(mask_mod: MaskMod, out, grid: tuple[int, ...]) -> None:
    """Raise unless ``out``, what ``mask_mod`` returned on index tensors of ``grid``, is a bool tensor
    broadcastable to ``grid``."""
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(f"{mod_name('mask_mod', mask_mod)} returned {got}; expected a bool tensor, True = may "
                        "attend (e.g. kv_idx <= q_idx, not a 0/1 or float tensor)")
    if not broadcasts_to(out.shape, grid):
        raise ValueError(f"{mod_name('mask_mod', mask_mod)} returned shape {tuple(out.shape)} for indices "
                         f"broadcasting to {tuple(grid)}; expected a shape broadcastable to it")


def _grid(q_len: int, kv_len: int, device) -> tuple[Tensor, Tensor]:
    _check_len("q_len", q_len)
    _check_len("kv_len", kv_len)
    q = torch.arange(q_len, device=device).view(-1, 1)
    kv = torch.arange(kv_len, device=device).view(1, -1)
    return q, kv


def causal(q_len: int, kv_len: int | None = None, *, offset: int | None = None, device=None) -> Tensor:
    """Look-ahead mask ``[Lq, Lk]``, aligned bottom-right by default (``offset = Lk - Lq``).

    ``causal(3, 5)``::

        keys ->  0 1 2 3 4
        q0       x x x . .
        q1       x x x x .
        q2       x x x x x

    (``x`` = may attend). Pass ``offset=0`` for PyTorch's top-left alignment.
    """
    kv_len = q_len if kv_len is None else kv_len
    q, kv = _grid(q_len, kv_len, device)
    off = kv_len - q_len if offset is None else offset
    return causal_mod(off)(None, None, q, kv)


def sliding_window(
    q_len: int,
    kv_len: int | None = None,
    *,
    left: int | None,
    right: int | None = 0,
    offset: int | None = None,
    device=None,
) -> Tensor:
    """Truncated (local) attention ``[Lq, Lk]``: keys within ``left`` before and ``right`` after.

    ``sliding_window(5, left=1, right=1)``::

        keys ->  0 1 2 3 4
        q0       x x . . .
        q1       x x x . .
        q2       . x x x .
        q3       . . x x x
        q4       . . . x x
    """
    kv_len = q_len if kv_len is None else kv_len
    q, kv = _grid(q_len, kv_len, device)
    off = kv_len - q_len if offset is None else offset
    return window_mod(left, right, off)(None, None, q, kv)


def prefix_lm(q_len: int, prefix_len: int, *, device=None) -> Tensor:
    """Prefix-LM mask ``[L, L]``: the prefix sees itself fully, the rest is causal.

    ``prefix_lm(4, 2)``::

        keys ->  0 1 2 3
        q0       x x . .
        q1       x x . .
        q2       x x x .
        q3       x x x x
    """
    q, kv = _grid(q_len, q_len, device)
    return prefix_lm_mod(prefix_len)(None, None, q, kv)


def padding(lengths: Tensor | Sequence[int], max_len: int | None = None, *, device=None) -> Tensor:
    """Key-padding mask ``[B, 1, 1, L]`` from sequence lengths (``True`` = real token).

    ``padding([3, 1], 4)``::

        b0   x x x .
        b1   x . . .
    """
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be a 1-D integer sequence, got shape {tuple(lengths.shape)} "
                         f"dtype {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    max_len = int(lengths.max()) if max_len is None else max_len
    if lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(f"lengths must be <= max_len ({max_len}), got {lengths.tolist()}")
    kv = torch.arange(max_len, device=lengths.device)
    return (kv.view(1, -1) < lengths.view(-1, 1))[:, None, None, :]


def document(q_doc_ids: Tensor, kv_doc_ids: Tensor | None = None) -> Tensor:
    """Block-diagonal mask from per-token document ids: ``[Lq, Lk]`` or ``[B, 1, Lq, Lk]``.

    ``document(tensor([0, 0, 1, 1, 1]))``::

        keys ->  0 1 2 3 4
        q0       x x . . .
        q1       x x . . .
        q2       . . x x x
        q3       . . x x x
        q4       . . x x x
    """
    kv_doc_ids = q_doc_ids if kv_doc_ids is None else kv_doc_ids
    if q_doc_ids.dim() == 1:
        return q_doc_ids.view(-1, 1) == kv_doc_ids.view(1, -1)
    return (q_doc_ids[:, :, None] == kv_doc_ids[:, None, :])[:, None]


def block_diagonal(lengths: Sequence[int], *, device=None) -> Tensor:
    """Block-diagonal mask ``[sum(lengths), sum(lengths)]`` for sequences packed end to end.

    ``block_diagonal([2, 3])`` is ``document(tensor([0, 0, 1, 1, 1]))`` (see there).
    """
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or (lengths < 0).any():
        raise ValueError(f"lengths must be a 1-D sequence of non-negative ints, got {lengths.tolist()}")
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    return document(ids)


# --------------------------------------------------------------------------------------------
# Converters from other conventions
# --------------------------------------------------------------------------------------------


def from_key_padding_mask(key_padding_mask: Tensor) -> Tensor:
    """PyTorch's ``key_padding_mask`` ``[B, L]`` (``True`` = *ignore*) to ours, ``[B, 1, 1, L]``.

    A float ``key_padding_mask`` (additive, ``-inf`` = ignore) is accepted too.
    """
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be a [B, L] tensor, got {describe(key_padding_mask)}")
    if key_padding_mask.dtype == torch.bool:
        keep = ~key_padding_mask
    elif key_padding_mask.is_floating_point():
        keep = key_padding_mask > float("-inf")
    else:
        raise TypeError(f"key_padding_mask must be bool or float, got {key_padding_mask.dtype}")
    return keep[:, None, None, :]


def from_hf_attention_mask(attention_mask: Tensor) -> Tensor:
    """Hugging Face's 0/1 ``attention_mask`` ``[B, L]`` (``1`` = real token) to ``[B, 1, 1, L]``."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a [B, L] tensor, got {describe(attention_mask)}")
    return (attention_mask != 0)[:, None, None, :]


# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Sparse patterns (Longformer, Sparse Transformer, BigBird): predicates and dense builders
# --------------------------------------------------------------------------------------------


def global_tokens_mod(window: int, global_idx, offset: int = 0) -> MaskMod:
    """Longformer: a sliding window of ``window`` keys on each side, plus global positions that see
    every key and are seen by every query (query ``i`` sits at position ``i + offset``).

    A row sees its window and the global keys; a global row sees everything: about
    ``2 * window + 1 + len(global_idx)`` keys, as up to ``len(global_idx) + 1`` intervals.
    """
    _check_window_side("window", window)
    member = _membership(_positions_tensor("global_idx", global_idx))
    last = member.numel() - 1  # always False: where positions past the largest global one land

    def is_global(x: Tensor) -> Tensor:
        return member.to(x.device)[x.clamp(0, last)] & (x >= 0)

    def mod(b, h, q_idx, kv_idx):
        p = q_idx + offset
        return ((p - kv_idx).abs() <= window) | is_global(kv_idx) | is_global(p)

    return mod


def global_tokens(n: int, window: int, global_idx, *, device=None) -> Tensor:
    """``[n, n]`` :func:`global_tokens_mod`. ``global_tokens(12, 1, [0, 7])``::

        >>> print(picture(global_tokens(12, 1, [0, 7])))
        ############
        ###....#....
        ####...#....
        #.###..#....
        #..###.#....
        #...####....
        #....###....
        ############
        #......###..
        #......####.
        #......#.###
        #......#..##
    """
    q, kv = _grid(n, n, device)
    return global_tokens_mod(window, global_idx)(None, None, q, kv)


def dilated_window_mod(window: int, dilation: int, offset: int = 0, *, causal: bool = False) -> MaskMod:
    """Longformer's dilated sliding window: query at position ``p = i + offset`` sees keys
    ``p - d * w ... p + d * w`` in steps of ``d = dilation`` (``w = window``; ``causal`` keeps the
    left side only): ``2 * window + 1`` keys as as many one-key intervals when ``dilation > 1``."""
    _check_window_side("window", window)
    if not isinstance(dilation, int) or isinstance(dilation, bool) or dilation < 1:
        raise ValueError(f"dilation must be a positive int, got {dilation!r}")

    def mod(b, h, q_idx, kv_idx):
        d = q_idx + offset - kv_idx
        ok = (d.abs() <= window * dilation) & (d % dilation == 0)
        return ok & (d >= 0) if causal else ok

    return mod


def dilated_window(n: int, window: int, dilation: int, *, causal: bool = False, device=None) -> Tensor:
    """``[n, n]`` :func:`dilated_window_mod`. ``dilated_window(12, 2, 2)``::

        >>> print(picture(dilated_window(12, 2, 2)))
        #.#.#.......
        .#.#.#......
        #.#.#.#.....
        .#.#.#.#....
        #.#.#.#.#...
        .#.#.#.#.#..
        ..#.#.#.#.#.
        ...#.#.#.#.#
        ....#.#.#.#.
        .....#.#.#.#
        ......#.#.#.
        .......#.#.#
    """
    q, kv = _grid(n, n, device)
    return dilated_window_mod(window, dilation, causal=causal)(None, None, q, kv)


def strided_mod(stride: int, offset: int = 0) -> MaskMod:
    """Sparse Transformer's strided pattern (Child et al. 2019), causal: query at position ``p``
    sees the previous ``stride`` keys (``p - stride < j <= p``) and every key ``stride``, ``2 *
    stride``, ... back (``(p - j) % stride == 0``): about ``p / stride + 1`` intervals per row."""
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise ValueError(f"stride must be a positive int, got {stride!r}")

    def mod(b, h, q_idx, kv_idx):
        d = q_idx + offset - kv_idx
        return (d >= 0) & ((d < stride) | (d % stride == 0))

    return mod


def strided(n: int, stride: int, *, device=None) -> Tensor:
    """``[n, n]`` :func:`strided_mod`. ``strided(12, 3)``::

        >>> print(picture(strided(12, 3)))
        #...........
        ##..........
        ###.........
        ####........
        .####.......
        ..####......
        #..####.....
        .#..####....
        ..#..####...
        #..#..####..
        .#..#..####.
        ..#..#..####
    """
    q, kv = _grid(n, n, device)
    return strided_mod(stride)(None, None, q, kv)


def block_sparse_mod(layout: Tensor, block: int) -> MaskMod:
    """Attend by blocks: query ``i`` may see key ``j`` when ``layout[i // block, j // block]``
    (``layout``: bool ``[query blocks, key blocks]``, e.g. :func:`bigbird_layout`)."""
    if not isinstance(layout, Tensor) or layout.dtype != torch.bool or layout.dim() != 2:
        raise ValueError(f"layout must be a 2-D bool tensor [query blocks, key blocks], got {describe(layout)}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")

    def mod(b, h, q_idx, kv_idx):
        return layout[(q_idx // block).clamp(max=layout.shape[0] - 1), (kv_idx // block).clamp(max=layout.shape[1] - 1)]

    return mod


def block_sparse(layout: Tensor, block: int, *, device=None) -> Tensor:
    """``[Lq, Lk]`` :func:`block_sparse_mod` (each layout entry a ``block x block`` square)::

        >>> print(picture(block_sparse(torch.tensor([[True, False], [True, True]]), 3)))
        ###...
        ###...
        ###...
        ######
        ######
        ######
    """
    q, kv = _grid(layout.shape[0] * block, layout.shape[1] * block, device)
    return block_sparse_mod(layout, block)(None, None, q, kv)


def bigbird_layout(n_blocks: int, *, window_blocks: int = 3, global_blocks: int = 2, random_blocks: int = 3,
                   seed: int = 0) -> Tensor:
    """BigBird's block layout (Zaheer et al. 2020), bool ``[n_blocks, n_blocks]``: each block row
    sees ``window_blocks`` blocks around its own, the first ``global_blocks`` blocks (which also see
    every block), and ``random_blocks`` other blocks drawn with ``torch.Generator`` seeded by
    ``seed`` (the same on every machine)::

        >>> print(picture(bigbird_layout(8, window_blocks=3, global_blocks=1, random_blocks=1, seed=0)))
        ########
        ###....#
        ####...#
        #.###..#
        #.####..
        #...####
        ##...###
        #...#.##
    """
    for name, val, least in (("n_blocks", n_blocks, 1), ("window_blocks", window_blocks, 0),
                             ("global_blocks", global_blocks, 0), ("random_blocks", random_blocks, 0)):
        if not isinstance(val, int) or isinstance(val, bool) or val < least:
            raise ValueError(f"{name} must be an int >= {least}, got {val!r}")
    i = torch.arange(n_blocks)
    layout = (i.view(-1, 1) - i.view(1, -1)).abs() <= window_blocks // 2
    layout[:global_blocks] = True
    layout[:, :global_blocks] = True
    gen = torch.Generator().manual_seed(seed)
    for row in range(global_blocks, n_blocks):
        free = (~layout[row]).nonzero().flatten()
        pick = free[torch.randperm(free.numel(), generator=gen)[:random_blocks]]
        layout[row, pick] = True
    return layout


def picture(mask: Tensor) -> str:
    """A 2-D bool mask as text, one line per query: ``#`` may attend, ``.`` may not."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a 2-D tensor [Lq, Lk], got {describe(mask)}")
    return "\n".join("".join("#" if x else "." for x in row) for row in mask.tolist())


def _positions_tensor(name: str, idx) -> Tensor:
    t = torch.as_tensor(idx, dtype=torch.long).flatten()
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must hold non-negative positions, got {t.tolist()}")
    return t


def _membership(idx: Tensor) -> Tensor:
    """Bool ``[max + 2]``: True at the positions in ``idx`` (the last entry stays False, so a clamped
    index past the end reads False)."""
    out = torch.zeros(int(idx.max()) + 2 if idx.numel() else 1, dtype=torch.bool)
    out[idx] = True
    return out


def _check_len(name: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")


def _check_window_side(name: str, n) -> None:
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"window {name} must be None or a non-negative int, got {n!r}")

