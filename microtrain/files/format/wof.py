"""The weight-only format (.wof): the trainable weights of a circle model.

Layout (little-endian, see schemas/wof.md): uint16 magic 429, uint8 version 1,
uint8 reserved 0, uint32 n_buffers (= tensors in the model's first subgraph),
n_buffers uint32 offsets from the start of the file (0 = no data for that
tensor), then each present tensor's raw data starting on a 16-byte boundary.
"""
import math
import struct

import numpy as np

from microtrain.files.atomic import atomic_write
from microtrain.files.errors import UserError
from microtrain.files.opening import map_regular
from microtrain.files.format.model import int_list, tensor_dtype

MAGIC = 429
VERSION = 1
ALIGN = 16
_HEADER = struct.Struct("<HBBI")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def placement(n_tensors: int, arrays: dict[int, np.ndarray]) -> tuple[dict[int, int], int]:
    """(tensor index -> byte offset, file size) of the .wof wof_to_bytes writes:
    the arrays in the order given (trainconf and microtrain give them in the order
    of the master buffer, so a weight map reads frozen rows in place,
    microtrain/files/weight_map.py), each on a 16-byte boundary."""
    offsets, size = {}, _HEADER.size + 4 * n_tensors  # the file so far: header and offset table
    for index in arrays:
        if not 0 <= index < n_tensors:
            raise ValueError(f"tensor index {index} outside 0..{n_tensors - 1}")
        offsets[index] = _aligned(size)
        size = offsets[index] + np.asarray(arrays[index]).nbytes
    return offsets, size


def wof_to_bytes(n_tensors: int, arrays: dict[int, np.ndarray]) -> bytes:
    """Encode `arrays` (tensor index -> data) for a subgraph of `n_tensors` tensors."""
    offsets, size = placement(n_tensors, arrays)
    out = bytearray(size)
    _HEADER.pack_into(out, 0, MAGIC, VERSION, 0, n_tensors)
    struct.pack_into(f"<{n_tensors}I", out, _HEADER.size,
                     *(offsets.get(i, 0) for i in range(n_tensors)))
    for index, offset in offsets.items():
        a = np.ascontiguousarray(arrays[index])
        blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        out[offset:offset + len(blob)] = blob
    return bytes(out)


def write_wof(path, n_tensors: int, arrays: dict[int, np.ndarray]) -> None:
    atomic_write(path, wof_to_bytes(n_tensors, arrays))


def read_wof(path, model) -> dict[int, np.ndarray]:
    """Read and validate a .wof against `model`; the arrays, shaped and typed as
    their tensors, are read-only views of a map of the file (files.map_regular)."""
    return wof_from_bytes(map_regular(path, ".wof"), model, path)


def wof_from_bytes(data, model, path=None) -> dict[int, np.ndarray]:
    """The arrays of the .wof `data` (views of it), validated against `model`."""
    tensors = model.subgraphs[0].tensors or []
    offsets = _read_offsets(data, len(tensors), path)
    spans = []
    for index, offset in enumerate(offsets):
        if offset:
            spans.append((offset, _span_end(data, tensors, index, offset, path), index))
    _check_overlaps(sorted(spans), tensors, path)
    end = max((e for _, e, _ in spans), default=_HEADER.size + 4 * len(tensors))
    if len(data) != end:
        raise UserError(path, f"{len(data)} bytes, but its tensors end at byte {end}: "
                              "bytes were added or cut")
    arrays = {}
    for offset, _, index in spans:
        t = tensors[index]
        shape = int_list(t.shape)
        arrays[index] = np.frombuffer(data, tensor_dtype(t), int(np.prod(shape)),
                                      offset).reshape(shape)
        _check_finite(arrays[index], f"tensor {index} '{t.name}'", path)
    return arrays


def layout(data) -> tuple[int, tuple[int, ...]] | None:
    """(tensor count, offsets) of a .wof, None when its header or table is cut or
    not a .wof's: for explaining a misfit, not validating it (wof_from_bytes does)."""
    if len(data) < _HEADER.size:
        return None
    magic, version, _, count = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or len(data) < _HEADER.size + 4 * count:
        return None
    return count, struct.unpack_from(f"<{count}I", data, _HEADER.size)


def _check_finite(array: np.ndarray, what: str, path) -> None:
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise UserError(path, f"{what} holds {bad} NaN or inf values; such weights cannot train "
                              "or predict")


def _read_offsets(data, n_tensors: int, path) -> tuple[int, ...]:
    if len(data) < _HEADER.size:
        raise UserError(path, f"truncated: {len(data)} bytes, a .wof header needs {_HEADER.size}")
    magic, version, reserved, count = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise UserError(path, f"not a .wof file: magic number {magic}, expected {MAGIC}")
    if version != VERSION:
        raise UserError(path, f".wof version {version} is not supported (expected {VERSION})")
    if reserved != 0:
        raise UserError(path, f"reserved byte 3 is {reserved}, expected 0")
    if count != n_tensors:
        raise UserError(path, f"holds {count} buffers, but the model's subgraph has "
                              f"{n_tensors} tensors")
    table_end = _HEADER.size + 4 * count
    if len(data) < table_end:
        raise UserError(path, f"truncated: the offset table ends at byte {table_end}, "
                              f"the file has {len(data)} bytes")
    return struct.unpack_from(f"<{count}I", data, _HEADER.size)


def _span_end(data, tensors, index: int, offset: int, path) -> int:
    """End of tensor `index`'s data, after checking that it lies in the file."""
    t = tensors[index]
    what = f"tensor {index} '{t.name}'"
    if offset % ALIGN:
        raise UserError(path, f"{what}: offset {offset} is not a multiple of {ALIGN}")
    header_end = _HEADER.size + 4 * len(tensors)
    if offset < header_end:
        raise UserError(path, f"{what}: offset {offset} points into the header, "
                              f"which ends at byte {header_end}")
    shape = int_list(t.shape)
    if any(d < 0 for d in shape):
        raise UserError(path, f"{what}: the model gives it shape {shape}, with a dimension < 0")
    if 0 in shape:  # nothing to train, and numpy refuses such a shape when its other dims are huge
        raise UserError(path, f"{what}: the model gives it shape {shape}, with no elements")
    dtype = tensor_dtype(t)
    size = math.prod(shape) * dtype.itemsize
    if offset + size > len(data):
        raise UserError(path, f"{what}: shape {shape} of {dtype.name} needs {size} bytes at "
                              f"offset {offset}, but the file ends at byte {len(data)}")
    return offset + size


def _check_overlaps(spans, tensors, path) -> None:
    for (start_a, end_a, a), (start_b, end_b, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise UserError(path, f"tensor {b} '{tensors[b].name}' (bytes {start_b}-{end_b}) "
                                  f"overlaps tensor {a} '{tensors[a].name}' "
                                  f"(bytes {start_a}-{end_a})")
