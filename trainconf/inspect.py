"""`trainconf inspect`: what a model holds, as a dict (for --json) or as text."""
from pathlib import Path

import numpy as np

from microtrain.files.artifacts import TRAINING_META, load_artifacts, sibling
from microtrain.files.contracts import TrainingMeta
from microtrain.files.format import circle_generated as circle
from microtrain.files.quantization import quantization_of
from microtrain.run_config import DEFAULT_DIVERGENCE_SNAPSHOT
from microtrain.files.format.model import (TYPE_NAMES, enum_names, get_metadata, int_list, op_name,
                                           options_dict, tensor_dtype)
from microtrain.files.graph import stores_levels

from .constants import RESOLVERS, is_quantized
from .memory import measure_scratch, peak, peak_text, scratch_points
from .recompute import summary as recompute_summary
from .operators import spec
from .unroll import loops_of

ACTIVATIONS = enum_names(circle.ActivationFunctionType)


def training_support(op_type: str) -> str:
    """How `trainconf split` treats an operator: it has a gradient rule, it is
    folded into a constant (shape computations), it is lowered into operators
    that train (recurrent layers, unrolled over time), it runs forward only (below
    the lowest trained layer), it is a loop unrolled into flat operators, or
    microtrain cannot run it."""
    op = spec(op_type)
    if op_type == "WHILE":
        return "unrolled"
    if op.lowered:
        return "lowered"
    if op.gradient:
        return "gradient"
    if op.fold:
        return "folded"
    return "forward only" if op.forward else "unsupported"


def describe(model: circle.ModelT) -> dict:
    subgraphs = [_subgraph(model, s, sg) for s, sg in enumerate(model.subgraphs)]
    return {
        "version": model.version,
        "description": model.description,
        "metadata": [m.name for m in model.metadata or ()],
        "signatures": [sig.signatureKey for sig in model.signatureDefs or ()],
        "subgraphs": subgraphs,
        "loops": [loop.to_dict() for loop in loops_of(model)],
        "totals": {key: sum(sg["totals"][key] for sg in subgraphs)
                   for key in ("operators", "constants", "parameters", "bytes")},
    }


def trained(path: Path, model: circle.ModelT) -> dict | None:
    """What a frozen model written by `trainconf split` trains: the --trainable
    scheme it was chosen by (or --memory-budget's choice in those terms), the
    count of trainable tensors and their partial rows, and what its memory plan
    assumed of `microtrain run`'s options (None: not recorded); else None."""
    raw = get_metadata(model, TRAINING_META)
    if raw is None:
        return None
    training = TrainingMeta.from_json(raw, path)
    planned = training.planned_for
    return {"scheme": training.scheme, "tensors": len(training.trainable),
            "rows": {str(t): list(r) for t, r in training.rows.items()},
            "planned_for": planned.to_dict() if planned else None}


def planned_memory(path: Path, model: circle.ModelT, batch: int | None, optimizer: str | None,
                   accum_steps: int | None = None, embedding_update: str | None = None,
                   divergence_snapshot: str = DEFAULT_DIVERGENCE_SNAPSHOT,
                   loss_scale: str | None = None) -> dict | None:
    """The planned peak of a training step for a frozen model written by
    `trainconf split` whose .wof and backprop graph lie beside it; else None.
    `batch` and `optimizer` default to the model's recorded training parameters;
    `accum_steps`, `embedding_update` and `loss_scale` to what its plan assumed of
    the run (TrainingMeta.planned_for), else microtrain run's defaults."""
    files = {"frozen": Path(path), "wof": sibling(Path(path), ".wof"),
             "backprop": sibling(Path(path), ".backprop.circle")}
    if get_metadata(model, TRAINING_META) is None or not all(f.exists() for f in files.values()):
        return None
    art = load_artifacts(path)
    recorded = art.training.parameters
    batch, optimizer = batch or recorded.batch_size, optimizer or recorded.optimizer
    given = {"accum_steps": accum_steps, "embedding_update": embedding_update,
             "loss_scale": loss_scale}
    assumed = art.training.planned_for.to_dict() if art.training.planned_for else {}
    # neither given nor recorded: peak()'s defaults, microtrain run's
    run = {k: v if v is not None else assumed.get(k) for k, v in given.items()}
    plan = art.links.memory
    if plan is None:
        return None
    if scratch_points(batch) != plan.kernel_scratch_measured_at:
        plan.kernel_scratch = tuple(measure_scratch(art, batch))  # exact at this batch
    memory = peak(art, batch, optimizer, {name: f.stat().st_size for name, f in files.items()},
                  divergence_snapshot=divergence_snapshot,
                  **{k: v for k, v in run.items() if v is not None})
    return {**memory, "recompute": recompute_summary(art)}


