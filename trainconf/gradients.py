"""Gradient rules: for each forward operator, the gradient operators that compute
the gradients of its inputs from the gradient of its output.  Which operator
uses which rule is declared in trainconf/operators.py.

A rule is `rule(b, op, dy, needs) -> list[grad | None]`, one entry per op input:
`b` is the backprop builder, `dy` the backprop tensor holding dLoss/d(output),
`needs[i]` whether input i wants a gradient.  Rules only emit operators; the
math of each operator is in schemas/backprop.md and microtrain/step/kernels.
"""
import numpy as np

from microtrain.files.errors import UserError
from microtrain.step.kernels.shape import tile_axes

# Fused activation codes (circle ActivationFunctionType) as ActivationGrad names.
FUSED_NAMES = {1: "relu", 2: "relu_n1_to_1", 3: "relu6", 4: "tanh"}
# Elementwise functions whose derivative the runtime computes from their output
# (ActivationGrad) or from their input (ActivationInputGrad).
ACTIVATION_OPS = {"RELU": "relu", "RELU6": "relu6", "RELU_N1_TO_1": "relu_n1_to_1",
                  "TANH": "tanh", "LOGISTIC": "logistic", "LEAKY_RELU": "leaky_relu",
                  "ELU": "elu", "EXP": "exp", "SQRT": "sqrt", "RSQRT": "rsqrt"}
INPUT_ACTIVATION_OPS = {"HARD_SWISH": "hard_swish", "GELU": "gelu", "LOG": "log",
                        "SQUARE": "square"}
CONV_OPTIONS = ("padding", "stride_w", "stride_h", "dilation_w_factor", "dilation_h_factor")
POOL_OPTIONS = ("padding", "stride_w", "stride_h", "filter_width", "filter_height")

def _pick(options: dict, keys) -> dict:
    return {k: options[k] for k in keys if k in options}


def through_fused(b, op, dy):
    """dLoss/d(pre-activation) of an op with a fused activation."""
    code = op.options.get("fused_activation_function", 0)
    if code == 0:
        return dy
    if code not in FUSED_NAMES:  # 5, SIGN_BIT: a step function, zero slope wherever defined
        raise UserError(None, f"operator {op.index} ({op.type}) has fused activation "
                              f"{code} (SIGN_BIT), which has no gradient")
    y = b.forward(op.outputs[0])
    return b.emit("ActivationGrad", [dy, y], like=op.outputs[0], activation=FUSED_NAMES[code])


def _weighted(input_grad, weight_grad, extra_options=()):
    """Rule of a weighted op (x, w[, bias]) whose gradients are three custom ops."""
    def grad(b, op, dy, needs):
        x, w = op.inputs[:2]
        opts = _pick(op.options, CONV_OPTIONS + tuple(extra_options))
        dz = through_fused(b, op, dy)
        grads = [None] * len(op.inputs)
        if needs[0]:
            grads[0] = b.emit(input_grad, [dz, b.forward(w)], like=x, **opts)
        if needs[1]:
            grads[1] = b.emit(weight_grad, [dz, b.forward(x)], like=w, **opts)
        if len(op.inputs) > 2 and op.inputs[2] >= 0 and needs[2]:
            grads[2] = b.emit("BiasGrad", [dz], like=op.inputs[2])
        return grads
    return grad


fully_connected = _weighted("FullyConnectedInputGrad", "FullyConnectedWeightGrad")
conv_2d = _weighted("Conv2DInputGrad", "Conv2DWeightGrad")
depthwise_conv_2d = _weighted("DepthwiseConv2DInputGrad", "DepthwiseConv2DWeightGrad",
                              ("depth_multiplier",))


def max_pool(b, op, dy, needs):
    dz = through_fused(b, op, dy)
    x = op.inputs[0]
    return [b.emit("MaxPool2DGrad", [dz, b.forward(x)], like=x, **_pick(op.options, POOL_OPTIONS))]


def average_pool(b, op, dy, needs):
    dz = through_fused(b, op, dy)
    return [b.emit("AveragePool2DGrad", [dz], like=op.inputs[0], **_pick(op.options, POOL_OPTIONS))]


def _axis(b, op) -> list[int]:
    return [int(a) for a in np.atleast_1d(b.constant_of(op.inputs[1]))]


