"""Activation kernels and their gradients.

Constant operands (clip bounds, 0, 1) are chosen by size, as measured with
numpy 2.x on x86-64.  Below LARGE elements numpy's loops run 1.5-3x faster
against a full array than against a scalar, so there the constant is
pre-broadcast to the operand's shape once, in the factory (shared read-only
arrays, see `full`).  From LARGE elements on, comparisons and arithmetic with a
scalar are as fast or faster and np.clip with scalar bounds is the fastest
clip, so large activations need no constant arrays as large as themselves.
"""
from functools import partial
from math import prod

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.step.kernels import in_sequence, kernel
from microtrain.step.kernels.workspace import compact, in_turn, kept, row_tiles, scratch

# Fused activation code -> (lower, upper) clip bounds; 4 (TANH) and 5
# (SIGN_BIT) are no clips.  Circle's ActivationFunctionType: 0 NONE, 1 RELU,
# 2 RELU_N1_TO_1, 3 RELU6, 4 TANH, 5 SIGN_BIT.
CLIPS = {1: (0, None), 2: (-1, 1), 3: (0, 6)}
TANH, SIGN_BIT = 4, 5
CODES = {0, TANH, SIGN_BIT, *CLIPS}
LARGE = 1 << 15
# Elements from which np.clip beats maximum/minimum against full bounds (a
# maximum against zeros alone stays faster up to ~128K elements).
CLIP_FROM = {1: 1 << 17, 2: LARGE, 3: LARGE}


def full(like, value):
    """A shared read-only array shaped like `like`, filled with `value`."""
    return filled(like.shape, like.dtype, value)


def filled(shape, dtype, value):
    """A read-only array of `shape` filled with `value`: a view of the leading
    elements of one array per value, shared by the kernels of a workspace
    whatever their shapes."""
    def make(s):
        a = np.full(s, value, dtype)
        a.flags.writeable = False
        return a
    return kept(("filled", value), (prod(shape),), dtype, make).reshape(shape)


def constant(like, value):
    """`value` as an operand of comparisons and arithmetic with arrays shaped
    like `like`: a full array when small, the scalar when large (see above) or
    the workspace is compact."""
    return full(like, value) if like.size < LARGE and not compact() else like.dtype.type(value)


def noop():
    pass


def _check(code):
    if code not in CODES:
        raise OperatorError(None, f"unsupported fused activation {code}")


def activation_step(code, x, y):
    """A closure computing y = act(x) for a fused activation code (x may be y)."""
    if code == 0:
        return noop if x is y else partial(np.copyto, y, x)
    if code == TANH:
        return partial(np.tanh, x, out=y)
    if code == SIGN_BIT:
        return _sign_bit(x, y)
    _check(code)
    lo, hi = CLIPS[code]
    if y.size >= CLIP_FROM[code] or compact():
        return partial(np.clip, x, lo, np.inf if hi is None else hi, out=y)
    lower = partial(np.maximum, x, full(y, lo), out=y)
    if hi is None:
        return lower
    upper = full(y, hi)

    def clip():
        lower()
        np.minimum(y, upper, out=y)
    return clip


def _sign_bit(x, y):
    """y = 1 where x's sign bit is set (x < 0, or -0), else 0: TFLite's SIGN_BIT."""
    negative = scratch(y.shape, bool)

    def step():
        np.signbit(x, out=negative)
        np.copyto(y, negative)
    return step


def bind_activation(code, y):
    """A closure applying fused activation `code` to the array y in place."""
    return activation_step(code, y, y)


def then_activate(compute, code, y):
    """A closure running compute, then fused activation `code` on y in place."""
    if code == 0:
        return compute
    act = bind_activation(code, y)

    def step():
        compute()
        act()
    return step


def fused_activation(code: int):
    """The in-place function for a fused activation code.

    For callers without a fixed output array; `bind_activation` is faster.
    """
    _check(code)
    return lambda x: bind_activation(code, x)()


def _standalone(code):
    def factory(inputs, outputs, **_):
        return activation_step(code, inputs[0], outputs[0])
    return factory


