"""The fp32 master buffer of the trainable weights, and where it reads the .wof in place.

The master buffer is [frozen rows | trained elements | frozen rows]: a weight
trained only in some rows keeps its frozen rows just before (or after) the
trained elements, so that the graphs read one contiguous tensor.  Only the
trained elements need RAM.  When some weight has frozen rows, the buffer is a
private (copy-on-write) map of the .wof placed so that this weight's bytes are
the file's: its frozen rows are read in place (file-backed pages, never
written), and only the pages the runtime writes (the trained elements, and
weights that lie elsewhere in the file, copied in) become memory of the process.
"""
import mmap
from dataclasses import dataclass

import numpy as np

from microtrain.files.opening import FileMap, opened

FLOAT = np.dtype(np.float32)  # the .wof's master weights


def layout(weights: dict[int, np.ndarray], spans: dict[int, tuple[int, int]]
           ) -> tuple[dict[int, int], int]:
    """(weight -> its first element in the master buffer, the buffer's elements)
    for the trained elements `spans` of `weights` (in buffer order)."""
    if not spans:  # nothing trains (a model run as it is)
        return {}, 0
    starts, at = {}, 0
    for t, (lo, hi) in spans.items():
        starts[t] = at - lo  # its frozen rows before `lo` lie just before
        at += hi - lo
    first, last = next(iter(spans)), list(spans)[-1]
    lead = spans[first][0]
    tail = weights[last].size - spans[last][1]
    return {t: s + lead for t, s in starts.items()}, lead + at + tail


@dataclass
class WeightMap:
    """How the master buffer maps the .wof."""
    offset: int  # the file byte of the buffer's first element
    in_place: set  # weights whose bytes in the map are the file's own (nothing copied)
    frozen: int  # their frozen elements, read in place

    def mapped_bytes(self, elements: int) -> int:
        """Bytes of the map of a buffer of `elements` (it starts on a page boundary)."""
        return self.offset % mmap.ALLOCATIONGRANULARITY + elements * FLOAT.itemsize

    def read_only_bytes(self) -> int:
        """Bytes of the map never written: the page's bytes before the buffer and
        the frozen rows read in place."""
        return self.offset % mmap.ALLOCATIONGRANULARITY + self.frozen * FLOAT.itemsize

    def written_bytes(self, elements: int) -> int:
        """Bytes of the map the runtime writes, so memory: the trained elements and
        the weights copied in."""
        return self.mapped_bytes(elements) - self.read_only_bytes()


def weight_map(weights: dict[int, np.ndarray], spans: dict[int, tuple[int, int]],
               offsets: dict[int, int], file_size: int) -> WeightMap | None:
    """The map of the .wof (whose weights lie at byte `offsets`) that reads the
    frozen rows of the first partly trained weight in place; None when every
    weight trains whole, or such a map would not lie within the file."""
    partial = [t for t, (lo, hi) in spans.items() if hi - lo < weights[t].size]
    if not partial or not offsets or any(weights[t].dtype != FLOAT for t in spans):
        return None
    starts, elements = layout(weights, spans)
    offset = offsets[partial[0]] - starts[partial[0]] * FLOAT.itemsize
    if offset < 0 or offset + elements * FLOAT.itemsize > file_size:
        return None
    in_place = {t for t in spans if offsets[t] == offset + starts[t] * FLOAT.itemsize}
    frozen = sum(weights[t].size - (hi - lo) for t, (lo, hi) in spans.items() if t in in_place)
    return WeightMap(offset, in_place, frozen)


def map_buffer(path, wmap: WeightMap, elements: int) -> np.ndarray:
    """The master buffer of `elements` float32 as the private map `wmap` of the
    .wof at `path`: the weights of `wmap.in_place` already hold their values."""
    skip = wmap.offset % mmap.ALLOCATIONGRANULARITY
    with opened(path, ".wof") as (f, _):
        private = FileMap(f.fileno(), wmap.mapped_bytes(elements), access=mmap.ACCESS_COPY,
                          offset=wmap.offset - skip)
    private.written = wmap.written_bytes(elements)
    return np.frombuffer(private, FLOAT, elements, skip)
