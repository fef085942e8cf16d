"""Values of shape-computing operators, for folding them into constants.

The TFLite converter turns a dynamic-batch Flatten into SHAPE -> STRIDED_SLICE ->
PACK -> RESHAPE, and a dense layer over a sequence into SHAPE -> GATHER ->
REDUCE_PROD -> PACK -> RESHAPE.  Those ops compute on shapes, not data, so their
results are known at split time once the batch dimension is symbolic: a product
with the batch's -1 in it is itself symbolic (-16: sixteen rows a sample), which
is how trainconf/batch.py reads a folded RESHAPE target.
"""
import numpy as np

from microtrain.files.graph import Graph, Op
from microtrain.step.kernels.shape import strided_index


def shape(g: Graph, op: Op, values):
    return np.array(g.tensors[op.inputs[0]].shape, np.int32)


def strided_slice(g: Graph, op: Op, values):
    x, begin, end, strides = (values[t] for t in op.inputs)
    return np.asarray(x[strided_index(x.ndim, begin, end, strides, **op.options)])


def pack(g: Graph, op: Op, values):
    return np.stack([values[t] for t in op.inputs], axis=op.options.get("axis", 0))


def concatenation(g: Graph, op: Op, values):
    return np.concatenate([values[t] for t in op.inputs], axis=op.options.get("axis", 0))


def gather(g: Graph, op: Op, values):
    params, indices = values[op.inputs[0]], values[op.inputs[1]]
    return np.take(params, indices, axis=op.options.get("axis", 0))


def reduce_prod(g: Graph, op: Op, values):
    axis = tuple(int(a) for a in np.atleast_1d(values[op.inputs[1]]))
    x = values[op.inputs[0]]
    return np.prod(x, axis=axis, keepdims=bool(op.options.get("keep_dims"))).astype(x.dtype)
