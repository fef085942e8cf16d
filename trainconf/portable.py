"""Rewrites that let an exported model run in onert as well as in LiteRT.

Each replaces an operator that onert lacks or misreads with operators that
compute exactly the same values, in both runtimes, for every input the original
accepts:
- FULLY_CONNECTED with keep_num_dims over a rank > 2 input: onert ignores
  keep_num_dims (its output is always [rows, units]), so the operator flattens
  and a RESHAPE restores the leading dimensions.
- EMBEDDING_LOOKUP(ids, table): onert has no kernel; it is GATHER(table, ids)
  on axis 0, the same rows in the same order.
- SELECT / SELECT_V2 on integer branches (Keras's wrap of negative ids): onert's
  Select takes only float32, so c ? a : b becomes a*c + b*(1-c), with c cast to
  the branches' type (each product is 0 or the branch itself, so it is exact).
- BROADCAST_TO whose every reader is an elementwise operator that broadcasts it
  to the same shape anyway (BERT's position embeddings added to the token
  embeddings): the readers take its input instead.  onert cannot run a
  BROADCAST_TO to a shape known only at run time.
- Otherwise a shape operand (BROADCAST_TO's shape) that split folded with the
  symbolic batch in it: at batch 1 it gets the rows back; with a dynamic batch it
  cannot stay a constant, and is computed at run time from the first input's
  batch (SHAPE, SLICE, MUL, CONCATENATION), which LiteRT runs and onert does not.
"""
import numpy as np

from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import int_list
from microtrain.files.graph import BATCH, Graph, Op, Tensor, batched, graph_of

from .batch import BROADCASTING, broadcast
from .operators import OPERATORS, spec
from .writer import circle_operator, circle_tensor, set_constant


def make_portable(model, batch: int) -> None:
    """Rewrite the first subgraph's operators as above (in place); `batch` is the
    model's batch: BATCH (dynamic) or 1."""
    g = graph_of(model)
    edit = Editor(model, g, batch)
    for op, original in zip(g.ops, model.subgraphs[0].operators):
        op.inputs = [edit.renamed.get(t, t) for t in op.inputs]
        original.inputs = op.inputs
        rewrite = REWRITES.get(op.type)
        if rewrite is None or not rewrite(edit, op, original):
            edit.ops.append(original)
    model.subgraphs[0].operators = edit.ops


class Editor:
    """Collects the new operator list, adding tensors to the model as it goes."""

    def __init__(self, model, g: Graph, batch: int):
        self.model, self.g, self.batch, self.ops = model, g, batch, []
        self.rows = None  # the run-time batch, [B] (int32), once computed
        self.renamed: dict[int, int] = {}  # tensor -> the tensor its readers take instead
        self.readers: dict[int, list[Op]] = {}
        for op in g.ops:
            for t in set(op.inputs):
                self.readers.setdefault(t, []).append(op)

    def shape(self, t: int) -> tuple[int, ...]:
        return self.g.tensors[t].shape

    def tensor(self, name: str, shape, dtype, data=None) -> int:
        sg = self.model.subgraphs[0]
        tensor = Tensor(len(sg.tensors), name, tuple(shape), np.dtype(dtype), data)
        self.g.tensors.append(tensor)
        sg.tensors.append(circle_tensor(self.model, tensor))
        return tensor.index

    def const(self, name: str, value) -> int:
        value = np.asarray(value)
        return self.tensor(name, value.shape, value.dtype, value)

    def op(self, type_: str, inputs, output: int, **options) -> int:
        self.ops.append(circle_operator(self.model, Op(0, type_, list(inputs), [output], options)))
        return output

    def new(self, type_: str, inputs, name: str, shape, dtype, **options) -> int:
        """One operator writing a new tensor."""
        return self.op(type_, inputs, self.tensor(name, shape, dtype), **options)

    def batch_rows(self) -> int:
        """[B]: the first input's rows at run time."""
        if self.rows is None:
            x = next(i for i in self.g.inputs if batched(self.shape(i)))
            name = f"{self.g.tensors[x].name}/batch"
            shape = self.new("SHAPE", [x], f"{name}/shape", (len(self.shape(x)),), np.int32,
                             out_type=circle.TensorType.INT32)
            self.rows = self.new("SLICE", [shape, self.const(f"{name}/begin", np.int32([0])),
                                           self.const(f"{name}/size", np.int32([1]))],
                                 name, (1,), np.int32)
        return self.rows


