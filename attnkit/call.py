"""The call: one attention call's arguments, validated once and described for every backend.

``attnkit.attention`` checks its arguments once, here (:func:`validate_call`), and hands backends a :class:`Call`;
backends never re-validate user input. Shape notation (used throughout attnkit):

* ``...``  batch dimensions (any number, equal for query, key and value)
* ``H``    query heads; ``Hkv`` key/value heads (``H % Hkv == 0``: grouped-query attention)
* ``Lq``, ``Lk``  query and key lengths; ``E`` q/k head size; ``Ev`` value head size
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from . import masks as _masks
from . import per_element
from .dtypes import DTYPES
from .maskplan import MaskPlan, for_call

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
Window = tuple[int | None, int | None]

P = TypeVar("P")


class Derived:
    """What is worked out about one :class:`Call` and kept for it: plans, each under its own type.

    A backend keeps its plan for a call as an instance of a class of its own (``kind``), made once by
    :meth:`plan`; a key beyond the type tells apart plans of one kind made with other settings (a block
    size). It belongs to that call alone: :class:`Call` never copies it (see :attr:`Call.derived`).
    Not a ``functools.cached_property`` on the call: its lock (Python 3.11) is a context manager
    torch.compile cannot trace.
    """

    def __init__(self) -> None:
        self._plans: dict[tuple, object] = {}

    def plan(self, kind: type[P], make: Callable[..., P | None], *args, key: tuple = ()) -> P | None:
        """The call's plan of type ``kind`` (and ``key``): ``make(*args)`` on first use, kept after.

        ``make`` may return None (no plan of that kind for this call: no mask, say); that is kept too."""
        at = (kind, *key)
        if at not in self._plans:
            made = make(*args)
            if made is not None and not isinstance(made, kind):
                raise TypeError(f"a {kind.__name__} plan was made as a {type(made).__name__}")
            self._plans[at] = made
        return self._plans[at]

    def forget_all_but(self, *kinds: type) -> None:
        """Drop every plan but those of ``kinds``: for a call whose tensors were written in place since the plans
        were made (a KV cache's new tokens), keeping those that hold nothing of their values (the mask plan)."""
        self._plans = {at: plan for at, plan in self._plans.items() if at[0] in kinds}


def _nothing_worked_out() -> Derived:
    # A function for the field's default_factory: TorchDynamo (torch 2.13) cannot trace a class given there.
    return Derived()


@dataclass(frozen=True)
class Call:
    """One attention call, validated. See the module docstring for the shape notation."""

    query: Tensor  # [..., H, Lq, E]
    key: Tensor  # [..., Hkv, Lk, E]
    value: Tensor  # [..., Hkv, Lk, Ev]
    mask: Tensor | None  # bool, broadcastable to [..., H, Lq, Lk]
    bias: Tensor | None  # float, broadcastable to [..., H, Lq, Lk]
    is_causal: bool
    window: Window | None
    mask_mod: _masks.MaskMod | None
    score_mod: ScoreMod | None
    scale: float
    dropout_p: float
    return_weights: bool
    #: What is worked out about this call once and reused (its mask plan; a backend's plan, from asking whether
    #: it can serve the call to serving it): not an argument, not part of the call's identity, and never
    #: copied: a call made from this one with ``dataclasses.replace`` (the NaN rule's sanitized call) starts
    #: with none, since a plan may hold this call's tensors.
    derived: Derived = field(init=False, default_factory=_nothing_worked_out, compare=False, repr=False)

    @property
    def heads(self) -> int:
        return self.query.shape[-3]

    @property
    def kv_heads(self) -> int:
        return self.key.shape[-3]

    @property
    def q_len(self) -> int:
        return self.query.shape[-2]

    @property
    def kv_len(self) -> int:
        return self.key.shape[-2]

    @property
    def offset(self) -> int:
        """Absolute position of query 0: ``Lk - Lq`` (bottom-right alignment)."""
        return self.kv_len - self.q_len

    @property
    def batch_shape(self) -> torch.Size:
        return self.query.shape[:-3]

    @property
    def scores_shape(self) -> torch.Size:
        return self.batch_shape + (self.heads, self.q_len, self.kv_len)

    @property
    def mask_plan(self) -> MaskPlan | None:
        """The :class:`attnkit.MaskPlan` of ``is_causal``/``window``/``mask_mod`` and a dense 4-D ``mask``
        (None when none is set), worked out on first use and kept in :attr:`derived` (see
        :func:`attnkit.maskplan.for_call`). Not a ``functools.cached_property``: its lock (Python
        3.11) is a context manager torch.compile cannot trace."""
        return self.derived.plan(MaskPlan, for_call, self)

    def describe(self) -> str:
        """The call in one line, for messages: the tensors' shapes, their dtype and device, and what else is set."""
        q, k, v = self.query, self.key, self.value
        what = [f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}, {q.dtype} on {q.device}"]
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            what.append("a gradient")
        if self.mask is not None:
            what.append(f"mask {tuple(self.mask.shape)}")
        if self.bias is not None:
            what.append(f"bias {tuple(self.bias.shape)} {self.bias.dtype}")
        set_ = (("is_causal", self.is_causal), (f"window {self.window}", self.window),
                ("a MaskPlan" if is_plan(self.mask_mod) else "mask_mod", self.mask_mod), ("score_mod", self.score_mod),
                (f"dropout_p {self.dropout_p}", self.dropout_p), ("return_weights", self.return_weights))
        what += [name for name, given in set_ if given]
        return "; ".join(what)

    def structured_mask_mod(self) -> _masks.MaskMod | None:
        """``is_causal``, ``window`` and ``mask_mod`` as one predicate (``None`` if none is set)."""
        return _masks.combined_mask_mod(self.is_causal, self.window, self.offset, self.mask_mod)

    def dense_mask(self) -> Tensor | None:
        """Everything that masks, materialised: bool broadcastable to ``[..., H, Lq, Lk]``."""
        out = self.mask
        mod = self.structured_mask_mod()
        if mod is not None:
            batch = self.query.shape[0] if self.query.dim() == 4 else 1
            grid = _masks.materialize(mod, batch, self.heads, self.q_len, self.kv_len,
                                      device=self.query.device)
            if self.query.dim() != 4:  # predicates without b/h use: drop the leading grid dims
                grid = grid.reshape(grid.shape[-2:])
            out = grid if out is None else out & grid
        return out


def validate_call(
    query,
    key,
    value,
    *,
    mask=None,
    bias=None,
    is_causal=False,
    window=None,
    mask_mod=None,
    score_mod=None,
    scale=None,
    dropout_p=0.0,
    return_weights=False,
) -> Call:
    """Check every argument of ``attnkit.attention`` and return a :class:`Call`.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: a shape, size or value outside what is expected; the message names the
            argument, what came and what was expected.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64 (what attnkit computes in), got "
                            f"dtype {t.dtype} on {t.device}; convert it first, e.g. {name}.to(torch.bfloat16)")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no values to attend over: attnkit computes "
                             "on CPU and CUDA tensors (the PyTorch backends, sdpa, tiles and reference, on any "
                             "device PyTorch computes on)")
        if t.dim() < 3:
            raise ValueError(f"{name} must have shape [..., heads, length, dim] (at least 3-D), "
                             f"got shape {tuple(t.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match query dtype {query.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
        if t.shape[:-3] != query.shape[:-3]:
            raise ValueError(f"{name} batch dims {tuple(t.shape[:-3])} must equal query batch dims "
                             f"{tuple(query.shape[:-3])}")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key head size {key.shape[-1]} must equal query head size {query.shape[-1]} "
                         f"(query {tuple(query.shape)}, key {tuple(key.shape)})")
    if value.shape[-3] != key.shape[-3] or value.shape[-2] != key.shape[-2]:
        raise ValueError(f"value must have the same heads and length as key: key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)} (expected [..., {key.shape[-3]}, {key.shape[-2]}, Ev])")
    h, hkv = query.shape[-3], key.shape[-3]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")

    target = query.shape[:-3] + (h, query.shape[-2], key.shape[-2])
    if is_plan(mask):  # the whole mask, worked out once: from here on it is the request's mask_mod
        if mask_mod is not None or is_causal or window is not None:
            raise ValueError("mask is a MaskPlan, which holds the whole mask: build it with is_causal/window/"
                             "mask_mod (attnkit.mask_plan) instead of passing them here as well")
        if query.dim() != 4:
            raise ValueError(f"a MaskPlan needs 4-D inputs [B, H, L, E], got query shape {tuple(query.shape)}")
        mask.check(query.shape[0], query.shape[-2], key.shape[-2], query.device)
        mask, mask_mod = None, mask
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a bool tensor, a MaskPlan or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
                            "pass additive float terms as bias=")
        _check_broadcast("mask", mask, target, query.device)
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a floating-point tensor or None, got {type(bias).__name__}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor, got dtype {bias.dtype}; "
                            "pass boolean masks as mask=")
        _check_broadcast("bias", bias, target, query.device)
    if query.dim() >= 4:
        for name, t in (("mask", mask), ("bias", bias)):
            _check_not_per_batch_3d(name, t, query.dim(), h)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    window = _masks.check_window(window)
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None:
            if not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
            if query.dim() != 4:
                raise ValueError(f"{name} needs 4-D inputs [B, H, L, E], got query shape {tuple(query.shape)}")
    unchecked = None if is_plan(mask_mod) else mask_mod  # a plan's predicate was checked when it was built
    probed = None if getattr(score_mod, "score_only", False) is True else score_mod  # e.g. attnkit.scores.softcap
    if (unchecked is not None or probed is not None) and 0 not in target:
        if unchecked is not None:
            unchecked = mask_mod = per_element.evaluator(mask_mod, target, query.device)
        if probed is not None:
            score_mod = probed = per_element.evaluator(score_mod, target, query.device, query.dtype)
        _probe_mods(unchecked, probed, per_element.probe_indices(target, query.device), query)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    return Call(query, key, value, mask, bias, is_causal, window, mask_mod, score_mod,
                   float(scale), float(dropout_p), return_weights)


def is_plan(mask) -> bool:
    """Whether ``mask`` is an :class:`attnkit.MaskPlan`."""
    return isinstance(mask, MaskPlan)


def _check_broadcast(name: str, t: Tensor, target: torch.Size, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}")
    if not _masks.broadcasts_to(t.shape, target):
        raise ValueError(f"{name} of shape {tuple(t.shape)} is not broadcastable to "
                         f"[..., H, Lq, Lk] = {tuple(target)}")


def _check_not_per_batch_3d(name: str, t: Tensor | None, ndim: int, heads: int) -> None:
    """Refuse a 3-D mask/bias ``[X, Lq, Lk]`` with ``X > 1`` against 4-D (or more) scores.

    Broadcasting aligns trailing dims, so ``X`` lands on the head axis: a per-batch ``[B, Lq, Lk]``
    mask (the usual intent) silently masks head ``b`` with sequence ``b``'s mask when ``B == H``.
    """
    if t is None or t.dim() != 3 or t.shape[0] == 1:
        return
    raise ValueError(f"{name} of shape {tuple(t.shape)} against {ndim}-D queries is ambiguous: its first dim would "
                     f"align with the {heads} heads, not the batch; pass {name}[:, None] ([B, 1, Lq, Lk]) for one "
                     f"{name} per batch element, or {name}[None] ([1, H, Lq, Lk]) for one per head")


def _probe_mods(mask_mod, score_mod, sample: tuple[Tensor, ...], query: Tensor) -> None:
    """Call each mod once on ``sample`` (:func:`attnkit.per_element.probe_indices`) and check what it returns.

    A wrong return would otherwise surface deep in a backend as an unrelated error (a float
    ``&``, ``None.to``), or not at all (a scalar score broadcast over the tile: uniform
    attention). The indices stay in range, so mods that index captured tensors with them
    (document ids, per-batch lengths) work. Under ``no_grad``: the probe is not part of the
    computation and must not touch the autograd graph of captured parameters.
    """
    b, h, q, kv = sample
    grid = (b.shape[0], h.shape[1], q.shape[2], kv.shape[3])
    try:
        with torch.no_grad():
            mask_out = None if mask_mod is None else mask_mod(b, h, q, kv)
            score_out = None if score_mod is None else score_mod(query.new_zeros(grid), b, h, q, kv)
    except Exception:  # a mod that raises here raises in the real call too, with its own message and traceback
        return
    if mask_mod is not None:
        _masks.check_mask_mod_output(mask_mod, mask_out, grid)
    if score_mod is None:
        return
    fn = _masks.mod_name("score_mod", score_mod)
    if not isinstance(score_out, Tensor) or not score_out.is_floating_point():
        got = f"a {score_out.dtype} tensor" if isinstance(score_out, Tensor) else type(score_out).__name__
        raise TypeError(f"{fn} returned {got}; expected a floating-point tensor of the score's shape "
                        "(e.g. score + bias[h])")
    if score_out.shape != grid:
        raise ValueError(f"{fn} returned shape {tuple(score_out.shape)} for scores of shape {grid}; expected "
                         "the score's shape (a reduction such as score.sum() would make attention uniform)")
