"""Writing a file whole: readers see the old contents or the new, never a part, as ``torch.save`` would leave it.

:func:`write_atomically` writes into a new file beside the target and renames it
over the target, so that a crash mid-write leaves the old file intact. Done
naively, the rename would also change what ``torch.save(obj, path)`` keeps: the
file's mode (a temporary file is private, ``0600``) and a symbolic link (the
link itself would be replaced by a plain file, leaving its target stale). So the
new file gets the mode ``torch.save`` would give it (the existing file's mode, or
``0666`` less the umask for a new file, as ``open`` creates it), and a link is
followed to its final target, which is replaced in its own folder. A target that
is not a regular file (a device such as ``/dev/null``, a pipe) is written in
place, as ``torch.save`` writes it: it cannot be replaced.

One difference from writing in place remains: the target becomes a new file, so
other hard links to the old one keep the old contents, and its owner becomes
the writing user (its group is kept where the user may set it).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
from collections.abc import Callable
from typing import IO

__all__ = ["write_atomically"]


def _create_beside(target: str) -> tuple[int, str]:
    """A new empty file in ``target``'s folder, created with mode 0666 less the umask (as ``open`` would)."""
    folder, name = os.path.split(target)
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:  # a name collision (a 48-bit random name): draw again
            continue


def _keep_mode(fd: int, tmp: str, st: os.stat_result) -> None:
    """Give the new file ``fd`` (at ``tmp``) the old file's group, where the user may, then its mode."""
    if hasattr(os, "fchown"):  # POSIX
        with contextlib.suppress(OSError):  # a group the user is not in
            os.fchown(fd, -1, st.st_gid)
    if hasattr(os, "fchmod"):  # after the group: changing it may clear the set-group-ID bit
        os.fchmod(fd, stat.S_IMODE(st.st_mode))
    else:
        os.chmod(tmp, stat.S_IMODE(st.st_mode))


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write`` on a new file (readable, writable, seekable) that then replaces ``path`` whole.

    ``path`` may be a symbolic link (or a chain of them): its final target is
    replaced, and the links stay. The file keeps the target's mode, or gets
    ``0666`` less the umask if it is new. If ``write`` raises, the new file is
    removed and ``path`` is left as it was.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> real, link = os.path.join(folder, "real.txt"), os.path.join(folder, "latest.txt")
        >>> with open(real, "w") as fh:
        ...     _ = fh.write("old")
        >>> os.chmod(real, 0o640); os.symlink("real.txt", link)
        >>> write_atomically(link, lambda fh: fh.write(b"new"))
        >>> open(real).read(), os.path.islink(link), oct(os.stat(real).st_mode & 0o777)
        ('new', True, '0o640')
    """
    target = os.path.realpath(path)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        buffer = io.BytesIO()  # a device or a pipe may not seek: ``write`` gets a buffer, copied in one go
        write(buffer)
        with open(target, "wb") as fh:
            fh.write(buffer.getbuffer())
        return
    fd, tmp = _create_beside(target)
    try:
        with os.fdopen(fd, "w+b") as fh:
            if st is not None:
                _keep_mode(fh.fileno(), tmp, st)
            write(fh)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
