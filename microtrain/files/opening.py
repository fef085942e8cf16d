"""Opening the files a command is given: only regular files are read (a FIFO or a
device would block or never end), and an output is not written over a file of
another kind unless the user says so.

`kind_of` tells the kinds apart by their first bytes, not by their names.
"""
import io
import math
import mmap
import os
import stat
import tokenize
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from microtrain.files.errors import UserError

MAX_INPUT_BYTES = 1 << 34  # 16 GiB: beyond any model, weights or checkpoint a device trains


def regular_file(path, what: str = "file") -> Path:
    """`path` if it names a readable regular file; else UserError, without opening it
    (opening a FIFO for reading blocks until a writer comes)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(path, f"no such {what}") from None
    except OSError as e:
        raise UserError(path, f"cannot read the {what}: {e.strerror or e}") from None
    if stat.S_ISDIR(mode):
        raise UserError(path, f"is a folder, not a {what}")
    if not stat.S_ISREG(mode):
        raise UserError(path, f"is not a regular file (a FIFO, socket or device); expected a {what}")
    if not os.access(path, os.R_OK):
        raise UserError(path, f"cannot read the {what}: permission denied")
    return path


@contextmanager
def opened(path, what: str = "file", limit: int = MAX_INPUT_BYTES):
    """(the open binary file, its size) of a regular file of at most `limit` bytes;
    an OSError while it is open becomes a UserError naming it."""
    path = regular_file(path, what)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise UserError(path, f"{size} bytes is larger than any {what} this tool reads "
                                      f"({limit} bytes at most)")
            yield f, size
    except OSError as e:
        raise UserError(path, f"cannot read the {what}: {e.strerror or e}") from None


def read_regular(path, what: str = "file", limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes."""
    with opened(path, what, limit) as (f, _):
        return f.read()


class FileMap(mmap.mmap):
    """A memory map of a file: its bytes are read in place, file-backed pages the
    system may drop and read again, not memory of this process, but for the
    `written` bytes of a private (copy-on-write) map (arena.held_by counts them)."""
    written = 0


def map_regular(path, what: str = "file", limit: int = MAX_INPUT_BYTES):
    """A read-only FileMap of a regular file of at most `limit` bytes (b"" when it
    is empty).  Files are replaced by renaming a new one into place
    (microtrain/files/atomic.py), so a map keeps the bytes it was made from."""
    with opened(path, what, limit) as (f, size):
        return FileMap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""


# -- kinds of files, by their first bytes -----------------------------------------------------------

