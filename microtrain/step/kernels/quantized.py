"""Integer kernels: operators on quantized (int8) tensors, computed as TFLite's
reference kernels compute them, to the bit.

Products of int8 values are summed exactly: the operands, minus their zero
points, are copied into float scratch, where the float kernels of this package
compute the sums (float32 where no sum can pass 2**24, else float64, exact below
2**53: exact either way whatever the order of the additions), and the int32
accumulator is then requantized with the fixed-point arithmetic of
microtrain/step/fixedpoint.py.  Each factory takes the
OpQuantization of the operator's tensors after its arrays.
"""
import math
from functools import partial

import numpy as np

from microtrain.files.errors import OperatorError, UserError
from microtrain.step.fixedpoint import (as_i64, divide_by_pot, doubling_high_mul,
                                        doubling_high_mul_truncated, exp_on_negative_values,
                                        inv_sqrt_multiplier, multiply_by_quantized_multiplier,
                                        reciprocal, round_half_away, saturating_left_shift, wrap32)
from microtrain.files.quantization import (activation_range, dequantize, op_quantization, quantize,
                                           quantize_multiplier, requantize, type_range)
from microtrain.step.kernels import INTEGER_KERNELS, KERNELS, Step, in_sequence, kernel
from microtrain.step.kernels.workspace import scratch

F64 = np.float64
# what the kernels compute on: int8 activations (int32: a bias cut out of the graph to train);
# QUANTIZE and DEQUANTIZE also take uint8, the edges of a model converted with uint8 inputs
# or outputs (`inference_input_type=tf.uint8`)
COMPUTED_TYPES = (np.dtype(np.int8), np.dtype(np.int32))
EDGE_TYPES = {"QUANTIZE": COMPUTED_TYPES + (np.dtype(np.uint8),),
              "DEQUANTIZE": COMPUTED_TYPES + (np.dtype(np.uint8),)}


def integer_problem(g, op) -> str | None:
    """Why microtrain cannot run `op` of graph g as its quantized tensors ask (None:
    it can, or it computes in float on float constants)."""
    quant = op_quantization(g, op)
    if quant is None:
        held = [g.tensors[i] for i in op.inputs
                if i >= 0 and g.tensors[i].data is not None and g.tensors[i].quantization
                is not None and g.tensors[i].dtype.kind in "iu"]
        return None if not held else (
            f"reads the quantized constant '{held[0].name}' with float activations (a "
            "dynamic-range model): split it (`trainconf split` dequantizes such weights) "
            "and run the split model")
    for i in [i for i in op.inputs if i >= 0] + op.outputs:
        t, q = g.tensors[i], g.tensors[i].quantization
        if q is None:
            continue
        if t.data is None and t.dtype not in EDGE_TYPES.get(op.type, COMPUTED_TYPES):
            return (f"computes on {t.dtype} activations (tensor {i} '{t.name}'): microtrain's "
                    "integer kernels compute int8 activations only")
        if not (np.isfinite(q.scale).all() and (q.scale > 0).all()) or \
                q.zero_point.size not in (1, q.scale.size):
            return (f"reads tensor {i} '{t.name}' of scales {q.scale.tolist()} and zero points "
                    f"{q.zero_point.tolist()}: scales must be positive and finite, one zero "
                    "point for all or one per scale")
    if op.type not in INTEGER_KERNELS:
        return "on int8 activations has no integer kernel in microtrain"
    return None


def check_integer_ops(g, path) -> None:
    """A one-line UserError naming the first operator of graph g that microtrain cannot
    run as its quantized tensors ask (integer_problem)."""
    for op in g.ops:
        if problem := integer_problem(g, op):
            raise UserError(path, f"operator {op.index} ({op.type}) {problem}")


def _centred(a: np.ndarray, q, dtype=F64) -> tuple[np.ndarray, Step]:
    """Scratch of `dtype` for a − zero point (per slice for a per-channel tensor) and
    the step filling it (the weights too: a training run may change them)."""
    out = scratch(a.shape, dtype)
    zero = 0 if q is None else q.along(q.zero_point, a.ndim).astype(dtype)
    return out, partial(np.subtract, a, zero, out=out, dtype=dtype)


