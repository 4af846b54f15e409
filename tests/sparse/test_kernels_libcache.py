"""functopk.sparse.kernels.libcache: a cached library is loaded only if it is safe, damage is rebuilt, one build.

A tiny C library stands in for the scan (it compiles in a few hundredths of a second); the compiler is a
shell script around ``cc`` that counts its runs. A spy on ``ctypes.CDLL`` records which files are loaded
and refuses planted ones instead of loading them, so a regression fails here rather than crashing the run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from functopk.sparse.kernels import libcache

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

SOURCE = b"int answer(void) { return 42; }\n"
ROOT = os.geteuid() == 0


@pytest.fixture()
def cc(tmp_path):
    """A compiler command whose runs are counted: ``cc.runs()``; ``cc.command(delay)`` sleeps before compiling."""
    log = tmp_path / "cc.log"
    script = tmp_path / "cc.sh"
    script.write_text(f'#!/bin/sh\necho run >> "{log}"\nsleep "$1"\nshift\nexec cc "$@"\n')

    class Compiler:
        @staticmethod
        def command(delay: float = 0.0) -> list[str]:
            return ["sh", str(script), str(delay), "-shared", "-fPIC"]

        @staticmethod
        def runs() -> int:
            return len(log.read_text().splitlines()) if log.exists() else 0

    return Compiler


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "home" / "cache"
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(folder))
    return folder


@pytest.fixture()
def loaded(monkeypatch):
    """The inodes ``ctypes.CDLL`` was asked to load; loading one of ``loaded.planted`` fails the test instead."""
    real = ctypes.CDLL
    inodes: list[int] = []
    planted: set[int] = set()

    def spy(path, *args, **kwargs):
        inode = os.stat(path).st_ino
        inodes.append(inode)
        if inode in planted:
            pytest.fail(f"a planted library was loaded: {path}")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", spy)
    spy.inodes, spy.planted = inodes, planted
    return spy


def library_file(folder: Path) -> Path:
    (so,) = folder.glob("*.so")
    return so


def test_first_use_makes_a_private_folder_whatever_the_umask_and_later_uses_load_the_file(cache, cc):
    old = os.umask(0)  # as in many containers: without the explicit modes everything would be world-writable
    try:
        lib, note = libcache.load(SOURCE, "t", cc.command())
    finally:
        os.umask(old)
    assert lib.answer() == 42 and note is None and cc.runs() == 1
    for folder in (cache, cache.parent):  # the missing parent was created private too
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    so = library_file(cache)
    modes = {p.name.removeprefix(so.name): stat.S_IMODE(p.stat().st_mode) for p in cache.iterdir()}
    assert modes == {"": 0o700, ".sha256": 0o600, ".lock": 0o600}
    assert (cache / (so.name + ".sha256")).read_text().strip() == hashlib.sha256(so.read_bytes()).hexdigest()
    assert libcache.load(SOURCE, "t", cc.command())[0].answer() == 42
    assert cc.runs() == 1  # the second use loaded the verified file


def test_concurrent_first_use_builds_once(cache, cc):
    results: list[int] = []

    def use():
        results.append(libcache.load(SOURCE, "t", cc.command(delay=0.3))[0].answer())

    threads = [threading.Thread(target=use) for _ in range(4)]  # flock is per open file: threads contend too
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [42] * 4
    assert cc.runs() == 1


def test_the_name_covers_the_source_and_the_command_and_each_library_loads(cache, cc):
    answers = [libcache.load(SOURCE, "t", cc.command())[0].answer(),
               libcache.load(SOURCE, "t", [*cc.command(), "-O2"])[0].answer(),
               libcache.load(SOURCE.replace(b"42", b"43"), "t", cc.command())[0].answer()]
    assert len(list(cache.glob("*.so"))) == 3 and cc.runs() == 3
    assert answers == [42, 42, 43]  # the third is not mistaken for the first (the loader's memory of names)


def rewrite(so: Path, data: bytes) -> None:
    """Put ``data`` under ``so``'s name as a new file (this process may have the old one mapped)."""
    so.with_name("new").write_bytes(data)
    os.replace(so.with_name("new"), so)


def truncate(so: Path) -> None:
    rewrite(so, so.read_bytes()[:4000])  # loading this would kill the process with SIGBUS