# The fused activations as ops: RELU y = max(x, 0), RELU_N1_TO_1 y = clip(x, -1, 1),
# RELU6 y = clip(x, 0, 6), TANH y = tanh(x).
for _name, _code in (("RELU", 1), ("RELU_N1_TO_1", 2), ("RELU6", 3), ("TANH", TANH)):
    kernel(_name, rows="each")(_standalone(_code))


@kernel("LOGISTIC", rows="each")
def logistic(inputs, outputs, **_):
    """y = 1 / (1 + exp(-x)), computed from e = exp(-|x|), which cannot overflow,
    as 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0: accurate in both tails.
    The numerator is max(e, sign(x)) (e <= 1), so no branch and no mask: ~6x
    faster than through np.logaddexp (scalar libm calls) on an LSTM gate's [32, 64]."""
    (x,), (y,) = inputs, outputs
    e, one = scratch(y.shape, y.dtype), constant(y, 1)

    def step():
        np.abs(x, out=e)
        np.negative(e, out=e)
        np.exp(e, out=e)
        np.sign(x, out=y)
        np.maximum(e, y, out=y)
        np.add(e, one, out=e)
        np.divide(y, e, out=y)
    return step


@kernel("LEAKY_RELU", rows="each")
def leaky_relu(inputs, outputs, alpha=0.0, **_):
    """y = x where x > 0 else alpha*x, i.e. max(x, alpha*x) for alpha <= 1 and
    min(x, alpha*x) for alpha > 1."""
    (x,), (y,) = inputs, outputs
    pick = np.maximum if alpha <= 1 else np.minimum

    def step():
        np.multiply(x, alpha, out=y)
        pick(x, y, out=y)
    return step


def row_sums(a2, sums):
    """A closure writing sums [rows, 1] = a2 summed along each row: a BLAS
    product with ones, ~3x faster than np.add.reduce(axis=1) on small rows."""
    if a2.dtype != sums.dtype:  # np.dot's out= must have the product's dtype
        return partial(np.add.reduce, a2, axis=1, keepdims=True, out=sums)
    return partial(np.dot, a2, filled((a2.shape[1], 1), a2.dtype, 1), out=sums)


# Rows up to this long, and at least this many per element of a row, take their maxima
# from a transposed copy: np.maximum.reduce along short rows costs ~50 ns a row
# (attention scores [B*heads*T, T]: [2048, 32] 119 -> 58 µs); a maximum is exact,
# so the result is the same.
SHORT_ROW, MANY_ROWS = 64, 16


def row_max(a2, out):
    """A closure writing out [rows, 1] = the maximum of each row of the 2-D a2."""
    n, w = a2.shape
    if w > SHORT_ROW or n < MANY_ROWS * w:
        return partial(np.maximum.reduce, a2, axis=1, keepdims=True, out=out)
    columns, flat = scratch((w, n), a2.dtype), out.reshape(n)

    def step():
        np.copyto(columns, a2.T)
        np.maximum.reduce(columns, axis=0, out=flat)
    return step


def row_exp(x2, beta, shifted, e, sums):
    """A closure writing, per row of the 2-D x2: shifted = beta*x2 - max(beta*x2),
    e = exp(shifted), sums = sum(e) (shape [rows, 1]).  Subtracting the row
    maximum keeps exp from overflowing; shifted may be e."""
    rowmax = scratch(sums.shape, sums.dtype)
    src = x2 if beta == 1 else shifted
    total = row_sums(e, sums)
    maxima = row_max(src, rowmax)

    def step():
        if beta != 1:
            np.multiply(x2, beta, out=shifted)
        maxima()
        np.subtract(src, rowmax, out=shifted)
        np.exp(shifted, out=e)
        total()
    return step


def rows(a):
    """a viewed as a 2-D [-1, last axis] array."""
    return a.reshape(-1, a.shape[-1])


@kernel("SOFTMAX", rows="each")
def softmax(inputs, outputs, beta=1.0, **_):
    """y = exp(beta*x) / sum(exp(beta*x)) over the last axis."""
    (x,), (y,) = inputs, outputs
    y2 = rows(y)
    sums = scratch((y2.shape[0], 1), y.dtype)
    exps = row_exp(rows(x), beta, y2, y2, sums)

    def step():
        exps()
        np.divide(y2, sums, out=y2)
    return step