def _requantizer(acc: np.ndarray, bias, y: np.ndarray, real, qy, code: int, once: bool):
    """The step writing y = the int32 accumulators `acc` (float, exact) plus the int32
    `bias` (or None) times the real multipliers `real` (one, or one per channel of y's
    last axis), rounded twice or `once` (see requantize), plus y's zero point, clamped
    to the fused activation's range."""
    mult, shift = quantize_multiplier(real)
    lo, hi = activation_range(code, qy, y.dtype)
    zero = int(qy.zero_point[0])

    def step():
        total = acc.astype(np.int64) if bias is None else acc.astype(np.int64) + bias
        np.copyto(y, requantize(total, mult, shift, zero, lo, hi, y.dtype, once))
    return step


def _scale(q) -> F64:
    return F64(q.scale[0])


EXACT_F32 = 1 << 24  # integers up to this are exact in float32


def _sums_type(name: str, x, w, qx, qw, opts: dict):
    """float32 when no sum of the operator's products can exceed 2**24 in magnitude (the
    products' count times the largest |x − zx| and |w − zw| the types allow), so that
    float32 sums are exact in any order of additions (BLAS's sgemm is about twice
    dgemm's speed); else float64, exact below 2**53."""
    terms = {"CONV_2D": lambda: w[0].size, "TRANSPOSE_CONV": lambda: w[0].size,
             "DEPTHWISE_CONV_2D": lambda: w.shape[1] * w.shape[2],
             "FULLY_CONNECTED": lambda: w.shape[-1],
             "BATCH_MATMUL": lambda: x.shape[-2 if opts.get("adj_x") else -1]}[name]()
    return np.float32 if terms * _span(x.dtype, qx) * _span(w.dtype, qw) <= EXACT_F32 else F64


def _span(dtype, q) -> int:
    """The largest |v − zero point| of a value v of integer `dtype`."""
    lo, hi = type_range(dtype)
    zero = np.zeros(1, np.int64) if q is None else q.zero_point
    return int(np.max(np.maximum(hi - zero, zero - lo)))


def _weighted(name: str, inputs, outputs, quant, code: int, opts: dict, at=(0, 1, 2)):
    """CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, BATCH_MATMUL, TRANSPOSE_CONV: int32
    sums of (x − zx)·(w − zw) plus the int32 bias, requantized per output channel by
    scale_x·scale_w/scale_y (in double, as TFLite's per-channel multipliers).  The sums
    are the float kernels' on centred copies (_sums_type), the bias added in int64.
    LiteRT's reference FULLY_CONNECTED rounds the product once, the others twice
    (measured: tests/test_kernels_quantized.py).  `at`: the positions of x, w and the
    bias among the inputs (the float kernel gets the others as they are)."""
    x, w, b = (inputs[i] if i < len(inputs) else None for i in at)
    (y,) = outputs
    (qx, qw), qy = (quant.inputs[i] for i in at[:2]), quant.outputs[0]
    if qw is None:
        raise OperatorError(None, "its weights are not quantized (a model that mixes float "
                                  "weights with int8 activations)")
    dtype = _sums_type(name, x, w, qx, qw, opts)
    xs, load_x = _centred(x, qx, dtype)
    ws, load_w = _centred(w, qw, dtype)
    acc = scratch(y.shape, dtype)
    operands = list(inputs)
    operands[at[0]], operands[at[1]] = xs, ws
    if at[2] < len(operands):
        operands[at[2]] = None
    inner = KERNELS[name](operands, [acc], **opts)
    real = _scale(qx) * qw.scale.astype(F64) / _scale(qy)
    once = name == "FULLY_CONNECTED"
    return in_sequence([load_x, load_w, inner, _requantizer(acc, b, y, real, qy, code, once)])


@kernel("CONV_2D", integer=True)
def conv_2d(inputs, outputs, quant, fused_activation_function=0, **opts):
    return _weighted("CONV_2D", inputs, outputs, quant, fused_activation_function, opts)


@kernel("DEPTHWISE_CONV_2D", integer=True)
def depthwise_conv_2d(inputs, outputs, quant, fused_activation_function=0, **opts):
    return _weighted("DEPTHWISE_CONV_2D", inputs, outputs, quant, fused_activation_function, opts)


