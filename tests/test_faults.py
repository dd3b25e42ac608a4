"""Issue 13's fault-injection suite, through the command line: a full disk (an injected ENOSPC),
a read-only destination, SIGKILL in the middle of writing followed by --resume, two writers at
once, and workers that must die with their parent. Each asserts that nothing is lost."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from sim.app.cli import main
from sim.app.outputs import LOCK_NAME
from sim.app.sweep import RESULTS, read_table
from tests.test_outputs import read_only
from traces import AZURE_CONV_SAMPLE

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
SMALL = [str(AZURE_CONV_SAMPLE), "--limit", "40"]
GRID = ["--policy", "prefill-first,chunked", "--max-num-batched-tokens", "256,1024"]
SLOW = str(ROOT / "tests" / "data" / "policies" / "slow.py") + ":SlowChunked"
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def sim(*args) -> int:
    return main([str(a) for a in args])


def sim_process(*args, cwd=None, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "sim.app.cli", *map(str, args)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("sim: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=["wall_s"]).reset_index(drop=True)


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def wait_for(condition, timeout_s: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pd.DataFrame:
    out = tmp_path_factory.mktemp("faults") / "full"
    assert sim("sweep", *SMALL, *GRID, "--out", out, "--jobs", 1, "--quiet") == 0
    return read_table(out / RESULTS)[0]


# A full disk.

def test_full_disk_mid_sweep_keeps_the_table_whole_and_resume_completes(tmp_path, monkeypatch, capsys,
                                                                         uninterrupted):
    import pyarrow.parquet as pq

    real_write_table = pq.write_table
    calls = []

    def write_table(table, where, **kwargs):
        calls.append(where)
        if len(calls) == 3:  # the third row's rewrite finds the disk full, half written
            real_write_table(table.slice(0, 1), where, **kwargs)
            raise ENOSPC
        return real_write_table(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", write_table)
    out = tmp_path / "s"
    assert sim("sweep", *SMALL, *GRID, "--out", out, "--jobs", 1, "--quiet") == 2
    assert error_line(capsys) == (f"sim: error: {out / RESULTS}: cannot write (No space left on device); the file "
                                  "there is unchanged")
    frame, _ = read_table(out / RESULTS)
    assert len(frame) == 2 and temporaries(out) == [] and not (out / LOCK_NAME).exists()
    monkeypatch.setattr(pq, "write_table", real_write_table)
    assert sim("sweep", *SMALL, *GRID, "--out", out, "--jobs", 1, "--quiet", "--resume") == 0
    pd.testing.assert_frame_equal(comparable(read_table(out / RESULTS)[0]), comparable(uninterrupted))


def _fill_disk_at_steps_table(monkeypatch):
    from reports.run_tables import TableWriter

    write = TableWriter.write

    def write_steps(self, columns):
        if "step" in columns:  # the steps table: a part of the file, then the disk is full
            self.path.write_bytes(b"PAR1")
            raise ENOSPC
        write(self, columns)

    monkeypatch.setattr(TableWriter, "write", write_steps)


def test_full_disk_during_a_replay_leaves_no_part_of_a_run(tmp_path, monkeypatch, capsys):
    _fill_disk_at_steps_table(monkeypatch)
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 2
    assert error_line(capsys) == (f"sim: error: {run / 'steps.parquet'}: cannot write (No space left on device); the "
                                  "run folder is as it was")
    assert not run.exists()  # it made the folder; a part of a run is no run
    monkeypatch.chdir(tmp_path)
    assert sim("replay", *SMALL, "--quiet") == 2  # the default folder under runs/ goes too
    assert list((tmp_path / "runs").iterdir()) == []


def test_full_disk_during_replay_overwrite_keeps_the_old_run(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    _fill_disk_at_steps_table(monkeypatch)
    assert sim("replay", *SMALL, "--policy", "prefill-first", "--out", run, "--overwrite", "--quiet") == 2
    capsys.readouterr()
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # not one file of the new run


def test_a_table_that_cannot_reach_the_disk_fails_the_replay_and_keeps_the_old_run(tmp_path, monkeypatch, capsys):
    """A table's fsync (before its rename) failing is the replay's error, naming the table, and no
    file of the new run is renamed into place."""
    import sim.files as files  # where files are written whole (atomic_path, sync_file)

    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    fsync = files._fsync

    def failing_fsync(path):
        if ".requests.csv." in path.name:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        fsync(path)

    monkeypatch.setattr(files, "_fsync", failing_fsync)
    assert sim("replay", *SMALL, "--policy", "prefill-first", "--out", run, "--overwrite", "--quiet") == 2
    assert error_line(capsys) == (f"sim: error: {run / 'requests.csv'}: cannot write (Input/output error); the "
                                  "run folder is as it was")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_run_folder_syncs_every_file_and_its_folder(tmp_path, monkeypatch):
    import sim.app.outputs as outputs
    import sim.files as files

    synced, folders = [], []
    fsync, fsync_folder = files._fsync, files._fsync_folder
    monkeypatch.setattr(files, "_fsync", lambda path: synced.append(path.name.split(".")[1]) or fsync(path))
    for module in (files, outputs):  # a file's rename (sim/files.py), a run folder's swap (outputs.py)
        monkeypatch.setattr(module, "_fsync_folder", lambda folder: folders.append(folder) or fsync_folder(folder))
    run = tmp_path / "run"
    assert sim("replay", *SMALL, "--out", run, "--quiet") == 0
    names = {"requests", "steps", "summary", "digest", "report"}
    assert names <= set(synced)  # every file before its rename
    assert run in folders  # and the renames made durable


# A read-only destination: refused at the start, before the trace is even read.

def test_read_only_destination_is_exit_2_before_any_work(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    assert sim("replay", *SMALL, "--out", folder / "keep", "--quiet") == 0
    report_before = (folder / "keep" / "report.html").read_bytes()
    read_only(folder, monkeypatch)
    read_only(folder / "keep", monkeypatch)
    missing = tmp_path / "no-such-trace.csv"  # named first is the destination: the trace is never opened
    try:
        for args, where in [
            (["replay", missing, "--out", folder / "run"], folder),
            (["sweep", missing, "--out", folder / "sweep"], folder),
            (["capacity", missing, "--slo", "tbt=0.1", "--out", folder / "cap"], folder),
            (["trace", "convert", missing, folder / "t.csv"], folder),
            (["calibrate", "--model", "tiny", "--out", folder / "p.json"], folder),
            (["report", folder / "keep"], folder / "keep"),
        ]:
            assert sim(*args) == 2, args
            assert error_line(capsys) == f"sim: error: {where}: cannot write there (Permission denied)", args
    finally:
        (folder / "keep").chmod(0o755)
        folder.chmod(0o755)
    assert (folder / "keep" / "report.html").read_bytes() == report_before
    assert sorted(p.name for p in folder.iterdir()) == ["keep"]


# SIGKILL in the middle of writing, then --resume.

KILLED_MID_WRITE = """
import sys, time
import pyarrow.parquet as pq
real = pq.write_table
calls = []
def write_table(table, where, **kwargs):
    calls.append(where)
    real(table, where, **kwargs)
    if len(calls) == 2:  # the second rewrite is on disk under its temporary name, not yet renamed
        print("mid-write", flush=True)
        time.sleep(120)
