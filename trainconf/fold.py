"""Fold shape-computing chains into constants.

The TFLite converter turns a dynamic-batch Flatten into SHAPE -> STRIDED_SLICE ->
PACK -> RESHAPE.  Those ops compute on shapes, not data, so their results are
known at split time once the batch dimension is written as -1 (which RESHAPE
accepts as "infer this dimension").
"""
import numpy as np

from microtrain.errors import UserError
from microtrain.graph import Graph, Op
from microtrain.kernels.shape import strided_index


def shape(g: Graph, op: Op, values):
    return np.array(g.tensors[op.inputs[0]].shape, np.int32)


def strided_slice(g: Graph, op: Op, values):
    x, begin, end, strides = (values[t] for t in op.inputs)
    return np.asarray(x[strided_index(x.ndim, begin, end, strides, **op.options)])


def pack(g: Graph, op: Op, values):
    return np.stack([values[t] for t in op.inputs], axis=op.options.get("axis", 0))


def concatenation(g: Graph, op: Op, values):
    return np.concatenate([values[t] for t in op.inputs], axis=op.options.get("axis", 0))


def fold_shape_chains(g: Graph, folds: dict) -> tuple[set[int], dict[int, np.ndarray]]:
    """Ops to delete and the constant value of each tensor they produced that
    a remaining op reads; `folds` maps an operator to its value function (of
    trainconf/operators.py)."""
    values = {t.index: t.data for t in g.tensors if t.data is not None}
    folded: set[int] = set()
    for op in g.ops:
        fn = folds.get(op.type)
        known = op.type == "SHAPE" or all(t in values for t in op.inputs if t >= 0)
        if fn is None or not known or (op.type == "CONCATENATION" and not _ints(values, op)):
            continue
        try:
            values[op.outputs[0]] = fn(g, op, values)
        except (ValueError, IndexError, TypeError) as e:  # shapes or indices that do not fit
            raise UserError(None, f"operator {op.index} ({op.type}) cannot be folded: {e}") \
                from None
        folded.add(op.index)
    read = {t for op in g.ops if op.index not in folded for t in op.inputs}
    produced = {t for i in folded for t in g.ops[i].outputs}
    return folded, {t: values[t] for t in produced & read}


def _ints(values, op: Op) -> bool:
    return all(np.issubdtype(values[t].dtype, np.integer) for t in op.inputs)
