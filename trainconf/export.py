"""`trainconf export`: put the trained weights of a .wof back into the frozen
graph and write a model for inference, as .circle (onert) or .tflite (LiteRT, onert).

What changes against the frozen model: the trainable tensors get their .wof
values as constants; activations get back the type (float32) and the batch
dimension the split model had (`batch` in the training metadata: dynamic, or a
fixed 1); the training metadata goes, and so do tensors no operator reads any
more (the outputs of folded shape chains).  Shape chains stay folded: the
RESHAPE that a dynamic-batch Flatten became reads a constant shape with -1 as
its batch, which TFLite and onert infer at run time.  Recurrent layers stay
unrolled; trainconf/portable.py writes what onert lacks as operators it runs,
with the same values, and computes at run time any other shape holding the batch.
Low-rank adapters (`split --lora`) are folded into their weights, or kept.
With `int8`, the float model is then written full-integer (trainconf/int8.py).
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tflite

from microtrain.files.artifacts import TRAINING_META, load_artifacts, sibling
from microtrain.files.contracts import Adapters, Quantization
from microtrain.data import spec_file
from microtrain.files.atomic import atomic_write
from microtrain.files.opening import check_output
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (TYPE_NAMES, add_operator_code, enum_names, int_list,
                                           load_model, model_to_bytes, op_name, remove_metadata)
from microtrain.files.graph import BATCH, graph_of

from .circle_plus import METADATA as CIRCLE_PLUS, set_circle_plus, to_circle_plus
from .importer import TFLITE_VERSION
from .int8 import DEFAULT_IO, has_record, to_int8
from .quantize import round_weights
from .lora import adapters_of, merge as merge_adapters
from .portable import make_portable
from .select import weighted_ops
from .split import activations
from .writer import set_constant

IDENTIFIERS = {".circle": b"CIR0", ".tflite": b"TFL3"}
WEIGHT_TYPES = ("fp32", "fp16")
LORA_EXPORTS = ("merge", "keep")
# TFLite's op version of DEQUANTIZE that reads float16 (its versions: 1 uint8,
# 2 int8, 3 float16).
DEQUANTIZE_FP16_VERSION = 3


@dataclass
class ExportResult:
    path: Path
    format: str  # "circle" or "tflite"
    weights: str  # "fp32" or "fp16"
    batch: str  # "dynamic" or "1"
    activations: str  # "float32" or "int8"
    io: str  # the input and output tensors' type: "float32" or "int8"
    traininfo: bool  # carries circle+ CIRCLE_TRAINING
    trained_tensors: int
    tensors: int
    operators: int
    bytes: int

    def summary(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()}


def export(frozen, output, wof=None, weights: str = "fp32", traininfo: bool = False,
           force: bool = False, lora: str = "merge", int8: bool | None = None,
           calibration=(), io: str | None = None) -> ExportResult:
    """Write FROZEN with the weights of `wof` (default STEM.wof beside it) to
    `output`, whose suffix (.circle or .tflite) chooses the format.  With
    `traininfo`, the training setup goes along as circle+ CIRCLE_TRAINING.
    A model with LoRA adapters gets them folded into its weights (`lora`
    "merge": the original structure) or kept as operators ("keep").  `int8`
    (None: when FROZEN records int8 ranges) writes a full-integer model, its
    activation ranges from the `calibration` files or the record, its input
    and output of type `io` ("int8", the default, or "float")."""
    frozen, output = Path(frozen), Path(output)
    identifier = IDENTIFIERS.get(output.suffix)
    if identifier is None:
        raise UserError(output, "the output must end in .circle or .tflite")
    check_output(output, (output.suffix[1:],), force,
                 reads=(("FROZEN", frozen), ("--wof", wof or sibling(frozen, ".wof")),
                        *(("--calibration", spec_file(c)) for c in calibration)))
    if lora not in LORA_EXPORTS:
        raise UserError(None, f"unknown --lora {lora!r} (choose {' or '.join(LORA_EXPORTS)})")
    if weights not in WEIGHT_TYPES:
        raise UserError(None, f"unknown weight type {weights!r} (choose fp32 or fp16)")
    art = load_artifacts(frozen, wof, with_backprop=False)
    model = load_model(frozen)
    for t, value in art.weights.items():
        set_constant(model, t, np.asarray(value, np.float32))
    trained = set(art.weights)
    round_weights(model)  # a model trained through fake quantization: weights on their grids
    if lora == "merge" and adapters_of(model) is not None:
        trained = merge_adapters(model, art.weights)
    remove_metadata(model, Adapters.NAME)
    batch = art.training.batch
    restore_activations(model, batch)
    make_portable(model, batch)
    int8 = has_record(model) if int8 is None else int8
    if int8:
        if weights != "fp32" or traininfo:
            raise UserError(None, "an int8 export holds int8 weights and no training setup: "
                                  "--weights fp16 and --traininfo are for float exports")
        io = io or DEFAULT_IO
        to_int8(model, frozen, calibration, io)
    elif calibration or io:
        raise UserError(None, f"--{'calibration' if calibration else 'io'} is for an int8 "
                              "export (--int8)")
    remove_metadata(model, Quantization.NAME)
    remove_metadata(model, TRAINING_META)
    remove_metadata(model, CIRCLE_PLUS)
    trainable_ops = trainable_operators(model, trained) if traininfo else []
    if weights == "fp16":
        shift = dequantize_weights(model)
        trainable_ops = [i + shift for i in trainable_ops]
    if traininfo:
        t, p = art.training, art.training.parameters
        try:
            if t.ignore_index is not None or t.from_logits:
                raise UserError(None, "circle+ cannot hold the loss's --ignore-index or "
                                      "--from-logits")
            set_circle_plus(model, to_circle_plus(p.optimizer, p.hyperparameters, t.loss,
                                                  t.reduction, p.epochs, p.batch_size,
                                                  trainable_ops))
        except UserError as e:
            raise e.at(frozen) from None
    prune(model)
    if identifier == b"TFL3":
        check_tflite(model, frozen)
        model.version = TFLITE_VERSION
    data = model_to_bytes(model, identifier)
    atomic_write(output, data)
    return ExportResult(output, output.suffix[1:], "int8" if int8 else weights,
                        "dynamic" if batch == BATCH else "1", "int8" if int8 else "float32",
                        "int8" if int8 and io == "int8" else "float32", traininfo,
                        len(art.weights), len(model.subgraphs[0].tensors),
                        len(model.subgraphs[0].operators), len(data))


def restore_activations(model, batch: int) -> None:
    """Give activations float32 (the split may have made them float16, or int8
    levels of a FAKE_QUANT) and, for a model whose batch was a fixed 1, that batch
    instead of the split's -1 (integer tensors such as token ids too)."""
    sg = model.subgraphs[0]
    g = graph_of(model)
    for t in activations(g) | {t.index for t in g.tensors if t.fake_quant}:
        sg.tensors[t].type = circle.TensorType.FLOAT32
        if g.tensors[t].fake_quant:
            sg.tensors[t].quantization = None
    for t in set(g.inputs) | {t for op in g.ops for t in op.outputs} if batch != BATCH else ():
        sg.tensors[t].shapeSignature = None
    if batch == BATCH:
        return
    for op in g.ops:  # the split wrote RESHAPE's batch as -1: its rows at batch 1 again
        if op.type == "RESHAPE" and len(op.inputs) > 1 and g.tensors[op.inputs[1]].data is not None:
            shape = np.array(g.tensors[op.inputs[1]].data, np.int32)
            if shape.size and shape[0] == BATCH:
                shape[0] = sg.tensors[op.outputs[0]].shape[0]
                set_constant(model, op.inputs[1], shape)


