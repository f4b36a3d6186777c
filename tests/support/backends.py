"""The backends that the generic backend-parametrized tests run."""

from __future__ import annotations

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
