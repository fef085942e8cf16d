"""Atomic file writes: a failed or interrupted command never leaves a half-written
file, nor a set of files of which some are new and some old without saying so.

Each file is written to a temporary beside it, named `.NAME.PID-RANDOM.partial`,
fsynced, renamed into place, and the folder is fsynced so that the rename
survives a power cut.  A process killed before its rename leaves that
temporary behind; the next write of NAME removes the temporaries of NAME whose
process is gone (those of a live process may still be renamed).
"""
import os
import re
from pathlib import Path

from microtrain.files.errors import TornSetError, UserError

SUFFIX = ".partial"
PENDING = ".split-pending"  # STEM.split-pending: a set of files is being renamed into place


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}{SUFFIX}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_leftovers(path: Path) -> list[Path]:
    """Delete the temporaries of `path` left by processes that no longer run."""
    pattern = re.compile(re.escape(f".{path.name}.") + r"(\d+)-[0-9a-f]{8}" + re.escape(SUFFIX))
    removed = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            try:
                os.unlink(path.parent / name)
                removed.append(path.parent / name)
            except OSError:
                pass
    return removed


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temporary(path: Path, data: bytes) -> Path:
    """`data` in a fsynced temporary beside `path`; UserError naming `path` on failure."""
    if not path.parent.is_dir():
        raise UserError(path, f"cannot write it: no folder {path.parent}")
    remove_leftovers(path)
    tmp = temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(path, f"cannot write it: {e.strerror or e}") from None
        raise
    return tmp


def atomic_write(path, data: bytes) -> None:
    """Write `data` to `path` so that it holds either its old or its new contents."""
    path = Path(path)
    tmp = _write_temporary(path, data)
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(path, f"cannot write it: {e.strerror or e}") from None
    _fsync_folder(path.parent)


def pending_marker(first: Path, stem: str) -> Path:
    return first.with_name(stem + PENDING)


def atomic_write_set(files: dict[Path, bytes], marker: Path) -> None:
    """Write several files that belong together, all in one folder: every file
    goes to a temporary first (a failure, e.g. a full disk, removes them and
    leaves the previous set as it was); then `marker` is created, the files are
    renamed in the given order, and the marker is removed.  A reader that finds
    the marker knows the set may be torn (check_set_complete)."""
    written: list[tuple[Path, Path]] = []
    try:
        for path, data in files.items():
            written.append((path, _write_temporary(path, data)))
        atomic_write(marker, b"".join(str(p.name).encode() + b"\n" for p in files))
    except BaseException:
        for _, tmp in written:
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in written:
        try:
            os.replace(tmp, path)
        except OSError as e:
            for _, left in written:
                left.unlink(missing_ok=True)
            raise UserError(path, f"cannot write it: {e.strerror or e}; the set of files "
                                  f"listed in {marker.name} is incomplete") from None
    _fsync_folder(marker.parent)
    marker.unlink()
    _fsync_folder(marker.parent)


def check_set_complete(marker: Path) -> None:
    """TornSetError if a set written with `marker` was interrupted while being renamed."""
    if marker.exists():
        raise TornSetError(marker.parent / marker.name[: -len(PENDING)],
                           f"an interrupted `trainconf split` left a mix of old and new files "
                           f"({marker.name} is still there); run the split again")
