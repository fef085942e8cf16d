"""A flat, read-only view of a circle subgraph: the form in which both tools reason
about a model.  Shapes keep the batch dimension symbolic: a first dimension d < 0
holds -d rows per sample (-1, BATCH: one; -16: sixteen, as a dense layer over a
sequence of 16 reshapes [B, 16, D] to [B*16, D]).  A file stores such a tensor
with shape_signature -1 there and its rows at batch 1 in shape."""
from dataclasses import dataclass, field

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.format.model import buffer_array, op_name, options_dict, tensor_dtype
from microtrain.files.quantization import Quantization, quantization_of

BATCH = -1


@dataclass
class Tensor:
    index: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: np.ndarray | None = None  # constant data; None for activations and cut-out weights
    quantization: Quantization | None = None  # an integer tensor's scales and zero points
    # the fake-quantization operator (FAKE_QUANT, FakeQuantPerChannel) whose int8
    # levels the tensor holds: its float32 values stored in one byte each
    # (`quantization` is their grid; "": not such a tensor); operators read the values
    fake_quant: str = ""


@dataclass
class Op:
    index: int
    type: str  # builtin operator name, or the custom_code of a custom operator
    inputs: list[int]  # -1 marks an absent optional input
    outputs: list[int]
    options: dict = field(default_factory=dict)
    version: int = 1  # the operator code's version (a custom op's kernel may run only some)


@dataclass
class Graph:
    tensors: list[Tensor]
    ops: list[Op]
    inputs: list[int]
    outputs: list[int]

    def producers(self) -> dict[int, Op]:
        return {t: op for op in self.ops for t in op.outputs}

    def readers(self) -> dict[int, list[Op]]:
        """Tensor -> the operators that read it, in execution order."""
        found: dict[int, list[Op]] = {}
        for op in self.ops:
            for t in op.inputs:
                found.setdefault(t, []).append(op)
        return found


def _ints(values) -> tuple[int, ...]:
    return () if values is None else tuple(int(v) for v in values)


def symbolic_shape(t) -> tuple[int, ...]:
    """The tensor's shape with a dynamic dimension as -1 (shape_signature when
    present), a dynamic first one as minus its rows at batch 1."""
    signature, shape = _ints(t.shapeSignature), _ints(t.shape)
    if not signature:
        return shape
    if signature[0] == -1 and len(shape) == len(signature) and shape[0] > 1:
        return (-shape[0],) + signature[1:]
    return signature


def batched(shape: tuple[int, ...]) -> bool:
    """Whether a symbolic shape has the batch (in its first dimension)."""
    return bool(shape) and shape[0] < 0


def symbolic_batch(g: "Graph") -> bool:
    """Whether the graph takes any batch size (else it keeps a fixed batch of 1)."""
    return any(batched(g.tensors[t].shape) for t in g.inputs)


def graph_of(model, subgraph: int = 0) -> Graph:
    sg = model.subgraphs[subgraph]
    tensors = [Tensor(i, (t.name or b"").decode() if isinstance(t.name, bytes) else (t.name or ""),
                      symbolic_shape(t), tensor_dtype(t), buffer_array(model, t), quantization_of(t))
               for i, t in enumerate(sg.tensors or [])]
    names = [op_name(model, op) for op in sg.operators or []]
    ops = [Op(i, name, list(_ints(op.inputs)), list(_ints(op.outputs)), options_dict(op, name),
              model.operatorCodes[op.opcodeIndex].version)
           for i, (name, op) in enumerate(zip(names, sg.operators or []))]
    for op in ops:
        for t in op.outputs:
            tensors[t].fake_quant = op.type if stores_levels(op.type, tensors[t].dtype) else ""
    return Graph(tensors, ops, list(_ints(sg.inputs)), list(_ints(sg.outputs)))


def stores_levels(op_type: str, dtype) -> bool:
    """Whether an output of type `dtype` of an operator `op_type` holds a fake
    quantization's int8 levels (Tensor.fake_quant)."""
    return op_type in ("FAKE_QUANT", "FakeQuantPerChannel") and np.dtype(dtype) == np.int8


def concrete_shape(shape: tuple[int, ...], batch: int) -> tuple[int, ...]:
    """The shape at batch size `batch`."""
    return tuple(-d * batch if d < 0 else d for d in shape)


def check_dataflow(g: Graph, path, given: set[int]) -> None:
    """What the runtime relies on before it allocates anything: inputs and
    outputs, dimensions >= 0 (only the first may be symbolic), and
    operators that read only tensors that are given (graph inputs, constants,
    `given`) or written by an earlier operator."""
    if not g.inputs or not g.outputs:
        raise UserError(path, "the graph has no inputs or no outputs")
    for t in g.tensors:
        if any(d < 0 for d in t.shape[1:]):
            raise UserError(path, f"tensor {t.index} '{t.name}' has shape {list(t.shape)}: only "
                                  "the first dimension may be -1 (the batch)")
    ready = set(g.inputs) | given | {t.index for t in g.tensors if t.data is not None}
    for op in g.ops:
        unready = [i for i in op.inputs if i >= 0 and i not in ready]
        if unready:
            raise UserError(path, f"operator {op.index} ({op.type}) reads tensor {unready[0]}, "
                                  "which is neither given nor written by an earlier operator")
        ready.update(op.outputs)
    written = {t for op in g.ops for t in op.outputs} | set(g.inputs)
    if not set(g.outputs) <= written:
        raise UserError(path, f"graph output {sorted(set(g.outputs) - written)[0]} is written by "
                              "no operator")