def mean_sum(b, op, dy, needs):
    return [b.emit("MeanGrad" if op.type == "MEAN" else "SumGrad", [dy], like=op.inputs[0],
                   axis=_axis(b, op), keep_dims=bool(op.options.get("keep_dims", False))), None]


def reduce_max(b, op, dy, needs):
    x, y = op.inputs[0], op.outputs[0]
    return [b.emit("ReduceMaxGrad", [dy, b.forward(x), b.forward(y)], like=x, axis=_axis(b, op),
                   keep_dims=bool(op.options.get("keep_dims", False))), None]


def l2_normalization(b, op, dy, needs):
    x = op.inputs[0]
    return [b.emit("L2NormalizationGrad", [through_fused(b, op, dy), b.forward(x)], like=x)]


def reshape(b, op, dy, needs):
    return [b.reshape(dy, op.inputs[0])] + [None] * (len(op.inputs) - 1)


def softmax(b, op, dy, needs):
    y = b.forward(op.outputs[0])
    return [b.emit("SoftmaxGrad", [dy, y], like=op.inputs[0], beta=op.options.get("beta", 1.0))]


def activation(b, op, dy, needs):
    y = b.forward(op.outputs[0])
    extra = {"alpha": op.options.get("alpha", 0.2)} if op.type == "LEAKY_RELU" else {}
    return [b.emit("ActivationGrad", [dy, y], like=op.inputs[0],
                   activation=ACTIVATION_OPS[op.type], **extra)]


def add_sub(b, op, dy, needs):
    dz = through_fused(b, op, dy)
    grads = [None, None]
    if needs[0]:
        grads[0] = b.sum_to(dz, op.inputs[0])
    if needs[1]:
        dz_b = b.emit("NEG", [dz], like_tensor=dz) if op.type == "SUB" else dz
        grads[1] = b.sum_to(dz_b, op.inputs[1])
    return grads


def mul(b, op, dy, needs):
    dz = through_fused(b, op, dy)
    x, w = op.inputs
    grads = [None, None]
    if needs[0]:
        grads[0] = b.sum_to(b.emit("MUL", [dz, b.forward(w)], like_tensor=dz), x)
    if needs[1]:
        grads[1] = b.sum_to(b.emit("MUL", [dz, b.forward(x)], like_tensor=dz), w)
    return grads


def div(b, op, dy, needs):
    # z = x / w: dx = dz / w, dw = -(dz / w) * (x / w)
    dz = through_fused(b, op, dy)
    x, w = op.inputs
    dz_over_w = b.emit("DIV", [dz, b.forward(w)], like_tensor=dz)
    grads = [None, None]
    if needs[0]:
        grads[0] = b.sum_to(dz_over_w, x)
    if needs[1]:
        quotient = b.emit("DIV", [b.forward(x), b.forward(w)], like_tensor=dz)
        product = b.emit("MUL", [dz_over_w, quotient], like_tensor=dz)
        grads[1] = b.sum_to(b.emit("NEG", [product], like_tensor=dz), w)
    return grads


def concatenation(b, op, dy, needs):
    dz = through_fused(b, op, dy)
    rank = len(b.fwd.tensors[op.outputs[0]].shape)
    axis = op.options.get("axis", 0) % rank
    grads, start = [], 0
    for t, need in zip(op.inputs, needs):
        shape = b.fwd.tensors[t].shape
        if need:
            begin = [0] * rank
            begin[axis] = start
            grads.append(b.slice(dz, begin, t))
        else:
            grads.append(None)
        start += shape[axis]
    return grads


def pad(b, op, dy, needs):
    before = [int(p) for p in b.constant_of(op.inputs[1])[:, 0]]
    return [b.slice(dy, before, op.inputs[0])] + [None] * (len(op.inputs) - 1)


def mirror_pad(b, op, dy, needs):
    paddings = b.const(np.asarray(b.constant_of(op.inputs[1]), np.int32), "paddings")
    return [b.emit("MirrorPadGrad", [dy, paddings], like=op.inputs[0],
                   mode=int(op.options.get("mode", 0))), None]


def depth_space(b, op, dy, needs):
    inverse = "SPACE_TO_DEPTH" if op.type == "DEPTH_TO_SPACE" else "DEPTH_TO_SPACE"
    return [b.emit(inverse, [dy], like=op.inputs[0], block_size=op.options["block_size"])]


