"""Safe outputs (sim/app/outputs.py): destination checks, atomic writes under injected faults
(a full disk, a read-only folder, SIGKILL mid-write, two writers at once), run folders, locks."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sim.app import outputs
from sim.app.outputs import (
    LOCK_NAME,
    FolderLock,
    atomic_path,
    atomic_write_bytes,
    check_file_destination,
    check_folder_destination,
    check_not_input,
    claim_folder,
    make_run_folder,
)
from sim.errors import ServesimError

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def python(code: str, *args) -> subprocess.Popen:
    """A child Python running `code` with this checkout on its path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(outputs.TEMP_SUFFIX))


# Atomic writes.

def test_atomic_write_replaces_the_file_and_keeps_its_mode(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_bytes(path, b"one")
    mask = os.umask(0)
    os.umask(mask)
    assert path.read_bytes() == b"one" and path.stat().st_mode & 0o777 == 0o666 & ~mask
    path.chmod(0o640)
    atomic_write_bytes(path, b"two")
    assert path.read_bytes() == b"two" and path.stat().st_mode & 0o777 == 0o640
    assert leftovers(tmp_path) == []


def test_full_disk_during_a_write_keeps_the_old_file_and_leaves_no_part(tmp_path, monkeypatch):
    path = tmp_path / "results.csv"
    path.write_bytes(b"old results\n")
    real_write = os.write
    written = []

    def write_then_fill_the_disk(fd, data):
        if written:  # the first call writes half, the second finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(real_write(fd, bytes(data[: len(data) // 2])))
        return written[-1]

    monkeypatch.setattr(os, "write", write_then_fill_the_disk)
    with pytest.raises(ServesimError) as e:
        atomic_write_bytes(path, b"x" * 10_000)
    assert str(e.value) == f"{path}: cannot write (No space left on device); the file there is unchanged"
    assert written == [5000]
    assert path.read_bytes() == b"old results\n" and leftovers(tmp_path) == []


def test_full_disk_in_a_library_writer_through_atomic_path(tmp_path):
    path = tmp_path / "new.csv"
    with pytest.raises(ServesimError) as e, atomic_path(path) as temp, open(temp, "w") as f:
        f.write("a,b\n" * 1000)  # what pandas' to_csv or pyarrow do with the temporary path
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(e.value) == f"{path}: cannot write (No space left on device); nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_mid_write_removes_the_temporary_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_path(path) as temp:
        temp.write_text("half")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and leftovers(tmp_path) == []


SLOW_WRITER = """
import sys, time
from sim.app.outputs import atomic_path
with atomic_path(sys.argv[1]) as temp:
    with open(temp, "wb") as f:
        f.write(b"n" * 100_000)
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
"""


def test_sigkill_mid_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"old": true}')
    child = python(SLOW_WRITER, path)
    assert child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert path.read_text() == '{"old": true}'
    (temp,) = leftovers(tmp_path)  # a killed process cannot clean up; its part is beside, never in place
    assert temp.startswith(".summary.json.") and (tmp_path / temp).stat().st_size == 100_000
    atomic_write_bytes(path, b'{"new": true}')  # the next run writes whole
    assert path.read_text() == '{"new": true}'


WRITER = """
import sys
from sim.app.outputs import atomic_write_bytes
path, byte = sys.argv[1], sys.argv[2].encode()
for _ in range(40):
    atomic_write_bytes(path, byte * 200_000)
"""


def test_two_concurrent_writers_leave_one_whole_file(tmp_path):
    path = tmp_path / "results.parquet"
    writers = [python(WRITER, path, c) for c in "ab"]
    seen = set()
    while any(w.poll() is None for w in writers):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        seen.add((len(data), data[:1], data.count(data[:1])))
    assert [w.wait() for w in writers] == [0, 0], [w.stderr.read() for w in writers]
    assert seen
    assert seen <= {(200_000, b"a", 200_000), (200_000, b"b", 200_000)}  # never a mix, never a part
    assert path.read_bytes() in (b"a" * 200_000, b"b" * 200_000) and leftovers(tmp_path) == []


# Destinations, checked before any work.

def test_folder_destination_checks(tmp_path):
    assert check_folder_destination(tmp_path / "new" / "run") == tmp_path / "new" / "run"
    assert not (tmp_path / "new").exists()  # checking makes nothing
    (tmp_path / "f").write_text("")
    with pytest.raises(ServesimError, match=rf"^{tmp_path / 'f'}: is a file, not a folder$"):
        check_folder_destination(tmp_path / "f")
    with pytest.raises(ServesimError, match=rf"^{tmp_path / 'f'}: is a file, so the folder {tmp_path / 'f/a/b'} "):
        check_folder_destination(tmp_path / "f" / "a" / "b")


def test_file_destination_checks(tmp_path):
    with pytest.raises(ServesimError, match=rf"^{tmp_path / 'nodir'}: no such folder \(for "):
        check_file_destination(tmp_path / "nodir" / "x.csv")
    with pytest.raises(ServesimError, match=rf"^{tmp_path}: is a folder; name a file to write$"):
        check_file_destination(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ServesimError, match="is a file, so"):
        check_file_destination(tmp_path / "f" / "x.csv")


