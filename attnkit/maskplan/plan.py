"""The :class:`MaskPlan` type: a mask worked out once for one set of sizes, in the form each kernel wants.

A plan holds a mask (``is_causal``, ``window``, a ``mask_mod``, a dense bool mask) for fixed
lengths, batch and device:

* each query row's allowed keys as a few sorted, disjoint intervals (``starts``/``ends``
  ``[1 or B, Lq, K]``, the form of :mod:`attnkit.intervals`; ``[B*H, Lq, K]`` for a mask that
  depends on the head), where the mask has that form: the ``"band"`` backend runs on them;
* the (query tile, key block) kinds, empty / full / partial, for the tile backends, at whatever
  tile size they ask (:meth:`MaskPlan.kinds`, from the intervals without looking at a cell);
* the mask as one predicate, for partial tiles and the dense backends.

Build it with :func:`mask_plan` and pass it as ``attnkit.attention(..., mask=plan)``, to
``MultiHeadAttention`` or to a model, and reuse it across layers and steps (FlexAttention's
``create_block_mask`` -> ``BlockMask``, for attnkit's kernels). ``is_causal`` and ``window`` are
worked out analytically (:func:`attnkit.intervals.row_bounds`), the typed masks of
:mod:`attnkit.masks` say their own intervals, and any other predicate is worked out from the
predicate itself by :func:`attnkit.maskplan.row_intervals`.

A plan's ``starts`` and ``ends`` are fixed once it is built: every backend reads them or the
predicate they were derived from, so a plan changed in place would make backends disagree.
:meth:`MaskPlan.check`, called wherever a plan meets a call, refuses a plan whose tensors were
written since it was built (their version counters moved) and checks, once per plan, the
invariants the kernels rely on (:func:`check_intervals`); on later calls it compares two version
counters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import masks as _masks
from .. import per_element
from ..intervals import intersect_intervals, row_bounds
from .derivation import row_intervals
from .every_cell import traced
from .rows import MAX_INTERVALS
from .tile_kinds import tile_kinds


class MaskPlan:
    """A mask worked out for one set of lengths, batch and device; see the module docstring.

    Callable as a predicate (``plan(b, h, q_idx, kv_idx) -> bool``). Attributes: ``q_len``,
    ``kv_len``, ``batch`` (the batch it was built for, all batch dims flattened; intervals may be
    shared, ``[1, Lq, K]``), ``device``, ``starts``/``ends`` (None when the mask has no interval
    form), ``heads`` (the heads it was built for when its rows differ by head: then ``starts``/
    ``ends`` are ``[B*H, Lq, K]``, batch element ``b`` head ``h`` at ``b * H + h``; None when every
    head shares them), ``predicate``, and ``derived_by``: how a predicate's intervals were found
    (``"closed form"``, ``"ranges"``, ``"every cell"``; ``"its own intervals"`` for a typed mask
    of :mod:`attnkit.masks`, ``"is_causal/window"`` for those alone; None without a mask).

    ``starts`` and ``ends`` are the plan's own: they cannot be reassigned, and a plan whose tensors
    were written in place after it was built is refused where it meets a call (:meth:`check`).
    Intervals given here are checked (:func:`check_intervals`) the first time the plan meets a call.
    """

    derived_by: str | None = None

    def __init__(self, predicate, *, q_len: int, kv_len: int, batch: int, device: torch.device,
                 starts: Tensor | None, ends: Tensor | None, heads: int | None = None):
        if (starts is None) != (ends is None):
            raise ValueError("starts and ends must both be tensors or both be None, got "
                             f"starts {type(starts).__name__} and ends {type(ends).__name__}")
        if starts is not None and not torch.compiler.is_compiling() and (starts.is_inference() or ends.is_inference()):
            with torch.inference_mode(False):  # inference tensors keep no version counter: a write could not be seen
                starts, ends = starts.clone(), ends.clone()
        self.predicate = predicate
        self.heads = heads
        self.q_len, self.kv_len, self.batch, self.device = q_len, kv_len, batch, device
        self._starts, self._ends = starts, ends
        self._kinds: dict[tuple[int, int], Tensor] = {}
        #: the version counters of (starts, ends) when their invariants last held; None: not checked yet
        self._checked: tuple[int, int] | None = None

    @property
    def starts(self) -> Tensor | None:
        """Each row's interval starts, int64 ``[P, Lq, K]`` (None without an interval form)."""
        return self._starts

    @starts.setter
    def starts(self, value) -> None:
        raise AttributeError("a MaskPlan's starts and ends are fixed when it is built; build a new plan "
                             "(attnkit.mask_plan, or MaskPlan(...) with your own intervals)")

    @property
    def ends(self) -> Tensor | None:
        """Each row's interval ends (exclusive), int64 ``[P, Lq, K]`` (None without an interval form)."""
        return self._ends

    @ends.setter
    def ends(self, value) -> None:
        self.starts = value  # the same refusal

    def __call__(self, b, h, q_idx, kv_idx):
        return self.predicate(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        form = "no intervals" if self.starts is None else f"{self.starts.shape[-1]} interval(s) per row"
        how = (f" per head ({self.heads})" if self.heads else "") + (f", derived by {self.derived_by}"
                                                                     if self.derived_by else "")
        return f"MaskPlan(q_len={self.q_len}, kv_len={self.kv_len}, batch={self.batch}, {form}{how})"

    def check(self, batch: int, q_len: int, kv_len: int, device: torch.device | None = None,
              heads: int | None = None) -> None:
        """Raise ``ValueError`` unless this plan was built for these sizes (and device, and heads
        where its rows differ by head) and its intervals are sound: unchanged since it was built
        and, the first time, every invariant of :func:`check_intervals`. O(1) once checked (two
        version counters compared); ``O(P * Lq * K)`` the first time for intervals given to the
        constructor. Not checked under ``torch.compile``, where a plan built outside was checked
        when it was first used outside."""
        self._check_intervals()
        if self.heads is not None and heads is not None and heads != self.heads:
            raise ValueError(f"mask plan was built per head for {self.heads} heads, but the call has {heads}")
        got = (q_len, kv_len)
        if got != (self.q_len, self.kv_len):
            raise ValueError(f"mask plan was built for q_len={self.q_len}, kv_len={self.kv_len}, "
                             f"but the call has q_len={q_len}, kv_len={kv_len}")
        if batch != self.batch and not (self.starts is not None and self.starts.shape[0] == 1):
            raise ValueError(f"mask plan was built for a batch of {self.batch}, but the call has {batch} "
                             "(batch dims flattened)")
        if device is not None and torch.device(device).type != self.device.type:
            raise ValueError(f"mask plan was built for {self.device}, but the call is on {device}")

    def _check_intervals(self) -> None:
        """:meth:`check`'s part on the intervals: refuse a plan changed in place since it was built,
        and check a new plan's intervals once."""
        if self._starts is None or torch.compiler.is_compiling():
            return
        if self._checked is None:
            sizes = self.batch, self.heads or 1
            check_intervals(self._starts, self._ends, q_len=self.q_len, kv_len=self.kv_len,
                            parts=sorted({1, sizes[0], sizes[0] * sizes[1]}))
            self._checked = (self._starts._version, self._ends._version)
            return
        now = (self._starts._version, self._ends._version)
        if now != self._checked:
            raise ValueError(
                "mask plan's starts/ends were written in place since it was built or first used (version counters "
                f"{self._checked} -> {now}): they no longer match its predicate or its tile kinds, and backends "
                "would disagree; build a new plan (attnkit.mask_plan, or MaskPlan(...) with the new intervals)")

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, pickling) has fresh tensors whose version counters start again:
        its intervals are checked once more where it first meets a call."""
        self.__dict__.update(state)
        self._checked = None

    def _trusted(self) -> MaskPlan:
        """This plan, its intervals taken as sound without :func:`check_intervals` (the derivations'
        own; their tests hold them to it)."""
        if self._starts is not None and not torch.compiler.is_compiling():
            self._checked = (self._starts._version, self._ends._version)
        return self

    def kinds(self, q_tile: int, kv_block: int) -> Tensor | None:
        """``[tiles, blocks]`` int8 EMPTY/FULL/PARTIAL (:mod:`attnkit.maskplan.tile_kinds`) from the
        intervals, cached per tile size; None without intervals (the tile backends then evaluate
        the predicate)."""
        if self.starts is None:
            return None
        key = (q_tile, kv_block)
        if key not in self._kinds:
            self._kinds[key] = tile_kinds(self.starts, self.ends, self.q_len, self.kv_len, q_tile, kv_block)
        return self._kinds[key]


def check_intervals(starts: Tensor, ends: Tensor, *, q_len: int, kv_len: int, parts=None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first thing that breaks what every kernel relies on
    in a plan's intervals: ``starts``/``ends`` int64 CPU tensors of one shape ``[P, q_len, K]`` with
    ``K >= 1`` (``P`` in ``parts`` when given), ``0 <= start <= end <= kv_len``, each row's intervals
    sorted and disjoint (``end <= next start``), an empty one written ``(kv_len, kv_len)`` (so empties
    come last). ``O(P * q_len * K)``; tensors only read.
    """
    for name, t in (("starts", starts), ("ends", ends)):
        if not isinstance(t, Tensor):
            raise TypeError(f"mask plan's {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise TypeError(f"mask plan's {name} must be an int64 CPU tensor, got {t.dtype} on {t.device}")
        if t.dim() != 3 or t.shape[1] != q_len or t.shape[2] < 1:
            raise ValueError(f"mask plan's {name} must have shape [P, Lq={q_len}, K >= 1], got {tuple(t.shape)}")
    if starts.shape != ends.shape:
        raise ValueError(f"mask plan's starts and ends must have the same shape, got {tuple(starts.shape)} "
                         f"and {tuple(ends.shape)}")
    if parts is not None and starts.shape[0] not in parts:
        raise ValueError(f"mask plan's intervals are for {starts.shape[0]} batch elements/heads (P = "
                         f"{starts.shape[0]}); expected P in {tuple(parts)} (1 shared, B, or B*H per head)")
    empty = starts == ends
    bad = (starts < 0) | (starts > ends) | (ends > kv_len) | (empty & (starts != kv_len))
    if bool(bad.any()):
        p, i, k = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"mask plan's interval {k} of row {i} (of part {p}) is [{int(starts[p, i, k])}, "
                         f"{int(ends[p, i, k])}); expected 0 <= start <= end <= kv_len = {kv_len}, an empty one "
                         f"written ({kv_len}, {kv_len})")
    out_of_order = ends[..., :-1] > starts[..., 1:]
    if bool(out_of_order.any()):
        p, i, k = (int(x) for x in out_of_order.nonzero()[0])
        raise ValueError(f"mask plan's intervals of row {i} (of part {p}) are not sorted and disjoint: "
                         f"[{int(starts[p, i, k])}, {int(ends[p, i, k])}) then [{int(starts[p, i, k + 1])}, "
                         f"{int(ends[p, i, k + 1])}); expected each to end at or before the next starts, "
                         f"empties ({kv_len}, {kv_len}) last")


