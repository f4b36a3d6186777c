"""Load a C++ extension built at install, or compile it once per cache key into a private cache, and load
either back safely.

:func:`load_installed` imports a module that ``setup.py`` built beside attnkit's sources once its build
record names the build key this process needs (sources, torch version, CPU, flags) and the module's bytes
match the SHA-256 recorded beside them; else it raises :class:`BuildError` saying why (not installed, built
for another torch, ...). :func:`load`, the fallback, turns source files, their compiler flags and a module
name (which the caller derives from everything that changes the binary) into the imported module, or raises
:class:`BuildError` with a one-line reason. The cache (``$ATTNKIT_CACHE``, default
``~/.cache/attnkit``) may sit in a shared place, so it is treated as hostile until checked:

- the folder is created 0700 and refused if another user owns it or group/others may write to it;
- a build is compiled in a private ``mkdtemp`` folder inside the cache and put in place by
  :func:`attnkit._io.atomic_write` (an ``O_EXCL`` file under an unguessable name, then
  ``os.replace``, which replaces a symlink rather than following it), beside a ``<name>.sha256``
  sidecar written the same way;
- a cached build is read with ``O_NOFOLLOW`` (a symlink is refused), hashed, and only those
  verified bytes are loaded: they are copied into a fresh 0600 file in a private ``mkdtemp``
  folder, so nothing can swap the file between the hash and ``dlopen``. (Loading the cache entry
  in place would lean on the folder check alone; the copy costs a few hundred kB of writes.)
  A missing or wrong checksum, a truncated file or an import error means "rebuild", never a crash;
- the installed module is loaded the same way: read with ``O_NOFOLLOW``, hashed against its build record,
  and the verified bytes imported from a fresh private copy;
- one process builds while the others wait on ``flock`` of ``<name>.lock`` (at most
  :data:`LOCK_WAIT_S`), then take its result;
- a failed build leaves ``<name>.failed`` (time and reason), and for :data:`RETRY_AFTER_S` later
  processes give that reason instead of failing again; a new source, torch or flags is a new name.

``ATTNKIT_BUILD=0`` forbids compiling (a verified cached build is still used); ``ATTNKIT_BUILD=1``
retries a build that failed recently.

A process that is about to block (compile, or wait for another process's compile) says so once through
:func:`warnings.warn` (a :class:`BuildWarning`), with the reason the installed module was not used; the time
the compile took, and the rest, go to :mod:`logging` (logger ``attnkit.backends._build``).

Within a process, modules are imported one at a time (pybind11 3 keeps a completed module per name
and skips the initialisation of a second object made for that name meanwhile: two threads importing
together could get a module with no functions), and :func:`once` makes a lazily built global (a
loaded and self-checked module) once, under a lock, remembering a failure with its reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .._io import atomic_write

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
#: How long a failed build is not retried (unless ``ATTNKIT_BUILD=1``).
RETRY_AFTER_S = 3600
#: How long a process waits for another one's build before giving up (several times what a build takes on 2 cores).
LOCK_WAIT_S = 600

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_IMPORTING = threading.Lock()  # one import of an extension module at a time in this process


class BuildError(RuntimeError):
    """Why the module could not be loaded or built, in one line."""


class BuildWarning(UserWarning):
    """A native kernel is being compiled now, on first use, which blocks the call for minutes (the module built
    at install was missing or built for another torch): the message says why, and how to build it at install."""


def once(build: Callable[[], _T]) -> Callable[[], _T]:
    """``build`` as a lazily built global: run on the first call only, under a lock, so that threads
    making their first call together wait for the one that builds and all get the same object.

    A :class:`BuildError` it raises is remembered: that call and every later one raise a BuildError
    with the same reason (a failed load stays a failure with its reason, never a half-made result,
    and is not tried again in this process). Any other exception is not remembered: the next call
    builds again. ``.cache_clear()`` forgets the outcome, as :func:`functools.cache`'s does.
    """
    lock = threading.RLock()  # (a build that calls itself recurses instead of deadlocking)
    outcome: list[tuple] = []  # [(value, None)] or [(None, reason)] once decided

    @functools.wraps(build)
    def get() -> _T:
        if not outcome:  # (after the first call, no lock: the list is appended to once, when complete)
            with lock:
                if not outcome:
                    try:
                        outcome.append((build(), None))
                    except BuildError as e:
                        outcome.append((None, str(e)))
        value, reason = outcome[0]
        if reason is not None:
            raise BuildError(reason)
        return value

    get.cache_clear = outcome.clear
    return get


def cache_dir() -> Path:
    """``$ATTNKIT_CACHE``, default ``~/.cache/attnkit``."""
    return Path(os.environ.get("ATTNKIT_CACHE") or Path.home() / ".cache" / "attnkit")


def entry(name: str) -> Path:
    """Where the build of module ``name`` is cached."""
    return cache_dir() / f"{name}{SUFFIX}"


def load_installed(path: Path, record: Path, key: str):
    """The module built at install at ``path``, once its build ``record`` (``setup.py`` writes it) names ``key``
    and the SHA-256 of the module's bytes; only those verified bytes are imported (from a private copy).

    Raises:
        BuildError: why not, in a few words (no module there, built for another key, a checksum or import failure).
    """
    from . import _band_sources

    data = check_installed(path, record, key)
    name = _band_sources.module_name(key)  # the module's own name (bindings.cpp), not its file's
    try:
        with tempfile.TemporaryDirectory(prefix="attnkit-load-") as tmp:  # (mkdtemp: 0700, an unguessable name)
            return _import_copy(name, data, Path(tmp) / f"{name}{SUFFIX}")
    except Exception as e:  # a verified build that does not import (a library it needs is gone, a torch ABI break)
        raise BuildError(f"installed {path.name} does not import: {_cause(e)}") from e


def check_installed(path: Path, record: Path, key: str) -> bytes:
    """The bytes of the module built at install at ``path`` once its build ``record`` names ``key`` and their
    SHA-256 (read without following a symlink), else a :class:`BuildError` saying why; nothing is imported."""
    from . import _band_sources

    try:
        data = _read(path)
    except FileNotFoundError:
        raise BuildError(f"no {path.name} installed beside attnkit") from None
    except OSError as e:
        raise BuildError(f"installed {path.name} unreadable: {e.strerror or e}") from None
    try:
        built_key, digest, built_for = _band_sources.parse_record(_read(record))
    except (OSError, UnicodeDecodeError, ValueError, KeyError):
        raise BuildError(f"installed {path.name} has no readable build record ({record.name})") from None
    if built_key != key:
        raise BuildError(f"installed {path.name} was built for other sources, another torch or another CPU "
                         f"({built_for + '; ' if built_for else ''}build key {built_key}; this process, with torch "
                         f"{_torch_version()}, needs {key})")
    if hashlib.sha256(data).hexdigest() != digest:
        raise BuildError(f"installed {path.name} does not match its recorded SHA-256")
    return data


def _torch_version() -> str:
    import torch

    return torch.__version__


def load(name: str, sources: list[Path], cflags: list[str], ldflags: list[str], what: str, why: str = ""):
    """The extension module ``name`` built from ``sources``: from the cache if a verified build is
    there, else compiled now (one process at a time, the sources in parallel) and cached.

    Args:
        name: module name; must change whenever the binary would (sources, torch, flags).
        sources: the C++ translation units.
        cflags, ldflags: extra compiler and linker flags.
        what: the module in words, for the warning and the log.
        why: why the module is compiled here rather than loaded as installed, for the warning.

    Raises:
        BuildError: with a one-line reason (folder refused, ``ATTNKIT_BUILD=0``, a recent failed
            build, the compiler's error, ...).
    """
    policy = os.environ.get("ATTNKIT_BUILD", "")
    folder = cache_dir()
    if policy == "0" and not folder.exists():
        raise BuildError("ATTNKIT_BUILD=0 forbids compiling it")
    try:
        _private_folder(folder)
        mod, missing = _load_cached(name)
        if mod is not None:
            return mod
        if policy == "0":
            raise BuildError(f"ATTNKIT_BUILD=0 forbids compiling it ({missing})")
        _not_failed_recently(name, policy)
        with _lock(folder / f"{name}.lock", what, why) as waited:
            mod, _ = _load_cached(name)  # built by the process we waited for
            if mod is not None:
                return mod
            _not_failed_recently(name, policy)
            return _build(name, sources, cflags, ldflags, what, None if waited else why)
    except BuildError:
        raise
    except Exception as e:  # whatever else goes wrong, the caller falls back instead of crashing
        raise BuildError(f"{type(e).__name__}: {_cause(e)}") from e


def _private_folder(folder: Path) -> None:
    """Create ``folder`` 0700, and refuse it unless it is this user's and nobody else may write in it."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(folder)
    except OSError as e:
        raise BuildError(f"cannot use cache folder {folder}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise BuildError(f"cache folder {folder} is not a folder")
    if st.st_uid != os.geteuid():
        raise BuildError(f"cache folder {folder} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}); "
                         "set ATTNKIT_CACHE to a folder of yours")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BuildError(f"cache folder {folder} may be written by group or others (mode {st.st_mode & 0o777:o}); "
                         "chmod 700 it or set ATTNKIT_CACHE to a private folder")


def _read(path: Path) -> bytes:
    """A regular file's bytes, refusing a symlink (``O_NOFOLLOW``: ELOOP) or anything but a file
    (``O_NONBLOCK``: a FIFO planted at the name must not hang the open)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read()


def _load_cached(name: str):
    """(module, None) from a verified cache entry, else (None, why not)."""
    path = entry(name)
    try:
        data = _read(path)
    except FileNotFoundError:
        return None, "not built yet"
    except OSError as e:
        return None, f"cached build unreadable: {e.strerror or e}"
    try:
        recorded = _read(path.with_name(f"{name}.sha256")).decode().strip()
    except (OSError, UnicodeDecodeError):
        recorded = None
    if hashlib.sha256(data).hexdigest() != recorded:
        return None, "cached build does not match its recorded SHA-256"
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".load-") as tmp:
            return _import_copy(name, data, Path(tmp) / path.name), None
    except Exception as e:  # a verified build that does not import (e.g. a library it needs is gone)
        return None, f"cached build does not import: {_cause(e)}"


def _import_copy(name: str, data: bytes, copy: Path):
    """Module ``name`` imported from ``data`` written to ``copy`` (a new 0600 file in a private folder): what is
    imported is exactly the bytes that were verified."""
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return _import(name, copy)


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    with _IMPORTING:  # made and initialised before another import of the name may start (see the top)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _lock(path: Path, what: str, why: str):
    """Hold ``path``'s flock; yields whether it had to wait for another process (which then warned)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    waited = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = True
            _warn(f"{_clause(why)}waiting for another process's build of {what} (up to {LOCK_WAIT_S // 60} min)")
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                time.sleep(0.2)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise BuildError(f"gave up after {LOCK_WAIT_S} s waiting for another process's build "
                                         f"(lock {path})") from None
        yield waited
    finally:
        os.close(fd)  # releases the lock; the file stays (unlinking it would let two holders in)


def _not_failed_recently(name: str, policy: str) -> None:
    """Raise the remembered reason if building ``name`` failed less than RETRY_AFTER_S ago."""
    if policy == "1":
        return
    try:
        stamp, _, reason = _read(cache_dir() / f"{name}.failed").decode().strip().partition(" ")
        age = time.time() - float(stamp)
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if 0 <= age < RETRY_AFTER_S:
        raise BuildError(f"{reason} (remembered from a build {age / 60:.0f} min ago; not retried for "
                         f"{RETRY_AFTER_S // 60} min, ATTNKIT_BUILD=1 retries now)")


def _build(name: str, sources: list[Path], cflags: list[str], ldflags: list[str], what: str, why: str | None):
    """Compile in a private folder inside the cache, record the SHA-256, install both; remember a failure.
    ``why``: the warning's reason (None: this process already warned, while it waited for another's build)."""
    path = entry(name)
    if why is not None:
        _warn(f"{_clause(why)}compiling {what} for this machine now, once for this torch and CPU ({len(sources)} "
              f"files in parallel, MAX_JOBS at a time if set: minutes on 2 cores) -> {path}")
    else:
        logger.info("compiling %s for this machine -> %s", what, path)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        try:
            mod, made = _compile(name, sources, cflags, ldflags, Path(tmp))
        except Exception as e:
            reason = _cause(e)
            note = f"{time.time():.0f} {reason}\n".encode()
            atomic_write(path.with_name(f"{name}.failed"), lambda f: f.write(note))
            raise BuildError(reason) from e
        data = made.read_bytes()
    atomic_write(path, lambda f: f.write(data))
    digest = f"{hashlib.sha256(data).hexdigest()}\n".encode()
    atomic_write(path.with_name(f"{name}.sha256"), lambda f: f.write(digest))
    path.with_name(f"{name}.failed").unlink(missing_ok=True)
    logger.warning("attnkit: compiled %s in %.0f s -> %s", what, time.perf_counter() - start, path)
    return mod


def _clause(why: str) -> str:
    return f"{why}; " if why else ""


def _warn(message: str) -> None:
    """The one warning of a blocking build, pointed at the user's call rather than at this file."""
    warnings.warn(f"attnkit: {message}", BuildWarning, stacklevel=_outside_attnkit())


def _outside_attnkit() -> int:
    """The stacklevel of the nearest frame outside attnkit (and torch), for a warning the user can place."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("attnkit", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def _compile(name: str, sources: list[Path], cflags: list[str], ldflags: list[str], folder: Path):
    """(imported module, path of the built library), built in ``folder`` by torch's cpp_extension."""
    from torch.utils import cpp_extension

    # torch logs a multi-line banner for an unexpected compiler; the one line that matters is the error
    cpp_logger = logging.getLogger(cpp_extension.__name__)
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = cpp_extension.load(name, [str(s) for s in sources], extra_cflags=cflags, extra_ldflags=ldflags,
                                     build_directory=str(folder), verbose=False)
    finally:
        cpp_logger.setLevel(level)
    return mod, next(folder.glob(f"{name}*.so"))


def _cause(e: BaseException) -> str:
    """The line of an error that says what went wrong: the compiler's first ``error:``, a shell's
    ``not found``, else the last line that is not ninja's summary."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for marker in ("error:", "not found", "No such file"):
        hit = next((line for line in lines if marker in line), None)
        if hit is not None:
            return hit[:300]
    lines = [line for line in lines if not line.startswith("ninja: build stopped")]
    return lines[-1][:300] if lines else type(e).__name__
