"""Builds attnkit's banded attention kernel at install (``attnkit.backends._band_kernel``), against the torch that
is installed; everything else about the package is in pyproject.toml.

The kernel must be compiled against the torch it will run with, so install with pip's build isolation off:
``pip install --no-build-isolation -e .`` (an isolated build would fetch a torch of its own: a multi-GB download
and maybe another ABI). Where the build sees no torch (an isolated build), has no compiler, or the compile fails,
attnkit installs without the module and compiles the kernel on first use instead, saying so through ``warnings``
(:mod:`attnkit.backends._band`). The translation units compile in parallel (ninja; ``MAX_JOBS`` caps the jobs).
Beside the module goes its build record (``_band_kernel.build``): the build key of the sources, torch version,
CPU capability and flags, and the module's SHA-256, which the loader checks before it loads the module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import warnings
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _by_path(name: str, relative: str):
    """A module of attnkit loaded from its file (attnkit itself is not importable before it is installed)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel() -> dict:
    """setup()'s arguments for the kernel's extension, or none where torch is not importable."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        warnings.warn("attnkit: no torch where this build runs (pip's build isolation? use "
                      "`pip install --no-build-isolation`): installing without the compiled kernel; it is "
                      "compiled on first use instead", stacklevel=1)
        return {}
    sources = _by_path("_attnkit_band_sources", "attnkit/backends/_band_sources.py")
    cpu = _by_path("_attnkit_cpu", "attnkit/_cpu.py")
    capability = torch.backends.cpu.get_cpu_capability()
    cflags = sources.cflags(capability, cpu.flags())
    key = sources.key(torch.__version__, capability, cflags)

    class BuildKernel(cpp_extension.BuildExtension):
        """torch's BuildExtension, with the kernel optional and its build record written beside it."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # no compiler, a compile error: attnkit installs, the kernel is built on first use
                self.warn(f"attnkit: the banded kernel did not compile ({type(e).__name__}: {e}); installing without "
                          "it (it is compiled on first use instead)")
                return
            self._record(Path(self.get_ext_fullpath(ext.name)))

        def copy_extensions_to_source(self):  # an editable install: the module is copied beside the sources
            super().copy_extensions_to_source()
            for ext in self.extensions:
                self._record(Path(self.get_ext_fullpath(ext.name)))

        @staticmethod
        def _record(built: Path) -> None:
            """The build record beside the module ``built`` (if it was built), written atomically."""
            if not built.exists():
                return
            record = built.with_name(sources.RECORD)
            staged = record.with_name(f".{record.name}.{os.getpid()}")
            staged.write_bytes(sources.record(key, hashlib.sha256(built.read_bytes()).hexdigest(),
                                              f"torch {torch.__version__}, CPU capability {capability}"))
            os.replace(staged, record)

    # -g0: without the debug information Python's own CFLAGS ask for (it is most of the module's size). The module
    # is named by its build key, as the fallback's build is (bindings.cpp).
    extension = cpp_extension.CppExtension(
        f"attnkit.backends.{sources.MODULE}", [str(p.relative_to(ROOT)) for p in sources.sources()],
        extra_compile_args=[*cflags, "-g0", f"-DATTNKIT_BAND_MODULE={sources.module_name(key)}"],
        extra_link_args=sources.LDFLAGS,
        optional=True)  # so that an editable install copies the module beside the sources only if it was built
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildKernel}}


setup(**_kernel())
