"""Races on purpose: many threads released together, switching far more often than usual."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def race(body: Callable[[int, Callable[[], object]], None], threads: int, interval: float) -> None:
    """``body(me, together)`` in ``threads`` threads released together (``together()`` holds each until
    all reach it again), with threads switching every ``interval`` seconds (far more often than
    usual: a race shows sooner); fails with the errors any raised."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(me: int) -> None:
        try:
            barrier.wait()
            body(me, barrier.wait)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            barrier.abort()

    try:
        pool = [threading.Thread(target=work, args=(me,)) for me in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors[:3]
