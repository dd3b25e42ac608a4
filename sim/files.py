"""Files written whole or not at all: a temporary file in the destination folder, fsynced, then
renamed into place, so a reader (or a crash) sees the old file or the new one, never a part. Used
by the commands' outputs (sim/app/outputs.py) and by the profile writers (backends/), which cannot
import the application layer.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sim.errors import ServesimError

TEMP_SUFFIX = ".tmp"


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write; on leaving the block it is fsynced and renamed
    onto `path`. If the block fails (a full disk, an interrupt), the temporary file is removed
    and `path` keeps what it held. A `path` that is a symbolic link is written through: the file it
    names is replaced and the link kept (renaming onto the link replaced the link itself with the new
    file and left the file it named as it was), as an --overwrite of a linked folder replaces the
    folder it names."""
    path = Path(path)
    if path.is_symlink():
        try:
            path = path.resolve()
        except (RuntimeError, OSError):  # a loop of links (Python 3.11 raises RuntimeError, 3.13 OSError)
            raise ServesimError(f"{path}: a link that leads back to itself (a loop of links); remove it, or "
                                "choose another name") from None
    existed = path.exists()
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise ServesimError(f"{path}: cannot write ({e.strerror or e})") from None
    temp = Path(name)
    try:
        yield temp
        _fsync(temp)
        os.chmod(temp, _mode_for(path))
        os.replace(temp, path)
        _fsync_folder(path.parent)
    except BaseException as e:
        try:
            temp.unlink()
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            kept = "the file there is unchanged" if existed else "nothing was written"
            raise ServesimError(f"{path}: cannot write ({e.strerror or e}); {kept}") from None
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as temp:
        fd = os.open(temp, os.O_WRONLY | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def sync_file(path: str | Path) -> None:
    """fsync a written file: before a group of atomic_path files is renamed into place, so that a
    disk error leaves every one of them unrenamed (their own fsync then finds nothing to write)."""
    _fsync(Path(path))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (a folder's entries are data too)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a folder; the rename stands anyway
        pass
    finally:
        os.close(fd)


def _mode_for(path: Path) -> int:
    """The replaced file's permissions, or those a plain open() would give (mkstemp gives 0600)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