STRIDED_OPTIONS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                   "shrink_axis_mask", "offset")


def _strided_slice_grad(b, dy, x, begin, end, strides, **options):
    consts = [b.const(np.asarray(v, np.int32), name)
              for v, name in ((begin, "begin"), (end, "end"), (strides, "strides"))]
    return b.emit("StridedSliceGrad", [dy, *consts], like=x, **options)


def strided_slice(b, op, dy, needs):
    begin, end, strides = (b.constant_of(t) for t in op.inputs[1:4])
    return [_strided_slice_grad(b, dy, op.inputs[0], begin, end, strides,
                                **_pick(op.options, STRIDED_OPTIONS)), None, None, None]


def slice_(b, op, dy, needs):
    begin, size = (np.asarray(b.constant_of(t)).reshape(-1) for t in op.inputs[1:3])
    to_end = size == -1
    end_mask = sum(1 << i for i in np.flatnonzero(to_end).tolist())
    return [_strided_slice_grad(b, dy, op.inputs[0], begin, np.where(to_end, 0, begin + size),
                                np.ones_like(begin), end_mask=end_mask), None, None]


def split(b, op, dy, needs):
    dys = dy if isinstance(dy, list) else [dy]
    x, axis = (op.inputs[1], op.inputs[0]) if op.type == "SPLIT" else (op.inputs[0], op.inputs[2])
    axis = int(np.asarray(b.constant_of(axis)).reshape(-1)[0])
    sizes = [b.fwd.tensors[t].shape[axis] for t in op.outputs]
    if any(s < 0 for s in sizes):
        raise UserError(None, f"operator {op.index} ({op.type}) splits the batch axis")
    dx = b.emit("SplitGrad", [-1 if d is None else d for d in dys], like=x, axis=axis, sizes=sizes)
    return [None, dx] if op.type == "SPLIT" else [dx, None, None]


def _table_grad(b, table, indices, axis, dy):
    """GatherGrad of a gathered tensor: a scatter-add of dY into the rows the
    indices touched; constant indices become the backprop graph's own constant,
    computed ones (token ids) are read from the forward pass."""
    fwd = b.fwd.tensors[indices]
    index = b.forward(indices) if fwd.data is None else \
        b.const(np.asarray(fwd.data, np.int32), "indices")
    return b.emit("GatherGrad", [dy, index], like=table, axis=axis)


def gather(b, op, dy, needs):
    """GATHER(params, indices): params is an activation or an embedding table."""
    params, indices = op.inputs[:2]
    return [_table_grad(b, params, indices, int(op.options.get("axis", 0)), dy), None]


def embedding_lookup(b, op, dy, needs):
    """EMBEDDING_LOOKUP(ids, table)."""
    ids, table = op.inputs[:2]
    return [None, _table_grad(b, table, ids, 0, dy)]


def transpose(b, op, dy, needs):
    perm = b.constant_of(op.inputs[1]).astype(np.int64)
    inverse = b.const(np.argsort(perm).astype(np.int32), "perm")
    return [b.emit("TRANSPOSE", [dy, inverse], like=op.inputs[0]), None]


def batch_matmul(b, op, dy, needs):
    # c = op(x) @ op(w), op() transposing the last two axes where adj_* is set.
    x, w = op.inputs
    adj_x, adj_y = bool(op.options.get("adj_x")), bool(op.options.get("adj_y"))
    batch = b.fwd.tensors[op.outputs[0]].shape[:-2]
    grads = [None, None]
    if needs[0]:
        pair = ([b.forward(w), dy], dict(adj_x=adj_y, adj_y=True)) if adj_x else \
            ([dy, b.forward(w)], dict(adj_x=False, adj_y=not adj_y))
        full = b.emit("BATCH_MATMUL", pair[0], shape=batch + b.fwd.tensors[x].shape[-2:], **pair[1])
        grads[0] = b.sum_to(full, x)
    if needs[1]:
        pair = ([dy, b.forward(x)], dict(adj_x=True, adj_y=adj_x)) if adj_y else \
            ([b.forward(x), dy], dict(adj_x=not adj_x, adj_y=False))
        full = b.emit("BATCH_MATMUL", pair[0], shape=batch + b.fwd.tensors[w].shape[-2:], **pair[1])
        grads[1] = b.sum_to(full, w)
    return grads


