"""Shuffling without numpy.random.

numpy.random costs about 6 MB of resident memory when imported, more than the
rest of the runtime.  The epoch orders come instead from a counter-based
generator: permutation k of a Shuffler is a pure function of (seed, k) -- the
sample indices hashed by splitmix64 from a per-draw stream, then sorted -- so
its whole state is two integers, and a resumed run replays exactly.
"""
import os

import numpy as np

MASK = (1 << 64) - 1
STREAM = 0xD1B54A32D192ED03  # an odd constant spreading the draw counter over 64 bits


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Steele, Lea and Flood's splitmix64 finaliser over a uint64 array (a bijection
    with full avalanche; uint64 array arithmetic wraps modulo 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Shuffler:
    """Reproducible permutations; `state()` is JSON and `Shuffler(**state)` resumes it."""

    def __init__(self, seed: int | None = None, draws: int = 0):
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        if not (isinstance(seed, int) and isinstance(draws, int)) or draws < 0:
            raise ValueError(f"a shuffler state is two whole numbers, got {seed!r}, {draws!r}")
        self.seed, self.draws = seed & MASK, draws

    def permutation(self, n: int) -> np.ndarray:
        """The next order of n samples."""
        stream = splitmix64(np.array([self.seed ^ (self.draws * STREAM & MASK)], np.uint64))
        self.draws += 1
        return np.argsort(splitmix64(np.arange(n, dtype=np.uint64) + stream), kind="stable")

    def state(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}
