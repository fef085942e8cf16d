"""Fake quantization: float tensors rounded to the grid an int8 model computes on,
and the straight-through gradients of that rounding (docs/quantization.md).

FAKE_QUANT (the circle builtin: min, max, num_bits, narrow_range) rounds an
activation to its per-tensor asymmetric grid, with TensorFlow's nudging of the
range so that 0 is exactly representable.  FakeQuantPerChannel rounds a weight
(or a bias) to its per-channel symmetric grid: zero point 0, levels
−qmax..qmax with qmax = 2^(bits−1) − 1, as TFLite's int8 weights (bits 8) and
int32 biases (bits 32); its scales are an input (fixed), or, without that
input, each channel's max|W|/qmax of the current W (tracked, as TensorFlow's
quantization-aware training and the int8 export compute them).  Both round
half away from zero, as TFLite does.

Either, given an int8 output, stores the level of each value instead of the value
(schemas/quantization.md, "int8 storage"): level q of FAKE_QUANT's int8 grid
(scale, zero point) is its level q + 128, of float32 value (q + 128)·scale +
nudged min; FakeQuantPerChannel's level q has the value q·s (of 8 bits).
`dequantizer` computes those values as the float kernels do, so a reader sees the
very values a float32 output would hold.

Their gradients are straight-through estimators with a clamp mask: dY passes
where the rounded level of X is representable, 0 elsewhere (the level taken
before clamping, as torch.fake_quantize_per_*_affine define it).
"""
from functools import partial

import numpy as np

from microtrain.step.kernels import kernel


def nudged_range(min_: float, max_: float, num_bits: int = 8,
                 narrow_range: bool = False) -> tuple[float, float, int, int]:
    """(scale, nudged min, lowest level, highest level) of FAKE_QUANT's range, in
    float32 as TensorFlow's kernel computes them: the zero point is rounded to a
    level so that 0.0 lands on the grid."""
    f32 = np.float32
    low, high = (1 if narrow_range else 0), (1 << num_bits) - 1
    scale = (f32(max_) - f32(min_)) / f32(high - low)
    zero_from_min = f32(low) - f32(min_) / scale
    zero = low if zero_from_min < low else high if zero_from_min > high \
        else int(np.floor(zero_from_min + f32(0.5)))
    return float(scale), float(f32(low - zero) * scale), low, high


def range_of(scale: float, zero_point: int, num_bits: int = 8) -> tuple[float, float]:
    """FAKE_QUANT's (min, max) for a signed num_bits tensor's (scale, zero point)."""
    half = 1 << (num_bits - 1)
    return float((-half - zero_point) * scale), float((half - 1 - zero_point) * scale)


def scale_zero_point(min_: float, max_: float, num_bits: int = 8,
                     narrow_range: bool = False) -> tuple[float, int]:
    """The (scale, zero point) of FAKE_QUANT's grid as a signed num_bits integer
    tensor stores it (int8: levels −128..127)."""
    scale, lo, low, _ = nudged_range(min_, max_, num_bits, narrow_range)
    return scale, int(round(low - lo / scale)) - (1 << (num_bits - 1))


def _levels(x: np.ndarray, lo: float, scale: float) -> np.ndarray:
    """round((x − lo)·(1/scale)): the level of x on the grid, before clamping (a
    product with the float32 reciprocal, as LiteRT's kernel computes it)."""
    inverse = x.dtype.type(np.float32(1) / np.float32(scale))
    return np.floor((x - x.dtype.type(lo)) * inverse + x.dtype.type(0.5))


LEVEL_OFFSET = 128  # int8 level q is FAKE_QUANT's level q + 128 (of 0..255)
# a 0-d array: one for every closure (the memory plan counts what closures keep)
OFFSET = np.array(LEVEL_OFFSET, np.float32)


@kernel("FAKE_QUANT", rows="each")
def fake_quant(inputs, outputs, min=0.0, max=0.0, num_bits=8, narrow_range=False, **_):
    (x,), (y,) = inputs, outputs
    scale, lo, low, high = nudged_range(min, max, num_bits, narrow_range)
    top = np.float64(high - low)
    if y.dtype == np.int8:  # its levels (levels_problem has checked the grid)
        def store():
            np.subtract(np.clip(_levels(x, lo, scale), 0, top), OFFSET, out=y, casting="unsafe")
        return store

    def step():
        np.clip(_levels(x, lo, scale), 0, top, out=y)
        _to_values(y, scale, lo)
    return step


def _to_values(levels: np.ndarray, scale: float, lo: float) -> None:
    """FAKE_QUANT's values of float `levels` in place: level·scale + nudged min."""
    np.multiply(levels, levels.dtype.type(scale), out=levels)
    np.add(levels, levels.dtype.type(lo), out=levels)


