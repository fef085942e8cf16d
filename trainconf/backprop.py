"""Derive the backpropagation graph of a forward graph.

The backprop graph is a Graph of its own.  Forward tensors it reads (activations,
weights, model outputs) become its inputs, linked by index to the forward graph;
the training targets are inputs too; its outputs are the loss and one gradient
per trainable tensor.  See schemas/backprop.md.
"""
from dataclasses import dataclass, replace

import numpy as np

from microtrain.files.contracts import REDUCTIONS
from microtrain.files.errors import UserError
from microtrain.files.graph import Graph, Op, Tensor
from microtrain.files.loss_registry import LOSS_KINDS, PER_CLASS
from microtrain.step.precision import reduced

from .operators import WITH_GRADIENT, spec

FLOAT32 = np.dtype(np.float32)


@dataclass
class Backprop:
    graph: Graph
    forward_links: dict[int, int]  # backprop tensor -> forward tensor it aliases
    targets: list[int]  # backprop target tensors, one per model output
    loss: int
    gradients: list[tuple[int, int]]  # (backprop tensor, trainable forward tensor)
    layers: list[int]  # backprop tensors holding a layer's input gradient (loss scaling)


class Builder:
    """Appends tensors and operators to the backprop graph under construction."""

    def __init__(self, fwd: Graph, grad_dtype=FLOAT32):
        self.fwd = fwd
        self.grad_dtype = np.dtype(grad_dtype)
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []
        self.links: dict[int, int] = {}  # forward tensor -> backprop tensor

    def tensor(self, name: str, shape, dtype=FLOAT32, data=None) -> int:
        self.tensors.append(Tensor(len(self.tensors), name, tuple(shape), np.dtype(dtype), data))
        return len(self.tensors) - 1

    def forward(self, t: int) -> int:
        """The backprop input that aliases forward tensor t."""
        if t not in self.links:
            self.tensors.append(stand_in(self.fwd.tensors[t], len(self.tensors)))
            self.links[t] = len(self.tensors) - 1
        return self.links[t]

    def constant_of(self, t: int) -> np.ndarray:
        data = self.fwd.tensors[t].data
        if data is None:
            raise UserError(None, f"tensor {t} ({self.fwd.tensors[t].name}) must be a constant")
        return data

    def const(self, array: np.ndarray, name: str) -> int:
        return self.tensor(f"const/{name}_{len(self.tensors)}", array.shape, array.dtype, array)

    def emit_many(self, type_: str, inputs: list[int], shapes, names, dtypes=None,
                  **options) -> list[int]:
        """One operator; its outputs are gradients (of the gradient dtype) unless
        `dtypes` says otherwise."""
        dtypes = dtypes or [self.grad_dtype] * len(names)
        outputs = [self.tensor(n, s, d) for n, s, d in zip(names, shapes, dtypes)]
        self.ops.append(Op(len(self.ops), type_, list(inputs), outputs, options))
        return outputs

    def emit(self, type_: str, inputs: list[int], like: int | None = None,
             like_tensor: int | None = None, shape=None, **options) -> int:
        """One operator with one output shaped like a forward tensor, a backprop
        tensor, or an explicit shape."""
        if like is not None:
            shape, name = self.fwd.tensors[like].shape, f"grad/{self.fwd.tensors[like].name}"
        else:
            shape = self.tensors[like_tensor].shape if shape is None else shape
            name = f"{type_.lower()}_{len(self.ops)}"
        return self.emit_many(type_, inputs, [shape], [name], **options)[0]

    def shape_of(self, t: int) -> tuple[int, ...]:
        return self.tensors[t].shape

    def reshape(self, dy: int, x: int) -> int:
        shape = self.fwd.tensors[x].shape
        if self.shape_of(dy) == shape:
            return dy
        return self.emit("RESHAPE", [dy, self.const(np.array(shape, np.int32), "shape")], like=x)

    def sum_to(self, dz: int, x: int) -> int:
        """dz reduced over broadcast axes to the shape of forward tensor x."""
        if self.shape_of(dz) == self.fwd.tensors[x].shape:
            return dz
        return self.emit("SumToShape", [dz], like=x)

    def slice(self, dz: int, begin: list[int], x: int) -> int:
        size = [-1 if d < 0 else d for d in self.fwd.tensors[x].shape]
        return self.emit("SLICE", [dz, self.const(np.array(begin, np.int32), "begin"),
                                   self.const(np.array(size, np.int32), "size")], like=x)

    def accumulate(self, contributions: list[int], name: str) -> int:
        """The sum of every gradient contribution to one tensor (branches meet here)."""
        if len(contributions) == 1:
            return contributions[0]
        return self.emit_many("ADD_N", contributions, [self.shape_of(contributions[0])],
                              [f"accum/{name}"])[0]