def input_activation(b, op, dy, needs):
    extra = {"approximate": bool(op.options.get("approximate"))} if op.type == "GELU" else {}
    return [b.emit("ActivationInputGrad", [dy, b.forward(op.inputs[0])], like=op.inputs[0],
                   activation=INPUT_ACTIVATION_OPS[op.type], **extra)]


def prelu(b, op, dy, needs):
    x, alpha = op.inputs
    grads = [None, None]
    if needs[0]:
        grads[0] = b.emit("PReluInputGrad", [dy, b.forward(x), b.forward(alpha)], like=x)
    if needs[1]:
        grads[1] = b.emit("PReluAlphaGrad", [dy, b.forward(x)], like=alpha)
    return grads


def squared_difference(b, op, dy, needs):
    # y = (a - b)²: da = 2(a - b)·dy, db = -da
    x, w = op.inputs
    diff = b.emit("SUB", [b.forward(x), b.forward(w)], like_tensor=dy)
    product = b.emit("MUL", [dy, diff], like_tensor=dy)
    twice = b.emit("ADD", [product, product], like_tensor=dy)
    grads = [None, None]
    if needs[0]:
        grads[0] = b.sum_to(twice, x)
    if needs[1]:
        grads[1] = b.sum_to(b.emit("NEG", [twice], like_tensor=dy), w)
    return grads


def pick(b, op, dy, needs):
    operands = [b.forward(t) for t in op.inputs]
    return [b.sum_to(b.emit("PickGrad", [dy, *operands], like_tensor=dy, op=op.type.lower(),
                            operand=i), t) if need else None
            for i, (t, need) in enumerate(zip(op.inputs, needs))]


def log_softmax(b, op, dy, needs):
    y = b.forward(op.outputs[0])
    return [b.emit("LogSoftmaxGrad", [dy, y], like=op.inputs[0])]


def _resize(grad_op):
    def grad(b, op, dy, needs):
        options = {k: bool(op.options.get(k)) for k in ("align_corners", "half_pixel_centers")}
        return [b.emit(grad_op, [dy], like=op.inputs[0], **options), None]
    return grad


resize_bilinear = _resize("ResizeBilinearGrad")
resize_nearest_neighbor = _resize("ResizeNearestNeighborGrad")


def transpose_conv(b, op, dy, needs):
    """TRANSPOSE_CONV (output shape, W, x[, bias]) and MediaPipe's
    Convolution2DTransposeBias (x, W, bias)."""
    x_at, bias_at = (2, 3) if op.type == "TRANSPOSE_CONV" else (0, 2)
    x, w = op.inputs[x_at], op.inputs[1]
    opts = _pick(op.options, ("padding", "stride_w", "stride_h"))
    dz = through_fused(b, op, dy)
    grads = [None] * len(op.inputs)
    if needs[x_at]:
        grads[x_at] = b.emit("TransposeConvInputGrad", [dz, b.forward(w)], like=x, **opts)
    if needs[1]:
        grads[1] = b.emit("TransposeConvWeightGrad", [dz, b.forward(x)], like=w, **opts)
    if len(op.inputs) > bias_at and op.inputs[bias_at] >= 0 and needs[bias_at]:
        grads[bias_at] = b.emit("BiasGrad", [dz], like=op.inputs[bias_at])
    return grads


def transform_landmarks(b, op, dy, needs):
    """MediaPipe's TransformLandmarks (landmarks [B, N, 2], matrix [B, 4, 4]):
    y = x · A^T + t with A the matrix's top-left 2×2, so dx = dy · A.  The matrix
    comes from landmarks through Landmarks2TransformMatrix, which has no gradient:
    a gradient wanted for it is refused."""
    x, m = op.inputs
    if needs[1]:
        raise UserError(None, f"operator {op.index} ({op.type}): its transform matrix (input 1) "
                              "is on the gradient path, but only its landmarks (input 0) have "
                              "a gradient rule")
    if b.fwd.tensors[x].shape[-1] != 2:
        raise UserError(None, f"operator {op.index} ({op.type}): the gradient of 3-D "
                              "landmarks is not supported")
    size = b.const(np.array([-1, 2, 2], np.int32), "size")
    a = b.emit("SLICE", [b.forward(m), b.const(np.zeros(3, np.int32), "begin"), size],
               shape=b.fwd.tensors[m].shape[:1] + (2, 2))
    return [b.emit("BATCH_MATMUL", [dy, a], like=x, adj_x=False, adj_y=False), None]


