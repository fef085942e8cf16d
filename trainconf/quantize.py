"""Training through int8 quantization (docs/quantization.md, schemas/quantization.md).

Three cases become one form, a float graph with fake quantization:
- a full-integer int8 model: its int8 tensors become float32 (weights and biases
  dequantized, the .wof's fp32 master), each operator's scales kept;
- a dynamic-range model (int8 weights, float activations) with `--int8-weights
  keep`: its weights likewise, its activations stay float;
- a float model with `--quantize int8 --calibration X.npy`: activation ranges
  from X, per-channel symmetric weight scales from the weights.

Every quantized activation is then written through a FAKE_QUANT operator, and
every quantized weight or bias read through a FakeQuantPerChannel operator (when
it trains; a frozen one is rounded once, here).  A trained weight's scales track
it (each channel's max|w|/127, as TensorFlow's quantization-aware training and
the int8 export compute them) unless `--weight-scales fixed` keeps the recorded
ones, under which a weight that outgrows its grid clamps and stops learning.
The scales are recorded in the frozen model's `microtrain.quantization`
metadata, which `trainconf export` reads to write the int8 model.
"""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from microtrain.files.contracts import Quantization, TensorRange, WeightScales
from microtrain.data import load_array
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import (TYPE_NAMES, add_operator_code, buffer_array,
                                           get_metadata, int_list, op_name, remove_metadata,
                                           set_builtin_options, set_metadata)
from microtrain.files.graph import Graph, concrete_shape, graph_of
from microtrain.step.kernels import build as build_kernel
from microtrain.step.kernels.fake_quant import (channel_shape, range_of, scale_zero_point,
                                                symmetric_levels, tracked_scales)

from .constants import dequantized, is_quantized, set_float
from .portable import Editor
from .writer import circle_quantization, set_constant

METADATA = Quantization.NAME
QUANTIZE_CHOICES = ("int8",)
INT8_WEIGHTS = ("keep", "dequantize")  # what split does with a dynamic-range model's weights
DEFAULT_INT8_WEIGHTS = "keep"  # the deployed form
DEFAULT_QAS = True
WEIGHT_SCALES = ("track", "fixed")  # a trained weight's scales: its max|w|/127, or recorded
DEFAULT_WEIGHT_SCALES = "track"
# operators TFLite runs on int8 with their output on their input's grid
SAME_GRID = {"RESHAPE", "SQUEEZE", "EXPAND_DIMS", "MAX_POOL_2D", "TRANSPOSE", "STRIDED_SLICE",
             "SLICE", "SPACE_TO_DEPTH", "DEPTH_TO_SPACE"}
# outputs whose int8 grid TFLite fixes: (scale, zero point)
FIXED_GRID = {"SOFTMAX": (1 / 256, -128), "LOGISTIC": (1 / 256, -128), "TANH": (1 / 128, 0)}
# weighted operators whose weight (input 1) and bias (input 2) int8 models quantize
# per output channel, and that channel's axis in the weight
CHANNEL_AXIS = {"CONV_2D": 0, "FULLY_CONNECTED": 0, "DEPTHWISE_CONV_2D": 3}
CALIBRATION_BATCH = 64


@dataclass(frozen=True)
class QuantSpec:
    """What split's --quantize, --calibration, --qas, --int8-weights and
    --weight-scales ask for."""
    quantize: str | None = None
    calibration: Path | None = None
    qas: bool = DEFAULT_QAS
    int8_weights: str = DEFAULT_INT8_WEIGHTS
    weight_scales: str = DEFAULT_WEIGHT_SCALES


