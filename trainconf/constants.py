"""Constants as a split needs them: plain float32, and each trainable one read
by one operator.

Converters keep weights compact: fp16 or int8 behind a DEQUANTIZE operator
(MediaPipe), sparse behind DENSIFY, or int8 read directly by FULLY_CONNECTED /
CONV_2D in a dynamic-range quantized model (activations stay float, the kernel
dequantizes).  Training needs the real values, so every such constant becomes
the float32 tensor it stands for and the DEQUANTIZE / DENSIFY operators that
produced it are removed.  A model whose activations are quantized (full-integer)
is made float first, its grids kept as fake quantization (trainconf/quantize.py);
one left quantized here is refused.

Converters also store identical constants once: the zero biases of many layers
become one tensor.  Training that tensor would train every layer reading it, so
each weighted operator gets its own copy (untie_weights).
"""
import numpy as np

from microtrain.files.errors import UserError
from microtrain.step.executor import SPLIT_RESOLVES as RESOLVERS  # the ops that resolve constants
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import TYPE_NAMES, buffer_array, int_list, op_name, tensor_dtype

from .operators import Operand, spec
from .writer import set_constant

QUANTIZED_TYPES = {circle.TensorType.INT8, circle.TensorType.UINT8, circle.TensorType.INT16,
                   circle.TensorType.INT4, circle.TensorType.INT32}  # int32: an int8 model's biases


def _scales(tensor) -> np.ndarray | None:
    q = tensor.quantization
    if q is None or q.scale is None or len(q.scale) == 0:
        return None
    return np.asarray(q.scale, np.float32)


def is_quantized(tensor) -> bool:
    """An integer tensor whose values stand for real numbers (it has scales)."""
    return tensor.type in QUANTIZED_TYPES and _scales(tensor) is not None


def _is_constant(model, tensor) -> bool:
    data = model.buffers[tensor.buffer].data
    return data is not None and len(data) > 0


def check_float_activations(model, path=None) -> None:
    """Refuse a full-integer model: one whose computed tensors are quantized."""
    sg = model.subgraphs[0]
    computed = set(int_list(sg.inputs)) | {t for op in sg.operators or ()
                                           for t in int_list(op.outputs)}
    for t in sorted(computed):
        tensor = sg.tensors[t]
        if is_quantized(tensor) and not _is_constant(model, tensor):
            raise UserError(path, f"a full-integer quantized model (tensor {t} '{tensor.name}' "
                                  f"is {TYPE_NAMES[tensor.type]} with scales): only models "
                                  "with float activations can train")


def dequantized(values: np.ndarray, tensor) -> np.ndarray:
    """float32 values of a quantized or fp16 constant: scale·(q − zero_point),
    per tensor or per slice along quantized_dimension."""
    scale = _scales(tensor)
    if scale is None:
        return values.astype(np.float32)
    q = tensor.quantization
    zero = np.zeros_like(scale) if q.zeroPoint is None or len(q.zeroPoint) == 0 \
        else np.asarray(q.zeroPoint)
    if scale.size > 1:  # per axis: broadcast along the quantized dimension
        shape = [1] * values.ndim
        shape[q.quantizedDimension] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    # in float32, as TFLite's DEQUANTIZE kernel (q − zero_point is exact there)
    return (values.astype(np.float32) - zero.astype(np.float32)) * scale.astype(np.float32)


def densified(model, tensor) -> np.ndarray:
    """The dense value of a sparse constant (TFLite's sparsity format: a
    traversal order over the dimensions and blocks, each level dense or CSR)."""
    sp = tensor.sparsity
    shape = int_list(tensor.shape)
    n = len(shape)
    order, block_map = int_list(sp.traversalOrder), int_list(sp.blockMap)
    levels = sp.dimMetadata
    block_size = [levels[n + j].denseSize for j in range(len(block_map))]
    values = np.frombuffer(bytes(model.buffers[tensor.buffer].data),
                           tensor_dtype(tensor))
    # walk the levels, keeping for every stored position its coordinate on each level
    pos, coords = np.zeros(1, np.int64), []
    for level in levels:
        if level.format == circle.DimensionType.DENSE:
            size = level.denseSize
            coords = [np.repeat(c, size) for c in coords]
            coords.append(np.tile(np.arange(size), len(pos)))
            pos = (pos[:, None] * size + np.arange(size)).ravel()
        else:
            segments = np.asarray(level.arraySegments.values, np.int64)
            indices = np.asarray(level.arrayIndices.values, np.int64)
            counts = segments[pos + 1] - segments[pos]
            starts = np.repeat(segments[pos], counts)
            within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            children = starts + within
            coords = [np.repeat(c, counts) for c in coords]
            coords.append(indices[children])
            pos = children
    index = [None] * n
    for level, dim in enumerate(order):
        if dim < n:
            index[dim] = coords[level]
    for j, dim in enumerate(block_map):
        level = order.index(n + j)
        index[dim] = index[dim] * block_size[j] + coords[level]
    dense = np.zeros(shape, values.dtype)
    dense[tuple(index)] = values[pos]
    return dense


