"""Data-movement and reduction kernels of the mobile models (PADV2, MIRROR_PAD,
DEPTH_TO_SPACE, SPACE_TO_DEPTH, STRIDED_SLICE, SPLIT, SPLIT_V, GATHER, SUM,
REDUCE_MAX, L2_NORMALIZATION): forward against the TFLite interpreter, gradient
kernels against PyTorch autograd and central finite differences in float64."""
import numpy as np
import pytest
import torch

from kernel_check import numeric_grad, run
from microtrain.step.kernels import build
from tflite_op import tflite_run

rng = np.random.default_rng(13)


def f32(*shape):
    return rng.normal(size=shape).astype(np.float32)


def ours(name, inputs, out_shapes, **options):
    """Our kernel in float32, for comparison with TFLite."""
    return run(name, inputs, out_shapes, dtype=np.float32, **options)


def torch_vjp(f, x, dy):
    t = torch.tensor(x, requires_grad=True)
    f(t).backward(torch.tensor(dy))
    return t.grad.numpy()


def i32(v):
    return np.array(v, np.int32)


@pytest.mark.parametrize("value", [0.0, -1.5])
def test_padv2_matches_tflite(value):
    x, paddings = f32(2, 3, 4, 2), i32([[0, 0], [1, 2], [0, 3], [1, 0]])
    shape = (2, 6, 7, 3)
    inputs = [x, paddings, np.array([value], np.float32)]
    np.testing.assert_array_equal(ours("PADV2", inputs, [shape])[0],
                                  tflite_run("PADV2", inputs, [shape], constant=(1, 2))[0])


MIRROR_CASES = [((2, 4, 5, 3), [[0, 0], [2, 1], [3, 0], [0, 0]]),
                ((2, 4, 5, 3), [[1, 1], [3, 2], [4, 3], [2, 0]]),
                ((3, 6), [[0, 2], [1, 1]])]


def _mirror_shape(x_shape, paddings):
    return tuple(n + a + b for n, (a, b) in zip(x_shape, paddings))


@pytest.mark.parametrize("x_shape, paddings", MIRROR_CASES)
@pytest.mark.parametrize("mode", [0, 1])
def test_mirror_pad_matches_tflite_and_numpy(x_shape, paddings, mode):
    if mode == 1:  # SYMMETRIC pads at most the axis's size, REFLECT one less
        paddings = [[min(a, n), min(b, n)] for (a, b), n in zip(paddings, x_shape)]
    x, shape = f32(*x_shape), _mirror_shape(x_shape, paddings)
    inputs = [x, i32(paddings)]
    y = ours("MIRROR_PAD", inputs, [shape], mode=mode)[0]
    np.testing.assert_array_equal(y, np.pad(x, paddings, mode=("reflect", "symmetric")[mode]))
    np.testing.assert_array_equal(y, tflite_run("MIRROR_PAD", inputs, [shape], constant=(1,),
                                                mode=mode)[0])


@pytest.mark.parametrize("x_shape, paddings", MIRROR_CASES)
@pytest.mark.parametrize("mode", [0, 1])
def test_mirror_pad_grad(x_shape, paddings, mode):
    x, shape = rng.normal(size=x_shape), _mirror_shape(x_shape, paddings)
    dy = rng.normal(size=shape)
    (dx,) = run("MirrorPadGrad", [dy, i32(paddings)], [x_shape], mode=mode)
    pad = lambda v: run("MIRROR_PAD", [v, i32(paddings)], [shape], mode=mode)[0]  # noqa: E731
    np.testing.assert_allclose(dx, numeric_grad(pad, x, dy), rtol=1e-6, atol=1e-8)
    # torch: the same padding as a gather of x's elements by a padded index
    index = torch.tensor(np.pad(np.arange(x.size).reshape(x_shape), paddings,
                                mode=("reflect", "symmetric")[mode]))
    np.testing.assert_allclose(dx, torch_vjp(lambda t: t.reshape(-1)[index], x, dy), rtol=1e-13)


@pytest.mark.parametrize("block", [2, 3])
def test_depth_to_space_and_back_match_tflite(block):
    x = f32(2, 3, 2, 2 * block * block)
    deep_shape, wide_shape = x.shape, (2, 3 * block, 2 * block, 2)
    wide = ours("DEPTH_TO_SPACE", [x], [wide_shape], block_size=block)[0]
    np.testing.assert_array_equal(wide, tflite_run("DEPTH_TO_SPACE", [x], [wide_shape],
                                                   block_size=block)[0])
    back = ours("SPACE_TO_DEPTH", [wide], [deep_shape], block_size=block)[0]
    np.testing.assert_array_equal(back, tflite_run("SPACE_TO_DEPTH", [wide], [deep_shape],
                                                   block_size=block)[0])
    np.testing.assert_array_equal(back, x)  # each is the other's gradient: a permutation