@dataclass
class Record:
    """The grids of a fake-quantized model, by tensor index of the frozen model:
    activations {t: (scale, zero point)} as int8; weights {t: (axis, bits, scales)}
    symmetric per channel (bits 8: a weight, 32: a bias)."""
    activations: dict[int, tuple[float, int]] = field(default_factory=dict)
    weights: dict[int, tuple[int, int, list[float]]] = field(default_factory=dict)
    qas: bool = DEFAULT_QAS

    def to_json(self) -> bytes:
        """As the `microtrain.quantization` contract that export reads (contracts.Quantization)."""
        return Quantization(
            Quantization.VERSION,
            {t: TensorRange(scale=float(s), zero_point=int(z))
             for t, (s, z) in sorted(self.activations.items())},
            {t: WeightScales([float(v) for v in s], axis=a, bits=b)
             for t, (a, b, s) in sorted(self.weights.items())}, self.qas).to_json()

    @classmethod
    def from_json(cls, raw: bytes, path=None) -> "Record":
        q = Quantization.from_json(raw, path)
        if any(r.scale is None for r in q.activations.values()) or \
                any(w.axis is None for w in q.weights.values()):
            raise UserError(path, f"{METADATA}: a fake-quantized split records every grid "
                                  "(scale and zero point, weight axis)")
        return cls({t: (r.scale, r.zero_point) for t, r in q.activations.items()},
                   {t: (w.axis, w.bits or 8, list(w.scale)) for t, w in q.weights.items()},
                   DEFAULT_QAS if q.qas is None else q.qas)


def record_of(model) -> Record | None:
    """The model's quantization record (None: it was not split quantized)."""
    raw = get_metadata(model, METADATA)
    return None if raw is None else Record.from_json(raw)


# ---------------------------------------------------------------- int8 models

def from_integer(model, spec: QuantSpec) -> Record | None:
    """Turn an int8 model's quantized tensors into float32 in place, recording
    their grids; None for a float model (or dynamic-range weights dequantized)."""
    sg = model.subgraphs[0]
    computed = set(int_list(sg.inputs)) | {t for op in sg.operators for t in int_list(op.outputs)}
    activations = {t for t in computed if is_quantized(sg.tensors[t])}
    weights = _quantized_weights(model)
    if not activations and (not weights or spec.int8_weights == "dequantize"):
        return None
    if spec.quantize:
        raise UserError(None, "--quantize int8 is for float models: this one is quantized "
                              "already and trains with its own scales")
    record = Record(qas=spec.qas)
    for t in sorted(activations):
        record.activations[t] = _activation_grid(sg.tensors[t], t)
    for t, axis in weights.items():
        tensor = sg.tensors[t]
        bits = 32 if tensor.type == circle.TensorType.INT32 else 8
        record.weights[t] = (axis, bits, _channel_scales(tensor, axis, t))
    sg.operators = [op for op in sg.operators if not _final_dequantize(model, op, activations)]
    for op in sg.operators:
        if op_name(model, op) in ("QUANTIZE", "DEQUANTIZE") and int_list(op.inputs)[0] in computed:
            _as_fake_quant(model, op)
    for t in activations | set(weights):
        _to_float(model, t)
    return record


def _quantized_weights(model) -> dict[int, int]:
    """The int8 weights and int32 biases of the weighted operators: {tensor: channel axis}."""
    sg = model.subgraphs[0]
    found = {}
    for op in sg.operators:
        axis = CHANNEL_AXIS.get(op_name(model, op))
        inputs = int_list(op.inputs)
        for t in inputs[1:3] if axis is not None else ():
            tensor = sg.tensors[t] if t >= 0 else None
            if tensor is not None and is_quantized(tensor) and model.buffers[tensor.buffer].data \
                    is not None and tensor.sparsity is None:
                found[t] = axis if t == inputs[1] else 0
    return found


def _activation_grid(tensor, t: int) -> tuple[float, int]:
    q = tensor.quantization
    if tensor.type != circle.TensorType.INT8 or len(q.scale) != 1:
        raise UserError(None, f"tensor {t} '{tensor.name}' is {TYPE_NAMES[tensor.type]} with "
                              f"{len(q.scale)} scales: only int8 activations with one scale "
                              "can train")
    zero = int(q.zeroPoint[0]) if q.zeroPoint is not None and len(q.zeroPoint) else 0
    return float(q.scale[0]), zero


def _channel_scales(tensor, axis: int, t: int) -> list[float]:
    q = tensor.quantization
    if q.zeroPoint is not None and np.any(np.asarray(q.zeroPoint) != 0):
        raise UserError(None, f"tensor {t} '{tensor.name}' has non-zero zero points: only "
                              "symmetric int8 weights can train quantized")
    scales = np.asarray(q.scale, np.float64)
    channels = int_list(tensor.shape)[axis]
    return [float(s) for s in np.broadcast_to(scales, (channels,))]


