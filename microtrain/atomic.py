"""Atomic file writes: a failed or interrupted command never leaves a half-written file."""
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(2, "no such folder", str(path.parent))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
