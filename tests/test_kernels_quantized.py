"""Integer kernels against LiteRT's reference kernels (OpResolverType.BUILTIN_REF),
exactly: random int8 inputs, random scales and zero points, per-tensor and
per-channel weights, every fused activation with an integer form."""
import numpy as np
import pytest

from microtrain.files.errors import OperatorError
from microtrain.step.fixedpoint import (divide_by_pot, doubling_high_mul,
                                        multiply_by_quantized_multiplier, quantize_multiplier)
from microtrain.step.kernels import build
from microtrain.files.quantization import OpQuantization, Quantization, dequantize, quantize
from tflite_op import tflite_run

rng = np.random.default_rng(21)
I8 = np.int8
ACTIVATIONS = (0, 1, 2, 3)  # none, RELU, RELU_N1_TO_1, RELU6


q = Quantization


def activation_q():
    """Random parameters of an int8 activation."""
    return q(rng.uniform(0.005, 0.1), int(rng.integers(-30, 30)))


def int8(*shape):
    return rng.integers(-128, 128, size=shape).astype(I8)


def ours(name, inputs, out_shapes, quants, out_dtypes=None, **options):
    """Our integer kernel on `inputs`, `quants` per input then per output."""
    out_dtypes = out_dtypes or [I8] * len(out_shapes)
    outputs = [np.zeros(s, d) for s, d in zip(out_shapes, out_dtypes)]
    n = len(inputs)
    build(name, inputs, outputs, quantization=OpQuantization(list(quants[:n]), list(quants[n:])),
          **options)()
    return outputs


def check(name, inputs, out_shapes, quants, constant=(), out_dtypes=None, **options):
    """Our kernel equals LiteRT's reference kernel to the bit."""
    want = tflite_run(name, inputs, out_shapes, constant=constant,
                      out_dtypes=out_dtypes or [I8] * len(out_shapes), quantization=quants,
                      reference=True, **options)
    got = ours(name, inputs, out_shapes, quants, out_dtypes, **options)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    return got


# ----------------------------------------------------------------- fixed-point helpers

def test_doubling_high_mul_rounding_and_saturation():
    a = np.array([1 << 30, -(1 << 30), 3, -3, -(1 << 31)])
    b = np.array([1 << 30, 1 << 30, 1 << 30, 1 << 30, -(1 << 31)])
    # 2^30·2^30·2/2^32 = 2^29; 3·2^30·2/2^32 = 1.5 -> 2, but -1.5 -> -1 (the nudge of a
    # negative product is 1 - 2^30); MIN·MIN saturates
    np.testing.assert_array_equal(doubling_high_mul(a, b),
                                  [1 << 29, -(1 << 29), 2, -1, (1 << 31) - 1])


def test_divide_by_pot_rounds_half_away():
    np.testing.assert_array_equal(divide_by_pot(np.array([5, -5, 6, -6, 7, -7]), 2),
                                  [1, -1, 2, -2, 2, -2])


def test_fixed_point_helpers_follow_their_c_definitions():
    """The vectorised shortcuts against TFLite's definitions written out in Python ints:
    SaturatingRoundingDoublingHighMul's nudge and truncating division, RoundingDivideByPOT's
    mask and threshold."""
    a = np.concatenate([rng.integers(-2 ** 31, 2 ** 31, 5000), [-2 ** 31, 2 ** 31 - 1, 0, -1]])
    b = np.concatenate([rng.integers(-2 ** 31, 2 ** 31, 5000), [-2 ** 31, -2 ** 31, 5, 3]])
    e = rng.integers(0, 31, a.size)

    def high_mul(x, y):
        if x == y == -2 ** 31:
            return 2 ** 31 - 1
        n = x * y + (2 ** 30 if x * y >= 0 else 1 - 2 ** 30)
        return abs(n) // 2 ** 31 * (1 if n >= 0 else -1)

    def divide(x, k):
        mask = (1 << k) - 1
        return (x >> k) + ((x & mask) > (mask >> 1) + (x < 0))
    np.testing.assert_array_equal(doubling_high_mul(a, b),
                                  [high_mul(int(x), int(y)) for x, y in zip(a, b)])
    np.testing.assert_array_equal(divide_by_pot(a, e),
                                  [divide(int(x), int(k)) for x, k in zip(a, e)])