def _final_dequantize(model, op, activations: set[int]) -> bool:
    """Whether op DEQUANTIZEs an int8 activation into a model output: then that
    activation becomes the output (the float form needs no DEQUANTIZE, and the
    loss reads a final SOFTMAX's logits)."""
    sg = model.subgraphs[0]
    if op_name(model, op) != "DEQUANTIZE":
        return False
    (source,), (out,) = int_list(op.inputs), int_list(op.outputs)
    if source not in activations or out not in int_list(sg.outputs):
        return False
    sg.outputs = [source if t == out else t for t in int_list(sg.outputs)]
    for signature in model.signatureDefs or ():
        for entry in signature.outputs or ():
            entry.tensorIndex = source if entry.tensorIndex == out else entry.tensorIndex
    return True


def _as_fake_quant(model, op) -> None:
    """A QUANTIZE (to its output's grid) or DEQUANTIZE (of a grid its input is on
    already) of an activation becomes a FAKE_QUANT of the float form."""
    sg = model.subgraphs[0]
    dequantize = op_name(model, op) == "DEQUANTIZE"
    t = int_list(op.inputs)[0] if dequantize else int_list(op.outputs)[0]
    scale, zero = _activation_grid(sg.tensors[t], t)
    op.opcodeIndex = add_operator_code(model, "FAKE_QUANT", 1)
    set_builtin_options(op, _fake_quant_options(scale, zero))


def _fake_quant_options(scale: float, zero: int):
    lo, hi = range_of(scale, zero)
    return circle.FakeQuantOptionsT(min=lo, max=hi, numBits=8, narrowRange=False)


def _to_float(model, t: int) -> None:
    tensor = model.subgraphs[0].tensors[t]
    value = buffer_array(model, tensor)
    if value is not None:
        set_float(model, t, dequantized(value, tensor))
    else:
        tensor.type, tensor.quantization = circle.TensorType.FLOAT32, None


# ---------------------------------------------------------------- float models

def calibrated(g: Graph, path: Path) -> Record:
    """The grids of a float model: each activation's range over the calibration
    data (its min and max, widened to hold 0, as TFLite's converter calibrates),
    or its input's for an operator that keeps the grid, or the grid TFLite fixes
    for SOFTMAX, LOGISTIC and TANH; each weight's per-channel symmetric scales
    max|w|/127, its bias's s_in·s_w."""
    ranges = activation_ranges(g, _calibration_data(g, path))
    record = Record()
    producers = g.producers()
    for t in [*g.inputs, *(t for op in g.ops for t in op.outputs)]:
        if t not in ranges:
            continue
        op = producers.get(t)
        if op is not None and op.type in FIXED_GRID:
            record.activations[t] = FIXED_GRID[op.type]
        elif op is not None and op.type in SAME_GRID and op.inputs[0] in record.activations:
            record.activations[t] = record.activations[op.inputs[0]]
        else:
            record.activations[t] = scale_zero_point(*ranges[t])
    for op in g.ops:
        _weight_grids(g, op, record)
    return record


def _weight_grids(g: Graph, op, record: Record) -> None:
    axis = CHANNEL_AXIS.get(op.type)
    if axis is None or g.tensors[op.inputs[1]].data is None:
        return
    w = g.tensors[op.inputs[1]].data
    others = tuple(a for a in range(w.ndim) if a != axis)
    peak = np.abs(w.astype(np.float64)).max(axis=others)
    scales = np.where(peak > 0, peak / 127, 1.0)
    record.weights[op.inputs[1]] = (axis, 8, [float(s) for s in scales])
    bias = op.inputs[2] if len(op.inputs) > 2 else -1
    if bias >= 0 and g.tensors[bias].data is not None and op.inputs[0] in record.activations:
        s_in = record.activations[op.inputs[0]][0]
        record.weights[bias] = (0, 32, [float(s_in * s) for s in scales])


def _calibration_data(g: Graph, path: Path) -> np.ndarray:
    if len(g.inputs) != 1:
        raise UserError(path, f"--calibration gives one input, but the model has {len(g.inputs)}")
    x = load_array(str(path), dtype=g.tensors[g.inputs[0]].dtype)
    want = g.tensors[g.inputs[0]].shape[1:]
    if x.ndim < 1 or len(x) == 0 or tuple(x.shape[1:]) != tuple(want):
        raise UserError(path, f"holds samples of shape {list(x.shape[1:])}, but the model's input "
                              f"takes {list(want)}")
    return x


