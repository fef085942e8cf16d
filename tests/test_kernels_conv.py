"""Convolution and pooling kernels against PyTorch (forward and autograd) and
central finite differences, in float64, on random shapes."""
import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_check import numeric_grad, run
from microtrain.files.errors import OperatorError
from microtrain.step.kernels import build

SAME, VALID = 0, 1
ACTIVATIONS = {0: lambda t: t, 1: torch.relu, 2: lambda t: t.clamp(-1, 1),
               3: lambda t: t.clamp(0, 6), 4: torch.tanh}


def _axis(size, k, stride, dilation, padding):
    """Output size and (before, after) padding of one axis, TFLite rules."""
    span = (k - 1) * dilation + 1
    if padding == VALID:
        return (size - span) // stride + 1, (0, 0)
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + span - size, 0)
    return out, (total // 2, total - total // 2)


@dataclass
class Case:
    """Geometry of one conv/pool: input [n, h, w, c], kernel kh x kw, and
    `mult` (output channels for CONV_2D, depth multiplier for depthwise)."""
    n: int
    h: int
    w: int
    c: int
    kh: int
    kw: int
    sh: int = 1
    sw: int = 1
    dh: int = 1
    dw: int = 1
    padding: int = SAME
    mult: int = 1

    def __str__(self):
        pad = "SAME" if self.padding == SAME else "VALID"
        return (f"{self.n}x{self.h}x{self.w}x{self.c}-k{self.kh}x{self.kw}-s{self.sh}{self.sw}"
                f"-d{self.dh}{self.dw}-{pad}-m{self.mult}")

    def out_hw(self):
        return (_axis(self.h, self.kh, self.sh, self.dh, self.padding)[0],
                _axis(self.w, self.kw, self.sw, self.dw, self.padding)[0])

    def torch_pad(self, t, value=0.0):
        """Pad an NCHW tensor as TFLite would (asymmetric for SAME)."""
        top, bottom = _axis(self.h, self.kh, self.sh, self.dh, self.padding)[1]
        left, right = _axis(self.w, self.kw, self.sw, self.dw, self.padding)[1]
        return F.pad(t, (left, right, top, bottom), value=value)

    def conv_opts(self):
        return dict(padding=self.padding, stride_h=self.sh, stride_w=self.sw,
                    dilation_h_factor=self.dh, dilation_w_factor=self.dw,
                    depth_multiplier=self.mult)

    def pool_opts(self):
        return dict(padding=self.padding, stride_h=self.sh, stride_w=self.sw,
                    filter_height=self.kh, filter_width=self.kw)


def conv_shapes(case, depthwise):
    """Shapes of x, w, b, y."""
    oh, ow = case.out_hw()
    out_c = case.c * case.mult if depthwise else case.mult
    w = (1, case.kh, case.kw, out_c) if depthwise else (out_c, case.kh, case.kw, case.c)
    return (case.n, case.h, case.w, case.c), w, (out_c,), (case.n, oh, ow, out_c)


def pool_out_shape(case):
    return (case.n, *case.out_hw(), case.c)


def torch_conv(case, depthwise, x, w, b=None):
    """TFLite-layout conv via torch: x NHWC, w [O,KH,KW,C] or [1,KH,KW,C*M]."""
    weight = w.permute(3, 0, 1, 2) if depthwise else w.permute(0, 3, 1, 2)
    y = F.conv2d(case.torch_pad(x.permute(0, 3, 1, 2)), weight, b, stride=(case.sh, case.sw),
                 dilation=(case.dh, case.dw), groups=case.c if depthwise else 1)
    return y.permute(0, 2, 3, 1)


def torch_pool(case, kind, x):
    """Max pool ignoring padding, or average over the non-padded pixels."""
    xt, size, stride = x.permute(0, 3, 1, 2), (case.kh, case.kw), (case.sh, case.sw)
    if kind == "MAX":
        y = F.max_pool2d(case.torch_pad(xt, -math.inf), size, stride)
    else:
        total = F.avg_pool2d(case.torch_pad(xt), size, stride, divisor_override=1)
        count = F.avg_pool2d(case.torch_pad(torch.ones_like(xt[:1, :1])), size, stride,
                             divisor_override=1)
        y = total / count
    return y.permute(0, 2, 3, 1)


def tensor(a, grad=False):
    return torch.from_numpy(np.array(a)).requires_grad_(grad)


def forward_cases(seed):
    """Every stride x dilation x padding combination; sizes odd and even,
    kernels square, oblong and 1x1, multipliers 1-3."""
    rng = np.random.default_rng(seed)
    kernels = [(3, 3), (2, 3), (3, 1), (1, 1)]
    cases = []
    for i, (s, d, padding) in enumerate(itertools.product((1, 2, 3), (1, 2), (SAME, VALID))):
        kh, kw = kernels[i % 4]
        cases.append(Case(n=int(rng.integers(1, 4)), h=5 + i % 4, w=9 - i % 3,
                          c=int(rng.integers(1, 5)), kh=kh, kw=kw, sh=s, sw=s % 3 + 1,
                          dh=d, dw=3 - d, padding=padding, mult=1 + i % 3))
    # 1x1 with stride 1 takes the single-matmul path; 8 channels the strided-copy gather.
    cases.append(Case(n=2, h=4, w=3, c=3, kh=1, kw=1, mult=2))
    cases.append(Case(n=2, h=6, w=5, c=8, kh=3, kw=3, sh=2, padding=SAME, mult=2))
    return cases


@pytest.mark.parametrize("depthwise", [False, True], ids=["conv", "depthwise"])
@pytest.mark.parametrize("index, case", list(enumerate(forward_cases(1))), ids=str)
def test_conv_forward_matches_torch(index, case, depthwise):
    rng = np.random.default_rng(index)
    xs, ws, bs, ys = conv_shapes(case, depthwise)
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(bs)
    inputs = [[x, w, b], [x, w, None], [x, w]][index % 3]  # bias given, None, left off
    act = index % 5
    name = "DEPTHWISE_CONV_2D" if depthwise else "CONV_2D"
    (got,) = run(name, inputs, [ys], fused_activation_function=act, **case.conv_opts())
    want = ACTIVATIONS[act](torch_conv(case, depthwise, tensor(x), tensor(w),
                                       tensor(b) if index % 3 == 0 else None))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-10)


