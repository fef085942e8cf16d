"""Comparisons, logic, SELECT, CAST, ONE_HOT, ARG_MAX/ARG_MIN and the data
movement and reductions of sequence models (REVERSE_V2, BROADCAST_TO, TILE,
REDUCE_PROD, CUMSUM) against LiteRT; REDUCE_PROD's gradient against torch float64
and finite differences."""
import numpy as np
import pytest
import torch

from kernel_check import numeric_grad, run
from microtrain.files.errors import OperatorError
from tflite_op import tflite_run

rng = np.random.default_rng(18)
BROADCASTS = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((4,), (2, 3, 4)), ((2, 1, 4), (3, 1)),
              ((), (2, 3)), ((2, 3), ())]
COMPARISONS = ["LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL"]


def small(shape, dtype):
    """Values from a few integers, so that ties (EQUAL, LESS_EQUAL) occur."""
    return np.asarray(rng.integers(-2, 3, size=shape)).astype(dtype)


def i32(*values):
    return np.array(values, np.int32)


def same_as_litert(name, inputs, shape, dtype, constant=(), version=1, **options):
    """Our kernel's output equals LiteRT's, in type and value."""
    (want,) = tflite_run(name, inputs, [shape], constant=constant, out_dtypes=[dtype],
                         version=version, **options)
    (got,) = run(name, inputs, [want.shape], dtype=dtype, **options)
    assert want.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)
    return got


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("a_shape, b_shape", BROADCASTS)
@pytest.mark.parametrize("name", COMPARISONS)
def test_comparisons_match_litert(name, a_shape, b_shape, dtype):
    a, b = small(a_shape, dtype), small(b_shape, dtype)
    same_as_litert(name, [a, b], np.broadcast_shapes(a_shape, b_shape), np.bool_)


@pytest.mark.parametrize("a_shape, b_shape", BROADCASTS)
@pytest.mark.parametrize("name", ["LOGICAL_AND", "LOGICAL_OR"])
def test_logic_matches_litert(name, a_shape, b_shape):
    a, b = rng.random(a_shape) < 0.5, rng.random(b_shape) < 0.5
    same_as_litert(name, [a, b], np.broadcast_shapes(a_shape, b_shape), np.bool_)


def test_logical_not_matches_litert():
    x = rng.random((3, 5)) < 0.5
    same_as_litert("LOGICAL_NOT", [x], x.shape, np.bool_)


@pytest.mark.parametrize("cond_shape, a_shape, b_shape", [
    ((2, 3, 4), (2, 3, 4), (2, 3, 4)), ((3, 1), (1, 4), (4,)), ((4,), (2, 3, 4), (2, 1, 1)),
    ((), (2, 3), (2, 3)), ((2, 1, 1, 3), (1, 5, 1, 1), (2, 5, 4, 3))])
def test_select_v2_broadcasts_all_three_like_litert(cond_shape, a_shape, b_shape):
    cond = rng.random(cond_shape) < 0.5
    a, b = small(a_shape, np.float32), small(b_shape, np.float32) + 10
    shape = np.broadcast_shapes(cond_shape, a_shape, b_shape)
    same_as_litert("SELECT_V2", [cond, a, b], shape, np.float32)


@pytest.mark.parametrize("cond_shape, shape", [((2, 3, 4), (2, 3, 4)), ((3,), (3, 2, 4)),
                                               ((5,), (5,))])
def test_select_picks_whole_slices_by_a_rank_1_condition_like_litert(cond_shape, shape):
    cond = np.array([True, False, True, True, False][:cond_shape[0]]).reshape(-1) \
        if len(cond_shape) == 1 else rng.random(cond_shape) < 0.5
    a, b = small(shape, np.float32), small(shape, np.float32) + 10
    same_as_litert("SELECT", [cond, a, b], shape, np.float32)


def test_select_refuses_branches_that_do_not_broadcast():
    with pytest.raises(OperatorError, match="do not broadcast"):
        run("SELECT_V2", [np.ones(3, bool), np.ones(3), np.ones(4)], [(3,)])


@pytest.mark.parametrize("x, dtype", [
    (rng.normal(0, 3, (3, 4)).astype(np.float32), np.int32),
    (rng.normal(0, 3, (3, 4)).astype(np.float32), np.int64),
    (np.array([0.0, -0.0, 0.5, -2.0, np.inf], np.float32), np.bool_),
    (rng.random((2, 3)) < 0.5, np.float32),
    (small((2, 5), np.int32), np.float32),
    (small((2, 5), np.int32) * 1000, np.int64)])
def test_cast_matches_litert(x, dtype):
    same_as_litert("CAST", [x], x.shape, dtype)


@pytest.mark.parametrize("indices_shape, depth, axis", [((4,), 5, -1), ((2, 3), 4, -1),
                                                         ((2, 3), 4, 0), ((2, 3), 4, 1)])
