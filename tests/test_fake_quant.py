"""Fake-quantization kernels: forward against LiteRT's FAKE_QUANT and torch's
fake_quantize_*_affine, straight-through gradients against torch's autograd."""
import numpy as np
import pytest
import torch

from kernel_check import run
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.step.kernels.fake_quant import (levels_problem, nudged_range, range_of,
                                                scale_zero_point)
from microtrain.step.precision import widen
from microtrain.files.quantization import Quantization
from tflite_op import tflite_run

RANGES = [(-1.3, 2.1), (0.0, 6.0), (-0.4, 0.0), (0.3, 5.0)]  # the last nudged to include 0


def _torch_per_tensor(x: np.ndarray, lo: float, hi: float):
    scale, nmin, low, high = nudged_range(lo, hi)
    zero = int(round(low - nmin / scale))
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = torch.fake_quantize_per_tensor_affine(t, scale, zero, low, high)
    return t, y


@pytest.mark.parametrize("lo,hi", RANGES)
def test_fake_quant_forward_matches_litert_and_torch(lo, hi):
    x = np.random.default_rng(1).uniform(-3, 7, (4, 5, 6)).astype(np.float32)
    (ours,) = run("FAKE_QUANT", [x], [x.shape], np.float32, min=lo, max=hi, num_bits=8)
    (litert,) = tflite_run("FAKE_QUANT", [x], [x.shape], min=lo, max=hi, num_bits=8)
    np.testing.assert_allclose(ours, litert, atol=1e-6)
    _, y = _torch_per_tensor(x, lo, hi)
    np.testing.assert_allclose(ours, y.detach().numpy(), atol=1e-6)


@pytest.mark.parametrize("lo,hi", RANGES)
def test_fake_quant_gradient_is_torch_straight_through(lo, hi):
    rng = np.random.default_rng(2)
    x, dy = rng.uniform(-3, 7, (3, 40)), rng.standard_normal((3, 40))
    t, y = _torch_per_tensor(x, lo, hi)
    y.backward(torch.tensor(dy))
    (dx,) = run("FakeQuantGrad", [dy, x], [x.shape], min=lo, max=hi, num_bits=8)
    np.testing.assert_array_equal(dx, t.grad.numpy())
    assert 0 < np.count_nonzero(dx) < dx.size  # some inside the range, some clamped


@pytest.mark.parametrize("lo,hi", RANGES + [(-0.0123 * 111, 0.0123 * 144)])  # a model's grid
def test_int8_levels_hold_the_float_kernels_values(lo, hi):
    """A FAKE_QUANT writing int8 stores the levels of LiteRT's values on the grid
    it declares, and widening them gives the float kernel's values, to the bit."""
    x = np.random.default_rng(5).uniform(-3, 7, (4, 5, 60)).astype(np.float32)
    x[0, 0, :3] = [lo, hi, 0.0]  # the range's ends and zero
    scale, zero = scale_zero_point(lo, hi)
    (values,) = run("FAKE_QUANT", [x], [x.shape], np.float32, min=lo, max=hi, num_bits=8)
    (levels,) = run("FAKE_QUANT", [x], [x.shape], np.int8, min=lo, max=hi, num_bits=8)
    (litert,) = tflite_run("FAKE_QUANT", [x], [x.shape], min=lo, max=hi, num_bits=8)
    np.testing.assert_array_equal(levels, np.round(litert / scale) + zero)
    assert levels.min() == -128 and levels.max() == 127  # both clamped ends are stored
    assert_widens_to(levels, values, Quantization(scale, zero), "FAKE_QUANT")


def assert_widens_to(levels: np.ndarray, values: np.ndarray, grid: Quantization, writer: str):
    """precision.widen of the int8 `levels` of a tensor `writer` wrote on `grid`
    gives the float32 `values`, to the bit (but a −0.0, which a level cannot
    hold: a weight rounded to zero from below, widened to +0.0)."""
    tensor = Tensor(0, "y", levels.shape, levels.dtype, quantization=grid, fake_quant=writer)
    widened = np.full(levels.shape, np.nan, np.float32)
    widen(levels, widened, tensor)()
    np.testing.assert_array_equal(widened.view(np.uint32), (values + 0.0).view(np.uint32))