@kernel("FULLY_CONNECTED", integer=True)
def fully_connected(inputs, outputs, quant, fused_activation_function=0, **opts):
    return _weighted("FULLY_CONNECTED", inputs, outputs, quant, fused_activation_function, opts)


@kernel("TRANSPOSE_CONV", integer=True)
def transpose_conv(inputs, outputs, quant, fused_activation_function=0, **opts):
    """Inputs: the output's shape, the weights, x, the bias."""
    return _weighted("TRANSPOSE_CONV", inputs, outputs, quant, fused_activation_function, opts,
                     at=(2, 1, 3))


@kernel("BATCH_MATMUL", integer=True)
def batch_matmul(inputs, outputs, quant, **opts):
    """Both operands activations (attention's scores and values) or the second a constant."""
    return _weighted("BATCH_MATMUL", inputs, outputs, quant, 0, opts)


def _clamped(y: np.ndarray, qy, code: int):
    """A step clamping y in place to the integer range of fused activation `code`."""
    lo, hi = activation_range(code, qy, y.dtype)
    return partial(np.clip, y, lo, hi, out=y)


ADD_LEFT_SHIFT = 20  # the headroom TFLite's 8-bit ADD gives its operands


def _add(inputs, outputs, quant, code: int, sign: int):
    """TFLite's 8-bit ADD (sign 1) and SUB (sign −1): each operand minus its zero point,
    shifted left by 20 and scaled by its scale / (2·the larger scale), the second by the
    negated multiplier for SUB; their sum scaled back to y's."""
    (x1, x2), (y,) = inputs, outputs
    (q1, q2), qy = quant.inputs, quant.outputs[0]
    twice = 2 * F64(max(q1.scale[0], q2.scale[0]))
    m1, s1 = quantize_multiplier(_scale(q1) / twice)
    m2, s2 = quantize_multiplier(_scale(q2) / twice)
    mo, so = quantize_multiplier(twice / (F64(1 << ADD_LEFT_SHIFT) * _scale(qy)))
    lo, hi = activation_range(code, qy, y.dtype)
    z1, z2, zy = (int(q.zero_point[0]) for q in (q1, q2, qy))

    def scaled(x, zero, m, s):
        return multiply_by_quantized_multiplier((as_i64(x) - zero) << ADD_LEFT_SHIFT, m, s)

    def step():
        total = scaled(x1, z1, m1, s1) + scaled(x2, z2, sign * m2, s2)
        np.copyto(y, requantize(total, mo, so, zy, lo, hi, y.dtype))
    return step


@kernel("ADD", integer=True)
def add(inputs, outputs, quant, fused_activation_function=0, **_):
    return _add(inputs, outputs, quant, fused_activation_function, 1)


@kernel("SUB", integer=True)
def sub(inputs, outputs, quant, fused_activation_function=0, **_):
    return _add(inputs, outputs, quant, fused_activation_function, -1)


SQUARED_DIFFERENCE_LEFT_SHIFT = 7  # int8 operands: (255 << 7)² still fits in int32


@kernel("SQUARED_DIFFERENCE", integer=True)
def squared_difference(inputs, outputs, quant, **_):
    """TFLite's int8 SQUARED_DIFFERENCE: each operand minus its zero point, shifted left
    by 7 and scaled by its scale / (2·the larger scale) as ADD's; the square of their
    difference scaled by (2·the larger scale)² / (2**14 · scale_y), all in double."""
    (x1, x2), (y,) = inputs, outputs
    (q1, q2), qy = quant.inputs, quant.outputs[0]
    twice = 2 * F64(max(q1.scale[0], q2.scale[0]))
    m1, s1 = quantize_multiplier(_scale(q1) / twice)
    m2, s2 = quantize_multiplier(_scale(q2) / twice)
    mo, so = quantize_multiplier(twice * twice
                                 / (F64(1 << 2 * SQUARED_DIFFERENCE_LEFT_SHIFT) * _scale(qy)))
    lo, hi = type_range(y.dtype)
    z1, z2, zy = (int(q.zero_point[0]) for q in (q1, q2, qy))

    def scaled(x, zero, m, s):
        return multiply_by_quantized_multiplier(
            (as_i64(x) - zero) << SQUARED_DIFFERENCE_LEFT_SHIFT, m, s)

    def step():
        diff = scaled(x1, z1, m1, s1) - scaled(x2, z2, m2, s2)
        np.copyto(y, requantize(diff * diff, mo, so, zy, lo, hi, y.dtype))
    return step


