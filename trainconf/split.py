"""`trainconf split`: cut the trainable weights out of a model into a .wof and
generate its backpropagation graph."""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from microtrain.atomic import atomic_write
from microtrain.errors import UserError
from microtrain.format.model import load_model, model_to_bytes, set_metadata
from microtrain.format.wof import wof_to_bytes
from microtrain.graph import BATCH, Graph, graph_of
from microtrain.artifacts import BACKPROP_META, TRAINING_META

from .backprop import LOGITS_OF, LOSSES, REDUCTIONS, Backprop, build_backprop
from .fold import fold_shape_chains
from .select import select_trainable
from .writer import graph_to_model, set_constant


@dataclass
class SplitResult:
    frozen: Path
    wof: Path
    backprop: Path
    trainable: list[dict]
    backprop_ops: int
    loss: str
    reduction: str
    precision: dict

    def summary(self) -> dict:
        files = {k: {"path": str(p), "bytes": p.stat().st_size}
                 for k, p in (("frozen", self.frozen), ("wof", self.wof), ("backprop", self.backprop))}
        return {"trainable_tensors": len(self.trainable),
                "trainable_parameters": sum(t["parameters"] for t in self.trainable),
                "trainable": self.trainable, "backprop_ops": self.backprop_ops,
                "loss": self.loss, "reduction": self.reduction, "precision": self.precision,
                "files": files}


def _activations(g: Graph) -> set[int]:
    """Float tensors computed from the inputs: those that have a batch dimension."""
    computed = set(g.inputs) | {t for op in g.ops for t in op.outputs}
    return {t for t in computed if np.issubdtype(g.tensors[t].dtype, np.floating)}


def make_batch_symbolic(model, g: Graph) -> None:
    """Write the batch dimension of every activation as -1, so the artifacts train at
    any batch size.  Models with a fixed batch above 1 are refused."""
    sg = model.subgraphs[0]
    for i in g.inputs:
        if g.tensors[i].shape and g.tensors[i].shape[0] not in (1, BATCH):
            raise UserError(None, f"input {g.tensors[i].name!r} has a fixed batch of "
                                  f"{g.tensors[i].shape[0]}; only models with a dynamic batch "
                                  "or a batch of 1 can be split")
    for i in _activations(g):
        t = g.tensors[i]
        if t.shape:
            t.shape = (BATCH,) + t.shape[1:]
            sg.tensors[i].shapeSignature = list(t.shape)
            sg.tensors[i].shape = [1] + list(t.shape[1:])
    for op in g.ops:
        if op.type == "RESHAPE" and len(op.inputs) > 1 and g.tensors[op.inputs[1]].data is not None:
            shape = np.array(g.tensors[op.outputs[0]].shape, np.int32)
            set_constant(model, op.inputs[1], shape)


def fold(model, g: Graph) -> Graph:
    """Fold shape chains in the model; returns the graph of the folded model."""
    folded, constants = fold_shape_chains(g)
    for t, value in constants.items():
        set_constant(model, t, value)
    sg = model.subgraphs[0]
    sg.operators = [op for i, op in enumerate(sg.operators) if i not in folded]
    folded_graph = graph_of(model)
    for t in _activations(folded_graph):  # keep the symbolic batch made above
        folded_graph.tensors[t].shape = g.tensors[t].shape
    return folded_graph


PRECISIONS = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}


def resolve_precision(precision: str = "fp32", weight_dtype: str | None = None,
                      activation_dtype: str | None = None, grad_dtype: str | None = None) -> dict:
    """The preset, with any of the three types overridden: {"weights": "fp16", ...}."""
    chosen = {"weights": weight_dtype, "activations": activation_dtype, "gradients": grad_dtype}
    for key, value in chosen.items():
        value = value or precision
        if value not in PRECISIONS:
            raise UserError(None, f"unknown {key} type {value!r} (choose fp32 or fp16)")
        chosen[key] = value
    return chosen


def set_activation_dtype(model, g: Graph, dtype: np.dtype) -> None:
    from .writer import TENSOR_TYPES
    for t in _activations(g):
        g.tensors[t].dtype = dtype
        model.subgraphs[0].tensors[t].type = TENSOR_TYPES[dtype]