def test_quantize_multiplier_reconstructs_the_real():
    real = rng.uniform(1e-6, 10, 200)
    mult, shift = quantize_multiplier(real)
    assert ((mult >= 1 << 30) & (mult < 1 << 31)).all()
    np.testing.assert_allclose(mult * 2.0 ** (shift - 31), real, rtol=2 ** -30)
    x = rng.integers(-(1 << 20), 1 << 20, 200)
    got = multiply_by_quantized_multiplier(x, mult, shift)
    assert np.abs(got - x * real).max() <= 1


def test_quantize_and_dequantize_match_litert():
    x = rng.normal(scale=2, size=(4, 7)).astype(np.float32)
    x[0, :3] = [0.125, -0.125, 0.375]  # halves of the scale below
    qy = q(0.25, -3)
    (want,) = tflite_run("QUANTIZE", [x], [x.shape], out_dtypes=[I8], quantization=[None, qy],
                         reference=True)
    np.testing.assert_array_equal(quantize(x, qy), want)
    (back,) = tflite_run("DEQUANTIZE", [want], [x.shape], quantization=[qy, None], reference=True)
    np.testing.assert_array_equal(dequantize(want, qy), back)


# ----------------------------------------------------------------- weighted operators

def weights(shape, axis, per_channel):
    """Random int8 weights with symmetric scales: one per slice along `axis`, or one."""
    n = shape[axis] if per_channel else 1
    return int8(*shape), q(rng.uniform(0.002, 0.02, n), 0, axis)


def bias(n):
    return rng.integers(-5000, 5000, n).astype(np.int32)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("padding,stride", [(0, 1), (1, 2), (0, 2)])