pq.write_table = write_table
from sim.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_mid_write_then_resume_gives_the_uninterrupted_rows(tmp_path, capsys, uninterrupted):
    out = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, "sweep", *SMALL, *GRID, "--out", str(out),
                              "--jobs", "1", "--quiet"], env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "mid-write\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(read_table(out / RESULTS)[0]) == 1  # the table before the killed rewrite, whole
    (temp,) = temporaries(out)
    assert temp.startswith(".results.parquet.")
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == child.pid  # left by the dead process
    assert sim("sweep", *SMALL, *GRID, "--out", out, "--jobs", 1, "--quiet", "--resume") == 0
    err = capsys.readouterr().err
    assert f"sim: warning: {out}: took over the lock left by pid {child.pid} on host {socket.gethostname()}" in err
    pd.testing.assert_frame_equal(comparable(read_table(out / RESULTS)[0]), comparable(uninterrupted))


# Two writers at once.

def _holder_pid(folder: Path) -> int | None:
    try:
        return json.loads((folder / LOCK_NAME).read_text()).get("pid")
    except (FileNotFoundError, ValueError):
        return None


@pytest.mark.slow  # a sweep of a policy that sleeps 20 ms a step, run to its end
def test_a_second_sweep_or_capacity_into_a_busy_folder_is_exit_2_naming_the_first(tmp_path, capsys):
    out = tmp_path / "x"
    first = sim_process("sweep", *SMALL, "--policy", SLOW, "--out", out, "--jobs", 1, "--quiet")
    wait_for(lambda: _holder_pid(out) == first.pid, what="the first sweep's lock")
    for args in (["sweep", *SMALL, *GRID, "--out", out, "--jobs", 1, "--resume"],
                 ["sweep", *SMALL, *GRID, "--out", out, "--jobs", 1, "--overwrite"],
                 ["capacity", *SMALL, "--slo", "tbt=0.1", "--out", out, "--resume"]):
        assert sim(*args) == 2
        line = error_line(capsys)
        assert line.startswith(f"sim: error: {out}: in use by pid {first.pid} on host {socket.gethostname()}, "), line
    assert first.wait(timeout=300) == 0, first.stderr.read()
    frame, _ = read_table(out / RESULTS)
    assert len(frame) == 1 and frame["status"].tolist() == ["ok"] and not (out / LOCK_NAME).exists()