def _subgraph(model, s: int, sg) -> dict:
    tensors = sg.tensors or []
    readers: dict[int, int] = {}
    for op in sg.operators or ():
        for t in int_list(op.inputs):
            readers[t] = readers.get(t, 0) + 1
    constants = [_constant(model, t, tensors[t], readers.get(t, 0)) for t in range(len(tensors))
                 if _data_size(model, tensors[t])]
    stored = _stored_constants(model, sg)
    levels = {t for op in sg.operators or () for t in int_list(op.outputs)
              if stores_levels(op_name(model, op), tensor_dtype(tensors[t]))}
    operators = [_operator(model, k, op, tensors, stored, levels)
                 for k, op in enumerate(sg.operators or ())]
    return {
        "index": s,
        "name": sg.name,
        "inputs": [_io(t, tensors[t]) for t in int_list(sg.inputs)],
        "outputs": [_io(t, tensors[t]) for t in int_list(sg.outputs)],
        "operators": operators,
        "constants": constants,
        "totals": {"tensors": len(tensors), "operators": len(operators),
                   "constants": len(constants),
                   "shared_constants": sum(c["readers"] > 1 for c in constants),
                   "parameters": sum(c["parameters"] for c in constants),
                   "bytes": sum(c["bytes"] for c in constants)},
    }


def _shape(tensor) -> list[int]:
    """The shape with -1 for each dimension only known at run time."""
    return int_list(tensor.shapeSignature) if tensor.shapeSignature is not None else int_list(tensor.shape)


def _io(t: int, tensor) -> dict:
    """A model input or output; a quantized one with its scales and zero points (what
    its integers stand for: scale · (q − zero_point))."""
    shape = _shape(tensor)
    batch = None if not shape else "dynamic" if shape[0] == -1 else "fixed"
    io = {"index": t, "name": tensor.name, "type": TYPE_NAMES.get(tensor.type, tensor.type),
          "shape": shape, "batch": batch}
    if (q := quantization_of(tensor)) is not None:
        io["quantization"] = {"scale": q.scale.tolist(), "zero_point": q.zero_point.tolist()}
    return io


def _ref(t: int, tensors) -> dict:
    return {"index": t, "name": tensors[t].name if t >= 0 else None}


def _stored_constants(model, sg) -> set[int]:
    """Tensors that hold data, and the outputs of DEQUANTIZE/DENSIFY chains over them
    (split folds a DENSIFY -> DEQUANTIZE chain into one float32 constant)."""
    tensors = sg.tensors or []
    stored = {t for t in range(len(tensors)) if _data_size(model, tensors[t])}
    for op in sg.operators or ():
        inputs = int_list(op.inputs)
        if op_name(model, op) in RESOLVERS and inputs and inputs[0] in stored:
            stored.update(int_list(op.outputs))
    return stored


def _training(model, op, tensors, stored: set[int], levels: set[int]) -> str:
    """training_support, and what quantization or a stored form changes about it:
    `quantized` (it computes on quantized activations: it trains through fake
    quantization), `quantized weights` (dynamic-range int8 weights: kept on
    their grids or dequantized at split, --int8-weights), `folded` for a
    DEQUANTIZE/DENSIFY of a constant (`stored`).  A FAKE_QUANT's int8 levels
    (`levels`: a split's float values in storage) are no quantized activations."""
    name = op_name(model, op)
    indices = [t for t in int_list(op.inputs) if t >= 0]
    inputs = [tensors[t] for t in indices]
    constant = [t in stored for t in indices]
    if any(is_quantized(tensors[t]) and not c for t, c in zip(indices, constant)
           if t not in levels) or \
            any(is_quantized(tensors[t]) for t in int_list(op.outputs) if t not in levels):
        return "quantized"
    if name in RESOLVERS and constant and constant[0]:
        return "folded"
    if any(is_quantized(x) and c for x, c in zip(inputs, constant)):
        return "quantized weights"
    return training_support(name)