def read_only(folder: Path, monkeypatch) -> None:
    """A read-only folder. Root writes through permission bits (CI runs as root), so there
    creating a file in it fails with an injected EACCES instead."""
    folder.chmod(0o555)
    if IS_ROOT:
        real_open = os.open

        def no_write(path, flags, *args, **kwargs):
            if Path(os.fspath(path)).parent == folder and flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_write)


def test_read_only_destination_is_refused_at_the_start(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "old.csv").write_text("old")
    read_only(folder, monkeypatch)
    try:
        for check in (lambda: check_folder_destination(folder), lambda: check_file_destination(folder / "x.csv"),
                      lambda: check_folder_destination(folder / "sub")):
            with pytest.raises(ServesimError, match=rf"^{folder}: cannot write there \(Permission denied\)$"):
                check()
        with pytest.raises(ServesimError, match=rf"^{folder / 'old.csv'}: cannot write \(Permission denied\)$"):
            atomic_write_bytes(folder / "old.csv", b"new")
        assert (folder / "old.csv").read_text() == "old"
    finally:
        folder.chmod(0o755)


def test_an_output_that_is_an_input_is_refused(tmp_path):
    source = tmp_path / "t.csv"
    source.write_text("x")
    (tmp_path / "link.csv").symlink_to("t.csv")
    os.link(source, tmp_path / "hard.csv")
    for out in (source, tmp_path / "." / "t.csv", tmp_path / "link.csv", tmp_path / "hard.csv"):
        with pytest.raises(ServesimError, match=rf"^{out}: is the input {source}; writing it would destroy it"):
            check_not_input(out, (source,))
    check_not_input(tmp_path / "other.csv", (source,))  # not there yet: fine
    check_not_input(source, (tmp_path / "missing.csv",))


# Run folders.

def test_run_folders_are_unique_even_when_made_at_once(tmp_path):
    made: list[Path] = []
    lock = threading.Lock()

    def make():
        folder = make_run_folder(tmp_path / "runs", "20250101-000000-chunked")
        with lock:
            made.append(folder)

    threads = [threading.Thread(target=make) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    names = sorted(p.name for p in made)
    assert names == sorted(["20250101-000000-chunked"] + [f"20250101-000000-chunked-{n}" for n in range(2, 17)])


def test_claim_folder_refuses_a_run_unless_overwrite_or_resume(tmp_path):
    run = tmp_path / "run"
    with claim_folder(run):  # made and locked
        assert (run / LOCK_NAME).exists()
    assert list(run.iterdir()) == []  # the lock goes with its holder
    with claim_folder(run):  # an empty folder is free to take
        (run / "summary.json").write_text("{}")
    with pytest.raises(ServesimError, match=rf"^{run}: already holds a run \(summary.json\); pass --overwrite"):
        claim_folder(run)
    assert not (run / LOCK_NAME).exists()
    for flags in ({"overwrite": True}, {"resume": True}):
        claim_folder(run, **flags).release()
    (tmp_path / "f").write_text("")
    with pytest.raises(ServesimError, match="is a file, not a folder"):
        claim_folder(tmp_path / "f")


# Locks.

HOLDER = """
import sys, time
from sim.app.outputs import FolderLock
lock = FolderLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_holder_is_refused_naming_the_first_and_a_dead_ones_lock_is_taken_over(tmp_path):
    holder = python(HOLDER, tmp_path)
    assert holder.stdout.readline() == "locked\n"
    info = json.loads((tmp_path / LOCK_NAME).read_text())
    assert info["pid"] == holder.pid and info["host"] == socket.gethostname()
    with pytest.raises(ServesimError) as e:
        FolderLock(tmp_path).acquire()
    assert str(e.value).startswith(f"{tmp_path}: in use by pid {holder.pid} on host {socket.gethostname()}, since ")
    assert f"(lock file {tmp_path / LOCK_NAME}); wait for it to finish" in str(e.value)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = FolderLock(tmp_path).acquire()
    assert lock.took_over.startswith(f"{tmp_path}: took over the lock left by pid {holder.pid} on host ")
    assert lock.took_over.endswith("which is no longer running")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_file_of_another_host_is_not_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(ServesimError, match=r"locked by pid 1 on host elsewhere .* if that run is gone, delete "):
        FolderLock(tmp_path).acquire()


def test_a_stale_lock_file_on_this_host_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True,
                          text=True).stdout.strip()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": int(dead), "host": socket.gethostname()}))
    with FolderLock(tmp_path) as lock:
        assert lock.took_over == (f"{tmp_path}: took over the lock left by pid {dead} on host "
                                  f"{socket.gethostname()}, which is no longer running")


def test_lock_is_exclusive_within_a_process_and_free_after_release(tmp_path):
    first = FolderLock(tmp_path).acquire()
    with pytest.raises(ServesimError, match=f"in use by pid {os.getpid()}"):
        FolderLock(tmp_path).acquire()
    first.release()
    started = time.monotonic()
    with FolderLock(tmp_path) as again:
        assert again.took_over is None
    assert time.monotonic() - started < 1
