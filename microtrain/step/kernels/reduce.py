"""Reductions over constant axes (MEAN, SUM, REDUCE_MAX, REDUCE_PROD),
L2_NORMALIZATION over the last axis, CUMSUM, and their gradients."""
from functools import partial
from math import prod

import numpy as np

from microtrain.step.kernels import kernel
from microtrain.step.kernels.activations import row_sums, rows, then_activate
from microtrain.step.kernels.workspace import scratch


def _reduction(shape, axis):
    """(reduced axes, shape with those axes kept as 1, reduced element count)
    for axis values that may be negative or repeated."""
    axes = tuple(sorted({a % len(shape) for a in np.atleast_1d(axis).astype(int).tolist()}))
    kept = tuple(1 if i in axes else d for i, d in enumerate(shape))
    return axes, kept, prod(shape[a] for a in axes)


def _reduce(ufunc, divide=False):
    """y = ufunc reduced over the constant `axis` input (keep_dims only decides
    y's shape, which is given); MEAN divides by the reduced element count."""
    def factory(inputs, outputs, **_):
        x, axis = inputs[:2]
        (y,) = outputs
        axes, kept, count = _reduction(x.shape, axis)
        y_kept = y.reshape(kept)

        def step():
            ufunc.reduce(x, axis=axes, keepdims=True, out=y_kept)
            if divide:
                np.divide(y_kept, count, out=y_kept)
        return step
    return factory


kernel("MEAN")(_reduce(np.add, divide=True))
kernel("SUM")(_reduce(np.add))
kernel("REDUCE_MAX")(_reduce(np.maximum))


@kernel("MeanGrad")
def mean_grad(inputs, outputs, axis=(), **_):
    """dX = dY broadcast back over the reduced axes / reduced element count."""
    (dy,), (dx,) = inputs, outputs
    _, kept, count = _reduction(dx.shape, axis)
    return partial(np.divide, dy.reshape(kept), count, out=dx)


@kernel("SumGrad")
def sum_grad(inputs, outputs, axis=(), **_):
    """dX = dY broadcast back over the reduced axes."""
    (dy,), (dx,) = inputs, outputs
    _, kept, _ = _reduction(dx.shape, axis)
    return partial(np.copyto, dx, dy.reshape(kept))


@kernel("ReduceMaxGrad")
def reduce_max_grad(inputs, outputs, axis=(), **_):
    """dX = dY at the maxima of X over the reduced axes, shared equally among
    tied maxima (as TensorFlow and PyTorch's amax)."""
    (dy, x, y), (dx,) = inputs, outputs
    axes, kept, _ = _reduction(dx.shape, axis)
    dy_kept, y_kept = dy.reshape(kept), y.reshape(kept)
    hit = scratch(dx.shape, bool)
    share = scratch(kept, dx.dtype)

    def step():
        np.equal(x, y_kept, out=hit)
        np.add.reduce(hit, axis=axes, keepdims=True, out=share)
        np.divide(dy_kept, share, out=share)
        np.multiply(hit, share, out=dx)
    return step


EPSILON = 1e-6  # TFLite's floor on the norm


def _row_norms(x2, squares, norms):
    """A step writing norms = max(‖row‖, ε) for each row of the 2-D x2;
    squares is a temporary shaped like x2."""
    total = row_sums(squares, norms)

    def step():
        np.multiply(x2, x2, out=squares)
        total()
        np.sqrt(norms, out=norms)
        np.maximum(norms, EPSILON, out=norms)
    return step


@kernel("L2_NORMALIZATION")
def l2_normalization(inputs, outputs, fused_activation_function=0, **_):
    """y = act(x / max(‖x‖, 1e-6)), the norm over the last axis."""
    (x,), (y,) = inputs, outputs
    x2, y2 = rows(x), rows(y)
    norms = scratch((x2.shape[0], 1), x.dtype)
    measure = _row_norms(x2, y2, norms)

    def step():
        measure()
        np.divide(x2, norms, out=y2)
    return then_activate(step, fused_activation_function, y)


@kernel("L2NormalizationGrad")
def l2_normalization_grad(inputs, outputs, **_):
    """dX = (dY - Y·Σ_last(dY·Y)) / ‖X‖ with Y = X/‖X‖, or dY/ε where the
    norm is at the floor ε = 1e-6 (a constant there)."""
    (dy, x), (dx,) = inputs, outputs
    dy2, x2, dx2 = rows(dy), rows(x), rows(dx)
    norms, dots = scratch((x2.shape[0], 1), x.dtype), scratch((x2.shape[0], 1), x.dtype)
    floored = scratch(norms.shape, bool)
    measure, dot_total = _row_norms(x2, dx2, norms), row_sums(dx2, dots)

    def step():
        measure()
        np.less_equal(norms, EPSILON, out=floored)
        np.multiply(dy2, x2, out=dx2)
        dot_total()  # Σ dY·X
        np.divide(dots, norms, out=dots)
        np.divide(dots, norms, out=dots)  # Σ dY·Y / ‖X‖
        np.copyto(dots, 0.0, where=floored)
        np.multiply(x2, dots, out=dx2)
        np.subtract(dy2, dx2, out=dx2)
        np.divide(dx2, norms, out=dx2)
    return step


kernel("REDUCE_PROD")(_reduce(np.multiply))


@kernel("ReduceProdGrad")
def reduce_prod_grad(inputs, outputs, axis=(), **_):
    """dX = dY times the product of the other elements of X's reduced group:
    dY·P/X with P the product of the group's non-zero elements, where no other
    element of the group is 0 (at a group's only zero that is dY·P), else 0."""
    (dy, x), (dx,) = inputs, outputs
    axes, kept, _ = _reduction(dx.shape, axis)
    dy_kept = dy.reshape(kept)
    zero = scratch(x.shape, bool)
    others = scratch(x.shape, dx.dtype)  # X with its zeros as 1, then the zeros among the others
    product, zeros = scratch(kept, dx.dtype), scratch(kept, dx.dtype)

    def step():
        np.equal(x, 0, out=zero)
        np.copyto(others, x)
        np.copyto(others, 1, where=zero)
        np.multiply.reduce(others, axis=axes, keepdims=True, out=product)
        np.multiply(product, dy_kept, out=product)
        np.divide(product, others, out=dx)
        np.add.reduce(zero, axis=axes, keepdims=True, out=zeros)
        np.subtract(zeros, zero, out=others)
        np.not_equal(others, 0, out=zero)
        np.copyto(dx, 0, where=zero)
    return step


@kernel("CUMSUM")
def cumsum(inputs, outputs, exclusive=False, reverse=False, **_):
    """y = the running sum of x along the constant axis (input 1), from the end
    with `reverse`; `exclusive` leaves each element out of its own sum."""
    x, axis = inputs[:2]
    (y,) = outputs
    axis = int(np.asarray(axis).reshape(-1)[0]) % x.ndim
    if reverse:
        x, y = np.flip(x, axis), np.flip(y, axis)
    if not exclusive:
        return partial(np.cumsum, x, axis=axis, out=y)
    lead = (slice(None),) * axis
    first, rest, before = y[lead + (slice(0, 1),)], y[lead + (slice(1, None),)], \
        x[lead + (slice(0, -1),)]

    def step():
        first.fill(0)
        np.cumsum(before, axis=axis, out=rest)
    return step