def mask_plan(mask_mod=None, *, q_len: int, kv_len: int | None = None, batch: int = 1, heads: int = 1,
              is_causal: bool = False, window=None, device="cpu") -> MaskPlan:
    """Work out a mask once, for every kernel (see the module docstring).

    Args:
        mask_mod: ``fn(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's convention, per element or
            broadcasting), a typed mask of :mod:`attnkit.masks`, or None.
        q_len, kv_len: query and key lengths (``kv_len`` defaults to ``q_len``).
        batch: the batch size of the calls (all batch dims flattened).
        heads: query heads (a predicate that depends on the head gets intervals per head).
        is_causal, window: as in ``attnkit.attention`` (aligned bottom-right).
        device: where the calls run.

    Raises:
        TypeError, ValueError: bad arguments, or a predicate that returns something else than bool.
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, val, least in (("q_len", q_len, 0), ("kv_len", kv_len, 0), ("batch", batch, 1), ("heads", heads, 1)):
        if not isinstance(val, int) or isinstance(val, bool) or val < least:
            raise ValueError(f"{name} must be an int >= {least}, got {val!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
    if mask_mod is not None and not isinstance(mask_mod, _masks.Mask) and q_len and kv_len:
        # FlexAttention's per-element semantics, as attnkit.attention gives them
        mask_mod = per_element.evaluator(mask_mod, (batch, heads, q_len, kv_len), device)
    return build(mask_mod, q_len, kv_len, batch, heads, is_causal, _masks.check_window(window), torch.device(device))


def build(mask_mod, q_len, kv_len, batch, heads, is_causal, window, device) -> MaskPlan:
    """A plan of ``is_causal``/``window`` (already checked) and ``mask_mod`` (a predicate, a typed mask or
    None) for these sizes: their intervals intersected, and the predicate that combines them."""
    bounded = is_causal or window is not None
    derived_by = "is_causal/window" if bounded else None
    per_head = False
    rows = row_bounds(q_len, kv_len, is_causal, window) if bounded or mask_mod is None else None
    if mask_mod is not None:
        # A typed mask of attnkit.masks says its rows; any other predicate is evaluated once (under
        # torch.compile on every call, in the graph: a plan built outside saves that).
        compiling = torch.compiler.is_compiling()
        derived = mask_mod.intervals(batch, q_len, kv_len) if isinstance(mask_mod, _masks.Mask) else None
        derived_by = "its own intervals"
        if derived is None and compiling:
            derived, derived_by = traced(mask_mod, batch, heads, q_len, kv_len, device), "every cell, traced"
        elif derived is None:
            derived, derived_by, per_head = row_intervals(mask_mod, batch, heads, q_len, kv_len, device)
        if derived is not None and not compiling and derived[0].shape[-1] > MAX_INTERVALS:
            derived = None
        if derived is None or not bounded:  # both in the shared form: all keys and x is x
            rows = derived
        else:
            rows = intersect_intervals(rows, derived, kv_len)
    predicate = _masks.combined_mask_mod(is_causal, window, kv_len - q_len, mask_mod) or _everything
    starts, ends = rows if rows is not None else (None, None)
    plan = MaskPlan(predicate, q_len=q_len, kv_len=kv_len, batch=batch, device=device, starts=starts, ends=ends,
                    heads=heads if per_head and starts is not None else None)
    plan.derived_by = derived_by
    return plan._trusted()


def _everything(b, h, q_idx, kv_idx) -> Tensor:
    return torch.ones((), dtype=torch.bool)


