"""The memory plan of one training step (schemas/memory.md).

A step runs in this order: the inputs and targets are loaded (step 0), the
forward operators run (steps 1..F), then the backprop operators (F+1..F+K),
then the update reads the gradients while the loss, outputs and targets are
read for the metrics (step F+K+1).  Every tensor that is not a weight, a weight
gradient or a constant lives from the step that writes it to the last step that
reads it; a forward activation lives only until the last backprop operator
reading it, and one that no backprop operator reads dies in the forward pass.
Tensors whose lives do not overlap share memory in one arena.

The batch size B is symbolic, so sizes are a*B (a tensor with a batch axis) or
c (one without).  The arena has two regions, [fixed | batch], each packed on
its own: the fixed region in bytes, the batch region in bytes per sample.  A
tensor of the batch region at per-sample offset o lies at byte c_total + o*B,
so one plan is valid (non-overlapping, 8-byte aligned) for every B >= 1.
"""
from dataclasses import dataclass
from functools import cache
from math import prod

import numpy as np

from microtrain.step.arena import START_ALIGN, held_bytes, linear, memory_limit
from microtrain.files.artifacts import Artifacts
from microtrain.files.contracts import GraphLinks, MemoryPlan
from microtrain.files.errors import UserError
from microtrain.step.executor import (Memory, Wrappers, _trained_spans, compile_plan, precision,
                                      reorders)
from microtrain.files.format.wof import placement
from microtrain.step.precision import dtype_of, reduced
from microtrain.step.precision import storage as runtime_dtype
from microtrain.files.graph import Graph, batched, concrete_shape, symbolic_batch
from microtrain.step.kernels import IN_PLACE, OVERWRITES
from microtrain.step.kernels.workspace import sharing
from microtrain.step.lazy import (DEFAULT_EMBEDDING_UPDATE, RowGrad, RowSum, lazy_tables,
                                  row_gradients)
from microtrain.step.loss_scale import DEFAULT_LOSS_SCALE, LossScale, make_loss_scale
from microtrain.metrics import bind, default_metric
from microtrain.step.optimizers import TILE, make_optimizer
from microtrain.step.precision import Underflow
from microtrain.run_config import DEFAULT_DIVERGENCE_SNAPSHOT
from microtrain.step.update_order import UpdateOrder
from microtrain.files.weight_map import WeightMap, weight_map

from .operators import ROW_GRADS

ALIGN = 8  # every runtime type's size divides it; wider alignment measured no faster
PARTS = ["arena", "kernel_scratch", "other_tensors", "weights", "gradients", "optimizer_state",
         "constants", "files"]
READ_ONLY = ["files"]  # file-backed bytes read in place; the other parts are RAM


@dataclass
class Need:
    """The memory one tensor (or several aliased tensors) needs."""
    keys: list  # (graph, index): graph is "forward" or "backprop"
    size: int  # bytes, per sample in the batch region
    batch: bool
    first: int  # step that writes it
    last: int  # last step that reads it


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _runtime_size(t) -> tuple[int, bool] | None:
    """(bytes, per sample?) the runtime allocates for t; None when the size is
    not linear in the batch size (the tensor then keeps an array of its own)."""
    return _size_of(t.shape, t.dtype)


@cache  # the recomputation chooser plans many variants of one step's tensors
def _size_of(shape: tuple, dtype) -> tuple[int, bool] | None:
    if any(d < 0 for d in shape[1:]):
        return None
    elements = prod(abs(d) for d in shape)
    return _aligned(elements * runtime_dtype(dtype).itemsize), batched(shape)


class _Steps:
    """When each tensor of the step is written and last read, keyed by
    (graph, index); backprop tensors linked to forward ones use the forward key."""

    def __init__(self, links: GraphLinks):
        self.alias = dict(links.forward)
        self.first: dict = {}
        self.last: dict = {}

    def key(self, graph: str, t: int) -> tuple:
        return ("forward", self.alias[t]) if graph == "backprop" and t in self.alias else (graph, t)

    def write(self, key, step: int) -> None:
        self.first.setdefault(key, step)
        self.last.setdefault(key, step)

    def read(self, key, step: int) -> None:
        self.last[key] = max(self.last.get(key, step), step)


