"""Hoist the input projection of an unrolled loop out of its steps.

An unrolled Keras 3 RNN (trainconf/unroll.py, read batch-major by
trainconf/sequence_reads.py) reads step t of its sequence x [B, T, D] as
GATHER(x, t) on axis 1 and projects it with FULLY_CONNECTED(x_t, W): T small
matrix products, and in backprop T scatter-adds of each step's gradient into a
[B, T, D] tensor, summed by an ADD_N (work quadratic in T).  The steps'
projections are rewritten as one FULLY_CONNECTED over the whole sequence
(keep_num_dims), SPLIT into steps along time and RESHAPEd to [B, U]: the same
rows of the same product, whose gradient is one product and one concatenation
(SplitGrad).  Fused recurrent layers are lowered this way from the start
(trainconf/recurrent.py).
"""
from microtrain.files.graph import Graph, Op, graph_of

from .recurrent import _Builder


def hoist_input_projections(model) -> int:
    """Rewrite in place every group of two or more step projections of one
    sequence by one weight (see above); returns the number of groups."""
    g = graph_of(model)
    groups = _step_projections(g)
    if not groups:
        return 0
    written = {t for op in g.ops for t in op.outputs} | set(g.inputs)
    sg = model.subgraphs[0]
    replaced: dict[int, list] = {}  # first gather of a group -> the operators in its place
    dropped: set[int] = set()
    readers = g.readers()
    for (x, w, bias), steps in groups.items():
        first = min(gather.index for _, gather, _ in steps)
        b = _Builder(model, g, steps[0][2], written)
        replaced[first] = b.ops
        if bias < 0 and (sums := _bias_sums(g, readers, steps)):
            bias = sums[0][1].inputs[1 - sums[0][1].inputs.index(sums[0][0].outputs[0])]
            for inner, outer in sums:  # the inner sum writes what the bias's sum wrote
                sg.operators[inner.index].outputs = list(outer.outputs)
                dropped.add(outer.index)
        _project_whole(b, x, w, bias, steps)
        dropped |= {op.index for _, gather, fc in steps for op in (gather, fc)}
    operators = []
    for k, op in enumerate(sg.operators):
        operators += replaced.get(k, [])
        if k not in dropped:
            operators.append(op)
    sg.operators = operators
    return len(groups)


def _project_whole(b: _Builder, x: int, w: int, bias: int, steps: list) -> None:
    """One FULLY_CONNECTED over x, split along time into [B, 1, U]; each step's
    projection becomes a RESHAPE of its part to [B, U]."""
    whole = b.fully_connected(x, w, bias if bias >= 0 else None, "sequence_projection")
    parts = b.split(whole, 1, b.shape(x)[1], "step")
    units = b.shape(whole)[-1]
    shape = b.ints([-1, units], "step_shape")
    for t, _, step_fc in steps:
        b.op("RESHAPE", [parts[t], shape], b.shape(step_fc.outputs[0]), "",
             output=step_fc.outputs[0])


def _bias_sums(g: Graph, readers: dict, steps: list) -> list[tuple[Op, Op]] | None:
    """Per step, (ADD(projection, r), ADD(that, bias)) when every step adds the same
    constant bias [U] to the sum of its projection and one other term (a Keras 3
    LSTM or GRU cell's recurrent product): the projection can add the bias instead,
    once for all steps, and each step saves an ADD and, in backprop, the sum of its
    gradient over the batch.  None when a step differs."""
    def only_reader(t: int) -> Op | None:
        users = readers.get(t, [])
        plain = len(users) == 1 and users[0].type == "ADD" and t not in g.outputs and \
            not users[0].options.get("fused_activation_function", 0)
        return users[0] if plain else None

    sums, biases = [], set()
    for _, _, fc in steps:
        inner = only_reader(fc.outputs[0])
        outer = inner and only_reader(inner.outputs[0])
        if outer is None:
            return None
        bias = outer.inputs[1 - outer.inputs.index(inner.outputs[0])]
        if g.tensors[bias].data is None or g.tensors[bias].shape != g.tensors[fc.outputs[0]].shape[-1:]:
            return None
        sums.append((inner, outer))
        biases.add(bias)
    return sums if len(biases) == 1 else None


def _step_projections(g: Graph) -> dict[tuple, list[tuple[int, Op, Op]]]:
    """(sequence, weight, bias) -> [(t, GATHER, FULLY_CONNECTED)] of the steps whose
    only reader is a plain FULLY_CONNECTED by that weight (see above)."""
    readers = g.readers()
    outputs = set(g.outputs)
    groups: dict[tuple, list] = {}
    for op in g.ops:
        t = _step(g, op)
        users = readers.get(op.outputs[0], [])
        if t is None or len(users) != 1 or op.outputs[0] in outputs:
            continue
        fc = users[0]
        if fc.type != "FULLY_CONNECTED" or fc.inputs[0] != op.outputs[0] or \
                g.tensors[fc.inputs[1]].data is None or _does_more(fc):
            continue
        bias = fc.inputs[2] if len(fc.inputs) > 2 else -1
        groups.setdefault((op.inputs[0], fc.inputs[1], bias), []).append((t, op, fc))
    return {key: steps for key, steps in groups.items()
            if len(steps) > 1 and len({t for t, _, _ in steps}) == len(steps)}


def _step(g: Graph, op: Op) -> int | None:
    """t of a GATHER(x, t) on axis 1 of a float sequence x [B, T, D], t a constant scalar."""
    if op.type != "GATHER" or op.options.get("axis", 0) != 1 or op.options.get("batch_dims", 0):
        return None
    x, index = g.tensors[op.inputs[0]], g.tensors[op.inputs[1]].data
    if len(x.shape) != 3 or x.data is not None or x.dtype.kind != "f" or \
            index is None or index.ndim != 0:
        return None
    return int(index) % x.shape[1]


def _does_more(fc: Op) -> bool:
    """Whether a FULLY_CONNECTED does more than x·Wᵀ + b (an activation, a
    shuffled weight format) or keeps x's rank."""
    o = fc.options
    return bool(o.get("fused_activation_function", 0) or o.get("keep_num_dims", False)
                or o.get("weights_format", 0))
