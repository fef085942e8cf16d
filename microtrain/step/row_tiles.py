"""Running an operator on its batch a few rows at a time.

An operator that treats the rows of its batch separately (`ROWS` in
microtrain/step/kernels) and holds reduced-precision tensors computes in float32
copies of them (microtrain/step/precision.py).  Run a tile of rows at a time, those
copies, and the kernel's own scratch, are a tile's instead of the batch's.
"""
import numpy as np

from microtrain.files.graph import BATCH, Graph, batched
from microtrain.step.kernels import ROWS, in_sequence, prepare
from microtrain.step.kernels.workspace import scratch
from microtrain.step.precision import F32, narrow_work, reduced, store, wide, widen

TILE = 1 << 14  # elements of a batch tensor's float32 copy in one tile


def tile_rows(g: Graph, op, inputs: list, outputs: list) -> int | None:
    """Rows per tile for running `op` a few batch rows at a time (see tiled),
    or None to run it whole: when it holds no reduced-precision tensor, does not
    treat rows separately, or its batch tensors are small."""
    if op.type not in ROWS or not any(
            a is not None and reduced(a.dtype) for a in inputs + outputs):
        return None
    ts = [g.tensors[t] for t in op.inputs if t >= 0] + [g.tensors[t] for t in op.outputs]
    if any(batched(t.shape) and t.shape[0] != BATCH for t in ts):
        return None  # several rows a sample (a sequence's): not cut into samples
    arrays = [a for a in inputs if a is not None] + outputs
    tensors = [(t, a) for t, a in zip(ts, arrays) if t.shape[:1] == (BATCH,)]
    if ROWS[op.type] == "sum" and (len(outputs) != 1
                                   or g.tensors[op.outputs[0]].shape[:1] == (BATCH,)):
        return None
    if not tensors or len({a.shape[0] for _, a in tensors}) > 1:
        return None
    n = tensors[0][1].shape[0]
    per_row = max(a[0].size for _, a in tensors)
    rows = max(1, TILE // per_row)
    if ROWS[op.type] == "sum":  # tiles need a float32 partial sum the size of the output
        whole = sum(a.size for _, a in tensors)
        if rows * whole // n + outputs[0].size >= whole:
            return None
    return rows if rows < n else None


def tiled(g: Graph, op, inputs: list, outputs: list, rows: int, roundings: list, levels: list):
    """One closure running `op` on its batch `rows` rows at a time, so that the
    float32 copies of its reduced-precision tensors (and the kernel's own
    scratch) are those of `rows` rows: the batch-shaped inputs are widened
    (or copied) a tile at a time, and row-wise outputs stored a tile at a
    time, while a sum over the rows (a weight gradient) adds the tiles' sums
    and is stored once.  `roundings`: each output's (precision.Rounding);
    `levels`: each input's graph tensor when it holds a fake quantization's int8
    levels, else None."""
    batch = [t >= 0 and g.tensors[t].shape[:1] == (BATCH,) for t in op.inputs]  # -1: absent
    n = next(a.shape[0] for a, b in zip(inputs, batch) if b)
    tile = lambda a: scratch((rows,) + a.shape[1:], F32)  # noqa: E731
    wide_in = [tile(a) if b else wide(a, t) for a, b, t in zip(inputs, batch, levels)]
    whole_loads = [widen(a, w, t) for a, w, b, t in zip(inputs, wide_in, batch, levels)
                   if not b and w is not a]
    sums = ROWS[op.type] == "sum"
    if sums:
        ((out, rounding),) = zip(outputs, roundings)
        total, part = wide(out), scratch(out.shape, F32)
        wide_out = [part]
    else:
        wide_out = [tile(a) for a in outputs]
    work = narrow_work((rows,) + outputs[0].shape[1:]) if not sums else None
    spans = [(i, min(i + rows, n)) for i in range(0, n, rows)]
    kernels = {}
    for lo, hi in spans:  # one kernel per tile height: whole tiles and the last one
        if hi - lo not in kernels:
            cut = lambda a, k=hi - lo: a if sums and a is part else a[:k]  # noqa: E731
            kernels[hi - lo] = prepare(op.type, [cut(w) if b else w for w, b in
                                                 zip(wide_in, batch)],
                                       [cut(w) for w in wide_out], **op.options)
    tiles = []
    head = lambda w, k: w if len(w) == k else w[:k]  # noqa: E731  (no view per whole tile)
    for lo, hi in spans:
        k = hi - lo
        tiles += [_loader(a[lo:hi], head(w, k), t)
                  for a, w, b, t in zip(inputs, wide_in, batch, levels) if b]
        tiles.append(kernels[k])
        if sums:
            tiles.append(_adder(part, total, first=lo == 0))
        else:
            tiles += [store(head(w, k), a[lo:hi], r, work)
                      for a, w, r in zip(outputs, wide_out, roundings)]
    if sums:
        tiles.append(store(total, out, rounding))
    return in_sequence(whole_loads + [s for s in tiles if s is not None])


def _loader(src: np.ndarray, dst: np.ndarray, levels):
    """Widen or copy one tile of a batch-shaped input into float32 scratch."""
    return widen(src, dst, levels) if reduced(src.dtype) or levels is not None \
        else (lambda: np.copyto(dst, src))


def _adder(part: np.ndarray, total: np.ndarray, first: bool):
    """Add one tile's sum into the total (the first tile's: copy it)."""
    return (lambda: np.copyto(total, part)) if first else (lambda: np.add(total, part, out=total))
