"""fp16 storage: the runtime's rounding and its float32 -> float16 stores equal
numpy's float16 cast exactly (ties to even, subnormals, overflow, inf, NaN, signed
zeros), underflow is counted exactly, and widening float16 back is exact for every
float16 bit pattern."""
import numpy as np
import pytest

from microtrain.precision import SMALL, Underflow, narrow, round_in_place, widen

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
