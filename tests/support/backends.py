"""The backends that the generic backend-parametrized tests run, and the banded kernel's half-products switch."""

from __future__ import annotations

import contextlib

import pytest

from attnkit import backends


def eager_backends() -> list[str]:
    """Every registered backend but ``flex``.

    ``flex`` compiles a kernel for each new family of calls (shapes, dtype, mods), seconds of CPU
    each, so the generic grids (hundreds of shapes x masks x dtypes) would compile hundreds of them.
    It has its own oracle grid instead, in ``tests/backends/test_flex*.py``: every dtype it serves
    (bfloat16 and float16 too), each way a mask reaches it, dead rows, GQA and ``Lq != Lk``, on a few
    shapes whose kernels are shared across cases.
    """
    return [name for name in backends.available() if name != "flex"]


@contextlib.contextmanager
def half_products(dtype, on: bool):
    """The banded kernel's products of half type ``dtype`` on or off for the block, whatever this CPU's default
    (on: skips where torch has none, or their self-check failed)."""
    from attnkit.backends import _band

    if on and not (_band.available() and _band._products_ok.get(dtype)):
        pytest.skip(f"no {dtype} products here: {_band.half_products_reason(dtype)}")
    with _band.half_products_set(dtype, on):
        yield

