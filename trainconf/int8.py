"""Full-integer int8 export (`trainconf export --int8`): the float inference
model that export builds, written with int8 activations and weights as TFLite's
int8 quantization spec defines them, so that LiteRT, TFLite Micro and NPU
delegates run it.

- Activations: per tensor, asymmetric, x = s·(q − z) with q in [−128, 127],
  from a range [min, max] widened to hold 0 (s = (max − min)/255,
  z = −128 − round(min/s)), or a given (s, z).  Ranges come from calibration
  data run through the float model (min and max of each tensor over the whole
  set), else from the model's `microtrain.quantization` record
  (schemas/quantization.md).
- What the spec ties (trainconf.operators.INT8): a pool, RESHAPE, PAD or
  CONCATENATION has its inputs' scale, so each tied group of tensors gets one
  scale over the union of its ranges; SOFTMAX, LOGISTIC and TANH have fixed
  output scales.
- Weights of CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED: symmetric per output
  channel, zero point 0, q in [−127, 127], scale max|w|/127 of the trained fp32
  weights (or the record's scales); biases int32 with scale s_input·s_weight[c]
  (a weight's scale grows where its bias would not fit in int32).  Any other
  float constant an operator reads (an ADD's operand) is per-tensor asymmetric
  over its own range.  Values round half away from zero, as TFLite does.
- TFLite's FAKE_QUANT operators (quantization-aware training's rounding) go:
  the int8 model rounds by itself; their [min, max] is a range.
- Edges: int8 input and output tensors (the default: nothing float is left), or
  float ones behind QUANTIZE and DEQUANTIZE (the TFLite converter's
  inference_input_type/inference_output_type float32).
"""
import copy
from dataclasses import dataclass

import numpy as np

from microtrain.step import kernels
from microtrain.files.contracts import Quantization, TensorRange, WeightScales
from microtrain.data import load_array
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import add_operator_code, get_metadata, int_list
from microtrain.files.graph import Graph, concrete_shape, graph_of, symbolic_batch

from .operators import INT8
from .writer import set_constant

IO_TYPES = ("int8", "float")
DEFAULT_IO = "int8"
CALIBRATION_ROWS = 256  # samples the float model runs at once while calibrating
QMIN, QMAX = -128, 127
WEIGHT_MAX = 127  # symmetric weights leave out -128
INT32_MAX = 2 ** 31 - 1
WEIGHT, BIAS = 1, 2  # input positions of a weighted operator's weight and bias
EDGES = ("QUANTIZE", "DEQUANTIZE")  # what --io float adds, never in the float graph


@dataclass(frozen=True)
class QParams:
    scale: float
    zero_point: int