def test_conv_2d(per_channel, act, padding, stride):
    x, qx = int8(2, 7, 6, 3), activation_q()
    w, qw = weights((5, 3, 3, 3), 0, per_channel)
    qb = q(qx.scale[0] * qw.scale, 0)
    oh, ow = ((7 + stride - 1) // stride, (6 + stride - 1) // stride) if padding == 0 else \
        ((7 - 3) // stride + 1, (6 - 3) // stride + 1)
    check("CONV_2D", [x, w, bias(5)], [(2, oh, ow, 5)], [qx, qw, qb, activation_q()],
          constant=(1, 2), version=3, padding=padding, stride_h=stride, stride_w=stride,
          dilation_h_factor=1, dilation_w_factor=1, fused_activation_function=act)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("multiplier", [1, 2])
def test_depthwise_conv_2d(per_channel, multiplier):
    x, qx = int8(2, 6, 6, 4), activation_q()
    w, qw = weights((1, 3, 3, 4 * multiplier), 3, per_channel)
    check("DEPTHWISE_CONV_2D", [x, w, bias(4 * multiplier)], [(2, 6, 6, 4 * multiplier)],
          [qx, qw, q(qx.scale[0] * qw.scale, 0), activation_q()], constant=(1, 2), version=3,
          padding=0, stride_h=1, stride_w=1, depth_multiplier=multiplier, dilation_h_factor=1,
          dilation_w_factor=1, fused_activation_function=1)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fully_connected(per_channel, act, with_bias):
    x, qx = int8(32, 40), activation_q()  # enough outputs to tell one rounding from two
    w, qw = weights((7, 40), 0, per_channel)
    inputs = [x, w] + ([bias(7)] if with_bias else [])
    quants = [qx, qw] + ([q(qx.scale[0] * qw.scale, 0)] if with_bias else []) + [activation_q()]
    check("FULLY_CONNECTED", inputs, [(32, 7)], quants, constant=(1, 2), version=5,
          fused_activation_function=act, keep_num_dims=False)


# ----------------------------------------------------------------- elementwise

@pytest.mark.parametrize("op", ["ADD", "MUL"])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("shapes", [((3, 4, 5), (3, 4, 5)), ((3, 4, 5), (5,))])
def test_add_and_mul(op, act, shapes):
    a, b = int8(*shapes[0]), int8(*shapes[1])
    check(op, [a, b], [shapes[0]], [activation_q(), activation_q(), activation_q()],
          version=2, fused_activation_function=act)


# ----------------------------------------------------------------- pooling and reduction

@pytest.mark.parametrize("op", ["MAX_POOL_2D", "AVERAGE_POOL_2D"])
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("act", [0, 3])
def test_pools(op, padding, act):
    x, qx = int8(2, 7, 7, 3), activation_q()
    out = 4 if padding == 0 else 3
    check(op, [x], [(2, out, out, 3)], [qx, qx], version=2, padding=padding, stride_h=2,
          stride_w=2, filter_height=3, filter_width=3, fused_activation_function=act)


@pytest.mark.parametrize("axes,keep", [((1, 2), True), ((1, 2), False), ((2,), False),
                                       ((3, 1), True), ((0, 1, 2, 3), False)])
@pytest.mark.parametrize("same", [True, False])
def test_mean(axes, keep, same):
    x, qx = int8(2, 5, 4, 3), activation_q()
    qy = qx if same else activation_q()
    shape = [1 if i in axes else d for i, d in enumerate(x.shape)] if keep else \
        [d for i, d in enumerate(x.shape) if i not in axes]
    check("MEAN", [x, np.array(axes, np.int32)], [tuple(shape)], [qx, None, qy], constant=(1,),
          version=2, keep_dims=keep)


# ----------------------------------------------------------------- activations, layout

@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_softmax(beta):
    x = int8(6, 10)
    x[0] = 127  # a row of ties
    for scale in (0.02, 0.2, 1.5):
        check("SOFTMAX", [x], [x.shape], [q(scale, int(rng.integers(-20, 20))), q(1 / 256, -128)],
              version=2, beta=beta)


def test_requantize():
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    for qx, qy in [(activation_q(), activation_q()) for _ in range(4)] + near_ties():
        check("QUANTIZE", [x], [x.shape], [qx, qy], version=2)


def test_uint8_edges():
    """QUANTIZE from and to uint8 (a model's uint8 input or output), DEQUANTIZE of uint8."""
    u = np.arange(0, 256, dtype=np.uint8).reshape(16, 16)
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    for _ in range(3):
        qu = q(rng.uniform(0.005, 0.1), int(rng.integers(100, 156)))
        check("QUANTIZE", [u], [u.shape], [qu, activation_q()], version=2)
        check("QUANTIZE", [x], [x.shape], [activation_q(), qu], out_dtypes=[np.uint8], version=2)
        check("DEQUANTIZE", [u], [u.shape], [qu, None], out_dtypes=[np.float32], version=2)


def test_pad_uses_the_zero_point():
    x, qx = int8(2, 3, 3, 2), activation_q()
    paddings = np.array([[0, 0], [1, 2], [2, 0], [0, 0]], np.int32)
    check("PAD", [x, paddings], [(2, 6, 5, 2)], [qx, None, qx], constant=(1,), version=2)


def test_concatenation_of_other_parameters_is_refused_as_litert_does():
    """LiteRT's int8 CONCATENATION requires its inputs quantized as its output."""
    a, b, qa, qy = int8(2, 3), int8(2, 3), activation_q(), activation_q()
    with pytest.raises(RuntimeError, match="params.scale != output->params.scale"):
        tflite_run("CONCATENATION", [a, b], [(2, 6)], out_dtypes=[I8], quantization=[qa, qy, qy],
                   reference=True, version=2, axis=-1, fused_activation_function=0)
    with pytest.raises(OperatorError, match="quantized unlike its output"):
        ours("CONCATENATION", [a, b], [(2, 6)], [qa, qy, qy], axis=-1)


def test_dilated_convolution():
    x, qx = int8(1, 9, 9, 2), activation_q()
    w, qw = weights((3, 3, 3, 2), 0, True)
    check("CONV_2D", [x, w, bias(3)], [(1, 9, 9, 3)],
          [qx, qw, q(qx.scale[0] * qw.scale), activation_q()],
          constant=(1, 2), version=3, padding=0, stride_h=1, stride_w=1, dilation_h_factor=2,
          dilation_w_factor=2, fused_activation_function=0)


@pytest.mark.parametrize("op,inputs,shape,options", [
    ("TRANSPOSE", [np.array([0, 2, 1], np.int32)], (2, 5, 4), {}),
    ("STRIDED_SLICE", [np.array([0, 1, 0], np.int32), np.array([2, 4, 5], np.int32),
                       np.array([1, 2, 2], np.int32)], (2, 2, 3), {}),
    ("RESIZE_NEAREST_NEIGHBOR", [np.array([4, 10], np.int32)], (2, 4, 10), {}),
    ("GATHER", [np.array([3, 0, 3], np.int32)], (2, 4, 3), {"axis": 2}),
    ("REDUCE_MAX", [np.array([1], np.int32)], (2, 5), {"keep_dims": False}),
])
def test_operators_on_the_stored_integers(op, inputs, shape, options):
    x, qx = int8(2, 4, 5), activation_q()
    if op == "RESIZE_NEAREST_NEIGHBOR":
        x, shape = x.reshape(2, 4, 5, 1), shape + (1,)
    check(op, [x, *inputs], [shape], [qx] + [None] * len(inputs) + [qx],
          constant=tuple(range(1, len(inputs) + 1)), **options)


@pytest.mark.parametrize("op,inputs,shapes,options", [
    ("SPLIT", [np.array(2, np.int32), "x"], [(2, 4, 2), (2, 4, 2)], {"num_splits": 2}),
    ("SPLIT_V", ["x", np.array([1, 3], np.int32), np.array(1, np.int32)], [(2, 1, 4), (2, 3, 4)],
     {"num_splits": 2}),
    ("PACK", ["x", "x"], [(2, 2, 4, 4)], {"axis": 1, "values_count": 2}),
    ("TILE", ["x", np.array([1, 2, 1], np.int32)], [(2, 8, 4)], {}),
    ("BROADCAST_TO", ["x", np.array([3, 2, 4, 4], np.int32)], [(3, 2, 4, 4)], {"version": 2}),
    ("REVERSE_V2", ["x", np.array([1], np.int32)], [(2, 4, 4)], {}),
    ("MIRROR_PAD", ["x", np.array([[0, 0], [1, 2], [2, 0]], np.int32)], [(2, 7, 6)], {"mode": 0}),
])
def test_operators_copying_the_stored_integers(op, inputs, shapes, options):
    """Operators LiteRT's int8 kernels run on the stored values (parameters kept)."""
    x, qx = int8(2, 4, 4), activation_q()
    inputs = [x if isinstance(a, str) else a for a in inputs]
    constant = tuple(i for i, a in enumerate(inputs) if a is not x)
    check(op, inputs, shapes, [qx if a is x else None for a in inputs] + [qx] * len(shapes),
          constant=constant, out_dtypes=[I8] * len(shapes), **options)


def test_select_takes_the_stored_values():
    """Whatever their parameters, as LiteRT's SELECT_V2."""
    qx, condition = activation_q(), rng.random((2, 1, 5)) > 0.5
    check("SELECT_V2", [condition, int8(2, 4, 5), int8(2, 4, 5)], [(2, 4, 5)],
          [None, qx, activation_q(), qx])


@pytest.mark.parametrize("op", ["MAXIMUM", "MINIMUM"])
def test_maximum_and_minimum(op):
    qx = activation_q()
    check(op, [int8(3, 7), int8(3, 7)], [(3, 7)], [qx, qx, qx], version=2)


def test_concatenation_and_reshape():
    qx = activation_q()
    a, b = int8(2, 3, 4), int8(2, 3, 2)
    check("CONCATENATION", [a, b], [(2, 3, 6)], [qx, qx, qx], version=2, axis=-1,
          fused_activation_function=0)
    check("RESHAPE", [a, np.array([2, 12], np.int32)], [(2, 12)], [qx, None, qx], constant=(1,))


@pytest.mark.parametrize("scale", [0.01, 0.05, 0.3])
def test_logistic(scale):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    check("LOGISTIC", [x], [x.shape], [q(scale, int(rng.integers(-20, 20))), q(1 / 256, -128)],
          version=2)


@pytest.mark.parametrize("scales", [(0.01, 0.02), (0.05, 0.03), (0.3, 0.2), (0.02, 0.5)])
def test_hard_swish(scales):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    check("HARD_SWISH", [x], [x.shape], [q(scales[0], int(rng.integers(-20, 20))),
                                         q(scales[1], int(rng.integers(-20, 20)))])


@pytest.mark.parametrize("scales", [(0.01, 0.02), (0.02, 0.05), (0.05, 0.3)])
def test_exp(scales):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    check("EXP", [x], [x.shape], [q(scales[0], int(rng.integers(-20, 20))), q(scales[1], -128)],
          version=2)


@pytest.mark.parametrize("scale", [0.01, 0.05, 0.3])
def test_tanh(scale):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    check("TANH", [x], [x.shape], [q(scale, int(rng.integers(-20, 20))), q(1 / 128, 0)],
          version=2)


def near_ties():
    """(input, output) parameters whose ratio puts an input, 75 steps above the zero
    point, within float rounding of a half (51.5 steps out): whether the ratio is divided
    in float32 or float64 then decides some outputs."""
    sx = np.float32(0.05680746)
    base = np.float32(sx * 75 / 51.5)
    return [(q(sx, -3), q(base + np.float32(k) * np.spacing(base), -14)) for k in range(-8, 8)]


@pytest.mark.parametrize("op", ["RELU", "RELU6", "RELU_N1_TO_1"])
def test_relus(op):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    for qx, qy in [(activation_q(), activation_q()) for _ in range(4)] + near_ties():
        check(op, [x], [x.shape], [qx, qy], version=2 if op != "RELU_N1_TO_1" else 1)


@pytest.mark.parametrize("alpha_shape", [(1, 1, 3), (3,)])
def test_prelu(alpha_shape):
    x = np.arange(-128, 128, dtype=I8)[:252].reshape(2, 42, 3)
    for _ in range(4):
        qa = q(rng.uniform(0.001, 0.01), int(rng.integers(-20, 20)))
        check("PRELU", [x, int8(*alpha_shape)], [x.shape], [activation_q(), qa, activation_q()],
              constant=(1,))


def test_arg_max_and_min_compare_the_stored_values():
    x = int8(3, 5, 7)
    for op in ("ARG_MAX", "ARG_MIN"):
        check(op, [x, np.array([1], np.int32)], [(3, 7)], [activation_q(), None, None],
              constant=(1,), out_dtypes=[np.int32], version=2, output_type=2)


@pytest.mark.parametrize("alpha", [0.2, 0.01, 1.5])
def test_leaky_relu(alpha):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    for qx, qy in [(activation_q(), activation_q()) for _ in range(4)] + near_ties():
        check("LEAKY_RELU", [x], [x.shape], [qx, qy], version=2, alpha=alpha)


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_sub(act):
    a, b = int8(3, 4, 5), int8(3, 4, 5)
    for _ in range(3):
        check("SUB", [a, b], [a.shape], [activation_q(), activation_q(), activation_q()],
              version=2, fused_activation_function=act)


CONV_OPTIONS = dict(padding=0, stride_h=1, stride_w=1, dilation_h_factor=1, dilation_w_factor=1,
                    fused_activation_function=0)


@pytest.mark.parametrize("op", ["CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "ADD"])
def test_multipliers_at_near_ties(op):
    """The products by a weight of 1 (scale 1) and ADD of an operand at its zero point
    requantize by scale_x/scale_y alone: at near ties only the multiplier TFLite computes
    (in double here) gives its outputs."""
    x = np.arange(-128, 128, dtype=I8).reshape(1, 16, 16, 1)
    one, zero_bias = np.ones((1, 1, 1, 1), I8), np.zeros(1, np.int32)
    for qx, qy in near_ties():
        if op == "ADD":
            check(op, [x, np.full_like(x, 5)], [x.shape], [qx, q(qx.scale[0], 5), qy], version=2,
                  fused_activation_function=0)
        elif op == "FULLY_CONNECTED":
            check(op, [x.reshape(256, 1), one.reshape(1, 1), zero_bias], [(256, 1)],
                  [qx, q(1.0), q(qx.scale[0]), qy], constant=(1, 2), version=5,
                  fused_activation_function=0, keep_num_dims=False)
        else:
            options = dict(CONV_OPTIONS, depth_multiplier=1) if op == "DEPTHWISE_CONV_2D" \
                else CONV_OPTIONS
            check(op, [x, one, zero_bias], [x.shape], [qx, q(1.0), q(qx.scale[0]), qy],
                  constant=(1, 2), version=3, **options)


# ----------------------------------------------------------------- transformer operators

@pytest.mark.parametrize("adj_x,adj_y", [(False, False), (False, True), (True, False)])
def test_batch_matmul(adj_x, adj_y):
    """Attention's products of two activations (enough outputs to tell one rounding from
    two), the second broadcast over the first's batch."""
    a = int8(2, 3, 24, 20) if not adj_x else int8(2, 3, 20, 24)
    b = int8(1, 3, 20, 9) if not adj_y else int8(1, 3, 9, 20)
    for _ in range(3):
        check("BATCH_MATMUL", [a, b], [(2, 3, 24, 9)],
              [activation_q(), activation_q(), q(rng.uniform(0.1, 2), int(rng.integers(-30, 30)))],
              version=4, adj_x=adj_x, adj_y=adj_y, asymmetric_quantize_inputs=False)


@pytest.mark.parametrize("shapes", [((3, 4, 5), (3, 4, 5)), ((3, 4, 5), (3, 4, 1))])
def test_squared_difference(shapes):
    a, b = int8(*shapes[0]), int8(*shapes[1])
    for _ in range(4):
        check("SQUARED_DIFFERENCE", [a, b], [shapes[0]],
              [activation_q(), activation_q(), q(rng.uniform(0.05, 2), -128)], version=2)


@pytest.mark.parametrize("scales", [(1.6e-5, 0.09), (0.0064, 0.0055), (0.05, 0.3), (2.0, 0.01)])
def test_rsqrt(scales):
    """Every int8 input (those below the zero point are refused by LiteRT: not given)."""
    zx = -128 + int(rng.integers(0, 3))
    x = np.arange(zx, 128, dtype=I8)
    check("RSQRT", [x], [x.shape], [q(scales[0], zx), q(scales[1], -128)], version=2)


@pytest.mark.parametrize("approximate", [True, False])
def test_gelu(approximate):
    x = np.arange(-128, 128, dtype=I8).reshape(16, 16)
    for scales in [(0.0027, 0.0013), (0.02, 0.01), (0.05, 0.03), (0.1, 0.08)]:
        check("GELU", [x], [x.shape], [q(scales[0], int(rng.integers(-20, 20))),
                                       q(scales[1], int(rng.integers(-40, 0)))],
              version=2, approximate=approximate)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("padding,stride", [(0, 2), (1, 2), (1, 1)])
def test_transpose_conv(per_channel, padding, stride):
    x, qx = int8(2, 4, 5, 3), activation_q()
    w, qw = weights((6, 3, 3, 3), 0, per_channel)
    oh, ow = (4 * stride, 5 * stride) if padding == 0 else ((4 - 1) * stride + 3,
                                                            (5 - 1) * stride + 3)
    shape = np.array([2, oh, ow, 6], np.int32)
    for with_bias in (True, False):
        inputs = [shape, w, x] + ([bias(6)] if with_bias else [])
        quants = [None, qw, qx] + ([q(qx.scale[0] * qw.scale, 0)] if with_bias else [])
        check("TRANSPOSE_CONV", inputs, [(2, oh, ow, 6)], quants + [activation_q()],
              constant=(0, 1, 3), version=3, padding=padding, stride_h=stride, stride_w=stride)


@pytest.mark.parametrize("align_corners,half_pixel_centers", [(False, False), (True, False),
                                                              (False, True)])
@pytest.mark.parametrize("size", [(8, 10), (3, 2), (5, 7)])
def test_resize_bilinear(align_corners, half_pixel_centers, size):
    x, qx = int8(2, 4, 5, 3), activation_q()
    check("RESIZE_BILINEAR", [x, np.array(size, np.int32)], [(2, *size, 3)], [qx, None, qx],
          constant=(1,), version=3, align_corners=align_corners,
          half_pixel_centers=half_pixel_centers)
