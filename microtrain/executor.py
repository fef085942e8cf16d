"""The training step, prepared once: every tensor gets its array at load time and
every operator becomes a closure over those arrays, so a step is a flat list of
kernel calls.

All arrays are allocated for the largest batch.  A smaller (partial last) batch
runs a second list of closures over the leading rows of the same arrays.
"""
from dataclasses import dataclass

import numpy as np

from .artifacts import Artifacts
from .errors import UserError
from .graph import BATCH, Graph, concrete_shape
from .kernels import KERNELS, build


def _float(dtype) -> np.dtype:
    return np.dtype(np.float32) if np.issubdtype(dtype, np.floating) else np.dtype(dtype)


def _check_kernels(g: Graph, path) -> None:
    for op in g.ops:
        if op.type not in KERNELS:
            raise UserError(path, f"operator {op.index} ({op.type}) is not supported by microtrain")


class Memory:
    """Every array of the forward and backprop graphs, allocated for `batch` rows."""

    def __init__(self, art: Artifacts, batch: int):
        trainable = list(art.training["trainable"])
        sizes = [art.weights[t].size for t in trainable]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.params = np.empty(offsets[-1], np.float32)  # fp32 master copy of all weights
        self.grads = np.zeros(offsets[-1], np.float32)
        self.param_views, self.grad_views = {}, {}
        for t, lo, hi in zip(trainable, offsets, offsets[1:]):
            self.param_views[t] = self.params[lo:hi].reshape(art.weights[t].shape)
            self.param_views[t][...] = art.weights[t]
            self.grad_views[t] = self.grads[lo:hi].reshape(art.weights[t].shape)
        self.forward = self._allocate(art.forward, batch, self.param_views)
        self.backprop = None
        if art.backprop is not None:
            aliases = {b: self.forward[f] for b, f in art.links["forward"]}
            aliases.update({g: self.grad_views[t] for g, t in art.links["gradients"]})
            self.backprop = self._allocate(art.backprop, batch, aliases)

    @staticmethod
    def _allocate(g: Graph, batch: int, given: dict) -> list:
        arrays = []
        for t in g.tensors:
            if t.index in given:
                arrays.append(given[t.index])
            elif t.data is not None:
                arrays.append(np.ascontiguousarray(t.data, _float(t.dtype)))
            else:
                arrays.append(np.zeros(concrete_shape(t.shape, batch), _float(t.dtype)))
        return arrays

    def nbytes(self) -> int:
        seen, total = set(), 0
        for arr in self.forward + (self.backprop or []):
            base = arr if arr.base is None else arr.base
            if id(base) not in seen:
                seen.add(id(base))
                total += base.nbytes
        return total


@dataclass
class Plan:
    """The closures and input/output views of one batch size."""
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]
    targets: list[np.ndarray]
    loss: np.ndarray | None
    forward: list
    backward: list
    loss_ops: list  # the loss operators alone, for evaluation

    def run_forward(self) -> None:
        for step in self.forward:
            step()

    def run_backward(self) -> None:
        for step in self.backward:
            step()

    def run_loss(self) -> None:
        for step in self.loss_ops:
            step()


def _views(g: Graph, arrays: list, rows: int) -> list:
    """Each batch-shaped array cut to its first `rows` rows."""
    return [a[:rows] if t.shape and t.shape[0] == BATCH else a for t, a in zip(g.tensors, arrays)]


def _closures(g: Graph, arrays: list, ops=None) -> list:
    return [build(op.type, [arrays[i] if i >= 0 else None for i in op.inputs],
                  [arrays[i] for i in op.outputs], **op.options)
            for op in (g.ops if ops is None else ops)]


def compile_plan(art: Artifacts, mem: Memory, rows: int) -> Plan:
    fwd = _views(art.forward, mem.forward, rows)
    plan = Plan([fwd[i] for i in art.forward.inputs], [fwd[i] for i in art.forward.outputs],
                [], None, _closures(art.forward, fwd), [], [])
    if art.backprop is not None:
        bp = _views(art.backprop, mem.backprop, rows)
        plan.targets = [bp[i] for i in art.links["targets"]]
        plan.loss = bp[art.links["loss"]]
        plan.backward = _closures(art.backprop, bp)
        plan.loss_ops = _closures(art.backprop, bp, [op for op in art.backprop.ops
                                                    if op.type in ("Loss", "LogitsLoss")])
        _add_loss_total(art, bp, plan)
    return plan


def _add_loss_total(art: Artifacts, bp: list, plan: Plan) -> None:
    """With several outputs the loss is their sum: evaluation needs that op too."""
    totals = [op for op in art.backprop.ops if art.links["loss"] in op.outputs
              and op.type not in ("Loss", "LogitsLoss")]
    plan.loss_ops += _closures(art.backprop, bp, totals)


def check_supported(art: Artifacts) -> None:
    _check_kernels(art.forward, art.frozen_path)
    if art.backprop is not None:
        _check_kernels(art.backprop, art.backprop_path)