def _ratio32(qx, qy) -> F64:
    """scale_x / scale_y divided in float32 (as TFLite's RELU and LEAKY_RELU do)."""
    return F64(qx.scale[0] / qy.scale[0])


def _relu(code: int):
    """RELU, RELU_N1_TO_1, RELU6 on int8: x − zx requantized by scale_x/scale_y, clamped
    to the activation's range."""
    def factory(inputs, outputs, quant, **_):
        (x,), (y,) = inputs, outputs
        qx, qy = quant.inputs[0], quant.outputs[0]
        mult, shift = quantize_multiplier(_ratio32(qx, qy))
        lo, hi = activation_range(code, qy, y.dtype)
        zx, zy = int(qx.zero_point[0]), int(qy.zero_point[0])
        return lambda: np.copyto(y, requantize(as_i64(x) - zx, mult, shift, zy, lo, hi, y.dtype))
    return factory


for _name, _code in (("RELU", 1), ("RELU_N1_TO_1", 2), ("RELU6", 3)):
    kernel(_name, integer=True)(_relu(_code))


@kernel("LEAKY_RELU", integer=True)
def leaky_relu(inputs, outputs, quant, alpha=0.2, **_):
    """x − zx requantized by scale_x/scale_y where it is not negative, by
    alpha·scale_x/scale_y where it is (both in float32, as TFLite)."""
    (x,), (y,) = inputs, outputs
    qx, qy = quant.inputs[0], quant.outputs[0]
    identity = quantize_multiplier(_ratio32(qx, qy))
    sloped = quantize_multiplier(F64(qx.scale[0] * np.float32(alpha) / qy.scale[0]))
    lo, hi = type_range(y.dtype)
    zx, zy = int(qx.zero_point[0]), int(qy.zero_point[0])

    def step():
        centred = as_i64(x) - zx
        mult, shift = (np.where(centred >= 0, a, b) for a, b in zip(identity, sloped))
        np.copyto(y, requantize(centred, mult, shift, zy, lo, hi, y.dtype))
    return step


@kernel("PRELU", integer=True)
def prelu(inputs, outputs, quant, **_):
    """TFLite's int8 PRELU: x − zx requantized by scale_x/scale_y where it is not
    negative, (x − zx)·(alpha − z_alpha) by scale_x·scale_alpha/scale_y where it is (in
    double), plus zy, saturated."""
    (x, alpha), (y,) = inputs, outputs
    (qx, qa), qy = quant.inputs, quant.outputs[0]
    identity = quantize_multiplier(_scale(qx) / _scale(qy))
    sloped = quantize_multiplier(_scale(qx) * _scale(qa) / _scale(qy))
    lo, hi = type_range(y.dtype)
    zx, za, zy = (int(q.zero_point[0]) for q in (qx, qa, qy))

    def step():
        centred = as_i64(x) - zx
        negative = np.broadcast_to(centred < 0, y.shape)
        product = np.where(negative, centred * (as_i64(alpha) - za), centred)
        mult, shift = (np.where(negative, b, a) for a, b in zip(identity, sloped))
        np.copyto(y, requantize(product, mult, shift, zy, lo, hi, y.dtype))
    return step


@kernel("MUL", integer=True)
def mul(inputs, outputs, quant, fused_activation_function=0, **_):
    """TFLite's 8-bit MUL: (x1 − z1)·(x2 − z2) requantized by scale1·scale2/scale_y,
    a multiplier TFLite computes in float32."""
    (x1, x2), (y,) = inputs, outputs
    (q1, q2), qy = quant.inputs, quant.outputs[0]
    real = F64(np.float32(q1.scale[0]) * np.float32(q2.scale[0]) / np.float32(qy.scale[0]))
    mult, shift = quantize_multiplier(real)
    lo, hi = activation_range(fused_activation_function, qy, y.dtype)
    z1, z2, zy = (int(q.zero_point[0]) for q in (q1, q2, qy))

    def step():
        product = (as_i64(x1) - z1) * (as_i64(x2) - z2)
        np.copyto(y, requantize(product, mult, shift, zy, lo, hi, y.dtype))
    return step


