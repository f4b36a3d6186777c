"""The per-predicate plan cache: a call with a ``mask_mod`` reuses the plan of an earlier call.

``attnkit.attention(..., mask_mod=fn)`` builds the plan itself (:func:`for_call`) and keeps it, with
the predicate (weakly: nothing is kept alive by the cache), keyed on the lengths, the batch, the
device and what the predicate reaches (:func:`attnkit.closures.captured_state`): the identity and
version counter of each tensor (an in-place change to captured document ids, or a module's buffer
edited or reassigned, makes a new plan) and the plain values (``int``, ``float``, ``bool``,
``str``) in its closure, defaults, globals and the attributes of a bound module or callable object.
What that cannot see: an edit through ``tensor.data`` or numpy memory (the version counter does
not move), a numpy array, the fields of an object that is neither callable nor a module. A
predicate that reads such state should be given a plan built for it (``mask=attnkit.mask_plan(...)``,
built again when the state changes), or the cache turned off (:data:`PLANS_PER_PREDICATE` = 0).
Under ``torch.inference_mode`` captured tensors keep no version counter: such a predicate's plan
is built on every call.

Safe to use from several threads: one lock around the cache's reads and writes; plans are built
outside it, and each derivation's state is its own.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from .. import closures
from .. import masks as _masks
from .plan import MaskPlan, build

#: How many automatically built plans ``attnkit.attention`` keeps per predicate (sizes, tensor versions);
#: 0 turns the cache off (a plan is built on every call that has no ``mask=plan``).
PLANS_PER_PREDICATE = 8

#: predicate -> {key: (weak references to the tensors the key names, plan)}; read and written under _lock.
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def for_call(req) -> MaskPlan | None:
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
    plan = build(mod, req.q_len, req.kv_len, batch, req.heads, req.is_causal, req.window, dev)
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


def _cache_key(mask_mod, sizes: tuple) -> tuple:
    """``(owner, key, tensors)``: the object the cached plans hang on (the predicate, or ``_NO_MOD``
    for is_causal/window alone; None when it cannot be weakly referenced), what a plan depends on
    besides it, and the tensors the key names (a hit must find these very tensors: another one may
    come to a freed one's address with the same version). The key: the sizes, the address, version
    counter and shape of every tensor the predicate reaches, and the plain values it reaches
    (:func:`attnkit.closures.captured_state`). Inference tensors (made under
    ``torch.inference_mode``) keep no version counter: such a predicate is not cached."""
    mask_mod = getattr(mask_mod, "__wrapped__", mask_mod)  # a per-element wrapper, made per call: its mod
    if mask_mod is None:
        return _NO_MOD, sizes, ()
    try:
        weakref.ref(mask_mod)
        hash(mask_mod)
    except TypeError:
        return None, None, ()
    found, values = closures.captured_state(mask_mod)
    if any(t.is_inference() for t in found):  # no version counter: an in-place change would go unseen
        return None, None, ()
    tensors = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in found)
    return mask_mod, (tensors, tuple((type(v), v) for v in values) if values else (), *sizes), found


class _NoMod:
    """Stands for "no predicate" as a weak-dict key (is_causal/window plans)."""


_NO_MOD = _NoMod()
