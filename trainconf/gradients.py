"""Gradient rules: for each forward operator, the gradient operators that compute
the gradients of its inputs from the gradient of its output.  Which operator
uses which rule is declared in trainconf/operators.py.

A rule is `rule(b, op, dy, needs) -> list[grad | None]`, one entry per op input:
`b` is the backprop builder, `dy` the backprop tensor holding dLoss/d(output),
`needs[i]` whether input i wants a gradient.  Rules only emit operators; the
math of each operator is in schemas/backprop.md and microtrain/kernels.
"""
import numpy as np

from microtrain.errors import UserError

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


def mean(b, op, dy, needs):
    axis = [int(a) for a in np.atleast_1d(b.constant_of(op.inputs[1]))]
    return [b.emit("MeanGrad", [dy], like=op.inputs[0], axis=axis,
                   keep_dims=bool(op.options.get("keep_dims", False))), None]


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
    return [b.slice(dy, before, op.inputs[0]), None]


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
