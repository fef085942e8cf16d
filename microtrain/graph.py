"""A flat, read-only view of a circle subgraph: the form in which both tools reason
about a model.  Shapes keep the batch dimension symbolic as -1."""
from dataclasses import dataclass, field

import numpy as np

from .format.model import buffer_array, op_name, options_dict, tensor_dtype

BATCH = -1


@dataclass
class Tensor:
    index: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: np.ndarray | None = None  # constant data; None for activations and cut-out weights


@dataclass
class Op:
    index: int
    type: str  # builtin operator name, or the custom_code of a custom operator
    inputs: list[int]  # -1 marks an absent optional input
    outputs: list[int]
    options: dict = field(default_factory=dict)


@dataclass
class Graph:
    tensors: list[Tensor]
    ops: list[Op]
    inputs: list[int]
    outputs: list[int]

    def producers(self) -> dict[int, Op]:
        return {t: op for op in self.ops for t in op.outputs}


def _ints(values) -> tuple[int, ...]:
    return () if values is None else tuple(int(v) for v in values)


def symbolic_shape(t) -> tuple[int, ...]:
    """The tensor's shape with a dynamic dimension as -1 (shape_signature when present)."""
    signature = _ints(t.shapeSignature)
    return signature if signature else _ints(t.shape)


def graph_of(model, subgraph: int = 0) -> Graph:
    sg = model.subgraphs[subgraph]
    tensors = [Tensor(i, (t.name or b"").decode() if isinstance(t.name, bytes) else (t.name or ""),
                      symbolic_shape(t), tensor_dtype(t), buffer_array(model, t))
               for i, t in enumerate(sg.tensors or [])]
    ops = [Op(i, op_name(model, op), list(_ints(op.inputs)), list(_ints(op.outputs)),
              options_dict(op))
           for i, op in enumerate(sg.operators or [])]
    return Graph(tensors, ops, list(_ints(sg.inputs)), list(_ints(sg.outputs)))


def concrete_shape(shape: tuple[int, ...], batch: int) -> tuple[int, ...]:
    """Replace the symbolic batch dimension with `batch`."""
    return tuple(batch if d == BATCH else d for d in shape)
