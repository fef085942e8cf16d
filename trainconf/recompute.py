"""`trainconf split --recompute`: drop forward activations after the forward pass
and recompute them in the backward pass from the nearest kept ones (the
"materialization" of the onert-micro training proposal; schemas/memory.md).

A choice is the set of forward activations the backward pass reads through a
`forward` link that it recomputes instead.  For each, copies of the forward
operators that compute it from kept tensors (activations still linked, the
model inputs, weights and constants) go into the backprop graph, writing
backprop tensors of their own, each copy placed right before the first
backprop operator that needs its outputs.  The runtime runs them with the
forward kernels; the memory planner sees the shorter lives: a recomputed
activation dies in the forward pass, and its copy lives from its recomputation
to its last backprop reader.

The chooser minimises the planned arena (the real planner, trainconf/memory.py,
is the cost) and, among choices of the same arena, the extra forward work, its
multiply-adds weighed by how fast microtrain runs them (`cost`).
"""
from dataclasses import dataclass, replace
from math import prod

from microtrain.step.arena import START_ALIGN, linear
from microtrain.files.artifacts import UNSEALED
from microtrain.files.contracts import GraphLinks
from microtrain.files.graph import Graph, Op, batched

from .backprop import Backprop, stand_in
from .memory import needs, regions
from .operators import OPERATORS, spec

MODES = ("auto", "none")


def default_mode(budget) -> str:
    """`auto` under --memory-budget (recomputing is tried before training fewer
    layers), else `none` (the step keeps its speed)."""
    return "none" if budget is None else "auto"