def lifetimes(fwd: Graph, bp: Graph, links: GraphLinks) -> _Steps:
    steps = _Steps(links)
    end = len(fwd.ops) + len(bp.ops) + 1
    for t in fwd.inputs:
        steps.write(("forward", t), 0)
    for t in links.targets:
        steps.write(("backprop", t), 0)
    for offset, graph, g in ((1, "forward", fwd), (1 + len(fwd.ops), "backprop", bp)):
        for i, op in enumerate(g.ops):
            for t in op.inputs:
                if t >= 0:
                    steps.read(steps.key(graph, t), offset + i)
            for t in op.outputs:
                steps.write(steps.key(graph, t), offset + i)
    # read after the step: the metrics (outputs, targets) and the loss
    for key in [("forward", t) for t in fwd.outputs] + \
               [("backprop", t) for t in links.targets + [links.loss]]:
        steps.read(key, end)
    return steps


def _step_tensors(fwd: Graph, bp: Graph, links: GraphLinks, trainable: list[int]) -> list[tuple]:
    """Keys of the tensors the arena may hold: neither constants nor weights nor
    weight gradients (those live in flat buffers) nor linked backprop tensors."""
    linked = {b for b, _ in links.forward} | {g for g, _ in links.gradients}
    keys = [("forward", t.index) for t in fwd.tensors
            if t.data is None and t.index not in trainable]
    return keys + [("backprop", t.index) for t in bp.tensors
                   if t.data is None and t.index not in linked]


def _in_place(graphs: dict, steps: _Steps, planned: set) -> dict:
    """Key -> the key whose memory it shares, when both are planned, of the same
    type and size: the outputs of copies (RESHAPE) share their input's memory,
    and the output of a kernel that may write over its first input (OVERWRITES:
    an activation's gradient) takes that input's memory when no later step reads
    the input (nor anything sharing its memory)."""
    root: dict = {}
    last = dict(steps.last)  # of each group, by its root

    def find(k):
        while k in root:
            k = root[k]
        return k
    step = 0
    for graph, g in graphs.items():  # forward, then backprop: the steps' order
        for op in g.ops:
            step += 1
            if op.type not in IN_PLACE | OVERWRITES:
                continue
            x, y = steps.key(graph, op.inputs[0]), steps.key(graph, op.outputs[0])
            tx, ty = graphs[x[0]].tensors[x[1]], graphs[y[0]].tensors[y[1]]
            if not ({x, y} <= planned and tx.dtype == ty.dtype
                    and _runtime_size(tx) == _runtime_size(ty)):
                continue
            rx = find(x)
            if op.type in IN_PLACE or last.get(rx) == step:
                root[y] = rx
                last[rx] = max(last.get(rx, step), last.get(y, step))
    return {k: find(k) for k in root}


def needs(fwd: Graph, bp: Graph, links: GraphLinks, trainable: list[int]) -> list[Need]:
    """The memory needs of the step's tensors whose size is linear in the batch
    size (any other keeps an array of its own)."""
    graphs = {"forward": fwd, "backprop": bp}
    steps = lifetimes(fwd, bp, links)
    planned = [k for k in _step_tensors(fwd, bp, links, trainable)
               if _runtime_size(graphs[k[0]].tensors[k[1]]) is not None]
    shared = _in_place(graphs, steps, set(planned))
    groups: dict = {}
    for k in planned:
        groups.setdefault(shared.get(k, k), []).append(k)
    result = []
    for root, keys in groups.items():
        size, batch = _runtime_size(graphs[root[0]].tensors[root[1]])
        touched = [k for k in keys if k in steps.first]
        if not touched:  # neither written nor read: any place will do
            result.append(Need(keys, size, batch, -1, -2))
            continue
        result.append(Need(keys, size, batch, min(steps.first[k] for k in touched),
                           max(steps.last[k] for k in touched)))
    return result