def stand_in(src: Tensor, index: int, name: str | None = None) -> Tensor:
    """A backprop tensor standing for forward tensor `src` (its value, not its
    data): of its shape and type, a fake quantization's int8 levels with their grid."""
    return replace(src, index=index, name=src.name if name is None else name, data=None)


def _is_float(t: Tensor) -> bool:
    """Whether t holds real values: floats, or a fake quantization's int8 levels."""
    return np.issubdtype(t.dtype, np.floating) or reduced(t.dtype) or t.fake_quant


def requires_grad(fwd: Graph, trainable: set[int]) -> set[int]:
    """Float tensors whose value depends on a trainable tensor.  A bool or
    integer output (a comparison's mask, an ARG_MAX, a CAST to int) has no
    gradient, so the path stops there: its operator is never asked for one."""
    needed = set(trainable)
    for op in fwd.ops:
        if any(t in needed for t in op.inputs):
            needed.update(t for t in op.outputs if t >= 0 and _is_float(fwd.tensors[t]))
    return needed


@dataclass(frozen=True)
class LossSpec:
    """The loss on the model's outputs, as `trainconf split` chose it."""
    name: str
    reduction: str = "mean"
    ignore_index: int | None = None  # cce/sparse_cce: tokens of this class are left out
    from_logits: bool = False  # the outputs are logits (cce/sparse_cce on their softmax)

    def options(self) -> dict:
        extra = {} if self.ignore_index is None else {"ignore_index": self.ignore_index}
        return dict(loss=self.name, reduction=self.reduction, **extra)


def check_loss(fwd: Graph, spec: LossSpec) -> None:
    """Refuse the options that do not apply to the loss or the model."""
    if spec.name not in LOSS_KINDS or spec.reduction not in REDUCTIONS:
        raise UserError(None, f"unknown loss {spec.name!r} or reduction {spec.reduction!r}")
    for given, option in ((spec.ignore_index is not None, "--ignore-index"),
                          (spec.from_logits, "--from-logits")):
        if given and spec.name not in PER_CLASS:
            raise UserError(None, f"{option} applies to {' and '.join(PER_CLASS)}, not {spec.name}")
    final = fwd.producers().get(fwd.outputs[0])
    if spec.from_logits and final is not None and final.type == "SOFTMAX":
        raise UserError(None, "--from-logits: the model ends in SOFTMAX, so its outputs are "
                              "probabilities, not logits")


def _logits_loss(b: Builder, spec: LossSpec, z: int, target: int, y: int | None, final: Op | None):
    """The loss from logits z (of a final SOFTMAX/LOGISTIC `final`, whose output y
    lets the runtime skip recomputing a softmax; none: the outputs are logits)."""
    activation = final.type.lower() if final is not None else "softmax"
    options = dict(activation=activation, **spec.options())
    if activation == "softmax":
        options["beta"] = float(final.options.get("beta", 1.0)) if final is not None else 1.0
    inputs = [b.forward(z), target] + ([b.forward(y)] if y is not None else [])
    name = b.fwd.tensors[z].name
    return b.emit_many("LogitsLoss", inputs, [(1,), b.fwd.tensors[z].shape],
                       [f"loss/{name}", f"grad/{name}"], [FLOAT32, b.grad_dtype], **options)


