"""The backends that the generic backend-parametrized tests run, and the banded kernel's half-products switch."""

from __future__ import annotations

import contextlib

import pytest

from attnkit import backends


def eager_backends() -> list[str]:
    """Every registered backend but ``flex`` and ``decode``.

    ``flex`` compiles a kernel for each new family of calls (shapes, dtype, mods), seconds of CPU
    each, so the generic grids (hundreds of shapes x masks x dtypes) would compile hundreds of them.
    It has its own oracle grid instead, in ``tests/backends/test_flex*.py``: every dtype it serves
    (bfloat16 and float16 too), each way a mask reaches it, dead rows, GQA and ``Lq != Lk``, on a few
    shapes whose kernels are shared across cases.

    ``decode`` serves a few queries without a gradient, in float32 and the half types, where the grids run
    float64 with gradients; ``tests/backends/test_decode.py`` has its grid, and ``"auto"`` takes it for the
    grids' calls it serves.
    """
    return [name for name in backends.available() if name not in ("flex", "decode")]


@contextlib.contextmanager
def half_products(dtype, on: bool):
    """The banded kernel's products of half type ``dtype`` on or off for the block, whatever this CPU's default
    (on: skips where torch has none, or their self-check failed)."""
    from attnkit.backends import _band

    if on and not (_band.available() and _band._products_ok.get(dtype)):
        pytest.skip(f"no {dtype} products here: {_band.half_products_reason(dtype)}")
    with _band.half_products_set(dtype, on):
        yield