@kernel("MAX_POOL_2D", integer=True)
def max_pool_2d(inputs, outputs, quant, fused_activation_function=0, **opts):
    """The largest value of each window (input and output share their scale), clamped."""
    (x,), (y,) = inputs, outputs
    xs, load = _centred(x, None)
    pooled = scratch(y.shape, F64)
    inner = KERNELS["MAX_POOL_2D"]([xs], [pooled], **opts)
    clamp = _clamped(y, quant.outputs[0], fused_activation_function)
    return in_sequence([load, inner, partial(np.copyto, y, pooled, casting="unsafe"), clamp])


@kernel("AVERAGE_POOL_2D", integer=True)
def average_pool_2d(inputs, outputs, quant, fused_activation_function=0, filter_height=1,
                    filter_width=1, **opts):
    """The sum of each window's non-padded pixels divided by their count, rounded
    half away from zero (integer division), clamped.  The sums are a depthwise
    convolution by ones, the counts the same of an image of ones."""
    (x,), (y,) = inputs, outputs
    channels = x.shape[3]
    ones = np.ones((1, filter_height, filter_width, channels), F64)
    counts = np.empty((1, *y.shape[1:]), F64)
    KERNELS["DEPTHWISE_CONV_2D"]([np.ones((1, *x.shape[1:]), F64), ones, None], [counts],
                                 **opts)()
    counts = counts.astype(np.int64)
    xs, load = _centred(x, None)
    sums = scratch(y.shape, F64)
    inner = KERNELS["DEPTHWISE_CONV_2D"]([xs, ones, None], [sums], **opts)
    lo, hi = activation_range(fused_activation_function, quant.outputs[0], y.dtype)

    def divide():
        np.copyto(y, np.clip(_divide_rounded(sums.astype(np.int64), counts), lo, hi),
                  casting="unsafe")
    return in_sequence([load, inner, divide])


def _divide_rounded(total, count):
    """total / count rounded half away from zero, as C's (total ± count/2) / count."""
    half = count // 2
    shifted = np.where(total > 0, total + half, total - half)
    return np.sign(shifted) * (np.abs(shifted) // count)


@kernel("MEAN", integer=True)
def mean(inputs, outputs, quant, **_):
    """LiteRT's integer mean: the sum of x − zx over the axes, times
    scale_x / (scale_y · count) in fixed point: the multiplier of scale_x/scale_y
    shifted left by up to log2(count) bits, divided by the count (truncated), the
    shift lowered by as many."""
    x, axes = inputs
    (y,) = outputs
    qx, qy = quant.inputs[0], quant.outputs[0]
    axes = tuple(sorted({int(a) % x.ndim for a in np.asarray(axes).reshape(-1)}))
    count = int(np.prod([x.shape[a] for a in axes]))
    mult, shift = (int(v) for v in quantize_multiplier(_scale(qx) / _scale(qy)))
    bits = min(count.bit_length() - 1, 32, 31 + shift)
    mult, shift = (mult << bits) // count, shift - bits
    lo, hi = type_range(y.dtype)
    zx, zy = int(qx.zero_point[0]), int(qy.zero_point[0])

    def step():
        total = np.sum(x, axis=axes, dtype=np.int64).reshape(y.shape) - zx * count
        np.copyto(y, requantize(total, mult, shift, zy, lo, hi, y.dtype))
    return step


SOFTMAX_DIFF_BITS = 5  # integer bits of the scaled input differences (Q5.26)
SOFTMAX_SUM_BITS = 12  # integer bits of the sum of exponentials


@kernel("SOFTMAX", integer=True)
def softmax(inputs, outputs, quant, beta=1.0, **_):
    """TFLite's reference 8-bit softmax: each difference to its row's largest value,
    scaled by beta·scale_x into Q5.26, exponentiated in fixed point, the sum of the
    exponentials inverted in fixed point; outputs of scale 1/256 (int8: zero point −128)."""
    (x,), (y,) = inputs, outputs
    real = min(F64(beta) * _scale(quant.inputs[0]) * (1 << (31 - SOFTMAX_DIFF_BITS)),
               F64((1 << 31) - 1))
    mult, left = (int(v) for v in quantize_multiplier(real))
    diff_min = -int(np.floor(((1 << SOFTMAX_DIFF_BITS) - 1) * F64(1 << (31 - SOFTMAX_DIFF_BITS))
                             / F64(1 << left)))
    lo, hi = type_range(y.dtype)
    rows_x, rows_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])

    def step():
        values = as_i64(rows_x)
        diff = values - values.max(axis=1, keepdims=True)
        kept = diff >= diff_min
        exps = exp_on_negative_values(doubling_high_mul(wrap32(diff << left), mult),
                                      SOFTMAX_DIFF_BITS)
        total = np.where(kept, divide_by_pot(exps, SOFTMAX_SUM_BITS), 0).sum(axis=1, keepdims=True)
        inverse, over = reciprocal(total, SOFTMAX_SUM_BITS)
        out = divide_by_pot(doubling_high_mul(inverse, exps), over + 31 - 8 * y.itemsize) + lo
        np.copyto(rows_y, np.where(kept, np.clip(out, lo, hi), lo), casting="unsafe")
    return step