def test_one_hot_matches_litert(indices_shape, depth, axis):
    indices = rng.integers(-1, depth + 1, indices_shape).astype(np.int32)  # some outside
    shape = list(indices_shape)
    shape.insert(axis % (len(shape) + 1), depth)
    inputs = [indices, np.array(depth, np.int32), np.array(2.5, np.float32),
              np.array(-1.0, np.float32)]
    same_as_litert("ONE_HOT", inputs, shape, np.float32, constant=(1, 2, 3), axis=axis)


@pytest.mark.parametrize("dtype, output_type", [(np.int32, 2), (np.int64, 4)])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("name", ["ARG_MAX", "ARG_MIN"])
def test_arg_max_min_match_litert_with_ties(name, axis, dtype, output_type):
    x = small((3, 4, 5), np.float32)  # ties: the first occurrence wins
    shape = np.delete(np.array(x.shape), axis)
    same_as_litert(name, [x, i32(axis)], shape, dtype, constant=(1,), output_type=output_type)


@pytest.mark.parametrize("axes", [(0,), (1,), (-1,), (1, 2)])  # LiteRT: contiguous axes
def test_reverse_v2_matches_litert(axes):
    x = rng.normal(size=(2, 3, 4)).astype(np.float32)
    same_as_litert("REVERSE_V2", [x, i32(*axes)], x.shape, np.float32, constant=(1,))


@pytest.mark.parametrize("x_shape, shape", [((3,), (2, 3)), ((2, 1), (2, 4)),
                                            ((1, 3, 1), (2, 3, 4)), ((4,), (4,))])
def test_broadcast_to_matches_litert(x_shape, shape):
    x = rng.normal(size=x_shape).astype(np.float32)
    same_as_litert("BROADCAST_TO", [x, i32(*shape)], shape, np.float32, constant=(1,),
                   version=2)


def test_broadcast_to_refuses_a_shape_it_cannot_reach():
    with pytest.raises(OperatorError, match="does not broadcast"):
        run("BROADCAST_TO", [np.ones((2, 3)), i32(4, 3)], [(4, 3)])


@pytest.mark.parametrize("x_shape, multiples", [((2, 3), (1, 1)), ((2, 3), (2, 1)),
                                                ((2, 3), (3, 2)), ((1, 2, 3), (2, 1, 3))])
def test_tile_matches_litert(x_shape, multiples):
    x = rng.normal(size=x_shape).astype(np.float32)
    shape = np.multiply(x_shape, multiples)
    same_as_litert("TILE", [x, i32(*multiples)], shape, np.float32, constant=(1,))


@pytest.mark.parametrize("axes, keep_dims", [((1,), False), ((0, 2), True), ((-1,), False)])
def test_reduce_prod_matches_litert(axes, keep_dims):
    x = rng.uniform(0.5, 1.5, (2, 3, 4)).astype(np.float32)
    x[0, 1, 2] = 0
    (want,) = tflite_run("REDUCE_PROD", [x, i32(*axes)], [(1,)], constant=(1,),
                         keep_dims=keep_dims)
    (got,) = run("REDUCE_PROD", [x, i32(*axes)], [want.shape], dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumsum_matches_litert(axis, exclusive, reverse):
    x = rng.normal(size=(3, 4, 5)).astype(np.float32)
    (want,) = tflite_run("CUMSUM", [x, i32(axis).reshape(())], [x.shape], constant=(1,),
                         exclusive=exclusive, reverse=reverse)
    (got,) = run("CUMSUM", [x, i32(axis).reshape(())], [x.shape], dtype=np.float32,
                 exclusive=exclusive, reverse=reverse)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cumsum_of_int_matches_litert():
    x = small((4, 3), np.int32)
    same_as_litert("CUMSUM", [x, i32(0).reshape(())], x.shape, np.int32, constant=(1,),
                   exclusive=True)


@pytest.mark.parametrize("zeros", [(), ((0, 1),), ((0, 1), (1, 2)), ((0, 1), (0, 3)),
                                   ((0, 0), (0, 1), (0, 2), (0, 3))])
@pytest.mark.parametrize("axes, keep_dims", [((1,), False), ((0, 1), True)])
def test_reduce_prod_grad_is_right_where_elements_are_zero(zeros, axes, keep_dims):
    """No zero in a group: dY·P/X; one zero: only that element gets the product of
    the others; two: nothing.  Against torch float64 and finite differences."""
    x = rng.uniform(0.5, 2, (2, 4)) * rng.choice([-1, 1], (2, 4))
    for at in zeros:
        x[at] = 0
    xt = torch.tensor(x, requires_grad=True)
    y = torch.prod(xt.reshape(2, 4) if axes == (1,) else xt.reshape(1, 8), dim=1)
    y = y.reshape(1, 1) if keep_dims else y
    dy = rng.normal(size=tuple(y.shape))
    y.backward(torch.tensor(dy))
    (dx,) = run("ReduceProdGrad", [dy, x], [x.shape], axis=list(axes), keep_dims=keep_dims)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-13, atol=1e-15)

    def forward(v):
        return run("REDUCE_PROD", [v, i32(*axes)], [dy.shape])[0]
    np.testing.assert_allclose(dx, numeric_grad(forward, x, dy), rtol=1e-6, atol=1e-8)
