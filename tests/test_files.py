"""functopk.files: a file replaced whole keeps what torch.save keeps (its mode, its links), or is left as it was."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from functopk.files import write_atomically


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def write(data: bytes):
    return lambda fh: fh.write(data)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077, 0o000], ids=oct)
def test_a_new_file_gets_the_mode_open_gives_it(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_atomically(tmp_path / "new.pt", write(b"data"))
        with open(tmp_path / "reference.pt", "wb"):  # what torch.save(obj, path) does
            pass
    finally:
        os.umask(old)
    assert mode(tmp_path / "new.pt") == mode(tmp_path / "reference.pt") == 0o666 & ~umask
    assert (tmp_path / "new.pt").read_bytes() == b"data"


@pytest.mark.parametrize("kept", [0o664, 0o600, 0o640, 0o755], ids=oct)
def test_an_existing_file_keeps_its_mode(tmp_path, kept):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")
    path.chmod(kept)
    write_atomically(path, write(b"new"))
    assert mode(path) == kept and path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["state.pt"]  # no temporary file left


def test_a_link_stays_a_link_and_its_target_is_replaced_in_its_own_folder(tmp_path):
    runs, latest = tmp_path / "runs", tmp_path / "latest"
    runs.mkdir(), latest.mkdir()
    real = runs / "step-100.pt"
    real.write_bytes(b"old")
    real.chmod(0o640)
    (runs / "newest.pt").symlink_to("step-100.pt")  # a chain: latest/latest.pt -> ../runs/newest.pt -> step-100.pt
    (latest / "latest.pt").symlink_to(os.path.join("..", "runs", "newest.pt"))
    write_atomically(latest / "latest.pt", write(b"new"))
    assert os.readlink(latest / "latest.pt") == os.path.join("..", "runs", "newest.pt")
    assert os.readlink(runs / "newest.pt") == "step-100.pt"
    assert real.read_bytes() == b"new" and mode(real) == 0o640
    assert sorted(os.listdir(runs)) == ["newest.pt", "step-100.pt"] and os.listdir(latest) == ["latest.pt"]


def test_a_dangling_link_gets_its_target_created(tmp_path):
    (tmp_path / "latest.pt").symlink_to("first.pt")
    write_atomically(tmp_path / "latest.pt", write(b"new"))
    assert (tmp_path / "latest.pt").is_symlink() and (tmp_path / "first.pt").read_bytes() == b"new"


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    def fail(fh):
        fh.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(path, fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["state.pt"]


def test_a_pipe_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_atomically(fifo, lambda fh: (fh.write(b"new"), fh.seek(0), fh.write(b"N")))  # seekable, like a file
    reader.join(timeout=10)
    assert received == [b"New"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