def pack(region: list[Need]) -> tuple[dict[int, int], int]:
    """Offsets (by position in `region`) with no two overlapping lives sharing
    bytes: largest first, each at the lowest gap among the placed needs whose
    lives overlap its own (greedy by size, as TFLite's arena planner)."""
    order = sorted(range(len(region)), key=lambda i: (-region[i].size, region[i].first))
    first = np.array([n.first for n in region])
    last = np.array([n.last for n in region])
    lo = np.zeros(len(region), np.int64)
    hi = np.zeros(len(region), np.int64)
    placed = np.zeros(len(region), bool)
    for i in order:
        n = region[i]
        busy = placed & (first <= n.last) & (n.first <= last)
        offset = 0
        for start, stop in sorted(zip(lo[busy].tolist(), hi[busy].tolist())):
            if offset + n.size <= start:
                break
            offset = max(offset, stop)
        lo[i], hi[i], placed[i] = offset, offset + n.size, True
    return {i: int(lo[i]) for i in range(len(region))}, int(hi.max(initial=0))


def update_points(bp: Graph, links: GraphLinks) -> dict[int, int]:
    """Weight gradient -> the backprop operator after which its weight may update
    (operator reordering): the last one writing or reading the gradient or
    reading the weight (an input gradient reads the kernel's value before the
    update), and never before the loss is known (a diverged step updates nothing)."""
    weight_of = {b: f for b, f in links.forward}
    loss = max((op.index for op in bp.ops if links.loss in op.outputs), default=0)
    point = {g: loss for g, _ in links.gradients}
    weight_grad = {w: g for g, w in links.gradients}
    for op in bp.ops:
        for t in op.inputs + op.outputs:
            g = t if t in point else weight_grad.get(weight_of.get(t))
            if g is not None:
                point[g] = max(point[g], op.index)
    return point


def plan_gradients(bp: Graph, links: GraphLinks, trainable: list[int], fused_least: int) -> dict:
    """The gradient buffer of a step whose weights update as soon as their
    gradients are complete: each gradient lives from its first write to its
    update, and gradients whose lives do not overlap share bytes.  A table's
    gradient that may be held as its touched rows (lazy.row_gradients) is left
    out, as is one no operator writes: they keep arrays of their own.  Fused
    gradients take tiles of at least `fused_least` elements (fused_rows).
    Gradients of neighbouring weights that complete together update together
    (update_runs), placed one after another."""
    points = update_points(bp, links)
    first: dict = {}
    for op in bp.ops:
        for t in op.outputs:
            first.setdefault(t, op.index)
    lazy = row_gradients(bp, links)
    planned = [g for g, _ in links.gradients if g in first and g not in lazy]
    fused = fused_rows(bp, points, planned, fused_least)
    sizes = {g: 4 * fused.get(g, bp.tensors[g].shape[0]) * prod(bp.tensors[g].shape[1:])
             for g in planned}
    runs = update_runs(links, trainable, {g: n for g, n in sizes.items() if g not in fused}, points)
    runs += [[g] for g in planned if g in fused]
    for run in runs:
        for g in run:
            points[g] = max(points[h] for h in run)
    region = [Need([("backprop", g) for g in run], _aligned(sum(sizes[g] for g in run)), False,
                   min(first[g] for g in run), points[run[0]]) for run in runs]
    at, size = pack(region)
    gradients = [(g, at[i] + sum(sizes[h] for h in run[:k]))
                 for i, run in enumerate(runs) for k, g in enumerate(run)]
    return {"updates": sorted(points.items()), "gradients": sorted(gradients),
            "gradient_bytes": size, "fused": sorted(fused.items())}


