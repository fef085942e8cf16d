"""Activation kernels and their gradients against PyTorch (forward and
autograd) and central finite differences in float64."""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_check import numeric_grad, run
from microtrain.files.errors import OperatorError
from microtrain.step.kernels import build
from microtrain.step.kernels.activations import fused_activation

rng = np.random.default_rng(7)

# Forward op name -> (ActivationGrad's `activation`, torch reference, kinks).
ACTIVATIONS = {
    "RELU": ("relu", torch.relu, (0,)),
    "RELU6": ("relu6", F.relu6, (0, 6)),
    "RELU_N1_TO_1": ("relu_n1_to_1", lambda t: F.hardtanh(t, -1, 1), (-1, 1)),
    "LOGISTIC": ("logistic", torch.sigmoid, ()),
    "TANH": ("tanh", torch.tanh, ()),
}
SHAPES = [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 5)]


def away_from(x, kinks):
    """x with values within 0.01 of a kink moved 0.05 past it, so that central
    differences never straddle a kink."""
    for k in kinks:
        x = np.where(np.abs(x - k) < 0.01, k + 0.05, x)
    return x


def torch_vjp(f, x, dy):
    """d(sum(f(x) * dy))/dx by torch autograd, in float64."""
    xt = torch.tensor(x, requires_grad=True)
    f(xt).backward(torch.tensor(dy))
    return xt.grad.numpy()


def forward(name, **options):
    return lambda x: run(name, [x], [x.shape], **options)[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_forward_matches_torch(name, shape):
    x = rng.normal(size=shape) * 4
    expected = ACTIVATIONS[name][1](torch.tensor(x)).numpy()
    np.testing.assert_allclose(forward(name)(x), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.0, 1.7])
def test_leaky_relu_matches_torch(alpha):
    x = rng.normal(size=(4, 6))
    expected = F.leaky_relu(torch.tensor(x), alpha).numpy()
    np.testing.assert_allclose(forward("LEAKY_RELU", alpha=alpha)(x), expected, rtol=1e-15)


