"""Reduced-precision storage over float32 arithmetic.

A tensor declared float16 is stored as a float16 array (2 bytes an element).
Kernels compute in float32: in_float32 widens a kernel's float16 inputs into
float32 scratch, runs the kernel into float32 scratch and narrows the results
into their float16 arrays, rounding to nearest even (underflow to 0, overflow
to inf, as on hardware that accumulates in fp32 and stores in fp16).  A float16
tensor that aliases a float32 buffer (a weight gradient in the flat gradient
vector) is rounded in place to float16 values instead.

A fake quantization's output declared int8 (graph.Tensor.fake_quant) is stored as
its levels (1 byte an element) and widened likewise into its float32 values
(kernels/fake_quant.py); the fake-quantization kernel writes the levels itself.

numpy's float32 -> float16 cast converts an element at a time (~1.5 ns, and ~65 ns
for each value that becomes an fp16 subnormal or zero); the conversions below use
float32 arithmetic and integer bit operations instead, about a dozen passes of
~0.05 ns an element each, and exactly the cast's results.
"""
import functools
from dataclasses import dataclass
from math import prod

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.format.model import bfloat16
from microtrain.step.kernels import in_sequence
from microtrain.step.kernels.fake_quant import dequantizer
from microtrain.files.graph import Tensor
from microtrain.step.kernels.workspace import kept, scratch

F32 = np.dtype(np.float32)
HALF = np.dtype(np.float16)
TYPES = ("fp32", "fp16", "bf16")  # the names of the types a split may choose


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


# -- float16 rounding ----------------------------------------------------------------------------
# numpy's float16 cast is one call at ~1.5 ns an element, but ~65 ns for every
# element that becomes an fp16 subnormal or underflows to zero.  The passes below
# take ~0.05 ns an element each whatever the values.  Adding m = 2^(max(e, -14) + 13)
# to |x| (2^e <= |x| < 2^(e+1)) gives a sum in m's binade, where float32's spacing
# is fp16's at |x| (2^(e-10), or 2^-24 below fp16's normals): the add rounds |x| to
# fp16's grid, to nearest even (m is an even multiple of that spacing), and taking
# m away again is exact.  Multiplying an fp16 value by 2^-112 then gives a float32
# whose bits are the float16 bits shifted left by 13 (fp16 subnormals become float32
# subnormals, exactly).  Values that round to inf, inf and NaN take numpy's cast.
# (numpy's copysign, float count_nonzero and maximum against a scalar are slow
# loops here: the passes avoid them.)
# The constants are 0-d arrays: numpy converts a Python or numpy scalar operand
# anew at every call (~0.3 us), and a 16K-element pass takes ~1 us.
F16_ROUNDS_TO_INF_BITS = 0x477FF000  # 65520: from here |x| rounds to inf
F16_MIN_NORMAL_BITS = 0x38800000  # 2^-14
F16_LOST_BITS = 0x33000000  # 2^-25: 0 < |x| <= this rounds to zero


def _u32(value: int) -> np.ndarray:
    return np.array(value, np.uint32)


ONE, THIRTEEN, SIXTEEN = _u32(1), _u32(13), _u32(16)
SIGN_BIT, MAGNITUDE_BITS, EXPONENT_BITS = _u32(0x80000000), _u32(0x7FFFFFFF), _u32(0x7F800000)
HALF_SIGN_BIT = np.array(0x8000, np.uint16)
GRID_SHIFT = _u32(13 << 23)  # adds 13 to a float32's exponent
BELOW_NORMAL = _u32(2 * F16_MIN_NORMAL_BITS - 1)  # (twice the magnitude) - 1 below this
LOST = _u32(F16_LOST_BITS)  # (magnitude bits) - 1 below this: rounds to zero
TWICE_LOST = _u32(2 * F16_LOST_BITS + 1)  # (twice the magnitude) - 1 below this: the same
TO_HALF_FIELD = np.array(2.0 ** -112, np.float32)
FROM_HALF_FIELD = np.array(2.0 ** 112, np.float32)
HALF_FIELD_MASK = _u32(0x8FFFFFFF)
HALF_INF_VALUE = np.float32(2.0 ** 16)  # where widen() puts float16's inf
# Below this many elements numpy's cast (one call) beats the passes (~0.5 us a call)
# unless many values are below fp16's normals: small arrays look at those first.
SMALL = 8192
SMALL_WIDEN = 4096
CHUNK = 1 << 14  # arrays are rounded and narrowed this many elements at a time