def _clip_grad(dy, y, dx, lo, hi):
    """dx = dy where lo < y < hi else 0."""
    inside, below = scratch(y.shape, bool), scratch(y.shape, bool)
    low, high = constant(y, lo), constant(y, hi)

    def step():
        np.greater(y, low, out=inside)
        np.less(y, high, out=below)
        np.logical_and(inside, below, out=inside)
        np.multiply(dy, inside, out=dx)
    return step


def _relu_grad(dy, y, dx):
    """dx = dy * (y > 0), computed as dy * sign(y): y is a ReLU's output, so
    y >= 0 and sign(y) is that mask (~2x faster than a product with bools)."""
    sign = scratch(y.shape, y.dtype)

    def step():
        np.sign(y, out=sign)
        np.multiply(dy, sign, out=dx)
    return step


def _tanh_slope(y, t, one):
    """t = 1 - y², tanh's derivative in terms of its output."""
    np.multiply(y, y, out=t)
    np.subtract(one, t, out=t)


def _logistic_slope(y, t, one):
    """t = y * (1 - y), the logistic's derivative in terms of its output."""
    np.subtract(one, y, out=t)
    np.multiply(t, y, out=t)


def _slope_grad(dy, y, dx, slope):
    """dx = dy * slope(y)."""
    one, t = constant(y, 1), scratch(y.shape, y.dtype)

    def step():
        slope(y, t, one)
        np.multiply(dy, t, out=dx)
    return step


def _leaky_relu_grad(dy, y, dx, alpha):
    """dx = dy where y > 0 else alpha*dy (y > 0 exactly where x > 0, as alpha >= 0),
    as dy times a slope of 1 or alpha (dy * 1 is dy exactly)."""
    positive, slope, zero = scratch(y.shape, bool), scratch(y.shape, dy.dtype), constant(y, 0)
    low = dy.dtype.type(alpha)

    def step():
        np.greater(y, zero, out=positive)
        slope.fill(low)
        np.copyto(slope, 1, where=positive)
        np.multiply(dy, slope, out=dx)
    return step


def _elu_slope(y, t, one):
    """t = 1 where y > 0 else y + 1 (= exp(x)), ELU's derivative from its output."""
    np.add(y, one, out=t)
    np.minimum(t, one, out=t)


def _sqrt_slope(y, t, one):
    """t = 1 / (2y), sqrt's derivative from its output."""
    np.add(y, y, out=t)
    np.divide(one, t, out=t)


def _rsqrt_slope(y, t, one):
    """t = -y³/2, the derivative of 1/sqrt(x) from its output."""
    np.multiply(y, y, out=t)
    np.multiply(t, y, out=t)
    np.multiply(t, -0.5, out=t)


_BOUNDED = {"relu_n1_to_1": CLIPS[2], "relu6": CLIPS[3]}
_SLOPES = {"tanh": _tanh_slope, "logistic": _logistic_slope, "elu": _elu_slope,
           "sqrt": _sqrt_slope, "rsqrt": _rsqrt_slope}


@kernel("ActivationGrad", rows="each", overwrites=True)
def activation_grad(inputs, outputs, activation="relu", alpha=0.0, **_):
    """dX of an activation from dY and the activation's OUTPUT Y; elementwise
    (dX may be dY's memory), so in a compact workspace a tile at a time (its
    masks or slopes a tile's)."""
    (dy, y), (dx,) = inputs, outputs
    if not compact():
        return _activation_grad(dy, y, dx, activation, alpha)
    tiles = row_tiles(y.size, y.itemsize)
    flat = [a.reshape(-1) for a in (dy, y, dx)]
    return in_sequence(in_turn([partial(_activation_grad, *(a[t.start:t.stop] for a in flat),
                                        activation, alpha) for t in tiles]))


def _activation_grad(dy, y, dx, activation, alpha):
    if activation == "relu":
        return _relu_grad(dy, y, dx)
    if activation in _BOUNDED:
        return _clip_grad(dy, y, dx, *_BOUNDED[activation])
    if activation in _SLOPES:
        return _slope_grad(dy, y, dx, _SLOPES[activation])
    if activation == "exp":
        return partial(np.multiply, dy, y, out=dx)
    if activation == "leaky_relu":
        return _leaky_relu_grad(dy, y, dx, alpha)
    raise OperatorError(None, f"ActivationGrad: unsupported activation {activation!r}")