# (x shape, begin, end, strides, options)
STRIDED = [((4, 6, 5), [1, 0, 2], [3, 6, 5], [1, 2, 1], {}),
           ((4, 6, 5), [0, -1, 0], [4, 0, 5], [1, -2, 1], {"begin_mask": 1, "end_mask": 5}),
           ((4, 6, 5), [0, 2, 0], [0, 3, 0], [1, 1, 1], {"begin_mask": 5, "end_mask": 5,
                                                         "shrink_axis_mask": 2}),
           ((2, 3, 4, 6), [0, 1], [0, 4], [1, 2], {"ellipsis_mask": 1}),
           ((3, 4), [0, 0, 1], [0, 0, 3], [1, 1, 1], {"begin_mask": 1, "end_mask": 1,
                                                      "new_axis_mask": 2}),
           ((5, 6), [1, 2], [2, 3], [1, 1], {"offset": True}),
           ((5, 6), [-4, 10], [-1, -10], [2, -1], {})]


def _strided_inputs(x, begin, end, strides):
    return [x, i32(begin), i32(end), i32(strides)]


@pytest.mark.parametrize("x_shape, begin, end, strides, options", STRIDED)
def test_strided_slice_matches_tflite(x_shape, begin, end, strides, options):
    x = f32(*x_shape)
    inputs = _strided_inputs(x, begin, end, strides)
    want = tflite_run("STRIDED_SLICE", inputs, [(1,)], constant=(1, 2, 3), **options)[0]
    np.testing.assert_array_equal(ours("STRIDED_SLICE", inputs, [want.shape], **options)[0], want)


@pytest.mark.parametrize("x_shape, begin, end, strides, options", STRIDED)
def test_strided_slice_grad(x_shape, begin, end, strides, options):
    x = rng.normal(size=x_shape)
    consts = _strided_inputs(x, begin, end, strides)[1:]
    want = tflite_run("STRIDED_SLICE", [x.astype(np.float32), *consts], [(1,)],
                      constant=(1, 2, 3), **options)[0]
    dy = rng.normal(size=want.shape)
    (dx,) = run("StridedSliceGrad", [dy, *consts], [x_shape], **options)
    sliced = lambda v: run("STRIDED_SLICE", [v, *consts], [want.shape], **options)[0]  # noqa: E731
    np.testing.assert_allclose(dx, numeric_grad(sliced, x, dy), rtol=1e-6, atol=1e-9)
    index = torch.tensor(sliced(np.arange(x.size, dtype=np.float64).reshape(x_shape))).long()
    np.testing.assert_allclose(dx, torch_vjp(lambda t: t.reshape(-1)[index], x, dy), rtol=1e-14)


@pytest.mark.parametrize("op, inputs, shapes, options", [
    ("SPLIT", [i32([1]), f32(2, 6, 3)], [(2, 2, 3)] * 3, {"num_splits": 3}),
    ("SPLIT", [i32([-1]), f32(2, 6, 4)], [(2, 6, 2)] * 2, {"num_splits": 2}),
    ("SPLIT_V", [f32(2, 7, 3), i32([2, -1, 1]), i32([1])], [(2, 2, 3), (2, 4, 3), (2, 1, 3)],
     {"num_splits": 3})])
def test_split_matches_tflite(op, inputs, shapes, options):
    constant = (0,) if op == "SPLIT" else (1, 2)
    got = ours(op, inputs, shapes, **options)
    for g, w in zip(got, tflite_run(op, inputs, shapes, constant=constant, **options)):
        np.testing.assert_array_equal(g, w)


def test_split_grad_joins_the_parts_and_zeroes_absent_ones():
    parts = [rng.normal(size=(2, n, 3)) for n in (2, 4, 1)]
    (dx,) = run("SplitGrad", [parts[0], None, parts[2]], [(2, 7, 3)], axis=1, sizes=[2, 4, 1])
    np.testing.assert_array_equal(dx, np.concatenate([parts[0], np.zeros((2, 4, 3)), parts[2]], 1))


@pytest.mark.parametrize("x_shape, indices, axis", [((5, 3), [4, 0, 2], 0), ((2, 5, 3), [1, 1, 3], 1),
                                                    ((2, 3, 4), [[3, 0], [1, 3]], -1)])
def test_gather_matches_tflite_and_its_grad_torch(x_shape, indices, axis):
    x = f32(*x_shape)
    want = tflite_run("GATHER", [x, i32(indices)], [(1,)], constant=(1,), axis=axis)[0]
    np.testing.assert_array_equal(ours("GATHER", [x, i32(indices)], [want.shape], axis=axis)[0], want)
    x64, dy = x.astype(np.float64), rng.normal(size=want.shape)
    (dx,) = run("GatherGrad", [dy, i32(indices)], [x_shape], axis=axis)
    index = torch.tensor(indices)
    reference = torch_vjp(lambda t: torch.movedim(torch.movedim(t, axis, 0)[index], 
                                                  tuple(range(index.ndim)),
                                                  tuple(range(axis % len(x_shape),
                                                              axis % len(x_shape) + index.ndim))),
                          x64, dy)
    np.testing.assert_allclose(dx, reference, rtol=1e-14)


