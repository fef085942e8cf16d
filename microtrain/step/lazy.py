"""The lazy update of embedding tables: a step updates only the rows its ids
touched (and their optimizer state), as TF-Addons' LazyAdam and PyTorch's
SparseAdam do, instead of every row as Keras does (the default, `dense`).

A table trains lazily when its whole gradient is one GatherGrad over its rows
(a table also read as a dense layer's weight, or trained in some rows only,
keeps the dense update).  Its gradient is then held as the touched rows alone
(`RowGrad`, at most min(rows, ids per step) of them) instead of a whole table,
and no step passes over the table: the gradient kernel writes those rows, the
optimizer gathers their weights and state, updates them and scatters them back.
"""
from dataclasses import dataclass
from math import prod

import numpy as np

from microtrain.files.errors import UserError
from microtrain.files.graph import concrete_shape
from microtrain.step.kernels import prepare

EMBEDDING_UPDATES = {
    "dense": "every row every step, as Keras (an untouched row's zero gradient still decays "
             "its moments and moves it by them)",
    "lazy": "only the rows the step's ids touched, and their optimizer state, as TF-Addons' "
            "LazyAdam and PyTorch's SparseAdam; other weights stay dense",
}
DEFAULT_EMBEDDING_UPDATE = "dense"


@dataclass
class LazyTable:
    """A trainable table that updates lazily, and where its gradient comes from."""
    weight: int  # the table, a forward tensor
    grad: int  # its gradient, a backprop tensor
    op: int  # the GatherGrad writing it, an operator of the backprop graph
    rows: int
    width: int  # elements of a row
    ids: int  # the ids per run of the graph (at the trainer's rows per run)

    def capacity(self, runs: int = 1) -> int:
        """Rows a gradient summed over `runs` runs of the graph may touch."""
        return min(self.rows, self.ids * runs)


def check_embedding_update(name: str) -> None:
    if name not in EMBEDDING_UPDATES:
        raise UserError(None, f"unknown embedding update {name!r} (choose from "
                              f"{', '.join(EMBEDDING_UPDATES)})")


def check_lazy(art, loss_scale: str) -> None:
    """Refuse, in one line, what the lazy update does not support."""
    p = art.training.precision
    if {p.weights, p.activations, p.gradients} != {"fp32"}:
        raise UserError(art.frozen_path, "--embedding-update lazy needs fp32 weights, "
                                         "activations and gradients (split without --precision)")
    if loss_scale != "none":
        raise UserError(None, "--embedding-update lazy trains in fp32 without loss scaling: "
                              f"give --loss-scale none, not {loss_scale}")


def row_gradients(backprop, links) -> dict:
    """Weight gradient -> the GatherGrad over rows (axis 0) writing it, for each
    gradient no operator reads: the tables that may update lazily."""
    writer = {t: op for op in backprop.ops for t in op.outputs}
    read = {t for op in backprop.ops for t in op.inputs}
    return {grad: writer[grad] for grad, _ in links.gradients
            if grad in writer and writer[grad].type == "GatherGrad"
            and writer[grad].options.get("axis", 0) == 0 and grad not in read}


def lazy_tables(art, run_rows: int) -> dict[int, LazyTable]:
    """Trainable table -> its LazyTable, for each table that can update lazily
    when the graph runs `run_rows` samples at a time."""
    gathered = row_gradients(art.backprop, art.links)
    tables = {}
    for grad, weight in art.links.gradients:
        op = gathered.get(grad)
        if op is None or weight in art.training.rows:
            continue
        shape = art.weights[weight].shape
        ids = art.backprop.tensors[op.inputs[1]].shape
        tables[weight] = LazyTable(weight, grad, op.index, shape[0], prod(shape[1:]),
                                   prod(concrete_shape(ids, run_rows)))
    return tables


class RowGrad:
    """A table's gradient as the rows it touched: `ids[:count]` (distinct, sorted)
    and their gradient `values[:count]`; room for `capacity` rows."""

    def __init__(self, capacity: int, width: int):
        self.ids = np.zeros(capacity, np.int64)
        self.values = np.zeros((capacity, width), np.float32)
        self.counter = np.zeros(1, np.int64)  # the kernel's output

    @property
    def count(self) -> int:
        return int(self.counter[0])

    def touched(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.count
        return self.ids[:k], self.values[:k]

    def kernel(self, op, inputs: list, rows: int):
        """The closure of the table's GatherGrad `op` (float32 only), writing the
        touched rows here instead of a whole `rows`-row gradient."""
        return prepare("GatherRowsGrad", inputs, [self.ids, self.values, self.counter],
                       rows=rows, **op.options)


class RowSum(RowGrad):
    """The running sum of RowGrads (accumulated batches): the union of their
    rows.  `slot` maps a table row to its place in `ids` (-1: not touched yet),
    so adding one is a pass over its rows, never over the table."""

    def __init__(self, capacity: int, width: int, rows: int):
        super().__init__(capacity, width)
        self.slot = np.full(rows, -1, np.int32 if rows < 2 ** 31 else np.int64)

    def add(self, grad: RowGrad, weight: np.float32) -> None:
        ids, values = grad.touched()
        k = self.count
        new = ids[self.slot[ids] < 0]
        self.slot[new] = np.arange(k, k + new.size)
        self.ids[k:k + new.size] = new
        self.values[k:k + new.size] = 0
        self.counter[0] = k + new.size
        self.values[self.slot[ids]] += values * weight  # ids are distinct: no lost adds

    def clear(self) -> None:
        self.slot[self.ids[:self.count]] = -1
        self.counter[0] = 0
