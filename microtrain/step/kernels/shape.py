"""Shape kernels: data movement with every index worked out in the factory.

Constant inputs (RESHAPE's shape, PAD's paddings, SLICE's begin and size,
TRANSPOSE's perm, MEAN's axis) never change between calls, so the factories
read their values at build time.
"""
from functools import partial
from math import prod

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.step.kernels import kernel
from microtrain.step.kernels.activations import noop, then_activate
from microtrain.step.kernels.workspace import scratch


def _check_shape(op, view, y):
    if view.shape != y.shape:
        raise OperatorError(None, f"{op}: computed shape {view.shape} but the output is {y.shape}")


@kernel("RESHAPE", in_place=True)
@kernel("SQUEEZE", in_place=True)
@kernel("EXPAND_DIMS")
def reshape(inputs, outputs, **_):
    """y = x with y's shape (the output's shape is authoritative): a copy, or
    nothing when x and y already share their memory."""
    x, (y,) = inputs[0], outputs
    if x.size != y.size:
        raise OperatorError(None, f"RESHAPE: {x.shape} does not hold {y.size} elements")
    if x.ctypes.data == y.ctypes.data and x.dtype == y.dtype:
        return noop
    return partial(np.copyto, y, x.reshape(y.shape))


@kernel("SHAPE")
def shape(inputs, outputs, **_):
    """y = the shape of x, at the batch size this step runs (a converter's run-time
    shape computation, which `trainconf split` folds, in a model run as it is)."""
    (x,), (y,) = inputs, outputs
    dims = np.array(x.shape, y.dtype)
    return partial(np.copyto, y, dims)


@kernel("PACK")
def pack(inputs, outputs, axis=0, **_):
    """y = the inputs stacked along a new axis (a scalar constant may come as one
    element: each input takes the shape of y's slices)."""
    (y,) = outputs
    axis %= y.ndim
    parts = [a.reshape(y.shape[:axis] + y.shape[axis + 1:]) for a in inputs]
    return partial(np.stack, parts, axis=axis, out=y)


@kernel("CONCATENATION")
def concatenation(inputs, outputs, axis=0, fused_activation_function=0, **_):
    """y = act(concatenate(inputs, axis)); axis may be negative."""
    (y,) = outputs
    join = partial(np.concatenate, list(inputs), axis=axis, out=y)
    return then_activate(join, fused_activation_function, y)


def _pad_widths(x, paddings):
    return [(int(before), int(after)) for before, after in np.asarray(paddings).reshape(-1, 2)]


def _interior(y, x, paddings, op):
    """The view of y that holds x when y is x padded by `paddings`."""
    inner = y[tuple(slice(before, before + n)
                    for (before, _), n in zip(_pad_widths(x, paddings), x.shape))]
    _check_shape(op, inner, x)
    return inner


@kernel("PAD")
@kernel("PADV2")
def pad(inputs, outputs, **_):
    """y = x with paddings[i] = (before, after) elements around axis i, of
    value 0 (PAD) or of the constant input 2 (PADV2)."""
    x, paddings = inputs[:2]
    value = float(np.asarray(inputs[2]).reshape(-1)[0]) if len(inputs) > 2 else 0.0
    (y,) = outputs
    inner = _interior(y, x, paddings, "PAD")

    def step():
        y.fill(value)
        np.copyto(inner, x)
    return step


REFLECT, SYMMETRIC = 0, 1  # MirrorPadMode


def _mirrored(a, axis, before, after, n, mode):
    """(border, source) view pairs along `axis` of the padded array a whose
    interior starts at `before` and holds n elements: each border mirrors its
    source (REFLECT skips the edge element, SYMMETRIC repeats it)."""
    skip = 1 if mode == REFLECT else 0
    lead = (slice(None),) * axis

    def view(start, stop, step=1):
        return a[lead + (slice(start, stop, step),)]
    pairs = []
    if before:  # border [0, before) mirrors [before + skip, before + skip + before) reversed
        first = before + skip + before - 1
        pairs.append((view(0, before), view(first, before + skip - 1 if before + skip else None, -1)))
    if after:
        end = before + n  # border [end, end + after) mirrors the elements before end - skip
        last = end - 1 - skip
        stop = last - after
        pairs.append((view(end, end + after), view(last, stop if stop >= 0 else None, -1)))
    return pairs