def work(g: Graph, op: Op) -> int:
    """Multiply-adds of one sample for `op`: its output elements, times the
    kernel's elements per output channel (the output's last axis) for an op
    with a kernel (a weight at a fixed input)."""
    out = sum(prod(abs(d) for d in g.tensors[t].shape) for t in op.outputs)
    position = spec(op.type).weight
    if spec(op.type).kernel and position < len(op.inputs) and op.inputs[position] >= 0:
        channels = max(1, g.tensors[op.outputs[0]].shape[-1])
        return out * max(1, prod(g.tensors[op.inputs[position]].shape) // channels)
    return out


ELEMENTWISE_COST = 10  # a multiply-add in elementwise passes takes the time of 10 in a BLAS product


def cost(g: Graph, op: Op) -> int:
    """work(g, op) weighed by the time microtrain takes for it: an elementwise
    kernel's multiply-adds (the registry's `elementwise`) ELEMENTWISE_COST times."""
    return work(g, op) * (ELEMENTWISE_COST if spec(op.type).elementwise else 1)


def _computed(g: Graph) -> dict[int, Op]:
    """Forward activations an operator writes, with that operator."""
    return {t: op for op in g.ops for t in op.outputs if g.tensors[t].data is None}


def _shared_fc_weights(g: Graph) -> set[int]:
    """Weights several FULLY_CONNECTED read: the forward pass reads them through a
    transposed copy (microtrain.step.executor), so a copy in the backprop graph might
    round differently."""
    seen: dict[int, int] = {}
    for op in g.ops:
        if op.type == "FULLY_CONNECTED":
            seen[op.inputs[1]] = seen.get(op.inputs[1], 0) + 1
    return {w for w, n in seen.items() if n > 1}


def candidates(g: Graph, bp: Backprop) -> list[int]:
    """Forward activations the backprop graph reads that may be recomputed: batched,
    not a model output, written by an operator the registry knows (so the
    backprop graph can hold a copy with its options)."""
    producers = _computed(g)
    shared = _shared_fc_weights(g)
    copyable = {op.index for op in g.ops if op.type in OPERATORS
                and not any(t in shared for t in op.inputs)}
    return sorted(f for f in bp.forward_links.values()
                  if f in producers and producers[f].index in copyable
                  and batched(g.tensors[f].shape) and f not in g.outputs)


def _closure(g: Graph, dropped: set[int], kept: set[int]) -> list[Op]:
    """The forward operators to copy, in forward order: the producers of the
    dropped tensors and of every computed input they read that is not kept."""
    producers = _computed(g)
    needed, todo = set(), list(dropped)
    while todo:
        op = producers[todo.pop()]
        if op.index in needed:
            continue
        needed.add(op.index)
        todo += [t for t in op.inputs if t in producers and t not in kept]
    return [op for op in g.ops if op.index in needed]


@dataclass
class Choice:
    tensors: list[int]  # the backprop tensors the copied operators write
    cost: int  # their multiply-adds per sample, weighed by their kernels' speed (cost)


def summary(art) -> dict:
    """What a split set recomputes (its backprop graph's `recomputed` tensors):
    the operators copied and their share of the forward pass's work."""
    made = set(art.links.recomputed or ())
    copies = [op for op in art.backprop.ops if made & set(op.outputs)]
    extra = sum(work(art.backprop, op) for op in copies)
    forward = sum(work(art.forward, op) for op in art.forward.ops)
    return {"recomputed_tensors": len(made), "extra_ops": len(copies), "extra_work": extra,
            "forward_work": forward, "extra_fraction": round(extra / max(1, forward), 4)}


def apply(g: Graph, bp: Backprop, dropped) -> tuple[Backprop, Choice]:
    """The backprop graph recomputing `dropped` (forward tensors it reads through
    `forward` links), and what that costs."""
    dropped = set(dropped)
    linked = {f: b for b, f in bp.forward_links.items()}
    kept = set(linked) - dropped
    copies = _closure(g, dropped, kept)
    tensors = list(bp.graph.tensors)
    made: dict[int, int] = {}  # forward tensor -> its recomputed backprop tensor

    def new(f: int, name: str) -> int:
        tensors.append(stand_in(g.tensors[f], len(tensors), name))
        return len(tensors) - 1

    def read(f: int) -> int:
        if f < 0 or f in made:
            return made.get(f, f)
        if f not in linked:  # a kept tensor no gradient operator read: now linked
            linked[f] = new(f, g.tensors[f].name)
        return linked[f]
    ops = []
    for op in copies:
        inputs = [read(t) for t in op.inputs]
        for t in op.outputs:  # a dropped tensor's linked input becomes the copy's output
            name = f"recompute/{g.tensors[t].name}"
            made[t] = new(t, name) if t not in dropped else linked.pop(t)
            tensors[made[t]] = replace(tensors[made[t]], name=name)
        ops.append(Op(-1, op.type, inputs, [made[t] for t in op.outputs], dict(op.options),
                      op.version))
    graph = Graph(tensors, _placed(bp.graph.ops, ops), list(linked.values()) + bp.targets,
                  bp.graph.outputs)
    choice = Choice(sorted(made.values()), sum(cost(g, op) for op in copies))
    return replace(bp, graph=graph, forward_links={b: f for f, b in linked.items()}), choice


def _placed(backward: list[Op], copies: list[Op]) -> list[Op]:
    """The backprop operators with each copy right before the first operator
    (backprop or copy) reading its outputs; copies keep their forward order."""
    first: dict[int, int] = {}  # tensor -> position of its first reader
    for i, op in enumerate(backward):
        for t in op.inputs:
            first.setdefault(t, i)
    due = {}
    for op in reversed(copies):
        due[id(op)] = min(first.get(t, len(backward)) for t in op.outputs)
        for t in op.inputs:
            first[t] = min(first.get(t, due[id(op)]), due[id(op)])
    result = []
    for i, op in enumerate(backward):
        result += [c for c in copies if due[id(c)] == i] + [replace(op)]
    for i, op in enumerate(result):
        op.index = i
    return result


def _links(bp: Backprop) -> GraphLinks:
    return GraphLinks(version=GraphLinks.VERSION, frozen_sha256=UNSEALED,
                      backprop_sha256=UNSEALED, forward=sorted(bp.forward_links.items()),
                      targets=list(bp.targets), loss=bp.loss, gradients=list(bp.gradients),
                      layers=list(bp.layers))


class Chooser:
    """Evaluates choices with the real planner and searches them.  The search
    starts from the best of Chen et al.'s (2016) evenly spaced checkpoints
    (every k-th candidate kept, for every k), then descends by local moves
    (recompute or keep one tensor or two neighbours) while the cost falls: the
    arena, then the bytes x steps of the tensors' lives (which leads the
    search across choices of one arena), then the work.  Last, it keeps back
    the tensors whose recomputation the arena does not need, the most work
    first.  On the small graphs of tests/test_recompute.py, chains and
    residual ones, it finds what trying every choice finds."""

    def __init__(self, g: Graph, bp: Backprop, trainable: list[int], batch: int):
        self.g, self.bp, self.trainable, self.batch = g, bp, trainable, batch
        self.candidates = candidates(g, bp)
        self.seen: dict = {}

    def cost(self, dropped: frozenset) -> tuple[int, int, int]:
        """(arena, bytes x steps, extra work's cost) of recomputing `dropped`."""
        if dropped not in self.seen:
            bp, choice = apply(self.g, self.bp, dropped)
            step = needs(self.g, bp.graph, _links(bp), self.trainable)
            (*_, fixed), (*_, per_sample) = regions(step)
            area = sum(n.size * (self.batch if n.batch else 1) * (n.last - n.first + 1)
                       for n in step)
            self.seen[dropped] = (linear((per_sample, fixed), self.batch), area, choice.cost)
        return self.seen[dropped]

    def choose(self, target: int) -> frozenset:
        """The least arena (target 0), or the least work whose arena fits
        `target` bytes (the least arena when none does); nothing when
        recomputing saves no arena."""
        best = self.best()
        if self.cost(best)[0] >= self.cost(frozenset())[0]:
            return frozenset()
        # from the least arena's lightest choice: a looser target never costs more work
        least = self.lightest(best, self.cost(best)[0])
        return self.lightest(least, max(target, self.cost(best)[0]))

    def best(self) -> frozenset:
        """The least arena found, with the least work among its choices."""
        order = self.candidates
        seeds = [frozenset(order) - set(order[k - 1::k]) for k in range(1, len(order) + 2)]
        # moves: recompute or keep one tensor, or two neighbours (a segment's
        # boundary moves by one when one of them is kept and the other not)
        moves = [{t} for t in order] + [{a, b} for a, b in zip(order, order[1:])]
        current, improved = min(seeds, key=self.cost), True
        while improved:  # first improvement, sweeping the moves in order
            improved = False
            for move in moves:
                if self.cost(current ^ move) < self.cost(current):
                    current, improved = current ^ move, True
        return current

    def lightest(self, current: frozenset, arena: int) -> frozenset:
        """`current` less the recomputations an arena of `arena` bytes does not need."""
        while True:
            fits = [current - {t} for t in current if self.cost(current - {t})[0] <= arena]
            if not fits:
                return current
            current = min(fits, key=lambda c: self.cost(c)[2])


def recompute(g: Graph, bp: Backprop, trainable: list[int], batch: int,
              target: int) -> tuple[Backprop, list[int], int]:
    """The backprop graph with the recomputation chosen for `target` (see
    Chooser.choose), the backprop tensors it recomputes, and the arena's
    bytes (as `peak` counts them) without recomputation."""
    chooser = Chooser(g, bp, trainable, batch)
    new, choice = apply(g, bp, chooser.choose(target))
    return new, choice.tensors, chooser.cost(frozenset())[0] + START_ALIGN
