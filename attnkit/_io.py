"""Writing output files whole or not at all, into folders no one else can write into.

A page or picture is written to a temporary file beside its destination and renamed over it
(``os.replace``, atomic on POSIX and Windows), so a failure half-way (a bad character, a full
disk, an interrupt) leaves the previous file, or none, never a truncated one; and a link planted
under the destination's name is replaced, never written through. :func:`own_folder` checks an
output folder before anything is written: a folder someone else owns, or may write into, can have
its files replaced or links planted in it at any moment.
"""

from __future__ import annotations

import os
import stat
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


def own_folder(path: str | Path, what: str = "folder") -> Path:
    """``path`` as a folder to write into: created if missing, else checked to be the user's own.

    A missing folder is created (with its parents), writable by its owner and group only. An
    existing one must be a folder (or a link, owned by the user, to one) that the user owns and
    that other users cannot write into; a folder whose group may write is accepted when the group
    is the user's own (the usual ``umask 002`` setup), as is any folder where the system has no
    user ids (Windows).

    Args:
        path: the folder; its ``..`` parts are worked out first (see :func:`_without_dotdot`).
        what: how messages name it, e.g. ``"--out"``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, absolute when it had ``..`` parts.

    Raises:
        ValueError: a dangling link, something other than a folder, or a folder (or link) owned
            by another user or writable by others; the message names it and says what it is.
        OSError: the folder cannot be created.
    """
    path = _without_dotdot(Path(path))
    me = os.getuid() if hasattr(os, "getuid") else None
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o775)  # less the umask; never writable by others
        return path
    if stat.S_ISLNK(link.st_mode):
        target = os.readlink(path)
        if not path.exists():
            raise ValueError(f"{what} {path} is a symbolic link to {target}, which does not exist; "
                             "pass a folder, or remove the link")
        if me is not None and link.st_uid != me:
            raise ValueError(f"{what} {path} is a symbolic link (to {target}) owned by {_user(link.st_uid)}, "
                             "not by you: whoever owns it chooses where files go; pass a folder of your own")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {path} is {_kind(st.st_mode)}, not a folder")
    if me is None:
        return path
    if st.st_uid != me:
        raise ValueError(f"{what} {path} is a folder owned by {_user(st.st_uid)}, not by you: its owner can "
                         "replace what is written there; pass a folder of your own")
    group_may = st.st_mode & stat.S_IWGRP and st.st_gid != os.getgid()
    if st.st_mode & stat.S_IWOTH or group_may:
        who = "every user" if st.st_mode & stat.S_IWOTH else f"group {st.st_gid}"
        way_out = "pass a folder of your own" if st.st_mode & stat.S_ISVTX else f"chmod o-w,g-w {path}, or pass another"
        raise ValueError(f"{what} {path} is a folder {who} may write into (mode {stat.S_IMODE(st.st_mode):o}): "
                         f"they could replace its files or plant links in it; {way_out}")
    return path


def _without_dotdot(path: Path) -> Path:
    """``path`` with its ``..`` parts worked out before anything is created: as the system follows them where
    the folders exist (after a link, to its target's parent) and by name where they do not, where the system
    would stop (``W/new/../out`` is ``W/out``, and ``W/new`` is not made). The parts after the last ``..``
    are kept as they are, so that a link among them is still checked, not followed."""
    parts = path.parts
    if ".." not in parts:
        return path
    last = len(parts) - 1 - parts[::-1].index("..")
    return Path(os.path.realpath(Path(*parts[: last + 1]))).joinpath(*parts[last + 1:])


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "something other than a file"
