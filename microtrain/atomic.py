"""Atomic file writes: a failed or interrupted command never leaves a half-written file."""
import os
import tempfile
from pathlib import Path


def atomic_write(path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
