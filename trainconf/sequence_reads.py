"""Read a batch-1 model's time-major sequence batch-major, so that it trains at
any batch size instead of one sample at a time (trainconf/batch.py).

A Keras 3 RNN converted at batch 1 turns its [1, T, D] sequence time-major with
a RESHAPE to [T, 1, D] (at batch 1 a reshape does what a transpose would), and
its unrolled loop (trainconf/unroll.py) reads step t as GATHER(seq, t) on axis 0,
the backward direction of a Bidirectional layer through a REVERSE_V2 on axis 0
first.  The last output goes back through a RESHAPE [1, H] -> [1, 1, H] and a
STRIDED_SLICE of the last (only) step on axis 0.  At batch 1 each of these is
the same as reading the batch-major tensor directly: step t is GATHER(x, t) on
axis 1 (T-1-t reversed), and the last output is the [1, H] state itself.  Keras's
LSTM cell also squeezes its recurrent product [1, 4H] to [4H] before adding it to
the input's [1, 4H]: the sum reads the [1, 4H] product instead.  The
rewrite changes no value at batch 1, and gives those reads their batched
meaning.
"""
import numpy as np

from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import buffer_array, int_list
from microtrain.files.graph import Graph, Op, graph_of

from .writer import set_constant


def read_sequences_batch_major(model) -> int:
    """Rewrite the time-major reads of a batch-1 model's sequences (see above) in
    place; returns the number of operators it bypassed and removed."""
    g = graph_of(model)
    readers = g.readers()
    bypassed: set[int] = set()  # operators left unread when their readers are rewritten
    for op in g.ops:
        if op.type == "RESHAPE" and _swaps_unit_axis(g, op):
            bypassed |= _gather_steps_batch_major(model, g, op, readers)
        elif op.type == "STRIDED_SLICE" and (source := _unit_step(g, op)) is not None:
            _read_instead(model, op.outputs[0], source.inputs[0], readers)
            bypassed |= {op.index, source.index}
        elif op.type == "RESHAPE" and _squeezes_unit_axis_for_sums(g, op, readers):
            _read_instead(model, op.outputs[0], op.inputs[0], readers)
            bypassed.add(op.index)
    _drop_unread(model, bypassed)
    return len(bypassed)


def _swaps_unit_axis(g: Graph, op: Op) -> bool:
    """RESHAPE [1, T, ...] -> [T, 1, ...] with T > 1."""
    x, y = (g.tensors[op.inputs[0]].shape, g.tensors[op.outputs[0]].shape)
    return len(x) >= 3 and x[0] == 1 and x[1] > 1 and y == (x[1], 1) + x[2:]


def _squeezes_unit_axis_for_sums(g: Graph, op: Op, readers: dict) -> bool:
    """RESHAPE [1, ...] -> [...] read only by broadcasting ADDs/MULs whose other
    operand keeps the unit axis (so the sum's shape does not change)."""
    x, y = g.tensors[op.inputs[0]].shape, g.tensors[op.outputs[0]].shape
    if not x or x[0] != 1 or y != x[1:] or op.outputs[0] in g.outputs:
        return False
    users = readers.get(op.outputs[0], [])
    return bool(users) and all(
        u.type in ("ADD", "MUL") and len(g.tensors[u.outputs[0]].shape) == len(x) for u in users)


def _step_index(g: Graph, op: Op) -> int | None:
    """t of a GATHER(seq, t) on axis 0 with a constant scalar t."""
    if op.type != "GATHER" or op.options.get("axis", 0) != 0 or op.options.get("batch_dims", 0):
        return None
    index = g.tensors[op.inputs[1]].data
    return int(index) if index is not None and index.ndim == 0 else None


