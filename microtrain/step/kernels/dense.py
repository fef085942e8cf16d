"""Fully connected and batched matrix product kernels and their gradients.

2-D products use np.dot with out=: it needs a C-contiguous output of the
product's dtype (our reshaped views are) and skips matmul's ufunc overhead.
"""
from functools import partial

import numpy as np

from microtrain.step.kernels import kernel
from microtrain.step.kernels.activations import bind_activation, filled


@kernel("FULLY_CONNECTED", rows="each")
def fully_connected(inputs, outputs, fused_activation_function=0, **_):
    """y = act(x2 @ W.T + b) with x2 = x reshaped [-1, in]; y's own shape
    already encodes keep_num_dims."""
    x, w, b = (*inputs, None)[:3]  # the bias may be None or left off
    (y,) = outputs
    x2, y2, wt = x.reshape(-1, w.shape[1]), y.reshape(-1, w.shape[0]), w.T
    act = bind_activation(fused_activation_function, y2)

    def step():
        np.dot(x2, wt, out=y2)
        if b is not None:
            np.add(y2, b, out=y2)
        act()
    return step


@kernel("BATCH_MATMUL")
def batch_matmul(inputs, outputs, adj_x=False, adj_y=False, **_):
    """out = op(x) @ op(y) over numpy-broadcast batch dims; op transposes the
    last two axes when adj_* is set."""
    x, y = inputs
    (out,) = outputs
    a = x.swapaxes(-1, -2) if adj_x else x
    b = y.swapaxes(-1, -2) if adj_y else y
    return partial(np.matmul, a, b, out=out)


@kernel("FullyConnectedInputGrad", rows="each")
def fully_connected_input_grad(inputs, outputs, **_):
    """dX = reshape(dY2 @ W, X.shape) with dY2 = dY reshaped [-1, out]."""
    (dy, w), (dx,) = inputs, outputs
    out_size, in_size = w.shape
    return partial(np.dot, dy.reshape(-1, out_size), w, out=dx.reshape(-1, in_size))


@kernel("FullyConnectedWeightGrad", rows="sum")
def fully_connected_weight_grad(inputs, outputs, **_):
    """dW = dY2.T @ X2 (dY2, X2: dY, X reshaped [-1, out], [-1, in])."""
    (dy, x), (dw,) = inputs, outputs
    out_size, in_size = dw.shape
    return partial(np.dot, dy.reshape(-1, out_size).T, x.reshape(-1, in_size), out=dw)


@kernel("BiasGrad", rows="sum")
def bias_grad(inputs, outputs, **_):
    """dB = sum of dY over all axes but the last, as ones @ dY2 (a BLAS gemv
    is ~3x faster than np.add.reduce over axis 0 on small batches)."""
    (dy,), (db,) = inputs, outputs
    dy2 = dy.reshape(-1, db.size)
    return partial(np.dot, filled(dy2.shape[:1], dy.dtype, 1), dy2, out=db.reshape(-1))
