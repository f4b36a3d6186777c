"""The memory guard: refuse, before allocating, what would not fit.

Every path that materialises a dense ``[..., H, Lq, Lk]`` tensor (the reference and SDPA backends, a
dense mask) or a native op whose output size depends on the data calls :func:`check_dense_fits` or
:func:`check_op_fits` first, so that a call that cannot fit fails at once, with the way out, rather
than in the allocator or the kernel's out-of-memory killer. The limit is
:func:`max_dense_bytes`: ``ATTNKIT_MAX_DENSE_BYTES`` when set, else the memory available now.
"""

from __future__ import annotations

import math
import os

import torch

from ._tracing import assume_constant_result

#: Environment variable: the most bytes of ``[..., H, Lq, Lk]`` tensors one call may materialise
#: (default: the memory the system reports available at the time of the call).
MAX_DENSE_BYTES_ENV = "ATTNKIT_MAX_DENSE_BYTES"


@assume_constant_result  # read once while tracing, not a graph break at every call
def max_dense_bytes() -> float:
    """The most bytes of dense ``[..., H, Lq, Lk]`` tensors one call may materialise.

    ``ATTNKIT_MAX_DENSE_BYTES`` when set, else the memory the system reports available now
    (``MemAvailable`` on Linux, total physical memory elsewhere).
    """
    env = os.environ.get(MAX_DENSE_BYTES_ENV)
    if env is not None:
        try:
            limit = int(env)
        except ValueError:
            limit = -1
        if limit < 0:
            raise ValueError(f"{MAX_DENSE_BYTES_ENV} must be a non-negative whole number of bytes, got {env!r}")
        return limit
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows): nothing to compare with
        return math.inf


def check_dense_fits(what: str, shape, dtype: torch.dtype, copies: int) -> None:
    """Refuse, before allocating, ``copies`` dense tensors of ``shape`` and ``dtype`` beyond :func:`max_dense_bytes`.

    The dense paths call this with what they will materialise, so that a call that cannot fit
    fails at once with the way out rather than in the allocator (or in the kernel's OOM killer).
    """
    nbytes = math.prod(shape) * dtype.itemsize * copies
    limit = over_limit(nbytes)
    if limit is not None:
        raise ValueError(f"{what} would materialise {copies} x {tuple(shape)} {dtype} = {_human_bytes(nbytes)}, "
                         f"more than the limit of {_human_bytes(limit)} ({_limit_source()}). backend='blockwise' "
                         "computes tile by tile without forming [..., H, Lq, Lk] (it returns no weights: pass "
                         "return_weights=False); a window= also restricts the work to nearby keys")


class Fits:
    """The kind under which :func:`check_fits_once` notes, in a call's :class:`attnkit.call.Derived`, that its dense
    tensors fit."""


def check_fits_once(req, backend: str, check, *args) -> None:
    """``check(*args)``, ``backend``'s memory check of call ``req`` (it raises when the call's dense tensors would
    not fit), once per call and backend: when the call is checked (:func:`attnkit.functional.checked`, before a KV
    cache is written), not again when the backend runs it. The note holds nothing of the call's values, so it
    outlives a cache's write (the sizes do not change)."""
    req.derived.plan(Fits, check, *args, key=(backend,))


@assume_constant_result
def _free_memory() -> int:
    """Unused physical memory, a cheap lower bound of what is available (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 0


def _human_bytes(n: int) -> str:
    """``"3072 bytes (3.0 KiB)"``: exact, and readable at a glance."""
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    i, x = -1, float(n)
    while x >= 1024 and i < len(units) - 1:
        x, i = x / 1024, i + 1
    return f"{n} bytes" if i < 0 else f"{n} bytes ({x:.1f} {units[i]})"


def over_limit(nbytes: int) -> float | None:
    """The memory limit of :func:`max_dense_bytes` (``ATTNKIT_MAX_DENSE_BYTES``, else the memory
    available now) when ``nbytes`` exceeds it, else None."""
    if nbytes == 0 or (MAX_DENSE_BYTES_ENV not in os.environ and nbytes <= _free_memory()):
        return None  # fits in free memory: /proc/meminfo (slow to read) is not read on every call
    limit = max_dense_bytes()
    return limit if nbytes > limit else None


def check_op_fits(op: str, what: str, nbytes: int, way_out: str) -> None:
    """Refuse, before allocating, ``nbytes`` for native op ``op`` beyond the memory limit
    (:func:`over_limit`), with ``what`` it would allocate and ``way_out`` in the message."""
    limit = over_limit(nbytes)
    if limit is not None:
        raise ValueError(f"{op} would allocate {what} = {_human_bytes(nbytes)}, more than the limit of "
                         f"{_human_bytes(limit)} ({_limit_source()}); {way_out}")


def _limit_source() -> str:
    """Where the limit of :func:`max_dense_bytes` comes from, for an error message."""
    return (f"set by {MAX_DENSE_BYTES_ENV}" if MAX_DENSE_BYTES_ENV in os.environ
            else f"the memory available now; {MAX_DENSE_BYTES_ENV} overrides it")
