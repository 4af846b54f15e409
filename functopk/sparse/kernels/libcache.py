"""A private, verified on-disk cache for a small C library compiled at first use.

:mod:`~functopk.sparse.kernels.native` compiles its scan once per machine and
loads it in every process. A shared library runs code when it is loaded, so a
file found in the cache is loaded only if no other user could have written it
and it is the file this user's build wrote:

* **Where:** ``$FUNCTOPK_CACHE_DIR``, else ``$XDG_CACHE_HOME/functopk``, else
  ``~/.cache/functopk``. An empty variable counts as unset (never the current
  directory), and so does a relative ``XDG_CACHE_HOME``, as the XDG spec says;
  a relative ``FUNCTOPK_CACHE_DIR`` is taken from the current directory. A
  home folder that is not an absolute path is not used (a private build, below).
* **The folder** (and any missing folder above it) is created with mode
  ``0700`` whatever the umask. It is used only if it is a directory, not a
  symbolic link, owned by the current user and not writable by group or
  others. Otherwise (or if it cannot be created) the library is compiled into
  a private temporary folder (:func:`tempfile.mkdtemp`), loaded from there
  and the folder deleted: safe, but every process compiles again, so the
  caller warns.
* **The file** ``<stem>-<key>.so`` (the key hashes the source, the compiler
  command with its flags and the platform) is loaded only if it is a regular
  file, not a link, owned by the user, not writable by group or others, and its
  SHA-256 equals the one its build wrote beside it (``<name>.sha256``). Anything
  else (absent, truncated, garbage, another mode) is rebuilt, never loaded.
  The file is opened without following links, checked through that open
  descriptor and loaded from it (``/proc/self/fd/N`` where the system has it),
  so the bytes checked are the bytes loaded.
* **Building** happens under an exclusive lock on ``<name>.lock`` (``flock``,
  released by the kernel if the process dies), so that processes starting
  together compile once, not once each: the first compiles into a temporary
  folder inside the cache and moves the library and its digest in with
  :func:`os.replace`; the others wait, then load its result.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["BuildError", "UntrustedCache", "cache_dir", "compiler_command", "load"]

FORMAT = "functopk-libcache-1"  # in the key: a new layout never reads an old one's files
TIMEOUT_S = 120
_KEPT_OPEN: list[int] = []  # descriptors of the libraries loaded from the cache (see _from_cache)


class BuildError(RuntimeError):
    """The library cannot be built or loaded; the message says why and what to do."""


class UntrustedCache(RuntimeError):
    """The cache folder cannot be used safely; the message names it, says why and how to fix it."""


def cache_dir() -> Path:
    """The cache folder the environment names (see the module's docstring); nothing is created.

    Raises :class:`UntrustedCache` where no variable names one and the home
    folder is unknown.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"FUNCTOPK_CACHE_DIR": "", "XDG_CACHE_HOME": "/var/cache/me"}):
        ...     str(cache_dir())
        '/var/cache/me/functopk'
    """
    if os.environ.get("FUNCTOPK_CACHE_DIR"):
        return Path(os.path.abspath(os.environ["FUNCTOPK_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "functopk"
    home = os.path.expanduser("~")  # HOME, else the user database; a relative HOME is refused below
    if not os.path.isabs(home):
        raise UntrustedCache(f"no cache folder: the home folder {home!r} is not an absolute path; set "
                             "FUNCTOPK_CACHE_DIR to a folder only you can write")
    return Path(home) / ".cache" / "functopk"


def compiler_command() -> list[str]:
    """``$CC`` (default ``cc``) split as a shell would (``CC='gcc -O2'`` works); ``BuildError`` if unusable.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"CC": "env cc '-DNAME=a b'"}):
        ...     compiler_command()
        ['env', 'cc', '-DNAME=a b']
    """
    text = os.environ.get("CC", "")
    try:
        command = shlex.split(text) or ["cc"]
    except ValueError as exc:
        raise BuildError(f"CC={text!r} is not a valid command line ({exc}); fix or unset CC") from None
    if shutil.which(command[0]) is None:
        raise BuildError(f"no C compiler: {command[0]!r} (from CC={text!r}) is not found" if text else
                         "no C compiler: 'cc' is not found; install one or set CC")
    return command


def _key(source: bytes, command: Sequence[str]) -> str:
    """Names the library: the source, the command (flags included), the compiler's path and the platform."""
    h = hashlib.sha256()
    compiler = os.path.realpath(shutil.which(command[0]) or command[0])
    for part in (FORMAT.encode(), source, *(c.encode() for c in (*command, compiler, sys.platform,
                                                                   platform.machine()))):
        h.update(len(part).to_bytes(8, "little") + part)  # length-prefixed: fields cannot run into each other
    return h.hexdigest()[:24]