def trainable_operators(model, trained: set[int]) -> list[int]:
    """circle+'s trainable_ops: every operator from the lowest one whose weights
    train to the last, except weighted operators whose weights stay frozen."""
    g = graph_of(model)
    weighted = {u.op.index: bool(trained & {u.kernel, u.bias}) for u in weighted_ops(g)}
    lowest = min(i for i, trains in weighted.items() if trains)
    return [i for i in range(lowest, len(g.ops)) if weighted.get(i, True)]


def dequantize_weights(model) -> int:
    """Store every float32 constant an operator reads as float16, read through a
    DEQUANTIZE operator that restores it to float32 at load time (what TFLite's
    float16 quantization writes, and how MediaPipe ships its models).  Returns
    the number of DEQUANTIZE operators, placed first."""
    sg = model.subgraphs[0]
    read = {t for op in sg.operators for t in int_list(op.inputs) if t >= 0}
    code = add_operator_code(model, "DEQUANTIZE")
    model.operatorCodes[code].version = DEQUANTIZE_FP16_VERSION
    dequantize = []
    for t in sorted(read):
        tensor = sg.tensors[t]
        data = model.buffers[tensor.buffer].data
        if tensor.type != circle.TensorType.FLOAT32 or data is None or len(data) == 0:
            continue
        half = circle.TensorT(name=f"{tensor.name}/fp16", type=circle.TensorType.FLOAT16,
                              shape=list(int_list(tensor.shape)))
        sg.tensors.append(half)
        set_constant(model, len(sg.tensors) - 1,
                     np.frombuffer(bytes(data), "<f4").astype(np.float16)
                     .reshape(half.shape))
        tensor.buffer = 0
        dequantize.append(circle.OperatorT(opcodeIndex=code, inputs=[len(sg.tensors) - 1],
                                           outputs=[t]))
    sg.operators = dequantize + list(sg.operators)
    return len(dequantize)