def _seed_loss(b: Builder, spec: LossSpec, skip: set[int],
               grads: dict[int, list[int]]) -> tuple[int, list[int]]:
    """Loss operators on every model output; returns the loss tensor and targets."""
    producers = b.fwd.producers()
    losses, targets = [], []
    for out in b.fwd.outputs:
        y = b.fwd.tensors[out]
        tshape = y.shape[:-1] if spec.name == "sparse_cce" else y.shape
        target = b.tensor(f"target/{y.name}", tshape)
        targets.append(target)
        final = producers.get(out)
        if spec.from_logits:
            value, dz = _logits_loss(b, spec, out, target, None, None)
            grads.setdefault(out, []).append(dz)
        elif final is not None and LOSS_KINDS[spec.name].logits_of == final.type:
            z = final.inputs[0]
            value, dz = _logits_loss(b, spec, z, target,
                                     out if final.type == "SOFTMAX" else None, final)
            skip.add(final.index)
            grads.setdefault(z, []).append(dz)
        else:
            value, dy = b.emit_many("Loss", [b.forward(out), target], [(1,), y.shape],
                                    [f"loss/{y.name}", f"grad/{y.name}"], [FLOAT32, b.grad_dtype],
                                    **spec.options())
            grads.setdefault(out, []).append(dy)
        losses.append(value)
    total = losses[0] if len(losses) == 1 else \
        b.emit_many("ADD_N", losses, [(1,)], ["loss/total"], [FLOAT32])[0]
    return total, targets


def unsupported(op: Op) -> UserError:
    supported = ", ".join(WITH_GRADIENT)
    return UserError(None, f"operator {op.index} ({op.type}) is on the gradient path but has no "
                           f"gradient rule; supported: {supported}")


def build_backprop(fwd: Graph, trainable: list[int], loss: str | LossSpec, reduction: str = "mean",
                   grad_dtype=FLOAT32) -> Backprop:
    chosen = loss if isinstance(loss, LossSpec) else LossSpec(loss, reduction)
    needed = requires_grad(fwd, set(trainable))
    b = Builder(fwd, grad_dtype)
    grads: dict[int, list[int]] = {}
    skip: set[int] = set()
    layers: list[int] = []
    loss_tensor, targets = _seed_loss(b, chosen, skip, grads)
    for op in reversed(fwd.ops):
        if op.index in skip or not any(t in grads for t in op.outputs):
            continue
        needs = [t >= 0 and t in needed for t in op.inputs]
        if not any(needs):
            continue
        rule = spec(op.type).gradient
        if rule is None:
            raise unsupported(op)
        # one dY per output, None for an output no gradient reaches; a rule of
        # a single-output op gets that output's dY alone
        dys = [b.accumulate(grads[t], fwd.tensors[t].name) if t in grads else None
               for t in op.outputs]
        dy = dys if len(dys) > 1 else dys[0]
        op_grads = rule(b, op, dy, needs)
        if spec(op.type).layer and op_grads[0] is not None:
            layers.append(op_grads[0])
        for t, g in zip(op.inputs, op_grads):
            if g is not None:
                grads.setdefault(t, []).append(g)
    gradients = [(_own_gradient(b, grads, w), w) for w in trainable]
    graph = Graph(b.tensors, b.ops, list(b.links.values()) + targets,
                  [loss_tensor] + [g for g, _ in gradients])
    return Backprop(graph, {v: k for k, v in b.links.items()}, targets, loss_tensor, gradients,
                    layers)


def _own_gradient(b: Builder, grads: dict[int, list[int]], w: int) -> int:
    """A tensor holding only w's gradient (the runtime lays gradients out in one flat buffer)."""
    name = b.fwd.tensors[w].name
    if w not in grads:
        raise UserError(None, f"trainable tensor {w} ({name}) does not reach the loss")
    g = b.accumulate(grads[w], name)
    produced_for_w = any(g in op.outputs for op in b.ops) and \
        all(g not in op.inputs for op in b.ops)
    if produced_for_w:
        return g
    shape = np.array(b.fwd.tensors[w].shape, np.int32)
    return b.emit("RESHAPE", [g, b.const(shape, "shape")], like=w)
