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

Their gradients are straight-through estimators with a clamp mask: dY passes
where the rounded level of X is representable, 0 elsewhere (the level taken
before clamping, as torch.fake_quantize_per_*_affine define it).
"""
import numpy as np

from . import kernel


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


@kernel("FAKE_QUANT", rows="each")
def fake_quant(inputs, outputs, min=0.0, max=0.0, num_bits=8, narrow_range=False, **_):
    (x,), (y,) = inputs, outputs
    scale, lo, low, high = nudged_range(min, max, num_bits, narrow_range)
    top = np.float64(high - low)

    def step():
        np.clip(_levels(x, lo, scale), 0, top, out=y)
        np.multiply(y, y.dtype.type(scale), out=y)
        np.add(y, y.dtype.type(lo), out=y)
    return step


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
        y[...] = np.clip(symmetric_levels(w, s), -qmax, qmax) * s
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
