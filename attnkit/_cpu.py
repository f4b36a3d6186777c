"""What this machine's CPU is and can do, read once: its model name, and the instruction-set flags
that decide how a kernel computes half precision."""

from __future__ import annotations

import contextlib
import functools
import platform
from collections.abc import Iterator
from pathlib import Path


@functools.cache
def _cpuinfo(key: str) -> str | None:
    """The value of the first ``key`` line of Linux's ``/proc/cpuinfo``; None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(key):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


@functools.cache  # asked on every float16 SDPA call
def flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line); empty where unknown."""
    return frozenset((_cpuinfo("flags") or "").split())


def name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what :mod:`platform` says)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def has_fp16_products() -> bool:
    """Whether the CPU multiplies float16 natively (AVX512-FP16 or AMX-FP16); without them a float16
    matrix product is emulated, slower than a float32 one."""
    return bool(flags() & {"avx512_fp16", "amx_fp16"})


def has_bf16_products() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16); without them MKL's bfloat16
    product widens its operands itself, no faster than a float32 product."""
    return bool(flags() & {"avx512_bf16", "amx_bf16"})


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Within the block torch's ops on the calling thread run on one thread, then on as many as before
    (``torch.set_num_threads`` sets the calling thread's OpenMP and MKL threads only). For work too small to
    split (a kernel's self-check cases, a graph of 34 nodes): there more threads mostly wait for each other,
    for seconds on a busy machine."""
    import torch  # here, not at import: setup.py reads this module before attnkit is installed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