DAMAGE = {
    "truncated": truncate,
    "garbage": lambda so: rewrite(so, b"\x7fELF not really a library"),
    "no digest": lambda so: so.with_name(so.name + ".sha256").unlink(),
    "wrong digest": lambda so: so.with_name(so.name + ".sha256").write_text("0" * 64 + "\n"),
    "writable by others": lambda so: so.chmod(0o666),
    "writable by the group": lambda so: so.chmod(0o620),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_exposed_library_is_rebuilt_not_loaded(cache, cc, loaded, damage):
    libcache.load(SOURCE, "t", cc.command())
    so = library_file(cache)
    DAMAGE[damage](so)
    loaded.planted.add(so.stat().st_ino)
    lib, note = libcache.load(SOURCE, "t", cc.command())
    assert lib.answer() == 42 and note is None
    assert cc.runs() == 2
    assert stat.S_IMODE(so.stat().st_mode) == 0o700
    assert (cache / (so.name + ".sha256")).read_text().strip() == hashlib.sha256(so.read_bytes()).hexdigest()


def test_a_symbolic_link_in_the_cache_is_replaced_not_followed(cache, cc, loaded, tmp_path):
    libcache.load(SOURCE, "t", cc.command())
    so = library_file(cache)
    elsewhere = tmp_path / "elsewhere.so"  # a valid library with a valid digest: only the link is wrong
    shutil.copy(so, elsewhere)
    so.unlink()
    so.symlink_to(elsewhere)
    loaded.planted.add(elsewhere.stat().st_ino)
    assert libcache.load(SOURCE, "t", cc.command())[0].answer() == 42
    assert not so.is_symlink() and cc.runs() == 2
    assert elsewhere.read_bytes() != b"" and elsewhere.stat().st_mode & 0o777 != 0  # the target was left alone


def plant(folder: Path, cc, loaded) -> list[str]:
    """A library with a matching digest in ``folder`` (built there, then truncated); the folder's listing."""
    libcache.load(SOURCE, "t", cc.command())
    so = library_file(folder)
    truncate(so)
    so.with_name(so.name + ".sha256").write_text(hashlib.sha256(so.read_bytes()).hexdigest() + "\n")
    loaded.planted.add(so.stat().st_ino)
    loaded.inodes.clear()
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=oct)
def test_a_folder_others_can_write_is_not_used(cache, cc, loaded, mode):
    listing = plant(cache, cc, loaded)
    cache.chmod(mode)
    lib, note = libcache.load(SOURCE, "t", cc.command())
    assert lib.answer() == 42 and cc.runs() == 2  # built again, privately
    assert f"{cache} is writable by group or others" in note and f"chmod 700 {cache}" in note
    assert sorted(os.listdir(cache)) == listing  # nothing written there
    assert loaded.inodes and not set(loaded.inodes) & loaded.planted


def test_a_folder_that_is_a_symbolic_link_is_not_used(tmp_path, monkeypatch, cc, loaded):
    real = tmp_path / "real"
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(real))
    plant(real, cc, loaded)
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(tmp_path / "link"))
    (tmp_path / "link").symlink_to(real)
    lib, note = libcache.load(SOURCE, "t", cc.command())
    assert lib.answer() == 42 and "is a symbolic link" in note and cc.runs() == 2


def test_a_folder_that_cannot_be_created_builds_privately(tmp_path, monkeypatch, cc):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", str(tmp_path / "file" / "cache"))
    lib, note = libcache.load(SOURCE, "t", cc.command())
    assert lib.answer() == 42 and "cannot be created" in note and "FUNCTOPK_CACHE_DIR" in note


@pytest.mark.skipif(not ROOT, reason="only root can give a file to another user")
def test_files_and_folders_of_another_user_are_not_trusted(cache, cc, loaded):
    listing = plant(cache, cc, loaded)
    so = library_file(cache)
    for path in (so, so.with_name(so.name + ".sha256")):
        os.chown(path, 4321, 4321)
    assert libcache.load(SOURCE, "t", cc.command())[0].answer() == 42 and cc.runs() == 2  # rebuilt over it
    loaded.planted.add(so.stat().st_ino)
    os.chown(cache, 4321, 4321)
    lib, note = libcache.load(SOURCE, "t", cc.command())
    assert "owned by uid 4321" in note and cc.runs() == 3 and sorted(os.listdir(cache)) == listing


def test_a_failed_build_says_why(cache):
    with pytest.raises(libcache.BuildError, match="exit code 1: .*error"):
        libcache.load(b"this is not C", "t", ["cc", "-shared", "-fPIC"])
    assert not list(cache.glob("*.so")) and not list(cache.glob(".build-*"))


def test_the_cache_folder_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", "")  # empty: unset, never the current directory
    assert libcache.cache_dir() == tmp_path / "xdg" / "functopk"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG spec: a relative path is ignored
    assert libcache.cache_dir() == Path.home() / ".cache" / "functopk"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", "mine")
    assert libcache.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("FUNCTOPK_CACHE_DIR", "")
    monkeypatch.setenv("HOME", "relative")  # not the current directory either
    with pytest.raises(libcache.UntrustedCache, match="the home folder 'relative' is not an absolute path"):
        libcache.cache_dir()


def test_without_a_home_folder_the_library_is_built_privately(monkeypatch, tmp_path, cc):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FUNCTOPK_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "relative")
    lib, note = libcache.load(SOURCE, "t", cc.command())
    assert lib.answer() == 42 and "home folder" in note
    assert sorted(os.listdir(tmp_path)) == ["cc.log", "cc.sh"]  # nothing in the current directory


def test_the_compiler_command_is_split_like_a_shell_command(monkeypatch):
    cc = shutil.which("cc")
    monkeypatch.setenv("CC", f"{cc} -O2 '-DNAME=a b'")
    assert libcache.compiler_command() == [cc, "-O2", "-DNAME=a b"]
    monkeypatch.setenv("CC", "")
    assert libcache.compiler_command() == ["cc"]
    monkeypatch.setenv("CC", "cc '-O2")
    with pytest.raises(libcache.BuildError, match="CC=\"cc '-O2\" is not a valid command line"):
        libcache.compiler_command()
    monkeypatch.setenv("CC", "no-such-cc -O2")
    with pytest.raises(libcache.BuildError, match="no C compiler: 'no-such-cc'"):
        libcache.compiler_command()


def test_a_truncated_library_in_the_cache_does_not_kill_a_new_process(cache, cc):
    """Without the checks, dlopen of the truncated file dies of SIGBUS: run it in a process of its own."""
    libcache.load(SOURCE, "t", cc.command())
    truncate(library_file(cache))
    script = (  # this module alone (it imports nothing from functopk): no torch import, a fast child
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('libcache', {libcache.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(m.load({SOURCE!r}, 't', {cc.command()!r})[0].answer())\n"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "42" and cc.runs() == 2
