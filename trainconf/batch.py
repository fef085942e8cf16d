"""The batch dimension at split time: made symbolic where the graph allows it, so
that the artifacts train at any batch size.

Every tensor computed from the model's inputs carries the batch in its first
axis, as a symbolic dimension (microtrain.files.graph): -1 for one row per sample, -k
for k rows per sample (a dense layer over a sequence reshapes [B, T, D] into
[B*T, D]: -T).  This module walks the graph once, in execution order, giving
each output its symbolic shape from its inputs' and folding shape computations
(SHAPE -> GATHER -> REDUCE_PROD -> PACK -> RESHAPE) as it goes: their values
then hold the symbolic dimensions too, so a dynamic-batch model's computed
reshape comes out as [-T, D].

A batch-1 model in which an operator works across that first axis (a loop over
a time-major sequence [T, 1, D], a transpose that moves the batch) cannot be
made symbolic: it keeps its batch of 1, and microtrain trains it one sample at
a time (FixedBatch names the operator; the split then leaves the shapes as they
are).  A dynamic-batch model has no such fallback and is refused in one line.
"""
from dataclasses import dataclass
from math import prod

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.graph import Graph, Op, batched

# Operators whose output is the broadcast of their inputs' shapes.
BROADCASTING = frozenset({
    "ADD", "SUB", "MUL", "DIV", "POW", "MAXIMUM", "MINIMUM", "SQUARED_DIFFERENCE",
    "FLOOR_DIV", "FLOOR_MOD", "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL",
    "NOT_EQUAL", "LOGICAL_AND", "LOGICAL_OR", "SELECT_V2", "ADD_N"})


class FixedBatch(Exception):
    """An operator works across the batch axis: the graph keeps its fixed batch."""

    def __init__(self, op: Op, why: str):
        super().__init__(f"operator {op.index} ({op.type}) {why}")


@dataclass
class Walk:
    """What one walk over the graph found."""
    folded: set[int]  # operators computed here, to delete
    values: dict[int, np.ndarray]  # constant value of every tensor, folded ones included

    def constants(self, g: Graph) -> dict[int, np.ndarray]:
        """The value of each folded output that a remaining operator reads."""
        read = {t for op in g.ops if op.index not in self.folded for t in op.inputs}
        produced = {t for i in self.folded for t in g.ops[i].outputs}
        return {t: self.values[t] for t in produced & read}


def infer_batch(g: Graph, folds: dict, symbolic: bool = True) -> Walk:
    """Give every tensor computed from the inputs its symbolic shape (in place, in
    g's tensors; with `symbolic` False the shapes stay the file's) and fold the
    shape computations (`folds`: operator -> value function, trainconf/operators.py).
    Raises FixedBatch where an operator works across the batch axis."""
    for i in g.inputs if symbolic else ():
        t = g.tensors[i]
        if t.shape:
            t.shape = (-1,) + t.shape[1:]
    values = {t.index: t.data for t in g.tensors if t.data is not None}
    folded: set[int] = set()
    for op in g.ops:
        if _foldable(op, folds, values):
            _fold(g, op, folds[op.type], values)
            folded.add(op.index)
            continue
        ins = [g.tensors[t].shape if t >= 0 else None for t in op.inputs]
        if not any(s is not None and batched(s) for s in ins):
            continue  # computed from constants alone: its shape is the file's
        for t, shape in zip(op.outputs, output_shapes(op, ins, g, values)):
            g.tensors[t].shape = shape
    return Walk(folded, values)


def _foldable(op: Op, folds: dict, values: dict) -> bool:
    """A shape computation whose inputs are known (SHAPE: its input's shape; a
    CONCATENATION or GATHER only of integers, a shape's parts: a GATHER of a float
    table is an embedding)."""
    if op.type not in folds:
        return False
    if op.type == "SHAPE":
        return True
    inputs = [values.get(t) for t in op.inputs if t >= 0]
    if any(v is None for v in inputs):
        return False
    return op.type not in ("CONCATENATION", "GATHER") or \
        all(np.issubdtype(v.dtype, np.integer) for v in inputs)


