"""Turn a Graph built by trainconf into a circle model, and edit constants in place."""
import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (add_operator_code, set_builtin_options,
                                           set_custom_options, set_metadata)
from microtrain.files.graph import Graph, batched

from .operators import spec

TENSOR_TYPES = {np.dtype(np.float32): circle.TensorType.FLOAT32,
                np.dtype(np.float16): circle.TensorType.FLOAT16,
                np.dtype(np.int32): circle.TensorType.INT32,
                np.dtype(np.int8): circle.TensorType.INT8,
                np.dtype(np.uint8): circle.TensorType.UINT8,
                np.dtype(np.int16): circle.TensorType.INT16,
                np.dtype(np.int64): circle.TensorType.INT64,
                np.dtype(np.bool_): circle.TensorType.BOOL}


def tensor_type(dtype: np.dtype) -> int:
    """The circle TensorType of a numpy dtype (ml_dtypes' bfloat16 by name: it is
    imported only when used)."""
    if np.dtype(dtype).name == "bfloat16":
        return circle.TensorType.BFLOAT16
    if np.dtype(dtype) not in TENSOR_TYPES:
        raise UserError(None, f"tensor type {dtype} cannot take part in a backprop graph")
    return TENSOR_TYPES[np.dtype(dtype)]


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(w.capitalize() for w in rest)


def _builtin_options(table_name: str, options: dict):
    table = getattr(circle, f"{table_name}T")()
    for key, value in options.items():
        setattr(table, _camel(key), value)
    return table


def _buffer(model, array: np.ndarray) -> int:
    model.buffers.append(circle.BufferT())
    model.buffers[-1].data = np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8)
    return len(model.buffers) - 1


def set_constant(model, t: int, value: np.ndarray) -> None:
    """Give tensor t of the first subgraph the constant `value` in a buffer of its own."""
    tensor = model.subgraphs[0].tensors[t]
    value = np.asarray(value, dtype=np.int32) if tensor.type == circle.TensorType.INT32 else value
    tensor.buffer = _buffer(model, value)
    tensor.shape = list(value.shape)
    tensor.shapeSignature = None


def circle_tensor(model, t) -> "circle.TensorT":
    out = circle.TensorT()
    out.name = t.name
    out.type = tensor_type(t.dtype)
    out.shape = [-d if d < 0 else d for d in t.shape]
    out.shapeSignature = [-1 if d < 0 else d for d in t.shape] if batched(t.shape) else None
    out.buffer = 0 if t.data is None else _buffer(model, t.data)
    if t.quantization is not None:
        q = t.quantization
        out.quantization = circle_quantization(q.scale, q.zero_point, q.axis)
    return out


def circle_quantization(scale, zero_point, axis: int = 0) -> "circle.QuantizationParametersT":
    """A tensor's quantization: its scales and zero points (one, or one per slice
    along `axis`)."""
    q = circle.QuantizationParametersT()
    q.scale = [float(s) for s in np.atleast_1d(scale)]
    q.zeroPoint = [int(z) for z in np.atleast_1d(zero_point)]
    q.quantizedDimension = axis
    return q


def circle_operator(model, op) -> "circle.OperatorT":
    out = circle.OperatorT()
    out.opcodeIndex = add_operator_code(model, op.type, op.version)
    out.inputs, out.outputs = list(op.inputs), list(op.outputs)
    table_name = spec(op.type).options
    if table_name:
        set_builtin_options(out, _builtin_options(table_name, op.options))
    elif op.options:
        set_custom_options(out, op.options, op.type)
    return out


def graph_to_model(g: Graph, description: str, metadata: dict[str, bytes]):
    model = circle.ModelT()
    model.version = 3
    model.description = description
    model.operatorCodes, model.buffers = [], [circle.BufferT()]  # buffer 0: the empty buffer
    sg = circle.SubGraphT()
    sg.name = "backprop"
    sg.tensors = [circle_tensor(model, t) for t in g.tensors]
    sg.operators = [circle_operator(model, op) for op in g.ops]
    sg.inputs, sg.outputs = list(g.inputs), list(g.outputs)
    model.subgraphs = [sg]
    for name, data in metadata.items():
        set_metadata(model, name, data)
    return model
