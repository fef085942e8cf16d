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

from .arena import Arena, linear, memory_limit
from .artifacts import Artifacts
from .errors import OperatorError, UserError
from .graph import BATCH, Graph, batched, concrete_shape
from .kernels import KERNELS, ROWS, in_sequence, prepare, version_problem
from .kernels.fake_quant import levels_problem
from .kernels.quantized import integer_problem
from .kernels.workspace import Workspace, begin_kernel, scratch, sharing
from .lazy import RowGrad
from .loss_registry import LOSS_OPS
from .loss_scale import LossScale
from .precision import (F32, Underflow, dtype_of, narrow, narrow_work,
                        reduced, round_in_place, storage, widen)
from .quantization import op_quantization
from .weight_map import layout, map_buffer, weight_map


# operators that make a constant of another form (fp16, sparse) into float32: split
# removes them (trainconf/constants.py), a model run as it is keeps them
SPLIT_RESOLVES = ("DEQUANTIZE", "DENSIFY")


def _check_kernels(g: Graph, path) -> None:
    for op in g.ops:
        if problem := integer_problem(g, op) or levels_problem(g, op):
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
    tensor; those rows are read in place from the .wof (microtrain/weight_map.py).
    With fp16 weights the graphs read a rounded working copy, refreshed after
    every update.  Tensors placed by the memory plan are views into one
    arena (microtrain/arena.py); the others get arrays of their own.  The
    kernels' temporaries live in `workspace` (None: each kernel keeps its own).
    The tables in `lazy` (microtrain/lazy.py) have no place in the gradient
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
            self.grad_views = _gradient_buffer(art, shapes, self.grad_offsets)
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