def _normal_floor(size: int) -> np.ndarray:
    """fp16's smallest normal's float32 bits, `size` times (shared by every closure)."""
    return kept("f16 normal floor", (size,), np.uint32,
                lambda shape: np.full(shape, F16_MIN_NORMAL_BITS, np.uint32))


def _chunks(a: np.ndarray) -> list:
    flat = a.reshape(-1)
    return [flat] if flat.size <= CHUNK else [flat[lo:lo + CHUNK]
                                              for lo in range(0, flat.size, CHUNK)]


def _first(a: np.ndarray, n: int) -> np.ndarray:
    """a's first n elements (a itself when it has n: the closures of a step hold
    tens of thousands of views)."""
    return a if a.size == n else a[:n]


class _CastChoice:
    """For a small float32 array: runs `cast` (numpy's cast, ~1.5 ns an element
    and ~65 ns for each value below fp16's normals) when that beats the passes,
    telling `lost` (a counter, or None) which elements underflow; returns False
    when it did not.  Which way is cheaper is decided from a count of the values
    below fp16's normals every RECOUNT-th call and kept in between (both ways
    are exact).  `bits`: the array's float32 bits; `work`, `flags`: uint32 and
    bool scratch of its size."""

    RECOUNT = 16

    def __init__(self, bits: np.ndarray, work: np.ndarray, flags: np.ndarray, cast, lost):
        self.bits, self.work, self.flags, self.cast, self.lost = bits, work, flags, cast, lost
        self.calls, self.cheap = 0, True

    def __call__(self) -> bool:
        recount = self.calls % self.RECOUNT == 0
        self.calls += 1
        if recount or self.lost is not None:
            np.left_shift(self.bits, ONE, out=self.work)  # twice the magnitude
            np.subtract(self.work, ONE, out=self.work)  # zeros wrap around to the largest value
        if recount:
            below_normal = 0 if self.work.min() >= BELOW_NORMAL else \
                np.count_nonzero(np.less(self.work, BELOW_NORMAL, out=self.flags))
            self.cheap = below_normal * 64 + self.bits.size < SMALL
        if not self.cheap:
            return False
        if self.lost is not None:  # 0 < |x| <= 2^-25 rounds to zero (a tie at 2^-25)
            self.lost(np.less(self.work, TWICE_LOST, out=self.flags))
        self.cast()
        return True


def _counter(underflow: Underflow | None, tensor: int, size: int):
    """A function recording the underflow of one store of `size` elements of
    `tensor`: given the count, or a mask of the elements that underflow (None:
    no counting)."""
    if underflow is None:
        return None

    def count(lost) -> None:
        underflow.add(tensor, np.count_nonzero(lost) if isinstance(lost, np.ndarray) else int(lost),
                      size)
    return count


def _span_counter(underflow: Underflow, spans: list):
    """_counter() for a chunk holding several tensors: `spans` [(tensor, start,
    end)] cover it in order; it must be given masks (or 0)."""
    starts = [start for _, start, _ in spans]  # a list: no array held per closure

    def count(lost) -> None:
        each = np.add.reduceat(lost, starts, dtype=np.intp) if isinstance(lost, np.ndarray) \
            else [0] * len(spans)
        for (tensor, start, end), n in zip(spans, each):
            underflow.add(tensor, int(n), end - start)
    return count