def resolve_constants(model, path=None) -> None:
    """Make every constant stored in another form a plain float32 constant, in place."""
    check_float_activations(model, path)
    sg = model.subgraphs[0]
    kept, sources = [], set()
    for op in sg.operators or ():
        name, inputs = op_name(model, op), int_list(op.inputs)
        if name not in RESOLVERS or not inputs or not _is_constant(model, sg.tensors[inputs[0]]):
            kept.append(op)
            continue
        (source, out), value = (inputs[0], int_list(op.outputs)[0]), None
        if name == "DENSIFY":  # the dense value, still in the source's type and scales
            value = densified(model, sg.tensors[source])
            sg.tensors[out].type = sg.tensors[source].type
            sg.tensors[out].quantization = sg.tensors[source].quantization
            sg.tensors[out].sparsity = None
            set_constant(model, out, value)
        else:
            set_float(model, out, dequantized(_plain_value(model, sg.tensors[source]),
                                               sg.tensors[source]))
        sources.add(source)
    sg.operators = kept
    for t, tensor in enumerate(sg.tensors or ()):
        if _is_constant(model, tensor) and (is_quantized(tensor) or tensor.sparsity):
            # read directly by a float operator (dynamic-range quantization)
            set_float(model, t, dequantized(_plain_value(model, tensor), tensor))
    drop_unread(model, sources)


def _plain_value(model, tensor) -> np.ndarray:
    return densified(model, tensor) if tensor.sparsity else buffer_array(model, tensor)


def set_float(model, t: int, value: np.ndarray) -> None:
    tensor = model.subgraphs[0].tensors[t]
    tensor.type, tensor.quantization, tensor.sparsity = circle.TensorType.FLOAT32, None, None
    set_constant(model, t, value.astype(np.float32))


def drop_unread(model, tensors: set[int]) -> None:
    """Free the buffers of the stored forms no operator reads any more."""
    sg = model.subgraphs[0]
    read = {t for op in sg.operators for t in int_list(op.inputs)} | set(int_list(sg.outputs))
    for t in tensors - read:
        buffer = sg.tensors[t].buffer
        sg.tensors[t].buffer = 0
        if all(x.buffer != buffer for x in sg.tensors):
            model.buffers[buffer].data = None


def untie_weights(model) -> int:
    """Give every weighted operator its own copy of a weight or bias that another
    operator also reads when it holds one value throughout (converters store
    identical initial constants once: zero biases, unit scales), so that training
    it trains that operator alone.  A shared constant of differing values is a tie
    the model means (GPT-2's token embedding and output layer): it stays one
    weight, trained by the sum of its uses' gradients.  Returns the number of
    copies made."""
    sg = model.subgraphs[0]
    uses: dict[int, int] = {}
    for op in sg.operators:
        for t in int_list(op.inputs):
            uses[t] = uses.get(t, 0) + 1
    copies, shared = 0, set()
    for k, op in enumerate(sg.operators):
        props = spec(op_name(model, op))
        inputs = int_list(op.inputs)
        weight = props.weight_input([_operand(model, t) for t in inputs],
                                    _shape(sg.tensors[int_list(op.outputs)[0]]))
        for position in (weight, props.bias if weight is not None else None):
            if position is None or position >= len(inputs) or inputs[position] < 0:
                continue
            t = inputs[position]
            if uses.get(t, 0) > 1 and _is_constant(model, sg.tensors[t]) and \
                    _uniform(buffer_array(model, sg.tensors[t])):
                inputs[position] = _copy(model, t, f"{sg.tensors[t].name}@op{k}")
                shared.add(t)
                copies += 1
        op.inputs = inputs
    drop_unread(model, shared)
    return copies


def _uniform(value: np.ndarray | None) -> bool:
    return value is not None and (value.size == 0 or bool(np.all(value == value.flat[0])))


def _shape(tensor) -> tuple:
    """Its shape, -1 for a dynamic dimension."""
    return tuple(int_list(tensor.shapeSignature) or int_list(tensor.shape))


def _operand(model, t: int) -> Operand | None:
    if t < 0:
        return None
    tensor = model.subgraphs[0].tensors[t]
    constant = _is_constant(model, tensor)
    value = buffer_array(model, tensor) if constant else None
    return Operand(_shape(tensor), tensor_dtype(tensor).kind == "f", constant,
                   value is not None and not value.any())


def _copy(model, t: int, name: str) -> int:
    sg = model.subgraphs[0]
    source = sg.tensors[t]
    sg.tensors.append(circle.TensorT(shape=list(source.shape), type=source.type, name=name,
                                     shapeSignature=source.shapeSignature, hasRank=source.hasRank,
                                     quantization=source.quantization))
    set_constant(model, len(sg.tensors) - 1, buffer_array(model, source).copy())
    return len(sg.tensors) - 1