@kernel("SoftmaxGrad", rows="each")
def softmax_grad(inputs, outputs, beta=1.0, **_):
    """dX = beta * Y * (dY - sum(dY*Y, last axis))."""
    (dy, y), (dx,) = inputs, outputs
    dy2, y2, dx2 = rows(dy), rows(y), rows(dx)
    dots = scratch((y2.shape[0], 1), y.dtype)
    total = row_sums(dx2, dots)

    def step():
        np.multiply(dy2, y2, out=dx2)
        total()
        np.subtract(dy2, dots, out=dx2)
        np.multiply(dx2, y2, out=dx2)
        if beta != 1:
            np.multiply(dx2, beta, out=dx2)
    return step


# -- activations beyond the fused ones ------------------------------------------------------------

@kernel("HARD_SWISH", rows="each")
def hard_swish(inputs, outputs, **_):
    """y = x * relu6(x + 3) / 6, in TFLite's order of operations."""
    (x,), (y,) = inputs, outputs

    def step():
        np.add(x, 3.0, out=y)
        np.clip(y, 0.0, 6.0, out=y)
        np.multiply(y, x, out=y)
        np.divide(y, 6.0, out=y)
    return step


@kernel("ELU", rows="each")
def elu(inputs, outputs, **_):
    """y = x where x > 0 else exp(x) - 1, as expm1(min(x, 0)) + max(x, 0)."""
    (x,), (y,) = inputs, outputs
    positive_part = scratch(y.shape, y.dtype)

    def step():
        np.minimum(x, 0.0, out=y)
        np.expm1(y, out=y)
        np.maximum(x, 0.0, out=positive_part)
        np.add(y, positive_part, out=y)
    return step


# erfc(z) for z >= 0 as t*exp(-z² + P(t)), t = 1/(1 + z/2), P the degree-9 polynomial
# of these coefficients (Numerical Recipes' erfcc): relative error below 1.2e-7
# everywhere, float32's resolution.  numpy has no erf of its own.
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
         0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_TANH_GELU = (0.7978845608028654, 0.044715)  # sqrt(2/pi), the cubic's coefficient


def _normal_cdf(x, cdf):
    """A step writing cdf = Φ(x) = erfc(-x/√2)/2, the standard normal CDF."""
    t, poly, upper = scratch(x.shape, x.dtype), scratch(x.shape, x.dtype), scratch(x.shape, bool)

    def step():
        np.abs(x, out=t)
        np.multiply(t, _SQRT_HALF / 2, out=t)
        np.add(t, 1.0, out=t)
        np.reciprocal(t, out=t)  # t = 1/(1 + z/2), z = |x|/√2
        np.multiply(t, _ERFC[-1], out=poly)
        for c in _ERFC[-2:0:-1]:  # Horner's scheme
            np.add(poly, c, out=poly)
            np.multiply(poly, t, out=poly)
        np.add(poly, _ERFC[0], out=poly)
        np.multiply(x, x, out=cdf)
        np.multiply(cdf, 0.5, out=cdf)  # z²
        np.subtract(poly, cdf, out=cdf)
        np.exp(cdf, out=cdf)
        np.multiply(cdf, t, out=cdf)  # erfc(z)
        np.multiply(cdf, 0.5, out=cdf)  # Φ(-|x|)
        np.greater(x, 0.0, out=upper)
        np.subtract(1.0, cdf, out=cdf, where=upper)
    return step


def _tanh_gelu_inner(x, th):
    """A step writing th = tanh(√(2/π)·(x + 0.044715·x³))."""
    a, b = _TANH_GELU

    def step():
        np.multiply(x, x, out=th)
        np.multiply(th, b, out=th)
        np.add(th, 1.0, out=th)
        np.multiply(th, x, out=th)
        np.multiply(th, a, out=th)
        np.tanh(th, out=th)
    return step


@kernel("GELU", rows="each")
def gelu(inputs, outputs, approximate=False, **_):
    """y = x·Φ(x) (exact, Φ the normal CDF), or with approximate
    y = x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))/2."""
    (x,), (y,) = inputs, outputs
    inner = _tanh_gelu_inner(x, y) if approximate else _normal_cdf(x, y)

    def step():
        inner()
        if approximate:
            np.add(y, 1.0, out=y)
            np.multiply(y, 0.5, out=y)
        np.multiply(y, x, out=y)
    return step