def pool_cases():
    """Pooling windows that overlap, tile, leave gaps; SAME and VALID."""
    return [Case(2, 6, 7, 3, 3, 3, 2, 2, padding=SAME),   # overlap, asymmetric padding
            Case(2, 5, 5, 2, 3, 2, 1, 1, padding=SAME),   # heavy overlap
            Case(1, 8, 6, 2, 2, 2, 2, 2, padding=VALID),  # tiles
            Case(2, 7, 8, 1, 2, 3, 3, 2, padding=VALID),  # gaps and overlap
            Case(3, 5, 6, 2, 3, 3, 3, 3, padding=SAME)]


@pytest.mark.parametrize("kind", ["MAX", "AVERAGE"])
@pytest.mark.parametrize("index, case", list(enumerate(pool_cases())), ids=str)
def test_pool_forward_matches_torch(index, case, kind):
    x = np.random.default_rng(index).standard_normal((case.n, case.h, case.w, case.c)) * 3
    for act in ACTIVATIONS:
        (got,) = run(f"{kind}_POOL_2D", [x], [pool_out_shape(case)],
                     fused_activation_function=act, **case.pool_opts())
        want = ACTIVATIONS[act](torch_pool(case, kind, tensor(x)))
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-10)


def check_gradient(name, grad_inputs, target, forward, torch_forward, **opts):
    """Gradient kernel `name` against finite differences of the forward kernel
    and against torch autograd, both taken at `target`."""
    dy = grad_inputs[0]
    (got,) = run(name, grad_inputs, [target.shape], **opts)
    np.testing.assert_allclose(got, numeric_grad(forward, target, dy), rtol=1e-6, atol=1e-7)
    t = tensor(target, grad=True)
    (torch_forward(t) * tensor(dy)).sum().backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-12)


GRAD_CASES = [Case(2, 5, 4, 2, 3, 3, mult=2),
              Case(2, 6, 7, 2, 3, 2, 2, 2, padding=SAME, mult=3),  # asymmetric SAME padding
              Case(1, 7, 6, 3, 2, 3, 2, 3, 2, 1, padding=VALID, mult=1),
              Case(2, 5, 5, 1, 3, 3, 1, 2, 2, 2, padding=SAME, mult=2),
              Case(2, 4, 3, 2, 1, 1, mult=3),  # single-matmul path
              Case(1, 5, 6, 2, 1, 1, 2, 2, padding=VALID, mult=2),
              Case(1, 5, 4, 6, 2, 2, padding=VALID, mult=2)]  # strided-copy gather


