"""Comparisons and logic (bool outputs), SELECT, CAST, ONE_HOT, ARG_MAX/ARG_MIN:
the operators of masks and ids, which carry no gradient of their own but for
SELECT's branches and a float-to-float CAST."""
from functools import partial

import numpy as np

from microtrain.files.errors import OperatorError
from microtrain.step.kernels import kernel
from microtrain.step.kernels.workspace import scratch


def _binary(ufunc):
    def factory(inputs, outputs, **_):
        (a, b), (y,) = inputs, outputs
        return partial(ufunc, a, b, out=y)
    return factory


# y = a op b, a and b broadcast against each other to y's shape.
for _name, _ufunc in (("LESS", np.less), ("LESS_EQUAL", np.less_equal), ("GREATER", np.greater),
                      ("GREATER_EQUAL", np.greater_equal), ("EQUAL", np.equal),
                      ("NOT_EQUAL", np.not_equal), ("LOGICAL_AND", np.logical_and),
                      ("LOGICAL_OR", np.logical_or)):
    kernel(_name)(_binary(_ufunc))


@kernel("LOGICAL_NOT")
def logical_not(inputs, outputs, **_):
    return partial(np.logical_not, inputs[0], out=outputs[0])


def aligned_condition(cond: np.ndarray, rank: int, first_axis: bool) -> np.ndarray:
    """SELECT's condition as it broadcasts against branches of `rank` axes: a
    rank-1 condition of SELECT (first_axis) picks whole slices along the first
    axis; otherwise it broadcasts as numpy does (SELECT_V2)."""
    if first_axis and cond.ndim == 1 and rank > 1:
        return cond.reshape(cond.shape + (1,) * (rank - 1))
    return cond


def _select(first_axis):
    def factory(inputs, outputs, **_):
        """y = a where cond else b, the three broadcast to y's shape."""
        (cond, a, b), (y,) = inputs, outputs
        mask = aligned_condition(cond, y.ndim, first_axis)
        try:
            np.broadcast_shapes(mask.shape, a.shape, b.shape, y.shape)
        except ValueError:
            raise OperatorError(None, f"SELECT: condition {cond.shape} and branches {a.shape}, "
                                      f"{b.shape} do not broadcast to {y.shape}") from None

        def step():
            np.copyto(y, b)
            np.copyto(y, a, where=mask)
        return step
    return factory


kernel("SELECT")(_select(first_axis=True))
kernel("SELECT_V2")(_select(first_axis=False))


@kernel("CAST")
def cast(inputs, outputs, **_):
    """y = x converted to y's type as C does: floats to integers truncate
    toward zero, to bool any non-zero is true."""
    return partial(np.copyto, outputs[0], inputs[0], casting="unsafe")


@kernel("ONE_HOT")
def one_hot(inputs, outputs, axis=-1, **_):
    """y = on_value at position indices[...] along the new axis `axis` (of size
    depth), off_value elsewhere; an index outside [0, depth) gives only off_value."""
    indices, _depth, on, off = inputs[:4]
    (y,) = outputs
    axis %= y.ndim
    classes = np.arange(y.shape[axis]).reshape((-1,) + (1,) * (y.ndim - 1 - axis))
    picks = np.expand_dims(indices, axis)
    hot = scratch(y.shape, bool)

    def step():
        np.equal(picks, classes, out=hot)
        np.copyto(y, off.reshape(()))
        np.copyto(y, on.reshape(()), where=hot)
    return step


def _arg(pick):
    def factory(inputs, outputs, **_):
        """y = the index of the first extreme element along the constant axis
        (input 1), in y's integer type (int32 or int64 per output_type)."""
        x, axis = inputs[:2]
        (y,) = outputs
        axis = int(np.asarray(axis).reshape(-1)[0]) % x.ndim
        if y.dtype == np.intp:
            return partial(pick, x, axis=axis, out=y)
        index = scratch(y.shape, np.intp)

        def step():
            pick(x, axis=axis, out=index)
            np.copyto(y, index, casting="unsafe")
        return step
    return factory


kernel("ARG_MAX")(_arg(np.argmax))
kernel("ARG_MIN")(_arg(np.argmin))