def _table(x: np.ndarray, y: np.ndarray, table: np.ndarray):
    """The step mapping each int8 of x through a table of the 256 values."""
    return lambda: np.copyto(y, table[as_i64(x) + 128])


def _float_table(x, y, quant, function):
    """LiteRT's int8 activations by table: each of the 256 inputs dequantized in float32,
    mapped by `function` (float64, rounded to float32: as the C library's float
    functions), quantized with y's scale and zero point (rounded half away from zero)."""
    qx, qy = quant.inputs[0], quant.outputs[0]
    real = dequantize(np.arange(-128, 128), qx)
    values = function(real.astype(F64)).astype(np.float32)
    scaled = (values * (np.float32(1) / qy.scale[0])).astype(np.float32)
    table = np.clip(round_half_away(scaled) + int(qy.zero_point[0]), *type_range(y.dtype))
    return _table(x, y, table.astype(y.dtype))


@kernel("LOGISTIC", integer=True)
def logistic(inputs, outputs, quant, **_):
    """1 / (1 + exp(−x)) by table (output scale 1/256), the division in float32."""
    def sigmoid(real):
        return np.float32(1) / (np.float32(1) + np.exp(-real).astype(np.float32))
    return _float_table(inputs[0], outputs[0], quant, sigmoid)


@kernel("EXP", integer=True)
def exp(inputs, outputs, quant, **_):
    """exp by table."""
    return _float_table(inputs[0], outputs[0], quant, np.exp)


@kernel("TANH", integer=True)
def tanh(inputs, outputs, quant, **_):
    """tanh by table (output scale 1/128)."""
    return _float_table(inputs[0], outputs[0], quant, np.tanh)