def update_runs(links: GraphLinks, trainable: list[int], sizes: dict[int, int],
                points: dict[int, int]) -> list[list[int]]:
    """The gradients `sizes` names (with their bytes) in runs of weights that
    follow one another in the flat parameter vector (`trainable`'s order) and
    whose updates fall at most one operator apart (a layer's kernel and its
    bias), each but the last of a whole number of `align` bytes: a run updates
    after its last gradient, in one optimizer call of some 12 ufuncs instead of
    one a weight, its first gradients held an operator longer."""
    grad_of = {w: g for g, w in links.gradients if g in sizes}
    runs: list[list[int]] = []
    previous = None
    for g in map(grad_of.get, trainable):
        joins = None not in (previous, g) and _aligned(sizes[previous]) == sizes[previous]
        span = [points[h] for h in runs[-1] + [g]] if joins else []
        if span and max(span) - min(span) <= 1:
            runs[-1].append(g)
        elif g is not None:
            runs.append([g])
        previous = g
    return runs


FUSED_TILE = 1024  # elements of a fused weight gradient's tile a sample of the batch (4 KiB)


def fused_tile(batch: int) -> int:
    """The least elements of a fused gradient's tile for steps of `batch`
    samples: FUSED_TILE a sample, at most the optimizer's tile (its update runs
    a tile at a time anyway).  Each tile costs a product and an update call
    whatever the batch, so a large batch, whose gradient buffer is small beside
    its activations, takes few tiles (MobileNetV2-0.35, Adam, batch 32: 270
    tiles of 1024 elements cost 1.09x the step time), batch 1 small ones."""
    return min(TILE, FUSED_TILE * batch)


