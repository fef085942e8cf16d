"""The runtime side of the memory plan (schemas/memory.md), and a count of the
bytes the runtime holds.

`trainconf split` places every activation, gradient and target of the training
step in one arena: a byte offset `a*B + c` per tensor, valid for every batch
size B.  The arena is allocated once; each planned tensor is a view at its
offset, shaped [B, ...], so the leading-rows views of a partial batch stay
contiguous.
"""
import functools
import math
import os
import types

import numpy as np

try:
    import resource
except ImportError:  # not POSIX
    resource = None

from microtrain.files.contracts import MemoryPlan
from microtrain.files.errors import UserError
from microtrain.files.opening import FileMap
from microtrain.files.graph import Graph, concrete_shape

START_ALIGN = 64  # the arena's first byte; the plan aligns offsets within it


def physical_memory() -> int:
    """Bytes of memory of this machine (a TiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def memory_limit() -> int:
    """Bytes this process may allocate: the machine's memory, or less where a limit
    says so (ulimit -v / -d, a cgroup's memory.max), so that a size read from a
    file is refused in one line rather than failing inside numpy."""
    limits = [physical_memory()]
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        soft = resource.getrlimit(getattr(resource, name))[0] if resource else -1
        if soft > 0:  # RLIM_INFINITY is -1
            limits.append(soft)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limits.append(int(f.read()))
    except (OSError, ValueError):  # no cgroup v2 limit ("max")
        pass
    return min(limits)


def linear(form, batch: int) -> int:
    """The value a*batch + c of a linear form [a, c]."""
    a, c = form
    return int(a) * batch + int(c)


class Arena:
    """One zeroed byte buffer holding every planned tensor for `batch` rows."""

    def __init__(self, plan: MemoryPlan, batch: int, path=None):
        self.plan, self.batch, self.path = plan, batch, path
        size = linear(plan.arena, batch)
        raw = np.zeros(size + START_ALIGN, np.uint8)
        start = -raw.ctypes.data % START_ALIGN
        self.bytes = raw[start:start + size]

    def views(self, g: Graph, graph: str, dtype_of) -> dict[int, np.ndarray]:
        """Arrays of the tensors of `g` that the plan places (`graph` names the
        plan's list: "forward" or "backprop"); `dtype_of` maps a declared dtype to
        the runtime's."""
        views = {}
        for t, a, c in getattr(self.plan, graph):
            if not 0 <= t < len(g.tensors):
                raise UserError(self.path, f"memory plan: {graph} tensor {t} does not exist")
            tensor = g.tensors[t]
            shape, dtype = concrete_shape(tensor.shape, self.batch), np.dtype(dtype_of(tensor.dtype))
            lo = linear((a, c), self.batch)
            hi = lo + math.prod(shape) * dtype.itemsize
            if lo < 0 or hi > self.bytes.size or lo % dtype.itemsize:
                raise UserError(self.path, f"memory plan: {graph} tensor {t} ({tensor.name}) "
                                           f"at bytes {lo}..{hi} does not fit the arena of "
                                           f"{self.bytes.size} bytes")
            views[t] = self.bytes[lo:hi].view(dtype).reshape(shape)
        return views


# -- what the runtime holds ----------------------------------------------------------------------

def _owner(a: np.ndarray):
    """The object that owns an array's memory and its size in bytes (a view's
    base chain ends at an array that owns its data, or at a bytes-like object)."""
    base = a
    while getattr(base, "base", None) is not None:  # also as_strided's wrapper
        base = base.base
    while isinstance(base, memoryview):  # np.frombuffer makes one per array
        base = base.obj
    return base, base.nbytes if isinstance(base, np.ndarray) else memoryview(base).nbytes


_OPAQUE = (type, types.ModuleType, str, bytes, bytearray, int, float, complex, bool,
           np.dtype, np.ufunc)


def _children(obj):
    """The objects `obj` keeps alive that may lead to arrays: container items,
    closure cells, partial arguments, bound instances and instance attributes."""
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, functools.partial):
        return [obj.func, obj.args, obj.keywords]
    if isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None]
        return cells + list(obj.__defaults__ or ())
    if isinstance(obj, (types.MethodType, types.BuiltinMethodType)):
        return [obj.__self__]
    if isinstance(obj, _OPAQUE):
        return []
    attrs = getattr(obj, "__dict__", None)
    return list(attrs.values()) if isinstance(attrs, dict) else []


def _read_only(owner, size: int) -> int:
    """The bytes of a memory block that are a file's, read in place: those of a
    map of a file that are never written (files.FileMap)."""
    return size - owner.written if isinstance(owner, FileMap) else 0


def _owners(root, visited: dict, read_only: bool) -> dict[int, int]:
    """Owner id -> bytes in RAM (or, `read_only`, bytes of files read in place) of
    every array reachable from `root`, skipping objects already in `visited` (id
    -> object, kept so that ids stay unique)."""
    found, stack = {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited[id(obj)] = obj
        if isinstance(obj, np.ndarray):
            owner, size = _owner(obj)
            visited.setdefault(id(owner), owner)
            file_bytes = _read_only(owner, size)
            found[id(owner)] = file_bytes if read_only else size - file_bytes
        else:
            stack.extend(_children(obj))
    return found


def held_by(roots: dict, exclude=(), read_only: bool = False) -> dict[str, int]:
    """Bytes of RAM the arrays reachable from each named root hold (`read_only`:
    bytes of files they read in place, through read-only maps), each memory
    block counted once (under the first root that reaches it) and none reachable
    from `exclude`."""
    visited: dict = {}
    counted = set(_owners(exclude, visited, read_only))
    result = {}
    for name, root in roots.items():
        owners = {k: v for k, v in _owners(root, visited, read_only).items() if k not in counted}
        counted.update(owners)
        result[name] = sum(owners.values())
    return result


def held_bytes(root, exclude=(), read_only: bool = False) -> int:
    """Bytes of RAM every array reachable from `root` holds (each memory block
    once); `read_only`: bytes of the files they read in place."""
    return held_by({"all": root}, exclude, read_only)["all"]