def _unsafe(st: os.stat_result, what: str) -> str | None:
    """Why a file or folder with status ``st`` might have been written by someone else, or ``None``."""
    if st.st_uid != os.geteuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


def _fd_path(fd: int, fallback: str) -> str:
    """A path that names the open file ``fd`` itself where the system has ``/proc/self/fd``, else ``fallback``."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else fallback


def _make_private(folder: Path) -> None:
    """Create ``folder`` and any missing folder above it, each with mode 0700 whatever the umask."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another process made it meanwhile: the caller checks the last one
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o700)  # the umask may have taken bits away; never adds any
        finally:
            os.close(fd)


def _open_cache(folder: Path) -> int:
    """A descriptor of the cache folder, created if absent; ``UntrustedCache`` unless it is safe to use."""
    fix = f"make it yours and private (chmod 700 {folder}) or set FUNCTOPK_CACHE_DIR to a folder only you can write"
    try:
        _make_private(folder)
        if stat.S_ISLNK(os.lstat(folder).st_mode):
            raise UntrustedCache(f"the cache folder {folder} is a symbolic link; set FUNCTOPK_CACHE_DIR to the "
                                 "folder it points to, if that folder is yours")
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UntrustedCache(f"the cache folder {folder} cannot be created or opened ({type(exc).__name__}: "
                             f"{exc}); set FUNCTOPK_CACHE_DIR to a folder you can write") from None
    reason = _unsafe(os.fstat(fd), f"the cache folder {folder}")
    if reason:
        os.close(fd)
        raise UntrustedCache(f"{reason}; {fix}")
    return fd


