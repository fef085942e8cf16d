"""FULLY_CONNECTED, BATCH_MATMUL and the fully connected gradients against
PyTorch (forward and autograd) and central finite differences in float64."""
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_check import numeric_grad, run
from microtrain.step.kernels import build

rng = np.random.default_rng(11)
ACT = {0: lambda t: t, 1: torch.relu, 2: lambda t: t.clamp(-1, 1),
       3: lambda t: t.clamp(0, 6), 4: torch.tanh}

# (x shape, out features, keep_num_dims, y shape); `in` = prod(x) / rows of y.
FC_CASES = [
    ((5, 3), 4, False, (5, 4)),
    ((2, 3, 4), 5, True, (2, 3, 5)),
    ((2, 3, 4), 5, False, (6, 5)),
    ((4, 2, 3), 5, False, (4, 5)),  # x flattened to [-1, 6]
    ((1, 6), 1, False, (1, 1)),
]


def fc_torch(x, w, b, y_shape, code=0):
    y = F.linear(x.reshape(-1, w.shape[1]), w, b).reshape(y_shape)
    return ACT[code](y)


def fc_arrays(x_shape, out, y_shape):
    in_size = int(np.prod(x_shape)) // int(np.prod(y_shape[:-1]))
    return rng.normal(size=x_shape), rng.normal(size=(out, in_size)), rng.normal(size=out)


@pytest.mark.parametrize("x_shape, out, keep, y_shape", FC_CASES)
@pytest.mark.parametrize("code", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("bias", ["given", "none", "left_off"])
def test_fully_connected_matches_torch(x_shape, out, keep, y_shape, code, bias):
    x, w, b = fc_arrays(x_shape, out, y_shape)
    b = b if bias == "given" else None
    inputs = [x, w] if bias == "left_off" else [x, w, b]
    (y,) = run("FULLY_CONNECTED", inputs, [y_shape], fused_activation_function=code, keep_num_dims=keep)
    tb = None if b is None else torch.tensor(b)
    expected = fc_torch(torch.tensor(x), torch.tensor(w), tb, y_shape, code).numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("x_shape, out, keep, y_shape", FC_CASES)
def test_fully_connected_grads(x_shape, out, keep, y_shape):
    x, w, b = fc_arrays(x_shape, out, y_shape)
    dy = rng.normal(size=y_shape)
    (dx,) = run("FullyConnectedInputGrad", [dy, w], [x.shape])
    (dw,) = run("FullyConnectedWeightGrad", [dy, x], [w.shape])
    (db,) = run("BiasGrad", [dy], [b.shape])

    def fc(x_, w_, b_):
        return run("FULLY_CONNECTED", [x_, w_, b_], [y_shape], keep_num_dims=keep)[0]
    np.testing.assert_allclose(dx, numeric_grad(lambda v: fc(v, w, b), x, dy), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, numeric_grad(lambda v: fc(x, v, b), w, dy), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(db, numeric_grad(lambda v: fc(x, w, v), b, dy), rtol=1e-6, atol=1e-8)

    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    fc_torch(xt, wt, bt, y_shape).backward(torch.tensor(dy))
    for ours, theirs in ((dx, xt), (dw, wt), (db, bt)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-12, atol=1e-13)


# (x shape, y shape) before adjoints: broadcast batch dims and plain matrices.
MATMUL_CASES = [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((3, 1, 2, 4), (5, 4, 3)),
                ((1, 3, 4), (2, 4, 2)), ((2, 3, 4), (4, 6))]


@pytest.mark.parametrize("x_shape, y_shape", MATMUL_CASES)
@pytest.mark.parametrize("adj_x, adj_y", list(itertools.product([False, True], repeat=2)))
def test_batch_matmul_matches_torch(x_shape, y_shape, adj_x, adj_y):
    a, b = rng.normal(size=x_shape), rng.normal(size=y_shape)
    x = a.swapaxes(-1, -2) if adj_x else a  # stored transposed, as the op reads it
    y = b.swapaxes(-1, -2) if adj_y else b
    expected = torch.matmul(torch.tensor(a), torch.tensor(b)).numpy()
    (out,) = run("BATCH_MATMUL", [x, y], [expected.shape], adj_x=adj_x, adj_y=adj_y)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-14)


def test_float32_closures_read_inputs_at_call_time():
    x, w, b = (np.zeros(s, np.float32) for s in ((8, 6), (4, 6), (4,)))
    y, dy = np.zeros((8, 4), np.float32), np.zeros((8, 4), np.float32)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros_like(b)
    steps = [build("FULLY_CONNECTED", [x, w, b], [y], fused_activation_function=1),
             build("FullyConnectedInputGrad", [dy, w], [dx]),
             build("FullyConnectedWeightGrad", [dy, x], [dw]),
             build("BiasGrad", [dy], [db])]
    for _ in range(2):
        for a in (x, w, b, dy):
            a[...] = rng.normal(size=a.shape)
        for step in steps:
            step()
        assert all(a.dtype == np.float32 for a in (y, dx, dw, db))
        np.testing.assert_allclose(y, np.maximum(x @ w.T + b, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dx, dy @ w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dw, dy.T @ x, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(db, dy.sum(0), rtol=1e-5, atol=1e-6)


def test_float32_batch_matmul_reads_inputs_at_call_time():
    x, y = np.zeros((2, 4, 3), np.float32), np.zeros((4, 5), np.float32)
    out = np.zeros((2, 3, 5), np.float32)
    step = build("BATCH_MATMUL", [x, y], [out], adj_x=True)
    for _ in range(2):
        x[...], y[...] = rng.normal(size=x.shape), rng.normal(size=y.shape)
        step()
        np.testing.assert_allclose(out, x.swapaxes(1, 2) @ y, rtol=1e-5, atol=1e-6)