@kernel("GELU", integer=True)
def gelu(inputs, outputs, quant, approximate=False, **_):
    """x·Φ(x) by table, in float32 as TFLite's: 0.5·x·erfc(−x/√2), or with `approximate`
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    f32 = np.float32

    def exact(x):
        x = x.astype(f32)
        return f32(0.5) * x * np.vectorize(math.erfc)(x * -f32(math.sqrt(0.5))).astype(f32)

    def tanh_form(x):
        x = x.astype(f32)
        inner = f32(math.sqrt(2 / math.pi)) * (x + f32(0.044715) * x * x * x)
        return f32(0.5) * x * (f32(1) + np.tanh(inner))
    return _float_table(inputs[0], outputs[0], quant, tanh_form if approximate else exact)


RSQRT_SHIFT = 20  # TFLite's headroom for 1/sqrt of an integer


@kernel("RSQRT", integer=True)
def rsqrt(inputs, outputs, quant, **_):
    """TFLite's int8 RSQRT by table: 1/sqrt(x − zx) in fixed point
    (GetInvSqrtQuantizedMultiplierExp: Newton–Raphson in Q3.28), times
    1/(sqrt(scale_x)·scale_y) (the square root and the product in float32, the reciprocal
    in double); x = zx gives the type's largest value."""
    (x,), (y,) = inputs, outputs
    qx, qy = quant.inputs[0], quant.outputs[0]
    mult, shift = (int(v) for v in quantize_multiplier(
        1 / F64(np.sqrt(qx.scale[0]) * qy.scale[0])))
    values = np.arange(-128, 128) - int(qx.zero_point[0])
    inv_mult, inv_shift = inv_sqrt_multiplier(np.maximum(values, 0))
    data = multiply_by_quantized_multiplier(1, inv_mult, inv_shift + RSQRT_SHIFT)
    out = multiply_by_quantized_multiplier(data, mult, shift - RSQRT_SHIFT) + int(qy.zero_point[0])
    lo, hi = type_range(y.dtype)
    table = np.where(values == 0, hi, np.clip(out, lo, hi))
    return _table(x, y, table.astype(y.dtype))


@kernel("HARD_SWISH", integer=True)
def hard_swish(inputs, outputs, quant, **_):
    """TFLite's reference int8 hard-swish, x·relu6(x + 3)/6 in 16-bit fixed point: x on a
    scale 128 times finer, a "relu-ish" factor in [0, 1] from x rescaled so that 3 is
    2**15, their product brought to y's scale (multipliers computed in float32, cut to
    16 bits)."""
    (x,), (y,) = inputs, outputs
    qx, qy = quant.inputs[0], quant.outputs[0]
    fine = np.float32(1 / 128) * qx.scale[0]
    out_mult, out_exp = _multiplier16(fine / qy.scale[0])
    relu_mult, relu_exp = _multiplier16(fine / np.float32(3 / 32768))
    values = np.arange(-128, 128) - int(qx.zero_point[0])
    hires = values * 128
    preshift = doubling_high_mul(hires, out_mult, 16)
    relu = hires
    if relu_exp > 0:
        relu = saturating_left_shift(relu, relu_exp - 1)
    relu = doubling_high_mul(relu, relu_mult, 16)
    relu = saturating_left_shift(relu, 1) if relu_exp > 0 else divide_by_pot(relu, -relu_exp)
    relu = (relu + (1 << 15)) >> 1
    out = divide_by_pot(doubling_high_mul_truncated(relu, preshift), -out_exp)
    table = np.clip(out + int(qy.zero_point[0]), *type_range(y.dtype))
    return _table(x, y, table.astype(y.dtype))


def _multiplier16(real: np.float32) -> tuple[int, int]:
    """A multiplier as TFLite's QuantizeMultiplier, cut to 16 bits (rounded;
    DownScaleInt32ToInt16Multiplier), and its exponent."""
    mult, exponent = (int(v) for v in quantize_multiplier(F64(real)))
    return (32767 if mult >= (1 << 31) - 1 - (1 << 15) else (mult + (1 << 15)) >> 16), exponent


RESIZE_FRACTION_BITS = 10  # TFLite's integer bilinear resize: positions in 1/1024 of a pixel


