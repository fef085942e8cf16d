"""Scratch memory shared by the kernels of a training step.

A kernel's temporaries (gathered windows, padded copies, products, masks,
rounding buffers) hold nothing from one call of its closure to the next, and
the closures of a step run one at a time.  So every kernel lays its
temporaries out from the start of one shared buffer: one kernel's never
overlap each other, different kernels' do, and the step's scratch costs the
largest kernel's need instead of the sum over all kernels.

Factories ask for temporaries with `scratch`; what must persist between calls
(index arrays, constants) stays in arrays of their own, or, when the steps of
other batch sizes can share it, comes from `kept`.  Without a workspace in use
(`sharing`), both give arrays of their own.  A `compact` workspace (a split for
a memory budget) asks factories to trade speed for less memory (`compact()`):
no index arrays or pre-broadcast constants the size of an activation, and
convolutions' window matrices filled and multiplied a tile of output rows at a
time (`row_tiles`, tiles of the workspace's `tile` bytes; depthwise ones as many
whole images at a time as a tile holds), so that the scratch does not grow with
the batch.
"""
import mmap
from contextlib import contextmanager
from contextvars import ContextVar
from math import prod

import numpy as np

ALIGN = 64  # each temporary starts on a cache line (the buffer on a page)
TILE_BYTES = 64 << 10  # a compact workspace's largest tile (smaller: more numpy calls a step)
SAMPLE_TILE_BYTES = 8 << 10  # its tile per sample of the batch it is planned for


def tile_bytes(batch: int) -> int:
    """The tile of a compact workspace planned for steps of `batch` samples: 8 KiB
    a sample, at most 64 KiB, so that a batch-1 step's scratch is a few KB and a
    large batch's tiles are few (8 KiB tiles cost 2.6x the step time at batch 32,
    64 KiB 1.17x: MobileNetV2-0.35, Adam)."""
    return min(TILE_BYTES, SAMPLE_TILE_BYTES * batch)


def _aligned_bytes(size: int) -> np.ndarray:
    """`size` bytes in a mapping of their own (page-aligned, returned to the system
    when dropped): the measuring pass drops buffers of up to twice the need, and
    glibc raises its mmap threshold to the size of each large block freed, which
    would leave the arrays allocated afterwards in heap memory it keeps."""
    return np.frombuffer(mmap.mmap(-1, size), np.uint8) if size else np.empty(0, np.uint8)


class Workspace:
    """One byte buffer from which each kernel's temporaries are laid out.

    A kernel asking for more than the buffer holds gets a view of a larger
    buffer and raises `need`; `grow` then sizes the buffer to the need, and
    closures built over it again share it."""

    def __init__(self, size: int = 0, tile: int | None = None):
        self.buffer = _aligned_bytes(size)
        self.tile = tile  # None: the kernels' fastest layouts; bytes: compact, tiles this large
        self.need = 0  # the most bytes one kernel asked for
        self._offset = 0
        self._outgrown = False  # closures since the last `grow` hold views of smaller buffers
        self.kept: dict = {}  # see `kept`

    def begin(self) -> None:
        """Lay out the next kernel's temporaries from the buffer's start."""
        self._offset = 0

    def take(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        start = self._offset
        end = start + prod(shape) * dtype.itemsize
        self._offset = -(-end // ALIGN) * ALIGN
        self.need = max(self.need, end)
        if end > self.buffer.size:  # double it: a measuring pass then holds about 2x the need
            self.buffer = _aligned_bytes(max(end, 2 * self.buffer.size))
            self._outgrown = True
        return self.buffer[start:end].view(dtype).reshape(shape)

    def grow(self) -> bool:
        """Size the buffer to the largest need seen; whether it had to grow since the
        last call (then the closures built since hold views of smaller buffers and
        must be built again)."""
        if not self._outgrown:
            return False
        self.buffer = _aligned_bytes(self.need)
        self._outgrown = False
        return True


_IN_USE: ContextVar[Workspace | None] = ContextVar("workspace", default=None)


@contextmanager
def sharing(workspace: Workspace | None):
    """Kernels built inside take their temporaries from `workspace` (None:
    arrays of their own)."""
    token = _IN_USE.set(workspace)
    try:
        yield workspace
    finally:
        _IN_USE.reset(token)


def begin_kernel() -> None:
    """Called before building each closure (kernels/__init__.build, the fp16
    rounding): its temporaries may overlap those of the closures built before.
    A factory must therefore not build another closure while it takes scratch."""
    workspace = _IN_USE.get()
    if workspace is not None:
        workspace.begin()


def compact() -> bool:
    """Whether the kernels being built should hold as little memory as they can,
    at some cost in speed (see the module's docstring)."""
    workspace = _IN_USE.get()
    return workspace is not None and workspace.tile is not None


def kept(key, shape, dtype, make) -> np.ndarray:
    """An array that persists between calls, shared by the steps of every batch
    size: `make(shape)` makes it (constants, index arrays, or temporaries of
    closures that run outside the step, as the metrics) and the same `key` with
    the same shape after the first axis gets the leading rows of the largest
    one made, so the step of a partial batch holds no copy of its own."""
    workspace = _IN_USE.get()
    shape, dtype = tuple(shape), np.dtype(dtype)
    if workspace is None:
        return make(shape)
    full_key = (key, len(shape), shape[1:], dtype)
    base = workspace.kept.get(full_key)
    if base is None or (shape and base.shape[0] < shape[0]):
        base = workspace.kept[full_key] = make(shape)
    return base[:shape[0]] if shape else base


def scratch(shape, dtype) -> np.ndarray:
    """An uninitialised array for temporaries whose contents need not survive
    from one call of the closure to the next (nor from the factory to the
    first call): other kernels overwrite it in between."""
    workspace = _IN_USE.get()
    return np.empty(shape, dtype) if workspace is None else workspace.take(tuple(shape), dtype)


def row_tile_bytes() -> int:
    """The bytes of the compact workspace's tiles (TILE_BYTES without one)."""
    workspace = _IN_USE.get()
    return workspace.tile if workspace is not None and workspace.tile else TILE_BYTES


def row_tiles(rows: int, row_bytes: int) -> list[range]:
    """`rows` rows split into consecutive tiles of about equal height, each of at
    most the compact workspace's tile bytes (one row if a row is larger)."""
    tile = row_tile_bytes()
    count = -(-rows // max(1, tile // max(row_bytes, 1)))
    bounds = [rows * i // count for i in range(count + 1)]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def in_turn(makers) -> list:
    """The closures `make()` for each of `makers`, built so that each one's
    temporaries start where the first one's do: for closures one step runs one
    after another (a kernel's tiles), which then take the scratch of the
    largest, not of all."""
    workspace = _IN_USE.get()
    if workspace is None:
        return [make() for make in makers]
    start = end = workspace._offset
    steps = []
    for make in makers:
        workspace._offset = start
        steps.append(make())
        end = max(end, workspace._offset)
    workspace._offset = end
    return steps
