"""The backend registry behind ``attnkit.attention``.

A backend is an object with a ``name``, ``not_supported_reasons(request) -> list[str]`` (empty
when it can serve the request exactly) and ``__call__(request) -> (out, weights | None)``.
``"auto"`` takes the first backend in :func:`auto_order` (:data:`AUTO_ORDER`, with the device's own
engines first: :data:`DEVICE_FIRST`) that can serve a request; forcing a
backend that cannot raises ``ValueError`` with its reasons, and when none fits, every backend's.
A family name (:data:`FAMILIES`: ``"blockwise"``) takes the first of its members that can serve, in
:func:`family_order` (on CUDA compiled FlexAttention first: :data:`FAMILY_DEVICE_FIRST`);
``attnkit.which_backend`` always names the member that runs.

The registry is :mod:`.registry`; each kernel is a module here (``decode``, ``sdpa``, ``band``,
``reference``, ``flex``, and ``tiles`` for both ``tiles`` and ``fused_tiles``), and what each refuses is
declared in :mod:`.refusals`.
"""

from .registry import (
    AUTO_ORDER,
    AUTO_RANKS,
    DEVICE_FIRST,
    FAMILIES,
    FAMILY_DEVICE_FIRST,
    Backend,
    auto_order,
    available,
    family_order,
    get,
    register,
    select,
    served,
)

__all__ = ["AUTO_ORDER", "AUTO_RANKS", "DEVICE_FIRST", "FAMILIES", "FAMILY_DEVICE_FIRST", "Backend", "auto_order",
           "available", "family_order", "get", "register", "select", "served"]