def _magnitude_to_grid(magnitude: np.ndarray, grid: np.ndarray, floor: np.ndarray) -> None:
    """Round the float32 magnitudes (|x| < 65520) to fp16's grid in place (see
    above); `grid`: uint32 scratch of their size, `floor`: _normal_floor()."""
    step = grid.view(np.float32)
    np.bitwise_and(magnitude.view(np.uint32), EXPONENT_BITS, out=grid)
    np.maximum(grid, floor, out=grid)
    np.add(grid, GRID_SHIFT, out=grid)
    np.add(magnitude, step, out=magnitude)
    np.subtract(magnitude, step, out=magnitude)


def round_in_place(a: np.ndarray, underflow: Underflow | None = None, tensor: int = -1,
                   dtype=HALF):
    """A closure rounding the float32 array `a` in place to `dtype` values, a
    chunk at a time; with `underflow`, it also counts the elements that became
    zero, under `tensor`.  Its scratch joins the layout of the kernel being built."""
    if dtype != HALF:  # through dtype scratch and back (ml_dtypes' bfloat16 cast is fast)
        narrowed = scratch((min(a.size, CHUNK),), dtype)
        return in_sequence([_through(part, narrowed[:part.size], underflow, tensor)
                             for part in _chunks(a)])
    return round_spans(a.reshape(-1), [(tensor, 0, a.size)] if underflow is not None else [],
                       underflow)


def round_spans(flat: np.ndarray, spans: list, underflow: Underflow | None):
    """A closure rounding the 1-D float32 array `flat` in place to fp16 values,
    a chunk at a time, counting the underflow of each span (tensor, start, end)
    of `spans` (which, when given, cover it in order) under its tensor."""
    size = min(flat.size, CHUNK)
    grid, magnitude, flags, floor = (scratch((size,), np.uint32), scratch((size,), F32),
                                     scratch((size,), bool), _normal_floor(size))
    steps = []
    for lo in range(0, flat.size, CHUNK):
        part = flat[lo:lo + CHUNK]
        n = part.size
        mine = [(t, max(a, lo) - lo, min(b, lo + n) - lo) for t, a, b in spans
                if a < lo + n and b > lo]
        several = underflow is not None and len(mine) > 1
        count = None if underflow is None else \
            _span_counter(underflow, mine) if several else _counter(underflow, mine[0][0], n)
        steps.append(_rounder(part, *(_first(a, n) for a in (grid, magnitude, flags, floor)),
                              count, may_cast=not several))
    return in_sequence(steps)


def _through(part: np.ndarray, narrowed: np.ndarray, underflow: Underflow | None, tensor: int):
    """Round `part` in place by storing it into `narrowed` (another dtype) and back."""
    def step():
        before = np.count_nonzero(part) if underflow is not None else 0
        np.copyto(narrowed, part, casting="unsafe")
        np.copyto(part, narrowed)
        _count_lost(underflow, tensor, before, part)
    return step


def _rounder(part: np.ndarray, grid: np.ndarray, magnitude: np.ndarray, flags: np.ndarray,
             floor: np.ndarray, lost, may_cast: bool = True):
    """Round the float32 array `part` to fp16 values in place, telling `lost`
    (a counter, or None) which elements underflow; the other arrays: scratch of
    its size and _normal_floor().  `may_cast`: small arrays may take numpy's
    cast (not with a _span_counter, which needs a mask of the lost elements)."""
    bits, mag_bits = part.view(np.uint32), magnitude.view(np.uint32)
    half = grid.view(HALF)[:part.size]

    def cast() -> None:  # numpy's cast there and back, through the grid's bytes
        np.copyto(half, part, casting="unsafe")
        np.copyto(part, half)
    cheap = _CastChoice(bits, grid, flags, cast, lost) if part.size < SMALL and may_cast else None

    def step():
        if cheap and cheap():
            return
        np.bitwise_and(bits, MAGNITUDE_BITS, out=mag_bits)
        if lost is not None:  # 0 < |x| <= 2^-25 rounds to zero
            np.subtract(mag_bits, ONE, out=grid)  # zeros wrap around
            lost(np.less(grid, LOST, out=flags))
        if mag_bits.max() >= F16_ROUNDS_TO_INF_BITS:  # some value rounds to inf, or is inf/NaN
            return cast()
        _magnitude_to_grid(magnitude, grid, floor)
        np.bitwise_and(bits, SIGN_BIT, out=bits)
        np.bitwise_or(bits, mag_bits, out=bits)
    return step


