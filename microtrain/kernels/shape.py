"""Shape kernels: data movement with every index worked out in the factory.

Constant inputs (RESHAPE's shape, PAD's paddings, SLICE's begin and size,
TRANSPOSE's perm, MEAN's axis) never change between calls, so the factories
read their values at build time.
"""
from functools import partial
from math import prod

import numpy as np

from ..errors import OperatorError
from . import kernel
from .activations import noop, then_activate


def _check_shape(op, view, y):
    if view.shape != y.shape:
        raise OperatorError(None, f"{op}: computed shape {view.shape} but the output is {y.shape}")


@kernel("RESHAPE")
@kernel("SQUEEZE")
def reshape(inputs, outputs, **_):
    """y = x with y's shape (the output's shape is authoritative): a copy, or
    nothing when x and y already share their memory."""
    x, (y,) = inputs[0], outputs
    if x.size != y.size:
        raise OperatorError(None, f"RESHAPE: {x.shape} does not hold {y.size} elements")
    if x.ctypes.data == y.ctypes.data and x.dtype == y.dtype:
        return noop
    return partial(np.copyto, y, x.reshape(y.shape))


@kernel("CONCATENATION")
def concatenation(inputs, outputs, axis=0, fused_activation_function=0, **_):
    """y = act(concatenate(inputs, axis)); axis may be negative."""
    (y,) = outputs
    join = partial(np.concatenate, list(inputs), axis=axis, out=y)
    return then_activate(join, fused_activation_function, y)


@kernel("PAD")
def pad(inputs, outputs, **_):
    """y = x with paddings[i] = (before, after) zeros around axis i."""
    x, paddings = inputs[:2]
    (y,) = outputs
    inner = y[tuple(slice(before, before + n)
                    for (before, _), n in zip(paddings.tolist(), x.shape))]
    _check_shape("PAD", inner, x)

    def step():
        y.fill(0)
        np.copyto(inner, x)
    return step


@kernel("SLICE")
def slice_(inputs, outputs, **_):
    """y = x[begin : begin + size] per axis; size -1 runs to the end."""
    x, begin, size = inputs[:3]
    (y,) = outputs
    view = x[tuple(slice(b, None if s == -1 else b + s)
                   for b, s in zip(begin.tolist(), size.tolist()))]
    _check_shape("SLICE", view, y)
    return partial(np.copyto, y, view)


@kernel("TRANSPOSE")
def transpose(inputs, outputs, **_):
    """y = x with its axes permuted: y.shape[i] = x.shape[perm[i]]."""
    x, perm = inputs[:2]
    (y,) = outputs
    view = x.transpose(perm.tolist())
    _check_shape("TRANSPOSE", view, y)
    return partial(np.copyto, y, view)


def _reduction(shape, axis):
    """(reduced axes, shape with those axes kept as 1, reduced element count)
    for axis values that may be negative or repeated."""
    axes = tuple(sorted({a % len(shape) for a in np.atleast_1d(axis).astype(int).tolist()}))
    kept = tuple(1 if i in axes else d for i, d in enumerate(shape))
    return axes, kept, prod(shape[a] for a in axes)


@kernel("MEAN")
def mean(inputs, outputs, **_):
    """y = mean of x over the constant `axis` input (keep_dims only decides
    y's shape, which is given)."""
    x, axis = inputs[:2]
    (y,) = outputs
    axes, kept, count = _reduction(x.shape, axis)
    y_kept = y.reshape(kept)

    def step():
        np.add.reduce(x, axis=axes, keepdims=True, out=y_kept)
        np.divide(y_kept, count, out=y_kept)
    return step


@kernel("MeanGrad")
def mean_grad(inputs, outputs, axis=(), **_):
    """dX = dY broadcast back over the reduced axes / reduced element count."""
    (dy,), (dx,) = inputs, outputs
    _, kept, count = _reduction(dx.shape, axis)
    return partial(np.divide, dy.reshape(kept), count, out=dx)
