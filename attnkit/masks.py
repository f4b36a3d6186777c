"""Attention masks: one polarity everywhere, ``True`` = *may attend*.

Every structured mask exists in two forms built from one predicate:

* a **mask_mod** ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's signature), which
  the engine reads through a mask plan (:mod:`attnkit.maskplan`: each row's keys as intervals, found by
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

from . import per_element
from ._text import describe
from .intervals import Intervals, intersect_intervals, normalize, positions, row_bounds, trim, union_intervals
from .memory import check_op_fits, over_limit

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""A predicate ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's signature): ``True`` = may attend."""

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
    "fixed_mod",
    "fixed",
    "picture",
    "Mask",
    "Causal",
    "Window",
    "PrefixLM",
    "Document",
    "Padding",
    "And",
    "Or",
    "GlobalTokens",
    "DilatedWindow",
    "Strided",
    "Fixed",
    "BlockSparse",
    "Intervals",
    "normalize",
    "intersect_intervals",
    "union_intervals",
]


# --------------------------------------------------------------------------------------------
# Typed predicates (mask_mods)
# --------------------------------------------------------------------------------------------


class Mask:
    """A mask_mod that knows its shape: callable as FlexAttention's ``mask(b, h, q_idx, kv_idx) ->
    bool tensor`` (broadcasting index tensors), and :meth:`intervals` gives each row's keys exactly,
    so the engine need not evaluate the predicate cell by cell. Subclasses define both; equality and
    hashing are by identity (plans are cached per mask object). ``broadcasts``: written to broadcast
    (:func:`attnkit.per_element.broadcasts`), so calls skip the per-element comparison."""

    broadcasts = True

    def __call__(self, b, h, q_idx, kv_idx) -> Tensor:
        raise NotImplementedError

    def intervals(self, batch: int, q_len: int, kv_len: int) -> Intervals | None:
        """Each row's allowed keys in the shared form: ``(starts, ends)``, int64 ``[1 or batch, q_len,
        K]``, sorted, disjoint, empties ``(kv_len, kv_len)`` last; None when this mask has no exact
        interval form for these sizes."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class Causal(Mask):
    """Query ``i`` may attend key ``j`` when ``j <= i + offset`` (one interval per row)."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.offset

    def intervals(self, batch, q_len, kv_len):
        return row_bounds(q_len, kv_len, is_causal=True, offset=self.offset)


class Window(Mask):
    """Query ``i`` at ``p = i + offset`` may attend keys ``p - left ... p + right`` (``None``:
    unbounded on that side); one interval per row."""

    def __init__(self, left: int | None, right: int | None, offset: int = 0):
        _check_window_side("left", left)
        _check_window_side("right", right)
        self.left, self.right, self.offset = left, right, offset

    def __call__(self, b, h, q_idx, kv_idx):
        d = kv_idx - (q_idx + self.offset)
        ok = torch.ones_like(d, dtype=torch.bool)
        if self.left is not None:
            ok = ok & (d >= -self.left)
        if self.right is not None:
            ok = ok & (d <= self.right)
        return ok

    def intervals(self, batch, q_len, kv_len):
        return row_bounds(q_len, kv_len, window=(self.left, self.right), offset=self.offset)


class PrefixLM(Mask):
    """Bidirectional over the first ``prefix_len`` keys (an int or one per batch element, ``[B]``),
    causal after them; one interval per row."""

    def __init__(self, prefix_len: int | Tensor, offset: int = 0):
        self.prefix_len, self.offset = prefix_len, offset

    def __call__(self, b, h, q_idx, kv_idx):
        p = self.prefix_len[b] if isinstance(self.prefix_len, Tensor) else self.prefix_len
        return (kv_idx < p) | (kv_idx <= q_idx + self.offset)

    def intervals(self, batch, q_len, kv_len):
        cut = self.prefix_len
        if isinstance(cut, Tensor):
            if cut.dim() != 1 or cut.numel() < batch:
                return None
            cut = cut[:batch].detach().long().cpu().view(-1, 1, 1)
        p = positions(q_len, self.offset)
        return normalize(torch.zeros_like(p), torch.maximum(p + 1, torch.as_tensor(cut)), kv_len)