def test_gather_reads_computed_indices_at_every_call():
    """Token ids are computed: the step built once gathers the ids its input holds when it
    runs (as LiteRT does with the ids fed), and its gradient adds at those ids."""
    table = f32(6, 3)
    ids, y, dx = np.zeros((2, 2), np.int32), np.zeros((2, 2, 3), np.float32), np.zeros((6, 3))
    forward = build("GATHER", [table, ids], [y], axis=0)
    dy = rng.normal(size=(2, 2, 3))
    backward = build("GatherGrad", [dy, ids], [dx], axis=0)
    for fed in ([[5, 1], [1, 0]], [[2, 3], [4, 2]]):
        ids[...] = fed
        forward()
        want = tflite_run("GATHER", [table, i32(fed)], [(2, 2, 3)], axis=0)[0]
        np.testing.assert_array_equal(y, want)
        backward()
        reference = torch_vjp(lambda t: t[torch.tensor(fed)], table.astype(np.float64), dy)
        np.testing.assert_allclose(dx, reference, rtol=1e-14)


REDUCE = [((3, 4, 5), [1], False), ((3, 4, 5), [0, 2], True), ((2, 3, 4, 5), [-1, 1], False)]


@pytest.mark.parametrize("x_shape, axis, keep_dims", REDUCE)
@pytest.mark.parametrize("op", ["SUM", "REDUCE_MAX"])
def test_reductions_match_tflite_and_their_grads_torch(op, x_shape, axis, keep_dims):
    x = f32(*x_shape)
    want = tflite_run(op, [x, i32(axis)], [(1,)], constant=(1,), keep_dims=keep_dims)[0]
    np.testing.assert_allclose(ours(op, [x, i32(axis)], [want.shape], keep_dims=keep_dims)[0],
                               want, rtol=1e-6, atol=1e-6)  # float32 sums in another order
    x64, dy = x.astype(np.float64), rng.normal(size=want.shape)
    if op == "SUM":
        (dx,) = run("SumGrad", [dy], [x_shape], axis=axis, keep_dims=keep_dims)
        reference = lambda t: t.sum(dim=axis, keepdim=keep_dims)  # noqa: E731
    else:
        y = run(op, [x64, i32(axis)], [want.shape], keep_dims=keep_dims)[0]
        (dx,) = run("ReduceMaxGrad", [dy, x64, y], [x_shape], axis=axis, keep_dims=keep_dims)
        reference = lambda t: t.amax(dim=axis, keepdim=keep_dims)  # noqa: E731
    np.testing.assert_allclose(dx, torch_vjp(reference, x64, dy), rtol=1e-14)


def test_reduce_max_grad_shares_ties_like_torch():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    dy = np.array([6.0, 3.0])
    y = run("REDUCE_MAX", [x, i32([1])], [(2,)])[0]
    (dx,) = run("ReduceMaxGrad", [dy, x, y], [x.shape], axis=[1])
    np.testing.assert_array_equal(dx, torch_vjp(lambda t: t.amax(dim=1), x, dy))
    np.testing.assert_array_equal(dx, [[0, 3, 3], [1, 1, 1]])


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 5)])
def test_l2_normalization(shape):
    x = f32(*shape)
    x[0] *= 1e-8  # a row whose norm is below TFLite's floor of 1e-6
    np.testing.assert_allclose(ours("L2_NORMALIZATION", [x], [shape])[0],
                               tflite_run("L2_NORMALIZATION", [x], [shape])[0], rtol=1e-6)
    x64, dy = x.astype(np.float64), rng.normal(size=shape)
    reference = lambda t: t / t.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # noqa: E731
    (dx,) = run("L2NormalizationGrad", [dy, x64], [shape])
    np.testing.assert_allclose(dx, torch_vjp(reference, x64, dy), rtol=1e-11)
    normalize = lambda v: run("L2_NORMALIZATION", [v], [shape])[0]  # noqa: E731
    rest = (slice(1, None),)  # finite differences of 1e-6 would cross the floor in row 0
    numeric = numeric_grad(normalize, x64, dy)
    np.testing.assert_allclose(dx[rest], numeric[rest], rtol=1e-6, atol=1e-9)


def test_shape_chain_reads_its_input_when_it_runs():
    """A converter's run-time Flatten (SHAPE, STRIDED_SLICE of one element, PACK), as a model
    run without split folding it computes it: each step reads what the one before wrote."""
    x = f32(3, 2, 4)
    dims = np.zeros(3, np.int32)
    batch, flat = np.zeros((), np.int32), np.array(8, np.int32)
    target = np.zeros(2, np.int32)
    steps = [build("SHAPE", [x], [dims]),
             build("STRIDED_SLICE", [dims, i32([0]), i32([1]), i32([1])], [batch],
                   shrink_axis_mask=1),
             build("PACK", [batch, flat.reshape(1)], [target], axis=0)]
    for step in steps:
        step()
    np.testing.assert_array_equal(target, [3, 8])
    (want,) = tflite_run("PACK", [np.array(3, np.int32), flat], [(2,)], out_dtypes=[np.int32],
                         values_count=2, axis=0)
    np.testing.assert_array_equal(target, want)
