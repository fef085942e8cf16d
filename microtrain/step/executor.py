"""The training step, prepared once: every tensor gets its array at load time and
every operator becomes a closure over those arrays, so a step is a flat list of
kernel calls.

All arrays are allocated for the largest batch.  A smaller (partial last) batch
runs a second list of closures over the leading rows of the same arrays.  The
kernels of both lists take their temporaries from one workspace
(kernels/workspace.py).
"""
import math
import operator
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from microtrain.step.arena import Arena, linear, memory_limit
from microtrain.files.artifacts import Artifacts
from microtrain.files.errors import OperatorError, UserError
from microtrain.files.graph import Graph, batched, concrete_shape
from microtrain.step.kernels import KERNELS, prepare, version_problem
from microtrain.step.kernels.fake_quant import levels_problem
from microtrain.step.kernels.quantized import check_integer_ops
from microtrain.step.kernels.workspace import Workspace, begin_kernel, scratch, sharing
from microtrain.step.lazy import RowGrad
from microtrain.files.loss_registry import LOSS_OPS
from microtrain.step.loss_scale import LossScale
from microtrain.step.precision import (F32, Rounding, Underflow, dtype_of, in_float32, narrow,
                                       reduced, storage)
from microtrain.files.quantization import op_quantization
from microtrain.step.row_tiles import tile_rows, tiled
from microtrain.step.update_order import UpdateOrder
from microtrain.files.weight_map import layout, map_buffer, weight_map


# operators that make a constant of another form (fp16, sparse) into float32: split
# removes them (trainconf/constants.py), a model run as it is keeps them
SPLIT_RESOLVES = ("DEQUANTIZE", "DENSIFY")


def _check_kernels(g: Graph, path) -> None:
    check_integer_ops(g, path)
    for op in g.ops:
        if problem := levels_problem(g, op):
            raise UserError(path, f"operator {op.index} ({op.type}) {problem}")
        if op_quantization(g, op) is not None:
            continue
        if op.type not in KERNELS:
            hint = "; `trainconf split` makes its constant plain float32: run the split model" \
                if op.type in SPLIT_RESOLVES else ""
            raise UserError(path, f"operator {op.index} ({op.type}) is not supported by "
                                  f"microtrain{hint}")
        if problem := version_problem(op.type, op.version):
            raise UserError(path, f"operator {op.index} ({op.type}) {problem}")


def precision(art: Artifacts):
    """The types of weights, activations and gradients chosen at split time."""
    return art.training.precision


