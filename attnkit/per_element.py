"""FlexAttention's per-element semantics for ``mask_mod``/``score_mod``, on attnkit's broadcasting calls.

FlexAttention defines a mod per cell (it is vmapped over scalar indices); attnkit calls it once
on broadcasting index tensors (``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,Lq,1]``,
``kv_idx [1,1,1,Lk]``), which is much faster and gives the same values for every mod written with
elementwise operations and tensor indexing. Mods that index with their arguments in ways that do
not broadcast (Flamingo-style ``intervals[image[q_idx]][0]``, an MLA-style
``torch.dot(q_rope[b, h, q_idx], k_rope[b, h, kv_idx])``) raise or compute something else that
way. :func:`evaluator` finds out once per mod, on a small grid, by comparing the broadcasting call
with per-element calls through ``torch.vmap``; when they differ (or the broadcasting call fails)
it returns a wrapper that evaluates the mod per element, in chunks, with the broadcasting
signature every backend uses. Exceptions: a mod that ``torch.vmap`` cannot run either (Python
control flow on a tensor's value, ``.item()``) is used as it is.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import Tensor

from . import _tracing
from .closures import captured_tensors

#: Most cells one vmapped call evaluates (bounded memory for per-element evaluation).
CHUNK = 1 << 18

#: mod -> whether it must be called per element. Weak: a mod (and the tensors it captures, which
#: may be a training step's activations) is not kept alive by having been asked about once.
_per_element: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def evaluator(mod, grid: tuple[int, ...], device, score_dtype: torch.dtype | None = None):
    """``mod`` itself when broadcasting calls agree with per-element calls on :func:`probe_indices`
    of ``grid`` (``(B, H, Lq, Lk)``; a score_mod gets a zero score of ``score_dtype`` first), else a
    per-element wrapper with the same signature. Decided once per mod.

    attnkit's own mods (those whose ``broadcasts`` attribute is True: :mod:`attnkit.masks`' typed
    masks, :mod:`attnkit.scores`' forms, built of such parts) are written to broadcast and used as
    they are. Under ``torch.compile`` the decision is made once while tracing, on real tensors, and
    is a constant of the graph; a mod over tensors made inside the traced code cannot be tried
    there and is evaluated per element (exact whichever way it is written).
    """
    if broadcasts(mod):
        return mod
    needed = _needs_per_element(mod, tuple(int(n) for n in grid), torch.device(device), score_dtype)
    return per_element(mod) if needed else mod


def broadcasts(*mods) -> bool:
    """Whether every mod says it is written to broadcast (its ``broadcasts`` attribute is True)."""
    return all(getattr(mod, "broadcasts", False) is True for mod in mods)


def probe_indices(grid: tuple[int, ...], device) -> tuple[Tensor, ...]:
    """A few in-range indices of each axis (first, middle, last; the keys also the second, so that
    a wrong shape cannot pass for a square grid), broadcasting like the backends'
    (``b [n,1,1,1]``, ``h [1,n,1,1]``, ``q_idx [1,1,n,1]``, ``kv_idx [1,1,1,n]``)."""
    picks = [{0, n // 2, n - 1} | ({min(1, n - 1)} if i == 3 else set()) for i, n in enumerate(grid)]
    return tuple(torch.tensor(sorted(p), device=device).view([-1 if d == i else 1 for d in range(4)])
                 for i, p in enumerate(picks))


@_tracing.assume_constant_result  # while tracing: decided on real tensors, a constant of the graph
def _needs_per_element(mod, grid: tuple[int, ...], device: torch.device, score_dtype) -> bool:
    try:
        needed = _per_element.get(mod)
    except TypeError:  # cannot be weakly referenced or hashed: decide every time
        needed = None
    if needed is None:
        with _tracing.real_tensors():
            if any(_tracing.is_fake(t) for t in captured_tensors(mod, requiring_grad=False)):
                return True  # made inside traced code: nothing real to try it on
            sample = probe_indices(grid, device)
            if score_dtype is not None:
                sample = (torch.zeros(torch.broadcast_shapes(*(t.shape for t in sample)), dtype=score_dtype,
                                      device=device), *sample)
            needed = _differs(mod, sample)
        try:
            _per_element[mod] = needed
        except TypeError:
            pass
    return needed


def _differs(mod, sample: tuple[Tensor, ...]) -> bool:
    """Whether the broadcasting call of ``mod`` on ``sample`` fails or differs from per-element calls."""
    try:
        with torch.no_grad():
            want = per_element(mod)(*sample)
    except Exception:  # noqa: BLE001 - vmap cannot run it: broadcasting is the only way there is
        return False
    try:
        with torch.no_grad():
            got = mod(*sample)
        same = isinstance(got, Tensor) and torch.broadcast_shapes(got.shape, want.shape) == want.shape and bool(
            (torch.broadcast_to(got, want.shape) == want).all() if got.dtype == torch.bool
            else torch.allclose(torch.broadcast_to(got, want.shape).to(want.dtype), want, equal_nan=True))
    except Exception:  # noqa: BLE001 - the broadcasting call fails: per element it is
        same = False
    return not same


def per_element(mod):
    """``mod`` evaluated cell by cell through ``torch.vmap`` (scalar indices, as FlexAttention calls
    it), with broadcasting arguments in and a broadcast result out (``__wrapped__`` is ``mod``)."""

    @functools.wraps(mod)
    def wrapper(*args):
        shape = torch.broadcast_shapes(*(a.shape for a in args))
        flat = [torch.broadcast_to(a, shape).reshape(-1) for a in args]
        fn = torch.vmap(mod)
        n = flat[0].numel()
        if n == 0:  # a mask_mod's result is bool, a score_mod's has the score's dtype (its first argument)
            return torch.zeros(shape, dtype=args[0].dtype if args[0].is_floating_point() else torch.bool)
        parts = [fn(*(a[i:i + CHUNK] for a in flat)) for i in range(0, n, CHUNK)]
        return torch.cat(parts).reshape(shape)

    return wrapper