def _count_lost(underflow: Underflow | None, tensor: int, before: int, after: np.ndarray) -> None:
    if underflow is not None:
        underflow.add(tensor, before - np.count_nonzero(after), after.size)


def narrow_work(shape) -> np.ndarray:
    """Scratch for narrow(): closures that run one after the other may share it."""
    return scratch((min(prod(shape), CHUNK),), np.uint32)


def narrow(src: np.ndarray, dst: np.ndarray, underflow: Underflow | None = None,
           tensor: int = -1, work: np.ndarray | None = None):
    """A closure storing the float32 array `src` into the float16 (or bfloat16)
    array `dst`, rounded to nearest even, a chunk at a time, counting underflow as
    `round_in_place` does; it may overwrite `src`.  Both contiguous, of one
    shape; `work`: narrow_work() of that shape or larger (default: its own)."""
    if dst.dtype != HALF:  # ml_dtypes' bfloat16 cast is fast (and rounds to nearest even)
        return _caster(src, dst, underflow, tensor)
    grid = work if work is not None and work.size >= min(src.size, CHUNK) else \
        narrow_work(src.shape)
    floor = _normal_floor(min(src.size, CHUNK))
    return in_sequence([_narrower(s, d, _first(grid, s.size), _first(floor, s.size),
                                   _counter(underflow, tensor, s.size))
                         for s, d in zip(_chunks(src), _chunks(dst))])


def _caster(src: np.ndarray, dst: np.ndarray, underflow: Underflow | None, tensor: int):
    """numpy's cast of `src` into `dst`, counting underflow."""
    def step():
        before = np.count_nonzero(src) if underflow is not None else 0
        np.copyto(dst, src, casting="unsafe")
        _count_lost(underflow, tensor, before, dst)
    return step


def _narrower(src: np.ndarray, dst: np.ndarray, grid: np.ndarray, floor: np.ndarray, lost):
    """One chunk of narrow(): 1-D arrays of one size, `grid` uint32 scratch,
    `lost` a _counter() or None."""
    bits, out = src.view(np.uint32), dst.view(np.uint16)
    shifted = _first(grid.view(np.uint16), src.size)  # grid's bytes, once done with
    cast = functools.partial(np.copyto, dst, src, casting="unsafe")
    cheap = _CastChoice(bits, grid, _first(dst.view(bool), src.size), cast, lost) \
        if src.size < SMALL else None

    def step():
        if cheap and cheap():
            return
        np.right_shift(bits, SIXTEEN, out=grid)
        np.copyto(out, grid, casting="unsafe")  # (cheaper than a shift into uint16)
        np.bitwise_and(out, HALF_SIGN_BIT, out=out)  # the signs
        np.bitwise_and(bits, MAGNITUDE_BITS, out=bits)
        before = np.count_nonzero(bits) if lost is not None else 0
        if bits.max() >= F16_ROUNDS_TO_INF_BITS:  # some value rounds to inf, or is inf/NaN:
            np.copyto(shifted, out)  # numpy's cast of the magnitudes, then the signs
            cast()
            np.bitwise_or(out, shifted, out=out)
            if lost is not None:
                lost(before - np.count_nonzero(dst))
            return
        _magnitude_to_grid(src, grid, floor)
        if lost is not None:
            lost(before - np.count_nonzero(bits))
        np.multiply(src, TO_HALF_FIELD, out=src)
        np.right_shift(bits, THIRTEEN, out=bits)
        np.copyto(shifted, bits, casting="unsafe")
        np.bitwise_or(out, shifted, out=out)
    return step


