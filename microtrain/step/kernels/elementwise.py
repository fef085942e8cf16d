"""Elementwise arithmetic kernels (numpy broadcasting) and SumToShape."""
from functools import partial

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.step.kernels import kernel
from microtrain.step.kernels.activations import constant, then_activate
from microtrain.step.kernels.workspace import scratch


def _binary(ufunc):
    def factory(inputs, outputs, fused_activation_function=0, **_):
        (a, b), (y,) = inputs, outputs
        return then_activate(partial(ufunc, a, b, out=y), fused_activation_function, y)
    return factory


# y = act(a op b), a and b broadcast against each other to y's shape.
for _name, _ufunc in (("ADD", np.add), ("SUB", np.subtract), ("MUL", np.multiply),
                      ("DIV", np.divide), ("MAXIMUM", np.maximum), ("MINIMUM", np.minimum)):
    kernel(_name, rows="each")(_binary(_ufunc))


@kernel("NEG", rows="each")
def neg(inputs, outputs, **_):
    """y = -x."""
    return partial(np.negative, inputs[0], out=outputs[0])


@kernel("ADD_N", rows="each")
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


def sum_to(dy, dx):
    """A step writing dx = dy summed over the axes along which broadcasting
    expanded dx's shape to dy's (numpy rules: shapes right-aligned, missing
    leading axes are 1)."""
    lead = dy.ndim - dx.ndim
    kept_shape = (1,) * lead + dx.shape  # dX at dY's rank
    if lead < 0 or any(k not in (1, d) for k, d in zip(kept_shape, dy.shape)):
        raise OperatorError(None, f"SumToShape: {dx.shape} does not broadcast to {dy.shape}")
    kept = dx.reshape(kept_shape)
    axes = tuple(i for i, (k, d) in enumerate(zip(kept.shape, dy.shape)) if k != d)
    if not axes:
        return partial(np.copyto, kept, dy)
    return partial(np.add.reduce, dy, axis=axes, keepdims=True, out=kept)


@kernel("SumToShape")
def sum_to_shape(inputs, outputs, **_):
    """dX = dY summed down to dX's shape (see sum_to)."""
    return sum_to(inputs[0], outputs[0])


def _where_positive(x, src, alpha, out):
    """A step writing out = src where x >= 0 else alpha·src."""
    positive = scratch(x.shape, bool)
    zero = constant(x, 0)

    def step():
        np.greater_equal(x, zero, out=positive)
        np.multiply(src, alpha, out=out)
        np.copyto(out, src, where=positive)
    return step


@kernel("PRELU")
def prelu(inputs, outputs, **_):
    """y = x where x >= 0 else alpha·x, alpha (a weight that may train)
    broadcast against x."""
    (x, alpha), (y,) = inputs, outputs
    return _where_positive(x, x, alpha, y)


@kernel("PReluInputGrad")
def prelu_input_grad(inputs, outputs, **_):
    """dX = dY where X >= 0 else alpha·dY."""
    (dy, x, alpha), (dx,) = inputs, outputs
    return _where_positive(x, dy, alpha, dx)


@kernel("PReluAlphaGrad")
def prelu_alpha_grad(inputs, outputs, **_):
    """dAlpha = dY·min(X, 0) summed over the axes along which alpha was broadcast."""
    (dy, x), (dalpha,) = inputs, outputs
    product = scratch(x.shape, x.dtype)
    reduce = sum_to(product, dalpha)

    def step():
        np.minimum(x, 0.0, out=product)
        np.multiply(product, dy, out=product)
        reduce()
    return step


def _rsqrt(x, out):
    np.sqrt(x, out=out)
    np.reciprocal(out, out=out)


# y = f(x) elementwise; RSQRT as 1/sqrt(x) like TFLite.
for _name, _fn in (("EXP", np.exp), ("LOG", np.log), ("SQRT", np.sqrt), ("SQUARE", np.square),
                   ("RSQRT", _rsqrt)):
    kernel(_name, rows="each")(
        lambda inputs, outputs, fn=_fn, **_: partial(fn, inputs[0], out=outputs[0]))


@kernel("SQUARED_DIFFERENCE", rows="each")
def squared_difference(inputs, outputs, **_):
    """y = (a - b)², a and b broadcast."""
    (a, b), (y,) = inputs, outputs

    def step():
        np.subtract(a, b, out=y)
        np.square(y, out=y)
    return step


@kernel("PickGrad")
def pick_grad(inputs, outputs, op="maximum", operand=0, **_):
    """Gradient of MAXIMUM/MINIMUM(A, B) for one operand, at dY's (broadcast)
    shape: dY where that operand was picked, else 0.  Ties go to A (operand 0),
    as in TensorFlow."""
    (dy, a, b), (dx,) = inputs, outputs
    compare = {("maximum", 0): np.greater_equal, ("maximum", 1): np.less,
               ("minimum", 0): np.less_equal, ("minimum", 1): np.greater}[op, operand]
    picked = scratch(dy.shape, bool)

    def step():
        compare(a, b, out=picked)
        np.multiply(dy, picked, out=dx)
    return step