@pytest.mark.parametrize("axis", [0, 3])
def test_per_channel_int8_levels_hold_the_float_kernels_values(axis):
    """FakeQuantPerChannel writing int8 stores round(W/s) clamped to ±127 (torch's
    levels), which widen to its float32 output, to the bit."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 3, 3, 5)).astype(np.float32)
    scales = (np.abs(w).max(axis=tuple(a for a in range(4) if a != axis)) / 160).astype(np.float32)
    (values,) = run("FakeQuantPerChannel", [w, scales], [w.shape], np.float32, axis=axis)
    (levels,) = run("FakeQuantPerChannel", [w, scales], [w.shape], np.int8, axis=axis)
    shape = [1] * 4
    shape[axis] = len(scales)
    torch_values = torch.fake_quantize_per_channel_affine(
        torch.tensor(w), torch.tensor(scales), torch.zeros(len(scales), dtype=torch.int32), axis,
        -127, 127).numpy()
    want = np.round(torch_values / scales.reshape(shape))
    np.testing.assert_array_equal(levels, want)
    assert np.abs(levels).max() == 127  # some clamped
    assert_widens_to(levels, values, Quantization(scales, 0, axis), "FakeQuantPerChannel")


def _stored(scale: float, zero: int, **options) -> tuple[Graph, Op]:
    """A graph of one FAKE_QUANT storing its output as int8 of grid (scale, zero)."""
    x = Tensor(0, "x", (-1, 4), np.dtype(np.float32))
    y = Tensor(1, "y", (-1, 4), np.dtype(np.int8), quantization=Quantization(scale, zero),
               fake_quant="FAKE_QUANT")
    op = Op(0, "FAKE_QUANT", [0], [1], {"min": -1.0, "max": 2.0, "num_bits": 8, **options})
    return Graph([x, y], [op], [0], [1]), op


def _stored_weight(scales, zero: int = 0, axis: int = 0, **options) -> tuple[Graph, Op]:
    """A graph of one FakeQuantPerChannel storing a [2, 3] weight as int8."""
    w = Tensor(0, "w", (2, 3), np.dtype(np.float32))
    s = Tensor(1, "s", (2,), np.dtype(np.float32), np.float32([0.5, 0.25]))
    y = Tensor(2, "y", (2, 3), np.dtype(np.int8), quantization=Quantization(scales, zero, axis),
               fake_quant="FakeQuantPerChannel")
    op = Op(0, "FakeQuantPerChannel", [0, 1], [2], {"axis": 0, "num_bits": 8, **options})
    return Graph([w, s, y], [op], [0], [2]), op


def test_int8_levels_must_declare_their_grid():
    scale, zero = scale_zero_point(-1.0, 2.0)
    assert levels_problem(*_stored(scale, zero)) is None
    assert levels_problem(*_stored_weight([0.5, 0.25])) is None
    for problem in (_stored(scale, zero + 1), _stored(scale * 1.001, zero),
                    _stored(scale, zero, narrow_range=True), _stored_weight([0.5, 0.5]),
                    _stored_weight([0.5, 0.25], zero=1), _stored_weight([0.5, 0.25], axis=1),
                    _stored_weight([0.5, 0.25], num_bits=32)):
        assert "stores tensor" in levels_problem(*problem) and "as int8" in levels_problem(*problem)


def test_scale_and_zero_point_round_trip():
    scale, zero = 0.0123, -17
    assert scale_zero_point(*range_of(scale, zero)) == (pytest.approx(scale, rel=1e-6), zero)


@pytest.mark.parametrize("axis", [0, 3])
def test_per_channel_forward_and_gradient_match_torch(axis):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3, 3, 5)).astype(np.float32)
    channels = w.shape[axis]
    # ranges smaller than the weights' so that some are clamped
    scales = (np.abs(w).max(axis=tuple(a for a in range(4) if a != axis)) / 160).astype(np.float32)
    dy = rng.standard_normal(w.shape).astype(np.float32)
    t = torch.tensor(w, requires_grad=True)
    y = torch.fake_quantize_per_channel_affine(t, torch.tensor(scales),
                                               torch.zeros(channels, dtype=torch.int32), axis,
                                               -127, 127)
    y.backward(torch.tensor(dy))
    (ours,) = run("FakeQuantPerChannel", [w, scales], [w.shape], np.float32, axis=axis)
    np.testing.assert_allclose(ours, y.detach().numpy(), rtol=1e-6, atol=1e-7)
    (dw,) = run("FakeQuantPerChannelGrad", [dy, w, scales], [w.shape], axis=axis)
    np.testing.assert_array_equal(dw, t.grad.numpy())
    assert 0 < np.count_nonzero(dw) < dw.size


def test_qas_off_scales_the_gradient_by_the_squared_scale():
    rng = np.random.default_rng(4)
    w, dy = rng.standard_normal((6, 8)), rng.standard_normal((6, 8))
    scales = np.abs(w).max(axis=1) / 127
    (on,) = run("FakeQuantPerChannelGrad", [dy, w, scales], [w.shape], axis=0, qas=True)
    (off,) = run("FakeQuantPerChannelGrad", [dy, w, scales], [w.shape], axis=0, qas=False)
    np.testing.assert_allclose(off, on * (scales ** 2)[:, None])
    assert not np.allclose(off, on)


def test_bias_grid_holds_32_bit_levels():
    scales = np.array([1e-6, 3e-5])
    b = np.array([[0.7, -12.3]])
    (q,) = run("FakeQuantPerChannel", [b, scales], [b.shape], axis=1, num_bits=32)
    np.testing.assert_allclose(q, np.round(b / scales) * scales)


@pytest.mark.parametrize("axis", [0, 3])
def test_tracked_scales_follow_the_weight_as_torch_with_its_detached_max(axis):
    """Without a scales input, each channel's scale is max|W|/127 of W: torch's
    per-channel fake quantization with those scales as constants, whose
    straight-through gradient then passes everywhere (nothing can clamp)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 3, 5)).astype(np.float32)
    w[(slice(None),) * axis + (1,)] = 0  # an all-zero channel: scale 1
    dy = rng.standard_normal(w.shape).astype(np.float32)
    t = torch.tensor(w, requires_grad=True)
    peak = t.detach().abs().amax(dim=[d for d in range(4) if d != axis])
    scales = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
    zeros = torch.zeros(len(scales), dtype=torch.int32)
    y = torch.fake_quantize_per_channel_affine(t, scales, zeros, axis, -127, 127)
    y.backward(torch.tensor(dy))
    (ours,) = run("FakeQuantPerChannel", [w], [w.shape], np.float32, axis=axis)
    np.testing.assert_allclose(ours, y.detach().numpy(), rtol=1e-6, atol=1e-7)
    (dw,) = run("FakeQuantPerChannelGrad", [dy, w], [w.shape], axis=axis)
    np.testing.assert_array_equal(dw, t.grad.numpy())
    np.testing.assert_array_equal(dw, dy)
    (off,) = run("FakeQuantPerChannelGrad", [dy, w], [w.shape], axis=axis, qas=False)
    np.testing.assert_allclose(off, dy * scales.numpy().astype(np.float64).reshape(
        [-1 if d == axis else 1 for d in range(4)]) ** 2, rtol=1e-6)


def test_a_weight_past_its_fixed_grid_clamps_where_tracked_scales_follow_it():
    w = np.array([[0.5, -1.0, 1.6]])  # the scales were set when max|w| was 1.0
    fixed = np.array([1.0 / 127])
    (clamped,) = run("FakeQuantPerChannel", [w, fixed], [w.shape], axis=0)
    (followed,) = run("FakeQuantPerChannel", [w], [w.shape], axis=0)
    np.testing.assert_allclose(clamped[0, 2], 1.0)
    np.testing.assert_allclose(followed[0, 2], 1.6)
    dy = np.ones_like(w)
    (stopped,) = run("FakeQuantPerChannelGrad", [dy, w, fixed], [w.shape], axis=0)
    (passed,) = run("FakeQuantPerChannelGrad", [dy, w], [w.shape], axis=0)
    np.testing.assert_array_equal(stopped, [[1, 1, 0]])
    np.testing.assert_array_equal(passed, [[1, 1, 1]])