def _read_checked(dir_fd: int, name: str) -> tuple[int, bytes] | None:
    """An open descriptor of the file ``name`` in the folder and its bytes, if it passes the checks, else ``None``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:  # absent, or a symbolic link (ELOOP)
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or _unsafe(st, name):
        os.close(fd)
        return None
    with open(fd, "rb", closefd=False) as fh:
        return fd, fh.read()


def _verified(dir_fd: int, name: str) -> int | None:
    """A descriptor of the library ``name`` if it and its digest pass every check (module docstring), else ``None``."""
    lib = _read_checked(dir_fd, name)
    if lib is None:
        return None
    digest = _read_checked(dir_fd, name + ".sha256")
    if digest is not None:
        os.close(digest[0])
    if digest is None or digest[1].strip() != hashlib.sha256(lib[1]).hexdigest().encode():
        os.close(lib[0])
        return None
    return lib[0]


def _compile(source: bytes, command: Sequence[str], folder: str) -> str:
    """Compile ``source`` in ``folder`` (private to this user); the library's path, mode 0700."""
    src, out = os.path.join(folder, "lib.c"), os.path.join(folder, "lib.so")
    with open(src, "wb") as fh:
        fh.write(source)
    try:
        subprocess.run([*command, src, "-o", out], check=True, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        tail = exc.stderr.decode(errors="replace").strip()[-600:]
        raise BuildError(f"{shlex.join(command)} failed with exit code {exc.returncode}: {tail}") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{shlex.join(command)} could not run ({type(exc).__name__}: {exc})") from None
    os.chmod(out, 0o700)  # the compiler honours the umask: 0777 under umask 000
    return out


@contextlib.contextmanager
def _locked(dir_fd: int, name: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<name>.lock`` in the cache (none where the filesystem has no locks)."""
    import fcntl  # POSIX only: this module is not used on Windows

    fd = os.open(name + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with contextlib.suppress(OSError):  # e.g. ENOLCK on a network filesystem: os.replace alone stays safe
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _build_into(folder: Path, dir_fd: int, name: str, source: bytes, command: Sequence[str]) -> None:
    """Compile the library and move it and its digest into the cache under ``name``, each atomically."""
    with tempfile.TemporaryDirectory(prefix=".build-", dir=_fd_path(dir_fd, str(folder))) as tmp:
        out = _compile(source, command, os.path.realpath(tmp))  # the compiler cannot see this process's fds
        with open(out, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
        sidecar = os.path.join(tmp, "lib.so.sha256")
        with open(os.open(sidecar, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as fh:
            fh.write(digest + "\n")
        # a reader in between sees a new library with an old digest (or the reverse): a mismatch, so it waits
        # for this build's lock and reads both again
        os.replace(out, name, dst_dir_fd=dir_fd)
        os.replace(sidecar, name + ".sha256", dst_dir_fd=dir_fd)


def _from_cache(folder: Path, dir_fd: int, name: str, source: bytes, command: Sequence[str]) -> ctypes.CDLL:
    """The library ``name`` from the cache: loaded if verified, else built once (under the lock) and loaded."""
    fd = _verified(dir_fd, name)
    if fd is None:
        try:
            with _locked(dir_fd, name):
                fd = _verified(dir_fd, name)  # another process may have built it while this one waited
                if fd is None:
                    _build_into(folder, dir_fd, name, source, command)
                    fd = _verified(dir_fd, name)
        except OSError as exc:  # not the build's own errors (BuildError): the folder refuses writes
            raise UntrustedCache(f"the cache folder {folder} cannot be written ({type(exc).__name__}: {exc}); "
                                 "set FUNCTOPK_CACHE_DIR to a folder you can write") from None
    if fd is None:
        raise BuildError(f"the library just built into {folder} does not pass its checks (was it changed "
                         "meanwhile?)")
    try:
        lib = ctypes.CDLL(_fd_path(fd, str(folder / name)))
    except OSError as exc:
        os.close(fd)
        # the file is the one the build wrote (its digest matched): the folder's filesystem is the likely cause
        raise BuildError(f"{folder / name} could not be loaded ({exc}); if its filesystem forbids running code "
                         "(noexec), set FUNCTOPK_CACHE_DIR to a folder on another one") from None
    # the loader remembers a library by the name it was loaded under and hands the same library out for that
    # name again: the descriptor stays open, so that no later library gets its /proc/self/fd name
    _KEPT_OPEN.append(fd)
    return lib


def _private(source: bytes, command: Sequence[str]) -> ctypes.CDLL:
    """Compile into a new private temporary folder, load, and delete the folder (the loaded code stays mapped)."""
    tmp = tempfile.mkdtemp(prefix="functopk-")
    try:
        out = _compile(source, command, tmp)
        try:
            return ctypes.CDLL(out)
        except OSError as exc:
            raise BuildError(f"the library built in {tmp} could not be loaded ({exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(source: bytes, stem: str, command: Sequence[str]) -> tuple[ctypes.CDLL, str | None]:
    """The library compiled from ``source`` by ``command + [src, "-o", out]``, through the cache.

    Returns the loaded library and ``None``, or, where the cache folder cannot
    be trusted, a library built in a private temporary folder and the reason
    (an :class:`UntrustedCache` message naming the folder and the fix). Raises
    :class:`BuildError` when the library cannot be built or loaded.

    Example:
        >>> os.environ["FUNCTOPK_CACHE_DIR"] = folder = tempfile.mkdtemp()
        >>> try:
        ...     lib, note = load(b"int answer(void) { return 42; }", "doc", [*compiler_command(), "-shared", "-fPIC"])
        ...     assert (lib.answer(), note) == (42, None)
        ...     assert sorted(p.suffix for p in Path(folder).iterdir()) == [".lock", ".sha256", ".so"]
        ... except BuildError as exc:  # no C compiler here
        ...     assert "compiler" in str(exc)
        >>> del os.environ["FUNCTOPK_CACHE_DIR"]; shutil.rmtree(folder)
    """
    name = f"{stem}-{_key(source, command)}.so"
    try:
        folder = cache_dir()
        dir_fd = _open_cache(folder)
        try:
            return _from_cache(folder, dir_fd, name, source, command), None
        finally:
            os.close(dir_fd)
    except UntrustedCache as exc:
        return _private(source, command), str(exc)