def _operator(model, k: int, op, tensors, stored: set[int], levels: set[int]) -> dict:
    name = op_name(model, op)
    options = options_dict(op, name)
    activation = options.get("fused_activation_function")
    return {
        "index": k,
        "type": name,
        "fused_activation": None if activation is None else ACTIVATIONS.get(activation, activation),
        "inputs": [_ref(t, tensors) for t in int_list(op.inputs)],
        "outputs": [_ref(t, tensors) for t in int_list(op.outputs)],
        "options": options,
        "training": _training(model, op, tensors, stored, levels),
    }


def _data_size(model, tensor) -> int:
    data = model.buffers[tensor.buffer].data
    return 0 if data is None else len(data)


def _constant(model, t: int, tensor, readers: int) -> dict:
    """A constant; `readers` counts the operator inputs reading it (more than one:
    a shared constant, which `trainconf split` copies for each weighted op)."""
    return {"index": t, "name": tensor.name, "type": TYPE_NAMES.get(tensor.type, tensor.type),
            "shape": int_list(tensor.shape), "parameters": int(np.prod(int_list(tensor.shape))),
            "bytes": _data_size(model, tensor), "readers": readers}


# ---------------------------------------------------------------- text

def render_text(desc: dict) -> str:
    lines = [f"schema version {desc['version']}"
             + (f", {desc['description']!r}" if desc["description"] else "")]
    for sg in desc["subgraphs"]:
        lines += _subgraph_lines(sg)
    lines += _loop_lines(desc["loops"])
    n = desc["totals"]
    lines.append(f"total: {n['operators']} operators, {n['constants']} constant tensors, "
                 f"{n['parameters']} parameters, {n['bytes']} bytes")
    if desc.get("trainable"):
        t = desc["trainable"]
        rows = "".join(f", rows {lo}..{hi} of tensor {i}" for i, (lo, hi) in t["rows"].items())
        lines.append(f"trainable: {t['scheme'] or 'as recorded'} ({t['tensors']} tensors{rows})")
    if desc.get("memory"):
        lines.append(peak_text(desc["memory"]))
    return "\n".join(lines)


def _loop_lines(loops: list[dict]) -> list[str]:
    """Each WHILE loop: how many steps split unrolls it into, or why it cannot."""
    lines = [f"loops (split unrolls them): {len(loops)}"] if loops else []
    for loop in loops:
        steps = f"{loop['trips']} steps" if loop["reason"] is None else \
            f"cannot be unrolled: {loop['reason']}"
        lines.append(f"  subgraph {loop['subgraph']} operator {loop['operator']}: body "
                     f"{loop['body']!r}, cond {loop['cond']!r}: {steps}")
    return lines


def _scales(io: dict) -> str:
    q = io.get("quantization")
    return "" if q is None else f"  scale {q['scale'][0]:.9g}, zero point {q['zero_point'][0]}" \
        if len(q["scale"]) == 1 else f"  {len(q['scale'])} scales"


def _tensor_text(t: dict) -> str:
    return f"#{t['index']} {t['name']}" if t["index"] >= 0 else "(none)"


def _subgraph_lines(sg: dict) -> list[str]:
    n = sg["totals"]
    lines = [f"subgraph {sg['index']} {sg['name'] or ''}: {n['tensors']} tensors, "
             f"{n['operators']} operators"]
    for kind in ("inputs", "outputs"):
        lines.append(f"  {kind}:")
        lines += [f"    {_tensor_text(t)}  {t['type']} {t['shape']}"
                  + (f"  ({t['batch']} batch)" if t["batch"] else "") + _scales(t)
                  for t in sg[kind]]
    lines.append("  operators:")
    for op in sg["operators"]:
        act = op["fused_activation"]
        act = f"  activation {act}" if act not in (None, "NONE") else ""
        lines += [f"    {op['index']}: {op['type']}{act}  [training: {op['training']}]",
                  "       in:  " + ", ".join(map(_tensor_text, op["inputs"])),
                  "       out: " + ", ".join(map(_tensor_text, op["outputs"]))]
    lines.append("  constants:")
    lines += [f"    {_tensor_text(c)}  {c['type']} {c['shape']}  {c['parameters']} parameters, "
              f"{c['bytes']} bytes" + (f", shared by {c['readers']} operator inputs"
                                       if c["readers"] > 1 else "") for c in sg["constants"]]
    lines.append(f"  {n['constants']} constant tensors ({n['shared_constants']} shared), "
                 f"{n['parameters']} parameters, {n['bytes']} bytes")
    return lines