def _gather_steps_batch_major(model, g: Graph, reshape: Op, readers: dict) -> set[int]:
    """Every step read from the time-major sequence read from the batch-major one
    (only when every reader of it is such a step, possibly through a reversal);
    returns the operators bypassed."""
    x, seq = reshape.inputs[0], reshape.outputs[0]
    steps = g.tensors[seq].shape[0]
    reads, bypassed = [], {reshape.index}  # (GATHER, step in the batch-major sequence)
    for op in readers.get(seq, []):
        if _step_index(g, op) is not None:
            reads.append((op, _step_index(g, op)))
        elif _reverses_first_axis(g, op) and op.outputs[0] not in g.outputs:
            gathers = readers.get(op.outputs[0], [])
            if not gathers or any(_step_index(g, r) is None for r in gathers):
                return set()
            reads += [(r, steps - 1 - _step_index(g, r)) for r in gathers]
            bypassed.add(op.index)
        else:
            return set()
    if seq in g.outputs:
        return set()
    sg = model.subgraphs[0]
    for op, step in reads:
        inputs = list(int_list(sg.operators[op.index].inputs))
        inputs[0], inputs[1] = x, _scalar(model, step, inputs[1])
        sg.operators[op.index].inputs = inputs
        sg.operators[op.index].builtinOptions.axis = 1
    return bypassed


def _reverses_first_axis(g: Graph, op: Op) -> bool:
    if op.type != "REVERSE_V2":
        return False
    axes = g.tensors[op.inputs[1]].data
    return axes is not None and [int(a) for a in np.atleast_1d(axes)] == [0]


def _scalar(model, value: int, like: int) -> int:
    """A new constant tensor holding `value`, of the type of index tensor `like`."""
    sg = model.subgraphs[0]
    sg.tensors.append(circle.TensorT(shape=[], type=sg.tensors[like].type, name=f"step{value}"))
    t = len(sg.tensors) - 1
    set_constant(model, t, np.asarray(value, buffer_array(model, sg.tensors[like]).dtype))
    return t


def _unit_step(g: Graph, op: Op) -> Op | None:
    """The [1, ...] tensor that a STRIDED_SLICE takes back out of its RESHAPE to
    [1, 1, ...]: the one step, first or last, of a unit time axis, shrunk away."""
    source = g.producers().get(op.inputs[0])
    if source is None or source.type != "RESHAPE":
        return None
    x, y = g.tensors[source.inputs[0]].shape, g.tensors[source.outputs[0]].shape
    if not x or x[0] != 1 or y != (1,) + x or g.tensors[op.outputs[0]].shape != x:
        return None
    begin, end, strides = (g.tensors[t].data for t in op.inputs[1:4])
    if any(v is None for v in (begin, end, strides)):
        return None
    o = op.options
    if o.get("shrink_axis_mask", 0) != 1 or o.get("ellipsis_mask", 0) or o.get("new_axis_mask", 0):
        return None
    if int(begin[0]) not in (0, -1) or int(strides[0]) != 1:
        return None
    whole = all(s == 1 and (b == 0 or o.get("begin_mask", 0) >> axis & 1)
                and (o.get("end_mask", 0) >> axis & 1 or e >= d)
                for axis, b, e, s, d in zip(range(1, len(y)), begin[1:], end[1:], strides[1:], x))
    return source if whole else None


def _read_instead(model, old: int, new: int, readers: dict) -> None:
    """Operators (and graph outputs) that read `old` read `new`."""
    sg = model.subgraphs[0]
    for op in readers.get(old, []):
        sg.operators[op.index].inputs = [new if t == old else t
                                         for t in int_list(sg.operators[op.index].inputs)]
    sg.outputs = [new if t == old else t for t in int_list(sg.outputs)]


def _drop_unread(model, bypassed: set[int]) -> None:
    """Remove the bypassed operators that nothing reads any more."""
    sg = model.subgraphs[0]
    read = {t for k, op in enumerate(sg.operators) if k not in bypassed
            for t in int_list(op.inputs)} | set(int_list(sg.outputs))
    sg.operators = [op for k, op in enumerate(sg.operators)
                    if k not in bypassed or any(t in read for t in int_list(op.outputs))]
