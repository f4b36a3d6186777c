"""Writing output files whole or not at all.

A page or picture is written to a temporary file beside its destination and renamed over it
(``os.replace``, atomic on POSIX and Windows), so a failure half-way (a bad character, a full
disk, an interrupt) leaves the previous file, or none, never a truncated one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> Path:
    """Call ``write(f)`` on a binary file that replaces ``path`` once ``write`` returns.

    Args:
        path: the destination; its folder must exist.
        write: fills the file, e.g. ``lambda f: fig.savefig(f, format="png")`` or
            ``lambda f: f.write(data)``. Encode text before the call, so an unencodable
            character fails before anything is written.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        Whatever ``write`` or the file system raises; ``path`` is then left as it was and the
        temporary file is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    # os.open with mode 0o666 lets the umask decide the permissions, as a plain open() does;
    # tempfile's files are 0o600 and would stay so after the rename.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
