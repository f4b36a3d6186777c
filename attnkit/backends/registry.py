"""The backend registry: :func:`register` adds a backend, :func:`select` picks the one that serves a
call (by name, a family in :data:`FAMILIES`, or ``"auto"`` through :func:`auto_order`: :data:`AUTO_ORDER`,
the backends by their :data:`AUTO_RANKS`, with the device's own engines first, :data:`DEVICE_FIRST`), and
the built-in kernels are registered when it is first imported. ``attnkit.backends`` offers these names.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from ..call import Call
from .refusals import refused


class Backend(Protocol):
    """What a backend is: a ``name``, ``not_supported_reasons(request)`` (empty when it can serve the
    validated :class:`attnkit.call.Call` exactly) and ``__call__(request) -> (out, weights or None)``.

    A backend may also have ``prefers(request) -> bool``: True for calls it serves faster than the backends
    before it in :func:`auto_order` (``"auto"`` then tries it first), each such rule a measured one; and
    ``step(query, key, value, is_causal, scale) -> Tensor | None``: its answer to a plain call of one query
    (:func:`step_leader`), or None to let the call take the whole way, asked only while it leads."""

    name: str

    def not_supported_reasons(self, req: Call) -> list[str]: ...

    def __call__(self, req: Call) -> tuple[Tensor, Tensor | None]: ...


_REGISTRY: dict[str, Backend] = {}
AUTO_RANKS: dict[str, int] = {}
"""Each backend ``backend="auto"`` tries -> its ``auto_rank`` (:func:`register`): lower ranks are tried first."""
AUTO_ORDER: list[str] = []
"""Preference order for ``backend="auto"``: the names of :data:`AUTO_RANKS` by rank, whatever order they were
registered in. Fused kernels first, the exact reference, then ``flex``, last (on the CPU ``flex`` serves only
what nothing else does; see :data:`DEVICE_FIRST` for other devices)."""
DEVICE_FIRST: dict[str, tuple[str, ...]] = {"cuda": ("sdpa", "flex")}
"""Per device type, the backends that go before the rest of :data:`AUTO_ORDER` there, in this order:
on CUDA, PyTorch's SDPA (flash, cuDNN, memory-efficient) for what it does exactly (no mask, causal, a
dense mask or bias), then ``flex`` (compiled FlexAttention) for windows, plans, ``mask_mod`` and
``score_mod``; the CPU-only kernels refuse there, so ``tiles`` and ``reference`` follow."""
FAMILIES: dict[str, tuple[str, ...]] = {"blockwise": ("band", "fused_tiles", "tiles")}
"""Names that stand for the first member able to serve a call: ``"blockwise"`` is the exact
O(tile)-memory kernels, fastest first (see :data:`FAMILY_DEVICE_FIRST` for other devices)."""
FAMILY_DEVICE_FIRST: dict[str, dict[str, tuple[str, ...]]] = {"blockwise": {"cuda": ("flex",)}}
"""Per family and device type, members that go before the family's own there: on CUDA, where the CPU
kernels refuse, ``"blockwise"`` is compiled FlexAttention before the tiles (on the CPU it is not a
member: its compile would cost seconds where the kernels serve at once)."""


def register(backend: Backend, *, auto_rank: int | None = None) -> Backend:
    """Add ``backend`` to the registry, in place of any of the same name.

    ``auto_rank`` places it in :data:`AUTO_ORDER`: after every backend of a lower rank, before every backend of a
    higher one (:data:`AUTO_RANKS` holds them; a backend already there moves to its new rank). It is a rank, not
    a position in the list: registering another backend never moves the rest among themselves. ``None`` leaves
    the order as it is (a new backend is then only served by name).

    Raises:
        TypeError: ``auto_rank`` is not an int.
        ValueError: another backend holds that rank (the order between the two would be unstated), naming it.
    """
    if auto_rank is not None:
        if not isinstance(auto_rank, int) or isinstance(auto_rank, bool):
            raise TypeError(f"auto_rank must be an int or None, got {type(auto_rank).__name__}")
        holder = next((n for n, r in AUTO_RANKS.items() if r == auto_rank and n != backend.name), None)
        if holder is not None:
            raise ValueError(f"auto_rank {auto_rank} is taken by {holder!r}: give {backend.name!r} a rank between "
                             f"those of the backends it should come between, of {AUTO_RANKS}")
    _REGISTRY[backend.name] = backend
    _PREFERRING.pop(backend.name, None)
    if getattr(backend, "prefers", None) is not None:
        _PREFERRING[backend.name] = backend
    if auto_rank is not None:
        AUTO_RANKS[backend.name] = auto_rank
        AUTO_ORDER[:] = sorted(AUTO_RANKS, key=AUTO_RANKS.__getitem__)  # in place: the list is importable
    return backend


_PREFERRING: dict[str, Backend] = {}  # the registered backends with a ``prefers`` rule (kept by register)
_BUILTIN: dict[str, Backend] = {}  # the built-in backends as _register_builtin registered them


def step_leader() -> Backend | None:
    """The backend ``"auto"`` picks first for a plain CPU call of one query (no mask, window, mods, bias, dropout
    or weights), when the order alone decides it: the first of the CPU's order. None when a backend registered
    since has a ``prefers`` rule, which might claim such a call: the built-ins' rules leave one query alone
    (band's asks for more), so only one of one's own can. :func:`attnkit.attention` offers such a call to this
    backend's ``step`` (the decode backend's lane, :meth:`attnkit.backends.decode.DecodeBackend.step`) before
    :func:`select`, which would pick the same backend."""
    if any(b is not _BUILTIN.get(n) for n, b in _PREFERRING.items()) or DEVICE_FIRST.get("cpu"):
        return None
    return _REGISTRY.get(AUTO_ORDER[0]) if AUTO_ORDER else None


def auto_order(device) -> list[str]:
    """The order ``backend="auto"`` tries on ``device`` (a ``torch.device`` or its name): the device's
    :data:`DEVICE_FIRST` backends that are registered, then the rest of :data:`AUTO_ORDER`."""
    first = [n for n in DEVICE_FIRST.get(torch.device(device).type, ()) if n in _REGISTRY]
    return first + [n for n in AUTO_ORDER if n not in first]


def family_order(name: str, device) -> list[str]:
    """The members family ``name`` tries on ``device``: :data:`FAMILY_DEVICE_FIRST`'s for the device that are
    registered, then :data:`FAMILIES`'."""
    first = [n for n in FAMILY_DEVICE_FIRST.get(name, {}).get(torch.device(device).type, ()) if n in _REGISTRY]
    return first + [n for n in FAMILIES[name] if n not in first]


