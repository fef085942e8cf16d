"""Shape kernels against PyTorch / numpy, and MeanGrad against PyTorch autograd
and central finite differences in float64."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_check import numeric_grad, run
from microtrain.files.errors import OperatorError
from microtrain.step.kernels import build

rng = np.random.default_rng(3)


@pytest.mark.parametrize("name, x_shape, y_shape", [
    ("RESHAPE", (2, 3, 4), (6, 4)), ("RESHAPE", (2, 3, 4), (24,)), ("RESHAPE", (5,), (1, 5, 1)),
    ("SQUEEZE", (1, 3, 1, 2), (3, 2)), ("SQUEEZE", (4, 1), (4,))])
@pytest.mark.parametrize("with_shape_input", [False, True])
def test_reshape_and_squeeze(name, x_shape, y_shape, with_shape_input):
    x = rng.normal(size=x_shape)
    inputs = [x, np.array(y_shape, np.int32)] if with_shape_input else [x]
    (y,) = run(name, inputs, [y_shape])
    np.testing.assert_array_equal(y, x.reshape(y_shape))


def test_reshape_of_shared_memory_is_correct():
    x = np.zeros((2, 6))
    y = x.reshape(3, 4)  # the executor may alias them
    step = build("RESHAPE", [x], [y])
    x[...] = rng.normal(size=x.shape)
    step()
    np.testing.assert_array_equal(y, x.reshape(3, 4))


def test_reshape_rejects_a_size_change():
    with pytest.raises(OperatorError):
        run("RESHAPE", [np.ones((2, 3))], [(7,)])


@pytest.mark.parametrize("shapes, axis", [
    ([(2, 3), (4, 3)], 0), ([(2, 3), (2, 1), (2, 5)], 1), ([(2, 3, 4), (2, 3, 2)], -1),
    ([(2, 1, 4), (2, 3, 4), (2, 2, 4)], -2), ([(3,), (0,), (2,)], 0)])
@pytest.mark.parametrize("code", [0, 1])
def test_concatenation_matches_torch(shapes, axis, code):
    xs = [rng.normal(size=s) for s in shapes]
    expected = torch.cat([torch.tensor(x) for x in xs], dim=axis)
    expected = (torch.relu(expected) if code else expected).numpy()
    (y,) = run("CONCATENATION", xs, [expected.shape], axis=axis, fused_activation_function=code)
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("x_shape, paddings", [
    ((2, 3), [[1, 0], [2, 3]]), ((1, 4, 4, 2), [[0, 0], [1, 1], [2, 0], [0, 0]]), ((3,), [[0, 0]])])
def test_pad_matches_torch_and_zeroes_every_call(x_shape, paddings):
    x = rng.normal(size=x_shape)
    torch_pads = [p for pair in reversed(paddings) for p in pair]  # last axis first
    expected = F.pad(torch.tensor(x), torch_pads).numpy()
    y = np.full(expected.shape, np.nan)  # stale contents must not survive
    build("PAD", [x, np.array(paddings, np.int32)], [y])()
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("x_shape, begin, size", [
    ((5, 6), [1, 2], [3, 4]), ((5, 6), [2, 0], [-1, 6]), ((2, 3, 4), [0, 1, 1], [2, -1, 2]),
    ((4,), [3], [1])])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_slice_matches_numpy(x_shape, begin, size, index_dtype):
    x = rng.normal(size=x_shape)
    index = tuple(slice(b, None if s == -1 else b + s) for b, s in zip(begin, size))
    expected = x[index]
    (y,) = run("SLICE", [x, np.array(begin, index_dtype), np.array(size, index_dtype)],
               [expected.shape])
    np.testing.assert_array_equal(y, expected)


@pytest.mark.parametrize("x_shape, perm", [
    ((2, 3), [1, 0]), ((2, 3, 4), [2, 0, 1]), ((2, 3, 4, 5), [0, 3, 1, 2]), ((4,), [0])])
def test_transpose_matches_torch(x_shape, perm):
    x = rng.normal(size=x_shape)
    expected = torch.tensor(x).permute(perm).numpy()
    (y,) = run("TRANSPOSE", [x, np.array(perm, np.int32)], [expected.shape])
    np.testing.assert_array_equal(y, expected)


MEAN_CASES = [((4, 5), [1]), ((4, 5), [-1]), ((2, 3, 4), [0, 2]), ((2, 3, 4), [-1, 1, -1]),
              ((2, 3, 4, 5), [1, 2]), ((3, 4), [0, 1]), ((3, 4), 0)]


@pytest.mark.parametrize("x_shape, axis", MEAN_CASES)
@pytest.mark.parametrize("keep_dims", [False, True])
def test_mean_matches_torch(x_shape, axis, keep_dims):
    x = rng.normal(size=x_shape)
    dims = sorted({a % len(x_shape) for a in np.atleast_1d(axis)})
    expected = torch.tensor(x).mean(dim=dims, keepdim=keep_dims).numpy()
    (y,) = run("MEAN", [x, np.array(axis, np.int32)], [expected.shape], keep_dims=keep_dims)
    np.testing.assert_allclose(y, expected, rtol=1e-14)


@pytest.mark.parametrize("x_shape, axis", MEAN_CASES)
@pytest.mark.parametrize("keep_dims", [False, True])
def test_mean_grad(x_shape, axis, keep_dims):
    x = rng.normal(size=x_shape)
    axis_list = np.atleast_1d(axis).tolist()
    axis_input = np.array(axis, np.int32)
    dims = sorted({a % len(x_shape) for a in axis_list})

    def mean(v):
        y_shape = torch.tensor(v).mean(dim=dims, keepdim=keep_dims).shape
        return run("MEAN", [v, axis_input], [tuple(y_shape)], keep_dims=keep_dims)[0]
    dy = rng.normal(size=mean(x).shape)
    (dx,) = run("MeanGrad", [dy], [x_shape], axis=axis_list, keep_dims=keep_dims)
    np.testing.assert_allclose(dx, numeric_grad(mean, x, dy), rtol=1e-6, atol=1e-9)
    xt = torch.tensor(x, requires_grad=True)
    xt.mean(dim=dims, keepdim=keep_dims).backward(torch.tensor(dy))
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-14)


def test_float32_closures_read_inputs_at_call_time():
    x = np.zeros((3, 4, 5), np.float32)
    outputs = {"TRANSPOSE": np.zeros((5, 3, 4), np.float32), "MEAN": np.zeros((3, 1, 1), np.float32),
               "SLICE": np.zeros((2, 4, 3), np.float32), "RESHAPE": np.zeros((12, 5), np.float32)}
    constants = {"TRANSPOSE": [np.array([2, 0, 1])], "MEAN": [np.array([1, 2])],
                 "SLICE": [np.array([1, 0, 2]), np.array([-1, -1, 3])], "RESHAPE": []}
    steps = [build(name, [x, *constants[name]], [y], keep_dims=True) for name, y in outputs.items()]
    dy, dx = np.zeros((3, 1, 1), np.float32), np.zeros_like(x)
    steps.append(build("MeanGrad", [dy], [dx], axis=[-1, 1], keep_dims=True))
    for _ in range(2):
        x[...], dy[...] = rng.normal(size=x.shape), rng.normal(size=dy.shape)
        for step in steps:
            step()
        assert all(a.dtype == np.float32 for a in (*outputs.values(), dx))
        np.testing.assert_array_equal(outputs["TRANSPOSE"], x.transpose(2, 0, 1))
        np.testing.assert_allclose(outputs["MEAN"], x.mean(axis=(1, 2), keepdims=True), rtol=1e-6)
        np.testing.assert_array_equal(outputs["SLICE"], x[1:, :, 2:])
        np.testing.assert_array_equal(outputs["RESHAPE"], x.reshape(12, 5))
        np.testing.assert_allclose(dx, np.broadcast_to(dy / 20, x.shape), rtol=1e-6)