def default_loss(g: Graph) -> str:
    producers = g.producers()
    last = producers.get(g.outputs[0])
    return "cce" if last is not None and last.type == "SOFTMAX" else "mse"


def cut_weights(model, trainable: list[int]) -> dict[int, np.ndarray]:
    """Remove the trainable tensors' data from the model; returns it for the .wof."""
    from microtrain.format.model import buffer_array
    sg = model.subgraphs[0]
    weights = {t: buffer_array(model, sg.tensors[t]) for t in trainable}
    for t in trainable:
        old = sg.tensors[t].buffer
        sg.tensors[t].buffer = 0
        if all(x.buffer != old for x in sg.tensors):
            model.buffers[old].data = None
    return weights


def _backprop_meta(bp: Backprop, frozen_bytes: bytes) -> dict:
    return {"version": 1, "frozen_sha256": hashlib.sha256(frozen_bytes).hexdigest(),
            "forward": sorted([b, f] for b, f in bp.forward_links.items()),
            "targets": bp.targets, "loss": bp.loss,
            "gradients": [[b, f] for b, f in bp.gradients]}


def output_paths(model_path: Path, out_dir: Path | None) -> tuple[Path, Path, Path]:
    out = Path(out_dir) if out_dir else model_path.parent
    stem = model_path.stem
    return out / f"{stem}.frozen.circle", out / f"{stem}.wof", out / f"{stem}.backprop.circle"


def split(model_path, out_dir=None, trainable: str = "all", loss: str | None = None,
          reduction: str = "mean", freeze_bias: bool = False, precision: str = "fp32",
          weight_dtype: str | None = None, activation_dtype: str | None = None,
          grad_dtype: str | None = None) -> SplitResult:
    """Write STEM.frozen.circle, STEM.wof and STEM.backprop.circle for MODEL."""
    model_path = Path(model_path)
    model = load_model(model_path)
    try:
        types = resolve_precision(precision, weight_dtype, activation_dtype, grad_dtype)
        return _split(model, model_path, out_dir, trainable, loss, reduction, freeze_bias, types)
    except UserError as e:
        if str(e).startswith(f"{model_path}:"):
            raise
        raise UserError(model_path, str(e)) from None


def _split(model, model_path, out_dir, trainable, loss, reduction, freeze_bias, types) -> SplitResult:
    g = graph_of(model)
    make_batch_symbolic(model, g)
    g = fold(model, g)
    set_activation_dtype(model, g, PRECISIONS[types["activations"]])
    weights = select_trainable(g, trainable, freeze_bias)
    loss = loss or default_loss(g)
    if loss not in LOSSES or reduction not in REDUCTIONS:
        raise UserError(None, f"unknown loss {loss!r} or reduction {reduction!r}")
    bp = build_backprop(g, weights, loss, reduction, PRECISIONS[types["gradients"]])
    arrays = cut_weights(model, weights)
    set_metadata(model, TRAINING_META, json.dumps({
        "version": 1, "loss": loss, "reduction": reduction, "trainable": weights,
        "precision": types,
        "stable_logits_loss": LOGITS_OF.get(loss) == g.producers()[g.outputs[0]].type
        if g.outputs[0] in g.producers() else False,
    }).encode())
    frozen_bytes = model_to_bytes(model)
    backprop_model = graph_to_model(bp.graph, "microtrain backprop graph",
                                    {BACKPROP_META: json.dumps(_backprop_meta(bp, frozen_bytes)).encode()})
    frozen_path, wof_path, backprop_path = output_paths(model_path, out_dir)
    frozen_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(frozen_path, frozen_bytes)
    atomic_write(wof_path, wof_to_bytes(len(g.tensors), arrays))
    atomic_write(backprop_path, model_to_bytes(backprop_model))
    info = [{"index": t, "name": g.tensors[t].name, "shape": list(g.tensors[t].shape),
             "parameters": int(np.prod(g.tensors[t].shape))} for t in weights]
    return SplitResult(frozen_path, wof_path, backprop_path, info, len(bp.graph.ops), loss, reduction,
                       types)