def test_logistic_is_accurate_and_silent_in_the_tails():
    x = np.array([-1000.0, -80.0, -20.0, 0.0, 20.0, 80.0, 1000.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (np.float32, np.float64):
            y = forward("LOGISTIC")(x.astype(dtype))
            expected = torch.sigmoid(torch.tensor(x, dtype=torch.float64)).numpy()
            np.testing.assert_allclose(y, expected, rtol=1e-5 if dtype == np.float32 else 1e-13)


@pytest.mark.parametrize("shape", SHAPES + [(16, 2, 32, 32)])  # attention scores: short rows
@pytest.mark.parametrize("beta", [1.0, 0.5, -2.0])                # maxima from a transposed copy
def test_softmax_matches_torch(shape, beta):
    x = rng.normal(size=shape) * 300  # far beyond exp's range: must be stable
    expected = torch.softmax(beta * torch.tensor(x), dim=-1).numpy()
    np.testing.assert_allclose(forward("SOFTMAX", beta=beta)(x), expected, rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_grad(name, shape):
    activation, reference, kinks = ACTIVATIONS[name]
    x = away_from(rng.normal(size=shape) * 4, kinks)
    dy = rng.normal(size=shape)
    y = forward(name)(x)
    (dx,) = run("ActivationGrad", [dy, y], [shape], activation=activation)
    np.testing.assert_allclose(dx, numeric_grad(forward(name), x, dy), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dx, torch_vjp(reference, x, dy), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 1.7])
def test_leaky_relu_grad(alpha):
    x = away_from(rng.normal(size=(3, 5)), (0,))
    dy = rng.normal(size=x.shape)
    y = forward("LEAKY_RELU", alpha=alpha)(x)
    (dx,) = run("ActivationGrad", [dy, y], [x.shape], activation="leaky_relu", alpha=alpha)
    np.testing.assert_allclose(dx, numeric_grad(forward("LEAKY_RELU", alpha=alpha), x, dy),
                               rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(dx, torch_vjp(lambda t: F.leaky_relu(t, alpha), x, dy), rtol=1e-15)


@pytest.mark.parametrize("activation, options", [
    ("relu", {}), ("relu6", {}), ("relu_n1_to_1", {}), ("logistic", {}), ("tanh", {}),
    ("elu", {}), ("exp", {}), ("sqrt", {}), ("rsqrt", {}), ("leaky_relu", {"alpha": 0.3})])
def test_activation_grad_written_over_its_incoming_gradient(activation, options):
    """ActivationGrad may write dX over dY (the planner gives it dY's bytes when dY
    dies there): the same numbers, bit for bit, as written apart."""
    y = np.abs(rng.normal(size=(4, 6))).astype(np.float32) * np.float32(0.9)
    y[0] = -y[0] if activation in ("relu_n1_to_1", "tanh", "elu", "leaky_relu") else y[0]
    y[:, 0] = 0  # a zero slope for the ReLUs
    dy = rng.normal(size=y.shape).astype(np.float32)
    apart, over = np.zeros_like(dy), dy.copy()
    with np.errstate(divide="ignore"):  # sqrt's slope at 0
        build("ActivationGrad", [dy, y], [apart], activation=activation, **options)()
        build("ActivationGrad", [over, y], [over], activation=activation, **options)()
    np.testing.assert_array_equal(over, apart)
    assert not np.array_equal(apart, dy)


@pytest.mark.parametrize("shape", [(6,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("beta", [1.0, 0.5, -2.0])
def test_softmax_grad(shape, beta):
    x, dy = rng.normal(size=shape), rng.normal(size=shape)
    y = forward("SOFTMAX", beta=beta)(x)
    (dx,) = run("SoftmaxGrad", [dy, y], [shape], beta=beta)
    np.testing.assert_allclose(dx, numeric_grad(forward("SOFTMAX", beta=beta), x, dy),
                               rtol=1e-6, atol=1e-9)
    reference = torch_vjp(lambda t: torch.softmax(beta * t, dim=-1), x, dy)
    np.testing.assert_allclose(dx, reference, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("code, reference", [
    (0, lambda t: t), (1, torch.relu), (2, lambda t: t.clamp(-1, 1)),
    (3, lambda t: t.clamp(0, 6)), (4, torch.tanh)])
def test_fused_activation_is_in_place(code, reference):
    x = rng.normal(size=(3, 4)) * 4
    expected = reference(torch.tensor(x)).numpy()
    fused_activation(code)(x)
    np.testing.assert_allclose(x, expected, rtol=1e-15)


def test_bad_options_raise():
    with pytest.raises(OperatorError):
        fused_activation(6)
    with pytest.raises(OperatorError):
        run("ActivationGrad", [np.ones(3), np.ones(3)], [(3,)], activation="gelu")


@pytest.mark.parametrize("name, options", [
    ("RELU", {}), ("RELU6", {}), ("RELU_N1_TO_1", {}), ("LOGISTIC", {}), ("TANH", {}),
    ("LEAKY_RELU", {"alpha": 0.1}), ("SOFTMAX", {"beta": 1.0})])
def test_float32_closure_reads_inputs_at_call_time(name, options):
    x = np.zeros((4, 5), np.float32)
    y = np.zeros_like(x)
    step = build(name, [x], [y], **options)
    for _ in range(2):
        x[...] = rng.normal(size=x.shape) * 4
        step()
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, forward(name, **options)(x.astype(np.float64)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op, options, reference", [
    ("ActivationGrad", {"activation": "relu6"}, ACTIVATIONS["RELU6"][1]),
    ("ActivationGrad", {"activation": "tanh"}, torch.tanh),
    ("SoftmaxGrad", {"beta": 1.0}, lambda t: torch.softmax(t, dim=-1))])
def test_float32_grad_closure_reads_inputs_at_call_time(op, options, reference):
    dy, y = np.zeros((4, 5), np.float32), np.zeros((4, 5), np.float32)
    dx = np.zeros_like(y)
    step = build(op, [dy, y], [dx], **options)
    for _ in range(2):
        x = rng.normal(size=y.shape) * 4
        y[...] = reference(torch.tensor(x)).numpy()
        dy[...] = rng.normal(size=y.shape)
        step()
        assert dx.dtype == np.float32
        expected = torch_vjp(reference, x, dy.astype(np.float64))
        np.testing.assert_allclose(dx, expected, rtol=1e-5, atol=1e-6)