def fused_rows(bp: Graph, points: dict[int, int], planned: list[int],
               least: int) -> dict[int, int]:
    """Planned weight gradient -> rows (output channels) per tile, for each
    gradient computed and applied a tile at a time (fused with its update): one
    ROW_GRADS operator writes it, in float32, and its update runs right after
    that operator (nothing later reads the gradient or the weight).  A tile
    holds `least` elements or as many as the largest gradient not fused
    (the buffer holds that one anyway: smaller tiles would only add steps);
    a gradient no larger than a tile is not fused."""
    writers: dict = {}
    for op in bp.ops:
        for t in op.outputs:
            writers.setdefault(t, []).append(op)
    fusable = set()
    for g in planned:
        ops = writers[g]
        if len(ops) == 1 and ops[0].type in ROW_GRADS and ops[0].index == points[g] and all(
                bp.tensors[t].dtype == np.float32 for t in ops[0].inputs + ops[0].outputs
                if t >= 0):
            fusable.add(g)
    size = {g: prod(bp.tensors[g].shape) for g in planned}
    tile = max([least] + [size[g] for g in planned if g not in fusable])
    return {g: max(1, tile // prod(bp.tensors[g].shape[1:])) for g in fusable if size[g] > tile}


def regions(all_needs: list[Need]) -> tuple[tuple, tuple]:
    """The fixed and the batch region, each (needs, offsets, size) as packed."""
    fixed = [n for n in all_needs if not n.batch]
    batch = [n for n in all_needs if n.batch]
    return (fixed, *pack(fixed)), (batch, *pack(batch))


def plan_memory(fwd: Graph, bp: Graph, links: GraphLinks, trainable: list[int],
                fused_least: int) -> MemoryPlan:
    """The arena layout (schemas/memory.md) and the gradient buffer, fused
    gradients in tiles of at least `fused_least` elements (fused_tile); the
    `kernel_scratch` is added by `measure_scratch`."""
    all_needs = needs(fwd, bp, links, trainable)
    total = sum(n.size for n in all_needs)  # bounds every offset pack gives (int64 in numpy)
    if total > memory_limit():
        raise UserError(None, f"the tensors of a training step need up to {total} bytes (per "
                              f"sample where batched), more than the {memory_limit()} this "
                              "process may use: its tensor shapes are too large")
    (fixed, fixed_at, fixed_size), (batch, batch_at, per_sample) = regions(all_needs)
    entries = {"forward": [], "backprop": []}
    for region, at, form in ((fixed, fixed_at, lambda o: [0, o]),
                             (batch, batch_at, lambda o: [o, fixed_size])):
        for i, n in enumerate(region):
            for graph, t in n.keys:
                entries[graph].append([t] + form(at[i]))
    return MemoryPlan(version=MemoryPlan.VERSION, align=ALIGN, arena=(per_sample, fixed_size),
                      forward=[tuple(e) for e in sorted(entries["forward"])],
                      backprop=[tuple(e) for e in sorted(entries["backprop"])],
                      **plan_gradients(bp, links, trainable, fused_least))


# -- the bytes of a whole step ------------------------------------------------------------------

def _fit(measure, at: tuple[int, int]) -> list[int]:
    """[a, c] of the line through measure(n) at the two points `at` (in whole
    bytes per unit: exact at the second point, within n2 - n1 bytes at the first)."""
    (n1, n2), (m1, m2) = at, (measure(n) for n in at)
    a = (m2 - m1) // (n2 - n1)
    return [a, m2 - a * n2]


def scratch_points(batch: int) -> tuple[int, int]:
    """Where the kernel scratch is measured: at batch 1 and the planned batch."""
    return (1, batch) if batch > 1 else (1, 2)


def measure_scratch(art: Artifacts, batch: int) -> list[int]:
    """Bytes of the kernels' (and the fp16 rounding's) scratch, as [a, c] in the
    batch size: the workspace their temporaries share and what their closures
    keep of their own (index arrays, constants).  The kernels decide both, so
    the planner prepares microtrain's own step and counts them.  Exact at batch
    1 and `batch`; between or beyond them a line (the workspace is the largest
    of the kernels' needs, and the fp16 rounding takes more scratch per element
    from 4096 elements on)."""
    def at(n: int) -> int:
        mem = Memory(art, n)
        plan = compile_plan(art, mem, n, Wrappers(LossScale(), Underflow(), UpdateOrder(art)))
        with sharing(mem.workspace):  # as the Trainer binds its metric
            meter = bind(default_metric(art.training.loss), plan.outputs, plan.targets,
                         art.training)
        return held_bytes((plan, meter), exclude=(mem, art)) + held_bytes(mem.workspace)
    return _fit(at, scratch_points(batch))


def optimizer_bytes(name: str, parameters: int, dense: int | None = None, lazy_rows: int = 0) -> int:
    """State and scratch vectors of optimizer `name` over `parameters` weights, of
    which `dense` (default: all) update densely and at most `lazy_rows` elements
    in a lazy table's touched rows (see microtrain.step.optimizers.Optimizer), measured
    on small ones: linear in the weights, in max(dense, lazy_rows) up to a tile
    (its scratch) and in lazy_rows (the touched rows of the weights and the state)."""
    def held(n, d, r):  # begun, as in a step: its scalars are 0-d arrays
        optimizer = make_optimizer(name, n, dense=d, lazy_rows=r)
        optimizer.begin(optimizer.learning_rate)
        return held_bytes(optimizer)
    base = held(1, 1, 1)
    per_weight, per_scratch = held(2, 1, 1) - base, held(1, 2, 1) - base
    per_row = held(1, 1, 2) - held(1, 2, 1)
    dense = parameters if dense is None else dense
    return base + per_weight * (parameters - 1) + per_scratch * (min(max(dense, lazy_rows), TILE) - 1) \
        + per_row * (lazy_rows - 1)


def _run_rows(art: Artifacts, batch: int) -> int:
    """Rows per run of the graph, as the trainer runs a batch."""
    return batch if symbolic_batch(art.forward) else 1


def _accumulating(art: Artifacts, batch: int, accum_steps: int) -> bool:
    """Whether the trainer sums the gradients of several runs before an update."""
    return accum_steps > 1 or _run_rows(art, batch) < batch


def _gradient_bytes(art: Artifacts, batch: int, accum_steps: int, embedding_update: str,
                    loss_scale: str) -> tuple[int, int, int]:
    """(bytes of the gradients, elements that update densely, elements of the
    largest lazy table's touched rows): each lazy table's touched rows (and
    their running sum when accumulating, as the trainer does for --accum-steps
    or a graph run a sample at a time), and the dense weights' gradients:
    reordered (microtrain.step.executor.reorders), the plan's gradient buffer and
    the gradients it leaves out; else the vector of them all; and the running
    sum of them all when accumulating."""
    run_rows = _run_rows(art, batch)
    accumulating = _accumulating(art, batch, accum_steps)
    tables = lazy_tables(art, run_rows) if embedding_update == "lazy" else {}
    spans = {t: hi - lo for t, (lo, hi) in _trained_spans(art).items() if t not in tables}
    runs = accum_steps * -(-batch // run_rows)
    held = [RowGrad(t.capacity(), t.width) for t in tables.values()]
    summed = [RowSum(t.capacity(runs), t.width, t.rows) for t in tables.values()] \
        if accumulating else []
    read = summed or held  # what the optimizer updates from
    dense = sum(spans.values())
    if reorders(art, accumulating, loss_scale):
        plan, weight_of = art.links.memory, dict(art.links.gradients)
        placed = {weight_of[g] for g, _ in plan.gradients}
        vectors = plan.gradient_bytes + 4 * sum(n for t, n in spans.items() if t not in placed)
    else:
        vectors = 4 * dense
    vectors += 4 * dense if accumulating else 0
    return (vectors + held_bytes((held, summed)), dense,
            max((g.values.size for g in read), default=0))


def _own_arrays(art: Artifacts, batch: int) -> int:
    """Bytes of the step's tensors left out of the arena (arrays of their own)."""
    plan, graphs = art.links.memory, {"forward": art.forward, "backprop": art.backprop}
    placed = {(graph, t) for graph in graphs for t, *_ in getattr(plan, graph)}
    own = [graphs[graph].tensors[t] for graph, t in
           _step_tensors(art.forward, art.backprop, art.links, art.training.trainable)
           if (graph, t) not in placed]
    return sum(prod(concrete_shape(t.shape, batch)) * runtime_dtype(t.dtype).itemsize for t in own)


def _constant_copies(art: Artifacts, weight_dtype) -> int:
    """Bytes of the constants the runtime converts (fp16 weights) instead of
    reading them from the loaded model."""
    constants = [t for g in (art.forward, art.backprop) for t in g.tensors if t.data is not None]
    copies = (Memory.constant(t, weight_dtype) for t in constants)
    return sum(c.nbytes for t, c in zip(constants, copies) if not np.shares_memory(c, t.data))


def _weight_map(art: Artifacts, files: dict[str, int]) -> WeightMap | None:
    """How the runtime maps the .wof (as `trainconf split` lays it out) to read
    frozen rows in place (microtrain/files/weight_map.py)."""
    offsets = placement(len(art.forward.tensors), art.weights)[0]
    return weight_map(art.weights, _trained_spans(art), offsets, files["wof"])


def _mapped_files(art: Artifacts, files: dict[str, int], wmap: WeightMap | None) -> int:
    """Bytes of the files the runtime keeps mapped read-only: each model whose
    constants or quantization parameters it reads (views of the file's bytes)
    and the part of the .wof map never written (frozen rows read in place); a
    .wof whose weights all train is unmapped once its arrays are copied."""
    kept = {name: any(t.data is not None or t.quantization is not None for t in g.tensors)
            for name, g in (("frozen", art.forward), ("backprop", art.backprop))}
    models = sum(size for name, size in files.items() if kept.get(name))
    return models + (wmap.read_only_bytes() if wmap else 0)


def peak(art: Artifacts, batch: int, optimizer: str, files: dict[str, int],
         accum_steps: int = 1, embedding_update: str = DEFAULT_EMBEDDING_UPDATE,
         divergence_snapshot: str = DEFAULT_DIVERGENCE_SNAPSHOT,
         loss_scale: str = DEFAULT_LOSS_SCALE) -> dict:
    """The bytes a training step at `batch` rows with `optimizer` (accumulating
    `accum_steps` batches per update, embedding tables updating as
    `embedding_update` says, a diverged run restored as `divergence_snapshot`
    says, `loss_scale` as microtrain run's --loss-scale) holds, by part, and
    their totals: `ram` and `read_only` (the files read in place).  `files` are
    the sizes of the three files ("frozen", "wof", "backprop")."""
    if loss_scale != "static":  # a kind the plan recorded (planned_for) names no scale
        loss_scale = make_loss_scale(loss_scale).kind
    plan = art.links.memory
    stored = sum(w.size for w in art.weights.values())  # with the frozen rows of partial ones
    trained = sum(hi - lo for lo, hi in _trained_spans(art).values())
    weight_dtype = dtype_of(precision(art).weights)
    half = reduced(weight_dtype)
    gradients, dense, lazy_rows = _gradient_bytes(art, batch, accum_steps, embedding_update,
                                                  loss_scale)
    wmap = _weight_map(art, files)
    parts = {
        "arena": linear(plan.arena, batch) + START_ALIGN,
        "kernel_scratch": linear(plan.kernel_scratch, batch),
        "other_tensors": _own_arrays(art, batch),
        # the fp32 master but for the frozen rows read in place, the copy taken at each
        # epoch's start with --divergence-snapshot ram and, with fp16 weights, the
        # working copy the graphs read (with the frozen rows)
        "weights": 4 * (stored - (wmap.frozen if wmap else 0))
        + (4 * trained if divergence_snapshot == "ram" else 0) + (2 * stored if half else 0),
        "gradients": gradients,
        "optimizer_state": optimizer_bytes(optimizer, trained, dense, lazy_rows),
        "constants": _constant_copies(art, weight_dtype),
        "files": _mapped_files(art, files, wmap),
    }
    read_only = sum(parts[name] for name in READ_ONLY)
    total = sum(parts.values())
    return {"batch_size": batch, "optimizer": optimizer, "accum_steps": accum_steps,
            "embedding_update": embedding_update, "divergence_snapshot": divergence_snapshot,
            "loss_scale": loss_scale,
            "gradients_reordered": reorders(art, _accumulating(art, batch, accum_steps),
                                            loss_scale),
            **parts, "ram": total - read_only, "read_only": read_only, "total": total}


def peak_text(memory: dict) -> str:
    """One line: the RAM and read-only totals and their non-zero parts."""
    def parts(names):
        return ", ".join(f"{name.replace('_', ' ')} {memory[name]}" for name in names
                         if memory[name])
    accumulating = f", accumulating {memory['accum_steps']} batches" \
        if memory.get("accum_steps", 1) > 1 else ""
    lazy = ", lazy embedding tables" if memory.get("embedding_update") == "lazy" else ""
    snapshot = ", a snapshot of the weights in RAM" \
        if memory.get("divergence_snapshot") == "ram" else ""
    scaled = f", {memory['loss_scale']} loss scale" \
        if memory.get("loss_scale", DEFAULT_LOSS_SCALE) != DEFAULT_LOSS_SCALE else ""
    again = memory.get("recompute", {})
    recomputing = (f"; the backward pass recomputes {again['extra_ops']} forward operators "
                   f"({again['extra_fraction']:.0%} of the forward pass's multiply-adds)"
                   if again.get("extra_ops") else "")
    ram = [name for name in PARTS if name not in READ_ONLY]
    return (f"planned peak at batch {memory['batch_size']} with {memory['optimizer']}"
            f"{accumulating}{lazy}{snapshot}{scaled}: {memory['ram']} bytes of RAM ({parts(ram)}) "
            f"and {memory['read_only']} bytes of files read in place "
            f"({parts(READ_ONLY) or 'none'}){recomputing}")