class Document(Mask):
    """Tokens attend only within their own document (ids ``[L]`` or ``[B, L]``); a document whose
    keys come in several runs gives as many intervals."""

    def __init__(self, q_doc_ids: Tensor, kv_doc_ids: Tensor | None = None):
        self.q_doc_ids = q_doc_ids
        self.kv_doc_ids = q_doc_ids if kv_doc_ids is None else kv_doc_ids

    def __call__(self, b, h, q_idx, kv_idx):
        if self.q_doc_ids.dim() == 1:
            return self.q_doc_ids[q_idx] == self.kv_doc_ids[kv_idx]
        return self.q_doc_ids[b, q_idx] == self.kv_doc_ids[b, kv_idx]

    def intervals(self, batch, q_len, kv_len):
        q_ids, kv_ids = self.q_doc_ids, self.kv_doc_ids
        if q_ids.dim() != kv_ids.dim() or q_ids.dim() not in (1, 2) or q_ids.shape[-1] < q_len \
                or kv_ids.shape[-1] < kv_len or (q_ids.dim() == 2 and min(len(q_ids), len(kv_ids)) < batch):
            return None
        if any(t.is_floating_point() or t.is_complex() for t in (q_ids, kv_ids)):
            return None  # not integer ids (the operator's contract): the engine reads the predicate instead
        if q_ids.dim() == 1:
            q_ids, kv_ids = q_ids[None], kv_ids[None]
        q_ids = q_ids[:batch, :q_len].detach().cpu()
        kv_ids = kv_ids[:batch, :kv_len].detach().cpu()
        if kv_len == 0:
            return normalize(torch.zeros(len(q_ids), q_len, 1), torch.zeros(len(q_ids), q_len, 1), 0)
        # Under torch.compile how many runs there are is data, not read here: the operator's K is unknown
        if not torch.compiler.is_compiling():
            runs = _most_runs(kv_ids)
            if q_len * runs > 1 << 24 or over_limit(len(q_ids) * q_len * runs * _RUN_SLOT_BYTES) is not None:
                return None  # too many runs to list: the engine reads the predicate instead
        return normalize(*torch.ops.attnkit.document_runs(q_ids, kv_ids), kv_len)


#: Bytes ``attnkit::document_runs`` allocates per slot of its ``[P, Lq, R]`` outputs (two int64, two bool).
_RUN_SLOT_BYTES = 18


def _most_runs(ids: Tensor) -> int:
    """The most runs of one id any row of ``ids [P, L]`` has (1 when there are no rows)."""
    return int(((ids[:, 1:] != ids[:, :-1]).sum(-1) + 1).max()) if len(ids) else 1