def neg(b, op, dy, needs):
    return [b.emit("NEG", [dy], like=op.inputs[0])]


def select(b, op, dy, needs):
    """SELECT(cond, a, b): each branch gets dY where it was picked, 0 elsewhere,
    summed down to its shape where it was broadcast; the condition gets none."""
    cond, *branches = op.inputs
    mask = b.forward(cond)
    rank, cond_shape = len(b.shape_of(dy)), b.fwd.tensors[cond].shape
    if op.type == "SELECT" and len(cond_shape) == 1 and rank > 1:  # picks along the first axis
        shape = cond_shape + (1,) * (rank - 1)
        mask = b.emit("RESHAPE", [mask, b.const(np.array(shape, np.int32), "shape")],
                      shape=shape, dtypes=[np.dtype(np.bool_)])
    zero = b.const(np.zeros((), b.grad_dtype), "zero")
    grads = [None]
    for i, (t, need) in enumerate(zip(branches, needs[1:])):
        picked = [dy, zero] if i == 0 else [zero, dy]
        grads.append(b.sum_to(b.emit("SELECT_V2", [mask, *picked], like_tensor=dy), t)
                     if need else None)
    return grads


def reverse_v2(b, op, dy, needs):
    axis = b.const(np.asarray(b.constant_of(op.inputs[1]), np.int32), "axis")
    return [b.emit("REVERSE_V2", [dy, axis], like=op.inputs[0]), None]


def broadcast_to(b, op, dy, needs):
    return [b.sum_to(dy, op.inputs[0]), None]


def reduce_prod(b, op, dy, needs):
    x = op.inputs[0]
    return [b.emit("ReduceProdGrad", [dy, b.forward(x)], like=x, axis=_axis(b, op),
                   keep_dims=bool(op.options.get("keep_dims", False))), None]


def tile(b, op, dy, needs):
    """TILE's gradient: dY seen as [multiple, size] along each tiled axis (a
    RESHAPE), summed over the multiples (a SUM)."""
    x = op.inputs[0]
    shape = b.fwd.tensors[x].shape
    split, copies = tile_axes(shape, np.asarray(b.constant_of(op.inputs[1])).reshape(-1).tolist())
    if not copies:
        return [b.reshape(dy, x), None]
    if any(split[i + 1] < 0 for i in copies):
        raise UserError(None, f"operator {op.index} ({op.type}) tiles the batch axis")
    parts = b.emit("RESHAPE", [dy, b.const(np.array(split, np.int32), "shape")], shape=split)
    return [b.emit("SUM", [parts, b.const(np.array(copies, np.int32), "axis")], like=x,
                   keep_dims=False), None]


def cumsum(b, op, dy, needs):
    """CUMSUM's gradient: the running sum of dY taken the other way."""
    axis = b.const(np.asarray(b.constant_of(op.inputs[1]), np.int32), "axis")
    return [b.emit("CUMSUM", [dy, axis], like=op.inputs[0],
                   exclusive=bool(op.options.get("exclusive")),
                   reverse=not op.options.get("reverse")), None]


FAKE_QUANT_OPTIONS = ("min", "max", "num_bits", "narrow_range")


def fake_quant(b, op, dy, needs):
    """Straight through where X's level is representable (FakeQuantGrad)."""
    x = op.inputs[0]
    return [b.emit("FakeQuantGrad", [dy, b.forward(x)], like=x,
                   **_pick(op.options, FAKE_QUANT_OPTIONS))]


def fake_quant_per_channel(b, op, dy, needs):
    """Straight through within each channel's range; `qas` as split chose it.
    The scales (when an input: tracked ones have none) get no gradient."""
    w, *scales = op.inputs
    return [b.emit("FakeQuantPerChannelGrad", [dy, *map(b.forward, op.inputs)], like=w,
                   **_pick(op.options, ("axis", "num_bits", "qas"))), *(None for _ in scales)]