def _fold(g: Graph, op: Op, fn, values: dict) -> None:
    try:
        value = np.asarray(fn(g, op, values))
    except (ValueError, IndexError, TypeError) as e:  # shapes or indices that do not fit
        raise UserError(None, f"operator {op.index} ({op.type}) cannot be folded: {e}") from None
    values[op.outputs[0]] = value
    g.tensors[op.outputs[0]].shape = value.shape


def output_shapes(op: Op, ins: list, g: Graph, values: dict) -> list[tuple[int, ...]]:
    """The symbolic shapes of the outputs of `op`, one of whose inputs has the batch."""
    rule = RULES.get(op.type)
    if op.type in BROADCASTING:
        shape = broadcast(op, [s for s in ins if s is not None])
        return [shape] * len(op.outputs)
    if rule is not None:
        return rule(op, ins, g, values)
    x = next(s for s in ins if s is not None and batched(s))
    return [_rows_kept(op, x, g.tensors[t].shape) for t in op.outputs]


def _rows_kept(op: Op, x: tuple, file_shape: tuple) -> tuple:
    """An output with the rows of its batched input x and, past the first axis, the
    file's dimensions (convolutions, pools, activations, reductions over other axes)."""
    rest = file_shape[1:]
    if any(d < 0 for d in rest):
        raise UserError(None, f"operator {op.index} ({op.type}) has an output of unknown shape "
                              f"{list(file_shape)}")
    return (x[0],) + tuple(rest)


def broadcast(op: Op, shapes: list) -> tuple[int, ...]:
    """numpy's broadcast of symbolic shapes: the batch may meet only 1 or itself."""
    rank = max(len(s) for s in shapes)
    out = []
    for dims in zip(*[(1,) * (rank - len(s)) + tuple(s) for s in shapes]):
        distinct = set(dims) - {1}
        if len(distinct) > 1:
            raise FixedBatch(op, f"broadcasts dimensions {sorted(distinct)} together")
        out.append(distinct.pop() if distinct else 1)
    if any(d < 0 for d in out[1:]):
        raise FixedBatch(op, "moves the batch off the first axis")
    return tuple(out)


def _constant(g: Graph, values: dict, t: int, op: Op, what: str) -> np.ndarray:
    if t not in values:
        raise UserError(None, f"operator {op.index} ({op.type}): its {what} (tensor {t}) is not "
                              "a constant, so the batch cannot be followed through it")
    return np.asarray(values[t]).reshape(-1)


def _axis(op: Op, axis: int, rank: int) -> int:
    return int(axis) % max(rank, 1)


def _not_first(op: Op, axes, rank: int, what: str) -> None:
    if any(_axis(op, a, rank) == 0 for a in np.atleast_1d(axes)):
        raise FixedBatch(op, f"{what} the batch axis")


