"""Upsampling kernels: RESIZE_BILINEAR, RESIZE_NEAREST_NEIGHBOR, TRANSPOSE_CONV
and MediaPipe's Convolution2DTransposeBias.  Forward against the TFLite
interpreter (float32) and PyTorch; gradients against central finite
differences and PyTorch autograd in float64."""
import numpy as np
import pytest
import torch

from kernel_check import numeric_grad, run
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import options_dict, set_custom_options
from tflite_op import tflite_run
from torch_reference import _resize, transpose_conv

rng = np.random.default_rng(17)
SIZES = [(4, 5, 8, 10), (5, 3, 7, 8), (8, 6, 3, 4), (1, 4, 3, 2), (3, 3, 3, 3)]
MODES = [dict(align_corners=False, half_pixel_centers=False),
         dict(align_corners=True, half_pixel_centers=False),
         dict(align_corners=False, half_pixel_centers=True)]
GRADS = {"RESIZE_BILINEAR": "ResizeBilinearGrad",
         "RESIZE_NEAREST_NEIGHBOR": "ResizeNearestNeighborGrad"}


def torch_vjp(f, xs, dy):
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    f(*ts).backward(torch.tensor(dy))
    return [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("mode", MODES, ids=["legacy", "align_corners", "half_pixel"])
@pytest.mark.parametrize("h, w, oh, ow", SIZES)
@pytest.mark.parametrize("op", GRADS)
def test_resize_matches_tflite_and_its_grad_finite_differences(op, h, w, oh, ow, mode):
    x, size = rng.normal(size=(2, h, w, 3)).astype(np.float32), np.array([oh, ow], np.int32)
    want = tflite_run(op, [x, size], [(2, oh, ow, 3)], constant=(1,), **mode)[0]
    got = run(op, [x, size], [want.shape], np.float32, **mode)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # nearest: exactly
    x64, dy = x.astype(np.float64), rng.normal(size=want.shape)
    (dx,) = run(GRADS[op], [dy], [x.shape], **mode)
    resize = lambda v: run(op, [v, size], [want.shape], **mode)[0]  # noqa: E731
    np.testing.assert_allclose(dx, numeric_grad(resize, x64, dy), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", MODES[1:], ids=["align_corners", "half_pixel"])
@pytest.mark.parametrize("op", GRADS)
def test_resize_grad_matches_torch(op, mode):
    if op == "RESIZE_NEAREST_NEIGHBOR" and mode["align_corners"]:
        mode = MODES[0]  # torch has no rounding nearest neighbour
    x = rng.normal(size=(2, 5, 4, 3))
    dy = rng.normal(size=(2, 9, 7, 3))
    (dx,) = run(GRADS[op], [dy], [x.shape], **mode)
    want = torch_vjp(lambda t: _resize(t, (9, 7), op, mode), [x], dy)[0]
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=5e-6)  # positions: float32 vs float64


# (h, w, kernel, stride, padding, H, W): SAME and VALID, an output taps do not fully reach
TCONV = [(3, 4, 3, 2, 0, 6, 8), (3, 4, 3, 2, 1, 7, 9), (4, 4, 4, 2, 0, 8, 8),
         (3, 3, 2, 2, 0, 6, 6), (3, 3, 3, 1, 0, 3, 3), (2, 3, 3, 2, 0, 3, 5)]


def _tconv_case(h, w, k, s, padding, big_h, big_w):
    x = rng.normal(size=(2, h, w, 3)).astype(np.float32)
    weights = rng.normal(size=(5, k, k, 3)).astype(np.float32)
    bias = rng.normal(size=5).astype(np.float32)
    return x, weights, bias, (2, big_h, big_w, 5), dict(padding=padding, stride_w=s, stride_h=s)


@pytest.mark.parametrize("case", TCONV)
def test_transpose_conv_matches_tflite_and_torch(case):
    x, weights, bias, shape, opts = _tconv_case(*case)
    inputs = [np.array(shape, np.int32), weights, x, bias]
    want = tflite_run("TRANSPOSE_CONV", inputs, [shape], constant=(0, 1, 3), **opts)[0]
    np.testing.assert_allclose(run("TRANSPOSE_CONV", inputs, [shape], np.float32, **opts)[0],
                               want, rtol=1e-5, atol=1e-5)
    mediapipe = run("Convolution2DTransposeBias", [x, weights, bias], [shape], np.float32, **opts)[0]
    np.testing.assert_array_equal(mediapipe, run("TRANSPOSE_CONV", inputs, [shape], np.float32,
                                                 **opts)[0])
    reference = transpose_conv(*(torch.tensor(a, dtype=torch.float64) for a in (x, weights, bias)),
                               shape[1:3], opts)
    np.testing.assert_allclose(want, reference.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", TCONV)
def test_transpose_conv_grads(case):
    x, weights, bias, shape, opts = (a.astype(np.float64) if isinstance(a, np.ndarray) else a
                                     for a in _tconv_case(*case))
    dy = rng.normal(size=shape)
    (dx,) = run("TransposeConvInputGrad", [dy, weights], [x.shape], **opts)
    (dw,) = run("TransposeConvWeightGrad", [dy, x], [weights.shape], **opts)

    def forward(x_, w_):
        return run("TRANSPOSE_CONV", [None, w_, x_, None], [shape], **opts)[0]
    np.testing.assert_allclose(dx, numeric_grad(lambda v: forward(v, weights), x, dy), rtol=1e-6,
                               atol=1e-8)
    np.testing.assert_allclose(dw, numeric_grad(lambda v: forward(x, v), weights, dy), rtol=1e-6,
                               atol=1e-8)
    want_dx, want_dw = torch_vjp(lambda a, b: transpose_conv(a, b, None, shape[1:3], opts),
                                 [x, weights], dy)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-12, atol=1e-12)


def test_mediapipe_transpose_conv_options_are_its_c_struct():
    op = circle.OperatorT()
    op.customOptions = np.frombuffer(bytes.fromhex("010000000200000003000000"), np.uint8)
    options = options_dict(op, "Convolution2DTransposeBias")
    assert options == {"padding": circle.Padding.SAME, "stride_w": 2, "stride_h": 3}
    set_custom_options(op, dict(options, padding=circle.Padding.VALID), "Convolution2DTransposeBias")
    assert bytes(op.customOptions).hex() == "020000000200000003000000"
