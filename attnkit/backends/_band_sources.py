"""The banded kernel's sources, compiler flags and build key, in one place for both of its builds: ``setup.py``'s
at install (the module ``attnkit.backends._band_kernel``) and :mod:`._band`'s on first use, its fallback.

This file imports nothing of attnkit and torch only inside functions: ``setup.py`` loads it by its path,
before attnkit is installed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The kernel's C++ sources: one translation unit per role (``csrc/band/kernel.h`` lists them).
FOLDER = Path(__file__).with_name("csrc") / "band"
SOURCES = ("checks.cpp", "products.cpp", "forward.cpp", "backward.cpp", "decode.cpp", "bindings.cpp")
#: The installed module's name in :mod:`attnkit.backends`, and its build record beside it (:func:`record`).
MODULE = "_band_kernel"
RECORD = f"{MODULE}.build"
LDFLAGS = ["-fopenmp"]
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


def sources() -> list[Path]:
    """The translation units, in build order."""
    return [FOLDER / name for name in SOURCES]


def files() -> list[Path]:
    """Every file the binary is built from (sources and headers), sorted."""
    return sorted([*FOLDER.glob("*.cpp"), *FOLDER.glob("*.h")])


def cflags(capability: str, cpu_flags: frozenset[str]) -> list[str]:
    """Compiler flags for torch's CPU ``capability`` (``torch.backends.cpu.get_cpu_capability()``) and the CPU's
    ``/proc/cpuinfo`` flags. Hidden visibility: the module exports its entry point only."""
    flags = ["-O3", "-fopenmp", "-fvisibility=hidden", *_ISA_FLAGS.get(capability, [])]
    if capability == "AVX512" and "avx512_bf16" in cpu_flags:
        flags.append("-mavx512bf16")  # the weights rounded to bfloat16 by one instruction (round_pair, vec_math.h)
    return flags


def key(torch_version: str, capability: str, flags: list[str]) -> str:
    """What the binary depends on, hashed: every source and header (name and text), torch's version, the CPU
    capability and the flags. The JIT build's module name and the installed module's record both carry it."""
    h = hashlib.sha256()
    for path in files():
        h.update(f"{path.name}\n{len(path.read_bytes())}\n".encode())
        h.update(path.read_bytes())
    h.update("\n".join([torch_version, capability, *flags]).encode())
    return h.hexdigest()[:16]


def module_name(key_: str) -> str:
    """The module's name for build key ``key_``, in both builds (``bindings.cpp``)."""
    return f"attnkit_band_{key_}"


def record(key_: str, digest: str, built_for: str = "") -> bytes:
    """The installed module's build record: its key (:func:`key`), the SHA-256 of the module's bytes and, in
    words, what it was built for (torch version and CPU capability, for the message when the key differs)."""
    return f"key {key_}\nsha256 {digest}\nfor {built_for}\n".encode()


def parse_record(data: bytes) -> tuple[str, str, str]:
    """``(key, sha256, built for)`` of a build record (built for: ``""`` where the record does not say); KeyError
    or ValueError if it is not one."""
    fields = dict(line.split(" ", 1) for line in data.decode().splitlines() if line)
    return fields["key"], fields["sha256"], fields.get("for", "")