def reshape_shape(op: Op, x: tuple, target) -> tuple[int, ...]:
    """RESHAPE of x to `target`: the batch goes into the first axis, which holds
    every row of a sample.  The target's first dimension is a -1 to infer, a
    symbolic one from a folded shape computation, or a batch-1 file's rows; one
    inner dimension may be -1 when the first is static."""
    per_sample = -x[0] * prod(x[1:])
    target = [int(d) for d in target]
    if not target:
        raise FixedBatch(op, "reshapes the batch into a scalar")
    first, inner = target[0], target[1:]
    if any(d < 0 for d in inner):
        if first < 0 or sum(d < 0 for d in inner) > 1:
            raise FixedBatch(op, f"reshapes to {target}, with more than one unknown dimension")
        known = first * prod(d for d in inner if d >= 0)
        if not known or per_sample % known:
            raise FixedBatch(op, f"reshapes {per_sample} elements a sample into {target}")
        inner, rows = [per_sample // known if d < 0 else d for d in inner], first
    else:
        size = prod(inner)
        rows = per_sample // size if size else 0
        if not size or rows * size != per_sample or first not in (-1, -rows, rows):
            raise FixedBatch(op, f"reshapes {per_sample} elements a sample into {target}")
    return (-rows,) + tuple(inner)


def _reshape(op, ins, g, values):
    if len(op.inputs) > 1 and op.inputs[1] >= 0:
        target = _constant(g, values, op.inputs[1], op, "shape")
    elif op.options.get("new_shape"):
        target = op.options["new_shape"]
    else:
        target = g.tensors[op.outputs[0]].shape
    return [reshape_shape(op, ins[0], target)]


def _squeeze_expand(op, ins, g, values):
    x = ins[0]
    if op.type == "EXPAND_DIMS":
        axis = int(_constant(g, values, op.inputs[1], op, "axis")[0])
        _not_first(op, [axis], len(x) + 1, "inserts an axis before")
    else:
        dims = op.options.get("squeeze_dims") or [i for i, d in enumerate(x) if d == 1]
        _not_first(op, dims or [1], len(x), "squeezes")
    return [reshape_shape(op, x, g.tensors[op.outputs[0]].shape)]


def _fully_connected(op, ins, g, values):
    x, w = ins[0], g.tensors[op.inputs[1]].shape
    if op.options.get("keep_num_dims"):
        return [x[:-1] + (w[0],)]
    return [(x[0] * prod(x[1:-1]), w[0])]


def _batch_matmul(op, ins, g, values):
    x, y = ins[:2]
    if len(x) < 3 and batched(x) and op.options.get("adj_x") or len(y) < 3 and batched(y):
        raise FixedBatch(op, "multiplies along the batch axis")
    rows = x[-1] if op.options.get("adj_x") else x[-2]
    cols = y[-2] if op.options.get("adj_y") else y[-1]
    if len(x) < 3 and len(y) < 3:
        return [(rows, cols)]
    lead = broadcast(op, [x[:-2] or (1,), y[:-2] or (1,)])
    return [lead + (rows, cols)]


def _transpose(op, ins, g, values):
    perm = [int(p) for p in _constant(g, values, op.inputs[1], op, "permutation")]
    if perm and perm[0] != 0:
        raise FixedBatch(op, "moves the batch axis")
    return [tuple(ins[0][p] for p in perm)]


def _gather(op, ins, g, values):
    params, indices = ins[:2]
    axis = _axis(op, op.options.get("axis", 0), len(params))
    if params is not None and batched(params) and axis == 0:
        raise FixedBatch(op, "gathers along the batch axis")
    if indices is not None and batched(indices):
        if axis != 0 or batched(params):
            raise FixedBatch(op, "gathers batched indices from a batched tensor")
        return [indices + tuple(params[1:])]
    return [params[:axis] + tuple(g.tensors[op.inputs[1]].shape) + params[axis + 1:]]


def _embedding_lookup(op, ins, g, values):
    return [ins[0] + tuple(g.tensors[op.inputs[1]].shape[1:])]


def _along_option(what: str, key: str = "axis", default: int = 0):
    """Operators that work along the axis in an option (concatenation, packing)."""
    def rule(op, ins, g, values):
        x = next(s for s in ins if s is not None and batched(s))
        rank = len(x) + (1 if op.type == "PACK" else 0)
        _not_first(op, [op.options.get(key, default)], rank, what)
        if op.type == "PACK" and any(s != x for s in ins):
            raise FixedBatch(op, "packs tensors of different shapes")
        return [_rows_kept(op, x, g.tensors[t].shape) for t in op.outputs]
    return rule


def _along_input(position: int, what: str):
    """Operators that work along the axes held in a constant input (reductions, splits)."""
    def rule(op, ins, g, values):
        x = next(s for s in ins if s is not None and batched(s))
        axes = _constant(g, values, op.inputs[position], op, "axis")
        _not_first(op, axes, len(x), what)
        return [_rows_kept(op, x, g.tensors[t].shape) for t in op.outputs]
    return rule


def _first_rows_whole(op: Op, first_begin: int, first_end_or_size: int, rows: int,
                      size: bool) -> None:
    whole = first_begin == 0 and (first_end_or_size in (-1, rows) if size
                                  else first_end_or_size >= rows)
    if not whole:
        raise FixedBatch(op, "slices the batch axis")


def _slice(op, ins, g, values):
    x = ins[0]
    begin, size = (_constant(g, values, t, op, "bounds") for t in op.inputs[1:3])
    _first_rows_whole(op, int(begin[0]), int(size[0]), -x[0], size=True)
    return [_rows_kept(op, x, g.tensors[op.outputs[0]].shape)]


def _strided_slice(op, ins, g, values):
    x = ins[0]
    begin, end, strides = (_constant(g, values, t, op, "bounds") for t in op.inputs[1:4])
    o = op.options
    if (o.get("ellipsis_mask", 0) | o.get("new_axis_mask", 0) | o.get("shrink_axis_mask", 0)) & 1 \
            or int(strides[0]) != 1:
        raise FixedBatch(op, "slices the batch axis")
    first_begin = 0 if o.get("begin_mask", 0) & 1 else int(begin[0])
    first_end = -x[0] if o.get("end_mask", 0) & 1 else int(end[0])
    _first_rows_whole(op, first_begin, first_end, -x[0], size=False)
    return [_rows_kept(op, x, g.tensors[op.outputs[0]].shape)]


def _padded(op, ins, g, values):
    paddings = _constant(g, values, op.inputs[1], op, "paddings")
    if paddings[:2].any():
        raise FixedBatch(op, "pads the batch axis")
    return [_rows_kept(op, ins[0], g.tensors[op.outputs[0]].shape)]


def _tiled(op, ins, g, values):
    multiples = _constant(g, values, op.inputs[1], op, "multiples")
    if multiples[0] != 1:
        raise FixedBatch(op, "tiles the batch axis")
    return [_rows_kept(op, ins[0], g.tensors[op.outputs[0]].shape)]


def _select(op, ins, g, values):
    """SELECT (version 1): its condition has the branches' shape or is one flag a row."""
    return [broadcast(op, ins[1:3])]


RULES = {
    "SELECT": _select,
    "RESHAPE": _reshape, "SQUEEZE": _squeeze_expand, "EXPAND_DIMS": _squeeze_expand,
    "FULLY_CONNECTED": _fully_connected, "BATCH_MATMUL": _batch_matmul,
    "TRANSPOSE": _transpose, "GATHER": _gather, "EMBEDDING_LOOKUP": _embedding_lookup,
    "CONCATENATION": _along_option("concatenates along"), "PACK": _along_option("packs along"),
    "UNPACK": _along_option("unpacks along"),
    "SPLIT": _along_input(0, "splits"), "SPLIT_V": _along_input(2, "splits"),
    "MEAN": _along_input(1, "reduces"), "SUM": _along_input(1, "reduces"),
    "REDUCE_MAX": _along_input(1, "reduces"), "REDUCE_MIN": _along_input(1, "reduces"),
    "REDUCE_PROD": _along_input(1, "reduces"), "ARG_MAX": _along_input(1, "reduces"),
    "ARG_MIN": _along_input(1, "reduces"), "CUMSUM": _along_input(1, "sums along"),
    "REVERSE_V2": _along_input(1, "reverses"),
    "SLICE": _slice, "STRIDED_SLICE": _strided_slice,
    "PAD": _padded, "PADV2": _padded, "MIRROR_PAD": _padded, "TILE": _tiled,
}
