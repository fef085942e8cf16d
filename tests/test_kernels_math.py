"""Kernels of the mobile models' elementwise operators (activations, math
functions, PRELU, MAXIMUM/MINIMUM, LOG_SOFTMAX) and their gradient kernels:
forward against PyTorch in float64 with TFLite's definitions, gradients against
PyTorch autograd and central finite differences."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_check import numeric_grad, run
from microtrain.step.kernels import build

rng = np.random.default_rng(11)


def torch_vjp(f, xs, dy):
    """Gradients of sum(f(*xs) * dy) w.r.t. each of xs, by torch autograd in float64."""
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    f(*ts).backward(torch.tensor(dy))
    return [t.grad.numpy() for t in ts]


def forward(name, **options):
    return lambda *xs: run(name, list(xs), [np.broadcast_shapes(*(x.shape for x in xs))],
                           **options)[0]


def positive(shape):
    return rng.uniform(0.3, 3, size=shape)


def away_from(x, kinks, gap=0.05):
    for k in kinks:
        x = np.where(np.abs(x - k) < gap, k + 2 * gap, x)
    return x


# name -> (torch reference, gradient op, its activation, input maker)
UNARY = {
    "HARD_SWISH": (F.hardswish, "ActivationInputGrad", "hard_swish",
                   lambda s: away_from(rng.normal(size=s) * 4, (-3, 3))),
    "GELU": (F.gelu, "ActivationInputGrad", "gelu", lambda s: rng.normal(size=s) * 3),
    "LOG": (torch.log, "ActivationInputGrad", "log", positive),
    "SQUARE": (torch.square, "ActivationInputGrad", "square", lambda s: rng.normal(size=s)),
    "ELU": (F.elu, "ActivationGrad", "elu", lambda s: away_from(rng.normal(size=s) * 2, (0,))),
    "EXP": (torch.exp, "ActivationGrad", "exp", lambda s: rng.normal(size=s)),
    "SQRT": (torch.sqrt, "ActivationGrad", "sqrt", positive),
    "RSQRT": (torch.rsqrt, "ActivationGrad", "rsqrt", positive),
}
# GELU's erf is a polynomial approximation good to float32's resolution (1.2e-7).
FORWARD_TOL = {"GELU": dict(rtol=2e-7, atol=1e-7)}
GRAD_TOL = {"GELU": dict(rtol=1e-6, atol=2e-7)}


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 2, 4)])
@pytest.mark.parametrize("name", UNARY)
def test_unary_forward_matches_torch(name, shape):
    reference, _, _, make = UNARY[name]
    x = make(shape)
    expected = reference(torch.tensor(x)).numpy()
    np.testing.assert_allclose(forward(name)(x), expected,
                               **FORWARD_TOL.get(name, dict(rtol=1e-13, atol=1e-15)))


@pytest.mark.parametrize("name", UNARY)
def test_unary_grad(name):
    reference, grad_op, activation, make = UNARY[name]
    x = make((3, 5))
    dy = rng.normal(size=x.shape)
    operand = forward(name)(x) if grad_op == "ActivationGrad" else x
    (dx,) = run(grad_op, [dy, operand], [x.shape], activation=activation)
    np.testing.assert_allclose(dx, numeric_grad(forward(name), x, dy), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dx, torch_vjp(reference, [x], dy)[0],
                               **GRAD_TOL.get(name, dict(rtol=1e-12, atol=1e-14)))


def test_gelu_tails_and_tanh_form():
    x = np.array([-40.0, -12.0, -6.0, -1e-3, 0.0, 1e-3, 6.0, 12.0, 40.0])
    expected = F.gelu(torch.tensor(x)).numpy()
    # torch forms 1 + erf(x), which is exactly 0 at -12; the true value is -2.1e-32
    np.testing.assert_allclose(forward("GELU")(x), expected, rtol=2e-7, atol=1e-20)
    x = rng.normal(size=(4, 6)) * 3
    dy = rng.normal(size=x.shape)
    tanh_gelu = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    np.testing.assert_allclose(forward("GELU", approximate=True)(x),
                               tanh_gelu(torch.tensor(x)).numpy(), rtol=1e-13, atol=1e-15)
    (dx,) = run("ActivationInputGrad", [dy, x], [x.shape], activation="gelu", approximate=True)
    np.testing.assert_allclose(dx, torch_vjp(tanh_gelu, [x], dy)[0], rtol=1e-12, atol=1e-14)


def test_hard_swish_at_its_kinks_takes_torchs_one_sided_slopes():
    x = np.array([-3.0, 3.0])
    (dx,) = run("ActivationInputGrad", [np.ones(2), x], [(2,)], activation="hard_swish")
    np.testing.assert_allclose(dx, torch_vjp(F.hardswish, [x], np.ones(2))[0])


@pytest.mark.parametrize("shape", [(2, 7), (3, 1, 5)])
def test_log_softmax(shape):
    x = rng.normal(size=shape) * 300  # far beyond exp's range: must be stable
    expected = torch.log_softmax(torch.tensor(x), dim=-1).numpy()
    np.testing.assert_allclose(forward("LOG_SOFTMAX")(x), expected, rtol=1e-12)
    x, dy = rng.normal(size=shape), rng.normal(size=shape)
    (dx,) = run("LogSoftmaxGrad", [dy, forward("LOG_SOFTMAX")(x)], [shape])
    np.testing.assert_allclose(dx, numeric_grad(forward("LOG_SOFTMAX"), x, dy), rtol=1e-6, atol=1e-9)
    reference = torch_vjp(lambda t: torch.log_softmax(t, dim=-1), [x], dy)[0]
    np.testing.assert_allclose(dx, reference, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("x_shape, alpha_shape", [((2, 4, 4, 3), (1, 1, 3)), ((2, 5), (5,)),
                                                  ((2, 3, 3, 2), (3, 3, 2)), ((4, 3), (1,))])
def test_prelu(x_shape, alpha_shape):
    x = away_from(rng.normal(size=x_shape), (0,))
    alpha, dy = rng.uniform(-0.5, 1.5, alpha_shape), rng.normal(size=x_shape)
    reference = lambda t, a: torch.where(t >= 0, t, a * t)  # noqa: E731  TFLite: x >= 0 ? x : αx
    np.testing.assert_array_equal(forward("PRELU")(x, alpha),
                                  reference(torch.tensor(x), torch.tensor(alpha)).numpy())
    want_dx, want_dalpha = torch_vjp(reference, [x, alpha], dy)
    (dx,) = run("PReluInputGrad", [dy, x, alpha], [x_shape])
    (dalpha,) = run("PReluAlphaGrad", [dy, x], [alpha_shape])
    np.testing.assert_allclose(dx, want_dx, rtol=1e-14)
    np.testing.assert_allclose(dalpha, want_dalpha, rtol=1e-12)
    np.testing.assert_allclose(dalpha, numeric_grad(lambda a: forward("PRELU")(x, a), alpha, dy),
                               rtol=1e-6)


BROADCASTS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3))]


@pytest.mark.parametrize("a_shape, b_shape", BROADCASTS)
@pytest.mark.parametrize("name, reference", [("MAXIMUM", torch.maximum), ("MINIMUM", torch.minimum),
                                             ("SQUARED_DIFFERENCE", lambda a, b: (a - b) ** 2)])
def test_binary_forward(name, reference, a_shape, b_shape):
    a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)
    expected = reference(torch.tensor(a), torch.tensor(b)).numpy()
    np.testing.assert_allclose(forward(name)(a, b), expected, rtol=1e-15)


@pytest.mark.parametrize("a_shape, b_shape", BROADCASTS)
@pytest.mark.parametrize("op, reference", [("maximum", torch.maximum), ("minimum", torch.minimum)])
def test_pick_grad(op, reference, a_shape, b_shape):
    a, b = rng.normal(size=a_shape), rng.normal(size=b_shape)  # no ties
    shape = np.broadcast_shapes(a_shape, b_shape)
    dy = rng.normal(size=shape)
    for operand, want in enumerate(torch_vjp(reference, [a, b], dy)):
        (full,) = run("PickGrad", [dy, a, b], [shape], op=op, operand=operand)
        (dx,) = run("SumToShape", [full], [want.shape])
        np.testing.assert_allclose(dx, want, rtol=1e-14)


def test_pick_grad_gives_ties_to_the_first_operand():
    a = b = np.array([1.0, 2.0])
    for op in ("maximum", "minimum"):
        first, second = (run("PickGrad", [np.ones(2), a, b], [(2,)], op=op, operand=i)[0]
                         for i in (0, 1))
        np.testing.assert_array_equal(first, [1, 1])
        np.testing.assert_array_equal(second, [0, 0])


@pytest.mark.parametrize("code", [0, 1, 2, 3, 4, 5])
def test_every_fused_activation_of_the_schema(code):
    """ActivationFunctionType 0..5 on ADD; 5 (SIGN_BIT) is 1 where the sign bit is set."""
    a, b = rng.normal(size=(3, 4)) * 4, np.array([0.0, -0.0, 1.0, -1.0])
    a[0, :2] = 0.0
    z = torch.tensor(a) + torch.tensor(b)
    expected = {0: z, 1: torch.relu(z), 2: z.clamp(-1, 1), 3: z.clamp(0, 6), 4: torch.tanh(z),
                5: torch.signbit(z).double()}[code].numpy()
    np.testing.assert_allclose(forward("ADD", fused_activation_function=code)(a, b), expected,
                               rtol=1e-15)


@pytest.mark.parametrize("name, options, make", [
    ("HARD_SWISH", {}, lambda s: rng.normal(size=s) * 4), ("GELU", {}, lambda s: rng.normal(size=s)),
    ("ELU", {}, lambda s: rng.normal(size=s)), ("RSQRT", {}, positive),
    ("LOG_SOFTMAX", {}, lambda s: rng.normal(size=s))])
def test_float32_closure_reads_inputs_at_call_time(name, options, make):
    x = np.zeros((4, 5), np.float32)
    y = np.zeros_like(x)
    step = build(name, [x], [y], **options)
    for _ in range(2):
        x[...] = make(x.shape)
        step()
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, forward(name, **options)(x.astype(np.float64)),
                                   rtol=2e-6, atol=1e-6)
