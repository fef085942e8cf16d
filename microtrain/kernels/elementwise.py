"""Elementwise arithmetic kernels (numpy broadcasting) and SumToShape."""
from functools import partial

import numpy as np

from . import kernel
from .activations import then_activate


def _binary(ufunc):
    def factory(inputs, outputs, fused_activation_function=0, **_):
        (a, b), (y,) = inputs, outputs
        return then_activate(partial(ufunc, a, b, out=y), fused_activation_function, y)
    return factory


# y = act(a op b), a and b broadcast against each other to y's shape.
for _name, _ufunc in (("ADD", np.add), ("SUB", np.subtract),
                      ("MUL", np.multiply), ("DIV", np.divide)):
    kernel(_name)(_binary(_ufunc))


@kernel("NEG")
def neg(inputs, outputs, **_):
    """y = -x."""
    return partial(np.negative, inputs[0], out=outputs[0])


@kernel("ADD_N")
def add_n(inputs, outputs, **_):
    """y = x0 + x1 + ... over any number of inputs."""
    (y,) = outputs
    first, *rest = inputs
    if not rest:
        return partial(np.copyto, y, first)
    adds = [partial(np.add, first, rest[0], out=y)]
    adds += [partial(np.add, y, x, out=y) for x in rest[1:]]

    def step():
        for add in adds:
            add()
    return step


@kernel("SumToShape")
def sum_to_shape(inputs, outputs, **_):
    """dX = dY summed over the axes that broadcasting expanded dX's shape
    along (numpy rules: shapes right-aligned, missing leading axes are 1)."""
    (dy,), (dx,) = inputs, outputs
    lead = dy.ndim - dx.ndim
    kept_shape = (1,) * lead + dx.shape  # dX at dY's rank
    if lead < 0 or any(k not in (1, d) for k, d in zip(kept_shape, dy.shape)):
        raise ValueError(f"SumToShape: {dx.shape} does not broadcast to {dy.shape}")
    kept = dx.reshape(kept_shape)
    axes = tuple(i for i, (k, d) in enumerate(zip(kept.shape, dy.shape)) if k != d)
    if not axes:
        return partial(np.copyto, kept, dy)
    return partial(np.add.reduce, dy, axis=axes, keepdims=True, out=kept)