def from_range(lo: float, hi: float) -> QParams:
    """Asymmetric int8 parameters covering [lo, hi] widened to hold 0 (which
    then is exactly a step: zero padding and ReLU's floor stay exact)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi == lo:  # a tensor that is always 0: any scale holds it
        return QParams(1.0, QMIN)
    scale = (hi - lo) / (QMAX - QMIN)
    return QParams(scale, int(np.clip(round_away(QMIN - lo / scale), QMIN, QMAX)))


def round_away(x):
    """Round half away from zero (TFLite's rounding), not numpy's half to even."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def has_record(model) -> bool:
    return get_metadata(model, Quantization.NAME) is not None


def recorded(model, path) -> tuple[dict, dict]:
    """The model's record as (activation ranges, weight scales), tensor index ->
    QParams or (min, max), and tensor index -> per-channel scales."""
    record = Quantization.from_json(get_metadata(model, Quantization.NAME), path)
    n = len(model.subgraphs[0].tensors)
    for t in (*record.activations, *record.weights):
        if t >= n:
            raise UserError(path, f"{Quantization.NAME}: tensor {t} is not in the model "
                                  f"({n} tensors)")
    ranges = {t: (r.min, r.max) if r.scale is None else QParams(r.scale, r.zero_point)
              for t, r in record.activations.items()}
    return ranges, {t: np.float64(w.scale) for t, w in record.weights.items()}


def record(ranges: dict, weight_scales: dict | None = None) -> Quantization:
    """The `microtrain.quantization` record of `ranges` (frozen-graph tensor ->
    QParams or (min, max)) and `weight_scales` (weight tensor -> its scales), as a
    split that knows them stores it: set_metadata(model, Quantization.NAME,
    record(...).to_json())."""
    activations = {t: TensorRange(min=float(r[0]), max=float(r[1])) if isinstance(r, tuple)
                   else TensorRange(scale=float(r.scale), zero_point=int(r.zero_point))
                   for t, r in ranges.items()}
    weights = {t: WeightScales([float(s) for s in np.atleast_1d(scales)])
               for t, scales in (weight_scales or {}).items()}
    return Quantization(Quantization.VERSION, activations, weights)


def load_calibration(g: Graph, specs, path) -> list[np.ndarray]:
    """The calibration arrays, one per model input, checked against its shape."""
    if len(specs) != len(g.inputs):
        raise UserError(None, f"{len(specs)} --calibration files given; {path} has "
                              f"{len(g.inputs)} inputs")
    arrays = []
    for spec, t in zip(specs, g.inputs):
        tensor = g.tensors[t]
        x = load_array(spec, concrete_shape(tensor.shape, 1)[1:], np.float32)
        if x.ndim == 0 or not len(x) or x.shape[1:] != concrete_shape(tensor.shape, 1)[1:]:
            raise UserError(spec, f"holds samples of shape {list(x.shape[1:])}; input "
                                  f"'{tensor.name}' takes {list(tensor.shape[1:])}")
        arrays.append(np.asarray(x, np.float32))
    if len({len(x) for x in arrays}) > 1:
        raise UserError(None, "the --calibration files hold different numbers of samples")
    return arrays


def calibrate(model, inputs: list[np.ndarray]) -> dict[int, tuple[float, float]]:
    """(min, max) of every activation of the float model over the samples
    `inputs`, run a chunk at a time with microtrain's kernels."""
    g = graph_of(model)
    rows = CALIBRATION_ROWS if symbolic_batch(g) else 1
    acts = activations(g)
    lo = {t: np.inf for t in acts}
    hi = {t: -np.inf for t in acts}
    for start in range(0, len(inputs[0]), rows):
        values = {t.index: t.data for t in g.tensors if t.data is not None}
        values.update((t, x[start:start + rows]) for t, x in zip(g.inputs, inputs))
        batch = len(values[g.inputs[0]])
        for op in g.ops:
            outputs = [np.zeros(concrete_shape(g.tensors[t].shape, batch), g.tensors[t].dtype)
                       for t in op.outputs]
            kernels.build(op.type, [values[t] if t >= 0 else None for t in op.inputs],
                          outputs, **op.options)()
            values.update(zip(op.outputs, outputs))
        for t in acts:
            lo[t] = min(lo[t], float(values[t].min()))
            hi[t] = max(hi[t], float(values[t].max()))
    return {t: (lo[t], hi[t]) for t in acts}


def activations(g: Graph) -> list[int]:
    """The tensors computed at run time: the graph's inputs and the operators' outputs."""
    return list(dict.fromkeys([*g.inputs, *(t for op in g.ops for t in op.outputs)]))


def drop_fake_quant(model, ranges: dict) -> dict:
    """Remove TFLite's FAKE_QUANT operators (a quantization-aware split's rounding,
    which the int8 model does itself): their readers read their input, which gets
    the range recorded for their output, else their own [min, max].  Returns the
    ranges so amended."""
    g = graph_of(model)
    sg = model.subgraphs[0]
    ranges, renamed, kept = dict(ranges), {}, []
    for op, original in zip(g.ops, sg.operators):
        if op.type != "FAKE_QUANT":
            kept.append(original)
            continue
        x, y = renamed.get(op.inputs[0], op.inputs[0]), op.outputs[0]
        renamed[y] = x
        given = ranges.pop(y, None)
        ranges.setdefault(x, given or (op.options["min"], op.options["max"]))
    for op in kept:
        op.inputs = [renamed.get(t, t) for t in int_list(op.inputs)]
    sg.outputs = [renamed.get(t, t) for t in int_list(sg.outputs)]
    for sig in model.signatureDefs or ():
        for m in sig.outputs or ():
            m.tensorIndex = renamed.get(m.tensorIndex, m.tensorIndex)
    sg.operators = kept
    return ranges


def check_operators(g: Graph, path) -> None:
    computing = [name for name in INT8 if name not in EDGES]
    for op in g.ops:
        if op.type not in computing:
            raise UserError(path, f"operator {op.index} ({op.type}) has no int8 form: a "
                                  f"full-integer model holds only {', '.join(computing)}")
        if INT8[op.type].channels is not None and g.tensors[op.inputs[WEIGHT]].data is None:
            raise UserError(path, f"operator {op.index} ({op.type}) reads a computed weight: "
                                  "an int8 weight must be a constant")
    for t in activations(g):
        if g.tensors[t].dtype != np.float32:
            raise UserError(path, f"tensor {t} '{g.tensors[t].name}' is "
                                  f"{g.tensors[t].dtype}: only float activations become int8")


def activation_params(g: Graph, ranges: dict, path) -> dict[int, QParams]:
    """Each activation's int8 parameters: one per tied group (see the module's
    docstring), a fixed output's or a given one, else from the union of the
    group's ranges."""
    group = {t: t for t in activations(g)}

    def root(t):
        while group[t] != t:
            t = group[t]
        return t
    given = [(t, r) for t, r in ranges.items() if isinstance(r, QParams) and t in group]
    for op in g.ops:
        form = INT8[op.type]
        if form.output is not None:
            given.append((op.outputs[0], QParams(*form.output)))
        if form.same_scale:
            for t in op.inputs if op.type == "CONCATENATION" else op.inputs[:1]:
                group[root(t)] = root(op.outputs[0])
    members: dict[int, list[int]] = {}
    for t in group:
        members.setdefault(root(t), []).append(t)
    fixed: dict[int, list] = {}
    for t, p in given:
        fixed.setdefault(root(t), []).append((t, p))
    params = {}
    for r, tied in members.items():
        params.update(dict.fromkeys(tied, _group_params(g, tied, fixed.get(r, []), ranges, path)))
    return params


def _group_params(g: Graph, tied: list[int], fixed: list, ranges: dict, path) -> QParams:
    for (a, pa), (b, pb) in zip(fixed, fixed[1:]):
        if pa != pb:
            raise UserError(path, f"'{g.tensors[a].name}' is given int8 {pa} and "
                                  f"'{g.tensors[b].name}' {pb}, but TFLite's int8 spec gives "
                                  "them one scale and zero point")
    if fixed:
        return fixed[0][1]
    seen = [ranges[t] for t in tied if t in ranges]
    if not seen:
        raise UserError(path, f"tensor {tied[0]} '{g.tensors[tied[0]].name}' has no int8 range: "
                                  "give --calibration data")
    return from_range(min(lo for lo, _ in seen), max(hi for _, hi in seen))


def _quantization(scale, zero_point, axis: int = 0) -> "circle.QuantizationParametersT":
    q = circle.QuantizationParametersT()
    q.scale = [float(s) for s in np.atleast_1d(scale)]
    q.zeroPoint = [int(z) for z in np.atleast_1d(zero_point)]
    q.quantizedDimension = axis
    return q


def _constant(model, name: str, value: np.ndarray, scale, zero_point, axis: int = 0) -> int:
    """A new constant tensor of int8 or int32 `value` with its quantization."""
    sg = model.subgraphs[0]
    types = {np.dtype(np.int8): circle.TensorType.INT8, np.dtype(np.int32): circle.TensorType.INT32}
    sg.tensors.append(circle.TensorT(name=name, type=types[value.dtype]))
    set_constant(model, len(sg.tensors) - 1, value)
    sg.tensors[-1].quantization = _quantization(scale, zero_point, axis)
    return len(sg.tensors) - 1


def _weights(model, g: Graph, op, original, axis: int, s_in: float, scales: dict, path) -> None:
    """The op's weight as symmetric per-channel int8 and its bias as int32."""
    w_t = op.inputs[WEIGHT]
    b_t = op.inputs[BIAS] if len(op.inputs) > BIAS else -1
    w = g.tensors[w_t].data.astype(np.float64)
    channels = w.shape[axis]
    if w_t in scales:
        scale = scales[w_t]
        if len(scale) not in (1, channels):
            raise UserError(path, f"{Quantization.NAME}: weight {w_t} has {len(scale)} scales "
                                  f"for {channels} channels")
        scale = np.broadcast_to(scale, (channels,)).copy()
    else:
        scale = np.abs(w).max(axis=tuple(a for a in range(w.ndim) if a != axis)) / WEIGHT_MAX
        scale[scale == 0] = 1.0  # an all-zero channel: any scale holds it
    bias = None if b_t < 0 else g.tensors[b_t].data.astype(np.float64)
    if bias is not None:
        scale = np.maximum(scale, np.abs(bias) / (s_in * INT32_MAX))
    shape = [1] * w.ndim
    shape[axis] = channels
    q = np.clip(round_away(w / scale.reshape(shape)), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8)
    inputs = int_list(original.inputs)
    inputs[WEIGHT] = _constant(model, f"{g.tensors[w_t].name}/int8", q, scale,
                               np.zeros(channels, np.int64), axis)
    if bias is not None:
        inputs[BIAS] = _constant(model, f"{g.tensors[b_t].name}/int32",
                                 round_away(bias / (s_in * scale)).astype(np.int32),
                                 s_in * scale, np.zeros(channels, np.int64))
    original.inputs = inputs


def _other_constants(model, g: Graph, op, original) -> None:
    """Float constants an operator computes with (not a weight or bias): int8
    per tensor over their own range."""
    inputs = int_list(original.inputs)
    skip = (WEIGHT, BIAS) if INT8[op.type].channels is not None else ()
    for position, t in enumerate(op.inputs):
        c = g.tensors[t] if t >= 0 else None
        if position in skip or c is None or c.data is None or c.dtype != np.float32:
            continue
        p = from_range(c.data.min(), c.data.max())
        q = np.clip(round_away(c.data / p.scale) + p.zero_point, QMIN, QMAX).astype(np.int8)
        inputs[position] = _constant(model, f"{c.name}/int8", q, p.scale, p.zero_point)
    original.inputs = inputs


def quantize(model, ranges: dict, weight_scales: dict, io: str, path) -> None:
    """Rewrite the first subgraph of the float inference model `model` (in
    place) as a full-integer int8 model; `ranges`: activation tensor -> QParams
    or (min, max); `weight_scales`: weight tensor -> scales to use."""
    g = graph_of(model)
    check_operators(g, path)
    params = activation_params(g, ranges, path)
    sg = model.subgraphs[0]
    for op, original in zip(g.ops, sg.operators):
        form = INT8[op.type]
        if form.channels is not None:
            _weights(model, g, op, original, form.channels, params[op.inputs[0]].scale,
                     weight_scales, path)
        _other_constants(model, g, op, original)
        model.operatorCodes[original.opcodeIndex].version = form.version
    for t, p in params.items():
        sg.tensors[t].type = circle.TensorType.INT8
        sg.tensors[t].quantization = _quantization(p.scale, p.zero_point)
    if io == "float":
        _float_edges(model, g)


def _float_edges(model, g: Graph) -> None:
    """Float input and output tensors: each input is QUANTIZEd into an int8 copy
    the operators read; each output is DEQUANTIZEd from an int8 copy they
    write.  The float tensors keep their indices (and so the signatures)."""
    sg = model.subgraphs[0]
    ops = list(sg.operators)
    edges = {kind: [] for kind in EDGES}
    for kind, tensors in zip(EDGES, (g.inputs, g.outputs)):
        code = add_operator_code(model, kind, INT8[kind].version)
        for t in tensors:
            inner = copy.deepcopy(sg.tensors[t])
            inner.name = f"{sg.tensors[t].name}/int8"
            sg.tensors.append(inner)
            i = len(sg.tensors) - 1
            for op in ops:
                op.inputs = [i if x == t else x for x in int_list(op.inputs)]
                op.outputs = [i if x == t else x for x in int_list(op.outputs)]
            sg.tensors[t].type, sg.tensors[t].quantization = circle.TensorType.FLOAT32, None
            edges[kind].append(circle.OperatorT(opcodeIndex=code, inputs=[t] if kind == "QUANTIZE"
                                                else [i], outputs=[i] if kind == "QUANTIZE" else [t]))
    quantize, dequantize = edges.values()
    sg.operators = quantize + ops + dequantize


def to_int8(model, frozen, calibration, io: str) -> None:
    """Make `model` (export's float model of `frozen`, trained weights in place)
    full-integer: activation ranges from the `calibration` files when given, else
    the model's record."""
    if io not in IO_TYPES:
        raise UserError(None, f"unknown --io {io!r} (choose {' or '.join(IO_TYPES)})")
    ranges, scales = recorded(model, frozen) if has_record(model) else ({}, {})
    ranges = drop_fake_quant(model, ranges)
    check_operators(graph_of(model), frozen)
    if calibration:
        ranges = calibrate(model, load_calibration(graph_of(model), calibration, frozen))
    elif not ranges:
        raise UserError(frozen, "has no recorded int8 ranges (it was not split with --quantize "
                                "int8): give --calibration data")
    quantize(model, ranges, scales, io, frozen)
