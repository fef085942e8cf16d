"""Reduced-precision storage over float32 arithmetic.

A tensor declared float16 is stored as a float16 array (2 bytes an element).
Kernels compute in float32: the executor widens a kernel's float16 inputs into
float32 scratch, runs the kernel into float32 scratch and narrows the results
into their float16 arrays, rounding to nearest even (underflow to 0, overflow
to inf, as on hardware that accumulates in fp32 and stores in fp16).  A float16
tensor that aliases a float32 buffer (a weight gradient in the flat gradient
vector) is rounded in place to float16 values instead.

numpy's own float16 casts take a software path here (~4 ns an element, ~100 ns
for fp16 subnormals); the conversions below use float32 arithmetic and integer
bit operations instead, a few passes of ~0.1 ns an element each.
"""
import functools

import numpy as np

from .errors import UserError
from .kernels.workspace import scratch

F32 = np.dtype(np.float32)
HALF = np.dtype(np.float16)
TYPES = ("fp32", "fp16", "bf16")  # the names of the types a split may choose


@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported only when bf16 is used (optional extra [bf16])."""
    try:
        import ml_dtypes
    except ImportError:
        raise UserError(None, "bf16 needs the ml_dtypes package: pip install "
                              "'trainconf-microtrain[bf16]'") from None
    return np.dtype(ml_dtypes.bfloat16)


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype of a type name of TYPES."""
    return {"fp32": lambda: F32, "fp16": lambda: HALF, "bf16": bfloat16}[name]()


def is_bfloat16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def reduced(dtype) -> bool:
    """Whether arrays of `dtype` hold a reduced-precision float (kernels read them widened)."""
    return np.dtype(dtype) == HALF or is_bfloat16(dtype)


def storage(dtype) -> np.dtype:
    """The dtype the runtime stores a tensor declared `dtype` in: float16 and
    bfloat16 as themselves, other floats as float32, anything else as declared."""
    dtype = np.dtype(dtype)
    if reduced(dtype):
        return dtype
    return F32 if np.issubdtype(dtype, np.floating) else dtype


class Underflow:
    """Counts gradient elements that were non-zero before rounding to float16 and
    zero after, per stored tensor (rounding never turns a zero into a non-zero, so
    that is the drop in the non-zero count).  Weight gradients are counted under
    their weight's tensor index, activation gradients under -1 - their backprop
    index: an activation gradient lost upstream makes the weight gradients below
    it exactly zero before their own rounding, so only the count over all
    stores shows it."""

    def __init__(self):
        self.counts: dict[int, list[int]] = {}  # tensor -> [lost, total]

    def add(self, tensor: int, lost: int, total: int) -> None:
        count = self.counts.setdefault(tensor, [0, 0])
        count[0] += lost
        count[1] += total

    def take(self) -> dict:
        """Fractions since the last call (then counting starts afresh): over the
        weight gradients, over every gradient store, and per weight tensor."""
        weights = {t: c for t, c in self.counts.items() if t >= 0}

        def fraction(counts) -> float:
            total = sum(c[1] for c in counts)
            return sum(c[0] for c in counts) / total if total else 0.0
        report = {"weights": fraction(weights.values()), "all": fraction(self.counts.values()),
                  "by_tensor": {t: c[0] / c[1] for t, c in weights.items() if c[1]}}
        self.counts = {}
        return report


F16_ROUNDS_TO_INF = np.float32(65520.0)  # from here |x| rounds to inf
# Below these many elements numpy's float16 cast (one call, ~4 ns an element) beats
# the dozen (narrow) or five (widen) calls of the passes below (~0.7 us a call
# here), but for fp16 subnormals, ~100 ns an element in the cast.
SMALL = 4096
SMALL_WIDEN = 4096
CHUNK = 1 << 16  # float32 arrays are rounded in place this many elements at a time


def round_in_place(a: np.ndarray, underflow: Underflow | None = None, tensor: int = -1,
                   dtype=HALF):
    """A closure rounding the float32 array `a` in place to `dtype` values (a
    store into `dtype` scratch and back, a chunk at a time); with `underflow`,
    it also counts the elements that became zero, under `tensor`.  Its scratch
    joins the layout of the kernel being built."""
    flat = a.reshape(-1)
    size = min(flat.size, CHUNK)
    half = scratch((size,), dtype)
    work = narrow_work((size,)) if dtype == HALF else None
    steps = []
    for lo in range(0, flat.size, CHUNK):
        part = flat[lo:lo + CHUNK]
        steps += [narrow(part, half[:part.size], underflow, tensor, work),
                  widen(half[:part.size], part)]

    def step():
        for s in steps:
            s()
    return step