def available() -> list[str]:
    """Names of the registered backends."""
    return list(_REGISTRY)


def get(name: str) -> Backend:
    """The registered backend called ``name``.

    Raises:
        ValueError: no backend has that name (the message lists those that do).
    """
    if name not in _REGISTRY:
        raise ValueError(f"backend must be 'auto' or one of {available() + list(FAMILIES)}, got {name!r}")
    return _REGISTRY[name]


_SERVED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("attnkit_served", default=None)


@contextlib.contextmanager
def served() -> Iterator[list[str]]:
    """A list that fills, in order, with the name of the backend that serves each attention call made inside
    the block (in this thread or task; an inner block's calls count in the outer one too; calls traced by
    ``torch.compile`` are not listed), so a model's calls can be told apart, e.g. which layer ran on which
    kernel::

        with attnkit.backends.served() as names:
            model(x)
        print(names)            # ['band', 'band', 'sdpa', ...]
    """
    names: list[str] = []
    outer = _SERVED.get()
    token = _SERVED.set(names)
    try:
        yield names
    finally:
        _SERVED.reset(token)
        if outer is not None:
            outer.extend(names)


def note_served(backend: Backend) -> None:
    """Tell the :func:`served` blocks around this call that ``backend`` serves an attention call
    (``attnkit.attention`` does, once per call; :func:`select` alone, as ``which_backend`` uses it, does not).
    Under ``torch.compile`` nothing is noted: a traced call is not served until the graph runs."""
    if torch.compiler.is_compiling():
        return
    names = _SERVED.get()
    if names is not None:
        names.append(backend.name)


def select(req: Call, name: str = "auto") -> Backend:
    """The backend that will serve ``req``: the named one, or the first fit in :func:`auto_order` for its
    device (or in the named family).

    Raises:
        ValueError: the named backend cannot serve ``req``: then the call (shapes, dtype, device, what is set)
            and its reasons; or no candidate can: then the call and, one a line, each candidate with its reasons.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, got {type(name).__name__}")
    if name != "auto" and name not in FAMILIES:
        backend = get(name)
        reasons = backend.not_supported_reasons(req)
        if reasons:
            raise refused(name, req, reasons)
        return backend
    why = {}
    order = auto_order(req.query.device) if name == "auto" else family_order(name, req.query.device)
    if name == "auto":
        ahead = [n for n in order if getattr(_REGISTRY[n], "prefers", None) is not None and _REGISTRY[n].prefers(req)]
        order = ahead + [n for n in order if n not in ahead]
    for candidate in order:
        reasons = _REGISTRY[candidate].not_supported_reasons(req)
        if not reasons:
            return _REGISTRY[candidate]
        why[candidate] = reasons
    what = "no attention backend" if name == "auto" else f"no backend of the {name!r} family"
    raise ValueError(f"{what} can serve this call ({req.describe()}):"
                     + "".join(f"\n  {n}: {'; '.join(r)}" for n, r in why.items()))


def _register_builtin() -> None:
    from .band import BandBackend
    from .decode import DecodeBackend
    from .flex import FlexBackend
    from .reference import ReferenceBackend
    from .sdpa import SDPABackend
    from .tiles import FusedTilesBackend, TilesBackend

    # first, before SDPA: a decode step (a few queries, no gradient) reads the cache once there (backends/decode.py)
    register(DecodeBackend(), auto_rank=0)
    register(SDPABackend(), auto_rank=10)  # ranks apart, so that a backend of one's own can go between
    register(BandBackend(), auto_rank=20)
    register(FusedTilesBackend(), auto_rank=30)
    register(TilesBackend(), auto_rank=40)
    register(ReferenceBackend(), auto_rank=99)
    # after the reference: on the CPU only what nothing else serves
    register(FlexBackend(fallback=_next_in_order("flex")), auto_rank=100)
    _BUILTIN.update(_REGISTRY)


def _next_in_order(name: str):
    """``pick(request)``: the first backend of the request's device order, other than ``name``, that serves it."""

    def pick(req: Call) -> Backend:
        for candidate in auto_order(req.query.device):
            if candidate != name and not _REGISTRY[candidate].not_supported_reasons(req):
                return _REGISTRY[candidate]
        return select(req)  # raises, listing every candidate's reasons

    return pick


_register_builtin()
