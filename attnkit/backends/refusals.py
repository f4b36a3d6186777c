"""What a backend cannot do, declared as data: each backend lists its :class:`Refusal` s.

A backend's ``REFUSALS`` is a tuple of (what the call asks for, why this backend cannot give it).
:func:`reasons` reads them for a call, and ``not_supported_reasons`` is that list, plus, for the
kernels that need it, what only working the call out can tell (the band kernel: whether the mask has
an interval form). Reading a backend's table tells what it serves without running it; when nothing
fits, :func:`attnkit.backends.select` lists every candidate's reasons.

Memory is not a refusal: a backend that forms dense ``[..., H, Lq, Lk]`` tensors (the reference, SDPA's
combined mask) has ``check_fits(call)``, asked of the backend chosen, and of it alone, while
:func:`attnkit.functional.checked` checks the call (before a KV cache is written). So ``"auto"`` chooses
as it always has, and the error is :mod:`attnkit.memory`'s, naming the limit and the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..call import Call


@dataclass(frozen=True)
class Refusal:
    """One thing a backend cannot serve: ``asks(call)`` says whether the call asks for it, ``why``
    (text, or a function of the call for a message that names what came) says why not."""

    asks: Callable[[Call], bool]
    why: str | Callable[[Call], str]


def reasons(refusals: tuple[Refusal, ...], req: Call) -> list[str]:
    """The ``why`` of every refusal in ``refusals`` that ``req`` asks for, in order."""
    return [r.why(req) if callable(r.why) else r.why for r in refusals if r.asks(req)]


def refused(backend: str, req: Call, why: list[str]) -> ValueError:
    """The error for a forced ``backend`` that cannot serve ``req``: the call as :meth:`Call.describe` gives it
    (as the message for a call no backend serves does), then ``why``, the backend's reasons."""
    return ValueError(f"backend {backend!r} cannot serve this call ({req.describe()}): " + "; ".join(why))


def weights(backend: str) -> Refusal:
    """The refusal of a kernel that never forms the attention weights."""
    return Refusal(lambda c: c.return_weights,
                   f"the {backend} backend never forms the weights (use backend='reference')")


def dropout(backend: str) -> Refusal:
    """The refusal of a kernel without dropout."""
    return Refusal(lambda c: c.dropout_p > 0, f"dropout is not implemented in the {backend} backend")
