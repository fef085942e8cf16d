"""One writer at a time: a command that writes an artifact set or a .wof
(`microtrain run`, `sweep`, `federated`, `trainconf split`) holds a lock on the
set and on the .wof it writes, so that two of them never both train on and
write the same files.

A lock is an advisory `flock` on `.NAME.lock` beside the file it guards (beside
the frozen model for the set).  The kernel releases it when its process ends,
however it ends (kill -9 included), so a lock left by a killed process never
blocks (its file stays until the next holder removes it).  The holder writes
its process id into it, for the message of the command refused.  The Python
API (microtrain.commands.session) takes no locks: a sweep's trials run under the sweep's.
"""
import errno
import fcntl
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

from microtrain.files.errors import UserError


def lock_file(path) -> Path:
    path = Path(os.path.realpath(path))
    return path.with_name(f".{path.name}.lock")


@contextmanager
def locked(paths, wait: bool = False):
    """Hold the locks of `paths` (in this order) for the block; a path held by another
    process is a UserError naming it and its holder, or, with `wait`, waited for;
    None in `paths` guards nothing."""
    with ExitStack() as stack:
        seen = set()
        for path in filter(None, paths):
            if lock_file(path) not in seen:
                seen.add(lock_file(path))
                stack.enter_context(_lock(Path(path), wait))
        yield


@contextmanager
def _lock(path: Path, wait: bool):
    name = lock_file(path)
    fd = _acquire(name, path, wait)
    if fd is None:
        yield
        return
    try:
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        name.unlink(missing_ok=True)  # while still held: see _acquire
        os.close(fd)  # releases the lock


def _acquire(name: Path, path: Path, wait: bool) -> int | None:
    """A descriptor of the lock file `name`, locked; None where nothing can be
    written.  A holder removes the file before it lets go, so a lock taken on a
    file that is no longer `name` is dropped and taken again on the new one."""
    while True:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT):
                return None  # a folder nothing can be written in (or not made yet)
            raise UserError(path, f"cannot lock it: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                raise UserError(path, f"in use by process {holder or '(starting)'} (another run "
                                      "or split of these files); give --wait to wait for it") \
                    from None
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino == os.stat(name).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
