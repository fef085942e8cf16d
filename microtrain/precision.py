"""Faithful reduced-precision storage over float32 arithmetic.

Every array is float32; a tensor declared float16 is rounded to float16 right
after the operator that writes it (underflow to 0, overflow to inf, as on
hardware that accumulates in fp32 and stores in fp16).  numpy's own float16
arithmetic is far slower than this round-on-store.
"""
import numpy as np

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


# numpy's float32 -> float16 cast takes a slow path (about 25x slower) for results in
# fp16's subnormal range, [2^-24, 2^-14).  Adding 0.5 to |x| < 2^-14 in float32 lands
# on a grid of spacing 2^-24, so (|x| + 0.5) - 0.5 is exactly that rounding, ties to even.
F16_MIN_NORMAL = np.float32(2.0 ** -14)
GRID = np.float32(0.5)


def _cast(a: np.ndarray, small_values: bool):
    """In-place rounding of `a` to float16 values."""
    half = np.empty(a.shape, HALF)
    if not small_values:
        def cast():
            np.copyto(half, a, casting="unsafe")
            np.copyto(a, half)
        return cast
    rounded, tiny = np.empty_like(a), np.empty(a.shape, bool)

    def cast_small():
        np.abs(a, out=rounded)
        np.less(rounded, F16_MIN_NORMAL, out=tiny)
        np.add(rounded, GRID, out=rounded)
        np.subtract(rounded, GRID, out=rounded)
        np.copysign(rounded, a, out=rounded)
        np.copyto(a, 0, where=tiny)  # keep the cast on its fast path
        np.copyto(half, a, casting="unsafe")
        np.copyto(a, half)
        np.copyto(a, rounded, where=tiny)
    return cast_small


def rounder(a: np.ndarray, underflow: Underflow | None = None, tensor: int = -1):
    """A closure rounding `a` to float16 in place.  With `underflow` (for
    gradients, which often hold subnormal-range values) it also counts the
    elements lost, under `tensor`."""
    cast = _cast(a, small_values=underflow is not None)
    if underflow is None:
        return cast

    def counted():
        before = np.count_nonzero(a)
        cast()
        underflow.add(tensor, before - int(np.count_nonzero(a)), a.size)
    return counted
