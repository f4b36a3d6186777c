"""What this machine's CPU can do, read once: the instruction-set flags that decide how a kernel
computes half precision."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``'s ``flags`` line); empty where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def has_fp16_products() -> bool:
    """Whether the CPU multiplies float16 natively (AVX512-FP16 or AMX-FP16); without them a float16
    matrix product is emulated, slower than a float32 one."""
    return bool(flags() & {"avx512_fp16", "amx_fp16"})
