"""The mask plan: which keys each query row may attend, worked out once and used by every kernel.

A :class:`MaskPlan` holds a mask (``is_causal``, ``window``, a ``mask_mod``, a dense bool mask) for fixed
lengths and batch, in the form each kernel wants:

* each query row's allowed keys as a few sorted, disjoint intervals (``starts``/``ends``
  ``[1 or B, Lq, K]``, the convention of :mod:`attnkit.masks`; ``[B*H, Lq, K]`` for a mask that
  depends on the head), where the mask has that form:
  the ``"band"`` backend runs on them;
* the (query tile, key block) kinds, empty / full / partial, for the tile backends, at whatever
  tile size they ask (:meth:`MaskPlan.kinds`, computed from the intervals without looking at a
  cell, or by evaluating the predicate tile by tile when there are none);
* the mask as one predicate, for partial tiles and the dense backends.

Build it with :func:`mask_plan` and pass it as ``attnkit.attention(..., mask=plan)``, to
``MultiHeadAttention`` or to a model, and reuse it across layers and steps: FlexAttention's
``create_block_mask`` -> ``BlockMask``, for attnkit's kernels. ``is_causal`` and ``window`` are
worked out analytically (:func:`row_bounds`, the one place that says which keys they allow), the
typed masks of :mod:`attnkit.masks` say their own intervals, and any other predicate, a user's
own, is worked out from the predicate itself, not annotated by hand, the first of three ways that
can follow it:

1. in closed form (:mod:`attnkit._pieces`): each row's values as affine pieces along the keys, for
   predicates affine in the indices, with ``//`` and ``%`` by constants, 1-D tables and 2-D ones
   read at a row constant along the keys (windows, documents, global tokens, prefix-LM, padding:
   1-4 ms at n = 8192; dilated and strided windows, block-local attention, block layouts); from
   32,768 rows on, in blocks of rows worked out at their two ends (a few passes, whatever the
   length: a window per head at n = 8192, 65,536 rows, 3 ms where row by row took 10);
2. on ranges of indices, tile by tile (:mod:`attnkit._ranges`: tiles it proves all allowed or all
   masked are settled whole, and only the cells of the others are evaluated; floats, a table read
   where it changes too often to cut: 5-60 ms at n = 8192);
3. on every cell (vectorised, in cache-sized row chunks: 0.05-1 s at n = 8192).

All three give the same, exact intervals.

``attnkit.attention(..., mask_mod=fn)`` builds the plan itself and keeps it, with the predicate
(weakly: nothing is kept alive by the cache), keyed on the lengths, the batch, the device and
what the predicate reaches (:func:`attnkit.backends._captured.captured_state`): the identity and
version counter of each tensor (an in-place change to captured document ids, or a module's buffer
edited or reassigned, makes a new plan) and the plain values (``int``, ``float``, ``bool``,
``str``) in its closure, defaults, globals and the attributes of a bound module or callable object.
What that cannot see: an edit through ``tensor.data`` or numpy memory (the version counter does
not move), a numpy array, the fields of an object that is neither callable nor a module. A
predicate that reads such state should be given a plan built for it (``mask=attnkit.mask_plan(...)``,
built again when the state changes), or the cache turned off (:data:`PLANS_PER_PREDICATE` = 0).
Under ``torch.inference_mode`` captured tensors keep no version counter: such a predicate's plan
is built on every call.

A plan's ``starts`` and ``ends`` are fixed once it is built: every backend reads them or the
predicate they were derived from, so a plan changed in place would make backends disagree.
:meth:`MaskPlan.check`, called wherever a plan meets a call, refuses a plan whose tensors were
written since it was built (their version counters moved) and checks, once per plan, the
invariants the kernels rely on (:func:`check_intervals`); on later calls it compares two version
counters. The cache is safe to use from several threads (one lock around its reads and writes;
plans are built outside it, and each derivation's state is the thread's own).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from . import _pieces, _ranges, elementwise
from . import masks as _masks
from .backends import _captured
from .request import check_window, combined_mask_mod

#: How many automatically built plans ``attnkit.attention`` keeps per predicate (sizes, tensor versions);
#: 0 turns the cache off (a plan is built on every call that has no ``mask=plan``).
PLANS_PER_PREDICATE = 8
#: Rows with more intervals than this are not worth the band kernel's per-row bookkeeping.
MAX_INTERVALS = 256

#: predicate -> {key: (weak references to the tensors the key names, plan)}; read and written under _lock.
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


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
        """``[tiles, blocks]`` int8 EMPTY/FULL/PARTIAL (``attnkit.backends._tiling``) from the
        intervals, cached per tile size; None without intervals (the tile backends then evaluate
        the predicate)."""
        if self.starts is None:
            return None
        key = (q_tile, kv_block)
        if key not in self._kinds:
            self._kinds[key] = _tile_kinds(self.starts, self.ends, self.q_len, self.kv_len, q_tile, kv_block)
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
        mask_mod = elementwise.evaluator(mask_mod, (batch, heads, q_len, kv_len), device)
    return _build(mask_mod, q_len, kv_len, batch, heads, is_causal, check_window(window), torch.device(device))


def for_request(req) -> MaskPlan | None:
    """The plan of a validated request's ``is_causal``/``window``/``mask_mod`` and dense ``mask``
    (None when it has none, or a dense mask with other than 4-D inputs): the request's own
    :class:`MaskPlan`, a cached one, or one built now.

    Plans built here keep no predicate (the request has it) and are cached per predicate, weakly:
    the cache does not keep a predicate, or the tensors it captures, alive. Plans of a dense mask
    are not cached (the mask may be large, and a freed mask's address may come back). Every plan
    returned has passed :meth:`MaskPlan.check` (O(1) once a plan was checked).

    Raises:
        ValueError: the request's own plan does not fit the call, or its intervals are not sound.
    """
    dense = req.mask if req.mask is not None and req.query.dim() == 4 else None
    if req.mask_mod is None and not req.is_causal and req.window is None and dense is None:
        return None
    if req.mask is not None and dense is None:
        return None
    batch = math.prod(req.batch_shape)
    dev = req.query.device
    if isinstance(req.mask_mod, MaskPlan) and not req.is_causal and req.window is None and dense is None:
        req.mask_mod.check(batch, req.q_len, req.kv_len, dev, req.heads)
        return req.mask_mod
    mod = req.mask_mod
    if dense is not None:
        mod = _dense_predicate(dense) if mod is None else _masks.and_masks(mod, _dense_predicate(dense))
    sizes = (req.q_len, req.kv_len, batch, req.heads, req.is_causal, req.window, dev)
    # Under torch.compile the plan is part of the traced graph (computed in it, per call): no cache.
    cached = dense is None and PLANS_PER_PREDICATE > 0 and not torch.compiler.is_compiling()
    owner, key, found = _cache_key(req.mask_mod, sizes) if cached else (None, None, ())
    if owner is not None:
        with _lock:
            plans = _cache.get(owner)
            hit = plans.get(key) if plans is not None else None
            if hit is not None:
                plans.move_to_end(key)
        # the same tensors, not others that came to the same addresses with the same versions
        if hit is not None and (not found or all(r() is t for r, t in zip(hit[0], found, strict=True))):
            got = hit[1]
            if got._starts is not None and (got._starts._version, got._ends._version) != got._checked:
                got._check_intervals()  # refuses a plan written in place (reachable as req.plan)
            return got
    plan = _build(mod, req.q_len, req.kv_len, batch, req.heads, req.is_causal, req.window, dev)
    plan.predicate = None
    if owner is not None:
        entry = tuple(weakref.ref(t) for t in found), plan
        with _lock:
            plans = _cache.setdefault(owner, OrderedDict())
            plans[key] = entry
            plans.move_to_end(key)
            while len(plans) > PLANS_PER_PREDICATE:
                plans.popitem(last=False)
    return plan


def _dense_predicate(mask: Tensor):
    """A bool ``[B|1, H|1, Lq|1, Lk|1]`` mask as a predicate on broadcasting index tensors."""
    m = _masks.as_grid(mask)

    def allowed(b, h, q_idx, kv_idx):
        return m[tuple(ix if m.shape[d] > 1 else 0 for d, ix in enumerate((b, h, q_idx, kv_idx)))]

    return allowed


def _build(mask_mod, q_len, kv_len, batch, heads, is_causal, window, device) -> MaskPlan:
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
            derived, derived_by = _traced_derive(mask_mod, batch, heads, q_len, kv_len, device), "every cell, traced"
        elif derived is None:
            derived, derived_by, per_head = _derive(mask_mod, batch, heads, q_len, kv_len, device)
        if derived is not None and not compiling and derived[0].shape[-1] > MAX_INTERVALS:
            derived = None
        if derived is None or not bounded:  # both in the shared form: all keys and x is x
            rows = derived
        else:
            rows = _masks.intersect_intervals(rows, derived, kv_len)
    predicate = combined_mask_mod(is_causal, window, kv_len - q_len, mask_mod) or _everything
    starts, ends = rows if rows is not None else (None, None)
    plan = MaskPlan(predicate, q_len=q_len, kv_len=kv_len, batch=batch, device=device, starts=starts, ends=ends,
                    heads=heads if per_head and starts is not None else None)
    plan.derived_by = derived_by
    return plan._trusted()


def row_bounds(q_len: int, kv_len: int, is_causal: bool = False, window=None) -> tuple[Tensor, Tensor]:
    """The one interval ``[lo, hi)`` of keys each query row may attend under ``is_causal`` and
    ``window`` (aligned bottom-right: query ``i`` sits at ``kv_len - q_len + i``), as
    ``[1, Lq, 1]`` intervals; an empty row is ``(Lk, Lk)``."""
    pos = torch.arange(q_len, dtype=torch.int64) + (kv_len - q_len)
    lo, hi = torch.zeros_like(pos), torch.full_like(pos, kv_len)
    if is_causal:
        hi = torch.minimum(hi, pos + 1)
    if window is not None:
        left, right = window
        lo = lo if left is None else torch.maximum(lo, pos - left)
        hi = hi if right is None else torch.minimum(hi, pos + right + 1)
    return _masks.normalize(lo.view(1, -1, 1), hi.view(1, -1, 1), kv_len)


def _cache_key(mask_mod, sizes: tuple) -> tuple:
    """``(owner, key, tensors)``: the object the cached plans hang on (the predicate, or ``_NO_MOD``
    for is_causal/window alone; None when it cannot be weakly referenced), what a plan depends on
    besides it, and the tensors the key names (a hit must find these very tensors: another one may
    come to a freed one's address with the same version). The key: the sizes, the address, version
    counter and shape of every tensor the predicate reaches, and the plain values it reaches
    (:func:`attnkit.backends._captured.captured_state`). Inference tensors (made under
    ``torch.inference_mode``) keep no version counter: such a predicate is not cached."""
    mask_mod = getattr(mask_mod, "__wrapped__", mask_mod)  # a per-element wrapper, made per call: its mod
    if mask_mod is None:
        return _NO_MOD, sizes, ()
    try:
        weakref.ref(mask_mod)
        hash(mask_mod)
    except TypeError:
        return None, None, ()
    found, values = _captured.captured_state(mask_mod)
    if any(t.is_inference() for t in found):  # no version counter: an in-place change would go unseen
        return None, None, ()
    tensors = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in found)
    return mask_mod, (tensors, tuple((type(v), v) for v in values) if values else (), *sizes), found


class _NoMod:
    """Stands for "no predicate" as a weak-dict key (is_causal/window plans)."""


_NO_MOD = _NoMod()


def _everything(b, h, q_idx, kv_idx) -> Tensor:
    return torch.ones((), dtype=torch.bool)


# --------------------------------------------------------------------------------------------
# Intervals from a predicate, and what follows from intervals without looking at a cell (the
# interval algebra itself is attnkit.masks': normalize, intersect_intervals, union_intervals).
# --------------------------------------------------------------------------------------------


def _derive(mod, batch: int, heads: int, q_len: int, kv_len: int,
            device) -> tuple[tuple[Tensor, Tensor] | None, str, bool]:
    """Each row's runs of allowed keys (None when a row has more than :data:`MAX_INTERVALS` runs),
    the way they were found (:attr:`MaskPlan.derived_by`), and whether they are per head.

    The ways, first that can follow ``mod`` first: in closed form (:mod:`attnkit._pieces`), on
    ranges of indices (:mod:`attnkit._ranges`: only the cells of tiles it cannot settle are
    evaluated), on every cell (:func:`_every_cell`). A predicate that reads the head is worked out
    again with the heads folded into the batch (element ``b * heads + h``): rows ``[B*H, Lq, K]``,
    or ``[1, Lq, K]`` when every head and batch element comes out the same.
    """
    try:
        return (*_one_set(mod, batch, heads, q_len, kv_len, device), False)
    except _ranges.ReadsHead:
        pass
    rows, way = _one_set(mod, batch, heads, q_len, kv_len, device, per_head=True)
    return rows, way, rows is not None and rows[0].shape[0] > 1


def _one_set(mod, batch: int, heads: int, q_len: int, kv_len: int, device,
             per_head: bool = False) -> tuple[tuple[Tensor, Tensor] | None, str]:
    """:func:`_derive` for rows shared by every head (raises :class:`attnkit._ranges.ReadsHead` when
    they are not), or ``per_head``: for the heads folded into the batch (element ``b * heads + h``)."""
    fold = heads if per_head else 1
    if per_head:
        def whole(b, h, q_idx, kv_idx):  # the predicate of one folded element
            return mod(b // fold, b % fold, q_idx, kv_idx)

        batch, heads = batch * heads, 1
    else:
        whole = mod
    if torch.device(device).type == "cpu":
        def by_ranges():
            return _pack(*_ranges.derive(whole, batch, heads, q_len, kv_len), q_len, kv_len)

        for name, way in (("closed form", functools.partial(_pieces.derive, mod, batch, heads, q_len, kv_len,
                                                            most=MAX_INTERVALS, fold=fold)),
                          ("ranges", by_ranges)):
            try:
                return way(), name
            except _ranges.ReadsHead:
                raise
            except Exception:  # noqa: BLE001 (whatever one way cannot follow, the next decides)
                continue
    return _every_cell(whole, batch, heads, q_len, kv_len, device), "every cell"


def _every_cell(mod, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[Tensor, Tensor] | None:
    """:func:`_derive` by evaluating ``mod`` on every cell, in row chunks.

    Dependence on ``b`` and ``h`` shows in the result's shape: a broadcasting predicate that never
    reads ``h`` returns size 1 along it. One that does is compared across heads, and raises
    :class:`attnkit._ranges.ReadsHead` where they differ.
    """
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    step = max(1, _ranges.CELLS // max(1, kv_len))
    buf = torch.zeros(step * batch, kv_len + 2, dtype=torch.bool, device=device)
    pieces, per_batch = [], False
    for r0 in range(0, q_len, step):
        q = torch.arange(r0, min(r0 + step, q_len), device=device).view(1, 1, -1, 1)
        grid = (batch, heads, q.shape[2], kv_len)
        out = mod(b, h, q, kv)
        _masks.check_mask_mod_output(mod, out, grid)
        out = _masks.as_grid(out)
        if out.shape[1] > 1:
            if not bool((out == out[:, :1]).all()):
                raise _ranges.ReadsHead()  # the caller works it out per head
            out = out[:, :1]
        out = out.expand(out.shape[0], 1, q.shape[2], kv_len)[:, 0]  # [1 or B, R, Lk]
        per_batch = per_batch or out.shape[0] > 1
        starts, ends = _ranges.runs(out.reshape(-1, kv_len), buf)
        if starts.shape[0] and int(torch.bincount(starts[:, 0]).max()) > MAX_INTERVALS:
            return None  # a row with too many runs: no interval form, whatever the other rows hold
        pieces.append((r0, out.shape[0], q.shape[2], starts, ends))
    return _assemble(pieces, batch if per_batch else 1, q_len, kv_len)


def _traced_derive(mod, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[Tensor, Tensor] | None:
    """:func:`_derive` in a graph torch.compile traces: ``mod`` on the whole grid at once, its runs
    read by one operator whose ``K`` is known only when it runs. None (no interval form) when the
    result varies along the head axis; a result that does not vary along the rows (key padding) is
    read once and shared by every row."""
    grid = (batch, heads, q_len, kv_len)
    b, h, q, kv = (torch.arange(n, device=device).view([-1 if d == i else 1 for d in range(4)])
                   for i, n in enumerate(grid))
    out = mod(b, h, q, kv)
    _masks.check_mask_mod_output(mod, out, grid)
    out = _masks.as_grid(out)
    if out.shape[1] > 1:
        return None
    rows = out.shape[2]
    starts, ends = torch.ops.attnkit.mask_runs(out[:, 0].expand(out.shape[0], rows, kv_len).contiguous())
    return starts.expand(-1, q_len, -1), ends.expand(-1, q_len, -1)


def _check_allowed(allowed: Tensor) -> None:
    """``attnkit::mask_runs``' argument, as PyTorch's own ops check theirs (in its fake too)."""
    if not isinstance(allowed, Tensor):
        raise TypeError(f"attnkit::mask_runs: allowed must be a tensor, got {type(allowed).__name__}")
    if allowed.dtype != torch.bool:
        raise TypeError(f"attnkit::mask_runs: allowed must be a bool tensor (True = may attend), got dtype "
                        f"{allowed.dtype}")
    if allowed.dim() != 3:
        raise ValueError(f"attnkit::mask_runs: allowed must be 3-D [P, R, Lk] (rows of keys per batch element), "
                         f"got shape {tuple(allowed.shape)}; pass allowed[None] for one set of rows")


@torch.library.custom_op("attnkit::mask_runs", mutates_args=(), device_types="cpu")
def _mask_runs(allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's runs of True in a bool CPU ``[P, R, Lk]``, as ``(starts, ends)`` int64 ``[P, R, K]``
    (``K`` the most runs a row has, at least 1; empty slots ``(Lk, Lk)``).

    Raises:
        TypeError: ``allowed`` not a bool tensor.
        ValueError: ``allowed`` not 3-D, or outputs (``P * R * K`` slots) beyond the memory limit
            (:func:`attnkit.masks.check_op_fits`).
    """
    _check_allowed(allowed)
    p, r, lk = allowed.shape
    if allowed.numel() == 0:  # no rows, or no keys: every row's one slot empty
        return torch.full((p, r, 1), lk, dtype=torch.int64), torch.full((p, r, 1), lk, dtype=torch.int64)
    rows = allowed.reshape(-1, lk)
    # runs per row: its rising edges; K known before the [runs, 2] edge lists and [P, R, K] slots are made
    k = int(((rows[:, 1:] & ~rows[:, :-1]).sum(-1) + rows[:, 0]).max())
    _masks.check_op_fits("attnkit::mask_runs", f"2 x int64 [P, R, K] = {(p, r, k)} and its runs' edges "
                         "(K: the most runs of True in a row)", p * r * k * 48, "call it on fewer rows at a time")
    buf = torch.zeros(p * r, lk + 2, dtype=torch.bool)
    starts, ends = _ranges.runs(rows, buf)
    return _assemble([(0, p, r, starts, ends)], p, r, lk, most=None)


@_mask_runs.register_fake
def _(allowed):
    _check_allowed(allowed)
    k = torch.library.get_ctx().new_dynamic_size(min=1)
    return (allowed.new_empty(*allowed.shape[:2], k, dtype=torch.int64),
            allowed.new_empty(*allowed.shape[:2], k, dtype=torch.int64))


def _assemble(pieces: list, p: int, q_len: int, kv_len: int,
              most: int | None = MAX_INTERVALS) -> tuple[Tensor, Tensor] | None:
    """``[p, Lq, K]`` intervals from the chunks' runs (a chunk with one row set per batch
    element, or one shared by all); None when a row has more than ``most`` runs."""
    rows, firsts, lasts = [], [], []
    for r0, pb, n, starts, ends in pieces:
        bi, ri = starts[:, 0] // n, starts[:, 0] % n
        for copy in range(p if pb == 1 else 1):  # a shared chunk of a per-batch plan: every element
            rows.append((bi + copy) * q_len + r0 + ri)
            firsts.append(starts[:, 1])
            lasts.append(ends[:, 1])
    row = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    order = row.argsort(stable=True)  # each row's runs in column order (chunks keep it)
    return _pack(row[order], torch.cat(firsts)[order] if firsts else row, torch.cat(lasts)[order] if lasts else row,
                 p, q_len, kv_len, most)


def _pack(row: Tensor, first: Tensor, last: Tensor, p: int, q_len: int, kv_len: int,
          most: int | None = MAX_INTERVALS) -> tuple[Tensor, Tensor] | None:
    """``[p, Lq, K]`` intervals from runs ``[first, last)`` of rows ``row`` (``pi * Lq + i``,
    sorted by row, then column); None when a row has more than ``most`` runs."""
    counts = torch.bincount(row, minlength=p * q_len)
    k = int(counts.max()) if row.numel() else 0
    if most is not None and k > most:
        return None
    k = max(k, 1)
    # each run's place in the [rows, k] table: its row's first place, plus its rank within the row
    place = torch.arange(row.numel()) + (row * k - (counts.cumsum(0) - counts).index_select(0, row))
    starts = torch.full((p * q_len * k,), kv_len, dtype=torch.int64).index_copy_(0, place, first)
    ends = torch.full((p * q_len * k,), kv_len, dtype=torch.int64).index_copy_(0, place, last)
    return starts.view(p, q_len, k), ends.view(p, q_len, k)


def _tile_kinds(starts: Tensor, ends: Tensor, q_len: int, kv_len: int, q_tile: int, kv_block: int) -> Tensor:
    """``[tiles, blocks]`` EMPTY/FULL/PARTIAL from intervals, by difference arrays over blocks.

    A pair is FULL when every real row of the tile, in every batch element, attends every key of
    the block (a block cut short by ``kv_len`` never is: its padding keys must be masked), EMPTY
    when no row attends any of its keys.
    """
    from .backends._tiling import EMPTY, FULL, PARTIAL

    p, lq, k = starts.shape
    nb, nt = -(-kv_len // kv_block), -(-q_len // q_tile)
    row = torch.arange(p * lq).repeat_interleave(k)
    s, e = starts.reshape(-1), ends.reshape(-1)

    def covered(first: Tensor, end: Tensor) -> Tensor:  # blocks first <= c < end, per row
        live = end > first
        d = torch.zeros(p * lq, nb + 1, dtype=torch.int32)
        ones = torch.ones(int(live.sum()), dtype=torch.int32)
        d.index_put_((row[live], first[live]), ones, accumulate=True)
        d.index_put_((row[live], end[live]), -ones, accumulate=True)
        return d.cumsum(1)[:, :nb] > 0

    live = e > s
    touched = covered(torch.where(live, s // kv_block, 0), torch.where(live, (e - 1) // kv_block + 1, 0))
    full = covered((s + kv_block - 1) // kv_block, e // kv_block)
    if kv_len % kv_block:
        full[:, -1] = False
    pad = nt * q_tile - lq
    touched = torch.nn.functional.pad(touched.view(p, lq, nb), (0, 0, 0, pad), value=False)
    full = torch.nn.functional.pad(full.view(p, lq, nb), (0, 0, 0, pad), value=True)
    touched = touched.view(p, nt, q_tile, nb).any(2).any(0)
    full = full.view(p, nt, q_tile, nb).all(2).all(0)
    return torch.where(full & touched, FULL, torch.where(touched, PARTIAL, EMPTY)).to(torch.int8)
