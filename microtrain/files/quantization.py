"""Quantized tensors: their parameters, and the conversions TFLite's kernels make
between real values and integers (the public helpers other modules use).

A quantized tensor of an integer type holds q standing for the real value
scale · (q − zero_point), with one scale and zero point for the tensor or one per
slice along `axis` (a per-channel weight).  Integer kernels accumulate in int32 and
bring an accumulator back to 8 bits by a fixed-point multiplier (`requantize`); the
arithmetic is TFLite's reference kernels', bit for bit (microtrain/step/fixedpoint.py, whose
quantize_multiplier gives a real multiplier's fixed-point form).
"""
from dataclasses import dataclass

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.step.fixedpoint import (as_i64, multiply_by_quantized_multiplier,
                         multiply_by_quantized_multiplier_once, quantize_multiplier,  # noqa: F401
                         round_half_away)

@dataclass(frozen=True, eq=False)
class Quantization:
    """Scales and zero points, given as numbers or sequences: Quantization(0.05, -3),
    Quantization([0.01, 0.02], 0, axis=3) (one zero point serves every scale)."""
    scale: np.ndarray  # float32, one value or one per slice along `axis`
    zero_point: np.ndarray = 0  # int64, as many as scale
    axis: int = 0

    def __post_init__(self):
        scale = np.atleast_1d(np.asarray(self.scale, np.float32))
        zero = np.atleast_1d(np.asarray(self.zero_point, np.int64))
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "zero_point",  # as read (a view of a mapped file's bytes)
                           np.broadcast_to(zero, scale.shape).copy() if zero.size == 1 < scale.size
                           else zero)

    def along(self, values: np.ndarray, ndim: int) -> np.ndarray:
        """Per-slice `values` shaped to broadcast over an array of `ndim` axes
        (a per-tensor value as it is)."""
        if values.size == 1:
            return values.reshape(())
        shape = [1] * ndim
        shape[self.axis] = values.size
        return values.reshape(shape)

    def same(self, other: "Quantization | None") -> bool:
        return other is not None and np.array_equal(self.scale, other.scale) and \
            np.array_equal(self.zero_point, other.zero_point)


def quantization_of(tensor) -> Quantization | None:
    """The parameters of a circle/tflite TensorT, None when it has no scales."""
    q = tensor.quantization
    if q is None or q.scale is None or len(q.scale) == 0:
        return None
    zero = 0 if q.zeroPoint is None or len(q.zeroPoint) == 0 else q.zeroPoint
    return Quantization(q.scale, zero, int(q.quantizedDimension))


def type_range(dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def quantize(x: np.ndarray, q: Quantization, dtype=np.int8) -> np.ndarray:
    """Real values as `dtype` integers, as TFLite's QUANTIZE: round(x / scale)
    (float32 division, halves away from zero) + zero point, saturated."""
    x = np.asarray(x, np.float32)
    scale = q.along(q.scale, x.ndim)
    rounded = round_half_away(x / scale) + q.along(q.zero_point, x.ndim)
    return np.clip(rounded, *type_range(dtype)).astype(dtype)


def dequantize(values: np.ndarray, q: Quantization) -> np.ndarray:
    """float32 scale · (q − zero_point), as TFLite's DEQUANTIZE (q − zero_point is
    exact in float32, so one rounding, as its double product cast to float)."""
    values = np.asarray(values)
    zero = q.along(q.zero_point, values.ndim).astype(np.float32)
    return (values.astype(np.float32) - zero) * q.along(q.scale, values.ndim)


def requantize(acc, mult, shift, zero_point, lo: int, hi: int, dtype=np.int8,
               once: bool = False) -> np.ndarray:
    """An int32 accumulator brought to `dtype`: acc · multiplier · 2**(shift − 31)
    rounded as TFLite's MultiplyByQuantizedMultiplier (twice; `once`: its
    single-rounding form, which LiteRT's FULLY_CONNECTED uses), plus the output
    zero point, clamped to [lo, hi] (the fused activation's range)."""
    times = multiply_by_quantized_multiplier_once if once else multiply_by_quantized_multiplier
    out = times(acc, mult, shift) + as_i64(zero_point)
    return np.clip(out, lo, hi).astype(dtype)


# fused_activation_function codes whose integer form is a clamp: (low, high) in real values
CLAMPS = {0: (None, None), 1: (0.0, None), 2: (-1.0, 1.0), 3: (0.0, 6.0)}


def activation_range(code: int, q: Quantization, dtype) -> tuple[int, int]:
    """The integer clamp of a fused activation on an output quantized by q
    (TFLite's CalculateActivationRangeQuantized: the bounds rounded in float32)."""
    if code not in CLAMPS:
        raise OperatorError(None, f"fused activation {code} has no integer form")
    lo, hi = type_range(dtype)
    scale, zero = np.float32(q.scale[0]), int(q.zero_point[0])
    real_lo, real_hi = CLAMPS[code]
    if real_lo is not None:
        lo = max(lo, zero + int(round_half_away(np.float32(real_lo) / scale)))
    if real_hi is not None:
        hi = min(hi, zero + int(round_half_away(np.float32(real_hi) / scale)))
    return lo, hi


@dataclass
class OpQuantization:
    """The parameters of an integer operator's inputs and outputs (None: not quantized)."""
    inputs: list[Quantization | None]
    outputs: list[Quantization | None]


def op_quantization(g, op) -> OpQuantization | None:
    """The parameters of `op` in graph g when it computes on quantized activations
    (an input it does not hold as a constant, or an output, is quantized), else None.
    A fake quantization's int8 levels are float values in storage
    (graph.Tensor.fake_quant): they do not make an operator integer."""
    computed = [g.tensors[i] for i in op.inputs if i >= 0 and g.tensors[i].data is None]
    outputs = [g.tensors[i] for i in op.outputs]
    if not any(t.quantization is not None and not t.fake_quant for t in computed + outputs):
        return None
    return OpQuantization([g.tensors[i].quantization if i >= 0 else None for i in op.inputs],
                          [t.quantization for t in outputs])