@kernel("LOG_SOFTMAX", rows="each")
def log_softmax(inputs, outputs, **_):
    """y = x - max(x) - log(sum(exp(x - max(x)))) over the last axis."""
    (x,), (y,) = inputs, outputs
    y2 = rows(y)
    sums = scratch((y2.shape[0], 1), y.dtype)
    exps = scratch(y2.shape, y.dtype)
    shift = row_exp(rows(x), 1, y2, exps, sums)

    def step():
        shift()
        np.log(sums, out=sums)
        np.subtract(y2, sums, out=y2)
    return step


def _hard_swish_slope(x, t, **_):
    """A step writing t = 0 for x <= -3, 1 for x >= 3, else x/3 + 1/2 (PyTorch's
    choice at the kinks)."""
    mask = scratch(x.shape, bool)

    def step():
        np.multiply(x, 1 / 3, out=t)
        np.add(t, 0.5, out=t)
        np.less_equal(x, -3.0, out=mask)
        np.copyto(t, 0.0, where=mask)
        np.greater_equal(x, 3.0, out=mask)
        np.copyto(t, 1.0, where=mask)
    return step


def _gelu_slope(x, t, approximate=False, **_):
    """A step writing t = Φ(x) + x·φ(x), GELU's derivative, or that of its tanh form:
    (1 + th)/2 + x·(1 - th²)·√(2/π)·(1 + 3·0.044715·x²)/2."""
    u, v = scratch(x.shape, x.dtype), scratch(x.shape, x.dtype)
    if approximate:
        a, b = _TANH_GELU
        inner = _tanh_gelu_inner(x, t)

        def tanh_form():
            inner()
            np.multiply(x, x, out=u)
            np.multiply(u, 3 * b, out=u)
            np.add(u, 1.0, out=u)
            np.multiply(u, x, out=u)
            np.multiply(u, a / 2, out=u)
            np.multiply(t, t, out=v)
            np.subtract(1.0, v, out=v)
            np.multiply(u, v, out=u)
            np.add(t, 1.0, out=t)
            np.multiply(t, 0.5, out=t)
            np.add(t, u, out=t)
        return tanh_form
    cdf = _normal_cdf(x, t)

    def exact():
        cdf()
        np.multiply(x, x, out=u)
        np.multiply(u, -0.5, out=u)
        np.exp(u, out=u)
        np.multiply(u, x, out=u)
        np.multiply(u, _INV_SQRT_2PI, out=u)
        np.add(t, u, out=t)
    return exact


def _log_slope(x, t, **_):
    return partial(np.reciprocal, x, out=t)


def _square_slope(x, t, **_):
    return partial(np.add, x, x, out=t)


_INPUT_SLOPES = {"hard_swish": _hard_swish_slope, "gelu": _gelu_slope, "log": _log_slope,
                 "square": _square_slope}


@kernel("ActivationInputGrad")
def activation_input_grad(inputs, outputs, activation="", **options):
    """dX = dY·f'(X) of an elementwise function f from its INPUT X."""
    (dy, x), (dx,) = inputs, outputs
    if activation not in _INPUT_SLOPES:
        raise ValueError(f"ActivationInputGrad: unsupported activation {activation!r}")
    t = scratch(x.shape, x.dtype)
    slope = _INPUT_SLOPES[activation](x, t, **options)

    def step():
        slope()
        np.multiply(dy, t, out=dx)
    return step


@kernel("LogSoftmaxGrad", rows="each")
def log_softmax_grad(inputs, outputs, **_):
    """dX = dY - exp(Y)·Σ_last(dY)."""
    (dy, y), (dx,) = inputs, outputs
    dy2, y2, dx2 = rows(dy), rows(y), rows(dx)
    sums = scratch((y2.shape[0], 1), y.dtype)
    total = row_sums(dy2, sums)

    def step():
        total()
        np.exp(y2, out=dx2)
        np.multiply(dx2, sums, out=dx2)
        np.subtract(dy2, dx2, out=dx2)
    return step