# -- float16 storage ------------------------------------------------------------------------------
# Narrowing works on the float32 bits a = |x|: in fp16's normal range the
# float16 bits are (a + 0xFFF + lsb) >> 13 minus the exponent rebias, lsb the
# bit that becomes the last kept one (round to nearest even); below it, |x| + 0.5
# lies on float32's 2^-24 grid, so its low bits are the float16 subnormal.
# Widening shifts the bits back and multiplies by 2^112, which rebiases the
# exponent and makes float16 subnormals float32 normals, exactly.  Values that
# round to inf, inf and NaN take numpy's cast (rare).
F16_MIN_NORMAL_BITS = 0x38800000  # 2^-14
F16_LOST_BITS = 0x33000000  # 2^-25: 0 < |x| <= this rounds to zero
HALF_BITS = 0x3F000000  # 0.5
REBIAS = (127 - 15) << 10
FROM_HALF_FIELD = np.float32(2.0 ** 112)
HALF_INF_VALUE = np.float32(2.0 ** 16)  # where float16's inf lands


def narrow_work(shape) -> tuple:
    """Scratch for narrow(): closures that run one after the other may share it."""
    return scratch(shape, np.uint32), scratch(shape, bool)


def narrow(src: np.ndarray, dst: np.ndarray, underflow: Underflow | None = None,
           tensor: int = -1, work: tuple | None = None):
    """A closure storing the float32 array `src` into the float16 (or bfloat16)
    array `dst`, rounded to nearest even, counting underflow as `round_in_place`
    does; it may overwrite `src`.  Both contiguous, of one shape; `work`:
    narrow_work() of that shape or larger (default: scratch of its own)."""
    def cast_all() -> None:
        before = np.count_nonzero(src) if underflow is not None else 0
        np.copyto(dst, src, casting="unsafe")
        if underflow is not None:
            underflow.add(tensor, before - np.count_nonzero(dst), src.size)
    if src.size < SMALL or dst.dtype != HALF:  # ml_dtypes' bfloat16 cast is fast (and RNE)
        return cast_all
    a, out = src.view(np.uint32), dst.view(np.uint16)
    magnitude = src  # src's bits with the sign cleared
    work = work or narrow_work(src.shape)
    normal, subnormal = (w.reshape(-1)[:src.size].reshape(src.shape) for w in work)

    def count_lost() -> None:
        np.less_equal(a, F16_LOST_BITS, out=subnormal)
        lost = np.count_nonzero(subnormal)
        underflow.add(tensor, lost - (a.size - np.count_nonzero(a)), a.size)

    def step():
        if not (src.max() < F16_ROUNDS_TO_INF and src.min() > -F16_ROUNDS_TO_INF):
            return cast_all()  # some value rounds to inf, or is inf/NaN
        np.right_shift(a, 16, out=out, casting="unsafe")
        np.bitwise_and(out, 0x8000, out=out)  # the sign
        np.bitwise_and(a, 0x7FFFFFFF, out=a)
        if underflow is not None:
            count_lost()
        np.less(a, F16_MIN_NORMAL_BITS, out=subnormal)
        np.right_shift(a, 13, out=normal)
        np.bitwise_and(normal, 1, out=normal)
        np.add(normal, a, out=normal)
        np.add(normal, 0xFFF, out=normal)
        np.right_shift(normal, 13, out=normal)
        np.subtract(normal, REBIAS, out=normal)
        np.add(magnitude, 0.5, out=magnitude)
        np.subtract(a, HALF_BITS, out=a)
        # normal += (a - normal) * subnormal, in wrapping uint32 arithmetic (a
        # masked copy is ~100x slower on mixed masks)
        np.subtract(a, normal, out=a)
        np.multiply(a, subnormal, out=a)
        np.add(normal, a, out=normal)
        np.bitwise_or(out, normal, out=out, casting="unsafe")
    return step


def widen(src: np.ndarray, dst: np.ndarray):
    """A closure copying the float16 array `src` into the float32 array `dst`
    (exact), in place in `dst`: sign-extending the float16 bits to 32 and
    shifting them left by 13 puts the sign on bit 31 and sets bits 28..30 for
    negative values; clearing those leaves the float32 bits of the value times
    2^-112.  Both contiguous, of one shape."""
    if src.size < SMALL_WIDEN or src.dtype != HALF:
        return lambda: np.copyto(dst, src)
    bits, field = src.view(np.int16), dst.view(np.int32)
    unsigned = dst.view(np.uint32)

    def step():
        np.copyto(field, bits)
        np.left_shift(unsigned, 13, out=unsigned)
        np.bitwise_and(unsigned, 0x8FFFFFFF, out=unsigned)
        np.multiply(dst, FROM_HALF_FIELD, out=dst)
        if not (dst.max() < HALF_INF_VALUE and dst.min() > -HALF_INF_VALUE):
            np.copyto(dst, src)  # inf/NaN: float16's exponent 31 came out as 2^16 and up
    return step