class Memory:
    """Every array of the forward and backprop graphs, allocated for `batch` rows.

    The trainable weights live in one flat fp32 master buffer (the optimizer
    updates it in one go) and their gradients in another.  A weight trained only
    in some rows (`rows` in the training metadata) keeps its frozen rows just
    before or after that buffer, so that the graphs still read one contiguous
    tensor; those rows are read in place from the .wof (microtrain/files/weight_map.py).
    With fp16 weights the graphs read a rounded working copy, refreshed after
    every update.  Tensors placed by the memory plan are views into one
    arena (microtrain/step/arena.py); the others get arrays of their own.  The
    kernels' temporaries live in `workspace` (None: each kernel keeps its own).
    The tables in `lazy` (microtrain/step/lazy.py) have no place in the gradient
    buffer: their gradient is the rows a step touched, in `row_grads`.

    `reorder`: each weight updates as soon as its gradient is complete (the
    plan's `updates`), so the gradients the plan places share its smaller
    gradient buffer by their lives, instead of one flat vector holding all."""

    def __init__(self, art: Artifacts, batch: int, lazy: dict | None = None,
                 reorder: bool = False):
        self.lazy = lazy or {}
        self.reorder = reorder
        self.row_grads = {t: RowGrad(table.capacity(), table.width)
                          for t, table in self.lazy.items()}
        self.weight_dtype = dtype_of(precision(art).weights)
        self.half_weights = reduced(self.weight_dtype)
        plan = art.links.memory if art.backprop is not None else None
        _check_affordable(art, plan, batch)
        working_views = self._lay_out_weights(art)
        self.arena = Arena(plan, batch, art.backprop_path) if plan else None
        self.forward = self._allocate(art.forward, batch,
                                      {**self._planned(art.forward, "forward"), **working_views})
        self.backprop = None
        if art.backprop is not None:
            aliases = self._planned(art.backprop, "backprop")
            aliases.update({b: self.forward[f] for b, f in art.links.forward})
            aliases.update({g: self.grad_views.get(t, _NO_GRADIENT) for g, t in art.links.gradients})
            self.backprop = self._allocate(art.backprop, batch, aliases)
        self.workspace: Workspace | None = Workspace(tile=art.training.scratch_tile)

    def _lay_out_weights(self, art: Artifacts) -> dict:
        """Fill the flat buffers and views; returns the views the graphs read."""
        self.spans = spans = _trained_spans(art)  # each weight's trained elements
        sizes = [hi - lo for lo, hi in spans.values()]
        ends = np.cumsum([0] + sizes).astype(int)
        self.offsets = {t: (int(lo), int(hi)) for t, lo, hi in zip(spans, ends, ends[1:])}
        lead = spans[next(iter(spans))][0] if spans else 0  # none: a model run as it is
        starts, elements = layout(art.weights, spans)
        wmap = weight_map(art.weights, spans, art.wof_offsets, art.wof_size)
        if wmap:
            backing, in_place = map_buffer(art.wof_path, wmap, elements), wmap.in_place
        else:
            backing, in_place = np.empty(elements, np.float32), set()
        self.params = backing[lead:lead + ends[-1]]  # fp32 master copy of all trained elements
        self.param_views = {}
        for t, start in starts.items():
            w = art.weights[t]
            self.param_views[t] = backing[start:start + w.size].reshape(w.shape)
            if t not in in_place:
                self.param_views[t][...] = w
            elif not np.array_equal(self.param_views[t], w):  # the map holds it, unless replaced
                raise UserError(art.wof_path, "was replaced while it was being loaded; run again")
        self._lay_out_gradients(art)
        if not self.half_weights:
            self.working = self.params
            return dict(self.param_views)
        working = backing.astype(self.weight_dtype)  # frozen rows rounded once
        self.working = working[lead:lead + ends[-1]]
        self.round_working: list = []  # set by compile_plan, over the workspace
        return {t: working[start:start + art.weights[t].size].reshape(art.weights[t].shape)
                for t, start in starts.items()}

    def _lay_out_gradients(self, art: Artifacts) -> None:
        """The flat gradient buffer of the weights that update densely, each
        one's place in it (`grad_offsets`) and the runs of them that lie
        together in the weights (`dense_spans`: weights lo, hi, gradient lo)."""
        dense = [t for t in self.offsets if t not in self.lazy]
        sizes = [self.offsets[t][1] - self.offsets[t][0] for t in dense]
        ends = np.cumsum([0] + sizes).astype(int)
        self.grad_offsets = {t: (int(lo), int(hi)) for t, lo, hi in zip(dense, ends, ends[1:])}
        shapes = {t: (-1,) + art.weights[t].shape[1:] for t in dense}
        if self.reorder:
            self.grads = None
            self.grad_buffer, self.grad_at, self.grad_views = _gradient_buffer(
                art, shapes, self.grad_offsets)
        else:
            self.grads = np.zeros(ends[-1], np.float32)
            self.grad_views = {t: self.grads[lo:hi].reshape(shapes[t])
                               for t, (lo, hi) in self.grad_offsets.items()}
        self.dense_spans = []
        for t in dense:
            (lo, hi), start = self.offsets[t], self.grad_offsets[t][0]
            if self.dense_spans and self.dense_spans[-1][1] == lo:
                self.dense_spans[-1][1] = hi
            else:
                self.dense_spans.append([lo, hi, start])

    @property
    def dense_size(self) -> int:
        """Elements of the weights that update densely (all but lazy tables)."""
        return sum(hi - lo for lo, hi in self.grad_offsets.values())

    def refresh_weights(self) -> None:
        """Round the master weights into the fp16 working copy."""
        for step in self.round_working if self.half_weights else ():
            step()

    def _planned(self, g: Graph, graph: str) -> dict:
        return self.arena.views(g, graph, storage) if self.arena else {}

    @staticmethod
    def constant(t, weight_dtype: np.dtype) -> np.ndarray:
        """A constant tensor as the graphs read it (fp16/bf16 weights: rounded)."""
        data = t.data.astype(weight_dtype) if reduced(weight_dtype) and t.data.dtype.kind == "f" \
            else t.data
        return np.ascontiguousarray(data, storage(t.dtype))

    def _allocate(self, g: Graph, batch: int, given: dict) -> list:
        arrays = []
        for t in g.tensors:
            if t.index in given:
                arrays.append(given[t.index])
            elif t.data is not None:
                arrays.append(self.constant(t, self.weight_dtype))
            else:
                arrays.append(np.zeros(concrete_shape(t.shape, batch), storage(t.dtype)))
        return arrays


