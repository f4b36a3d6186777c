"""One non-finite value planted in a decode step's inputs, the same way for every backend whose finiteness flag is
tested against it (``tests/backends/test_decode.py``, ``tests/backends/test_sdpa.py``)."""

from __future__ import annotations

#: Where a value goes: one element of a key or a value, a whole row (of one sign or of both), or a query element.
KV_PLACES = ["k element", "k row", "k row, mixed signs", "v element", "v row"]
PLACES = [*KV_PLACES, "q element"]


def poison(q, k, v, where: str, key: int, value: float) -> None:
    """Write ``value`` in place at ``where`` (:data:`PLACES`): key/value head 1 of batch element 1, key ``key``;
    for a query, query head 3's element ``key % E``."""
    if where == "q element":
        q[1, 3, 0, key % q.shape[-1]] = value
        return
    t = k if where.startswith("k") else v
    if where.endswith("element"):
        t[1, 1, key, 5] = value
    else:
        t[1, 1, key] = value
        if where.endswith("mixed signs"):
            t[1, 1, key, ::2] = -value
