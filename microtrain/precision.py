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


def rounder(a: np.ndarray, underflow: Underflow | None = None, tensor: int = -1):
    """A closure rounding `a` to float16 in place through a preallocated half
    buffer, counting underflow of `tensor` into `underflow` when given."""
    half = np.empty(a.shape, HALF)

    def step():
        before = np.count_nonzero(a) if underflow is not None else 0
        np.copyto(half, a, casting="unsafe")
        np.copyto(a, half)
        if underflow is not None:
            underflow.add(tensor, before - int(np.count_nonzero(a)), a.size)
    return step