def widen(src: np.ndarray, dst: np.ndarray, levels: Tensor | None = None):
    """A closure copying the float16 array `src` into the float32 array `dst`
    (exact), in place in `dst`: sign-extending the float16 bits to 32 and
    shifting them left by 13 puts the sign on bit 31 and sets bits 28..30 for
    negative values; clearing those leaves the float32 bits of the value times
    2^-112.  Both contiguous, of one shape.  Given the graph tensor `levels`
    (graph.Tensor.fake_quant), `src` holds its int8 levels and `dst` gets their
    values, bit for bit those of its fake-quantization operator's float kernel."""
    if levels is not None:
        return dequantizer(src, dst, levels)
    if src.size < SMALL_WIDEN or src.dtype != HALF:
        return lambda: np.copyto(dst, src)
    bits, field = src.view(np.int16), dst.view(np.int32)
    unsigned = dst.view(np.uint32)

    def step():
        np.copyto(field, bits)
        np.left_shift(unsigned, THIRTEEN, out=unsigned)
        np.bitwise_and(unsigned, HALF_FIELD_MASK, out=unsigned)
        np.multiply(dst, FROM_HALF_FIELD, out=dst)
        if not (dst.max() < HALF_INF_VALUE and dst.min() > -HALF_INF_VALUE):
            np.copyto(dst, src)  # inf/NaN: float16's exponent 31 came out as 2^16 and up
    return step


# -- a kernel over reduced-precision tensors ------------------------------------------------------

@dataclass(frozen=True)
class Rounding:
    """How float32 results are stored into a tensor declared `declared`; with
    `underflow`, the values lost to zero count there under `tensor` (see Underflow)."""
    declared: np.dtype
    underflow: Underflow | None = None
    tensor: int = -1


def wide(a: np.ndarray | None, levels: Tensor | None = None) -> np.ndarray | None:
    """`a` itself, or float32 scratch of its shape when it holds reduced precision
    or (given their graph tensor `levels`) a fake quantization's int8 levels."""
    return scratch(a.shape, F32) if a is not None and (reduced(a.dtype) or levels is not None) \
        else a


def store(src: np.ndarray, dst: np.ndarray, rounding: Rounding, work=None):
    """A closure storing float32 results `src` into `dst`: narrowed, rounded in
    place (reduced precision declared, float32 array) or copied; None when `src`
    is `dst` and nothing needs rounding.  `work`: as narrow()'s."""
    r = rounding
    if reduced(dst.dtype):
        return narrow(src, dst, r.underflow, r.tensor, work=work)
    rounds = round_in_place(src, r.underflow, r.tensor, r.declared) if reduced(r.declared) else None
    if src is dst:
        return rounds
    copy = functools.partial(np.copyto, dst, src)
    return copy if rounds is None else in_sequence([rounds, copy])


def in_float32(run, inputs: list, outputs: list, roundings: list, levels: list) -> list:
    """The closures of a kernel over `inputs` and `outputs` that computes in
    float32: its reduced-precision inputs, and those holding a fake
    quantization's int8 levels (`levels`: each input's graph tensor then, else
    None), widened into float32 scratch first, its results stored as each
    output's Rounding says.  `run(wide inputs, wide outputs)` builds the
    kernel's own closures (within this scratch layout)."""
    wide_in = [wide(a, t) for a, t in zip(inputs, levels)]
    wide_out = [wide(a) for a in outputs]
    loads = [widen(a, w, t) for a, w, t in zip(inputs, wide_in, levels) if w is not a]
    steps = run(wide_in, wide_out)
    for a, w, r in zip(outputs, wide_out, roundings):
        if w is not a or reduced(r.declared):
            steps.append(store(w, a, r))
    if not loads and len(steps) == 1:
        return steps
    return [in_sequence(loads + steps)]  # one closure: its scratch holds the float32 copies