def prune(model) -> None:
    """Drop the first subgraph's tensors that no operator, input, output or
    signature uses, buffers nothing refers to, and operator codes no operator
    uses (those of rewritten operators); renumber the rest."""
    sg = model.subgraphs[0]
    used = set(int_list(sg.inputs)) | set(int_list(sg.outputs))
    for op in sg.operators or ():
        used |= {t for t in int_list(op.inputs) + int_list(op.outputs)
                 + int_list(op.intermediates) if t >= 0}
    for sig in model.signatureDefs or ():
        if sig.subgraphIndex == 0:
            used |= {m.tensorIndex for m in (sig.inputs or []) + (sig.outputs or [])}
    keep = sorted(used)
    new = {old: i for i, old in enumerate(keep)}
    sg.tensors = [sg.tensors[i] for i in keep]

    def renumber(indices):
        return None if indices is None else [new[t] if t >= 0 else t for t in int_list(indices)]
    sg.inputs, sg.outputs = renumber(sg.inputs), renumber(sg.outputs)
    for op in sg.operators or ():
        op.inputs, op.outputs = renumber(op.inputs), renumber(op.outputs)
        op.intermediates = renumber(op.intermediates)
    for sig in model.signatureDefs or ():
        if sig.subgraphIndex == 0:
            for m in (sig.inputs or []) + (sig.outputs or []):
                m.tensorIndex = new[m.tensorIndex]
    _prune_buffers(model)
    _prune_operator_codes(model)


def _prune_operator_codes(model) -> None:
    ops = [op for sg in model.subgraphs for op in sg.operators or ()]
    keep = sorted({op.opcodeIndex for op in ops})
    new = {old: i for i, old in enumerate(keep)}
    model.operatorCodes = [model.operatorCodes[c] for c in keep]
    for op in ops:
        op.opcodeIndex = new[op.opcodeIndex]


def _prune_buffers(model) -> None:
    tensors = [t for sg in model.subgraphs for t in sg.tensors or ()]
    used = {0} | {t.buffer for t in tensors} | {m.buffer for m in model.metadata or ()}
    used |= set(int_list(model.metadataBuffer))
    keep = sorted(used)
    new = {old: i for i, old in enumerate(keep)}
    model.buffers = [model.buffers[b] for b in keep]
    for t in tensors:
        t.buffer = new[t.buffer]
    for m in model.metadata or ():
        m.buffer = new[m.buffer]
    if model.metadataBuffer is not None:
        model.metadataBuffer = [new[b] for b in int_list(model.metadataBuffer)]


def _tflite_has(enum, name: str, value: int) -> bool:
    return getattr(enum, name, None) == value


def check_tflite(model, path) -> None:
    """Refuse what TFLite's schema cannot hold: circle's own operators (negative
    codes in schemas/circle.fbs), options tables and tensor types.  TFLite's side
    is read from TensorFlow's own bindings of its schema (the tflite package)."""
    names = {e: enum_names(getattr(circle, e)) for e in
             ("BuiltinOperator", "BuiltinOptions", "BuiltinOptions2")}
    for code in model.operatorCodes or ():
        name = names["BuiltinOperator"].get(code.builtinCode, str(code.builtinCode))
        if not _tflite_has(tflite.BuiltinOperator, name, code.builtinCode):
            raise UserError(path, f"uses the circle-only operator {name}, which a .tflite "
                                  "cannot hold: export to .circle instead")
    for s, sg in enumerate(model.subgraphs):
        for o, op in enumerate(sg.operators or ()):
            for enum, kind in (("BuiltinOptions", op.builtinOptionsType),
                               ("BuiltinOptions2", op.builtinOptions2Type)):
                name = names[enum].get(kind, str(kind))
                if kind and not _tflite_has(getattr(tflite, enum), name, kind):
                    raise UserError(path, f"subgraph {s} operator {o} ({op_name(model, op)}) has "
                                          f"the circle-only options {name}, which a .tflite "
                                          "cannot hold: export to .circle instead")
        for tensor in sg.tensors or ():
            name = TYPE_NAMES.get(tensor.type, str(tensor.type))
            if not _tflite_has(tflite.TensorType, name, tensor.type):
                raise UserError(path, f"tensor '{tensor.name}' has the circle-only type {name}, "
                                      "which a .tflite cannot hold: export to .circle instead")
