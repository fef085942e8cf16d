"""Faithful reduced-precision storage over float32 arithmetic.

Every array is float32; a tensor declared float16 is rounded to float16 right
after the operator that writes it (underflow to 0, overflow to inf, as on
hardware that accumulates in fp32 and stores in fp16).  numpy's own float16
arithmetic is far slower than this round-on-store.
"""
import numpy as np

from .kernels.workspace import begin_kernel, scratch

HALF = np.dtype(np.float16)
TYPES = {"fp32": np.dtype(np.float32), "fp16": HALF}


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


# Rounding float32 to float16 values by float32 arithmetic, exactly as the cast
# would (ties to even), and about 4x faster than numpy's cast there and back (25x
# in fp16's subnormal range, where the cast takes a slow path):
#  - normal range: Veltkamp/Dekker splitting with 2^13 + 1 keeps the 11 leading
#    significant bits, rounded to nearest even;
#  - |x| < 2^-14 (fp16 subnormals): x + 0.75 lies on float32's 2^-24 grid, so
#    (x + 0.75) - 0.75 is x rounded to a multiple of 2^-24;
#  - |x| >= 65520 (rounds to inf), inf and NaN: numpy's cast (rare, so slow is fine).
F16_MIN_NORMAL = np.float32(2.0 ** -14)
F16_ROUNDS_TO_INF = np.float32(65520.0)
F16_LOST = np.float32(2.0 ** -25)  # 0 < |x| <= this rounds to zero
SPLIT = np.float32(2 ** 13 + 1)
GRID = np.float32(0.75)


SMALL = 4096  # below this many elements the two casts beat the dozen arithmetic passes


def rounder(a: np.ndarray, underflow: Underflow | None = None, tensor: int = -1):
    """A closure rounding `a` in place to float16 values; with `underflow`, it
    also counts the elements that became zero, under `tensor`."""
    begin_kernel()
    return (_cast_rounder if a.size < SMALL else _arithmetic_rounder)(a, underflow, tensor)


def _cast_rounder(a: np.ndarray, underflow: Underflow | None, tensor: int):
    half = scratch(a.shape, HALF)

    def step():
        before = np.count_nonzero(a) if underflow is not None else 0
        np.copyto(half, a, casting="unsafe")  # overflow to inf is meant: callers silence it
        np.copyto(a, half)
        if underflow is not None:
            underflow.add(tensor, before - np.count_nonzero(a), a.size)
    return step


def _arithmetic_rounder(a: np.ndarray, underflow: Underflow | None, tensor: int):
    mag, split, grid = (scratch(a.shape, a.dtype) for _ in range(3))
    normal, subnormal = scratch(a.shape, a.dtype), scratch(a.shape, a.dtype)  # 1.0/0.0 masks
    flags = scratch(a.shape, bool)
    cast = _cast_rounder(a, None, tensor)

    def count_lost() -> None:
        np.less_equal(mag, F16_LOST, out=flags)
        lost = np.count_nonzero(flags)
        np.equal(mag, 0, out=flags)
        underflow.add(tensor, lost - np.count_nonzero(flags), a.size)

    def step():
        np.abs(a, out=mag)
        if underflow is not None:
            count_lost()
        if not mag.max() < F16_ROUNDS_TO_INF:
            cast()
            return
        np.multiply(a, SPLIT, out=split)
        np.subtract(split, a, out=grid)
        np.subtract(split, grid, out=split)
        np.add(a, GRID, out=grid)
        np.subtract(grid, GRID, out=grid)
        np.less(mag, F16_MIN_NORMAL, out=subnormal)
        np.greater_equal(mag, F16_MIN_NORMAL, out=normal)
        np.multiply(split, normal, out=split)
        np.multiply(grid, subnormal, out=grid)
        np.add(split, grid, out=a)
    return step