@pytest.mark.parametrize("depthwise", [False, True], ids=["conv", "depthwise"])
@pytest.mark.parametrize("index, case", list(enumerate(GRAD_CASES)), ids=str)
def test_conv_gradients(index, case, depthwise):
    rng = np.random.default_rng(index)
    xs, ws, _, ys = conv_shapes(case, depthwise)
    x, w, dy = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ys)
    forward, grad = (("DEPTHWISE_CONV_2D", "DepthwiseConv2D") if depthwise
                     else ("CONV_2D", "Conv2D"))
    opts = case.conv_opts()
    check_gradient(f"{grad}InputGrad", [dy, w], x,
                   lambda v: run(forward, [v, w, None], [ys], **opts)[0],
                   lambda t: torch_conv(case, depthwise, t, tensor(w)), **opts)
    check_gradient(f"{grad}WeightGrad", [dy, x], w,
                   lambda v: run(forward, [x, v, None], [ys], **opts)[0],
                   lambda t: torch_conv(case, depthwise, tensor(x), t), **opts)


@pytest.mark.parametrize("kind", ["MAX", "AVERAGE"])
@pytest.mark.parametrize("index, case", list(enumerate(pool_cases())), ids=str)
def test_pool_gradients(index, case, kind):
    rng = np.random.default_rng(index)
    x = rng.standard_normal((case.n, case.h, case.w, case.c))
    dy = rng.standard_normal(pool_out_shape(case))
    opts = case.pool_opts()
    inputs = [dy, x] if kind == "MAX" else [dy]
    check_gradient(f"{kind.title()}Pool2DGrad", inputs, x,
                   lambda v: run(f"{kind}_POOL_2D", [v], [dy.shape], **opts)[0],
                   lambda t: torch_pool(case, kind, t), **opts)


def test_max_pool_grad_ties_go_to_first_maximum():
    # Equal values everywhere: each window's gradient lands on its top-left pixel.
    case = Case(1, 4, 6, 2, 2, 3, 2, 3, padding=VALID)
    dy = np.arange(1.0, 9.0).reshape(pool_out_shape(case))
    (dx,) = run("MaxPool2DGrad", [dy, np.zeros((1, 4, 6, 2))], [(1, 4, 6, 2)],
                **case.pool_opts())
    want = np.zeros((1, 4, 6, 2))
    want[:, ::2, ::3] = dy
    np.testing.assert_array_equal(dx, want)


def test_output_size_mismatch_is_rejected():
    with pytest.raises(OperatorError, match="output size"):
        run("CONV_2D", [np.zeros((1, 5, 5, 1)), np.zeros((2, 3, 3, 1)), None],
            [(1, 5, 5, 2)], padding=VALID)


def smoke_specs():
    """name -> (input shape keys, output shape key, options) on one geometry."""
    case = Case(2, 7, 6, 3, 3, 3, 2, 2, padding=SAME, mult=2)
    xs, ws, bs, ys = conv_shapes(case, False)
    _, wds, bds, yds = conv_shapes(case, True)
    shapes = dict(x=xs, w=ws, b=bs, y=ys, wd=wds, bd=bds, yd=yds, yp=pool_out_shape(case))
    conv = dict(case.conv_opts(), fused_activation_function=1)
    pool = dict(case.pool_opts(), fused_activation_function=1)
    specs = {"CONV_2D": (["x", "w", "b"], "y", conv),
             "Conv2DInputGrad": (["y", "w"], "x", conv),
             "Conv2DWeightGrad": (["y", "x"], "w", conv),
             "DEPTHWISE_CONV_2D": (["x", "wd", "bd"], "yd", conv),
             "DepthwiseConv2DInputGrad": (["yd", "wd"], "x", conv),
             "DepthwiseConv2DWeightGrad": (["yd", "x"], "wd", conv),
             "MAX_POOL_2D": (["x"], "yp", pool),
             "AVERAGE_POOL_2D": (["x"], "yp", pool),
             "MaxPool2DGrad": (["yp", "x"], "x", pool),
             "AveragePool2DGrad": (["yp"], "x", pool)}
    return shapes, specs


SHAPES, SPECS = smoke_specs()


@pytest.mark.parametrize("name", SPECS)
def test_float32_and_fresh_inputs_each_call(name):
    keys, out_key, opts = SPECS[name]
    rng = np.random.default_rng(0)
    inputs = [np.empty(SHAPES[k], np.float32) for k in keys]
    out = np.empty(SHAPES[out_key], np.float32)
    step = build(name, inputs, [out], **opts)
    results = []
    for _ in range(2):
        for a in inputs:
            a[...] = rng.standard_normal(a.shape)
        step()
        assert out.dtype == np.float32
        (want,) = run(name, inputs, [out.shape], **opts)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        results.append(out.copy())
    assert not np.allclose(results[0], results[1])
