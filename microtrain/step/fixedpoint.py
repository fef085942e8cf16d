"""The fixed-point arithmetic of TFLite's integer reference kernels, vectorised
over numpy int64 arrays that hold int32 values.

The definitions are TFLite's (tensorflow/lite/kernels/internal/common.h,
quantization_util.cc) and gemmlowp's (fixedpoint.h), the double-rounding
variant TFLite builds by default.  A value of FixedPoint<int32, I> (I integer
bits) is a raw int32 r standing for r / 2**(31 - I); a product of two such
values rounds its high word (`doubling_high_mul`), and rescaling between
formats rounds (`divide_by_pot`) or saturates (`saturating_shift_left`).
"""
import numpy as np

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


def as_i64(x) -> np.ndarray:
    return np.asarray(x, np.int64)


def wrap32(x) -> np.ndarray:
    """int32 two's-complement wrap-around of int64 values (C's int32 arithmetic)."""
    return ((as_i64(x) & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def round_half_away(x) -> np.ndarray:
    """std::round (TfLiteRound): halves away from zero, in float64 (exact for
    float32 inputs, unlike adding 0.5 in float32)."""
    x = np.asarray(x, np.float64)
    return np.copysign(np.floor(np.abs(x) + 0.5), x)


def doubling_high_mul(a, b, bits: int = 32) -> np.ndarray:
    """SaturatingRoundingDoublingHighMul of `bits`-bit values: a·b / 2**(bits − 1)
    rounded to nearest (positive halves up, negative ones toward zero: the nudge of a
    negative product is 1 − 2**(bits − 2)); MIN · MIN saturates to MAX."""
    a, b = as_i64(a), as_i64(b)
    low = -(1 << (bits - 1))
    # C truncates (ab + nudge) / 2**(bits-1) toward zero; for a negative product that is
    # the floor of (ab + 1 - 2**(bits-2) + 2**(bits-1) - 1): one shift serves both signs
    high = (a * b + (1 << (bits - 2))) >> (bits - 1)
    return np.where((a == low) & (b == low), -low - 1, high)


def doubling_high_mul_truncated(a, b, bits: int = 16) -> np.ndarray:
    """SaturatingDoublingHighMul: a·b / 2**(bits − 1) truncated toward zero; MIN · MIN
    saturates to MAX."""
    a, b = as_i64(a), as_i64(b)
    low = -(1 << (bits - 1))
    ab = a * b
    return np.where((a == low) & (b == low), -low - 1, np.sign(ab) * (np.abs(ab) >> (bits - 1)))


def saturating_left_shift(x, amount, bits: int = 16) -> np.ndarray:
    """x · 2**amount saturated to `bits`-bit integers (TFLite's SaturatingLeftShift)."""
    return np.clip(as_i64(x) << as_i64(amount), -(1 << (bits - 1)), (1 << (bits - 1)) - 1)


def divide_by_pot(x, exponent) -> np.ndarray:
    """RoundingDivideByPOT: x / 2**exponent rounded to nearest, halves away from zero."""
    x, exponent = as_i64(x), as_i64(exponent)
    half = (np.int64(1) << exponent) >> 1
    return (x + half - ((x < 0) & (half > 0))) >> exponent  # negative halves round down


def saturating_shift_left(x, exponent: int) -> np.ndarray:
    """gemmlowp's SaturatingRoundingMultiplyByPOT for a positive exponent."""
    limit = (1 << (31 - exponent)) - 1
    x = as_i64(x)
    return np.where(x > limit, I32_MAX, np.where(x < -limit, I32_MIN, x << exponent))


def quantize_multiplier(real) -> tuple[np.ndarray, np.ndarray]:
    """QuantizeMultiplier: (multiplier, shift) with real ≈ multiplier · 2**(shift − 31),
    multiplier an int32 in [2**30, 2**31) (0 for 0), for float64 `real` (arrays too)."""
    significand, shift = np.frexp(np.asarray(real, np.float64))
    fixed = round_half_away(significand * (1 << 31)).astype(np.int64)
    shift = shift.astype(np.int64)
    carry = fixed == (1 << 31)
    fixed, shift = np.where(carry, fixed // 2, fixed), np.where(carry, shift + 1, shift)
    tiny = shift < -31
    fixed, shift = np.where(tiny, 0, fixed), np.where(tiny, 0, shift)
    huge = shift > 30
    return np.where(huge, I32_MAX, fixed), np.where(huge, 30, shift)


def multiply_by_quantized_multiplier(x, multiplier, shift) -> np.ndarray:
    """MultiplyByQuantizedMultiplier: x · multiplier · 2**(shift − 31), rounded
    twice as TFLite does (high word, then the right shift)."""
    shift = as_i64(shift)
    left, right = np.maximum(shift, 0), np.maximum(-shift, 0)
    return divide_by_pot(doubling_high_mul(wrap32(as_i64(x) << left), multiplier), right)


def multiply_by_quantized_multiplier_once(x, multiplier, shift) -> np.ndarray:
    """The single-rounding MultiplyByQuantizedMultiplier (TFLITE_SINGLE_ROUNDING's):
    x · multiplier / 2**(31 − shift) rounded once, halves up."""
    total = 31 - as_i64(shift)
    return (as_i64(x) * as_i64(multiplier) + (np.int64(1) << (total - 1))) >> total


# exp(-2**k) in FixedPoint<int32, 0>, for k = -2 .. 4 (gemmlowp's barrel shifter)
_EXP_OF_MINUS_POT = {-2: 1672461947, -1: 1302514674, 0: 790015084, 1: 290630308,
                     2: 39332535, 3: 720401, 4: 242}
_EXP_MINUS_ONE_EIGHTH = 1895147668  # exp(-1/8), FixedPoint<int32, 0>
_ONE_THIRD = 715827883  # 1/3, FixedPoint<int32, 0>


def _exp_on_quarter(a) -> np.ndarray:
    """exp(a) for a in [-1/4, 0) in FixedPoint<int32, 0>: a Taylor expansion
    around -1/8 (gemmlowp's exp_on_interval_between_negative_one_quarter_and_0_excl)."""
    x = a + (1 << 28)
    x2 = doubling_high_mul(x, x)
    x3 = doubling_high_mul(x2, x)
    x4 = doubling_high_mul(x2, x2)
    poly = divide_by_pot(doubling_high_mul(divide_by_pot(x4, 2) + x3, _ONE_THIRD) + x2, 1)
    scaled = doubling_high_mul(_EXP_MINUS_ONE_EIGHTH, wrap32(x + poly))
    return wrap32(_EXP_MINUS_ONE_EIGHTH + scaled)


def exp_on_negative_values(a, integer_bits: int) -> np.ndarray:
    """exp(a) in FixedPoint<int32, 0> for a <= 0 in FixedPoint<int32, integer_bits>."""
    a = as_i64(a)
    fractional = 31 - integer_bits
    quarter = 1 << (fractional - 2)
    in_quarter = (a & (quarter - 1)) - quarter
    result = _exp_on_quarter(saturating_shift_left(in_quarter, integer_bits))
    remainder = in_quarter - a
    for k, factor in _EXP_OF_MINUS_POT.items():
        if integer_bits > k:
            bit = (remainder >> (fractional + k)) & 1
            result = np.where(bit == 1, doubling_high_mul(result, factor), result)
    if integer_bits > 5:
        result = np.where(a < -(1 << (36 - integer_bits)), 0, result)  # below -32: 0
    return np.where(a == 0, I32_MAX, result)


def _one_over_one_plus_x(a) -> np.ndarray:
    """1/(1 + a) for a in [0, 1) in FixedPoint<int32, 0>, by three Newton-Raphson
    steps in FixedPoint<int32, 2> (gemmlowp's one_over_one_plus_x_for_x_in_0_1)."""
    total = as_i64(a) + I32_MAX
    half = (total + 1) >> 1  # RoundingHalfSum(a, 1) of a >= 0
    x = wrap32(1515870810 + doubling_high_mul(half, -1010580540))  # 48/17 − 32/17·half
    for _ in range(3):
        error = wrap32((1 << 29) - doubling_high_mul(half, x))
        x = wrap32(x + saturating_shift_left(doubling_high_mul(x, error), 2))
    return saturating_shift_left(x, 1)


def reciprocal(x, integer_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """TFLite's GetReciprocal of positive x in FixedPoint<int32, integer_bits>:
    (1/x scaled into FixedPoint<int32, 0>, the bits it was shifted over unit)."""
    x = as_i64(x)
    leading = 32 - np.frexp(x.astype(np.float64))[1].astype(np.int64)  # CountLeadingZeros
    shifted = ((x << leading) & 0xFFFFFFFF) - (1 << 31)
    return _one_over_one_plus_x(shifted), integer_bits - leading


_HALF_SQRT_2 = 1518500250  # sqrt(2)/2, FixedPoint<int32, 0>


def inv_sqrt_multiplier(x) -> tuple[np.ndarray, np.ndarray]:
    """TFLite's GetInvSqrtQuantizedMultiplierExp (reverse shift −1) of x >= 0: (multiplier,
    left shift) with 1/sqrt(x) ≈ multiplier · 2**(shift − 31); x <= 1 gives (MAX, 0).  x is
    brought into [2**27, 2**29) by shifting pairs of bits, then 1/sqrt by five Newton–Raphson
    steps from 1 in FixedPoint<int32, 3>."""
    x = as_i64(x)
    small = x <= 1
    shift = np.full(x.shape, 11, np.int64)
    while (big := x >= (1 << 29)).any():
        x, shift = np.where(big, x // 4, x), shift + big
    leading = 32 - np.frexp(np.maximum(x, 1).astype(np.float64))[1].astype(np.int64)
    pairs = (leading - 1) // 2 - 1
    shift, x = shift - pairs, x << (2 * pairs)
    half_input = divide_by_pot(x >> 1, 1)  # Q3.28
    half_three = (1 << 28) + (1 << 27)  # 1.5
    root = np.full(x.shape, 1 << 28, np.int64)  # 1
    for _ in range(5):
        cube = saturating_shift_left(doubling_high_mul(doubling_high_mul(root, root), root), 6)
        root = saturating_shift_left(wrap32(doubling_high_mul(half_three, root)
                                            - doubling_high_mul(half_input, cube)), 3)
    root = doubling_high_mul(root, _HALF_SQRT_2)
    root, shift = np.where(shift < 0, root << np.maximum(-shift, 0), root), np.maximum(shift, 0)
    return np.where(small, I32_MAX, root), np.where(small, 0, -shift)