def _integer_taps(n_in: int, n_out: int, align_corners: bool, half_pixel_centers: bool):
    """TFLite's ComputeInterpolationValuesInteger over the output indices: (source
    position in 1/1024 pixel, lower index, upper index), C's truncating divisions."""
    one = 1 << RESIZE_FRACTION_BITS
    scale = (one * n_in + n_out // 2) // n_out
    if align_corners and n_out > 1:
        scale = (one * (n_in - 1) + (n_out - 1) // 2) // (n_out - 1)
    pos = np.arange(n_out, dtype=np.int64) * scale
    if half_pixel_centers:
        pos = pos + scale // 2 - one // 2
    lower = np.maximum(np.fix(pos / one).astype(np.int64), 0)
    upper = np.minimum(np.fix((pos + one - 1) / one).astype(np.int64), n_in - 1)
    return pos, lower, upper


@kernel("RESIZE_BILINEAR", integer=True)
def resize_bilinear(inputs, outputs, quant, align_corners=False, half_pixel_centers=False, **_):
    """TFLite's integer bilinear resize on the stored values (input and output share their
    parameters): weights in 1/1024 of a pixel along each axis, the four products summed
    in int64 and divided by 2**20, rounded half away from zero."""
    x, (y,) = inputs[0], outputs
    one = 1 << RESIZE_FRACTION_BITS
    (ys, y0, y1), (xs, x0, x1) = (
        _integer_taps(n_in, n_out, align_corners, half_pixel_centers)
        for n_in, n_out in ((x.shape[1], y.shape[1]), (x.shape[2], y.shape[2])))
    dy, dx = (ys - one * y0)[:, None, None], (xs - one * x0)[None, :, None]

    def step():
        v = as_i64(x)
        top = v[:, y0][:, :, x0] * (one - dx) + v[:, y0][:, :, x1] * dx
        bottom = v[:, y1][:, :, x0] * (one - dx) + v[:, y1][:, :, x1] * dx
        total = top * (one - dy) + bottom * dy
        half = np.where(total > 0, 1 << 19, -(1 << 19))
        np.copyto(y, np.fix((total + half) / (1 << 20)).astype(np.int64), casting="unsafe")
    return step


@kernel("QUANTIZE", integer=True)
def quantize_op(inputs, outputs, quant, **_):
    """Float to integers (TFLite's affine quantization), or integers to integers of
    other parameters (requantization: (x − zx)·scale_x/scale_y + zy, fixed point)."""
    (x,), (y,) = inputs, outputs
    qx, qy = quant.inputs[0], quant.outputs[0]
    if qx is None:
        return lambda: np.copyto(y, quantize(x, qy, y.dtype))
    mult, shift = quantize_multiplier(_scale(qx) / _scale(qy))
    lo, hi = type_range(y.dtype)
    zx, zy = int(qx.zero_point[0]), int(qy.zero_point[0])
    return lambda: np.copyto(y, requantize(as_i64(x) - zx, mult, shift, zy, lo, hi, y.dtype))


@kernel("DEQUANTIZE", integer=True)
def dequantize_op(inputs, outputs, quant, **_):
    (x,), (y,) = inputs, outputs
    return lambda: np.copyto(y, dequantize(x, quant.inputs[0]))


@kernel("PAD", integer=True)
def pad(inputs, outputs, quant, **_):
    """Padding of the output's zero point (the real value 0)."""
    zero = np.array([quant.outputs[0].zero_point[0]], outputs[0].dtype)
    return KERNELS["PADV2"]([*inputs[:2], zero], outputs)


@kernel("CONCATENATION", integer=True)
def concatenation(inputs, outputs, quant, fused_activation_function=0, **opts):
    """Joins inputs quantized as the output is (TFLite requires it of int8)."""
    qy = quant.outputs[0]
    if not all(qy.same(q) for q in quant.inputs):
        raise OperatorError(None, "its int8 inputs are quantized unlike its output")
    join = KERNELS["CONCATENATION"](inputs, outputs, **opts)
    return in_sequence([join, _clamped(outputs[0], qy, fused_activation_function)])


# Operators that move elements or compare them: their float kernels serve the integers
# as they are (TFLite's int8 kernels do the same, whatever the parameters).
AS_STORED = ("RESHAPE", "SQUEEZE", "EXPAND_DIMS", "TRANSPOSE", "STRIDED_SLICE", "SLICE",
             "PADV2", "SHAPE", "SPACE_TO_DEPTH", "DEPTH_TO_SPACE", "GATHER",
             "RESIZE_NEAREST_NEIGHBOR", "MAXIMUM", "MINIMUM", "REDUCE_MAX", "SELECT",
             "SELECT_V2", "SPLIT", "SPLIT_V", "PACK", "TILE", "BROADCAST_TO", "REVERSE_V2",
             "MIRROR_PAD", "ARG_MAX", "ARG_MIN")


def _as_stored(name, inputs, outputs, quant, **options):
    return KERNELS[name](inputs, outputs, **options)


for _name in AS_STORED:
    kernel(_name, integer=True)(partial(_as_stored, _name))