def kind_of(path: Path) -> str | None:
    """"circle", "tflite", "wof", "npy", "npz", "checkpoint", "other", or None for an
    empty file."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not head:
        return None
    if head[4:8] in (b"CIR0", b"TFL3"):
        return "circle" if head[4:8] == b"CIR0" else "tflite"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head[:2] == (429).to_bytes(2, "little") and head[2] == 1:
        return "wof"
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                return "checkpoint" if "meta.json" in archive.namelist() else "npz"
        except (zipfile.BadZipFile, OSError, EOFError):
            return "other"
    return "other"


KIND_NAMES = {"circle": "a circle model", "tflite": "a tflite model", "wof": "a .wof weights file",
              "npy": "a .npy array", "npz": "a .npz archive",
              "checkpoint": "a microtrain checkpoint", "other": "data of another kind"}


def check_output(path, kinds: tuple[str, ...] | None, force: bool = False, *,
                 reads: tuple = (), option: str = "-o", make_folder: bool = False) -> Path:
    """`path`, checked before any work as an output of a command: refuse a file the
    same command reads (`reads`: (option, path) pairs; the same file however it is
    reached, links followed), a missing folder (unless `make_folder`: the command
    creates it), a folder, FIFO or device, and a file of another kind than `kinds`
    (None: any kind) unless `force`."""
    path = Path(path)
    for name, read in reads:
        if _same_file(path, read):
            raise UserError(path, f"is also an input of this command ({name}); "
                                  f"give {option} another file")
    _check_folder(path, make_folder)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as e:
        raise UserError(path, f"cannot write it: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise UserError(path, "is a folder or special file; give a file name to write")
    if force or kinds is None:
        return path
    try:
        found = kind_of(path)
    except OSError:  # unreadable: the write itself will say whether it can replace it
        return path
    if found is not None and found not in kinds:
        raise UserError(path, f"holds {KIND_NAMES[found]}; refusing to replace it with "
                              f"{KIND_NAMES[kinds[0]]} (give --force to overwrite it)")
    return path


def _same_file(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either is missing: nothing read is overwritten
        return False


@contextmanager
def made_folder(folder):
    """`folder` made (and its missing parents) for the block, so that a lock can be taken
    in it before anything is written; those made are removed again if the block leaves
    them empty (a command refused)."""
    missing, folder = [], Path(folder)
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    if missing:
        missing[0].mkdir(parents=True)
    try:
        yield
    finally:
        for made in missing:  # innermost first
            try:
                made.rmdir()
            except OSError:  # it holds what the command wrote
                break


def _check_folder(path: Path, make_folder: bool) -> None:
    """The folder `path` is written in exists (or, with `make_folder`, its nearest
    existing ancestor) and is a writable folder."""
    folder = path.parent
    while make_folder and not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not os.path.lexists(folder):
        raise UserError(path, f"cannot write it: no folder {path.parent}")
    if not folder.is_dir():
        raise UserError(path, f"cannot write it: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(path, f"cannot write it: the folder {folder} is not writable")


# -- .npy arrays, checked before anything is allocated --------------------------------------------

def _npy_layout(stream, path, what: str) -> tuple[tuple, bool, np.dtype]:
    """(shape, Fortran order?, dtype) from the header of the .npy document `stream` is
    at the start of, after checking that it parses and its type is numeric."""
    try:
        version = np.lib.format.read_magic(stream)
    except (ValueError, EOFError):
        raise UserError(path, f"is not a {what}") from None
    try:
        header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = header(stream, max_header_size=1 << 16)
    except (ValueError, SyntaxError, TypeError, KeyError, EOFError, OverflowError,
            tokenize.TokenError) as e:
        raise UserError(path, f"is not a valid {what} ({str(e)[:120]})") from None
    if dtype.hasobject:
        raise UserError(path, "holds an object array; only numeric arrays are supported")
    if dtype.kind not in "biuf":
        raise UserError(path, f"holds {dtype} data; expected numbers")
    if any(d < 0 for d in shape):  # numpy's header parser lets them through
        raise UserError(path, f"is not a valid {what} (its header gives shape {shape})")
    return shape, fortran, dtype


def _check_npy_length(shape, dtype: np.dtype, have: int, path, what: str) -> None:
    need = math.prod(shape) * dtype.itemsize
    if need != have:
        raise UserError(path, f"is not a valid {what} (its header gives shape {shape} of {dtype}, "
                              f"{need} bytes, but it holds {have} bytes of data)")


def read_npy(data: bytes, path, what: str = ".npy file") -> np.ndarray:
    """The array a .npy document holds, after checking that its header parses, its
    type is numeric and its data is exactly as long as its shape says (numpy's
    own reader allocates the shape first and reads afterwards)."""
    stream = io.BytesIO(data)
    shape, fortran, dtype = _npy_layout(stream, path, what)
    _check_npy_length(shape, dtype, len(data) - stream.tell(), path, what)
    array = np.frombuffer(data, dtype, math.prod(shape), stream.tell())
    return array.reshape(shape, order="F" if fortran else "C").copy()


NPY_CHUNK = 1 << 20  # bytes of a .npy file read (and converted) at a time


def read_npy_file(path, what: str = ".npy file", holding=None) -> np.ndarray:
    """The array of a .npy file, checked as read_npy checks it, read a chunk at a
    time straight into the array that holds it: no copy of the file's bytes stays
    behind.  `holding(dtype)` chooses the type of that array from the file's
    (default: the file's own); `holding.convert(src, dst, start)` then stores
    each chunk into it (it may check the chunk, `start` being its first element)."""
    with opened(path, what) as (f, size):
        shape, fortran, stored = _npy_layout(f, path, what)
        _check_npy_length(shape, stored, size - f.tell(), path, what)
        out = np.empty(shape, holding(stored) if holding else stored,
                       order="F" if fortran else "C")
        flat = out.reshape(-1, order="A")  # a view: the elements in the file's order
        direct = out.dtype == stored
        step = max(1, NPY_CHUNK // stored.itemsize)
        chunk = None if direct else np.empty(min(step, flat.size), stored)
        for lo in range(0, flat.size, step):
            part = flat[lo:lo + step] if direct else chunk[:min(step, flat.size - lo)]
            if f.readinto(part.view(np.uint8)) != part.nbytes:
                raise UserError(path, f"is not a valid {what} (it ends early)")
            if not direct:
                holding.convert(part, flat[lo:lo + part.size], lo)
        return out


def read_zip_member(archive: zipfile.ZipFile, name: str, path, limit: int) -> bytes:
    """A member of an archive of `limit` bytes, after checking that its recorded size
    fits the archive (a stored member is never larger than the file)."""
    size = archive.getinfo(name).file_size
    if size > limit:
        raise UserError(path, f"member {name} claims {size} bytes, more than the "
                              f"{limit}-byte file holds")
    return archive.read(name)