@kernel("MIRROR_PAD")
def mirror_pad(inputs, outputs, mode=REFLECT, **_):
    """y = x padded by mirror images of itself, axis after axis (each axis's
    borders copy from the already padded earlier axes)."""
    x, paddings = inputs[:2]
    (y,) = outputs
    inner = _interior(y, x, paddings, "MIRROR_PAD")
    pairs = [pair for axis, ((before, after), n) in enumerate(zip(_pad_widths(x, paddings), x.shape))
             for pair in _mirrored(y, axis, before, after, n, mode)]

    def step():
        np.copyto(inner, x)
        for border, source in pairs:
            np.copyto(border, source)
    return step


@kernel("MirrorPadGrad")
def mirror_pad_grad(inputs, outputs, mode=REFLECT, **_):
    """dX = the interior of dY plus each border of dY added onto the elements
    it mirrored, folding the axes back in reverse order."""
    dy, paddings = inputs[:2]
    (dx,) = outputs
    acc = scratch(dy.shape, dy.dtype)
    widths = _pad_widths(dx, paddings)
    pairs = [pair for axis in reversed(range(dx.ndim))
             for pair in _mirrored(acc, axis, *widths[axis], dx.shape[axis], mode)]
    inner = _interior(acc, dx, paddings, "MirrorPadGrad")

    def step():
        np.copyto(acc, dy)
        for border, source in pairs:
            np.add(source, border, out=source)
        np.copyto(dx, inner)
    return step


@kernel("SLICE")
def slice_(inputs, outputs, **_):
    """y = x[begin : begin + size] per axis; size -1 runs to the end."""
    x, begin, size = inputs[:3]
    (y,) = outputs
    view = x[tuple(slice(b, None if s == -1 else b + s)
                   for b, s in zip(begin.tolist(), size.tolist()))]
    _check_shape("SLICE", view, y)
    return partial(np.copyto, y, view)


@kernel("TRANSPOSE")
def transpose(inputs, outputs, **_):
    """y = x with its axes permuted: y.shape[i] = x.shape[perm[i]]."""
    x, perm = inputs[:2]
    (y,) = outputs
    view = x.transpose(perm.tolist())
    _check_shape("TRANSPOSE", view, y)
    return partial(np.copyto, y, view)