def _check_document_ids(q_ids: Tensor, kv_ids: Tensor) -> None:
    """``attnkit::document_runs``' arguments, as PyTorch's own ops check theirs (in its fake too)."""
    for name, t in (("q_ids", q_ids), ("kv_ids", kv_ids)):
        if not isinstance(t, Tensor):
            raise TypeError(f"attnkit::document_runs: {name} must be a tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex():
            raise TypeError(f"attnkit::document_runs: {name} must hold integer document ids, got dtype {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"attnkit::document_runs: {name} must be 2-D [P, L] (one row of ids per batch "
                             f"element), got shape {tuple(t.shape)}")
    if q_ids.shape[0] != kv_ids.shape[0]:
        raise ValueError(f"attnkit::document_runs: q_ids [P, Lq] and kv_ids [P, Lk] must have the same P, got "
                         f"shapes {tuple(q_ids.shape)} and {tuple(kv_ids.shape)}")
    if q_ids.device != kv_ids.device:
        raise ValueError(f"attnkit::document_runs: q_ids is on {q_ids.device} but kv_ids is on {kv_ids.device}")


@torch.library.custom_op("attnkit::document_runs", mutates_args=(), device_types="cpu")
def _document_runs(q_ids: Tensor, kv_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each query's keys of its own document, ``q_ids [P, Lq]`` and ``kv_ids [P, Lk]`` (integer ids,
    CPU): ``(starts, ends)`` int64 ``[P, Lq, R]``, one slot per run of one id in the keys (``R`` the
    most runs any row has, at least 1), ``(Lk, Lk)`` where the run is another document's. An
    operator, so that torch.compile traces it with ``R`` as a size known only when it runs.

    Raises:
        TypeError: an argument that is not a tensor of integer ids.
        ValueError: other than 2-D arguments of one ``P`` on one device, or outputs (``P * Lq * R``
            slots) beyond the memory limit (:func:`check_op_fits`).
    """
    _check_document_ids(q_ids, kv_ids)
    kv_len, runs = kv_ids.shape[-1], _most_runs(kv_ids)
    p, q_len = q_ids.shape
    check_op_fits("attnkit::document_runs", f"2 x int64 and 2 x bool [P, Lq, R] = {(p, q_len, runs)} (R: the most "
                  "runs of one id in a row of kv_ids)", p * q_len * runs * _RUN_SLOT_BYTES,
                  "call it on fewer rows at a time")
    new = torch.ones_like(kv_ids, dtype=torch.bool)
    new[:, 1:] = kv_ids[:, 1:] != kv_ids[:, :-1]  # where a run of one id begins
    slot = new.long().cumsum(-1) - 1
    j = torch.arange(kv_len).expand_as(kv_ids)
    first = torch.full((len(kv_ids), runs), kv_len).scatter_reduce(-1, slot, j, "amin")
    last = torch.full((len(kv_ids), runs), -1).scatter_reduce(-1, slot, j, "amax")
    run_id = torch.zeros(len(kv_ids), runs, dtype=kv_ids.dtype).scatter(-1, slot, kv_ids)
    hit = (q_ids[:, :, None] == run_id[:, None, :]) & (last >= 0)[:, None, :]
    return torch.where(hit, first[:, None], kv_len), torch.where(hit, last[:, None] + 1, kv_len)


@_document_runs.register_fake
def _(q_ids, kv_ids):
    _check_document_ids(q_ids, kv_ids)
    runs = torch.library.get_ctx().new_dynamic_size(min=1)
    return q_ids.new_empty(len(q_ids), q_ids.shape[-1], runs, dtype=torch.int64), \
        q_ids.new_empty(len(q_ids), q_ids.shape[-1], runs, dtype=torch.int64)


class Padding(Mask):
    """Key ``j`` of batch element ``b`` is real when ``j < lengths[b]``; one interval per row."""

    def __init__(self, lengths: Tensor):
        self.lengths = lengths

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < self.lengths[b]

    def intervals(self, batch, q_len, kv_len):
        n = self.lengths
        if not isinstance(n, Tensor) or n.dim() != 1 or n.numel() < batch:
            return None
        hi = n[:batch].detach().long().cpu().view(-1, 1, 1).expand(batch, q_len, 1)
        return normalize(torch.zeros_like(hi), hi, kv_len)


class _Parts(Mask):
    """A mask made of other mask_mods (``parts``); it broadcasts when every part does (a user's own
    part may not: it is checked)."""

    def __init__(self, *parts: MaskMod):
        self.parts = parts

    @property
    def broadcasts(self) -> bool:
        return per_element.broadcasts(*self.parts)


class And(_Parts):
    """A cell is allowed when every part allows it; intervals intersect (None if a part has none)."""

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for m in self.parts[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    def intervals(self, batch, q_len, kv_len):
        return _fold(self.parts, intersect_intervals, batch, q_len, kv_len)


class Or(_Parts):
    """A cell is allowed when any part allows it; intervals unite (None if a part has none)."""

    def __call__(self, b, h, q_idx, kv_idx):
        out = self.parts[0](b, h, q_idx, kv_idx)
        for m in self.parts[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    def intervals(self, batch, q_len, kv_len):
        return _fold(self.parts, union_intervals, batch, q_len, kv_len)


def _fold(parts, combine, batch, q_len, kv_len) -> Intervals | None:
    out = None
    for m in parts:
        got = m.intervals(batch, q_len, kv_len) if isinstance(m, Mask) else None
        if got is None:
            return None
        out = got if out is None else combine(out, got, kv_len)
    return out


def causal_mod(offset: int = 0) -> Causal:
    """Query ``i`` may attend key ``j`` when ``j <= i + offset``."""
    return Causal(offset)


def window_mod(left: int | None, right: int | None, offset: int = 0) -> Window:
    """Query ``i`` (at position ``p = i + offset``) may attend keys ``p - left ... p + right``.

    ``None`` on a side means unbounded on that side; ``(None, 0)`` is causal.
    """
    return Window(left, right, offset)


def prefix_lm_mod(prefix_len: int | Tensor, offset: int = 0) -> PrefixLM:
    """Bidirectional over the first ``prefix_len`` keys, causal after them (T5/UniLM prefix LM).

    ``prefix_len`` may be a ``[B]`` tensor, one prefix per batch element.
    """
    return PrefixLM(prefix_len, offset)


def document_mod(q_doc_ids: Tensor, kv_doc_ids: Tensor | None = None) -> Document:
    """Tokens attend only within their own document (block-diagonal / packed sequences).

    Args:
        q_doc_ids: ``[Lq]`` or ``[B, Lq]`` integer document id of each query token.
        kv_doc_ids: the same for keys; defaults to ``q_doc_ids`` (self-attention).
    """
    return Document(q_doc_ids, kv_doc_ids)


def padding_mod(lengths: Tensor) -> Padding:
    """Key ``j`` of batch element ``b`` is real when ``j < lengths[b]``."""
    return Padding(lengths)


def and_masks(*mods: MaskMod) -> And:
    """A mask_mod that allows a cell only when every ``mods`` allows it."""
    if not mods:
        raise ValueError("and_masks needs at least one mask_mod, got none")
    return And(*mods)


def or_masks(*mods: MaskMod) -> Or:
    """A mask_mod that allows a cell when any of ``mods`` allows it."""
    if not mods:
        raise ValueError("or_masks needs at least one mask_mod, got none")
    return Or(*mods)


# --------------------------------------------------------------------------------------------
# Dense builders
# --------------------------------------------------------------------------------------------


def combined_mask_mod(is_causal: bool, window: tuple[int | None, int | None] | None, offset: int,
                      mask_mod) -> MaskMod | None:
    """``is_causal``, ``window`` (query ``i`` at position ``i + offset``) and ``mask_mod`` as one
    predicate, ``None`` if none is set."""
    mods = []
    if is_causal:
        mods.append(causal_mod(offset))
    if window is not None:
        mods.append(window_mod(*window, offset=offset))
    if mask_mod is not None:
        mods.append(mask_mod)
    if not mods:
        return None
    return mods[0] if len(mods) == 1 else and_masks(*mods)


def check_window(window) -> tuple[int | None, int | None] | None:
    """``window`` as a ``(left, right)`` tuple (None stays None), or ``ValueError`` naming what came."""
    if window is None:
        return None
    if not (isinstance(window, tuple | list) and len(window) == 2):
        raise ValueError(f"window must be a (left, right) pair, got {window!r}")
    for side, n in zip(("left", "right"), window, strict=True):
        _check_window_side(side, n)
    return (window[0], window[1])


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


def as_grid(t: Tensor) -> Tensor:
    """What a mod returned on broadcasting index tensors, as 4-D ``[B|1, H|1, Lq|1, Lk|1]``."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


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
# Sparse patterns (Longformer, Sparse Transformer, BigBird): predicates and dense builders
# --------------------------------------------------------------------------------------------


class GlobalTokens(Mask):
    """Longformer: a sliding window (``left`` keys before, ``right`` after the query's position
    ``p = i + offset``) plus global positions that see every key and are seen by every query.
    Intervals: a global row is ``[0, Lk)``; any other row its window and one interval per global key,
    merged where they touch (``K <= len(global_idx) + 1``)."""

    def __init__(self, left: int, right: int, global_idx: Tensor, offset: int = 0):
        self.left, self.right, self.global_idx, self.offset = left, right, global_idx, offset
        self._member = _membership(global_idx)

    def _is_global(self, x: Tensor) -> Tensor:
        member = self._member.to(x.device)
        return member[x.clamp(0, member.numel() - 1)] & (x >= 0)

    def __call__(self, b, h, q_idx, kv_idx):
        d = kv_idx - (q_idx + self.offset)
        return ((d >= -self.left) & (d <= self.right)) | self._is_global(kv_idx) | self._is_global(q_idx + self.offset)

    def intervals(self, batch, q_len, kv_len):
        p = positions(q_len, self.offset)
        member, global_idx = self._member.cpu(), self.global_idx.cpu()  # (planned on the host, as every mask is)
        glob_row = self._is_global(p)
        a, b = (p - self.left).clamp_min(0).clamp_max(kv_len), (p + self.right + 1).clamp_min(0).clamp_max(kv_len)
        # The global keys as runs, made once for every row (sorted, apart): a row's window takes in the
        # runs it touches, found by two binary searches, and the runs before and after stay as they are.
        # Under torch.compile (no shape may depend on the data), with no global key among the keys or a
        # row whose window holds none, each row's window and global keys are normalized instead.
        compiling = torch.compiler.is_compiling()
        run_s = run_e = torch.zeros(0, dtype=torch.long)
        if not compiling:
            edges = torch.diff(member[:kv_len].long(), prepend=torch.zeros(1, dtype=torch.long),
                               append=torch.zeros(1, dtype=torch.long))
            run_s, run_e = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
        if run_s.numel() == 0 or not bool((a < b).all()):
            g = global_idx.view(1, 1, -1).expand(1, q_len, -1)
            starts = torch.cat([p - self.left, g], -1).masked_fill(glob_row, 0)
            ends = torch.cat([p + self.right + 1, g + 1], -1).masked_fill(glob_row, kv_len)
            return normalize(starts, ends, kv_len)
        runs = run_s.numel()
        lo = torch.searchsorted(run_e, a)  # the first run that ends at or after the window's start
        hi = torch.searchsorted(run_s, b, right=True)  # the runs that start at or before its end
        touched = lo < hi
        a = torch.where(touched, torch.minimum(a, run_s[lo.clamp_max(runs - 1)]), a)
        b = torch.where(touched, torch.maximum(b, run_e[(hi - 1).clamp_min(0)]), b)
        j = torch.arange(runs + 1)
        after = j - 1 - lo + hi  # the run in slot j after the window's
        at = torch.where(j < lo, j, after).clamp_min(0).clamp_max(runs - 1)  # read where kept, else anywhere
        kept = (j < lo) | ((j > lo) & (after < runs))
        starts = torch.where(j == lo, a, torch.where(kept, run_s[at], kv_len))
        ends = torch.where(j == lo, b, torch.where(kept, run_e[at], kv_len))
        starts = torch.where(glob_row, torch.where(j == 0, 0, kv_len), starts)  # a global row: [0, kv_len)
        return trim(starts, ends.masked_fill(glob_row, kv_len))


class DilatedWindow(Mask):
    """Longformer's dilated sliding window: the query at ``p = i + offset`` sees keys ``p - d * k``
    for ``k`` in ``[-window, window]`` (``d = dilation``; ``causal``: ``k`` in ``[0, window]``).
    Intervals: one key each, ``K = 2 * window + 1`` (``window + 1`` causal; one when ``d == 1``)."""

    def __init__(self, window: int, dilation: int, offset: int = 0, causal: bool = False):
        self.window, self.dilation, self.offset, self.causal = window, dilation, offset, causal

    def __call__(self, b, h, q_idx, kv_idx):
        d = q_idx + self.offset - kv_idx
        ok = (d.abs() <= self.window * self.dilation) & (d % self.dilation == 0)
        return ok & (d >= 0) if self.causal else ok

    def intervals(self, batch, q_len, kv_len):
        # Each row's keys in [0, kv_len) are every d-th from its first to its last: written at once,
        # in order (normalizing the 2 * window + 1 candidates of each row costs ten times as much).
        d, p = self.dilation, positions(q_len, self.offset)
        if torch.compiler.is_compiling():  # K may not depend on the data there: every candidate, normalized
            keys = p - d * torch.arange(0 if self.causal else -self.window, self.window + 1)
            return normalize(keys, (keys + 1).masked_fill(keys < 0, 0), kv_len)
        lo, hi = p - d * self.window, p if self.causal else p + d * self.window
        first = lo + d * (-lo).clamp_min(0).add_(d - 1).div_(d, rounding_mode="floor")
        last = hi - d * (hi - (kv_len - 1)).clamp_min(0).add_(d - 1).div_(d, rounding_mode="floor")
        if d == 1:  # one run
            return normalize(first, last + 1, kv_len)
        count = (last - first).div(d, rounding_mode="floor").add_(1).clamp_min_(0)
        j = torch.arange(max(1, int(count.max())) if count.numel() else 1)
        seen = j < count
        starts = torch.where(seen, first + d * j, kv_len)
        return starts, torch.where(seen, starts + 1, kv_len)


class Strided(Mask):
    """Sparse Transformer's strided pattern (Child et al. 2019): the query at ``p = i + offset``
    sees the ``stride`` keys up to itself (``p - stride < j <= p``) and every key ``j`` with ``(p -
    j) % stride == 0`` before it. ``causal=False`` is the symmetric form (``|p - j| < stride`` or a
    multiple of ``stride`` either way). Intervals: the local one plus one per strided key, ``K``
    about ``Lk / stride + 1``."""

    def __init__(self, stride: int, offset: int = 0, causal: bool = True):
        self.stride, self.offset, self.causal = stride, offset, causal

    def __call__(self, b, h, q_idx, kv_idx):
        d = q_idx + self.offset - kv_idx
        near = (d < self.stride) & (d > -self.stride)
        ok = near | (d % self.stride == 0)
        return ok & (d >= 0) if self.causal else ok

    def intervals(self, batch, q_len, kv_len):
        p, s = positions(q_len, self.offset), self.stride
        if not torch.compiler.is_compiling() and s > 1 and q_len > 0 and 0 <= self.offset <= kv_len - q_len:
            # Every row inside the keys: its strided keys before its local run (p - 2s, p - 3s, ... >= 0),
            # the local run with the strided keys next to it (p - s and, both ways, p + s), then the
            # strided keys after it (p + 2s, ... < kv_len): sorted and apart as they are written.
            q = p.div(s, rounding_mode="floor")  # the strided keys up to p are p - s * (q - j), j = 0..q
            before = (q - 1).clamp_min(0)
            after = 0 if self.causal else (kv_len - 1 - p - 2 * s).div(s, rounding_mode="floor").add_(1).clamp_min_(0)
            count = before + 1 + after
            j = torch.arange(int(count.max()))
            starts = torch.where(j < before, p - s * (q - j),
                                 torch.where(j == before, (p - s).clamp_min(0), p + s * (j - before + 1)))
            run_end = p + 1 if self.causal else (p + s + 1).clamp_max(kv_len)
            ends = torch.where(j == before, run_end, starts + 1)
            return starts.masked_fill(j >= count, kv_len), ends.masked_fill(j >= count, kv_len)
        keys = p % self.stride + self.stride * torch.arange(kv_len // self.stride + 1)  # j = p mod stride
        ends = keys + 1
        if self.causal:
            ends = torch.where(keys <= p, ends, keys)
        starts = torch.cat([keys, p - self.stride + 1], -1)
        ends = torch.cat([ends, p + 1 if self.causal else p + self.stride], -1)
        return normalize(starts, ends, kv_len)


class Fixed(Mask):
    """Sparse Transformer's "fixed" pattern (Child et al. 2019), causal: positions in blocks of
    ``stride``; the query at ``p = i + offset`` sees its own block up to itself and the last
    ``summary`` positions of every block (the summary columns), never a key after ``p``. Intervals:
    its block plus one per earlier block, ``K`` about ``Lk / stride + 1``."""

    def __init__(self, stride: int, summary: int, offset: int = 0):
        self.stride, self.summary, self.offset = stride, summary, offset

    def __call__(self, b, h, q_idx, kv_idx):
        p = q_idx + self.offset
        same = torch.div(p, self.stride, rounding_mode="floor") == torch.div(kv_idx, self.stride, rounding_mode="floor")
        return (kv_idx <= p) & (same | (kv_idx % self.stride >= self.stride - self.summary))

    def intervals(self, batch, q_len, kv_len):
        p = positions(q_len, self.offset)
        own = torch.div(p, self.stride, rounding_mode="floor") * self.stride
        block_end = self.stride * (torch.arange(kv_len // self.stride + 1) + 1)
        starts = torch.cat([own, (block_end - self.summary).expand(1, q_len, -1)], -1)
        ends = torch.minimum(torch.cat([p + 1, block_end.expand(1, q_len, -1)], -1), p + 1)
        return normalize(starts, ends, kv_len)


class BlockSparse(Mask):
    """Attend by blocks: query ``i`` sees key ``j`` when ``layout[i // block, j // block]``
    (rows/keys past the layout use its last block row/column). Intervals: one per run of
    attended blocks in the row's layout row, ``K <= key blocks / 2 + 1``."""

    def __init__(self, layout: Tensor, block: int):
        self.layout, self.block = layout, block

    def __call__(self, b, h, q_idx, kv_idx):
        rows, cols = self.layout.shape
        return self.layout[(q_idx // self.block).clamp(max=rows - 1), (kv_idx // self.block).clamp(max=cols - 1)]

    def intervals(self, batch, q_len, kv_len):
        layout = self.layout.detach().cpu()
        rows, cols = layout.shape
        starts = torch.arange(cols) * self.block
        ends = starts + self.block
        ends[-1] = max(cols * self.block, kv_len)  # the last key block reaches every key past the layout
        on = layout[None]  # [1, rows, cols]: worked out once per block of rows, then given to its rows
        starts, ends = normalize(torch.where(on, starts, kv_len), torch.where(on, ends, kv_len), kv_len)
        row = (torch.arange(q_len) // self.block).clamp(max=rows - 1)
        return trim(starts[:, row], ends[:, row])  # K: the most any of these rows has


def global_tokens_mod(window: int | tuple[int, int], global_idx, offset: int = 0) -> GlobalTokens:
    """Longformer: a sliding window (``window`` keys on each side, or ``(left, right)``) plus global
    positions that see every key and are seen by every query (query ``i`` sits at ``i + offset``).
    A row sees about ``2 * window + 1 + len(global_idx)`` keys, as up to ``len(global_idx) + 1``
    intervals; a global row sees all keys."""
    left, right = window if isinstance(window, tuple) else (window, window)
    _check_window_side("window", left)
    _check_window_side("window", right)
    if left is None or right is None:
        raise ValueError(f"window must be an int >= 0 or a pair of them, got {window!r}")
    return GlobalTokens(left, right, _positions_tensor("global_idx", global_idx), offset)


def global_tokens(n: int, window: int | tuple[int, int], global_idx, *, device=None) -> Tensor:
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


def dilated_window_mod(window: int, dilation: int, offset: int = 0, *, causal: bool = False) -> DilatedWindow:
    """Longformer's dilated sliding window: query at position ``p = i + offset`` sees keys ``p - d *
    k`` for ``k`` in ``[-window, window]`` (``d = dilation``; ``causal=True`` keeps ``k >= 0``, the
    keys up to ``p``): ``2 * window + 1`` keys as as many one-key intervals when ``dilation > 1``."""
    _check_window_side("window", window)
    if window is None:
        raise ValueError("window must be a non-negative int, got None")
    _check_positive("dilation", dilation)
    return DilatedWindow(window, dilation, offset, bool(causal))


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


def strided_mod(stride: int, offset: int = 0, *, causal: bool = True) -> Strided:
    """Sparse Transformer's strided pattern (Child et al. 2019), causal by default: query at position
    ``p`` sees the previous ``stride`` keys (``p - stride < j <= p``) and every key ``stride``, ``2 *
    stride``, ... back (``(p - j) % stride == 0``): about ``p / stride + 1`` intervals per row.
    ``causal=False``: the same both ways (``|p - j| < stride`` or ``(p - j) % stride == 0``)."""
    _check_positive("stride", stride)
    return Strided(stride, offset, bool(causal))


def strided(n: int, stride: int, *, causal: bool = True, device=None) -> Tensor:
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
    return strided_mod(stride, causal=causal)(None, None, q, kv)


def fixed_mod(stride: int, summary: int = 1, offset: int = 0) -> Fixed:
    """Sparse Transformer's "fixed" pattern (Child et al. 2019), causal: blocks of ``stride``
    positions; a query sees its own block up to itself and the last ``summary`` positions of every
    earlier block (``1 <= summary <= stride``); about ``Lk / stride + 1`` intervals per row."""
    _check_positive("stride", stride)
    _check_positive("summary", summary)
    if summary > stride:
        raise ValueError(f"summary must be <= stride ({stride}), got {summary!r}")
    return Fixed(stride, summary, offset)


def fixed(n: int, stride: int, summary: int = 1, *, device=None) -> Tensor:
    """``[n, n]`` :func:`fixed_mod`. ``fixed(12, 4, summary=1)``::

        >>> print(picture(fixed(12, 4, summary=1)))
        #...........
        ##..........
        ###.........
        ####........
        ...##.......
        ...###......
        ...####.....
        ...#####....
        ...#...##...
        ...#...###..
        ...#...####.
        ...#...#####
    """
    q, kv = _grid(n, n, device)
    return fixed_mod(stride, summary)(None, None, q, kv)


def block_sparse_mod(layout: Tensor, block: int) -> BlockSparse:
    """Attend by blocks: query ``i`` may see key ``j`` when ``layout[i // block, j // block]``
    (``layout``: bool ``[query blocks, key blocks]``, e.g. :func:`bigbird_layout`)."""
    if not isinstance(layout, Tensor) or layout.dtype != torch.bool or layout.dim() != 2 or 0 in layout.shape:
        raise ValueError(f"layout must be a 2-D bool tensor [query blocks, key blocks], non-empty, "
                         f"got {describe(layout)}")
    _check_positive("block", block)
    return BlockSparse(layout, block)


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
    """Bool ``[max + 2]`` on ``idx``'s device: True at the positions in ``idx`` (the last entry stays False, so a
    clamped index past the end reads False)."""
    out = torch.zeros(int(idx.max()) + 2 if idx.numel() else 1, dtype=torch.bool, device=idx.device)
    out[idx] = True
    return out


def _check_positive(name: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")


def _check_len(name: str, n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")


def _check_window_side(name: str, n) -> None:
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"window {name} must be None or a non-negative int, got {n!r}")