def reorders(art: Artifacts, accumulating: bool, loss_scale: str) -> bool:
    """Whether each gradient leaves the plan's gradient buffer as soon as it is
    complete (operator reordering, where the plan says: its `updates`): its
    weight updates there, or, accumulating, it is added to the running sum of
    the runs.  Else every gradient is held in one vector until the backward
    pass ends: with a loss scale and no accumulation, as a step with a
    non-finite gradient is skipped whole, so no weight may move before every
    gradient is known to be finite (schemas/memory.md)."""
    plan = art.links.memory if art.backprop is not None else None
    return bool(plan and plan.updates) and (accumulating or loss_scale == "none")


def _gradient_buffer(art: Artifacts, shapes: dict, offsets: dict) -> tuple:
    """The plan's gradient buffer, weight -> the element its gradient starts at
    there, and weight -> its gradient array, in the buffer where the plan places
    it, else an array of its own."""
    plan = art.links.memory
    weight_of, fused = dict(art.links.gradients), dict(plan.fused)
    buffer = np.zeros(plan.gradient_bytes // 4, np.float32)
    views, starts = {}, {}
    for g, at in plan.gradients:
        t = weight_of.get(g)
        if t not in offsets or at % 4:
            raise UserError(art.backprop_path, f"memory plan: gradient {g} is no dense weight's "
                                               "gradient or lies at an unaligned byte")
        size = offsets[t][1] - offsets[t][0]
        if g in fused:  # a tile of rows
            size = fused[g] * (size // art.backprop.tensors[g].shape[0])
        lo, hi = at // 4, at // 4 + size
        if hi > buffer.size:
            raise UserError(art.backprop_path, f"memory plan: gradient {g} does not fit the "
                                               f"{plan.gradient_bytes}-byte gradient buffer")
        views[t], starts[t] = buffer[lo:hi].reshape(shapes[t]), lo
    for t, (lo, hi) in offsets.items():
        if t not in views:
            views[t] = np.zeros(hi - lo, np.float32).reshape(shapes[t])
    return buffer, starts, views


_NO_GRADIENT = np.zeros(0, np.float32)  # a lazy table's gradient tensor (RowGrad holds it)


def _check_affordable(art: Artifacts, plan, batch: int) -> None:
    """Refuse, before allocating, a step whose tensors alone would not fit this
    machine's memory (a huge shape or batch size, or a damaged plan)."""
    planned = {(g, t) for g in ("forward", "backprop") for t, *_ in getattr(plan, g, ())}
    graphs = [("forward", art.forward)] + ([("backprop", art.backprop)] if art.backprop else [])
    need = linear(plan.arena, batch) + plan.gradient_bytes if plan else 0
    for name, g in graphs:
        need += sum(math.prod(concrete_shape(t.shape, batch)) * storage(t.dtype).itemsize
                    for t in g.tensors if t.data is None and (name, t.index) not in planned)
    if need > memory_limit():
        raise UserError(art.frozen_path, f"a step at batch size {batch} needs {need} bytes of "
                                         f"tensors, more than the {memory_limit()} this process "
                                         "may use; " + ("give a smaller --batch-size" if batch > 1
                                                        else "its tensor shapes are too large"))


def _trained_spans(art: Artifacts) -> dict[int, tuple[int, int]]:
    """Trainable tensor -> the elements [lo, hi) of its flattened data that train:
    all, or the rows given in the training metadata.  Frozen rows can only lie
    before the first trained elements or after the last ones."""
    rows = art.training.rows
    trainable = art.training.trainable
    spans = {}
    for i, t in enumerate(trainable):
        w = art.weights[t]
        n = w.shape[0] if w.ndim else 1
        lo, hi = rows.get(t, (0, n))
        if not (0 <= lo < hi <= n and (lo == 0 or i == 0) and (hi == n or i == len(trainable) - 1)):
            raise UserError(art.frozen_path, f"trainable rows {lo}..{hi} of tensor {t} do not fit "
                                             f"its {n} rows or are not at the start or end of the "
                                             "trainable tensors")
        spans[t] = (lo * (w.size // n), hi * (w.size // n))
    return spans


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
    owners: dict = field(default_factory=dict)  # "forward" ... -> (file, Op) of each step

    def run_forward(self) -> None:
        _run(self.forward, self.owners["forward"])

    def run_backward(self) -> None:
        _run(self.backward, self.owners["backward"])

    def run_loss(self) -> None:
        _run(self.loss_ops, self.owners["loss_ops"])


# What a kernel raises when the tensors a (damaged or forged) file gives it do not fit.
KERNEL_FAILURES = (ValueError, IndexError, TypeError, KeyError, AttributeError, ZeroDivisionError,
                   OverflowError)


def _run(steps: list, owners: list) -> None:
    pending = iter(steps)  # no enumerate: a failed step's index is found from what is left
    try:
        for step in pending:
            step()
    except UserError as e:
        raise _at_operator(e, owners[_failed(steps, pending)]) from None
    except KERNEL_FAILURES as e:
        raise _at_operator(OperatorError(None, f"cannot run on its tensors ({e})"),
                           owners[_failed(steps, pending)]) from None


def _failed(steps: list, pending) -> int:
    """The index of the step that raised, the one before those `pending` still holds."""
    return len(steps) - operator.length_hint(pending) - 1


def _at_operator(e: UserError, owner) -> UserError:
    """The error, naming the file and operator of the step that raised it."""
    path, op = owner
    if e.field is None and op is not None:
        e.field = f"operator {op.index} ({op.type})"
    return e.at(path)


def _views(g: Graph, arrays: list, rows: int) -> list:
    """Each batch-shaped array cut to the rows of its first `rows` samples."""
    return [a[:-t.shape[0] * rows] if batched(t.shape) else a for t, a in zip(g.tensors, arrays)]


@dataclass
class Wrappers:
    """What runs around the kernels of a training step, besides computing in
    float32 over reduced-precision tensors: the loss scale's hooks, the count
    of gradients lost to fp16 underflow, and the plan's update order."""
    scaler: LossScale
    underflow: Underflow
    order: UpdateOrder


def _closures(art: Artifacts, mem: Memory, wrappers: Wrappers, g: Graph, arrays: list, ops,
              training: bool) -> tuple[list, list]:
    """The closures of `ops` over `arrays` and the owner (file, op) of each, to
    name them in errors; `training`: backprop with the loss scale's hooks and
    the updates, else the kernels alone (the forward pass, evaluation)."""
    backprop = g is art.backprop
    path = art.backprop_path if backprop else art.frozen_path
    # a lazy table's gradient tensor -> the RowGrad its GatherGrad writes instead
    row_grads = {table.grad: mem.row_grads[t] for t, table in mem.lazy.items()} if backprop else {}
    rounding = _rounding(art, g, wrappers.underflow if training else None)
    scaler, order = wrappers.scaler if training else None, wrappers.order
    steps, owners = [], []
    for op in ops:
        fused = training and order.fuses(op) and not scaler.hooks(op)
        mine = _guarded((path, op), lambda: order.fused_steps(g, op, arrays) if fused
                        else _wrapped(g, op, arrays, row_grads, rounding, scaler))
        if training:
            mine += order.after(op, arrays, fused)
        steps += mine
        owners += [(path, op)] * len(mine)
    return steps, owners


def _wrapped(g: Graph, op, arrays: list, row_grads: dict, rounding, scaler: LossScale | None):
    """The closures of one operator: its kernel (with the loss scale's hooks,
    given a `scaler`) computing in float32 over its reduced-precision tensors,
    a tile of batch rows at a time where that bounds their float32 copies."""
    begin_kernel()  # the float32 copies and the kernel's scratch share one layout
    inputs = [arrays[i] if i >= 0 else None for i in op.inputs]
    outputs = [arrays[i] for i in op.outputs]
    if (rows := row_grads.get(op.outputs[0])) is not None:  # fp32 only (lazy.py)
        return [rows.kernel(op, inputs, g.tensors[op.outputs[0]].shape[0])]
    roundings = [rounding(t) for t in op.outputs]
    levels = [_levels(g, t) for t in op.inputs]
    tile = None if scaler is not None and scaler.hooks(op) else tile_rows(g, op, inputs, outputs)
    if tile:
        return [tiled(g, op, inputs, outputs, tile, roundings, levels)]

    def kernel(wide_in: list, wide_out: list) -> list:
        if scaler is not None:
            return scaler.closures(op, wide_in, wide_out)
        return [prepare(op.type, wide_in, wide_out, op_quantization(g, op), **op.options)]
    return in_float32(kernel, inputs, outputs, roundings, levels)


def _levels(g: Graph, t: int):
    """Tensor t when it holds a fake quantization's int8 levels, else None."""
    return g.tensors[t] if t >= 0 and g.tensors[t].fake_quant else None


def _rounding(art: Artifacts, g: Graph, underflow: Underflow | None):
    """Tensor -> the Rounding of its results: counting underflow in `underflow`
    (training's gradients) under a weight gradient's weight, else -1 - tensor;
    recomputed forward activations are not gradients and count none."""
    weight_grads = dict(art.links.gradients) if art.links else {}
    recomputed = set(art.links.recomputed or ()) if art.links else set()

    def rounding(t: int) -> Rounding:
        declared = g.tensors[t].dtype
        if underflow is None or t in recomputed:
            return Rounding(declared)
        return Rounding(declared, underflow, weight_grads.get(t, -1 - t))
    return rounding


def compile_plan(art: Artifacts, mem: Memory, rows: int, wrappers: Wrappers) -> Plan:
    """The step for the first `rows` rows.  The first plan of a memory finds its
    workspace too small: the kernels then measure what they need, the workspace
    grows to it, and the plan is built again over the grown workspace."""
    with sharing(mem.workspace):
        plan = _compile(art, mem, rows, wrappers)
        if mem.workspace is not None and mem.workspace.grow():
            del plan  # freed before its successor is built: its objects' memory is reused
            plan = _compile(art, mem, rows, wrappers)
    return plan


WEIGHT_CHUNK = 1 << 16  # weights are rounded in chunks, so their scratch stays small


def _weight_chunk(params: np.ndarray, working: np.ndarray):
    """A closure rounding fp32 master weights into their fp16 working copy."""
    begin_kernel()
    wide = scratch(params.shape, F32)
    store = narrow(wide, working)

    def step():
        np.copyto(wide, params)
        store()
    return step


def _compile(art: Artifacts, mem: Memory, rows: int, wrappers: Wrappers) -> Plan:
    if mem.half_weights:  # between steps, so it may share the kernels' workspace
        mem.round_working = [_weight_chunk(mem.params[i:i + WEIGHT_CHUNK],
                                           mem.working[i:i + WEIGHT_CHUNK])
                             for i in range(0, mem.working.size, WEIGHT_CHUNK)]
    fwd = _views(art.forward, mem.forward, rows)
    inputs = [fwd[i] for i in art.forward.inputs]
    read, transposes = _transposed_weights(art.forward, fwd)
    closures = partial(_closures, art, mem, wrappers)
    steps, owners = closures(art.forward, read, art.forward.ops, training=False)
    steps, owners = transposes + steps, [(art.frozen_path, None)] * len(transposes) + owners
    plan = Plan(inputs, [fwd[i] for i in art.forward.outputs], [], None, steps, [], [])
    plan.owners = {"forward": owners, "backward": [], "loss_ops": []}
    if art.backprop is not None:
        bp = _views(art.backprop, mem.backprop, rows)
        plan.targets = [bp[i] for i in art.links.targets]
        plan.loss = bp[art.links.loss]
        plan.backward, plan.owners["backward"] = closures(art.backprop, bp, art.backprop.ops,
                                                          training=True)
        # evaluation runs the loss operators alone (and their sum, with several outputs)
        loss_ops = [op for op in art.backprop.ops if op.type in LOSS_OPS
                    or art.links.loss in op.outputs]
        plan.loss_ops, plan.owners["loss_ops"] = closures(art.backprop, bp, loss_ops,
                                                          training=False)
    return plan


def _transposed_weights(g: Graph, arrays: list) -> tuple[list, list]:
    """The arrays the forward closures read, and the steps that must run first: a
    float32 weight read by several FULLY_CONNECTED (an unrolled RNN's recurrent
    kernel, once a step) is read through a transposed copy, refreshed at the start
    of every forward pass (so whatever changed the weights, it is current).  Its
    kernel's x @ W.T then multiplies by a C-contiguous matrix: OpenBLAS is ~2x
    faster so on a few rows ([32, 64] @ [64, 256]: 19 -> 10 µs).  A weight read
    once is left alone, its results bit for bit as before."""
    readers = Counter(op.inputs[1] for op in g.ops if op.type == "FULLY_CONNECTED")
    read, steps = list(arrays), []
    for w, n in readers.items():
        if n > 1 and arrays[w].dtype == F32 and arrays[w].ndim == 2:
            copy = np.empty(arrays[w].shape[::-1], F32)
            steps.append(partial(np.copyto, copy, arrays[w].T))
            read[w] = copy.T
    return read, steps


def _guarded(owner, make):
    """make(), a kernel factory's work; its errors name the owner's file and operator."""
    try:
        return make()
    except UserError as e:
        raise _at_operator(e, owner) from None
    except KERNEL_FAILURES as e:
        raise _at_operator(OperatorError(None, f"does not fit its tensors ({e})"), owner) from None


def check_supported(art: Artifacts) -> None:
    _check_kernels(art.forward, art.frozen_path)
    if art.backprop is not None:
        _check_kernels(art.backprop, art.backprop_path)
