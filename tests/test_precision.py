"""fp16 storage: the runtime's rounding and its float32 -> float16 stores equal
numpy's float16 cast exactly (ties to even, subnormals, overflow, inf, NaN, signed
zeros), underflow is counted exactly, and widening float16 back is exact for every
float16 bit pattern."""
import numpy as np
import pytest

from microtrain.step.precision import (CHUNK, SMALL, Underflow, narrow, round_in_place, round_spans,
                                       widen)

RNG = np.random.default_rng(3)


def cast(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(np.float16).astype(np.float32)


def values(n: int) -> np.ndarray:
    """Magnitudes from far below fp16's smallest subnormal to above its largest value,
    plus exact ties in the normal and subnormal ranges."""
    x = np.sign(RNG.standard_normal(n)) * 2.0 ** RNG.uniform(-27, 16.2, n)
    ties = ((RNG.integers(113, 142, n) << 23) | (RNG.integers(0, 1024, n) << 13) | (1 << 12))
    sub_ties = (RNG.integers(0, 1024, n) + 0.5) * 2.0 ** -24
    return np.concatenate([x, ties.astype(np.uint32).view(np.float32), sub_ties,
                           -sub_ties]).astype(np.float32)


@pytest.mark.parametrize("n", [SMALL // 8, SMALL * 4])
@pytest.mark.parametrize("special", [False, True])
def test_rounding_equals_the_float16_cast(n, special):
    x = values(n)
    if special:
        x[:4] = [np.inf, -np.inf, np.nan, 70000.0]
    a, underflow = x.copy(), Underflow()
    with np.errstate(over="ignore", invalid="ignore"):  # as the Trainer runs every step
        round_in_place(a, underflow, 7)()
    want = cast(x)
    np.testing.assert_array_equal(a, want)  # NaN equals NaN here
    lost, total = underflow.counts[7]
    assert total == x.size
    assert lost == np.count_nonzero((x != 0) & (want == 0) & ~np.isnan(x))


@pytest.mark.parametrize("n", [SMALL // 8, SMALL * 4])
@pytest.mark.parametrize("special", [False, True])
def test_narrowing_stores_the_float16_cast(n, special):
    x = values(n)
    x[-2:] = [0.0, -0.0]
    if special:
        x[:4] = [np.inf, -np.inf, np.nan, -70000.0]
    dst, underflow = np.empty(x.shape, np.float16), Underflow()
    with np.errstate(over="ignore", invalid="ignore"):
        narrow(x.copy(), dst, underflow, 2)()
        want = x.astype(np.float16)
    np.testing.assert_array_equal(dst, want)
    np.testing.assert_array_equal(np.signbit(dst), np.signbit(want))
    assert underflow.counts[2] == [np.count_nonzero((x != 0) & (want == 0) & ~np.isnan(x)),
                                   x.size]


# float32 bit patterns where rounding to fp16 changes behaviour: zeros, float32
# subnormals, 2^-25 (a tie that rounds to 0) and its neighbours, fp16's smallest
# subnormal and normal, ties in both ranges, the largest fp16 (65504), the last
# value rounding to it and 65520 (a tie rounding to inf), inf and NaNs
EDGES = np.array([0, 1, 0x007FFFFF, 0x00800000, 0x32FFFFFF, 0x33000000, 0x33000001, 0x33800000,
                  0x33C00000, 0x34400000, 0x387FC000, 0x387FDFFF, 0x387FE000, 0x387FFFFF,
                  0x38800000, 0x38801000, 0x38803000, 0x3F801000, 0x3F803000, 0x3F800FFF,
                  0x3F801001, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,
                  0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF], np.uint32)


def patterns(stride: int, offset: int) -> np.ndarray:
    """Every `stride`-th float32 bit pattern from `offset`, both signs, plus EDGES."""
    bits = np.arange(offset, 1 << 31, stride, dtype=np.uint32)
    bits = np.concatenate([bits, EDGES])
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


def check_stores(x: np.ndarray, chunk: int) -> None:
    """narrow() and round_in_place() on `chunk` elements at a time equal numpy's
    cast bit for bit (a NaN: any NaN), and count underflow exactly."""
    with np.errstate(all="ignore"):
        want = x.astype(np.float16)
    lost = (x != 0) & (want == 0) & ~np.isnan(x)
    for lo in range(0, x.size, chunk):
        part, expect = x[lo:lo + chunk], want[lo:lo + chunk]
        dst, in_place, underflow = np.empty(part.shape, np.float16), part.copy(), Underflow()
        with np.errstate(over="ignore", invalid="ignore"):
            narrow(part.copy(), dst, underflow, 1)()
            round_in_place(in_place, underflow, 2)()
        finite = ~np.isnan(expect)
        assert np.array_equal(dst.view(np.uint16)[finite], expect.view(np.uint16)[finite])
        assert np.isnan(dst[~finite]).all()
        wide = expect.astype(np.float32)
        assert np.array_equal(in_place.view(np.uint32)[finite], wide.view(np.uint32)[finite])
        assert np.isnan(in_place[~finite]).all()
        n = int(np.count_nonzero(lost[lo:lo + chunk]))
        assert underflow.counts[1] == underflow.counts[2] == [n, part.size]


@pytest.mark.parametrize("chunk", [CHUNK * 2 + 17, SMALL - 1, 700])
def test_strided_sweep_of_every_float32_equals_the_cast(chunk):
    """Large arrays take the arithmetic passes; small ones numpy's cast or the
    passes, by how many values lie below fp16's normals (mixed here)."""
    check_stores(patterns(4099, chunk % 4099), chunk)


def test_small_arrays_with_a_few_values_below_normal_take_the_cast():
    x = (RNG.standard_normal(3000) * 4).astype(np.float32)
    x[::300] = [1e-8, -3e-8, 2.0 ** -25, -(2.0 ** -25), 1e-6, 2.0 ** -24, 0.0, -0.0, 1e-30, 6e-5]
    check_stores(x, x.size)


def test_a_small_store_stays_exact_when_its_values_change_between_calls():
    """Small arrays choose numpy's cast or the passes from their values every few
    calls and keep the choice in between: it must be exact either way."""
    normal = (RNG.standard_normal(2000) * 4).astype(np.float32)
    tiny = (normal * 1e-6).astype(np.float32)
    src, dst, in_place = np.empty_like(normal), np.empty(normal.shape, np.float16), \
        np.empty_like(normal)
    underflow = Underflow()
    store, rounding = narrow(src, dst, underflow, 1), round_in_place(in_place, underflow, 2)
    for x in [normal, tiny, tiny, normal] * 5:
        underflow.counts = {}
        src[...] = in_place[...] = x
        with np.errstate(all="ignore"):
            store()
            rounding()
            want = x.astype(np.float16)
        assert np.array_equal(dst.view(np.uint16), want.view(np.uint16))
        assert np.array_equal(in_place.view(np.uint32), want.astype(np.float32).view(np.uint32))
        lost = np.count_nonzero((x != 0) & (want == 0))
        assert underflow.counts[1] == underflow.counts[2] == [lost, x.size]


@pytest.mark.parametrize("sizes", [(5, 3000, 40), (CHUNK - 3, 10, CHUNK + 7, 1)])
def test_rounding_several_tensors_at_once_counts_each(sizes):
    """Weight gradients adjacent in the gradient vector are rounded in one go
    (chunks holding parts of several tensors), with underflow counted per tensor."""
    x = values(sum(sizes))[:sum(sizes)]
    ends = np.cumsum(sizes)
    spans = [(10 + i, int(end - size), int(end)) for i, (size, end) in enumerate(zip(sizes, ends))]
    a, underflow = x.copy(), Underflow()
    with np.errstate(over="ignore", invalid="ignore"):
        round_spans(a, spans, underflow)()
    np.testing.assert_array_equal(a, cast(x))
    assert np.array_equal(np.signbit(a), np.signbit(cast(x)))
    for t, lo, hi in spans:
        part, want = x[lo:hi], cast(x[lo:hi])
        assert underflow.counts[t] == [np.count_nonzero((part != 0) & (want == 0) & ~np.isnan(part)),
                                       hi - lo]


@pytest.mark.parametrize("finite", [False, True])
def test_widening_is_exact_for_every_float16(finite):
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    if finite:  # the fast path (inf/NaN take numpy's cast)
        every = every[np.isfinite(every)]
    wide = np.empty(every.shape, np.float32)
    widen(every, wide)()
    want = every.astype(np.float32)
    np.testing.assert_array_equal(wide, want)
    np.testing.assert_array_equal(np.signbit(wide), np.signbit(want))
    assert np.array_equal(wide.view(np.uint32)[np.isfinite(want)],
                          want.view(np.uint32)[np.isfinite(want)])


def test_underflow_report_separates_weights_from_activation_gradients():
    underflow = Underflow()
    underflow.add(4, 3, 10)
    underflow.add(-2, 5, 10)
    report = underflow.take()
    assert report == {"weights": 0.3, "all": 0.4, "by_tensor": {4: 0.3}}
    assert underflow.take()["all"] == 0.0