def activation_ranges(g: Graph, x: np.ndarray) -> dict[int, tuple[float, float]]:
    """{float tensor computed from the input: (min, max) over x}, with microtrain's
    forward kernels, CALIBRATION_BATCH samples at a time."""
    ranges: dict[int, tuple[float, float]] = {}
    for start in range(0, len(x), CALIBRATION_BATCH):
        chunk = x[start:start + CALIBRATION_BATCH]
        values = _forward(g, chunk)
        for t, v in values.items():
            lo, hi = ranges.get(t, (0.0, 0.0))
            ranges[t] = (min(lo, float(v.min())), max(hi, float(v.max())))
    return ranges


def _forward(g: Graph, x: np.ndarray) -> dict[int, np.ndarray]:
    arrays = {t.index: t.data for t in g.tensors if t.data is not None}
    arrays[g.inputs[0]] = np.ascontiguousarray(x)
    computed = {}
    for op in g.ops:
        outs = [np.zeros(concrete_shape(g.tensors[t].shape, len(x)), g.tensors[t].dtype)
                for t in op.outputs]
        build_kernel(op.type, [arrays.get(t) if t >= 0 else None for t in op.inputs], outs,
                     **op.options)()
        for t, a in zip(op.outputs, outs):
            arrays[t] = a
            if a.dtype.kind == "f" and a.size:
                computed[t] = a
    if x.dtype.kind == "f":
        computed[g.inputs[0]] = x
    return computed


# ---------------------------------------------------------------- fake quantization

def fake_quantize_activations(model, g: Graph, record: Record, batch: int) -> Graph:
    """Write each recorded activation through a FAKE_QUANT: its producer (or the
    model's input) writes a new raw tensor, the FAKE_QUANT the activation.  Not
    after an operator that keeps its input's grid, nor after a final SOFTMAX or
    LOGISTIC (the loss reads their logits); a FAKE_QUANT's output is on its grid."""
    edit = Editor(model, g, batch)
    sg = model.subgraphs[0]
    outputs = set(g.outputs)
    raw = {t: _raw(edit, t) for t in g.inputs if t in record.activations}
    sg.inputs = [raw.get(t, t) for t in int_list(sg.inputs)]
    for t, r in raw.items():
        edit.ops.append(_fake_quant_op(edit, r, t, record.activations[t]))
    for op, original in zip(g.ops, sg.operators):
        edit.ops.append(original)
        original.outputs = list(op.outputs)
        for k, t in enumerate(op.outputs):
            if t in record.activations and not _on_grid(g, op, t, record, outputs):
                original.outputs[k] = r = _raw(edit, t)
                edit.ops.append(_fake_quant_op(edit, r, t, record.activations[t]))
    sg.operators = edit.ops
    return graph_of(model)


def _on_grid(g: Graph, op, t: int, record: Record, outputs: set[int]) -> bool:
    if op.type == "FAKE_QUANT" or (t in outputs and op.type in ("SOFTMAX", "LOGISTIC")):
        return True
    return op.type in SAME_GRID and record.activations.get(op.inputs[0]) == record.activations[t]


def _raw(edit: Editor, t: int) -> int:
    tensor = edit.g.tensors[t]
    return edit.tensor(f"{tensor.name}/float", tensor.shape, tensor.dtype)


def _fake_quant_op(edit: Editor, source: int, t: int, grid: tuple[float, int]):
    lo, hi = range_of(*grid)
    edit.op("FAKE_QUANT", [source], t, min=lo, max=hi, num_bits=8, narrow_range=False)
    return edit.ops.pop()


def fake_quantize_weights(model, g: Graph, record: Record, trainable: list[int],
                          batch: int, track: bool) -> Graph:
    """Read each recorded weight that trains through a FakeQuantPerChannel, so the
    forward re-rounds it after every update; round a frozen one once, here.  With
    `track`, a trained int8 weight's op has no scales input (they follow the
    weight) and its scales leave the record, so that export computes them from
    the trained weight as training did; a bias keeps its s_in·s_w of the split
    (at 32 bits the grids differ by far less than an activation's step)."""
    edit = Editor(model, g, batch)
    sg = model.subgraphs[0]
    for op, original in zip(g.ops, sg.operators):
        original.inputs = list(op.inputs)
        for k, t in enumerate(op.inputs):
            if t not in record.weights or CHANNEL_AXIS.get(op.type) is None:
                continue
            axis, bits, scales = record.weights[t]
            if t not in trainable:
                set_constant(model, t, rounded(g.tensors[t].data, axis, bits, scales))
                continue
            name = g.tensors[t].name
            inputs = [t]
            if track and bits == 8:
                del record.weights[t]
            else:
                inputs.append(edit.const(f"{name}/scales", np.asarray(scales, np.float32)))
            original.inputs[k] = edit.new("FakeQuantPerChannel", inputs, f"{name}/quantized",
                                          g.tensors[t].shape, g.tensors[t].dtype, axis=axis,
                                          num_bits=bits, qas=record.qas)
        edit.ops.append(original)
    sg.operators = edit.ops
    set_metadata(model, METADATA, record.to_json())
    return graph_of(model)


