"""fp16 round-on-store: the runtime's rounding equals numpy's float16 cast exactly
(ties to even, subnormals, overflow, inf, NaN), and underflow is counted exactly."""
import numpy as np
import pytest

from microtrain.precision import SMALL, Underflow, rounder

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
        rounder(a, underflow, 7)()
    want = cast(x)
    np.testing.assert_array_equal(a, want)  # NaN equals NaN here
    lost, total = underflow.counts[7]
    assert total == x.size
    assert lost == np.count_nonzero((x != 0) & (want == 0) & ~np.isnan(x))


def test_underflow_report_separates_weights_from_activation_gradients():
    underflow = Underflow()
    underflow.add(4, 3, 10)
    underflow.add(-2, 5, 10)
    report = underflow.take()
    assert report == {"weights": 0.3, "all": 0.4, "by_tensor": {4: 0.3}}
    assert underflow.take()["all"] == 0.0