def test_replays_started_in_the_same_second_get_two_folders(tmp_path):
    replays = [sim_process("replay", *SMALL, "--policy", policy, "--quiet", cwd=tmp_path)
               for policy in ("chunked", "chunked", "chunked")]
    assert [r.wait(timeout=300) for r in replays] == [0, 0, 0], [r.stderr.read() for r in replays]
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 3
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir()) == [".servesim-files.json", "digest.json", "report.html",
                                                           "requests.csv", "steps.parquet", "summary.json"]


# Workers die with their parent.

def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_sweep_with_two_workers(out: Path) -> tuple[subprocess.Popen, list[int]]:
    """A sweep whose two workers are each in the middle of a point of about 50 s."""
    marks = out.parent / "marks"
    marks.mkdir()
    parent = sim_process("sweep", *SMALL, "--policy", SLOW, "--max-num-batched-tokens", "256,512,1024",
                         "--out", out, "--jobs", 2, "--quiet", env={"SLOW_POLICY_MARKS": str(marks)})
    wait_for(lambda: len(list(marks.iterdir())) == 2, what="two workers running a point each")
    workers = sorted(int(p.name) for p in marks.iterdir())
    assert all(pid in _children(parent.pid) for pid in workers)
    return parent, workers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_a_sweep_takes_its_workers_with_it(tmp_path):
    parent, workers = _start_sweep_with_two_workers(tmp_path / "s")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    wait_for(lambda: not any(_alive(pid) for pid in workers), timeout_s=10, what=f"workers {workers} to end")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_of_a_sweep_stops_its_workers_and_frees_the_folder(tmp_path):
    out = tmp_path / "s"
    parent, workers = _start_sweep_with_two_workers(out)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 143
    err = parent.stderr.read()
    # (both workers were on slow points: none had finished, and sim says so once, then how it was stopped)
    assert "sim: nothing had finished, so nothing was kept\nsim: terminated" in err and "interrupted" not in err
    wait_for(lambda: not any(_alive(pid) for pid in workers), timeout_s=10, what=f"workers {workers} to end")
    assert not (out / LOCK_NAME).exists()