def rounded(w: np.ndarray, axis: int, bits: int, scales: list[float] | None) -> np.ndarray:
    """w on its channels' symmetric grids, as FakeQuantPerChannel computes it
    (scales None: tracked)."""
    s = tracked_scales(w, axis, bits) if scales is None else \
        np.asarray(scales, np.float64).reshape(channel_shape(w.ndim, axis, len(scales)))
    qmax = (1 << (bits - 1)) - 1
    return (np.clip(symmetric_levels(w, s), -qmax, qmax) * s).astype(w.dtype)


def prepare(model, g: Graph, spec: QuantSpec, record: Record | None, batch: int) -> Graph:
    """Calibrate a float model (--quantize), fake-quantize the activations and
    record the grids in the model's metadata; returns the new graph."""
    if spec.quantize:
        if spec.calibration is None:
            raise UserError(None, "--quantize int8 needs --calibration X.npy (samples of the "
                                  "model's input)", "--calibration")
        record = calibrated(g, spec.calibration)
        record.qas = spec.qas
    elif spec.calibration is not None:
        raise UserError(None, "--calibration applies to --quantize int8", "--calibration")
    if record is None:
        remove_metadata(model, METADATA)  # a model exported after training keeps none
        return g
    g = fake_quantize_activations(model, g, record, batch)
    set_metadata(model, METADATA, record.to_json())
    return g


def round_weights(model) -> None:
    """Fold every FakeQuantPerChannel into its weight: the weight (its trained
    value set in the model) becomes its rounded value, read directly again, as
    an exported model holds it; activations keep their FAKE_QUANT operators."""
    g = graph_of(model)
    sg = model.subgraphs[0]
    renamed = {}
    for op in g.ops:
        if op.type == "FakeQuantPerChannel":
            w = op.inputs[0]
            scales = list(g.tensors[op.inputs[1]].data) if len(op.inputs) > 1 else None
            set_constant(model, w, rounded(buffer_array(model, sg.tensors[w]), op.options["axis"],
                                           op.options["num_bits"], scales))
            renamed[op.outputs[0]] = w
    sg.operators = [o for o, op in zip(sg.operators, g.ops) if op.type != "FakeQuantPerChannel"]
    for o in sg.operators:
        o.inputs = [renamed.get(t, t) for t in int_list(o.inputs)]


# ---------------------------------------------------------------- int8 storage

def store_levels(model) -> Graph:
    """Declare the output of each fake quantization of 8 bits (FAKE_QUANT's
    activations, FakeQuantPerChannel's weights of fixed scales) int8 on its grid, but a model
    output (the loss and the metrics read it): the runtime then stores its
    levels, a byte each, its readers seeing the very float32 values (the plan
    counts one byte; graph.Tensor.fake_quant, schemas/quantization.md)."""
    g = graph_of(model)
    sg = model.subgraphs[0]
    for op in g.ops:
        t, options = op.outputs[0], op.options
        if t in g.outputs or options.get("num_bits") != 8 or options.get("narrow_range"):
            continue
        if op.type == "FAKE_QUANT":
            grid = scale_zero_point(options["min"], options["max"])
        elif op.type == "FakeQuantPerChannel" and len(op.inputs) > 1 and op.inputs[1] >= 0:
            # (tracked scales, no input, change every step: no grid to store on)
            scales = g.tensors[op.inputs[1]].data
            grid = scales, np.zeros(len(scales), np.int64), options["axis"]
        else:
            continue
        sg.tensors[t].type = circle.TensorType.INT8
        sg.tensors[t].quantization = circle_quantization(*grid)
    return graph_of(model)