def _blocks(deep, block_size):
    """The NHWC array `deep` [N, H, W, b*b*C] as [N, H, b, W, b, C] (a view
    ordered like its pixels after DEPTH_TO_SPACE) and [N, H, W, b, b, C]."""
    n, h, w, c = deep.shape
    b = block_size
    return (n, h, b, w, b, c // (b * b)), (0, 1, 3, 2, 4, 5)


@kernel("DEPTH_TO_SPACE")
def depth_to_space(inputs, outputs, block_size=1, **_):
    """y[n, h·b+i, w·b+j, c] = x[n, h, w, (i·b+j)·C + c], b = block_size."""
    (x,), (y,) = inputs, outputs
    shape, order = _blocks(x, block_size)
    view = y.reshape(shape).transpose(order)
    return partial(np.copyto, view, x.reshape(view.shape))


@kernel("SPACE_TO_DEPTH")
def space_to_depth(inputs, outputs, block_size=1, **_):
    """The inverse of DEPTH_TO_SPACE: y[n, h, w, (i·b+j)·C + c] = x[n, h·b+i, w·b+j, c]."""
    (x,), (y,) = inputs, outputs
    shape, order = _blocks(y, block_size)
    view = x.reshape(shape).transpose(order)
    return partial(np.copyto, y.reshape(view.shape), view)


def strided_index(rank, begin, end, strides, begin_mask=0, end_mask=0, ellipsis_mask=0,
                  new_axis_mask=0, shrink_axis_mask=0, offset=False, **_):
    """STRIDED_SLICE's selection as a numpy index (slices, ints, None, Ellipsis)
    over an array of `rank` axes.  Python slices clamp and wrap negative bounds
    as TFLite does; a shrunk axis is an int, a new axis None; with `offset`,
    end is relative to begin."""
    index = []
    for i, (b, e, s) in enumerate(zip(*(np.asarray(v).reshape(-1).tolist()
                                        for v in (begin, end, strides)))):
        bit = 1 << i
        if ellipsis_mask & bit:
            index.append(Ellipsis)
        elif new_axis_mask & bit:
            index.append(None)
        elif shrink_axis_mask & bit:
            index.append(b)
        else:
            stop = None if end_mask & bit else (b + e if offset else e)
            index.append(slice(None if begin_mask & bit else b, stop, s))
    if Ellipsis not in index and len(index) - index.count(None) > rank:
        raise ValueError(f"STRIDED_SLICE: {len(index)} axes given for rank {rank}")
    return tuple(index)


def _strided_view(x, y_shape, begin, end, strides, options):
    index = strided_index(x.ndim, begin, end, strides, **options)
    # a trailing Ellipsis keeps a selection of one element a view (not a copy of its
    # value now), so the step reads what x holds when it runs
    view = x[index if Ellipsis in index else index + (Ellipsis,)]
    if view.size != prod(y_shape):
        raise ValueError(f"STRIDED_SLICE: selects {view.shape} but the output is {tuple(y_shape)}")
    return view


@kernel("STRIDED_SLICE")
def strided_slice(inputs, outputs, **options):
    """y = x[begin:end:strides] per axis, with TFLite's masks (see strided_index)."""
    x, begin, end, strides = inputs[:4]
    (y,) = outputs
    view = _strided_view(x, y.shape, begin, end, strides, options)
    return partial(np.copyto, y.reshape(view.shape), view)


@kernel("StridedSliceGrad")
def strided_slice_grad(inputs, outputs, **options):
    """dX = 0 except dX[begin:end:strides] = dY (one selected element gets one dY)."""
    dy, begin, end, strides = inputs[:4]
    (dx,) = outputs
    view = _strided_view(dx, dy.shape, begin, end, strides, options)
    dy_view = dy.reshape(view.shape)

    def step():
        dx.fill(0)
        np.copyto(view, dy_view)
    return step


def _parts(total, axis, size_splits=None, num_splits=1):
    """(start, stop) of each part along axis; one size of size_splits may be -1."""
    if size_splits is None:
        sizes = [total // num_splits] * num_splits
    else:
        sizes = [int(n) for n in np.asarray(size_splits).reshape(-1)]
        if -1 in sizes:
            sizes[sizes.index(-1)] = total - sum(n for n in sizes if n != -1)
    ends = np.cumsum([0] + sizes).tolist()
    if ends[-1] != total:
        raise ValueError(f"SPLIT: parts {sizes} do not add up to {total}")
    return list(zip(ends, ends[1:]))


def _split(x, outputs, axis, **parts):
    axis = int(np.asarray(axis).reshape(-1)[0]) % x.ndim
    lead = (slice(None),) * axis
    views = [x[lead + (slice(a, b),)] for a, b in _parts(x.shape[axis], axis, **parts)]
    for view, y in zip(views, outputs):
        _check_shape("SPLIT", view, y)
    copies = [partial(np.copyto, y, view) for y, view in zip(outputs, views)]

    def step():
        for copy in copies:
            copy()
    return step


@kernel("SPLIT")
def split(inputs, outputs, num_splits=1, **_):
    """outputs = x (input 1) cut into num_splits equal parts along axis (input 0)."""
    axis, x = inputs[:2]
    return _split(x, outputs, axis, num_splits=num_splits)


@kernel("SPLIT_V")
def split_v(inputs, outputs, **_):
    """outputs = x cut along axis (input 2) into parts of size_splits (input 1)."""
    x, sizes, axis = inputs[:3]
    return _split(x, outputs, axis, size_splits=sizes)


@kernel("SplitGrad")
def split_grad(inputs, outputs, axis=0, sizes=(), **_):
    """dX = the dY of each part (input i, or zeros where it is absent) joined along axis."""
    (dx,) = outputs
    axis %= dx.ndim
    lead = (slice(None),) * axis
    views = [dx[lead + (slice(a, b),)] for a, b in _parts(dx.shape[axis], axis, size_splits=sizes)]
    steps = [partial(np.copyto, view, dy) if dy is not None else partial(view.fill, 0)
             for view, dy in zip(views, inputs)]

    def step():
        for part in steps:
            part()
    return step


def _gather_index(x, indices, axis):
    """(axis, flat indices, shape of the gather with flat indices).  The indices
    are checked at each call, never here: before the first call the arena may
    hold another tensor's bytes where computed indices will be."""
    axis %= x.ndim
    flat = indices.reshape(-1)
    return axis, flat, x.shape[:axis] + (flat.size,) + x.shape[axis + 1:]


def _check_indices(flat, size):
    """Indices outside [0, size) are refused, never wrapped or clipped (the data
    loader refuses such ids in its files first, naming the file and sample)."""
    if flat.size and not (0 <= flat.min() and flat.max() < size):
        bad = flat[(flat < 0) | (flat >= size)][0]
        raise OperatorError(None, f"index {bad} outside the {size} rows of its table")


def _take(table, indices, y, axis):
    """y = table's slices at `indices` along axis, read at every call."""
    axis, flat, flat_shape = _gather_index(table, indices, axis)
    if prod(flat_shape) != y.size:
        raise ValueError(f"gathers {flat_shape} but the output is {y.shape}")
    out, size = y.reshape(flat_shape), table.shape[axis]

    def step():
        _check_indices(flat, size)
        np.take(table, flat, axis=axis, out=out, mode="clip")
    return step


@kernel("GATHER")
def gather(inputs, outputs, axis=0, batch_dims=0, **_):
    """y = x's slices at `indices` along axis (batch_dims 0)."""
    if batch_dims:
        raise ValueError("GATHER: batch_dims other than 0 is not supported")
    return _take(inputs[0], inputs[1], outputs[0], axis)


@kernel("EMBEDDING_LOOKUP")
def embedding_lookup(inputs, outputs, **_):
    """y = the table's rows at the ids (ids at input 0, the table at input 1)."""
    return _take(inputs[1], inputs[0], outputs[0], 0)


# Ids repeated at most this often are summed in layers (see scatter_add_rows).
LAYERS = 8


def scatter_add_rows(dx, ids, rows, compact=False):
    """dx[k] = the sum of rows[i] over the i with ids[i] == k, for each id k
    (other rows of dx are left as they are); `compact`: the sums go to dx's
    leading rows instead, in increasing id order.  Returns the distinct ids,
    sorted.  The ids are sorted; each id's first row is copied, and its later
    rows added a layer at a time (the k-th occurrences of all ids: distinct ids,
    so one fancy-indexed add each) when no id repeats more than LAYERS times
    (token ids in a large vocabulary: ~2x faster than reduceat on [1024, 64]
    rows of 2000 ids), else each run of repeats is summed by one reduceat
    (np.add.at takes ~3x as long on [2048, 64] rows)."""
    order = np.argsort(ids, kind="stable")
    ranked = ids[order]
    first = np.empty(ranked.size, bool)
    first[:1] = True
    np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    counts = np.diff(starts, append=ranked.size)
    distinct = ranked[starts]
    at = np.arange(distinct.size) if compact else distinct
    if counts.max(initial=0) <= LAYERS:
        run = np.repeat(np.arange(distinct.size), counts)  # each sorted row's id, as a run number
        occurrence = np.arange(ranked.size) - starts[run]
        dx[at] = rows[order[first]]
        for k in range(1, int(counts.max(initial=0))):
            layer = occurrence == k
            dx[at[run[layer]]] += rows[order[layer]]
        return distinct
    once = counts == 1
    dx[at[once]] = rows[order[starts[once]]]
    repeated = counts[~once]
    members = order[np.repeat(~once, counts)]
    offsets = np.cumsum(repeated) - repeated
    dx[at[~once]] = np.add.reduceat(rows[members], offsets, axis=0)
    return distinct


@kernel("GatherGrad")
def gather_grad(inputs, outputs, axis=0, **_):
    """dX = 0 with each dY slice added at its index along axis (repeated
    indices add up); the indices are read at every call (token ids)."""
    dy, indices = inputs[:2]
    (dx,) = outputs
    axis, flat, flat_shape = _gather_index(dx, indices, axis)
    rows = np.moveaxis(dy.reshape(flat_shape), axis, 0)
    table = np.moveaxis(dx, axis, 0)

    def step():
        _check_indices(flat, table.shape[0])
        dx.fill(0)
        scatter_add_rows(table, flat, rows)
    return step


@kernel("GatherRowsGrad")
def gather_rows_grad(inputs, outputs, rows=0, axis=0, **_):
    """GatherGrad of a table of `rows` rows kept as the rows the indices touched:
    outputs[0] the distinct indices (sorted), outputs[1] their summed dY rows,
    outputs[2] how many (their leading entries hold them).  A lazy update reads
    these instead of a whole table's gradient, so no step passes over the table."""
    dy, indices = inputs[:2]
    ids, sums, count = outputs
    if axis:
        raise ValueError("a table's rows are gathered along axis 0")
    flat = indices.reshape(-1)
    dy_rows = dy.reshape((flat.size,) + sums.shape[1:])
    if min(rows, flat.size) > len(ids):
        raise ValueError(f"{flat.size} indices may touch more rows than the {len(ids)} held")

    def step():
        _check_indices(flat, rows)
        touched = scatter_add_rows(sums, flat, dy_rows, compact=True)
        ids[:touched.size] = touched
        count[0] = touched.size
    return step


@kernel("REVERSE_V2")
def reverse_v2(inputs, outputs, **_):
    """y = x with the order of its elements reversed along each constant axis (input 1)."""
    x, axis = inputs[:2]
    (y,) = outputs
    return partial(np.copyto, y, np.flip(x, tuple(np.asarray(axis).reshape(-1).tolist())))


@kernel("BROADCAST_TO")
def broadcast_to(inputs, outputs, **_):
    """y = x broadcast (numpy rules) to y's shape (the constant input 1)."""
    x, (y,) = inputs[0], outputs
    try:
        view = np.broadcast_to(x, y.shape)
    except ValueError:
        raise OperatorError(None, f"BROADCAST_TO: {x.shape} does not broadcast to {y.shape}") \
            from None
    return partial(np.copyto, y, view)


def tile_axes(shape, multiples) -> tuple[list[int], list[int]]:
    """(y's shape with each tiled axis split in two, [multiple, size], and the
    positions of the multiples in it): TILE's output as copies of x along new axes."""
    split, copies = [], []
    for n, m in zip(shape, multiples):
        if m != 1:
            copies.append(len(split))
            split.append(int(m))
        split.append(n)
    return split, copies


@kernel("TILE")
def tile(inputs, outputs, **_):
    """y = x repeated multiples[i] times along each axis i (constant input 1)."""
    x, multiples = inputs[:2]
    (y,) = outputs
    times = np.asarray(multiples).reshape(-1).tolist()
    split, copies = tile_axes(x.shape, times)
    tiled = tuple(d * m for d, m in zip(x.shape, times))
    if tiled != y.shape:
        raise OperatorError(None, f"TILE: tiles {x.shape} to {tiled} but the output is {y.shape}")
    return partial(np.copyto, y.reshape(split), np.expand_dims(x, tuple(copies)))
