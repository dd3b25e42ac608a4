"""Outputs that are never lost: destinations checked before any work, files written whole or
not at all, run folders never overwritten unawares, one writer per folder.

    check_folder_destination / check_file_destination   at command start, before the work
    atomic_path / atomic_write_bytes / atomic_write_text  (sim/files.py) a unique temporary file in the
                                                          destination folder, fsynced, renamed into place
    sync_file                                            (sim/files.py) a group's files fsynced before any rename
    make_run_folder                                      a new folder, its name unique (mkdir, no exist_ok)
    open_run_folder                                      --out claimed, or a new folder under runs/
    claim_folder                                         an --out folder, locked, refused if it holds a
                                                          run (unless --overwrite or --resume)
    FolderLock                                           the lock file holding pid and host; on release,
                                                          the folder's run files recorded (write_manifest)
    record_file                                          a run file rewritten later (sim report) recorded
    check_not_input                                      an output is none of the command's inputs
    command_inputs                                       every file or folder a command's arguments name

A command that claimed a folder records, when it ends with the folder kept, the run files it holds
(`MANIFEST_NAME`, with each file's size and mtime): --overwrite replaces a folder only when every
run file in it is recorded so, and nothing else is in it. A user's `requests.csv`, a file edited
since, a folder of an older servesim or of a killed command are refused, never deleted.

An --overwrite of a folder that holds a run never loses it: the new run is written into a new
folder beside it (`.NAME.servesim-new-XXXX`, `FolderLock.staged`) and swapped in whole when the
command succeeds (renameat2 RENAME_EXCHANGE: one atomic step), the old run removed only then. A
kill, a full disk or an error leaves the old folder as it was, whole and usable.

A rename within one folder is atomic on POSIX file systems, so a reader (or a crash) sees either
the old file or the new one, never a part. Every problem is a `ServesimError` naming the path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Self

from sim.errors import ServesimError
from sim.files import TEMP_SUFFIX, _fsync_folder, atomic_path, atomic_write_bytes, atomic_write_text, sync_file  # noqa: F401

LOCK_NAME = "servesim.lock"


# Destinations, checked at command start.

def _named(path: str | Path, what: str) -> Path:
    """`path` as a Path, refused when it names nothing: an empty name (which would be the current
    folder) or one of spaces only (a folder or file named " " is never what was meant)."""
    if isinstance(path, str) and not path.strip():
        raise ServesimError(f"{path!r}: an empty name; name the {what} to write")
    return Path(path)


def check_folder_destination(path: str | Path) -> Path:
    """A folder the command will write into (made if missing): no file in the way, writable."""
    path = _named(path, "folder")
    if path.exists():
        if not path.is_dir():
            raise ServesimError(f"{path}: is a file, not a folder")
        _probe(path)
        return path
    if path.is_symlink():  # (mkdir said "File exists" of a name ls shows as missing)
        raise ServesimError(f"{path}: a link to {os.readlink(path)}, which does not exist; make that folder first, "
                            "or choose another --out")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ServesimError(f"{ancestor}: is a file, so the folder {path} cannot be made")
    _probe(ancestor)
    return path


def check_file_destination(path: str | Path, inputs: tuple[str | Path, ...] = (), overwrite: bool = False,
                           other: str = "another name") -> Path:
    """A file the command will write: its folder exists and is writable, it is none of `inputs`, and
    it does not exist yet, unless `overwrite` (the command's --overwrite) says to replace it; `other`
    says what to choose instead in that refusal."""
    path = _named(path, "file")
    if path.is_dir():
        raise ServesimError(f"{path}: is a folder; name a file to write")
    folder = path.parent
    if not folder.exists():
        raise ServesimError(f"{folder}: no such folder (for {path})")
    if not folder.is_dir():
        raise ServesimError(f"{folder}: is a file, so {path} cannot be written")
    check_not_input(path, inputs)
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise ServesimError(f"{path}: exists; pass --overwrite to replace it, or choose {other}")
    _probe(folder)
    return path


def check_not_input(output: str | Path, inputs: tuple | list, folder: bool = False) -> None:
    """Refuse an output that is one of the inputs (by any path: links, `./`, another spelling; by
    resolved path and by inode), or with `folder`, an output folder that holds one of them (a
    folder is replaced as a whole)."""
    for source in inputs:
        try:
            same = os.path.samefile(output, source)
        except OSError:  # either one does not exist (yet)
            same = False
        if not same:
            try:
                same = Path(output).resolve() == Path(source).resolve()
            except (OSError, RuntimeError):
                same = False
        if same:
            raise ServesimError(f"{output}: is the input {source}; writing it would destroy it: "
                                f"name another output")
        if folder and _inside(source, output):
            raise ServesimError(f"{output}: holds the input {source}; this command writes the folder as a whole, "
                                "which would destroy it: name another --out, or move the input out of it")


def _inside(source: str | Path, folder: str | Path) -> bool:
    """Whether `source` lies under `folder` (resolved: links and `..` followed)."""
    try:
        s, f = Path(source).resolve(), Path(folder).resolve()
    except (OSError, RuntimeError):
        return False
    return s != f and s.is_relative_to(f)


def command_inputs(args) -> list[str]:
    """Every existing file or folder that a command's arguments name (a trace, a profile, a hardware
    or model file, operator tables, a policy's FILE.py:Class, ...), whatever the flag: what no
    output of the command may overwrite. `out` is the output, not an input."""
    found: list[str] = []
    for key, value in sorted(vars(args).items()):
        if key in ("out", "func") or value is None:
            continue
        for text in (value if isinstance(value, (list, tuple)) else [value]):
            if not isinstance(text, (str, Path)) or not str(text):
                continue
            for candidate in (str(text), str(text).rpartition(":")[0]):
                if candidate and len(candidate) < 4096 and os.path.exists(candidate):
                    found.append(candidate)
    return found


def _probe(folder: Path) -> None:
    """Create and remove a file in `folder`: the one sure test that it can be written (root
    passes permission bits, not a read-only mount)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".servesim-probe-", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ServesimError(f"{folder}: cannot write there ({e.strerror or e})") from None


# Run folders.

def make_run_folder(parent: str | Path, name: str) -> Path:
    """A new folder `parent/name` (or name-2, name-3, ...), made by this call and no other:
    mkdir fails on an existing folder, so two commands started in the same second get two."""
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            folder = parent / (name if n == 1 else f"{name}-{n}")
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue
    except OSError as e:
        raise ServesimError(f"{parent}: cannot make a run folder there ({e.strerror or e})") from None
    raise ServesimError(f"{parent}: 10,000 folders named {name}-N exist already; choose an --out")


def claim_folder(path: str | Path, *, overwrite: bool = False, resume: bool = False,
                 hint: str = "pass --overwrite to replace it, or choose another --out",
                 inputs: tuple | list = ()) -> FolderLock:
    """Make (or take) the folder `path` and lock it. A folder already holding files is refused,
    naming a few, unless `overwrite` or `resume`; the check is made under the lock, so two
    commands cannot both find it empty. With `overwrite`, a folder holding files is not written
    into: the command writes `lock.folder`, a new folder beside it, swapped in whole when the
    command succeeds (`FolderLock.stage`). A folder that is or holds one of `inputs` is refused, and
    so is one holding anything no servesim command writes (`foreign_entries`), or with `overwrite`,
    a run file that servesim did not record writing (or that changed since), but with `resume`,
    which writes into the folder and removes nothing."""
    path = check_folder_destination(path)
    check_not_input(path, inputs, folder=True)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ServesimError(f"{path}: cannot make the folder ({e.strerror or e})") from None
    lock = FolderLock(path).acquire()
    lock.created = created
    foreign = [] if resume else foreign_entries(path)
    unrecorded = [name for name in foreign if name.rpartition("/")[2] in RUN_FILES]
    strangers = [name for name in foreign if name not in unrecorded]
    if strangers or (overwrite and unrecorded):  # an --overwrite replaces the folder whole: it would delete them
        lock.release()
        why = (f"not in its {MANIFEST_NAME}, or changed since" if (path / MANIFEST_NAME).exists() else
               f"no {MANIFEST_NAME}: an older servesim's folder, or a killed command's")
        parts = ([f"{_shown(strangers)}, which no servesim command writes"] if strangers else []) + (
            [f"{_shown(unrecorded)}, which servesim did not record writing ({why})"] if unrecorded else [])
        raise ServesimError(f"{path}: holds {'; and '.join(parts)}; --overwrite replaces only a folder that holds "
                            "nothing but the files servesim wrote there: choose another --out, or remove them yourself")
    if resume:  # run files there that servesim did not write stay unrecorded unless this command rewrites them
        not_ours = foreign_entries(path)
        lock.unrecorded = {name: stat for name, stat in _run_files(path).items() if name in not_ours}
    if not (overwrite or resume):
        held = sorted(entry.name for entry in path.iterdir() if entry.name not in (LOCK_NAME, MANIFEST_NAME))
        if held:
            lock.release()
            raise ServesimError(f"{path}: already holds a run ({_shown(held)}); {hint}")
    elif overwrite and not resume and any(entry.name not in (LOCK_NAME, MANIFEST_NAME) for entry in path.iterdir()):
        try:
            lock.stage()
        except BaseException:
            lock.release()
            raise
    return lock


# What servesim's commands write into a folder they claim (sim/app/run_folder.py: a run's tables,
# summary, digest and report; compare.py: its two runs and figures; results_table.py and
# capacity_cli.py: a sweep's or capacity search's table; validate.py). An --overwrite replaces a folder
# whole, so it is refused for a folder holding anything else: `--out . --overwrite` in a project, or
# a note saved in a run folder, is never deleted.
RUN_FILES = frozenset({"summary.json", "digest.json", "report.html", "requests.csv", "requests.parquet",
                       "steps.parquet", "steps.csv", "compare.json", "results.parquet", "probes.parquet",
                       "capacity.csv", "validate.csv", "validate.json", "measured.json"})
RUN_SUBFOLDERS = frozenset({"measured", "predicted"})  # sim compare's two run folders
OS_FILES = frozenset({".DS_Store", "Thumbs.db"})  # what a file browser leaves in a folder it showed: no one's data


MANIFEST_NAME = ".servesim-files.json"  # the run files a command wrote into the folder: name, size, mtime


def foreign_entries(folder: Path) -> list[str]:
    """The entries of `folder` that are not servesim's, sorted (those of RUN_SUBFOLDERS as
    "measured/NAME"). A run file is servesim's only if the folder's manifest records it with its
    present size and mtime: a user's file of the same name, or one edited since, is not. The lock,
    the manifest and a temporary file that a killed write left (`.NAME.XXXX.tmp` of a run file or
    the manifest, `.servesim-probe-XXXX`) are servesim's."""
    recorded = read_manifest(folder) or {}
    held = _run_files(folder)

    def ours(name: str) -> bool:
        return name in held and recorded.get(name) == held[name]

    def left_over(name: str) -> bool:  # a file browser's, or a killed write's
        return name in OS_FILES or _is_temporary(name)

    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        name = entry.name
        if name in (LOCK_NAME, MANIFEST_NAME) or left_over(name):
            continue
        if name in RUN_SUBFOLDERS and entry.is_dir() and not entry.is_symlink():
            found += [f"{name}/{inner.name}" for inner in sorted(entry.iterdir(), key=lambda e: e.name)
                      if not (left_over(inner.name) or ours(f"{name}/{inner.name}"))]
        elif not ours(name):
            found.append(name)
    return found


def _run_files(folder: Path) -> dict[str, tuple[int, int]]:
    """The run files (RUN_FILES, plain files, not links) in `folder` and in its RUN_SUBFOLDERS, by
    name ("measured/requests.csv"), with their size and st_mtime_ns."""
    found = {}
    for prefix, place in [("", folder)] + [(f"{sub}/", folder / sub) for sub in sorted(RUN_SUBFOLDERS)]:
        if (prefix and place.is_symlink()) or not place.is_dir():  # --out may be a link; a subfolder may not
            continue
        for entry in place.iterdir():
            if entry.name in RUN_FILES and not entry.is_symlink() and entry.is_file():
                st = entry.stat()
                found[prefix + entry.name] = (st.st_size, st.st_mtime_ns)
    return found


def read_manifest(folder: Path) -> dict[str, tuple[int, int]] | None:
    """The run files `folder`'s manifest records, with their size and mtime; None when it has none
    (or one that cannot be read: then nothing in it is taken as servesim's)."""
    try:
        files = json.loads((Path(folder) / MANIFEST_NAME).read_text())["files"]
        return {str(name): (int(v["size"]), int(v["mtime_ns"])) for name, v in files.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def write_manifest(folder: Path, unrecorded: dict[str, tuple[int, int]] | None = None) -> None:
    """Record the run files `folder` holds in its manifest, written whole, but those of
    `unrecorded` that are as they were (files of a resumed folder that servesim did not write).
    A folder holding no run file and no manifest is left as it is (an empty one stays empty)."""
    unrecorded = unrecorded or {}
    files = {name: stat for name, stat in _run_files(folder).items() if unrecorded.get(name) != stat}
    if files or (folder / MANIFEST_NAME).exists():
        _save_manifest(folder, files)


def _manifest_entry(path: Path) -> tuple[Path, str]:
    """(the folder whose manifest records `path`, its name there): the folder's own, but a run of sim
    compare's folder (its `measured/` or `predicted/`, which hold no manifest: the comparison's records
    them as "measured/NAME"), however the path reaches it (a link, `.`)."""
    folder = path.parent.resolve()
    if (not (folder / MANIFEST_NAME).exists() and folder.name in RUN_SUBFOLDERS
            and (folder.parent / "compare.json").exists() and (folder.parent / MANIFEST_NAME).exists()):
        return folder.parent, f"{folder.name}/{path.name}"
    return folder, path.name


def record_file(folder: str | Path, name: str) -> None:
    """After servesim rewrote `folder/name` outside a claimed folder (`sim report`), record it in
    the manifest that keeps it (`_manifest_entry`; begun if there is none: a folder of runs), so that
    the folder stays servesim's and a later `sim report` knows the file for its own
    (`check_ours_to_replace`)."""
    home, key = _manifest_entry(Path(folder) / name)
    recorded = read_manifest(home)
    if recorded is None:
        if (home / MANIFEST_NAME).exists():
            return  # one that cannot be read is left as it is: nothing in it is taken as servesim's
        recorded = {}
    st = (Path(folder) / name).stat()
    recorded[key] = (st.st_size, st.st_mtime_ns)
    _save_manifest(home, recorded)


def check_ours_to_replace(path: str | Path, command: str) -> None:
    """Refuse (exit 2) before `command` replaces `path` outside a claimed folder (`sim report`'s
    report.html) unless servesim recorded writing it, as it is now, in its folder's manifest: a
    user's file of that name, one edited since, or a link (whose target lies anywhere) is kept."""
    path = Path(path)
    if path.is_symlink():
        raise ServesimError(f"{path} is a link (to {os.readlink(path)}); {command} writes no file through a link: "
                            "remove the link to write it")
    if not path.exists():
        return
    if not path.is_file():
        raise ServesimError(f"{path} is not a file; {command} would replace it: move it away to write it")
    st = path.stat()
    home, key = _manifest_entry(path)
    recorded = read_manifest(home)
    if (recorded or {}).get(key) != (st.st_size, st.st_mtime_ns):
        why = (f" ({home / MANIFEST_NAME}, servesim's record of the folder, cannot be read)"
               if recorded is None and (home / MANIFEST_NAME).exists() else " (or it was changed since)")
        raise ServesimError(f"{path} exists and servesim did not record writing it{why}: "
                            f"{command} would replace it; move or rename it to write the report")


def _save_manifest(folder: Path, files: dict[str, tuple[int, int]]) -> None:
    record = {"about": "the files servesim wrote in this folder; --overwrite replaces the folder only while "
                       "it holds nothing else and these are as written",
              "files": {name: {"size": size, "mtime_ns": mtime} for name, (size, mtime) in sorted(files.items())}}
    atomic_write_text(folder / MANIFEST_NAME, json.dumps(record, indent=1) + "\n")


_TEMPORARY = re.compile(r"\.(.+)\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX))  # atomic_path's (mkstemp): .NAME.XXXXXXXX.tmp


def _is_temporary(name: str) -> bool:
    """A temporary file of servesim's: atomic_path's for a run file or the manifest, or _probe's."""
    match = _TEMPORARY.fullmatch(name)
    return (match is not None and match[1] in RUN_FILES | {MANIFEST_NAME}) or name.startswith(".servesim-probe-")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def open_run_folder(out: str | Path | None, default_name: str, *, parent: str | Path = "runs",
                    overwrite: bool = False, resume: bool = False, discard_on_failure: bool = False,
                    hint: str = "pass --overwrite to replace it, or choose another --out",
                    inputs: tuple | list = ()) -> FolderLock:
    """The locked folder a command writes: `out` claimed (claim_folder), or a new one under
    `parent` named after `default_name` (made now, so that no other command can take it). Use it
    as a context manager: a folder this call made is removed again if the command fails, when
    empty, or whatever it holds with `discard_on_failure`."""
    if out is not None:
        lock = claim_folder(out, overwrite=overwrite, resume=resume, hint=hint, inputs=inputs)
    else:
        check_folder_destination(parent)
        lock = FolderLock(make_run_folder(parent, safe_name(default_name))).acquire()
        lock.created = True
    lock.discard_on_failure = discard_on_failure
    return lock


def safe_name(text: str) -> str:
    """A folder name from free text (a policy may be 'path/to/file.py:Class')."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("._") or "run"


class InterruptedAfterWriting(KeyboardInterrupt):
    """Ctrl-C that came while a finished run took its folder's place: the folder holds the new run."""


def _written_words(folder: Path) -> str:
    """What a Ctrl-C or SIGTERM that came as a finished run took its folder's place says of it."""
    return f"after {folder} was written whole (the old run in it replaced)"


@contextmanager
def _interrupts_deferred():
    """Hold SIGINT and SIGTERM off for the block where they would raise (Python's Ctrl-C handler, the
    command's SIGTERM one: sim.app.workers.terminate_on_sigterm), in the main thread (elsewhere Python
    delivers none); yields a list that holds the signals that came. A signal the process ignores stays
    ignored."""
    import signal
    import threading

    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    held = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(number)
        if handler is signal.default_int_handler or (callable(handler) and number == signal.SIGTERM):
            held[number] = signal.signal(number, lambda number, frame: came.append(number))
    try:
        yield came
    finally:
        for number, handler in held.items():
            signal.signal(number, handler)


# One writer per folder.

class FolderLock:
    """`folder/servesim.lock`, holding the pid and host of the command writing the folder.

    The file is held with flock(2), which the kernel lets go when the process ends, however it
    ends (SIGKILL too): a lock file nobody holds was left by a dead process, and is taken over
    (`took_over` says whose it was, for a warning). A lock file from another host is never taken
    over: its process cannot be seen from here. On release the file is removed."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.fd: int | None = None
        self.took_over: str | None = None
        self.created = False  # whether the command made the folder (removed again if it fails)
        self.discard_on_failure = False  # remove what it holds too (a replay), not only when empty (a sweep)
        self.final = self.folder  # the folder the user named; `folder` is where to write (a staged one)
        self.staged = False
        self.unrecorded: dict[str, tuple[int, int]] = {}  # run files a resumed folder held that servesim did not write

    def stage(self) -> None:
        """Write the run into a new folder beside the locked one, to replace it whole on success
        (`__exit__`). Staged folders left by a killed command are removed first: the lock is ours,
        so no live command is writing one."""
        target = self.final.resolve()  # a link to a folder: the folder it names is replaced, the link kept
        parent, name = target.parent, target.name
        for stale in parent.glob(f".{glob_escape(name)}{STAGE_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            self.folder = Path(tempfile.mkdtemp(prefix=f".{name}{STAGE_MARK}", dir=parent))
            os.chmod(self.folder, _mode_for_folder(self.final))
        except OSError as e:
            raise ServesimError(f"{parent}: cannot make a folder beside {self.final} for the new run "
                                f"({e.strerror or e}); the old run is unchanged") from None
        self.staged = True

    def _swap_in(self) -> None:
        """The staged folder takes the final one's place in one step; the old run is removed after.
        A Ctrl-C meanwhile waits for both (`_interrupts_deferred`), then says the run was written:
        before, one during the removal said "interrupted" of a folder that held the new run."""
        new, final = self.folder, self.final
        with _interrupts_deferred() as interrupted:
            try:
                _exchange(new, final.resolve())  # `new` now holds the old run
            except OSError as e:
                raise ServesimError(f"{final}: cannot replace it with the new run ({e.strerror or e}); the old run "
                                    "is unchanged") from None
            self.folder, self.staged = final, False
            _fsync_folder(final.parent)
            shutil.rmtree(new, ignore_errors=True)
        if signal_number := next(iter(interrupted), None):
            import signal

            from sim.app.workers import Terminated

            raise (Terminated if signal_number == signal.SIGTERM else InterruptedAfterWriting)(_written_words(final))

    def acquire(self) -> FolderLock:
        for _ in range(100):  # another process may remove the file between our open and our flock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ServesimError(f"{self.path}: cannot make the lock file ({e.strerror or e})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read_holder(fd))
                os.close(fd)
                raise ServesimError(f"{self.folder}: in use by {holder} (lock file {self.path}); wait for it "
                                    "to finish, or write to another folder") from None
            except OSError as e:
                os.close(fd)
                raise ServesimError(f"{self.path}: cannot lock ({e.strerror or e})") from None
            if not _is_file_at(fd, self.path):  # its holder removed it as we opened it: open anew
                os.close(fd)
                continue
            previous = _read_holder(fd)
            if previous is not None:
                if previous.get("host") != socket.gethostname():
                    os.close(fd)
                    raise ServesimError(f"{self.folder}: locked by {_describe(previous)} (lock file {self.path}); "
                                        "it cannot be checked from this host: if that run is gone, delete the "
                                        "lock file")
                self.took_over = (f"{self.folder}: took over the lock left by {_describe(previous)}, which "
                                  "is no longer running")
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(["sim", *sys.argv[1:]])[:200]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
            self.fd = fd
            return self
        raise ServesimError(f"{self.path}: cannot lock: the lock file keeps being replaced")

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if _is_file_at(fd, self.path):
                os.unlink(self.path)
        finally:
            os.close(fd)  # lets go of the flock

    def __enter__(self) -> Self:
        if self.fd is None:
            self.acquire()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if self.staged:
            staging = str(self.folder)
            try:
                if kind is None:
                    write_manifest(self.folder)  # recorded before the swap: the folder arrives recorded
                    self._swap_in()
            finally:
                if self.staged:  # failed, or the swap did: the new run is discarded, the old one stays
                    shutil.rmtree(self.folder, ignore_errors=True)
                    self.folder, self.staged = self.final, False
                self.release()
            if isinstance(value, ServesimError) and staging in str(value):  # name the folder the user named
                raise ServesimError(str(value).replace(staging, str(self.final))) from None
            return
        try:
            if kind is None:
                write_manifest(self.folder, self.unrecorded)
            elif not (self.created and self.discard_on_failure):  # what a failed command keeps (a sweep's rows)
                try:
                    write_manifest(self.folder, self.unrecorded)
                except (ServesimError, OSError):  # a full disk, say: the command's own error is the one to show
                    pass
        finally:
            self.release()
        if kind is not None and self.created:  # the command failed in a folder it made
            if self.discard_on_failure:
                shutil.rmtree(self.folder, ignore_errors=True)  # a part of a run is no run
            else:
                try:
                    self.folder.rmdir()  # only if nothing was written into it (a sweep keeps its rows)
                except OSError:
                    pass


STAGE_MARK = ".servesim-new-"
RENAME_EXCHANGE = 2  # linux/fs.h


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _mode_for_folder(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o755


def _exchange(a: Path, b: Path) -> None:
    """Swap two folders' names atomically (Linux renameat2 RENAME_EXCHANGE); where the call or the
    file system lacks it, three renames (a crash between them leaves the old run whole, beside)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        except (OSError, AttributeError):
            renameat2 = None
        if renameat2 is not None:
            at_fdcwd = -100
            if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # other than "not supported here"
                raise OSError(err, os.strerror(err))
    aside = a.with_name(a.name + "-old")
    os.rename(b, aside)
    try:
        os.rename(a, b)
    except OSError:
        os.rename(aside, b)
        raise
    os.rename(aside, a)


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> dict | None:
    """The lock file's pid and host, None when it is empty (a new file)."""
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return {}
    if not raw.strip():
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict | None) -> str:
    if not info:
        return "another command (its lock file names no process)"
    since = f", since {info['started']}" if info.get("started") else ""
    command = f" `{info['command']}`" if info.get("command") else ""
    return f"pid {info.get('pid')} on host {info.get('host')}{since}{command}"