def dequantizer(src: np.ndarray, dst: np.ndarray, levels):
    """A closure writing into the float32 array `dst` the values of the int8
    levels `src` of graph tensor `levels` (its fake_quant operator and grid):
    those the operator's float kernel computes, bit for bit."""
    q = levels.quantization
    if levels.fake_quant == "FakeQuantPerChannel":  # a float64 product, as the kernel's
        scales = q.along(q.scale, src.ndim).astype(np.float64)
        return partial(np.multiply, src, scales, out=dst, casting="unsafe")
    scale = float(q.scale[0])
    lo = float(np.float32(-LEVEL_OFFSET - int(q.zero_point[0])) * np.float32(scale))  # nudged min

    def step():
        np.add(src, OFFSET, out=dst)
        _to_values(dst, scale, lo)
    return step


def levels_problem(g, op) -> str | None:
    """Why fake-quantization `op` of graph g cannot store its output as int8
    levels (None: it can, or its output is a float)."""
    t = g.tensors[op.outputs[0]]
    if not t.fake_quant:
        return None
    q, options = t.quantization, op.options
    if op.type == "FAKE_QUANT":
        want = scale_zero_point(options.get("min", 0.0), options.get("max", 0.0))
        fits = not options.get("narrow_range", False) and q is not None and q.scale.size == 1 \
            and (float(q.scale[0]), int(q.zero_point[0])) == want
        grid = f"scale {want[0]!r}, zero point {want[1]}"
    else:
        scales = g.tensors[op.inputs[1]]  # a constant, or linked to the forward graph's
        fits = q is not None and q.axis == options.get("axis", 0) and not q.zero_point.any() \
            and q.scale.shape == scales.shape and (scales.data is None
                                                   or np.array_equal(q.scale, scales.data))
        grid = "its scales along its axis, zero points 0"
    if options.get("num_bits", 8) != 8 or not fits:
        return (f"stores tensor {t.index} '{t.name}' as int8, which needs 8 bits without "
                f"narrow range and its grid declared ({grid})")
    return None


@kernel("FakeQuantGrad", rows="each")
def fake_quant_grad(inputs, outputs, min=0.0, max=0.0, num_bits=8, narrow_range=False, **_):
    """dX = dY where X's level is in range, else 0."""
    (dy, x), (dx,) = inputs, outputs
    scale, lo, low, high = nudged_range(min, max, num_bits, narrow_range)

    def step():
        level = _levels(x, lo, scale)
        np.multiply(dy, (level >= 0) & (level <= high - low), out=dx)
    return step


def channel_shape(ndim: int, axis: int, channels: int) -> tuple[int, ...]:
    """The shape that broadcasts per-channel values along `axis`."""
    shape = [1] * ndim
    shape[axis] = channels
    return tuple(shape)


def symmetric_levels(w: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """w/scale rounded half away from zero, in float64 (exact for 32-bit levels)."""
    v = w.astype(np.float64) / scales
    return np.trunc(v + np.copysign(0.5, v))


def tracked_scales(w: np.ndarray, axis: int, num_bits: int = 8) -> np.ndarray:
    """Each channel's max|w|/qmax along `axis` (an all-zero channel: 1), in float64,
    shaped to broadcast against w."""
    others = tuple(a for a in range(w.ndim) if a != axis)
    peak = np.abs(w.astype(np.float64)).max(axis=others, keepdims=True)
    return np.where(peak > 0, peak / ((1 << (num_bits - 1)) - 1), 1.0)


def _per_channel(w, scales, axis: int, num_bits: int) -> np.ndarray:
    """The channels' scales, broadcasting against w: given, or tracked (scales None)."""
    if scales is None:
        return tracked_scales(w, axis, num_bits)
    return np.asarray(scales, np.float64).reshape(channel_shape(w.ndim, axis, w.shape[axis]))


@kernel("FakeQuantPerChannel")
def fake_quant_per_channel(inputs, outputs, axis=0, num_bits=8, **_):
    """W rounded to its channels' symmetric grids: clamp(round(W/s), ±qmax)·s."""
    (w, *scales), (y,) = inputs, outputs
    qmax = float((1 << (num_bits - 1)) - 1)

    def step():
        s = _per_channel(w, scales[0] if scales else None, axis, num_bits)
        levels = np.clip(symmetric_levels(w, s), -qmax, qmax)
        y[...] = levels if y.dtype == np.int8 else levels * s  # int8: the levels (see above)
    return step


@kernel("FakeQuantPerChannelGrad")
def fake_quant_per_channel_grad(inputs, outputs, axis=0, num_bits=8, qas=True, **_):
    """dW = dY where |round(W/s)| ≤ qmax (tracked scales: everywhere), else 0;
    without `qas` also times s² (the update of an integer weight trained by
    plain SGD, seen on its float value: docs/quantization.md)."""
    (dy, w, *scales), (dw,) = inputs, outputs
    qmax = (1 << (num_bits - 1)) - 1

    def step():
        s = _per_channel(w, scales[0] if scales else None, axis, num_bits)
        grad = dy * (np.abs(symmetric_levels(w, s)) <= qmax)
        dw[...] = grad if qas else grad * s * s
    return step