def _gradient_buffer(art: Artifacts, shapes: dict, offsets: dict) -> dict:
    """Weight -> its gradient array, in the plan's gradient buffer where the plan
    places it, else an array of its own."""
    plan = art.links.memory
    weight_of, fused = dict(art.links.gradients), dict(plan.fused)
    buffer = np.zeros(plan.gradient_bytes // 4, np.float32)
    views = {}
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
        views[t] = buffer[lo:hi].reshape(shapes[t])
    for t, (lo, hi) in offsets.items():
        if t not in views:
            views[t] = np.zeros(hi - lo, np.float32).reshape(shapes[t])
    return views


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


class Hooks:
    """What runs around each kernel: widening its reduced-precision inputs into
    float32 scratch, loss scaling in the backprop graph, then storing every
    tensor declared fp16 rounded (counting gradient underflow); and, given
    `update`, a call update(weight, loss array) right after the backprop
    operator the plan's `updates` name for its gradient (operator reordering),
    or update(weight, loss array, (lo, hi)) after each tile of rows of a
    gradient the plan fuses with its update."""

    def __init__(self, art: Artifacts, scaler: LossScale, underflow: Underflow,
                 memory: Memory | None = None, update=None):
        self.backprop, self.scaler, self.underflow = art.backprop, scaler, underflow
        # a lazy table's gradient tensor -> the RowGrad its GatherGrad writes instead
        self.row_grads = {table.grad: memory.row_grads[t]
                          for t, table in memory.lazy.items()} if memory else {}
        self.paths = {"forward": art.frozen_path, "backprop": art.backprop_path}
        # backprop tensor of each weight gradient -> the forward (weight) tensor
        self.weight_grads = dict(art.links.gradients) if art.links else {}
        self.loss = art.links.loss if art.links else None
        self.update = update
        # gradient -> rows per tile of those computed and applied a tile at a time
        self.fused = dict(art.links.memory.fused) if art.links and art.links.memory else {}
        unknown = self.fused.keys() - self.weight_grads.keys()
        if unknown:
            raise UserError(art.backprop_path, f"memory plan: fused tensor {min(unknown)} is no "
                                               "weight gradient")
        self.updates: dict[int, list] = {}  # backprop operator -> the weights updated after it
        for g, i in art.links.memory.updates if update else ():
            if g not in self.weight_grads or not 0 <= i < len(art.backprop.ops):
                raise UserError(art.backprop_path, f"memory plan: the update of gradient {g} "
                                                   f"after operator {i} names no weight gradient "
                                                   "or operator")
            self.updates.setdefault(i, []).append(self.weight_grads[g])
        # recomputed forward activations are not gradients: their rounding counts no underflow
        self.recomputed = set(art.links.recomputed or ()) if art.links else set()

    def _counting(self, backprop: bool, t: int) -> tuple:
        """rounder() arguments that count gradient underflow (see Underflow)."""
        if not backprop or t in self.recomputed:
            return ()
        return self.underflow, self.weight_grads.get(t, -1 - t)

    def closures(self, g: Graph, arrays: list, ops, scaling: bool = True) -> tuple[list, list]:
        """The closures of `ops` over `arrays` and the owner (file, op) of each, to
        name them in errors; `scaling`: training (with the loss scale's hooks
        and the updates), else the kernels alone (evaluation)."""
        steps, owners = [], []
        path = self.paths["backprop" if g is self.backprop else "forward"]
        training = scaling and g is self.backprop
        updates = self.updates if training else {}
        for op in ops:
            fused = training and op.outputs[0] in self.fused and not self.scaler.hooks(op)
            mine = _guarded((path, op), lambda: self._fused(g, op, arrays) if fused
                            else self._op(g, op, arrays, training))
            tiled = self.weight_grads.get(op.outputs[0]) if fused else None  # updated by tiles
            mine += [partial(self.update, w, arrays[self.loss]) for w in updates.get(op.index, ())
                     if w != tiled]
            steps += mine
            owners += [(path, op)] * len(mine)
        return steps, owners

    def _fused(self, g: Graph, op, arrays: list) -> list:
        """Weight gradient op.outputs[0] (the plan's `fused`) computed a tile of
        its rows (output channels: the last axis of its first input) at a time
        into its array, the whole gradient or, updating as gradients complete,
        a tile that each tile's update reads right away.  The unfused run
        computes the same tiles, so that the sums (and the weights) are
        bit-identical whichever way the BLAS blocks a product."""
        (dy, *rest), (out,) = [arrays[i] if i >= 0 else None for i in op.inputs], \
            [arrays[i] for i in op.outputs]
        n, rows = dy.shape[-1], self.fused[op.outputs[0]]
        if g.tensors[op.outputs[0]].shape[0] != n or \
                any(a is not None and a.dtype != F32 for a in (dy, *rest, out)):
            raise UserError(None, f"memory plan: fused gradient {op.outputs[0]} is not float32 "
                                  "with a row per channel of its operator's first input")
        whole = self.update is None
        steps = []
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            begin_kernel()  # the tiles run one after another: they share one scratch layout
            tile = out[lo:hi] if whole else out[:hi - lo]
            steps.append(prepare(op.type, [dy[..., lo:hi], *rest], [tile], **op.options))
            if not whole:
                steps.append(partial(self.update, self.weight_grads[op.outputs[0]],
                                     arrays[self.loss], (lo, hi)))
        return [in_sequence(steps)]

    def _op(self, g: Graph, op, arrays: list, backprop: bool) -> list:
        begin_kernel()  # the float32 copies below and the kernel's scratch share one layout
        inputs = [arrays[i] if i >= 0 else None for i in op.inputs]
        outputs = [arrays[i] for i in op.outputs]
        if g is self.backprop and op.outputs[0] in self.row_grads:  # fp32 only (lazy.py)
            rows = self.row_grads[op.outputs[0]]
            return [prepare("GatherRowsGrad", inputs, [rows.ids, rows.values, rows.counter],
                            rows=g.tensors[op.outputs[0]].shape[0], **op.options)]
        rows = None if backprop and self.scaler.hooks(op) else _tile_rows(g, op, inputs, outputs)
        if rows:
            return [self._tiled(g, op, inputs, outputs, rows, backprop)]
        grids = [_grid(g, i) for i in op.inputs]
        wide_in = [_wide(a, grid) for a, grid in zip(inputs, grids)]
        wide_out = [_wide(a) for a in outputs]
        loads = [widen(a, w, grid) for a, w, grid in zip(inputs, wide_in, grids) if w is not a]
        steps = [self.scaler.kernel(op, wide_in, wide_out) if backprop
                 else prepare(op.type, wide_in, wide_out, op_quantization(g, op), **op.options)]
        if backprop:
            steps += self.scaler.after(op, wide_in, wide_out)
        for t, a, w in zip(op.outputs, outputs, wide_out):
            counting = self._counting(backprop, t)
            if w is not a:
                steps.append(narrow(w, a, *counting))
            elif reduced(g.tensors[t].dtype):
                # fp16/bf16 values in a float32 buffer
                steps.append(round_in_place(a, *_fill(counting), g.tensors[t].dtype))
        if not loads and len(steps) == 1:
            return steps
        return [in_sequence(loads + steps)]  # one closure: its scratch holds the float32 copies


    def _tiled(self, g: Graph, op, inputs: list, outputs: list, rows: int, backprop: bool):
        """One closure running `op` on its batch `rows` rows at a time, so that the
        float32 copies of its reduced-precision tensors (and the kernel's own
        scratch) are those of `rows` rows: the batch-shaped inputs are widened
        (or copied) a tile at a time, and row-wise outputs stored a tile at a
        time, while a sum over the rows (a weight gradient) adds the tiles' sums
        and is stored once."""
        batch = [t >= 0 and g.tensors[t].shape[:1] == (BATCH,) for t in op.inputs]  # -1: absent
        n = next(a.shape[0] for a, b in zip(inputs, batch) if b)
        tile = lambda a: scratch((rows,) + a.shape[1:], F32)  # noqa: E731
        grids = [_grid(g, i) for i in op.inputs]
        wide_in = [tile(a) if b else _wide(a, grid) for a, b, grid in zip(inputs, batch, grids)]
        whole_loads = [widen(a, w, grid) for a, w, b, grid in zip(inputs, wide_in, batch, grids)
                       if not b and w is not a]
        sums = ROWS[op.type] == "sum"
        if sums:
            ((t, out),) = zip(op.outputs, outputs)
            total, part = _wide(out), scratch(out.shape, F32)
            wide_out = [part]
        else:
            wide_out = [tile(a) for a in outputs]
        work = narrow_work((rows,) + outputs[0].shape[1:]) if not sums else None
        spans = [(i, min(i + rows, n)) for i in range(0, n, rows)]
        kernels = {}
        for lo, hi in spans:  # one kernel per tile height: whole tiles and the last one
            if hi - lo not in kernels:
                cut = lambda a, k=hi - lo: a if sums and a is part else a[:k]  # noqa: E731
                kernels[hi - lo] = prepare(op.type, [cut(w) if b else w for w, b in
                                                     zip(wide_in, batch)],
                                           [cut(w) for w in wide_out], **op.options)
        tiles = []
        head = lambda w, k: w if len(w) == k else w[:k]  # noqa: E731  (no view per whole tile)
        for lo, hi in spans:
            k = hi - lo
            steps = [_loader(a[lo:hi], head(w, k), grid)
                     for a, w, b, grid in zip(inputs, wide_in, batch, grids) if b]
            steps.append(kernels[k])
            if sums:
                steps.append(_adder(part, total, first=lo == 0))
            else:
                steps += [_storer(g, t, head(w, k), a[lo:hi], self._counting(backprop, t), work)
                          for t, a, w in zip(op.outputs, outputs, wide_out)]
            tiles += steps
        if sums:
            tiles.append(_storer(g, t, total, out, self._counting(backprop, t), None))
        return in_sequence(whole_loads + tiles)


def _tile_rows(g: Graph, op, inputs: list, outputs: list) -> int | None:
    """Rows per tile for running `op` a few batch rows at a time (see Hooks._tiled),
    or None to run it whole: when it holds no reduced-precision tensor, does not
    treat rows separately, or its batch tensors are small."""
    if op.type not in ROWS or not any(
            a is not None and reduced(a.dtype) for a in inputs + outputs):
        return None
    ts = [g.tensors[t] for t in op.inputs if t >= 0] + [g.tensors[t] for t in op.outputs]
    if any(batched(t.shape) and t.shape[0] != BATCH for t in ts):
        return None  # several rows a sample (a sequence's): not cut into samples
    arrays = [a for a in inputs if a is not None] + outputs
    tensors = [(t, a) for t, a in zip(ts, arrays) if t.shape[:1] == (BATCH,)]
    if ROWS[op.type] == "sum" and (len(outputs) != 1 or g.tensors[op.outputs[0]].shape[:1] == (BATCH,)):
        return None
    if not tensors or len({a.shape[0] for _, a in tensors}) > 1:
        return None
    n = tensors[0][1].shape[0]
    per_row = max(a[0].size for _, a in tensors)
    rows = max(1, TILE // per_row)
    if ROWS[op.type] == "sum":  # tiles need a float32 partial sum the size of the output
        whole = sum(a.size for _, a in tensors)
        if rows * whole // n + outputs[0].size >= whole:
            return None
    return rows if rows < n else None


TILE = 1 << 14  # elements of a batch tensor's float32 copy in one tile


def _loader(src: np.ndarray, dst: np.ndarray, grid):
    """Widen or copy one tile of a batch-shaped input into float32 scratch."""
    return widen(src, dst, grid) if reduced(src.dtype) or grid else (lambda: np.copyto(dst, src))


def _storer(g: Graph, t: int, src: np.ndarray, dst: np.ndarray, counting: tuple, work):
    """Store float32 results into the output array of tensor t: narrowed, rounded
    in place (fp16 declared, float32 array) or copied."""
    if reduced(dst.dtype):
        return narrow(src, dst, *counting, work=work)
    declared = g.tensors[t].dtype
    rounding = round_in_place(src, *_fill(counting), declared) if reduced(declared) else _nothing
    if src is dst:
        return rounding

    def step():
        rounding()
        np.copyto(dst, src)
    return step


def _fill(counting: tuple) -> tuple:
    """round_in_place()'s underflow and tensor arguments from _counting()'s."""
    return counting or (None, -1)


def _adder(part: np.ndarray, total: np.ndarray, first: bool):
    return (lambda: np.copyto(total, part)) if first else (lambda: np.add(total, part, out=total))


def _nothing():
    pass


def _wide(a: np.ndarray | None, grid=None) -> np.ndarray | None:
    """`a` itself, or float32 scratch of its shape when it holds reduced precision
    or (given their `grid`) a FAKE_QUANT's int8 levels."""
    return scratch(a.shape, F32) if a is not None and (reduced(a.dtype) or grid) else a


def _grid(g: Graph, t: int):
    """The grid of tensor t when it holds a FAKE_QUANT's int8 levels, else None."""
    return g.tensors[t].quantization if t >= 0 and g.tensors[t].fake_quant else None


def compile_plan(art: Artifacts, mem: Memory, rows: int, hooks: Hooks) -> Plan:
    """The step for the first `rows` rows.  The first plan of a memory finds its
    workspace too small: the kernels then measure what they need, the workspace
    grows to it, and the plan is built again over the grown workspace."""
    with sharing(mem.workspace):
        plan = _compile(art, mem, rows, hooks)
        if mem.workspace is not None and mem.workspace.grow():
            del plan  # freed before its successor is built: its objects' memory is reused
            plan = _compile(art, mem, rows, hooks)
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


def _compile(art: Artifacts, mem: Memory, rows: int, hooks: Hooks) -> Plan:
    if mem.half_weights:  # between steps, so it may share the kernels' workspace
        mem.round_working = [_weight_chunk(mem.params[i:i + WEIGHT_CHUNK],
                                           mem.working[i:i + WEIGHT_CHUNK])
                             for i in range(0, mem.working.size, WEIGHT_CHUNK)]
    fwd = _views(art.forward, mem.forward, rows)
    inputs = [fwd[i] for i in art.forward.inputs]
    read, transposes = _transposed_weights(art.forward, fwd)
    steps, owners = hooks.closures(art.forward, read, art.forward.ops)
    steps, owners = transposes + steps, [(art.frozen_path, None)] * len(transposes) + owners
    plan = Plan(inputs, [fwd[i] for i in art.forward.outputs], [], None, steps, [], [])
    plan.owners = {"forward": owners, "backward": [], "loss_ops": []}
    if art.backprop is not None:
        bp = _views(art.backprop, mem.backprop, rows)
        plan.targets = [bp[i] for i in art.links.targets]
        plan.loss = bp[art.links.loss]
        plan.backward, plan.owners["backward"] = hooks.closures(art.backprop, bp, art.backprop.ops)
        # evaluation runs the loss operators alone (and their sum, with several outputs)
        loss_ops = [op for op in art.backprop.ops if op.type in LOSS_OPS
                    or art.links.loss in op.outputs]
        plan.loss_ops, plan.owners["loss_ops"] = hooks.closures(art.backprop, bp, loss_ops,
                                                                scaling=False)
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
