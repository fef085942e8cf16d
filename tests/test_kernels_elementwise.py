"""Elementwise kernels and SumToShape against PyTorch (forward and autograd)
and central finite differences in float64."""
import numpy as np
import pytest
import torch

from kernel_check import numeric_grad, run
from microtrain.files.errors import OperatorError
from microtrain.step.kernels import build

rng = np.random.default_rng(5)
BINARY = {"ADD": torch.add, "SUB": torch.sub, "MUL": torch.mul, "DIV": torch.div}
ACT = {0: lambda t: t, 1: torch.relu, 2: lambda t: t.clamp(-1, 1),
       3: lambda t: t.clamp(0, 6), 4: torch.tanh}
BROADCASTS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((4,), (2, 3, 4)), ((2, 1, 4), (3, 1)),
              ((), (2, 3)), ((2, 3), ()), ((1,), (5,)), ((5, 1, 1, 2), (1, 3, 2))]


def operand(shape):
    """Random values with magnitude >= 0.5, so DIV's denominators are safe."""
    x = rng.uniform(0.5, 3, size=shape) * rng.choice([-1, 1], size=shape)
    return np.asarray(x)


@pytest.mark.parametrize("a_shape, b_shape", BROADCASTS)
@pytest.mark.parametrize("name", BINARY)
def test_binary_broadcasts_like_torch(name, a_shape, b_shape):
    a, b = operand(a_shape), operand(b_shape)
    expected = BINARY[name](torch.tensor(a), torch.tensor(b)).numpy()
    (y,) = run(name, [a, b], [expected.shape])
    np.testing.assert_allclose(y, expected, rtol=1e-15)


@pytest.mark.parametrize("code", [1, 2, 3, 4])
@pytest.mark.parametrize("name", BINARY)
def test_binary_fused_activation(name, code):
    a, b = operand((4, 5)) * 3, operand((5,))
    expected = ACT[code](BINARY[name](torch.tensor(a), torch.tensor(b))).numpy()
    (y,) = run(name, [a, b], [expected.shape], fused_activation_function=code)
    np.testing.assert_allclose(y, expected, rtol=1e-15)


def test_neg():
    x = rng.normal(size=(3, 4))
    np.testing.assert_array_equal(run("NEG", [x], [x.shape])[0], -x)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_add_n(count):
    xs = [rng.normal(size=(2, 3, 4)) for _ in range(count)]
    expected = torch.stack([torch.tensor(x) for x in xs]).sum(0).numpy()
    np.testing.assert_allclose(run("ADD_N", xs, [xs[0].shape])[0], expected, rtol=1e-14)


@pytest.mark.parametrize("dy_shape, dx_shape", [
    ((2, 3, 4), (4,)), ((2, 3, 4), (3, 1)), ((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (1, 1, 1)),
    ((2, 3, 4), ()), ((2, 3, 4), (2, 1, 4)), ((5, 1, 3), (1, 1, 3)), ((6,), (1,))])
def test_sum_to_shape_is_the_gradient_of_broadcasting(dy_shape, dx_shape):
    x, dy = rng.normal(size=dx_shape), rng.normal(size=dy_shape)
    (dx,) = run("SumToShape", [dy], [dx_shape])
    zeros = np.zeros(dy_shape)

    def broadcast_add(v):
        return run("ADD", [v, zeros], [dy_shape])[0]
    np.testing.assert_allclose(dx, numeric_grad(broadcast_add, x, dy), rtol=1e-6, atol=1e-9)
    xt = torch.tensor(x, requires_grad=True)
    (xt + torch.zeros(dy_shape, dtype=torch.float64)).backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("dy_shape, dx_shape", [((2, 3), (4,)), ((3,), (2, 3)), ((2, 3), (2, 2))])
def test_sum_to_shape_rejects_non_broadcast_shapes(dy_shape, dx_shape):
    with pytest.raises(OperatorError):
        run("SumToShape", [np.ones(dy_shape)], [dx_shape])


@pytest.mark.parametrize("name, b_shape, options, reference", [
    *[(name, (4,), {"fused_activation_function": 1}, lambda a, b, f=f: torch.relu(f(a, b)))
      for name, f in BINARY.items()],
    ("ADD_N", (3, 4), {}, torch.add)])
def test_float32_closure_reads_inputs_at_call_time(name, b_shape, options, reference):
    a, b = np.zeros((3, 4), np.float32), np.zeros(b_shape, np.float32)
    y = np.zeros((3, 4), np.float32)
    step = build(name, [a, b], [y], **options)
    for _ in range(2):
        a[...], b[...] = operand(a.shape), operand(b.shape)
        step()
        assert y.dtype == np.float32
        expected = reference(torch.tensor(a), torch.tensor(b)).numpy()
        np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_float32_sum_to_shape_reads_inputs_at_call_time():
    dy, dx = np.zeros((5, 3, 4), np.float32), np.zeros((3, 1), np.float32)
    step = build("SumToShape", [dy], [dx])
    for _ in range(2):
        dy[...] = rng.normal(size=dy.shape)
        step()
        np.testing.assert_allclose(dx, dy.sum(axis=(0, 2))[:, None], rtol=1e-5, atol=1e-6)