def _fully_connected(edit: Editor, op: Op, original) -> bool:
    x, y = op.inputs[0], op.outputs[0]
    if not op.options.get("keep_num_dims") or len(edit.shape(x)) <= 2:
        return False
    out = edit.shape(y)
    rows = out[0] * int(np.prod(out[1:-1]))  # -k*T... stays symbolic: the batch's rows
    original.builtinOptions.keepNumDims = False
    name = edit.g.tensors[y].name
    flat = edit.tensor(f"{name}/flat", (rows, out[-1]), edit.g.tensors[y].dtype)
    original.outputs = [flat]
    edit.ops.append(original)
    target = [BATCH if batched(out) else out[0], *out[1:]]
    edit.op("RESHAPE", [flat, edit.const(f"{name}/shape", np.int32(target))], y,
            new_shape=target)
    return True


def _embedding_lookup(edit: Editor, op: Op, original) -> bool:
    ids, table = op.inputs
    edit.op("GATHER", [table, ids], op.outputs[0], axis=0, batch_dims=0)
    return True


def _select(edit: Editor, op: Op, original) -> bool:
    c, a, b = op.inputs
    y = op.outputs[0]
    dtype = edit.g.tensors[y].dtype
    if dtype == np.float32 or (op.type == "SELECT" and len(edit.shape(c)) != len(edit.shape(y))):
        return False  # onert runs it; a row-flag SELECT would broadcast wrongly below
    name = edit.g.tensors[y].name
    flag = edit.new("CAST", [c], f"{name}/flag", edit.shape(c), dtype)
    other = edit.new("SUB", [edit.const(f"{name}/one", np.ones((), dtype)), flag],
                     f"{name}/not_flag", edit.shape(c), dtype)
    taken = [edit.new("MUL", [f, x], f"{name}/{part}",
                      broadcast(op, [edit.shape(f), edit.shape(x)]), dtype)
             for f, x, part in ((flag, a, "true"), (other, b, "false"))]
    edit.op("ADD", taken, y)
    return True


def _implied_broadcast(edit: Editor, op: Op) -> bool:
    """Whether every reader of op's output broadcasts it to its shape anyway."""
    y = op.outputs[0]
    readers = edit.readers.get(y, [])
    if y in edit.g.outputs or not readers:
        return False
    for reader in readers:
        others = [edit.shape(t) for t in reader.inputs if t != y]
        if reader.type not in BROADCASTING or not others \
                or broadcast(reader, others) != edit.shape(y):
            return False
    return True


def _shape_operand(edit: Editor, op: Op, original) -> bool:
    if op.type == "BROADCAST_TO" and _implied_broadcast(edit, op):
        edit.renamed[op.outputs[0]] = op.inputs[0]
        return True
    t = op.inputs[spec(op.type).shape]
    value = edit.g.tensors[t].data
    if value is None or value.ndim != 1 or not value.size or value[0] >= 0:
        return False
    rows = -int(value[0])  # the batch's rows in this shape: k a sample
    if edit.batch != BATCH:
        set_constant(edit.model, t, np.int32([rows, *value[1:]]))
        return False
    name = f"{edit.g.tensors[t].name}/at_run_time"
    first = edit.batch_rows()
    if rows != 1:
        first = edit.new("MUL", [first, edit.const(f"{name}/rows", np.int32([rows]))],
                         f"{name}/rows_of_batch", (1,), np.int32)
    shape = edit.new("CONCATENATION", [first, edit.const(f"{name}/rest", np.int32(value[1:]))],
                     name, value.shape, np.int32, axis=0)
    original.inputs = [shape if i == t else i for i in int_list(original.inputs)]
    edit.ops.append(original)
    return True


REWRITES = {"FULLY_CONNECTED": _fully_connected, "EMBEDDING_LOOKUP": _embedding_lookup,
            "SELECT": _select, "SELECT_V2": _select,
            **{name: _shape_operand for name, o in OPERATORS.items() if o.shape is not None}}
